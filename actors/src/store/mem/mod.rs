//! The in-memory store: the same traits as PgStore, for fast tests and the
//! simulator. A transaction holds the one lock for its whole life (so
//! transactions are serial) and works on a copy that commit installs.

mod capture;
mod push;
mod rebuild;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{CanonicalUuid, ScopeId};
use protocol::manifest::Manifest;
use protocol::position::{Boundary, StreamPosition};
use protocol::token::{KeyState, TokenKey};
use tokio::sync::{Mutex, OwnedMutexGuard, broadcast, watch};

use super::{ClientRecord, FenceListener, FenceReport, Store, StoreError, StoreTx};
use crate::capture::{
    CaptureHealth, CapturePlan, CaptureProblem, CaptureProgress, DependencyRow, Effect, Heartbeat,
    Materialization, Projection, Quarantine, Rematerialization,
};
use crate::config::DependencyAssignment;
use crate::ledger::contract::{
    FoundRow, LedgerEntries, PushRecord, Refusal, RowWrite, WriteResult, WriteTarget, Writer,
};
use crate::staging::{RebuildSession, RebuildUsage, StagedRow};
use crate::stream::state::{Checkpoint, MembershipRules, StreamState};
pub use capture::{MemFeed, SourceError};
pub use rebuild::LiveSession;

/// Everything the store holds.
#[derive(Clone, Debug)]
struct State {
    manifests: Vec<Manifest>,
    /// Config fingerprints, oldest applied first.
    applied_configs: Vec<String>,
    /// A planted bug: the applied configs are never read back.
    forgets_applied_configs: bool,
    clients: BTreeMap<String, ClientRecord>,
    grants: BTreeSet<(String, String)>,
    /// (relation, user_column, value_column) -> rows of (user, value).
    dependencies: BTreeMap<(String, String, String), Vec<(String, String)>>,
    capture: capture::CaptureState,
    ledger: push::Ledger,
    stream: StreamState,
    membership_rules: Vec<MembershipRules>,
    token_keys: Vec<TokenKey>,
    /// A planted bug: rotation deletes the old keys instead of keeping
    /// them verify-only.
    rotation_forgets_keys: bool,
    /// Each checkpoint, and when (by the store's clock) it was acknowledged.
    checkpoints: BTreeMap<(String, ScopeId), (Checkpoint, tokio::time::Instant)>,
    rebuilds: rebuild::Rebuilds,
}

/// An in-memory database.
#[derive(Clone)]
pub struct MemStore {
    state: Arc<Mutex<State>>,
    /// The commit log's length, for feeds waiting for the next transaction.
    log_len: Arc<watch::Sender<usize>>,
    /// Held by the one open feed (the capture leader), like PgStore's advisory lock.
    leader: Arc<AtomicBool>,
    /// The slot was lost: read without the state lock, as PostgreSQL's
    /// catalog is read without waiting on row locks.
    slot_lost: Arc<AtomicBool>,
    /// Commits of transactions that wrote checkpoints still to fail
    /// (a fault a test injects between a pull's writes and its commit).
    failing_checkpoint_commits: Arc<AtomicUsize>,
    /// See [`MemStore::lag_fence_visibility`]; 0 is none.
    fence_visibility_lag_ms: Arc<AtomicU64>,
    /// What every listener hears: the fences each commit satisfied.
    fence_reports: broadcast::Sender<Arc<[u64]>>,
    /// A planted bug: commits tell listeners nothing.
    fence_reports_withheld: Arc<AtomicBool>,
}

/// Reports a listener may fall behind by before it hears
/// [`FenceReport::Missed`].
const FENCE_REPORT_BACKLOG: usize = 1024;

impl Default for MemStore {
    fn default() -> MemStore {
        MemStore::with_seed(0)
    }
}

