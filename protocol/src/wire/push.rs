//! `POST /sync/push`: the sealed batch as received, and the outcome partition.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::ProtocolError;
use crate::ids::{CanonicalUuid, ServerVersion};
use crate::json::{self, Object, Value};
use crate::limits::{
    MAX_CANONICAL_PUSH_OCTETS, MAX_COLUMNS, MAX_MUTATION_OCTETS, MAX_MUTATIONS, MAX_SCOPE_ID_OCTETS,
};
use crate::manifest::SchemaRef;
use crate::members::{self, Members, ShapeError};
use crate::value::is_canonical_datetime;
use crate::wire::{PrimaryKey, RowImage, client_identity, parse_body, schema_ref};

/// A structurally valid push request.
#[derive(Clone, Debug, PartialEq)]
pub struct PushRequest {
    pub client_id: String,
    pub client_generation: u64,
    pub batch_id: CanonicalUuid,
    pub schema: SchemaRef,
    /// 1..=1000 mutations in request order, with unique IDs.
    pub mutations: Vec<Mutation>,
    /// `atomic: true` was present (`false` is not a valid encoding).
    pub atomic: bool,
}

/// Authored columns keyed by field ID (at most 256).
pub type Columns = BTreeMap<String, Value>;

/// The operation with exactly its legal members.
#[derive(Clone, Debug, PartialEq)]
pub enum Operation {
    /// `columns` may be empty.
    Insert {
        columns: Columns,
    },
    /// `columns` is nonempty.
    Update {
        base_version: ServerVersion,
        columns: Columns,
    },
    Delete {
        base_version: ServerVersion,
    },
}

impl Operation {
    /// The wire name.
    pub fn name(&self) -> &'static str {
        match self {
            Operation::Insert { .. } => "insert",
            Operation::Update { .. } => "update",
            Operation::Delete { .. } => "delete",
        }
    }

    /// The precondition version, absent for insert.
    pub fn base_version(&self) -> Option<&ServerVersion> {
        match self {
            Operation::Insert { .. } => None,
            Operation::Update { base_version, .. } | Operation::Delete { base_version } => {
                Some(base_version)
            }
        }
    }

    /// The authored columns, absent for delete.
    pub fn columns(&self) -> Option<&Columns> {
        match self {
            Operation::Insert { columns } | Operation::Update { columns, .. } => Some(columns),
            Operation::Delete { .. } => None,
        }
    }
}

/// One mutation of a batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Mutation {
    pub mutation_id: CanonicalUuid,
    pub table: String,
    pub pk: PrimaryKey,
    pub authored_schema: SchemaRef,
    pub op: Operation,
    /// RFC 3339 UTC diagnostic timestamp; never a precondition.
    pub client_version: String,
}

impl PushRequest {
    /// Parses a push body, enforcing every limit before any ledger work.
    pub fn parse(body: &[u8]) -> Result<PushRequest, ProtocolError> {
        PushRequest::from_value(parse_body(body)?)
    }

    /// Validates an already parsed body (see [`PushRequest::parse`]).
    pub fn from_value(v: Value) -> Result<PushRequest, ProtocolError> {
        if json::to_canonical(&v).len() > MAX_CANONICAL_PUSH_OCTETS {
            return Err(ProtocolError::invalid_request(
                "canonical request form exceeds 1048576 octets",
            ));
        }
        let mut m = Members::new(v, "push request")?;
        let (client_id, client_generation) = client_identity(&mut m)?;
        let batch_id = uuid(m.take("batch_id")?, "batch_id")?;
        let schema = schema_ref(&m.take("schema")?, "schema")?;
        let Value::Array(raw) = m.take("mutations")? else {
            return Err(ShapeError::member("mutations", "must be an array").into());
        };
        let atomic = match m.take_opt("atomic") {
            None => false,
            Some(Value::Bool(true)) => true,
            Some(_) => return Err(ShapeError::member("atomic", "must be true when present").into()),
        };
        m.finish()?;
        if !(1..=MAX_MUTATIONS).contains(&raw.len()) {
            return Err(ShapeError::member("mutations", "must hold 1..=1000 mutations").into());
        }
        let mut mutations = Vec::with_capacity(raw.len());
        let mut ids = BTreeSet::new();
        let mut keys = BTreeSet::new();
        for v in raw {
            if json::to_canonical(&v).len() > MAX_MUTATION_OCTETS {
                return Err(ProtocolError::invalid_request(
                    "a mutation exceeds 65536 canonical octets",
                ));
            }
            let mutation = Mutation::from_json(v)?;
            if !ids.insert(mutation.mutation_id) {
                return Err(ProtocolError::invalid_request(
                    "duplicate mutation_id in the batch",
                ));
            }
            let key = (
                mutation.table.clone(),
                mutation.pk.field_id.clone(),
                json::to_canonical(&mutation.pk.value),
            );
            if atomic && !keys.insert(key) {
                return Err(ProtocolError::invalid_request(
                    "an atomic batch names one row twice",
                ));
            }
            mutations.push(mutation);
        }
        Ok(PushRequest {
            client_id,
            client_generation,
            batch_id,
            schema,
            mutations,
            atomic,
        })
    }
}

