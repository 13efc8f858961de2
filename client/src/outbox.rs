//! The outbox's wire side: an authored write becomes a mutation object,
//! checked locally against the rules that would make the server refuse the
//! whole batch (so one bad write never blocks the queue); queued writes are
//! sealed into a batch body within the push limits; and a 200 push answer
//! becomes the settled outcome of every mutation of the batch.

use std::collections::BTreeSet;

use protocol::digest::{Digest, RowIdentity, row_digest};
use protocol::ids::{CanonicalUuid, ServerVersion};
use protocol::json::{self, Object, Value};
use protocol::limits::{MAX_BODY_OCTETS, MAX_COLUMNS, MAX_MUTATION_OCTETS, MAX_MUTATIONS};
use protocol::manifest::{Manifest, SchemaRef};
use protocol::value;

use crate::local::{QueuedWrite, SealedBatch, SettledOutcome};
use crate::page::{PageError, array, member, object, string};

/// What an authored write does.
#[derive(Clone, Debug, PartialEq)]
pub enum WriteOp {
    /// Creates the row; `columns` may be empty (the source supplies defaults).
    Insert { columns: Object },
    /// Patches the row at `base_version`; `columns` is nonempty.
    Update {
        base_version: String,
        columns: Object,
    },
    /// Deletes the row at `base_version`.
    Delete { base_version: String },
}

/// One write the application authors.
#[derive(Clone, Debug, PartialEq)]
pub struct Write {
    /// The logical table ID.
    pub table: String,
    /// The primary key's wire value.
    pub pk: Value,
    pub op: WriteOp,
    /// When the user made it (RFC 3339 UTC, microseconds): a diagnostic only.
    pub client_version: String,
}

/// Why a write cannot be queued.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InvalidWrite(pub String);

/// The mutation object of `write`, authored under `manifest`, checked for
/// every rule that makes a push `400 invalid_request`.
pub(crate) fn mutation(
    manifest: &Manifest,
    mutation_id: CanonicalUuid,
    write: &Write,
) -> Result<String, InvalidWrite> {
    let bad = |m: &str| Err(InvalidWrite(m.to_owned()));
    let Some(table) = manifest.table(&write.table) else {
        return bad("the table is not in the installed schema");
    };
    let key = table.primary_key();
    if value::decode(key.field_type(), &write.pk)
        .ok()
        .flatten()
        .is_none()
    {
        return bad("the primary key does not fit its type");
    }
    if !value::is_canonical_datetime(&write.client_version) {
        return bad("client_version is not an RFC 3339 UTC datetime with microseconds");
    }
    let mut o = Object::new();
    o.insert("mutation_id".into(), Value::string(mutation_id.to_string()));
    o.insert("table".into(), Value::string(write.table.clone()));
    o.insert(
        "pk".into(),
        json::object([(key.field_id(), write.pk.clone())]),
    );
    o.insert("authored_schema".into(), manifest.reference().to_json());
    o.insert(
        "client_version".into(),
        Value::string(write.client_version.clone()),
    );
    let (op, base, columns) = match &write.op {
        WriteOp::Insert { columns } => ("insert", None, Some(columns)),
        WriteOp::Update {
            base_version,
            columns,
        } => {
            if columns.is_empty() {
                return bad("an update patches at least one column");
            }
            ("update", Some(base_version), Some(columns))
        }
        WriteOp::Delete { base_version } => ("delete", Some(base_version), None),
    };
    o.insert("op".into(), Value::string(op));
    if let Some(b) = base {
        if ServerVersion::parse(b).is_none() {
            return bad("base_version is not a server version");
        }
        o.insert("base_version".into(), Value::string(b.clone()));
    }
    if let Some(columns) = columns {
        if columns.len() > MAX_COLUMNS {
            return bad("a mutation carries at most 256 columns");
        }
        o.insert("columns".into(), Value::Object(columns.clone()));
    }
    let text = json::to_canonical_string(&Value::Object(o));
    if text.len() > MAX_MUTATION_OCTETS {
        return bad("the mutation exceeds 65,536 octets");
    }
    Ok(text)
}

