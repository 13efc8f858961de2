//! Capture: what the stores' change feeds deliver (committed source
//! transactions in commit order) and what the materializer makes durable
//! from them (projections, dependency rows, per-scope effects, progress).
//! The types here are the contract between the materializer and both stores.

pub mod source_text;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::time::Duration;

use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{ScopeId, ServerVersion};
use protocol::json::Value;
use protocol::position::{Boundary, StreamPosition};
use protocol::value::FieldType;

use crate::config::{MembershipRule, SyncConfig};
use crate::error::StoreError;

/// A WAL position (PostgreSQL LSN, or MemStore's log position).
pub type Lsn = u64;

/// One row image, column name -> PostgreSQL text form (`None` is SQL NULL).
/// A column missing from an image was not sent (an unchanged TOASTed value).
pub type SourceImage = BTreeMap<String, Option<String>>;

/// The kind of a source row change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    Insert,
    Update,
    Delete,
}

/// One decoded row change; its `event_ordinal` is its index in
/// [`SourceTransaction::events`], assigned before anything is filtered.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceEvent {
    /// The schema-qualified relation.
    pub relation: String,
    pub kind: ChangeKind,
    /// The replica-identity key columns of the row (old key for a delete or a key change).
    pub identity: SourceImage,
    /// The new image of an insert or update.
    pub new: Option<SourceImage>,
}

/// What the version trigger recorded for one change of a registered row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionNote {
    pub table_id: String,
    /// The primary key in text form.
    pub key: String,
    /// The opaque version the change created.
    pub version: String,
    /// The fence the change allocated.
    pub fence: u64,
    /// A client's push wrote the change, so its fence is pending until
    /// capture satisfies it.
    pub client: bool,
}

impl VersionNote {
    /// The bytes the trigger writes: `table_id \t fence \t version \t key`,
    /// the fence marked `c` for a client's write and `a` for the application's.
    pub fn encode(&self) -> Vec<u8> {
        let writer = if self.client { 'c' } else { 'a' };
        format!(
            "{}\t{writer}{}\t{}\t{}",
            self.table_id, self.fence, self.version, self.key
        )
        .into_bytes()
    }

    /// Parses [`VersionNote::encode`]'s bytes. An unmarked fence was written
    /// by the trigger before migration 0017: it may be a client's.
    pub fn decode(bytes: &[u8]) -> Option<VersionNote> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut parts = text.splitn(4, '\t');
        let table_id = parts.next()?.to_owned();
        let fence = parts.next()?;
        let (client, fence) = match fence.as_bytes().first()? {
            b'c' => (true, &fence[1..]),
            b'a' => (false, &fence[1..]),
            _ => (true, fence),
        };
        Some(VersionNote {
            table_id,
            fence: fence.parse().ok()?,
            client,
            version: parts.next()?.to_owned(),
            key: parts.next()?.to_owned(),
        })
    }
}

/// Why capture cannot go on. Bounded classes; never row data.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum CaptureProblem {
    /// WAL bytes that are not a valid pgoutput message.
    Undecodable,
    /// TRUNCATE of a captured relation.
    Truncate,
    /// A captured relation was renamed, moved, recreated or changed its key or replica identity.
    RelationDrift,
    /// A registered row change without its version note, or a note without a change.
    VersionNoteMismatch,
    /// A captured value that is not valid for its field.
    InvalidValue,
    /// A rule rendered a scope ID that is not a valid scope ID.
    InvalidScopeId,
    /// An update without the previous projection that its unsent columns need.
    MissingProjection,
    /// A capture trigger on a registered table is missing or disabled.
    CaptureDisabled,
    /// The replication slot is missing, invalidated, or another slot under
    /// its name: the stream cannot continue where it stopped, and only a
    /// stream reset recovers (ADR 0010).
    SlotLost,
    /// A column that a field maps to was dropped or renamed under the
    /// running server (ADR 0020): restore it, or change the config.
    ColumnMissing,
    /// A column that a field maps to was retyped under the running server
    /// to a type that does not hold the field's values (ADR 0020): change
    /// the config to follow it.
    ColumnRetyped,
}