impl MemStore {
    /// An empty store.
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// An empty store whose row versions come from `seed`.
    pub fn with_seed(seed: u64) -> MemStore {
        MemStore {
            state: Arc::new(Mutex::new(State {
                manifests: Vec::new(),
                applied_configs: Vec::new(),
                forgets_applied_configs: false,
                clients: BTreeMap::new(),
                grants: BTreeSet::new(),
                dependencies: BTreeMap::new(),
                capture: capture::CaptureState::new(seed),
                ledger: push::Ledger::default(),
                stream: StreamState::default(),
                membership_rules: Vec::new(),
                token_keys: Vec::new(),
                rotation_forgets_keys: false,
                checkpoints: BTreeMap::new(),
                rebuilds: rebuild::Rebuilds::default(),
            })),
            log_len: Arc::new(watch::channel(0).0),
            slot_lost: Arc::new(AtomicBool::new(false)),
            leader: Arc::new(AtomicBool::new(false)),
            failing_checkpoint_commits: Arc::new(AtomicUsize::new(0)),
            fence_visibility_lag_ms: Arc::new(AtomicU64::new(0)),
            fence_reports: broadcast::channel(FENCE_REPORT_BACKLOG).0,
            fence_reports_withheld: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Plants a bug: commits that satisfy fences tell no listener, so a
    /// process that does not lead capture never hears of them.
    pub fn plant_fence_reports_withheld(&self) {
        self.fence_reports_withheld.store(true, Ordering::SeqCst);
    }

    /// The current version of a registered row and whether it was hard-deleted
    /// (then it is the row's deletion fence).
    pub async fn row_version(&self, table_id: &str, key: &str) -> Option<(String, bool)> {
        let state = self.state.lock().await;
        let v = state
            .capture
            .versions
            .get(&(table_id.to_owned(), key.to_owned()))?;
        Some((v.version.clone(), v.deleted))
    }

    /// The commit LSN of the newest committed source transaction (0 before any).
    pub async fn last_commit_lsn(&self) -> crate::capture::Lsn {
        self.state.lock().await.capture.last_commit_lsn()
    }

    /// Fault injection: the replication slot is dropped (or invalidated):
    /// the WAL it retained is gone, no feed opens, and `check_capture`
    /// reports it. An open feed reads nothing more.
    pub async fn lose_slot(&self) {
        let mut state = self.state.lock().await;
        state.capture.slot_lost = true;
        state.capture.lose_log();
        self.slot_lost.store(true, Ordering::Release);
    }

    /// Fault injection for a planted bug: the slot's unacknowledged WAL is
    /// lost, and capture goes on as if a new slot were the old one.
    pub async fn lose_wal(&self) {
        self.state.lock().await.capture.lose_log();
    }

    /// Where the materialized baseline's chunks are: its first chunk's
    /// commit LSN and the stream's first position; `None` before it
    /// completed, or when it held no row. Every commit below the first is in it.
    pub async fn baseline_span(&self) -> Option<(crate::capture::Lsn, crate::capture::Lsn)> {
        let state = self.state.lock().await;
        let c = &state.capture;
        (!c.progress.baseline_owed)
            .then_some(c.baseline_span)
            .flatten()
    }

    /// Whether the baseline is materialized.
    pub async fn baseline_done(&self) -> bool {
        !self.state.lock().await.capture.progress.baseline_owed
    }

    /// The version each registered row had in the last baseline exported, by key.
    pub async fn baseline_versions(&self) -> BTreeMap<String, String> {
        self.state.lock().await.capture.baseline_versions.clone()
    }

    /// A planted bug: a rematerialization's re-read of `relation` finds no
    /// rows, so rows it did not see change keep their old model (ADR 0020).
    pub async fn plant_reread_skipping(&self, relation: &str) {
        self.state.lock().await.capture.reread_skips = Some(relation.to_owned());
    }

    /// Fault injection: the transaction of baseline chunk `index` fails
    /// once, as a crash before its commit would; the chunks before it
    /// stay committed (ADR 0030).
    pub async fn cut_baseline_at(&self, index: u64) {
        self.state.lock().await.capture.cut_baseline_at = Some(index);
    }

    /// How many baselines were handed over to re-reads (ADR 0030).
    pub async fn baseline_handovers(&self) -> u64 {
        self.state.lock().await.capture.baseline_handovers
    }

    /// Whether the cut [`MemStore::cut_baseline_at`] injected has failed
    /// its chunk (a cut is spent when it fails).
    pub async fn baseline_was_cut(&self) -> bool {
        let state = self.state.lock().await;
        state.capture.cut_baseline_at.is_none()
    }

    /// A planted bug: a baseline cut short by a crash is handed over with
    /// no relation owed, so the rows it had not read are lost (ADR 0030).
    pub async fn plant_handover_forgetting_rows(&self) {
        self.state.lock().await.capture.handover_forgets_rows = true;
    }

    /// Fault injection for a planted bug: baselines leave out the
    /// dependency relations that scope rules read.
    pub async fn plant_baseline_without_dependencies(&self) {
        self.state
            .lock()
            .await
            .capture
            .baseline_without_dependencies = true;
    }

    /// Transactions the change feeds delivered, redeliveries included.
    pub async fn feed_deliveries(&self) -> u64 {
        self.state.lock().await.capture.deliveries
    }

    /// Fences that a materialization satisfied.
    pub async fn materialized_fences(&self) -> BTreeSet<u64> {
        self.state.lock().await.capture.fences_done.clone()
    }

    /// Declares a column's PostgreSQL type (`format_type` with its modifier,
    /// as `CREATE TABLE` would); push writes then keep only what it keeps.
    pub async fn declare_column_type(&self, relation: &str, column: &str, column_type: &str) {
        self.state.lock().await.capture.column_types.insert(
            (relation.to_owned(), column.to_owned()),
            column_type.to_owned(),
        );
    }

    /// Adds a row to `synchro.scope_grants` (what an operator's SQL would do).
    pub async fn grant(&self, user_id: &str, scope_id: &str) {
        self.state
            .lock()
            .await
            .grants
            .insert((user_id.into(), scope_id.into()));
    }

    /// Removes a grant.
    pub async fn revoke(&self, user_id: &str, scope_id: &str) {
        self.state
            .lock()
            .await
            .grants
            .remove(&(user_id.into(), scope_id.into()));
    }

    /// Adds or removes one row of a dependency relation (what the application's SQL would do).
    pub async fn dependency_row(
        &self,
        source: &DependencyAssignment,
        user_id: &str,
        value: &str,
        on: bool,
    ) {
        let key = (
            source.relation.clone(),
            source.user_column.clone(),
            source.value_column.clone(),
        );
        let mut state = self.state.lock().await;
        let rows = state.dependencies.entry(key).or_default();
        rows.retain(|(u, v)| !(u == user_id && v == value));
        if on {
            rows.push((user_id.into(), value.into()));
        }
    }

    /// The fences of writes accepted from `client_id` that are not yet
    /// materialized (pending, and not recorded satisfied).
    pub async fn pending_fences(&self, client_id: &str) -> Vec<u64> {
        let mut state = self.state.lock().await;
        state.capture.reveal_fences();
        let c = &state.capture;
        c.pending_fences
            .iter()
            .filter(|(f, c_id)| c_id.as_str() == client_id && !c.satisfied_fences.contains(f))
            .map(|(f, _)| *f)
            .collect()
    }

    /// Models PostgreSQL handing a commit to logical decoding before the
    /// committing session leaves the proc array: after a commit that wrote
    /// pending fences, the feed can deliver the transaction while those
    /// fences are not yet visible to any other transaction, until capture
    /// has materialized it or `lag` passed. The commit returns only once
    /// they are visible, as PostgreSQL's does.
    pub fn lag_fence_visibility(&self, lag: std::time::Duration) {
        let ms = u64::try_from(lag.as_millis()).unwrap_or(u64::MAX);
        self.fence_visibility_lag_ms.store(ms, Ordering::SeqCst);
    }

    /// Every rebuild session live at `now_micros` (for simulation judges).
    pub async fn live_rebuild_sessions(&self, now_micros: i64) -> Vec<LiveSession> {
        let state = self.state.lock().await;
        state.rebuilds.live(&state.clients, now_micros)
    }

    /// Where the WAL ends: every position written so far is before it.
    pub async fn wal_end(&self) -> crate::capture::Lsn {
        self.state.lock().await.capture.wal_end()
    }

    /// The WAL the slot still retains: written but not acknowledged.
    pub async fn retained_wal(&self) -> crate::capture::Lsn {
        self.state.lock().await.capture.retained_wal()
    }

    /// Plants a bug: an idle feed never offers its idle end, so the slot
    /// keeps the WAL of capture's own writes for ever.
    pub async fn plant_idle_end_withheld(&self) {
        self.state.lock().await.capture.idle_end_withheld = true;
    }

    /// Plants a bug: each compaction pass also deletes the latest effect
    /// above the floor that is not its scope's last, superseded or not.
    pub async fn plant_compaction_above_floor(&self) {
        self.state.lock().await.capture.compact_above_floor = true;
    }

    /// Plants a bug: a row's upsert in a scope does not replace the row's
    /// earlier upsert there, so the scope keeps the effect while the
    /// row's projection moves on (ADR 0037's premise broken).
    pub async fn plant_replacements_kept_back(&self) {
        self.state.lock().await.capture.keep_back_replacements = Some(0);
    }

    /// How many replacements the planted bug kept back.
    pub async fn replacements_kept_back(&self) -> usize {
        (self.state.lock().await.capture.keep_back_replacements).unwrap_or(0)
    }

    /// Plants a bug: a key rotation deletes the old keys, so every token
    /// issued before it is forged.
    pub async fn plant_rotation_forgets_keys(&self) {
        self.state.lock().await.rotation_forgets_keys = true;
    }

    /// Plants a bug: the configs processes started with are never read
    /// back, so a process of an older deploy brings its config back.
    pub async fn plant_forgets_applied_configs(&self) {
        self.state.lock().await.forgets_applied_configs = true;
    }

    /// Plants a bug: no client's fence is ever seen pending, so a pull or
    /// rebuild right after a push may serve state older than the push.
    pub async fn plant_unseen_fences(&self) {
        self.state.lock().await.capture.fences_unseen = true;
    }

    /// Plants a bug: a new rebuild attempt supersedes no session.
    pub async fn plant_no_supersede(&self) {
        self.state.lock().await.rebuilds.no_supersede = true;
    }

    /// Plants a bug: rebuild usage counts no staged row (no budget holds).
    pub async fn plant_blind_rebuild_usage(&self) {
        self.state.lock().await.rebuilds.blind_usage = true;
    }

    /// Plants a bug: a rebuild page is rendered from the rows as they are
    /// now, not as staged, so a replay after a write differs.
    pub async fn plant_live_rebuild_pages(&self) {
        self.state.lock().await.rebuilds.live_pages = true;
    }

    /// Plants the bug of issue 24: a materialization satisfies only the
    /// pending fences it can see, so one decoded before it was visible stays
    /// pending for ever.
    pub async fn plant_fences_by_visibility(&self) {
        self.state.lock().await.capture.fences_by_visibility = true;
    }

    /// Makes the next `n` commits of transactions that wrote checkpoints
    /// fail as a lost connection would (`Unavailable`), writing nothing.
    pub fn fail_checkpoint_commits(&self, n: usize) {
        self.failing_checkpoint_commits.store(n, Ordering::SeqCst);
    }

    /// The user of every bound client ID.
    pub async fn bound_users(&self) -> Vec<String> {
        let state = self.state.lock().await;
        state.clients.values().map(|c| c.user_id.clone()).collect()
    }
}

/// A transaction over a private copy of the state.
pub struct MemTx {
    guard: OwnedMutexGuard<State>,
    work: State,
    log_len: Arc<watch::Sender<usize>>,
    /// The state when an atomic group of writes began.
    group: Option<Box<State>>,
    wrote_checkpoints: bool,
    failing_checkpoint_commits: Arc<AtomicUsize>,
    /// The store's lost-slot flag, which a stream reset clears at commit.
    slot_lost: Arc<AtomicBool>,
    fence_visibility_lag_ms: Arc<AtomicU64>,
    /// The fences this transaction satisfied, told to listeners at commit.
    satisfied: Vec<u64>,
    fence_reports: Option<broadcast::Sender<Arc<[u64]>>>,
}

/// A [`MemStore`]'s fence reports, as one listener hears them.
pub struct MemFenceListener {
    receiver: broadcast::Receiver<Arc<[u64]>>,
}

impl FenceListener for MemFenceListener {
    async fn next(&mut self) -> Result<FenceReport, StoreError> {
        match self.receiver.recv().await {
            Ok(fences) => Ok(FenceReport::Satisfied(fences)),
            Err(broadcast::error::RecvError::Lagged(_)) => Ok(FenceReport::Missed),
            // The store holds the sender: it never closes while a listener lives.
            Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
        }
    }
}

impl Store for MemStore {
    type Tx = MemTx;
    type Feed = MemFeed;
    type Fences = MemFenceListener;

    async fn begin(&self) -> Result<MemTx, StoreError> {
        let mut guard = self.state.clone().lock_owned().await;
        guard.capture.reveal_fences();
        let work = guard.clone();
        Ok(MemTx {
            guard,
            work,
            log_len: self.log_len.clone(),
            group: None,
            wrote_checkpoints: false,
            failing_checkpoint_commits: self.failing_checkpoint_commits.clone(),
            slot_lost: self.slot_lost.clone(),
            fence_visibility_lag_ms: self.fence_visibility_lag_ms.clone(),
            satisfied: Vec::new(),
            fence_reports: (!self.fence_reports_withheld.load(Ordering::SeqCst))
                .then(|| self.fence_reports.clone()),
        })
    }

    async fn fence_listener(&self) -> Result<MemFenceListener, StoreError> {
        Ok(MemFenceListener {
            receiver: self.fence_reports.subscribe(),
        })
    }

    async fn begin_snapshot(&self) -> Result<MemTx, StoreError> {
        // Transactions are serial: every one is a snapshot.
        self.begin().await
    }

    async fn fresh_secret(&self) -> Result<[u8; 32], StoreError> {
        Ok(self.state.lock().await.capture.random_bytes())
    }

    async fn install_capture(&self, plan: &CapturePlan) -> Result<(), StoreError> {
        self.state.lock().await.capture.install(plan);
        Ok(())
    }

    async fn check_capture(&self) -> Result<Option<CaptureProblem>, StoreError> {
        // MemStore has no DDL: what it installed cannot drift. Its slot can be lost.
        let lost = self.slot_lost.load(Ordering::Acquire);
        Ok(lost.then_some(CaptureProblem::SlotLost))
    }

    async fn change_feed(&self) -> Result<Option<MemFeed>, StoreError> {
        if self.slot_lost.load(Ordering::Acquire) {
            return Err(StoreError::Unavailable(
                "the replication slot does not exist".into(),
            ));
        }
        if self
            .leader
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Ok(None);
        }
        match MemFeed::open(self.clone(), self.leader.clone()).await {
            Ok(feed) => Ok(Some(feed)),
            Err(e) => {
                self.leader.store(false, Ordering::Release);
                Err(e)
            }
        }
    }

    async fn install_push(&self, _targets: &[WriteTarget]) -> Result<(), StoreError> {
        // MemStore's writer is the store itself: nothing to grant.
        Ok(())
    }
}

impl StoreTx for MemTx {
    async fn manifests(&mut self) -> Result<Vec<Manifest>, StoreError> {
        Ok(self.work.manifests.clone())
    }