fn uuid(v: Value, member: &'static str) -> Result<CanonicalUuid, ShapeError> {
    v.as_str()
        .and_then(CanonicalUuid::parse)
        .ok_or(ShapeError::member(
            member,
            "must be a canonical lowercase non-nil UUID",
        ))
}

fn base_version(v: Value) -> Result<ServerVersion, ShapeError> {
    v.as_str()
        .and_then(ServerVersion::parse)
        .ok_or(ShapeError::member(
            "base_version",
            "must be a server version token",
        ))
}

fn columns(v: Value) -> Result<Columns, ShapeError> {
    let cols = members::object(v, "columns")?;
    if cols.len() > MAX_COLUMNS {
        return Err(ShapeError::member("columns", "has more than 256 fields"));
    }
    if cols
        .keys()
        .any(|k| !(1..=MAX_SCOPE_ID_OCTETS).contains(&k.len()))
    {
        return Err(ShapeError::member("columns", "has an invalid field ID"));
    }
    Ok(cols)
}

fn primary_key(v: Value) -> Result<PrimaryKey, ShapeError> {
    let bad = || ShapeError::member("pk", "must hold exactly one string or int key value");
    let o = members::object(v, "pk")?;
    let mut members = o.into_iter();
    let (Some((field_id, value)), None) = (members.next(), members.next()) else {
        return Err(bad());
    };
    let key_shaped = match &value {
        Value::String(_) => true,
        Value::Number(n) => n.as_exact_i64().is_some_and(|i| i32::try_from(i).is_ok()),
        _ => false,
    };
    if !key_shaped || !(1..=MAX_SCOPE_ID_OCTETS).contains(&field_id.len()) {
        return Err(bad());
    }
    Ok(PrimaryKey { field_id, value })
}

impl Mutation {
    fn from_json(v: Value) -> Result<Mutation, ShapeError> {
        let mut m = Members::new(v, "mutation")?;
        let mutation_id = uuid(m.take("mutation_id")?, "mutation_id")?;
        let table = members::string(m.take("table")?, "table", 1, MAX_SCOPE_ID_OCTETS)?;
        let pk = primary_key(m.take("pk")?)?;
        let authored_schema = schema_ref(&m.take("authored_schema")?, "authored_schema")?;
        let client_version = members::string(m.take("client_version")?, "client_version", 1, 64)?;
        // The one datetime form (UTC, exactly microseconds), as the reference requires.
        if !is_canonical_datetime(&client_version) {
            return Err(ShapeError::member(
                "client_version",
                "must be a UTC timestamp with microseconds",
            ));
        }
        let op_name = m.take("op")?;
        let base = m.take_opt("base_version");
        let cols = m.take_opt("columns");
        m.finish()?;
        let op = match (op_name.as_str(), base, cols) {
            (Some("insert"), None, Some(c)) => Operation::Insert {
                columns: columns(c)?,
            },
            (Some("update"), Some(b), Some(c)) => {
                let columns = columns(c)?;
                if columns.is_empty() {
                    return Err(ShapeError::member(
                        "columns",
                        "must not be empty for update",
                    ));
                }
                Operation::Update {
                    base_version: base_version(b)?,
                    columns,
                }
            }
            (Some("delete"), Some(b), None) => Operation::Delete {
                base_version: base_version(b)?,
            },
            (Some("insert" | "update" | "delete"), _, _) => {
                return Err(ShapeError::member(
                    "op",
                    "has members its operation does not allow",
                ));
            }
            _ => return Err(ShapeError::member("op", "must be insert, update or delete")),
        };
        Ok(Mutation {
            mutation_id,
            table,
            pk,
            authored_schema,
            op,
            client_version,
        })
    }

