//! Terminal scope checksums, cached. A scope's digest at a boundary is a
//! function of (stream generation, schema, scope, the scope's last effect
//! at or before the boundary): the membership index and its row digests
//! change only in a materialization, and every change of a scope's members
//! (a row joining, leaving, changing, deleted) writes an effect in that
//! scope in the same transaction, except a baseline's, which no digest
//! is computed before (every scope it feeds answers `503` until it is
//! read, ADR 0033). So a steady pull of an unchanged scope
//! reads one index entry, not every row. Debug builds (every test and the
//! simulator) recompute each cache hit and assert it equal.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use protocol::digest::{Digest, ScopeDigest, row_digest};
use protocol::ids::ScopeId;
use protocol::manifest::Manifest;
use protocol::position::{Boundary, StreamPosition};

use crate::capture::Projection;
use crate::store::{StoreError, StoreTx};

/// What determines a scope's digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    stream_generation: u64,
    schema_hash: Digest,
    last_effect: Option<StreamPosition>,
}

/// Scopes kept at most; past this the cache starts over (it is only a cache).
const MAX_CACHED_SCOPES: usize = 100_000;

/// The latest digest computed for each scope.
#[derive(Default)]
pub struct ChecksumCache {
    scopes: Mutex<BTreeMap<ScopeId, (Key, Digest)>>,
}

impl ChecksumCache {
    /// The digest of each of `scopes` at `boundary`, read in the caller's
    /// snapshot: every scope's key in one read, then each digest cached
    /// or computed.
    pub async fn digests<T: StoreTx + Send>(
        &self,
        tx: &mut T,
        stream_generation: u64,
        current: &Manifest,
        scopes: &BTreeSet<ScopeId>,
        boundary: Boundary,
    ) -> Result<BTreeMap<ScopeId, Digest>, StoreError> {
        // Every effect at or before the boundary is before its transaction end.
        let end = match boundary {
            Boundary::GenerationStart => StreamPosition::GenerationStart,
            Boundary::TransactionEnd { commit_lsn } => {
                StreamPosition::TransactionEnd { commit_lsn }
            }
        };
        let ordered: Vec<&ScopeId> = scopes.iter().collect();
        let last = tx.last_effects_before(&ordered, end).await?;
        assert_eq!(last.len(), ordered.len(), "one key per scope");
        let mut sums = BTreeMap::new();
        for (scope, last_effect) in ordered.into_iter().zip(last) {
            let key = Key {
                stream_generation,
                schema_hash: current.hash(),
                last_effect,
            };
            sums.insert(scope.clone(), self.digest(tx, current, scope, key).await?);
        }
        Ok(sums)
    }

    /// The digest of `scope` under `key`: cached, or computed and cached.
    async fn digest<T: StoreTx>(
        &self,
        tx: &mut T,
        current: &Manifest,
        scope: &ScopeId,
        key: Key,
    ) -> Result<Digest, StoreError> {
        let cached = self
            .lock()
            .get(scope)
            .filter(|(k, _)| *k == key)
            .map(|(_, d)| *d);
        if let Some(d) = cached {
            #[cfg(debug_assertions)]
            assert_eq!(
                d,
                compute(tx, current, scope).await?,
                "a cached scope digest is the digest"
            );
            return Ok(d);
        }
        let d = compute(tx, current, scope).await?;
        let mut scopes = self.lock();
        if scopes.len() >= MAX_CACHED_SCOPES {
            scopes.clear();
        }
        scopes.insert(scope.clone(), (key, d));
        Ok(d)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<ScopeId, (Key, Digest)>> {
        // A poisoned cache is still a valid cache: entries are written whole.
        self.scopes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The scope digest over the membership index, in row-identity order,
/// under the current manifest: a member whose digest was computed under
/// another manifest is recomputed from its projection; one the current
/// manifest cannot represent is an integrity failure.
async fn compute<T: StoreTx>(
    tx: &mut T,
    current: &Manifest,
    scope: &ScopeId,
) -> Result<Digest, StoreError> {
    let mut members = tx.scope_members(scope).await?;
    if tx.has_stale_projections(current.schema_version()).await? {
        let mut fresh = BTreeMap::new();
        for p in tx
            .stale_scope_members(scope, current.schema_version())
            .await?
        {
            fresh.insert(p.identity.clone(), reproject(current, &p)?);
        }
        for (identity, digest) in &mut members {
            if let Some(d) = fresh.remove(identity) {
                *digest = d;
            }
        }
        if !fresh.is_empty() {
            return Err(StoreError::Integrity(
                "a stale member outside its scope".into(),
            ));
        }
    }
    digest_of(current, scope, &members)
}

/// The scope digest of `members` (in row-identity order) under `current`.
pub fn digest_of(
    current: &Manifest,
    scope: &ScopeId,
    members: &[(protocol::digest::RowIdentity, Digest)],
) -> Result<Digest, StoreError> {
    let schema_hash = current.hash();
    let mut d = ScopeDigest::new(&schema_hash, scope.as_str(), members.len() as u64);
    for (identity, row) in members {
        d.push(identity, row);
    }
    d.finish()
        .map_err(|e| StoreError::Integrity(format!("scope digest: {e:?}")))
}

/// A projection's row digest under the current manifest.
pub fn reproject(current: &Manifest, p: &Projection) -> Result<Digest, StoreError> {
    let bad = |what: &str| StoreError::Integrity(format!("a projection {what}"));
    let table = current
        .table(&p.table_id)
        .ok_or_else(|| bad("names a table the manifest lacks"))?;
    let object = p
        .row
        .as_object()
        .ok_or_else(|| bad("row is not an object"))?;
    let row = table
        .decode_row(object)
        .map_err(|_| bad("row does not fit the current manifest"))?;
    Ok(row_digest(
        &current.hash(),
        table,
        &p.identity,
        &row,
        &p.version,
    ))
}