    async fn applied_configs(&mut self) -> Result<Vec<String>, StoreError> {
        if self.work.forgets_applied_configs {
            return Ok(Vec::new());
        }
        Ok(self.work.applied_configs.clone())
    }

    async fn apply_config(&mut self, fingerprint: &str) -> Result<(), StoreError> {
        let applied = &mut self.work.applied_configs;
        applied.retain(|f| f != fingerprint);
        applied.push(fingerprint.to_owned());
        Ok(())
    }

    async fn insert_manifest(&mut self, m: &Manifest) -> Result<(), StoreError> {
        if self
            .work
            .manifests
            .last()
            .is_some_and(|last| last.schema_version() >= m.schema_version())
        {
            return Err(StoreError::Integrity(
                "manifest versions must increase".into(),
            ));
        }
        self.work.manifests.push(m.clone());
        Ok(())
    }

    async fn lock_client(&mut self, client_id: &str) -> Result<Option<ClientRecord>, StoreError> {
        storable(&[client_id])?;
        Ok(self.work.clients.get(client_id).cloned())
    }

    async fn insert_client(&mut self, c: &ClientRecord) -> Result<bool, StoreError> {
        storable(&[&c.client_id, &c.user_id])?;
        if self.work.clients.contains_key(&c.client_id) {
            return Ok(false);
        }
        self.work.clients.insert(c.client_id.clone(), c.clone());
        Ok(true)
    }