    /// The mutation as the wire object it was received as (canonical member set).
    pub fn to_json(&self) -> Value {
        let mut o = Object::new();
        o.insert(
            "mutation_id".into(),
            Value::string(self.mutation_id.to_string()),
        );
        o.insert("table".into(), Value::string(&self.table));
        o.insert("pk".into(), self.pk.to_json());
        o.insert("authored_schema".into(), self.authored_schema.to_json());
        o.insert("op".into(), Value::string(self.op.name()));
        o.insert("client_version".into(), Value::string(&self.client_version));
        if let Some(b) = self.op.base_version() {
            o.insert("base_version".into(), Value::string(b.as_str()));
        }
        if let Some(c) = self.op.columns() {
            o.insert("columns".into(), Value::Object(c.clone()));
        }
        Value::Object(o)
    }
}

/// The identity every outcome echoes.
#[derive(Clone, Debug, PartialEq)]
pub struct OutcomeHead {
    pub mutation_id: CanonicalUuid,
    pub table: String,
    pub pk: PrimaryKey,
    pub outcome_schema: SchemaRef,
}

/// Conflict codes of the conflict matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConflictCode {
    VersionConflict,
    RowAlreadyExists,
    RowDeleted,
    RowNotFound,
}

impl ConflictCode {
    /// The wire code.
    pub fn as_str(self) -> &'static str {
        match self {
            ConflictCode::VersionConflict => "version_conflict",
            ConflictCode::RowAlreadyExists => "row_already_exists",
            ConflictCode::RowDeleted => "row_deleted",
            ConflictCode::RowNotFound => "row_not_found",
        }
    }

    fn message(self) -> &'static str {
        match self {
            ConflictCode::VersionConflict => "the base version does not match the current row",
            ConflictCode::RowAlreadyExists => "a row with this primary key already exists",
            ConflictCode::RowDeleted => "the row is deleted",
            ConflictCode::RowNotFound => "no row with this primary key exists",
        }
    }
}

/// The current authoritative state a conflict carries.
#[derive(Clone, Debug, PartialEq)]
pub enum ConflictState {
    /// A live row or source tombstone: row, checksum and version.
    Row {
        image: RowImage,
        server_version: ServerVersion,
    },
    /// A fence-only (hard) delete: version only.
    FenceOnly { server_version: ServerVersion },
    /// True absence: neither.
    Absent,
}

/// Terminal rejection codes other than `schema_incompatible`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TerminalCode {
    TableNotSynced,
    PolicyRejected,
    ValidationFailed,
    AtomicBatchRejected,
}

impl TerminalCode {
    /// The wire code.
    pub fn as_str(self) -> &'static str {
        match self {
            TerminalCode::TableNotSynced => "table_not_synced",
            TerminalCode::PolicyRejected => "policy_rejected",
            TerminalCode::ValidationFailed => "validation_failed",
            TerminalCode::AtomicBatchRejected => "atomic_batch_rejected",
        }
    }

    fn message(self) -> &'static str {
        match self {
            TerminalCode::TableNotSynced => "the table is not a synced table",
            TerminalCode::PolicyRejected => "the write policy denies the mutation",
            TerminalCode::ValidationFailed => "the mutation failed validation",
            TerminalCode::AtomicBatchRejected => "atomic batch rejected",
        }
    }
}

/// One mutation's terminal outcome.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// `applied`: the row after the push unit, absent after a fence-only delete.
    Applied {
        head: OutcomeHead,
        server_version: ServerVersion,
        row: Option<RowImage>,
    },
    /// `conflict` with its code and the current state.
    Conflict {
        head: OutcomeHead,
        code: ConflictCode,
        state: ConflictState,
    },
    /// `rejected_terminal` with a code other than `schema_incompatible`.
    Rejected {
        head: OutcomeHead,
        code: TerminalCode,
    },
    /// `rejected_terminal` / `schema_incompatible` with its required members.
    SchemaIncompatible {
        head: OutcomeHead,
        authored_schema: SchemaRef,
        current_schema: SchemaRef,
        /// Sorted by field-ID bytes, deduplicated.
        incompatible_field_ids: Vec<String>,
    },
}