impl CaptureProblem {
    /// The stable class name stored in the quarantine record and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            CaptureProblem::Undecodable => "undecodable",
            CaptureProblem::Truncate => "truncate",
            CaptureProblem::RelationDrift => "relation_drift",
            CaptureProblem::VersionNoteMismatch => "version_note_mismatch",
            CaptureProblem::InvalidValue => "invalid_value",
            CaptureProblem::InvalidScopeId => "invalid_scope_id",
            CaptureProblem::MissingProjection => "missing_projection",
            CaptureProblem::CaptureDisabled => "capture_disabled",
            CaptureProblem::SlotLost => "slot_lost",
            CaptureProblem::ColumnMissing => "column_missing",
            CaptureProblem::ColumnRetyped => "column_retyped",
        }
    }

    /// The inverse of [`CaptureProblem::as_str`].
    pub fn parse(s: &str) -> Option<CaptureProblem> {
        [
            CaptureProblem::Undecodable,
            CaptureProblem::Truncate,
            CaptureProblem::RelationDrift,
            CaptureProblem::VersionNoteMismatch,
            CaptureProblem::InvalidValue,
            CaptureProblem::InvalidScopeId,
            CaptureProblem::MissingProjection,
            CaptureProblem::CaptureDisabled,
            CaptureProblem::SlotLost,
            CaptureProblem::ColumnMissing,
            CaptureProblem::ColumnRetyped,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
    }
}

impl fmt::Display for CaptureProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One committed source transaction, as a change feed delivers it.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceTransaction {
    pub commit_lsn: Lsn,
    /// Where the slot may be acknowledged once this transaction is durable.
    pub end_lsn: Lsn,
    /// Row changes in decoded order.
    pub events: Vec<SourceEvent>,
    /// Version notes in decoded order.
    pub notes: Vec<VersionNote>,
    /// Set by the feed when the transaction cannot be read as a whole.
    pub problem: Option<CaptureProblem>,
    /// The watermark a re-read chunk's source transaction wrote (ADR 0020).
    pub watermark: Option<String>,
    /// The events are rows re-read under the current model, not changes:
    /// only what differs from the stored state becomes an effect.
    pub reread: bool,
}

impl SourceTransaction {
    /// A transaction at these positions with nothing in it yet.
    pub fn empty(commit_lsn: Lsn, end_lsn: Lsn) -> SourceTransaction {
        SourceTransaction {
            commit_lsn,
            end_lsn,
            events: Vec::new(),
            notes: Vec::new(),
            problem: None,
            watermark: None,
            reread: false,
        }
    }
}

/// A captured relation's rematerialization record (ADR 0020): the capture
/// model its materialized state was made under, and the re-reading owed
/// since that model changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rematerialization {
    pub relation: String,
    /// What the relation's projections or dependency rows are made under
    /// ([`model_fingerprints`]).
    pub fingerprint: String,
    /// Rows of the relation may still be in an older model: re-reading owed.
    pub pending: bool,
    /// The identity columns of the last row re-read (`None`: from the start).
    pub after: Option<SourceImage>,
    /// Rows re-read so far.
    pub rows: u64,
}

/// One chunk the materializer asks a feed to re-read: the rows of
/// `relation` after `after` in identity order, read with their row locks
/// held until `watermark` is committed in the same source transaction, so
/// the chunk is exactly the rows' state at the watermark's position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RereadRequest {
    pub relation: String,
    /// `(table_id, primary key column)` of a registered table; `None` for a dependency relation.
    pub registered: Option<(String, String)>,
    pub after: Option<SourceImage>,
    pub limit: usize,
    pub watermark: String,
}

/// The rows one re-read chunk found, as update events with version notes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RereadChunk {
    pub events: Vec<SourceEvent>,
    pub notes: Vec<VersionNote>,
    /// The relation's size as the store estimates it when the chunk was
    /// read (PostgreSQL's planner statistics), for the operator's progress
    /// report only; `None` when the store has no estimate.
    pub estimated_rows: Option<u64>,
}

/// Canonical JSON of an image (a dependency row's key, a re-read cursor).
pub fn image_json(image: &SourceImage) -> String {
    let members = image.iter().map(|(c, v)| {
        (
            c.clone(),
            v.as_ref().map_or(Value::Null, |s| Value::string(s.clone())),
        )
    });
    protocol::json::to_canonical_string(&Value::Object(members.collect()))
}

/// The inverse of [`image_json`].
pub fn image_from_json(text: &str) -> Option<SourceImage> {
    let v = protocol::json::parse(text.as_bytes()).ok()?;
    v.as_object()?
        .iter()
        .map(|(c, v)| match v {
            Value::Null => Some((c.clone(), None)),
            Value::String(s) => Some((c.clone(), Some(s.clone()))),
            _ => None,
        })
        .collect()
}

