//! The storage boundary: typed transactional primitives with no protocol
//! decisions in them. `PgStore` (crate `store-pg`) and [`MemStore`] implement
//! the same traits; the store-conformance suite keeps them in agreement.

mod mem;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::Arc;

pub use crate::error::StoreError;
pub use mem::{MemFeed, MemFenceListener, MemStore, MemTx, SourceError};
use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{CanonicalUuid, ScopeId};
use protocol::manifest::{Manifest, SchemaRef};
use protocol::position::{Boundary, StreamPosition};
use protocol::token::TokenKey;

use crate::capture::{
    CaptureHealth, CapturePlan, CaptureProblem, CaptureProgress, ChangeFeed, DependencyRow, Effect,
    Heartbeat, Materialization, Projection, Quarantine, Rematerialization,
};
use crate::config::DependencyAssignment;
use crate::ledger::contract::{
    FoundRow, LedgerEntries, PushRecord, Refusal, RowWrite, WriteResult, WriteTarget, Writer,
};
use crate::staging::{RebuildSession, RebuildUsage, StagedRow};
use crate::stream::state::{Checkpoint, MembershipRules, StreamState};

/// What a pull or a rebuild reads first, in its snapshot: one round trip
/// on PostgreSQL, where each round trip can wait for a core while capture
/// is busy beside it (ADR 0027).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestFrame {
    /// The durable materialization progress: it fixes the boundary.
    pub progress: CaptureProgress,
    /// The stream's generation, retention generation and floor.
    pub stream: StreamState,
    /// The named client (under any user), locked until commit.
    pub client: Option<ClientRecord>,
    /// The named ID's pending fences that no materialization satisfied, in
    /// fence order, at most the asked number (empty when none is named).
    pub pending_fences: Vec<u64>,
    /// The named ID's acknowledged checkpoints (empty when none is named).
    pub checkpoints: BTreeMap<ScopeId, Checkpoint>,
}

/// The identities a push asks the ledger for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LedgerLookup<'a> {
    pub batch_id: CanonicalUuid,
    pub mutation_ids: &'a [CanonicalUuid],
}

/// The first read of a push, in one step (ADR 0031).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushFrame {
    /// The named client (under any user), locked until commit.
    pub client: Option<ClientRecord>,
    /// The request's ledger entries; none unless the client is bound to
    /// the pushing user, not retired, and the request was well formed.
    pub ledger: LedgerEntries,
}

/// The durable state of one client identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientRecord {
    /// The user the client_id is bound to, forever.
    pub user_id: String,
    pub client_id: String,
    /// The current positive generation.
    pub generation: u64,
    /// Irreversibly retired: every request answers 409 `client_retired`.
    pub retired: bool,
    /// The schema the client last presented on connect (`None` before any).
    pub installed_schema: Option<SchemaRef>,
    /// The version of `assigned`; changes by exactly one when `assigned` changes.
    pub scope_set_version: u64,
    /// The authoritative assignment at `scope_set_version`.
    pub assigned: BTreeSet<ScopeId>,
    /// Every scope assigned in this generation, `assigned` included: a
    /// pull may present one that was removed since, never another.
    pub ever_assigned: BTreeSet<ScopeId>,
    /// Steps by one with every push that applied a write.
    pub accepted_write_epoch: u64,
    /// The client went on from its first connect (a continuing connect, or a
    /// push): a repeat of that first connect no longer replays it.
    pub continued: bool,
    /// The server time (microseconds) the ID was bound at; never rewritten.
    pub registered_at: i64,
}

impl ClientRecord {
    /// A client just bound to `user_id` at `registered_at`, in `generation`,
    /// with nothing installed, assigned or pushed yet.
    pub fn fresh(user_id: &str, client_id: &str, generation: u64, registered_at: i64) -> Self {
        ClientRecord {
            user_id: user_id.to_owned(),
            client_id: client_id.to_owned(),
            generation,
            retired: false,
            installed_schema: None,
            scope_set_version: 0,
            assigned: BTreeSet::new(),
            ever_assigned: BTreeSet::new(),
            accepted_write_epoch: 0,
            continued: false,
            registered_at,
        }
    }
}

/// What a process hears of the fences capture satisfied, whichever
/// process leads it (ADR 0028).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FenceReport {
    /// A committed materialization satisfied these fences.
    Satisfied(Arc<[u64]>),
    /// Reports may have been lost (the listening connection was): any
    /// fence may have been satisfied meanwhile.
    Missed,
}