impl Outcome {
    /// The echoed identity.
    pub fn head(&self) -> &OutcomeHead {
        match self {
            Outcome::Applied { head, .. }
            | Outcome::Conflict { head, .. }
            | Outcome::Rejected { head, .. }
            | Outcome::SchemaIncompatible { head, .. } => head,
        }
    }

    /// Whether the outcome belongs in `accepted`.
    pub fn is_accepted(&self) -> bool {
        matches!(self, Outcome::Applied { .. })
    }

    /// The wire code, absent for `applied`.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            Outcome::Applied { .. } => None,
            Outcome::Conflict { code, .. } => Some(code.as_str()),
            Outcome::Rejected { code, .. } => Some(code.as_str()),
            Outcome::SchemaIncompatible { .. } => Some("schema_incompatible"),
        }
    }

    /// The outcome object.
    pub fn to_json(&self) -> Value {
        let head = self.head();
        let mut o = Object::new();
        o.insert(
            "mutation_id".into(),
            Value::string(head.mutation_id.to_string()),
        );
        o.insert("table".into(), Value::string(&head.table));
        o.insert("pk".into(), head.pk.to_json());
        o.insert("outcome_schema".into(), head.outcome_schema.to_json());
        let put_row = |o: &mut Object, image: &RowImage| {
            o.insert("server_row".into(), image.row.clone());
            o.insert("row_checksum".into(), image.checksum.checksum_json());
        };
        match self {
            Outcome::Applied {
                server_version,
                row,
                ..
            } => {
                o.insert("status".into(), Value::string("applied"));
                if let Some(image) = row {
                    put_row(&mut o, image);
                }
                o.insert(
                    "server_version".into(),
                    Value::string(server_version.as_str()),
                );
            }
            Outcome::Conflict { code, state, .. } => {
                o.insert("status".into(), Value::string("conflict"));
                o.insert("code".into(), Value::string(code.as_str()));
                o.insert("message".into(), Value::string(code.message()));
                match state {
                    ConflictState::Row {
                        image,
                        server_version,
                    } => {
                        put_row(&mut o, image);
                        o.insert(
                            "server_version".into(),
                            Value::string(server_version.as_str()),
                        );
                    }
                    ConflictState::FenceOnly { server_version } => {
                        o.insert(
                            "server_version".into(),
                            Value::string(server_version.as_str()),
                        );
                    }
                    ConflictState::Absent => {}
                }
            }
            Outcome::Rejected { code, .. } => {
                o.insert("status".into(), Value::string("rejected_terminal"));
                o.insert("code".into(), Value::string(code.as_str()));
                o.insert("message".into(), Value::string(code.message()));
            }
            Outcome::SchemaIncompatible {
                authored_schema,
                current_schema,
                incompatible_field_ids,
                ..
            } => {
                let mut ids: Vec<&String> = incompatible_field_ids.iter().collect();
                ids.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
                ids.dedup();
                o.insert("status".into(), Value::string("rejected_terminal"));
                o.insert("code".into(), Value::string("schema_incompatible"));
                o.insert(
                    "message".into(),
                    Value::string("authored mutation cannot be represented by the current schema"),
                );
                o.insert("retryable".into(), Value::Bool(false));
                o.insert("authored_schema".into(), authored_schema.to_json());
                o.insert("current_schema".into(), current_schema.to_json());
                o.insert(
                    "incompatible_field_ids".into(),
                    Value::Array(ids.into_iter().map(|s| Value::string(s.clone())).collect()),
                );
            }
        }
        Value::Object(o)
    }
}

/// One outcome as a response holds it: evaluated now, or stored by the
/// ledger when the mutation completed in an earlier batch (its object is
/// then returned byte for byte, historical `outcome_schema` included).
#[derive(Clone, Debug, PartialEq)]
pub struct OutcomeEntry {
    mutation_id: CanonicalUuid,
    accepted: bool,
    code: Option<String>,
    object: Value,
}