    async fn count_registrations(
        &mut self,
        user_id: &str,
        since_micros: i64,
    ) -> Result<u64, StoreError> {
        let n = (self.work.clients.values())
            .filter(|c| c.user_id == user_id && c.registered_at >= since_micros)
            .count();
        Ok(n as u64)
    }

    async fn put_client(&mut self, c: &ClientRecord) -> Result<(), StoreError> {
        storable(&[&c.client_id, &c.user_id])?;
        match self.work.clients.get_mut(&c.client_id) {
            Some(bound) if bound.user_id == c.user_id => {
                // The binding's time is the first connect's, for ever.
                let registered_at = bound.registered_at;
                *bound = ClientRecord {
                    registered_at,
                    ..c.clone()
                };
                Ok(())
            }
            _ => Err(StoreError::Integrity(
                "a client record replaced without its binding".into(),
            )),
        }
    }

    async fn grants(&mut self, user_id: &str) -> Result<Vec<String>, StoreError> {
        storable(&[user_id])?;
        Ok(self
            .work
            .grants
            .iter()
            .filter(|(u, _)| u == user_id)
            .map(|(_, s)| s.clone())
            .collect())
    }

    async fn dependency_values(
        &mut self,
        source: &DependencyAssignment,
        user_id: &str,
    ) -> Result<Vec<String>, StoreError> {
        let key = (
            source.relation.clone(),
            source.user_column.clone(),
            source.value_column.clone(),
        );
        let rows = self
            .work
            .dependencies
            .get(&key)
            .map(Vec::as_slice)
            .unwrap_or_default();
        Ok(rows
            .iter()
            .filter(|(u, _)| u == user_id)
            .map(|(_, v)| v.clone())
            .collect())
    }