/// The capture model of each captured relation, as text that changes
/// exactly when what capture makes of the relation's rows could: for a
/// registered table its relation, key, field columns and types, lifecycle
/// and scope rules; for a dependency relation that it is one.
pub fn model_fingerprints(config: &SyncConfig) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for t in &config.tables {
        let text = |s: &str| Value::string(s);
        let fields = t.fields.iter().map(|f| {
            Value::Array(vec![
                text(&f.field_id),
                text(&f.column),
                text(&f.portable_type),
                Value::Bool(f.nullable),
                text(&format!("{:?}/{:?}", f.precision, f.scale)),
            ])
        });
        let rules = crate::stream::rules_fingerprint(&t.scopes);
        let v = protocol::json::object([
            ("table_id", text(&t.table_id)),
            ("primary_key", text(&t.primary_key)),
            (
                "deleted_at",
                t.lifecycle.deleted_at.as_deref().map_or(Value::Null, text),
            ),
            ("fields", Value::Array(fields.collect())),
            ("rules", text(&rules)),
        ]);
        out.insert(t.relation.clone(), protocol::json::to_canonical_string(&v));
    }
    for relation in CapturePlan::new(config).dependencies.keys() {
        out.entry(relation.clone())
            .or_insert_with(|| "{\"dependency\":true}".to_owned());
    }
    out
}

/// What a feed owes before its stream: the captured rows that existed when
/// the stream's slot was created, read under the slot's own snapshot (ADR 0011).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Baseline {
    /// Rows in the baseline, over every captured relation.
    pub rows: u64,
    /// Fences of client writes that the snapshot already holds: the
    /// baseline satisfies them, as materializing their transactions would.
    pub covered_fences: Vec<u64>,
}

/// At most this many rows in one baseline chunk.
pub const BASELINE_CHUNK_ROWS: usize = 1024;

/// The chunks a baseline of `rows` rows is read in.
pub fn baseline_chunks(rows: u64) -> u64 {
    rows.div_ceil(BASELINE_CHUNK_ROWS as u64)
}

/// The commit and end positions of chunk `index` of `chunks`, just below
/// `consistent` (where the slot's stream begins): in order, each chunk's
/// end before the next one's commit, and all before the stream's first
/// transaction. `None` when they do not fit below it.
pub fn baseline_position(consistent: Lsn, chunks: u64, index: u64) -> Option<(Lsn, Lsn)> {
    assert!(index < chunks, "a chunk of the baseline");
    let commit = consistent.checked_sub(2 * (chunks - index))?;
    (commit > 0).then_some((commit, commit + 1))
}

/// Committed source transactions in commit order, at least once.
pub trait ChangeFeed: Send {
    /// The baseline this feed delivers before its first transaction, if
    /// one is owed and none of it committed (the stream is new, or was
    /// reset). A feed that finds a baseline with a chunk committed keeps
    /// its slot and owes none: the materializer hands it over (ADR 0030).
    fn baseline(&self) -> Option<&Baseline>;
    /// Stops reading the baseline, with chunks of it unread: its snapshot
    /// is released, and the stream begins at the slot's consistent point
    /// (the materializer hands the rest over to re-reads, ADR 0030).
    fn end_baseline(&mut self) -> impl Future<Output = ()> + Send;
    /// The baseline's next chunk: inserts of existing rows (dependency
    /// relations first) with their version notes, at positions below the
    /// stream's first transaction, at most [`BASELINE_CHUNK_ROWS`] rows;
    /// `None` once every row was read.
    fn baseline_chunk(
        &mut self,
    ) -> impl Future<Output = Result<Option<SourceTransaction>, StoreError>> + Send;
    /// The next transaction, or `None` if none completes within `wait`. A
    /// transaction partly received when `wait` ends is kept for the next
    /// call: no transaction is ever skipped.
    fn next(
        &mut self,
        wait: Duration,
    ) -> impl Future<Output = Result<Option<SourceTransaction>, StoreError>> + Send;

    /// Re-reads one chunk of a relation and commits its watermark in the
    /// same source transaction, the rows locked until then (ADR 0020).
    /// The watermark arrives later through [`ChangeFeed::next`].
    fn reread(
        &mut self,
        req: &RereadRequest,
    ) -> impl Future<Output = Result<RereadChunk, StoreError>> + Send;