/// Fence reports from every process's capture on one database, in commit
/// order, from when the listener was opened.
pub trait FenceListener: Send {
    /// The next report; waits for one. An error ends the listener.
    fn next(&mut self) -> impl Future<Output = Result<FenceReport, StoreError>> + Send;
}

/// A database handle that opens transactions.
pub trait Store: Clone + Send + Sync + 'static {
    type Tx: StoreTx;
    type Feed: ChangeFeed + 'static;
    type Fences: FenceListener + 'static;

    /// Opens a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Opens a transaction whose reads all see one snapshot (PostgreSQL:
    /// REPEATABLE READ). A write that conflicts with a concurrent one fails
    /// `Unavailable`, and the caller retries.
    fn begin_snapshot(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// As [`Store::begin_snapshot`], for a transaction that most likely ends
    /// in [`StoreTx::commit_lazily`]: a store may prepare the lazy commit
    /// as it begins. Its [`StoreTx::commit`] is as durable as any.
    fn begin_snapshot_lazily(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send {
        self.begin_snapshot()
    }

    /// 32 bytes for a new secret: real entropy (MemStore: its seeded RNG).
    fn fresh_secret(&self) -> impl Future<Output = Result<[u8; 32], StoreError>> + Send;

    /// Installs (idempotently) and verifies what capture needs: version
    /// triggers and the key guard on registered tables, and the feed over
    /// registered and dependency relations.
    fn install_capture(
        &self,
        plan: &CapturePlan,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Whether what `install_capture` installed still stands: `Some` names
    /// what broke (a captured relation dropped, recreated or unpublished, a
    /// capture trigger missing or disabled).
    fn check_capture(
        &self,
    ) -> impl Future<Output = Result<Option<CaptureProblem>, StoreError>> + Send;

    /// Opens the change feed at the last acknowledged point, or `None` while
    /// another process leads capture.
    fn change_feed(&self) -> impl Future<Output = Result<Option<Self::Feed>, StoreError>> + Send;

    /// The store capture materializes through: connections of its own
    /// (PostgreSQL: a small pool apart from the requests'), so that requests
    /// queued for a connection never delay materialization. Otherwise itself.
    fn capture_store(&self) -> impl Future<Output = Result<Self, StoreError>> + Send {
        let store = self.clone();
        async move { Ok(store) }
    }

    /// Listens for the fences that capture's commits satisfy, from every
    /// process on this database (PostgreSQL: `LISTEN` on a connection of
    /// its own). A process that does not lead capture wakes its waiting
    /// requests by it.
    fn fence_listener(&self) -> impl Future<Output = Result<Self::Fences, StoreError>> + Send;

    /// Prepares (idempotently) what push writes need: the writer role and
    /// its privileges on these tables.
    fn install_push(
        &self,
        targets: &[WriteTarget],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// One transaction. Dropping it without `commit` rolls it back.
pub trait StoreTx: Send {
    /// Every stored manifest, by ascending version.
    fn manifests(&mut self) -> impl Future<Output = Result<Vec<Manifest>, StoreError>> + Send;

    /// Stores a new manifest; its version must be above every stored one.
    fn insert_manifest(
        &mut self,
        m: &Manifest,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The fingerprints of the configs processes started with, each once,
    /// from the one replaced longest ago to the newest (ADR 0020 §8).
    fn applied_configs(&mut self) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;

    /// Records that a process starts with the config of `fingerprint`: it
    /// becomes the newest, moved there if it was applied before.
    fn apply_config(
        &mut self,
        fingerprint: &str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The first read of a pull or a rebuild ([`RequestFrame`]): what
    /// [`StoreTx::capture_progress`], [`StoreTx::stream_state`] and, for a
    /// named client, [`StoreTx::lock_client`], [`StoreTx::pending_fences`]
    /// (at most `max_fences`) and [`StoreTx::checkpoints`] read, in one
    /// step. A store may read it all at once.
    fn request_frame(
        &mut self,
        client_id: Option<&str>,
        max_fences: usize,
    ) -> impl Future<Output = Result<RequestFrame, StoreError>> + Send
    where
        Self: Send,
    {
        async move {
            let progress = self.capture_progress().await?;
            let stream = self.stream_state().await?;
            let mut frame = RequestFrame {
                progress,
                stream,
                client: None,
                pending_fences: Vec::new(),
                checkpoints: BTreeMap::new(),
            };
            if let Some(id) = client_id {
                frame.client = self.lock_client(id).await?;
                frame.pending_fences = self.pending_fences(id, max_fences).await?;
                frame.checkpoints = self.checkpoints(id).await?;
            }
            Ok(frame)
        }
    }

    /// Reads and locks the client with this ID (under any user) until commit.
    fn lock_client(
        &mut self,
        client_id: &str,
    ) -> impl Future<Output = Result<Option<ClientRecord>, StoreError>> + Send;

    /// Binds a new client ID to its user with this record. `false`, changing
    /// nothing, when the ID is bound already (a concurrent first connect won):
    /// a binding is never rewritten.
    fn insert_client(
        &mut self,
        c: &ClientRecord,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// How many client IDs `user_id` bound at or after `since_micros`.
    fn count_registrations(
        &mut self,
        user_id: &str,
        since_micros: i64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Replaces the record of a bound client (same ID, same user); a record
    /// that does not exist is an integrity failure.
    fn put_client(
        &mut self,
        c: &ClientRecord,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Scopes granted to the user in `synchro.scope_grants`.
    fn grants(
        &mut self,
        user_id: &str,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;

    /// Values of `value_column` in the rows of the dependency relation whose `user_column` is the user.
    fn dependency_values(
        &mut self,
        source: &DependencyAssignment,
        user_id: &str,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;

    /// The durable materialization progress and quarantine.
    fn capture_progress(
        &mut self,
    ) -> impl Future<Output = Result<CaptureProgress, StoreError>> + Send;

    /// Records the capture leader's heartbeat with the store's clock.
    fn record_heartbeat(
        &mut self,
        beat: &Heartbeat,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The last heartbeat's age and lag, and whether a quarantine blocks capture.
    fn capture_health(&mut self) -> impl Future<Output = Result<CaptureHealth, StoreError>> + Send;

    /// The rows of a scope now (tombstones included), in row-identity
    /// order, with their row digests: what its scope digest covers.
    fn scope_members(
        &mut self,
        scope: &ScopeId,
    ) -> impl Future<Output = Result<Vec<(RowIdentity, Digest)>, StoreError>> + Send;

    /// How many rows the scope has now (tombstones included): what a
    /// rebuild of it stages.
    fn scope_size(
        &mut self,
        scope: &ScopeId,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Whether any projection's digest was computed under another manifest
    /// than `schema_version`.
    fn has_stale_projections(
        &mut self,
        schema_version: u64,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The projections of a scope's members whose digest was computed under
    /// another manifest than `schema_version`.
    fn stale_scope_members(
        &mut self,
        scope: &ScopeId,
        schema_version: u64,
    ) -> impl Future<Output = Result<Vec<Projection>, StoreError>> + Send;

    /// The projections of these rows of a table that exist.
    fn projections(
        &mut self,
        table_id: &str,
        rows: &[RowIdentity],
    ) -> impl Future<Output = Result<Vec<Projection>, StoreError>> + Send;

    /// The dependency rows with these identities that exist.
    fn dependency_rows_by_identity(
        &mut self,
        relation: &str,
        identities: &[String],
    ) -> impl Future<Output = Result<Vec<DependencyRow>, StoreError>> + Send;

    /// The dependency rows whose `column` has one of `values`.
    fn dependency_rows(
        &mut self,
        relation: &str,
        column: &str,
        values: &[String],
    ) -> impl Future<Output = Result<Vec<DependencyRow>, StoreError>> + Send;

    /// Writes one source transaction's outcome, advances progress to its
    /// end and clears any quarantine.
    fn materialize(
        &mut self,
        m: &Materialization,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The operator stream reset (ADR 0012): a new stream generation, every
    /// materialized state of the old one gone (projections, membership,
    /// effects, dependency rows, progress, checkpoints, rebuild stages; its
    /// rebuild sessions are swept but remembered),
    /// and a baseline owed under a new slot. Pending fences stay: the new
    /// baseline covers those it holds. Returns the new generation.
    fn reset_stream(&mut self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// This transaction commits chunk `index` of the baseline (ADR 0030).
    /// Chunks commit in order from 0; any other index is refused
    /// (integrity). Once one has committed, a feed that finds the baseline
    /// unfinished keeps the slot and hands the rows not yet read over to
    /// re-reads, instead of taking the baseline again.
    fn record_baseline_chunk(
        &mut self,
        index: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The baseline is handed over to re-reads (ADR 0030): the stream's
    /// slot is its own from now on, the records its chunks committed owe
    /// the rows not yet read, and a quarantine of a chunk (below the
    /// stream, never delivered again) is lifted. Refused (integrity)
    /// unless a baseline is owed and a chunk of it has committed.
    fn hand_over_baseline(&mut self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The baseline is materialized (in this transaction): the stream's
    /// slot is its own from now on, and `covered_fences` are satisfied.
    fn complete_baseline(
        &mut self,
        covered_fences: &[u64],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Forgets every projection, membership and effect of a table the
    /// config no longer registers (ADR 0020): no page or checksum holds it
    /// again. Returns the projections forgotten.
    fn forget_table(
        &mut self,
        table_id: &str,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Every captured relation's rematerialization record (ADR 0020).
    fn rematerializations(
        &mut self,
    ) -> impl Future<Output = Result<Vec<Rematerialization>, StoreError>> + Send;

    /// Stores these rematerialization records, replacing those of their relations.
    fn put_rematerializations(
        &mut self,
        records: &[Rematerialization],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Records the transaction that blocks capture, found by a leader that
    /// read its progress in `stream_generation`. Refused (unavailable,
    /// nothing written) once a reset began another generation: a leader
    /// of the old stream must not block the new one.
    fn quarantine(
        &mut self,
        q: &Quarantine,
        stream_generation: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The stream's generation, retention generation and floor.
    fn stream_state(&mut self) -> impl Future<Output = Result<StreamState, StoreError>> + Send;

    /// The history of every table's scope rules.
    fn membership_rules(
        &mut self,
    ) -> impl Future<Output = Result<Vec<MembershipRules>, StoreError>> + Send;

    /// Appends rule sets; a (table, generation) stored already is an integrity failure.
    fn insert_membership_rules(
        &mut self,
        rules: &[MembershipRules],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Every token key, of any state.
    fn token_keys(&mut self) -> impl Future<Output = Result<Vec<TokenKey>, StoreError>> + Send;

    /// Stores these keys, unless a key is stored already (a process that
    /// started at the same time won): then nothing changes.
    fn insert_token_keys(
        &mut self,
        keys: &[TokenKey],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Key rotation (ADR 0025): every active key becomes verify-only and
    /// `fresh` (one active key per kind, under unused IDs) is stored.
    fn rotate_token_keys(
        &mut self,
        fresh: &[TokenKey],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes the verify-only key `key_id`; tokens under it are forged from
    /// then on. Whether such a key was found (an active key never is).
    fn drop_token_key(
        &mut self,
        key_id: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The acknowledged checkpoints of a client, by scope.
    fn checkpoints(
        &mut self,
        client_id: &str,
    ) -> impl Future<Output = Result<BTreeMap<ScopeId, Checkpoint>, StoreError>> + Send;

    /// Sets these checkpoints of a client (the caller keeps them monotonic).
    fn put_checkpoints(
        &mut self,
        client_id: &str,
        checkpoints: &[(ScopeId, Checkpoint)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The least position a client may still present as a valid cursor, as
    /// retention counts it (docs/adr/0024): the `stream_generation`
    /// checkpoints of clients not retired acknowledged within `window` by
    /// the store's clock, and the boundary of each rebuild session begun
    /// within `window` whose scope its client has not acknowledged since;
    /// only those at or above the floor (one below is stale already).
    /// `None` when no client holds anything.
    fn retention_hold(
        &mut self,
        stream_generation: u64,
        window: std::time::Duration,
    ) -> impl Future<Output = Result<Option<StreamPosition>, StoreError>> + Send;

    /// Moves the stream's retention floor forward to `floor`; one at or
    /// past it stays where it is.
    fn advance_floor(
        &mut self,
        floor: StreamPosition,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes at most `max` effects at or below the floor that are
    /// deletions or removals and not their scope's last effect; how many
    /// it deleted. An upsert stays: it is its row's current state, and a
    /// scope's last effect keys its cached checksum.
    fn compact_below_floor(
        &mut self,
        max: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Forgets at most `max` records of materialized source transactions
    /// that committed below the floor's LSN; how many. Capture's progress
    /// is past them, so none can be materialized again.
    fn forget_transactions_below_floor(
        &mut self,
        max: usize,
    ) -> impl Future<Output = Result<usize, StoreError>> + Send;

    /// Retires `client_id` irreversibly, releasing what it held: its
    /// checkpoints, rebuild sessions and push outcomes. `false`: no such
    /// client. Retiring a retired client changes nothing.
    fn retire_client(
        &mut self,
        client_id: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The writes accepted from this client that await materialization:
    /// its pending fences that no materialization recorded satisfied, in
    /// fence order, at most `max` of them (empty: none awaits).
    fn pending_fences(
        &mut self,
        client_id: &str,
        max: usize,
    ) -> impl Future<Output = Result<Vec<u64>, StoreError>> + Send;

    /// Removes every pending fence recorded satisfied together with its
    /// record (ADR 0014: a materialization that ran before the write's
    /// pending fence was visible to it left both). Returns how many.
    fn reconcile_fences(&mut self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// A scope's retained pull candidates after `after`: the effects no
    /// later effect of the same row supersedes, in position order, at most
    /// `max` of them. `through` is the snapshot's boundary: the snapshot
    /// holds every effect through it and none past it.
    fn scope_candidates(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
        max: usize,
    ) -> impl Future<Output = Result<Vec<Effect>, StoreError>> + Send;

    /// The position of a scope's last effect before `before`, if any.
    fn last_effect_before(
        &mut self,
        scope: &ScopeId,
        before: StreamPosition,
    ) -> impl Future<Output = Result<Option<StreamPosition>, StoreError>> + Send;

    /// [`StoreTx::last_effect_before`] of each of `scopes`, in their order,
    /// in one step (one round trip on PostgreSQL, ADR 0027).
    fn last_effects_before(
        &mut self,
        scopes: &[&ScopeId],
        before: StreamPosition,
    ) -> impl Future<Output = Result<Vec<Option<StreamPosition>>, StoreError>> + Send
    where
        Self: Send,
    {
        async move {
            let mut last = Vec::with_capacity(scopes.len());
            for scope in scopes {
                last.push(self.last_effect_before(scope, before).await?);
            }
            Ok(last)
        }
    }

    /// The rebuild session of this client's attempt `rebuild_id`, if any.
    fn rebuild_session(
        &mut self,
        client_id: &str,
        rebuild_id: &CanonicalUuid,
    ) -> impl Future<Output = Result<Option<RebuildSession>, StoreError>> + Send;

    /// Creates `session` (replacing this client's session of the same
    /// `rebuild_id`, its stage and pages; one a concurrent request created
    /// is `Unavailable`) and stages every member of its
    /// scope this snapshot holds, inside the store, in row-identity order
    /// from ordinal 0, each with its projection's digest or its digest in
    /// `digests`. The number of rows staged.
    fn stage_rebuild(
        &mut self,
        session: &RebuildSession,
        digests: &[(RowIdentity, Digest)],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Ends every live session of `client_id` for `scope` (a new attempt
    /// supersedes it): each expires at `now_micros`, its stage and pages
    /// are deleted, and its row stays, so that its `rebuild_id` and its
    /// continuations are answered with 409. How many it ended.
    fn supersede_rebuild_sessions(
        &mut self,
        client_id: &str,
        scope: &ScopeId,
        now_micros: i64,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Rows staged by the sessions live at `now_micros`: those of
    /// `user_id`'s clients, and all of them.
    fn rebuild_usage(
        &mut self,
        user_id: &str,
        now_micros: i64,
    ) -> impl Future<Output = Result<RebuildUsage, StoreError>> + Send;

    /// The identity and digest of the staged rows from ordinal `from`, at
    /// most `max` of them, in stage order.
    fn staged_digests(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> impl Future<Output = Result<Vec<(RowIdentity, Digest)>, StoreError>> + Send;

    /// Records the staged scope's digest: the session is complete.
    fn seal_rebuild_session(
        &mut self,
        session_id: &CanonicalUuid,
        digest: &Digest,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The staged rows from ordinal `from`, at most `max` of them.
    fn staged_rows(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> impl Future<Output = Result<Vec<StagedRow>, StoreError>> + Send;

    /// Deletes the stages of at most `max` sessions that expired
    /// at or before `now_micros` and still hold them; how many it swept.
    /// The session rows stay, so that their `rebuild_id` is still answered
    /// with 409.
    fn sweep_rebuild_sessions(
        &mut self,
        now_micros: i64,
        max: usize,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes at most `max` swept sessions that expired at or before
    /// `expired_before`; how many it deleted. Their `rebuild_id`s are then
    /// unknown: a first request with one starts a new session.
    fn forget_rebuild_sessions(
        &mut self,
        expired_before: i64,
        max: usize,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The effects of a scope after `after` and through `through`, in position order.
    fn scope_effects(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
    ) -> impl Future<Output = Result<Vec<Effect>, StoreError>> + Send;

    /// The ledger entries of (user, client) for this batch and these mutations.
    fn push_ledger(
        &mut self,
        user_id: &str,
        client_id: &str,
        batch_id: CanonicalUuid,
        mutation_ids: &[CanonicalUuid],
    ) -> impl Future<Output = Result<LedgerEntries, StoreError>> + Send;

    /// Adds a completed batch and its newly completed mutations; an identity
    /// that is already stored is an integrity failure.
    fn record_push(
        &mut self,
        r: &PushRecord,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The first read of a push ([`PushFrame`]): what
    /// [`StoreTx::lock_client`] reads for `client_id` and, when that client
    /// is bound to `user_id` and not retired and a `lookup` is given,
    /// [`StoreTx::push_ledger`] reads, in one step. A store may read it all
    /// at once (ADR 0031).
    fn push_frame(
        &mut self,
        user_id: &str,
        client_id: &str,
        lookup: Option<LedgerLookup<'_>>,
    ) -> impl Future<Output = Result<PushFrame, StoreError>> + Send
    where
        Self: Send,
    {
        async move {
            let client = self.lock_client(client_id).await?;
            let ledger = match lookup {
                Some(l)
                    if client
                        .as_ref()
                        .is_some_and(|c| c.user_id == user_id && !c.retired) =>
                {
                    (self.push_ledger(user_id, client_id, l.batch_id, l.mutation_ids)).await?
                }
                _ => LedgerEntries::default(),
            };
            Ok(PushFrame { client, ledger })
        }
    }

    /// The last writes of a push: [`StoreTx::record_push`], then, when
    /// given, [`StoreTx::put_client`] of the client `r` names, in one step.
    /// A store may write both at once (ADR 0031).
    fn complete_push(
        &mut self,
        r: &PushRecord,
        client: Option<&ClientRecord>,
    ) -> impl Future<Output = Result<(), StoreError>> + Send
    where
        Self: Send,
    {
        async move {
            if client.is_some_and(|c| (&c.user_id, &c.client_id) != (&r.user_id, &r.client_id)) {
                return Err(StoreError::Integrity(
                    "a push completed for another client".into(),
                ));
            }
            self.record_push(r).await?;
            if let Some(c) = client {
                self.put_client(c).await?;
            }
            Ok(())
        }
    }

    /// From here on, source writes run as `writer`: its row security applies
    /// and its writes leave fences pending for its client.
    fn begin_writes(&mut self, w: &Writer) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Reads these rows of a table as the writer, locking the visible ones.
    fn find_rows(
        &mut self,
        target: &WriteTarget,
        keys: &[String],
    ) -> impl Future<Output = Result<Vec<FoundRow>, StoreError>> + Send;

    /// One source write to the row with primary key `key` (text form).
    fn write_row(
        &mut self,
        target: &WriteTarget,
        key: &str,
        write: &RowWrite,
    ) -> impl Future<Output = Result<WriteResult, StoreError>> + Send;

    /// Source writes to distinct rows of one table, all or none: `Some`
    /// with one `Written` per write in order, or `None` when any write was
    /// refused or changed no row (then none of them has any effect).
    fn write_rows(
        &mut self,
        target: &WriteTarget,
        writes: &[(String, RowWrite)],
    ) -> impl Future<Output = Result<Option<Vec<WriteResult>>, StoreError>> + Send;

    /// Marks the start of an atomic group of writes.
    fn mark_group(&mut self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Checks the deferred constraints now; `Some` when one fails, and then
    /// the group must be undone.
    fn check_constraints(
        &mut self,
    ) -> impl Future<Output = Result<Option<Refusal>, StoreError>> + Send;

    /// Undoes every write since `mark_group`.
    fn undo_group(&mut self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Source writes run as the store's own role again.
    fn end_writes(&mut self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Makes every write of the transaction durable.
    fn commit(self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Commits without waiting for the commit to be durable (ADR 0026):
    /// for a transaction whose writes a crash may undo harmlessly, such as
    /// checkpoints, which only move forward and are read conservatively.
    /// Its writes are visible at once, and durable no later than the next
    /// durable commit of any transaction. A store that never loses a commit
    /// commits as [`StoreTx::commit`] does.
    fn commit_lazily(self) -> impl Future<Output = Result<(), StoreError>> + Send
    where
        Self: Sized,
    {
        self.commit()
    }
}