/// Seals the longest prefix of `queued` that fits one push (at most 1,000
/// mutations, at most 1,048,576 octets) into a batch of `batch_id`.
pub(crate) fn seal(
    client_id: &str,
    generation: u64,
    schema: &SchemaRef,
    batch_id: CanonicalUuid,
    queued: &[QueuedWrite],
) -> Result<SealedBatch, PageError> {
    let envelope = |mutations: Vec<Value>| {
        json::to_canonical(&json::object([
            ("client_id", Value::string(client_id)),
            ("client_generation", Value::int(generation as i64)),
            ("batch_id", Value::string(batch_id.to_string())),
            ("schema", schema.to_json()),
            ("mutations", Value::Array(mutations)),
        ]))
    };
    let mut size = envelope(Vec::new()).len();
    let mut taken = Vec::new();
    for w in queued.iter().take(MAX_MUTATIONS) {
        let grown = size + w.mutation.len() + usize::from(!taken.is_empty());
        if grown > MAX_BODY_OCTETS {
            break;
        }
        size = grown;
        taken.push(w);
    }
    let mutations = taken
        .iter()
        .map(|w| {
            json::parse(w.mutation.as_bytes())
                .map_err(|_| PageError::Invalid("a queued mutation is damaged".into()))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let body = envelope(mutations);
    debug_assert_eq!(body.len(), size, "the size estimate is the body's");
    Ok(SealedBatch {
        batch_id: batch_id.to_string(),
        body,
        mutation_ids: taken.iter().map(|w| w.mutation_id.clone()).collect(),
    })
}

/// Reads a 200 push answer to `batch`: every mutation exactly once, each
/// outcome's shape, and every echoed row verified where its
/// `outcome_schema` is the installed manifest. Sequence numbers come from `seq`.
pub(crate) fn settle(
    manifest: &Manifest,
    batch: &SealedBatch,
    body: &[u8],
    mut seq: impl FnMut() -> u64,
) -> Result<Vec<SettledOutcome>, PageError> {
    let invalid = |m: &str| PageError::Invalid(m.to_owned());
    let v = json::parse(body).map_err(|_| invalid("the push answer is not JSON"))?;
    let o = object(&v, "the push answer")?;
    if string(o, "batch_id")? != batch.batch_id {
        return Err(invalid("the push answer is another batch's"));
    }
    string(o, "server_time")?;
    let mut seen = BTreeSet::new();
    let mut outcomes = Vec::new();
    for (list, accepted) in [("accepted", true), ("rejected", false)] {
        for e in array(o, list)? {
            let e = object(e, "an outcome")?;
            let mutation_id = string(e, "mutation_id")?;
            if !batch.mutation_ids.iter().any(|m| m == mutation_id) || !seen.insert(mutation_id) {
                return Err(invalid("an outcome of no mutation of the batch, or twice"));
            }
            let status = string(e, "status")?;
            if (status == "applied") != accepted {
                return Err(invalid("an outcome in the wrong array"));
            }
            if !["applied", "conflict", "rejected_terminal"].contains(&status) {
                return Err(invalid("an unknown outcome status"));
            }
            let code = e.get("code").and_then(Value::as_str).map(str::to_owned);
            if (status == "applied") != code.is_none() {
                return Err(invalid("an outcome's code does not fit its status"));
            }
            let version = match e.get("server_version") {
                None => None,
                Some(v) => Some(
                    v.as_str()
                        .filter(|s| ServerVersion::parse(s).is_some())
                        .ok_or_else(|| invalid("a malformed server_version"))?
                        .to_owned(),
                ),
            };
            if status == "applied" && version.is_none() {
                return Err(invalid("an applied outcome without its version"));
            }
            let schema = SchemaRef::from_json(member(e, "outcome_schema")?)
                .ok_or_else(|| invalid("a malformed outcome_schema"))?;
            let verified = match (e.get("server_row"), &version) {
                (Some(row), Some(v)) if schema == manifest.reference() => {
                    echo_verifies(manifest, e, row, v)?
                }
                (Some(_), None) => return Err(invalid("an echoed row without its version")),
                _ => false,
            };
            outcomes.push(SettledOutcome {
                seq: seq(),
                mutation_id: mutation_id.to_owned(),
                table: string(e, "table")?.to_owned(),
                pk: json::to_canonical_string(member(e, "pk")?),
                status: status.to_owned(),
                code,
                version,
                verified,
                object: json::to_canonical_string(&Value::Object(e.clone())),
            });
        }
    }
    if seen.len() != batch.mutation_ids.len() {
        return Err(invalid("a mutation of the batch has no outcome"));
    }
    Ok(outcomes)
}

/// Whether an echoed `server_row` digests to its `row_checksum`. A
/// mismatch keeps the outcome (it is the server's answer) but marks it
/// unverified: the row is not trusted for reconciliation.
fn echo_verifies(
    manifest: &Manifest,
    e: &Object,
    row: &Value,
    version: &str,
) -> Result<bool, PageError> {
    let Some(table) = manifest.table(string(e, "table")?) else {
        return Ok(false);
    };
    let (Ok(decoded), Some(sent), Some(version)) = (
        table.decode_row(object(row, "server_row")?),
        e.get("row_checksum").and_then(Digest::from_checksum_json),
        ServerVersion::parse(version),
    ) else {
        return Ok(false);
    };
    let Some(key) = table.row_key(&decoded) else {
        return Ok(false);
    };
    let identity = RowIdentity::of(table, key);
    Ok(row_digest(&manifest.hash(), table, &identity, &decoded, &version) == sent)
}