    /// The newest source WAL position the feed knows of (for lag in bytes).
    fn source_end(&self) -> Lsn;

    /// After [`ChangeFeed::next`] found nothing, with no transaction partly
    /// received: a WAL position through which every source transaction was
    /// delivered. The WAL after the last one (capture's own writes among
    /// it) then holds none, and acknowledging this lets the store forget it
    /// while idle (issue 25). `None` otherwise.
    fn idle_end(&self) -> Option<Lsn>;

    /// Everything through `end_lsn` is durable: the store may forget it.
    fn acknowledge(&mut self, end_lsn: Lsn) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Acknowledges an [`ChangeFeed::idle_end`]: past everything
    /// materialized, so recorded first where the store judges whether its
    /// slot's confirmed position is capture's own.
    fn acknowledge_idle(
        &mut self,
        end_lsn: Lsn,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// A registered table as capture sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapturedTable {
    pub table_id: String,
    pub relation: String,
    pub primary_key: String,
    /// The columns its fields map to.
    pub columns: Vec<String>,
    /// The type each of those columns must keep to hold its field's values
    /// (a column retyped away from it blocks capture).
    pub types: BTreeMap<String, FieldType>,
}

/// What a store installs for capture: version triggers on registered tables,
/// and a feed over registered tables and the dependency relations of rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapturePlan {
    pub tables: Vec<CapturedTable>,
    /// Dependency relations with the columns the rules read from them.
    pub dependencies: BTreeMap<String, BTreeSet<String>>,
    /// `(relation, column)` of each dependency relation's column that a
    /// rule joins on: the materializer looks its rows up by it.
    pub dependency_keys: BTreeSet<(String, String)>,
}

impl CapturePlan {
    /// The plan for a validated config.
    pub fn new(config: &SyncConfig) -> CapturePlan {
        let mut dependencies: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut dependency_keys = BTreeSet::new();
        for t in &config.tables {
            for rule in &t.scopes {
                if let MembershipRule::Dependency {
                    via, key, template, ..
                } = rule
                {
                    let columns = dependencies.entry(via.clone()).or_default();
                    columns.insert(key.clone());
                    dependency_keys.insert((via.clone(), key.clone()));
                    if let Ok(t) = crate::config::ScopeTemplate::parse(template) {
                        columns.extend(t.placeholders().map(str::to_owned));
                    }
                }
            }
        }
        CapturePlan {
            tables: config
                .tables
                .iter()
                .map(|t| CapturedTable {
                    table_id: t.table_id.clone(),
                    relation: t.relation.clone(),
                    primary_key: t.primary_key.clone(),
                    columns: t.fields.iter().map(|f| f.column.clone()).collect(),
                    types: t
                        .fields
                        .iter()
                        .filter_map(|f| Some((f.column.clone(), f.field_type().ok()?)))
                        .collect(),
                })
                .collect(),
            dependencies,
            dependency_keys,
        }
    }

    /// Every captured relation: registered tables, then dependency relations.
    pub fn relations(&self) -> impl Iterator<Item = &str> {
        self.tables
            .iter()
            .map(|t| t.relation.as_str())
            .chain(self.dependencies.keys().map(String::as_str))
    }
}

/// The captured state of one registered row.
#[derive(Clone, Debug, PartialEq)]
pub struct Projection {
    pub table_id: String,
    pub identity: RowIdentity,
    /// The primary key in text form.
    pub key: String,
    /// The complete synced row (wire object keyed by field ID).
    pub row: Value,
    pub version: ServerVersion,
    /// The row digest under `schema_version`'s manifest.
    pub digest: Digest,
    pub schema_version: u64,
    /// The lifecycle `deleted_at` field is set: a source tombstone.
    pub tombstone: bool,
    /// The scopes the row belongs to.
    pub scopes: BTreeSet<ScopeId>,
}

/// A row of a dependency relation, keyed by its replica identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DependencyRow {
    pub relation: String,
    /// Canonical JSON of the identity columns.
    pub identity: String,
    pub image: SourceImage,
}

/// The row an effect carries: the captured row, its version and digest.
#[derive(Clone, Debug, PartialEq)]
pub struct CapturedRow {
    /// Canonical JSON of the wire row object.
    pub row: String,
    pub version: ServerVersion,
    pub digest: Digest,
    /// The manifest `digest` was computed under; `None` for effects stored
    /// before it was recorded (pull then recomputes).
    pub schema_version: Option<u64>,
}

