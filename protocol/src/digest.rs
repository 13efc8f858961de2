//! The row and scope integrity values: row identity, row digest and the
//! streaming scope digest (INTEGRITY.md "Row identity, row digest, scope
//! digest"). The 32-byte value and its checksum object are `sha256`'s.

use std::fmt;

use sha2::{Digest as _, Sha256};

use crate::ids::ServerVersion;
use crate::manifest::{Row, TableManifest};
pub use crate::sha256::Digest;
use crate::sha256::domain_hasher;
use crate::value::{TypedValue, blob, encode_field};

fn text(s: &str, out: &mut Vec<u8>) {
    blob(s.as_bytes(), out);
}

/// The typed, length-prefixed identity of one row; ordered by its bytes.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RowIdentity(Vec<u8>);

impl RowIdentity {
    /// `D("synchro:v3:row-identity:v1") || text(table_id) || text(pk_field_id) || typed(pk)`.
    pub fn new(table_id: &str, pk_field_id: &str, pk: &TypedValue) -> RowIdentity {
        let mut out = Vec::with_capacity(64);
        out.extend_from_slice(IDENTITY_DOMAIN);
        text(table_id, &mut out);
        text(pk_field_id, &mut out);
        pk.encode(&mut out);
        RowIdentity(out)
    }

    /// The identity of `pk` in `table`.
    pub fn of(table: &TableManifest, pk: &TypedValue) -> RowIdentity {
        RowIdentity::new(table.table_id(), table.primary_key_field_id(), pk)
    }

    /// The encoded bytes (the unit of ordering for scope digests and rebuild stages).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Wraps bytes previously taken from [`RowIdentity::as_bytes`].
    pub fn from_bytes(bytes: Vec<u8>) -> RowIdentity {
        RowIdentity(bytes)
    }

    /// Validates bytes from outside: the domain, two nonempty UTF-8 texts,
    /// one present key of a key type (string, int, int64), nothing after.
    pub fn parse(bytes: Vec<u8>) -> Option<RowIdentity> {
        let rest = bytes.strip_prefix(IDENTITY_DOMAIN)?;
        let (table_id, rest) = take_text(rest)?;
        let (field_id, rest) = take_text(rest)?;
        let (&[tag, presence], rest) = rest.split_first_chunk::<2>()?;
        let payload_ok = presence == 0x01
            && match tag {
                0x01 => take_text(rest).is_some_and(|(_, after)| after.is_empty()),
                0x02 => rest.len() == 4,
                0x03 => rest.len() == 8,
                _ => false,
            };
        (payload_ok && !table_id.is_empty() && !field_id.is_empty()).then_some(RowIdentity(bytes))
    }

    /// The primary-key field ID and value inside the identity, read back
    /// from its bytes (no row needed); `None` for bytes that are not one.
    pub fn key(&self) -> Option<(&str, TypedValue)> {
        let rest = self.0.strip_prefix(IDENTITY_DOMAIN)?;
        let (_, rest) = take_text(rest)?;
        let (field_id, rest) = take_text(rest)?;
        let (&[tag, 0x01], rest) = rest.split_first_chunk::<2>()? else {
            return None;
        };
        let value = match tag {
            0x01 => match take_text(rest)? {
                (s, []) => TypedValue::String(s.to_owned()),
                _ => return None,
            },
            0x02 => TypedValue::Int(i32::from_be_bytes(rest.try_into().ok()?)),
            0x03 => TypedValue::Int64(i64::from_be_bytes(rest.try_into().ok()?)),
            _ => return None,
        };
        Some((field_id, value))
    }
}

const IDENTITY_DOMAIN: &[u8] = b"synchro:v3:row-identity:v1\0";

/// Splits `blob(utf8)` off the front of `bytes`.
fn take_text(bytes: &[u8]) -> Option<(&str, &[u8])> {
    let (len, rest) = bytes.split_first_chunk::<8>()?;
    let len = usize::try_from(u64::from_be_bytes(*len)).ok()?;
    if rest.len() < len {
        return None;
    }
    let (s, rest) = rest.split_at(len);
    Some((std::str::from_utf8(s).ok()?, rest))
}

impl fmt::Debug for RowIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RowIdentity({} bytes)", self.0.len())
    }
}

/// Reusable buffers for computing many row digests without allocating.
#[derive(Default)]
pub struct RowDigester {
    body: Vec<u8>,
}