    async fn capture_progress(&mut self) -> Result<CaptureProgress, StoreError> {
        Ok(MemTx::capture_progress(self))
    }

    async fn record_heartbeat(&mut self, beat: &Heartbeat) -> Result<(), StoreError> {
        let now = tokio::time::Instant::now();
        let c = &mut self.work.capture;
        let caught_up = if beat.caught_up {
            Some(now)
        } else {
            c.heartbeat.and_then(|(_, caught_up, _)| caught_up)
        };
        c.heartbeat = Some((now, caught_up, beat.lag_bytes));
        // Capture's own writes are WAL too, with no source transaction in it.
        c.write_wal();
        Ok(())
    }

    async fn capture_health(&mut self) -> Result<CaptureHealth, StoreError> {
        let now = tokio::time::Instant::now();
        let c = &self.work.capture;
        let age = |t: tokio::time::Instant| now.saturating_duration_since(t);
        Ok(CaptureHealth {
            heartbeat_age: c.heartbeat.map(|(at, _, _)| age(at)),
            caught_up_age: c.heartbeat.and_then(|(_, caught_up, _)| caught_up.map(age)),
            lag_bytes: c.heartbeat.map_or(0, |(_, _, lag)| lag),
            blocked: c.progress.quarantine.is_some() || c.progress.baseline_owed,
        })
    }

    async fn scope_members(
        &mut self,
        scope: &ScopeId,
    ) -> Result<Vec<(RowIdentity, Digest)>, StoreError> {
        MemTx::scope_members(self, scope)
    }

    async fn scope_size(&mut self, scope: &ScopeId) -> Result<u64, StoreError> {
        Ok(MemTx::scope_size(self, scope))
    }

    async fn has_stale_projections(&mut self, schema_version: u64) -> Result<bool, StoreError> {
        Ok(MemTx::has_stale_projections(self, schema_version))
    }

    async fn stale_scope_members(
        &mut self,
        scope: &ScopeId,
        schema_version: u64,
    ) -> Result<Vec<Projection>, StoreError> {
        MemTx::stale_scope_members(self, scope, schema_version)
    }

    async fn projections(
        &mut self,
        table_id: &str,
        rows: &[RowIdentity],
    ) -> Result<Vec<Projection>, StoreError> {
        Ok(MemTx::projections(self, table_id, rows))
    }

    async fn dependency_rows_by_identity(
        &mut self,
        relation: &str,
        identities: &[String],
    ) -> Result<Vec<DependencyRow>, StoreError> {
        Ok(identities
            .iter()
            .filter_map(|i| MemTx::dependency_row(self, relation, i))
            .collect())
    }

    async fn dependency_rows(
        &mut self,
        relation: &str,
        column: &str,
        values: &[String],
    ) -> Result<Vec<DependencyRow>, StoreError> {
        Ok(MemTx::dependency_rows(self, relation, column, values))
    }