/// What a scope's client must do for one row.
#[derive(Clone, Debug, PartialEq)]
pub enum EffectOp {
    /// The row is live in the scope.
    Upsert(CapturedRow),
    /// The row is a source tombstone (soft-deleted): a delete carrying it.
    Tombstone(CapturedRow),
    /// The row left the scope, or was hard-deleted: a delete without a row,
    /// at the version the row had then (after a hard delete, its deletion
    /// fence's). Every delete of the wire carries a `server_version`.
    Remove(ServerVersion),
}

impl EffectOp {
    /// The captured row, for an upsert or a tombstone.
    pub fn row(&self) -> Option<&CapturedRow> {
        match self {
            EffectOp::Upsert(r) | EffectOp::Tombstone(r) => Some(r),
            EffectOp::Remove(_) => None,
        }
    }

    /// The row's version at the effect.
    pub fn version(&self) -> &ServerVersion {
        match self {
            EffectOp::Upsert(r) | EffectOp::Tombstone(r) => &r.version,
            EffectOp::Remove(v) => v,
        }
    }
}

/// One per-scope effect at its delivery position.
#[derive(Clone, Debug, PartialEq)]
pub struct Effect {
    pub scope: ScopeId,
    pub commit_lsn: Lsn,
    pub event_ordinal: u64,
    /// Orders effects of one event within one scope (by row identity bytes).
    pub effect_ordinal: u64,
    pub table_id: String,
    pub identity: RowIdentity,
    /// The typed primary key as its wire value.
    pub key: Value,
    pub op: EffectOp,
}

impl Effect {
    /// The delivery position.
    pub fn position(&self) -> StreamPosition {
        StreamPosition::Effect {
            commit_lsn: self.commit_lsn,
            event_ordinal: self.event_ordinal,
            effect_ordinal: self.effect_ordinal,
        }
    }
}

/// The identity of one materialized source transaction: its events are
/// `(commit_lsn, 0..row_events)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaterializedTransaction {
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub row_events: u64,
}

/// Everything one or more consecutive source transactions make durable,
/// written atomically.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Materialization {
    /// The last transaction's commit LSN: progress moves to its `transaction_end`.
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    /// Every source transaction included, in commit order.
    pub transactions: Vec<MaterializedTransaction>,
    /// Projections of rows that had none before: inserted.
    pub new_projections: Vec<Projection>,
    /// Projections of rows that had one before: replaced.
    pub put_projections: Vec<Projection>,
    /// (table_id, identity) of hard-deleted rows that had a projection.
    pub removed_projections: Vec<(String, RowIdentity)>,
    pub put_dependencies: Vec<DependencyRow>,
    /// (relation, identity) of removed dependency rows.
    pub removed_dependencies: Vec<(String, String)>,
    /// The membership index's changes over the whole group: rows that
    /// joined a scope they were not in before it, and rows that left one.
    pub joined: Vec<Membership>,
    pub left: Vec<Membership>,
    pub effects: Vec<Effect>,
    /// Fences of client writes this transaction satisfies. A store
    /// records each one satisfied whether or not the write's pending fence
    /// is visible to it yet (ADR 0014).
    pub fences: Vec<u64>,
    /// The stream generation the materializer read its progress in: a
    /// store refuses the write once a reset began another one.
    pub stream_generation: u64,
    /// Rematerialization records a re-read chunk in the group moved.
    pub rematerialized: Vec<Rematerialization>,
    /// A chunk of the baseline: rows never materialized before, which
    /// reach clients by rebuild, so it carries no effects (ADR 0033).
    pub baseline: bool,
}

impl Materialization {
    /// Whether its parts agree: transactions in strictly increasing commit
    /// order, progress at the last one's commit, no effect past it, and a
    /// baseline chunk without effects. Both stores refuse anything else
    /// before any write.
    pub fn check_whole(&self) -> Result<(), StoreError> {
        let refuse = |what: &str| Err(StoreError::Integrity(what.into()));
        if self.baseline && !self.effects.is_empty() {
            return refuse("a baseline chunk carries effects");
        }
        if !self
            .transactions
            .windows(2)
            .all(|w| w[0].commit_lsn < w[1].commit_lsn)
        {
            return refuse("a group's transactions out of commit order");
        }
        if self
            .transactions
            .last()
            .is_some_and(|t| t.commit_lsn != self.commit_lsn)
        {
            return refuse("a group's progress is not its last transaction's");
        }
        if !self.effects.iter().all(|e| e.commit_lsn <= self.commit_lsn) {
            return refuse("an effect past its group's progress");
        }
        Ok(())
    }
}