impl OutcomeEntry {
    /// Reads back an outcome object that [`Outcome::to_json`] produced.
    pub fn from_stored(object: Value) -> Option<OutcomeEntry> {
        let o = object.as_object()?;
        let mutation_id = CanonicalUuid::parse(o.get("mutation_id")?.as_str()?)?;
        let accepted = match o.get("status")?.as_str()? {
            "applied" => true,
            "conflict" | "rejected_terminal" => false,
            _ => return None,
        };
        let code = match o.get("code") {
            None => None,
            Some(c) => Some(c.as_str()?.to_owned()),
        };
        if accepted == code.is_some() {
            return None;
        }
        Some(OutcomeEntry {
            mutation_id,
            accepted,
            code,
            object,
        })
    }

    /// The mutation this outcome answers.
    pub fn mutation_id(&self) -> CanonicalUuid {
        self.mutation_id
    }

    /// Whether it belongs in `accepted`.
    pub fn is_accepted(&self) -> bool {
        self.accepted
    }

    /// The wire code, absent for `applied`.
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }

    /// The outcome object.
    pub fn object(&self) -> &Value {
        &self.object
    }
}

impl From<&Outcome> for OutcomeEntry {
    fn from(o: &Outcome) -> OutcomeEntry {
        OutcomeEntry {
            mutation_id: o.head().mutation_id,
            accepted: o.is_accepted(),
            code: o.code().map(str::to_owned),
            object: o.to_json(),
        }
    }
}

/// A complete push response: every mutation exactly once, request order kept per array.
#[derive(Clone, Debug, PartialEq)]
pub struct PushResponse {
    batch_id: CanonicalUuid,
    server_time: String,
    outcomes: Vec<OutcomeEntry>,
}

/// Why a list of outcomes cannot form the response of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartitionError {
    /// Outcomes do not echo the request's mutations one to one, in order.
    NotOneToOne,
    /// `atomic_batch_rejected` in a non-atomic response.
    AtomicCodeOutsideAtomicBatch,
    /// An atomic response that is neither all-applied nor exactly one failure.
    NotAnAtomicForm,
}

impl PushResponse {
    /// Builds the response for `request` from one outcome per mutation, in request order.
    pub fn new(
        request: &PushRequest,
        server_time: String,
        outcomes: Vec<Outcome>,
    ) -> Result<PushResponse, PartitionError> {
        let entries = outcomes.iter().map(OutcomeEntry::from).collect();
        PushResponse::from_entries(request, server_time, entries)
    }

    /// Builds the response from fresh and stored outcomes, one per mutation, in request order.
    pub fn from_entries(
        request: &PushRequest,
        server_time: String,
        outcomes: Vec<OutcomeEntry>,
    ) -> Result<PushResponse, PartitionError> {
        let one_to_one = outcomes.len() == request.mutations.len()
            && outcomes
                .iter()
                .zip(&request.mutations)
                .all(|(o, m)| o.mutation_id == m.mutation_id);
        if !one_to_one {
            return Err(PartitionError::NotOneToOne);
        }
        let atomic_rejects = outcomes
            .iter()
            .filter(|o| o.code() == Some("atomic_batch_rejected"))
            .count();
        if request.atomic {
            let all_applied = outcomes.iter().all(OutcomeEntry::is_accepted);
            let none_applied = !outcomes.iter().any(OutcomeEntry::is_accepted);
            if !(all_applied || (none_applied && atomic_rejects + 1 == outcomes.len())) {
                return Err(PartitionError::NotAnAtomicForm);
            }
        } else if atomic_rejects > 0 {
            return Err(PartitionError::AtomicCodeOutsideAtomicBatch);
        }
        Ok(PushResponse {
            batch_id: request.batch_id,
            server_time,
            outcomes,
        })
    }

    /// The outcomes in request order.
    pub fn outcomes(&self) -> &[OutcomeEntry] {
        &self.outcomes
    }

    /// The response object.
    pub fn to_json(&self) -> Value {
        let (accepted, rejected): (Vec<_>, Vec<_>) =
            self.outcomes.iter().partition(|o| o.is_accepted());
        let objects =
            |v: Vec<&OutcomeEntry>| Value::Array(v.into_iter().map(|o| o.object.clone()).collect());
        json::object([
            ("batch_id", Value::string(self.batch_id.to_string())),
            ("server_time", Value::string(&self.server_time)),
            ("accepted", objects(accepted)),
            ("rejected", objects(rejected)),
        ])
    }

    /// The canonical response body (what the ledger stores and replays).
    pub fn to_body(&self) -> Vec<u8> {
        json::to_canonical(&self.to_json())
    }
}