    async fn materialize(&mut self, m: &Materialization) -> Result<(), StoreError> {
        MemTx::materialize(self, m)?;
        self.satisfied.extend_from_slice(&m.fences);
        Ok(())
    }

    async fn reset_stream(&mut self) -> Result<u64, StoreError> {
        let w = &mut self.work;
        w.stream = StreamState {
            generation: w.stream.generation + 1,
            retention_generation: w.stream.retention_generation + 1,
            ..StreamState::default()
        };
        w.checkpoints.clear();
        w.rebuilds.sweep_all();
        w.capture.reset_stream();
        Ok(w.stream.generation)
    }

    async fn record_baseline_chunk(&mut self, index: u64) -> Result<(), StoreError> {
        MemTx::record_baseline_chunk(self, index)
    }

    async fn hand_over_baseline(&mut self) -> Result<(), StoreError> {
        MemTx::hand_over_baseline(self)
    }

    async fn complete_baseline(&mut self, covered_fences: &[u64]) -> Result<(), StoreError> {
        MemTx::complete_baseline(self, covered_fences)?;
        self.satisfied.extend_from_slice(covered_fences);
        Ok(())
    }

    async fn quarantine(
        &mut self,
        q: &Quarantine,
        stream_generation: u64,
    ) -> Result<(), StoreError> {
        self.same_generation(stream_generation)?;
        MemTx::quarantine(self, q);
        Ok(())
    }

    async fn forget_table(&mut self, table_id: &str) -> Result<u64, StoreError> {
        let c = &mut self.work.capture;
        let before = c.projections.len();
        c.projections.retain(|(t, _), _| t != table_id);
        c.members.retain(|_, t| t != table_id);
        c.forget_effects(table_id);
        Ok((before - c.projections.len()) as u64)
    }

    async fn rematerializations(&mut self) -> Result<Vec<Rematerialization>, StoreError> {
        let records = &self.work.capture.rematerializations;
        Ok(records.values().cloned().collect())
    }

    async fn put_rematerializations(
        &mut self,
        records: &[Rematerialization],
    ) -> Result<(), StoreError> {
        for r in records {
            (self.work.capture.rematerializations).insert(r.relation.clone(), r.clone());
        }
        Ok(())
    }

    async fn stream_state(&mut self) -> Result<StreamState, StoreError> {
        Ok(self.work.stream)
    }

    async fn membership_rules(&mut self) -> Result<Vec<MembershipRules>, StoreError> {
        Ok(self.work.membership_rules.clone())
    }

    async fn insert_membership_rules(
        &mut self,
        rules: &[MembershipRules],
    ) -> Result<(), StoreError> {
        for r in rules {
            let stored = &self.work.membership_rules;
            if stored
                .iter()
                .any(|s| s.table_id == r.table_id && s.generation == r.generation)
            {
                return Err(StoreError::Integrity(
                    "a rule generation stored twice".into(),
                ));
            }
            self.work.membership_rules.push(r.clone());
        }
        Ok(())
    }

    async fn token_keys(&mut self) -> Result<Vec<TokenKey>, StoreError> {
        Ok(self.work.token_keys.clone())
    }

    async fn insert_token_keys(&mut self, keys: &[TokenKey]) -> Result<(), StoreError> {
        if self.work.token_keys.is_empty() {
            self.work.token_keys = keys.to_vec();
        }
        Ok(())
    }

    async fn rotate_token_keys(&mut self, fresh: &[TokenKey]) -> Result<(), StoreError> {
        let keys = &mut self.work.token_keys;
        if fresh
            .iter()
            .any(|f| keys.iter().any(|k| k.key_id == f.key_id))
        {
            return Err(StoreError::Integrity("a token key ID stored twice".into()));
        }
        for k in keys.iter_mut() {
            k.state = KeyState::VerifyOnly;
        }
        if self.work.rotation_forgets_keys {
            keys.clear();
        }
        keys.extend(fresh.iter().cloned());
        Ok(())
    }

    async fn drop_token_key(&mut self, key_id: &str) -> Result<bool, StoreError> {
        let keys = &mut self.work.token_keys;
        let before = keys.len();
        keys.retain(|k| k.key_id != key_id || k.state == KeyState::Active);
        Ok(keys.len() < before)
    }

    async fn checkpoints(
        &mut self,
        client_id: &str,
    ) -> Result<BTreeMap<ScopeId, Checkpoint>, StoreError> {
        Ok(self
            .work
            .checkpoints
            .iter()
            .filter(|((c, _), _)| c == client_id)
            .map(|((_, s), (p, _))| (s.clone(), *p))
            .collect())
    }

    async fn put_checkpoints(
        &mut self,
        client_id: &str,
        checkpoints: &[(ScopeId, Checkpoint)],
    ) -> Result<(), StoreError> {
        let now = tokio::time::Instant::now();
        for (scope, p) in checkpoints {
            self.work
                .checkpoints
                .insert((client_id.to_owned(), scope.clone()), (*p, now));
        }
        self.wrote_checkpoints = true;
        Ok(())
    }