/// One row in one scope: an entry of the membership index.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Membership {
    pub scope: ScopeId,
    pub table_id: String,
    pub identity: RowIdentity,
}

/// A heartbeat of the capture leader, written to the store so that every
/// process on the database can judge capture, not only the leader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// Nothing was waiting in the feed.
    pub caught_up: bool,
    /// Source WAL the leader knew of and had not yet materialized.
    pub lag_bytes: u64,
}

/// Capture as any process reads it from the shared heartbeat; ages are
/// measured by the store's own clock, so processes need no common clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaptureHealth {
    /// Since the leader's last heartbeat; `None` before the first.
    pub heartbeat_age: Option<Duration>,
    /// Since the leader last found nothing waiting; `None` before that.
    pub caught_up_age: Option<Duration>,
    /// The lag the last heartbeat reported.
    pub lag_bytes: u64,
    /// A quarantined transaction, or a baseline still owed, blocks capture.
    pub blocked: bool,
}

/// When capture counts as keeping up (the `[capture]` readiness limits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadinessLimits {
    pub max_heartbeat_age: Duration,
    pub max_lag: Duration,
    pub max_lag_bytes: u64,
}

impl CaptureHealth {
    /// Not blocked, a heartbeat within `max_heartbeat_age`, caught up
    /// within `max_lag`, and at most `max_lag_bytes` behind.
    pub fn is_ready(&self, limits: &ReadinessLimits) -> bool {
        !self.blocked
            && self
                .heartbeat_age
                .is_some_and(|a| a <= limits.max_heartbeat_age)
            && self.caught_up_age.is_some_and(|a| a <= limits.max_lag)
            && self.lag_bytes <= limits.max_lag_bytes
    }
}

/// The durable materialization progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureProgress {
    /// Everything through this boundary is materialized.
    pub boundary: Boundary,
    /// The end LSN of the last materialized transaction (0 before any).
    pub end_lsn: Lsn,
    /// The transaction that blocks capture, if any.
    pub quarantine: Option<Quarantine>,
    /// The stream's baseline is not materialized yet (a new stream, or one
    /// an operator reset): nothing is pull-visible until it is.
    pub baseline_owed: bool,
    /// Relations whose rows are not all rematerialized under the current
    /// model yet (ADR 0020): the scopes they feed are not served.
    pub rematerializing: BTreeSet<String>,
    /// The newest stored manifest's version: a process running an older
    /// config serves no page (ADR 0020).
    pub newest_schema_version: u64,
}

/// A transaction that could not be materialized, or a broken installation;
/// either blocks capture.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quarantine {
    /// The blocked transaction's commit LSN; for a broken installation
    /// found in the catalog, the end of durable progress.
    pub commit_lsn: Lsn,
    pub problem: CaptureProblem,
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{CaptureHealth, ReadinessLimits};

    #[test]
    fn readiness_follows_heartbeat_and_lag_limits() {
        let secs = Duration::from_secs;
        let limits = ReadinessLimits {
            max_heartbeat_age: secs(10),
            max_lag: secs(60),
            max_lag_bytes: 1000,
        };
        let health = |heartbeat: u64, caught_up: u64, lag_bytes, blocked| CaptureHealth {
            heartbeat_age: Some(secs(heartbeat)),
            caught_up_age: Some(secs(caught_up)),
            lag_bytes,
            blocked,
        };
        let ready = |h: CaptureHealth| h.is_ready(&limits);
        assert!(ready(health(1, 1, 0, false)));
        assert!(ready(health(10, 60, 1000, false)), "limits are inclusive");
        assert!(!ready(health(11, 1, 0, false)), "stale heartbeat");
        assert!(!ready(health(1, 61, 0, false)), "behind for too long");
        assert!(!ready(health(1, 1, 1001, false)), "too many bytes behind");
        assert!(!ready(health(1, 1, 0, true)), "blocked");
        let never = CaptureHealth {
            heartbeat_age: None,
            caught_up_age: None,
            lag_bytes: 0,
            blocked: false,
        };
        assert!(!ready(never), "no leader has ever run");
    }
}