impl RowDigester {
    /// The row digest of `row` of `table` at `server_version` under schema `schema_hash`.
    ///
    /// The row must come from [`TableManifest::decode_row`] for the same table,
    /// and its primary-key value must equal the one inside `identity`.
    pub fn digest(
        &mut self,
        schema_hash: &Digest,
        table: &TableManifest,
        identity: &RowIdentity,
        row: &Row,
        server_version: &ServerVersion,
    ) -> Digest {
        // A caller contract, not input: rows exist only through `decode_row`,
        // so a mismatch means a row was paired with another table (a bug).
        assert_eq!(
            row.values.len(),
            table.fields().len(),
            "row must come from this table"
        );
        self.body.clear();
        self.body
            .extend_from_slice(&(table.fields().len() as u32).to_be_bytes());
        for (field, value) in table.fields().iter().zip(&row.values) {
            text(field.field_id(), &mut self.body);
            encode_field(field.field_type().ty, value.as_ref(), &mut self.body);
        }
        let mut h = domain_hasher("synchro:v3:row-digest:v1");
        h.update(schema_hash.0);
        h.update((identity.0.len() as u64).to_be_bytes());
        h.update(&identity.0);
        h.update((self.body.len() as u64).to_be_bytes());
        h.update(&self.body);
        h.update((server_version.as_str().len() as u64).to_be_bytes());
        h.update(server_version.as_str().as_bytes());
        Digest(h.finalize().into())
    }
}

/// The row digest with a fresh buffer; see [`RowDigester::digest`].
pub fn row_digest(
    schema_hash: &Digest,
    table: &TableManifest,
    identity: &RowIdentity,
    row: &Row,
    server_version: &ServerVersion,
) -> Digest {
    RowDigester::default().digest(schema_hash, table, identity, row, server_version)
}

/// Why a scope digest could not be finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScopeDigestError {
    /// Rows were not given in strictly increasing row-identity order.
    OutOfOrder,
    /// The number of rows differs from the declared cardinality.
    CardinalityMismatch { declared: u64, seen: u64 },
}

/// A streaming scope digest: rows must arrive in strictly increasing identity order.
pub struct ScopeDigest {
    hasher: Sha256,
    declared: u64,
    seen: u64,
    last: Option<RowIdentity>,
    error: Option<ScopeDigestError>,
}

impl ScopeDigest {
    /// Starts the digest of `scope_id` holding `cardinality` rows under `schema_hash`.
    pub fn new(schema_hash: &Digest, scope_id: &str, cardinality: u64) -> ScopeDigest {
        let mut hasher = domain_hasher("synchro:v3:scope-digest:v1");
        hasher.update(schema_hash.0);
        hasher.update((scope_id.len() as u64).to_be_bytes());
        hasher.update(scope_id.as_bytes());
        hasher.update(cardinality.to_be_bytes());
        ScopeDigest {
            hasher,
            declared: cardinality,
            seen: 0,
            last: None,
            error: None,
        }
    }

    /// Absorbs the next row; an out-of-order row poisons the digest.
    pub fn push(&mut self, identity: &RowIdentity, row_digest: &Digest) {
        if self.last.as_ref().is_some_and(|last| last >= identity) {
            self.error.get_or_insert(ScopeDigestError::OutOfOrder);
        }
        self.hasher.update((identity.0.len() as u64).to_be_bytes());
        self.hasher.update(&identity.0);
        self.hasher.update(row_digest.0);
        self.seen += 1;
        match &mut self.last {
            Some(last) => {
                last.0.clear();
                last.0.extend_from_slice(&identity.0);
            }
            None => self.last = Some(identity.clone()),
        }
    }

    /// The scope digest, if the rows were ordered and matched the cardinality.
    pub fn finish(self) -> Result<Digest, ScopeDigestError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if self.seen != self.declared {
            return Err(ScopeDigestError::CardinalityMismatch {
                declared: self.declared,
                seen: self.seen,
            });
        }
        Ok(Digest(self.hasher.finalize().into()))
    }
}

/// The scope digest of an unordered set of `(identity, row digest)` pairs;
/// a repeated identity is [`ScopeDigestError::OutOfOrder`].
pub fn scope_digest(
    schema_hash: &Digest,
    scope_id: &str,
    rows: &mut [(RowIdentity, Digest)],
) -> Result<Digest, ScopeDigestError> {
    rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let mut d = ScopeDigest::new(schema_hash, scope_id, rows.len() as u64);
    for (identity, digest) in rows.iter() {
        d.push(identity, digest);
    }
    d.finish()
}