    async fn retention_hold(
        &mut self,
        stream_generation: u64,
        window: std::time::Duration,
    ) -> Result<Option<StreamPosition>, StoreError> {
        let w = &self.work;
        let now = tokio::time::Instant::now();
        let recent = |at: tokio::time::Instant| now.saturating_duration_since(at) < window;
        let active = |client: &str| w.clients.get(client).is_some_and(|c| !c.retired);
        let checkpoints = (w.checkpoints.iter())
            .filter(|((c, _), (k, at))| {
                active(c) && k.stream_generation == stream_generation && recent(*at)
            })
            .map(|(_, (k, _))| k.position);
        let sessions = (w.rebuilds.begun(stream_generation))
            .filter(|(s, at)| active(&s.client_id) && recent(*at))
            .filter(|(s, at)| {
                (w.checkpoints.get(&(s.client_id.clone(), s.scope.clone())))
                    .is_none_or(|(k, acked)| k.stream_generation != stream_generation || acked < at)
            })
            .map(|(s, _)| StreamPosition::from(s.boundary));
        let floor = w.stream.floor;
        Ok(checkpoints.chain(sessions).filter(|p| *p >= floor).min())
    }

    async fn advance_floor(&mut self, floor: StreamPosition) -> Result<(), StoreError> {
        let stream = &mut self.work.stream;
        stream.floor = stream.floor.max(floor);
        Ok(())
    }

    async fn compact_below_floor(&mut self, max: usize) -> Result<usize, StoreError> {
        let floor = self.work.stream.floor;
        Ok(MemTx::compact_below(self, floor, max))
    }

    async fn forget_transactions_below_floor(&mut self, max: usize) -> Result<usize, StoreError> {
        let floor = self.work.stream.floor;
        Ok(self.work.capture.forget_transactions_below(floor, max))
    }

    async fn retire_client(&mut self, client_id: &str) -> Result<bool, StoreError> {
        let w = &mut self.work;
        let Some(c) = w.clients.get_mut(client_id) else {
            return Ok(false);
        };
        c.retired = true;
        let user = c.user_id.clone();
        w.checkpoints.retain(|(c, _), _| c != client_id);
        w.rebuilds.forget_client(client_id);
        w.ledger.forget_client(&user, client_id);
        Ok(true)
    }

    async fn pending_fences(
        &mut self,
        client_id: &str,
        max: usize,
    ) -> Result<Vec<u64>, StoreError> {
        let c = &self.work.capture;
        if c.fences_unseen {
            return Ok(Vec::new());
        }
        Ok(c.pending_fences
            .iter()
            .filter(|(f, c_id)| *c_id == client_id && !c.satisfied_fences.contains(f))
            .map(|(f, _)| *f)
            .take(max)
            .collect())
    }

    async fn reconcile_fences(&mut self) -> Result<u64, StoreError> {
        let c = &mut self.work.capture;
        let paired: Vec<u64> = (c.satisfied_fences.iter())
            .filter(|f| c.pending_fences.contains_key(f))
            .copied()
            .collect();
        for f in &paired {
            c.pending_fences.remove(f);
            c.satisfied_fences.remove(f);
        }
        Ok(paired.len() as u64)
    }

    async fn scope_candidates(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
        max: usize,
    ) -> Result<Vec<Effect>, StoreError> {
        MemTx::scope_candidates(self, scope, after, through, max)
    }

    async fn last_effect_before(
        &mut self,
        scope: &ScopeId,
        before: StreamPosition,
    ) -> Result<Option<StreamPosition>, StoreError> {
        Ok(MemTx::last_effect_before(self, scope, before))
    }

    async fn scope_effects(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
    ) -> Result<Vec<Effect>, StoreError> {
        MemTx::scope_effects(self, scope, after, through)
    }

    async fn rebuild_session(
        &mut self,
        client_id: &str,
        rebuild_id: &CanonicalUuid,
    ) -> Result<Option<RebuildSession>, StoreError> {
        Ok(MemTx::rebuild_session(self, client_id, rebuild_id))
    }

    async fn stage_rebuild(
        &mut self,
        session: &RebuildSession,
        digests: &[(RowIdentity, Digest)],
    ) -> Result<u64, StoreError> {
        MemTx::stage_rebuild(self, session, digests)
    }

    async fn staged_digests(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<(RowIdentity, Digest)>, StoreError> {
        MemTx::staged_digests(self, session_id, from, max)
    }

    async fn seal_rebuild_session(
        &mut self,
        session_id: &CanonicalUuid,
        digest: &Digest,
    ) -> Result<(), StoreError> {
        MemTx::seal_rebuild_session(self, session_id, digest)
    }

    async fn staged_rows(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<StagedRow>, StoreError> {
        MemTx::staged_rows(self, session_id, from, max)
    }

    async fn supersede_rebuild_sessions(
        &mut self,
        client_id: &str,
        scope: &ScopeId,
        now_micros: i64,
    ) -> Result<u64, StoreError> {
        Ok(MemTx::supersede_rebuild_sessions(
            self, client_id, scope, now_micros,
        ))
    }

    async fn rebuild_usage(
        &mut self,
        user_id: &str,
        now_micros: i64,
    ) -> Result<RebuildUsage, StoreError> {
        Ok(MemTx::rebuild_usage(self, user_id, now_micros))
    }

    async fn sweep_rebuild_sessions(
        &mut self,
        now_micros: i64,
        max: usize,
    ) -> Result<u64, StoreError> {
        Ok(MemTx::sweep_rebuild_sessions(self, now_micros, max))
    }

    async fn forget_rebuild_sessions(
        &mut self,
        expired_before: i64,
        max: usize,
    ) -> Result<u64, StoreError> {
        Ok(MemTx::forget_rebuild_sessions(self, expired_before, max))
    }

    async fn push_ledger(
        &mut self,
        user_id: &str,
        client_id: &str,
        batch_id: CanonicalUuid,
        mutation_ids: &[CanonicalUuid],
    ) -> Result<LedgerEntries, StoreError> {
        Ok(MemTx::push_ledger(
            self,
            user_id,
            client_id,
            batch_id,
            mutation_ids,
        ))
    }

    async fn record_push(&mut self, r: &PushRecord) -> Result<(), StoreError> {
        MemTx::record_push(self, r)
    }

    async fn begin_writes(&mut self, w: &Writer) -> Result<(), StoreError> {
        MemTx::begin_writes(self, w);
        Ok(())
    }

    async fn find_rows(
        &mut self,
        target: &WriteTarget,
        keys: &[String],
    ) -> Result<Vec<FoundRow>, StoreError> {
        MemTx::find_rows(self, target, keys)
    }

    async fn write_row(
        &mut self,
        target: &WriteTarget,
        key: &str,
        write: &RowWrite,
    ) -> Result<WriteResult, StoreError> {
        MemTx::write_row(self, target, key, write)
    }

    async fn write_rows(
        &mut self,
        target: &WriteTarget,
        writes: &[(String, RowWrite)],
    ) -> Result<Option<Vec<WriteResult>>, StoreError> {
        let before = self.work.clone();
        let mut results = Vec::with_capacity(writes.len());
        for (key, write) in writes {
            let r = MemTx::write_row(self, target, key, write)?;
            if !matches!(r, WriteResult::Written { .. }) {
                self.work = before;
                return Ok(None);
            }
            results.push(r);
        }
        Ok(Some(results))
    }

    async fn mark_group(&mut self) -> Result<(), StoreError> {
        self.group = Some(Box::new(self.work.clone()));
        Ok(())
    }

    async fn check_constraints(&mut self) -> Result<Option<Refusal>, StoreError> {
        Ok(None) // no deferred constraints: every write was checked as it happened
    }

    async fn undo_group(&mut self) -> Result<(), StoreError> {
        let group = self
            .group
            .take()
            .ok_or(StoreError::Integrity("no group to undo".into()))?;
        self.work = *group;
        Ok(())
    }

    async fn end_writes(&mut self) -> Result<(), StoreError> {
        MemTx::end_writes(self);
        Ok(())
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        let fail = self.wrote_checkpoints
            && self
                .failing_checkpoint_commits
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
        if fail {
            return Err(StoreError::Unavailable("the connection was lost".into()));
        }
        self.work.capture.writer = None;
        let log_len = self.work.capture.commit_source();
        let MemTx {
            mut guard,
            mut work,
            log_len: sender,
            slot_lost,
            fence_visibility_lag_ms,
            satisfied,
            fence_reports,
            ..
        } = self;
        let lag = fence_visibility_lag_ms.load(Ordering::SeqCst);
        let mut hidden = Vec::new();
        if lag > 0 && log_len.is_some() {
            let before = &guard.capture.pending_fences;
            hidden = (work.capture.pending_fences.keys())
                .filter(|f| !before.contains_key(f))
                .copied()
                .collect();
            work.capture
                .hide_fences(&hidden, std::time::Duration::from_millis(lag));
        }
        slot_lost.store(work.capture.slot_lost, Ordering::Release);
        *guard = work;
        guard.capture.reveal_fences();
        if let Some(n) = log_len {
            sender.send_replace(n);
        }
        if let Some(reports) = fence_reports.filter(|_| !satisfied.is_empty()) {
            // No listener is no one to tell.
            let _ = reports.send(satisfied.into());
        }
        if !hidden.is_empty() {
            // Decoded, not yet visible: the commit returns once its fences
            // are. Any transaction that begins reveals those that are due,
            // so a crash of this server leaves none hidden for ever.
            let state = OwnedMutexGuard::mutex(&guard).clone();
            drop(guard);
            loop {
                let mut s = state.lock().await;
                s.capture.reveal_fences();
                if !s.capture.hidden(&hidden) {
                    break;
                }
                drop(s);
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
        Ok(())
    }
}

/// PostgreSQL text cannot hold U+0000: a request value with one is refused.
fn storable(texts: &[&str]) -> Result<(), StoreError> {
    if texts.iter().any(|t| t.contains('\0')) {
        return Err(StoreError::Data(
            "the database refused a value (22021)".into(),
        ));
    }
    Ok(())
}
