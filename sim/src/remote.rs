//! The database as its own node: a `Store` whose every operation is a
//! message over the simulated network to a node that holds the `MemStore`.
//! Lost messages become `StoreError::Unavailable`. A transaction whose owner
//! went silent (crashed server, lost commit) is rolled back by the database
//! after an idle timeout, as PostgreSQL does when a connection dies. A lost
//! commit reply is a commit-unknown result.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actors::capture::{
    Baseline, CaptureHealth, CapturePlan, CaptureProblem, CaptureProgress, ChangeFeed,
    DependencyRow, Effect, Heartbeat, Lsn, Materialization, Projection, Quarantine,
    Rematerialization, RereadChunk, RereadRequest, SourceTransaction,
};
use actors::config::DependencyAssignment;
use actors::ledger::contract::{
    FoundRow, LedgerEntries, PushRecord, Refusal, RowWrite, WriteResult, WriteTarget, Writer,
};
use actors::staging::{RebuildSession, RebuildUsage, StagedRow};
use actors::store::{
    ClientRecord, FenceListener, FenceReport, MemStore, Store, StoreError, StoreTx,
};
use actors::stream::{Checkpoint, MembershipRules, StreamState};
use madsim::net::Endpoint;
use madsim::rand::{Rng, thread_rng};
use madsim::time::{Instant, sleep, timeout};
use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{CanonicalUuid, ScopeId};
use protocol::manifest::Manifest;
use protocol::position::{Boundary, StreamPosition};
use protocol::token::TokenKey;
use tokio::sync::mpsc;

use crate::tripwire::{CrashPoint, Tripwire};

/// Where the database node listens.
pub const DATABASE: &str = "10.0.0.2:7001";
const DB_REQUEST: u64 = 11;
const DB_REPLY: u64 = 12;
/// How long the server waits for one database answer.
const ANSWER_TIMEOUT: Duration = Duration::from_millis(300);
/// Sends of one transaction operation before its connection counts as
/// lost; each waits a share of `ANSWER_TIMEOUT`. A database connection is a
/// reliable stream: a lost datagram costs latency, not the transaction.
const TX_TRANSMISSIONS: u32 = 3;
/// The chance that a database connection is closed at an operation: the
/// operation may or may not have run, and no answer comes (at a commit,
/// a commit-unknown result). The database rolls the rest back at once; a
/// crashed server's transactions wait for the idle timeout.
const CONNECTION_DROP: f64 = 0.005;
/// How long the database keeps a silent transaction open. A live owner sends
/// its next operation within one round trip; an owner that gave up (after
/// `ANSWER_TIMEOUT`) or crashed is rolled back soon after.
const IDLE_TIMEOUT: Duration = Duration::from_millis(400);

/// One operation inside a transaction.
#[derive(Clone)]
enum Op {
    Manifests,
    InsertManifest(Manifest),
    AppliedConfigs,
    ApplyConfig(String),
    LockClient(String),
    InsertClient(ClientRecord),
    CountRegistrations(String, i64),
    PutClient(ClientRecord),
    Grants(String),
    DependencyValues(DependencyAssignment, String),
    CaptureProgress,
    RecordHeartbeat(Heartbeat),
    CaptureHealth,
    ScopeMembers(ScopeId),
    ScopeSize(ScopeId),
    Projections(String, Vec<RowIdentity>),
    HasStaleProjections(u64),
    StaleScopeMembers(ScopeId, u64),
    DependencyRowsById(String, Vec<String>),
    DependencyRows(String, String, Vec<String>),
    Materialize(Box<Materialization>),
    Quarantine(Quarantine, u64),
    RecordBaselineChunk(u64),
    HandOverBaseline,
    CompleteBaseline(Vec<u64>),
    Rematerializations,
    PutRematerializations(Vec<Rematerialization>),
    ForgetTable(String),
    ResetStream,
    ScopeEffects(ScopeId, StreamPosition, Boundary),
    StreamState,
    MembershipRules,
    InsertMembershipRules(Vec<MembershipRules>),
    TokenKeys,
    InsertTokenKeys(Vec<TokenKey>),
    RotateTokenKeys(Vec<TokenKey>),
    DropTokenKey(String),
    Checkpoints(String),
    PutCheckpoints(String, Vec<(ScopeId, Checkpoint)>),
    PendingFences(String, usize),
    RetentionHold(u64, std::time::Duration),
    AdvanceFloor(StreamPosition),
    CompactBelowFloor(usize),
    ForgetTransactionsBelowFloor(usize),
    RetireClient(String),
    ReconcileFences,
    ScopeCandidates(ScopeId, StreamPosition, Boundary, usize),
    LastEffectBefore(ScopeId, StreamPosition),
    RebuildSession(String, CanonicalUuid),
    StageRebuild(Box<RebuildSession>, Vec<(RowIdentity, Digest)>),
    StagedDigests(CanonicalUuid, u64, usize),
    SupersedeRebuildSessions(String, ScopeId, i64),
    RebuildUsage(String, i64),
    SealRebuildSession(CanonicalUuid, Digest),
    StagedRows(CanonicalUuid, u64, usize),
    SweepRebuildSessions(i64, usize),
    ForgetRebuildSessions(i64, usize),
    PushLedger(String, String, CanonicalUuid, Vec<CanonicalUuid>),
    RecordPush(Box<PushRecord>),
    BeginWrites(Writer),
    FindRows(Box<WriteTarget>, Vec<String>),
    WriteRow(Box<WriteTarget>, String, RowWrite),
    WriteRows(Box<WriteTarget>, Vec<(String, RowWrite)>),
    MarkGroup,
    CheckConstraints,
    UndoGroup,
    EndWrites,
    Commit,
    /// The owner dropped the transaction: roll back now (a closed connection).
    Rollback,
}

#[derive(Clone)]
enum Answer {
    Manifests(Result<Vec<Manifest>, StoreError>),
    AppliedConfigs(Result<Vec<String>, StoreError>),
    Unit(Result<(), StoreError>),
    Client(Result<Option<ClientRecord>, StoreError>),
    Inserted(Result<bool, StoreError>),
    Strings(Result<Vec<String>, StoreError>),
    Progress(Result<CaptureProgress, StoreError>),
    Health(Result<CaptureHealth, StoreError>),
    Members(Result<Vec<(RowIdentity, Digest)>, StoreError>),
    Projections(Result<Vec<Projection>, StoreError>),
    Dependencies(Result<Vec<DependencyRow>, StoreError>),
    Effects(Result<Vec<Effect>, StoreError>),
    Stream(Result<StreamState, StoreError>),
    Rules(Result<Vec<MembershipRules>, StoreError>),
    Keys(Result<Vec<TokenKey>, StoreError>),
    Checkpoints(Result<BTreeMap<ScopeId, Checkpoint>, StoreError>),
    Position(Result<Option<StreamPosition>, StoreError>),
    Session(Result<Option<RebuildSession>, StoreError>),
    Count(Result<u64, StoreError>),
    Fences(Result<Vec<u64>, StoreError>),
    Usage(Result<RebuildUsage, StoreError>),
    Staged(Result<Vec<StagedRow>, StoreError>),
    Ledger(Result<LedgerEntries, StoreError>),
    Found(Result<Vec<FoundRow>, StoreError>),
    Written(Result<WriteResult, StoreError>),
    WrittenAll(Result<Option<Vec<WriteResult>>, StoreError>),
    Refusal(Result<Option<Refusal>, StoreError>),
    Check(Result<Option<CaptureProblem>, StoreError>),
    /// The new stream generation of a reset.
    Generation(Result<u64, StoreError>),
    /// A feed: opened (leader), with the baseline it owes, or refused (standby).
    Feed(Result<Option<Option<Baseline>>, StoreError>),
    Rematerializations(Result<Vec<Rematerialization>, StoreError>),
    Reread(Result<RereadChunk, StoreError>),
    /// The next transaction if one came, and the feed's source end.
    FeedNext(Result<FeedNext, StoreError>),
    /// The next fence report, if one came within the poll.
    Heard(Option<FenceReport>),
}

/// One operation on a change feed held open on the database node.
#[derive(Clone)]
enum FeedOp {
    /// The next transaction, if one completes within this wait (at most `FEED_POLL`).
    Next(Duration),
    BaselineChunk,
    EndBaseline,
    Acknowledge(Lsn),
    Reread(RereadRequest),
}

enum Request {
    /// `give_up_at`: when the caller stops waiting (a lock timeout, in database terms).
    Begin {
        id: u64,
        give_up_at: Instant,
    },
    Op {
        id: u64,
        seq: u64,
        op: Op,
    },
    InstallCapture {
        id: u64,
        plan: CapturePlan,
    },
    CheckCapture {
        id: u64,
    },
    InstallPush {
        id: u64,
        targets: Vec<WriteTarget>,
    },
    /// Opens a feed (if this caller may lead capture).
    FeedOpen {
        id: u64,
    },
    Feed {
        id: u64,
        seq: u64,
        op: FeedOp,
    },
    /// Opens a listener for fence reports, like `LISTEN` on a connection.
    Listen {
        id: u64,
    },
    /// The listener's next report, waiting at most `FEED_POLL`.
    Heard {
        id: u64,
        seq: u64,
    },
}

/// Sends of one feed operation before its connection counts as lost.
const FEED_TRANSMISSIONS: usize = 3;

/// How long the database node waits for the next source transaction per poll.
const FEED_POLL: Duration = Duration::from_millis(100);

/// An answer to the request `(id, seq)`. The id matters: an ephemeral port
/// is reused by a later endpoint, which must not take a late answer meant
/// for the earlier one.
struct Reply {
    id: u64,
    seq: u64,
    answer: Option<Answer>, // `None` answers Begin
}

/// Starts the database node (at [`DATABASE`]) serving `store`.
pub fn database_node(
    handle: &madsim::runtime::Handle,
    store: MemStore,
) -> madsim::runtime::NodeHandle {
    handle
        .create_node()
        .name("database")
        .ip("10.0.0.2".parse().expect("ip"))
        .init(move || database_main(store.clone()))
        .build()
}

/// The database node's program.
pub async fn database_main(store: MemStore) {
    let ep = Arc::new(Endpoint::bind(DATABASE).await.expect("bind"));
    let mut open: BTreeMap<u64, mpsc::UnboundedSender<(u64, Op, SocketAddr)>> = BTreeMap::new();
    let mut feeds: BTreeMap<u64, mpsc::UnboundedSender<(u64, FeedOp, SocketAddr)>> =
        BTreeMap::new();
    let mut listeners: BTreeMap<u64, mpsc::UnboundedSender<(u64, SocketAddr)>> = BTreeMap::new();
    loop {
        let Ok((payload, from)) = ep.recv_from_raw(DB_REQUEST).await else {
            continue;
        };
        let Ok(request) = payload.downcast::<Request>() else {
            continue;
        };
        match *request {
            Request::Begin { id, give_up_at } => {
                let (tx, rx) = mpsc::unbounded_channel();
                open.retain(|_, s| !s.is_closed());
                open.insert(id, tx);
                madsim::task::spawn(transaction(
                    store.clone(),
                    ep.clone(),
                    from,
                    id,
                    give_up_at,
                    rx,
                ));
            }
            Request::Op { id, seq, op } => {
                if let Some(s) = open.get(&id) {
                    let _ = s.send((seq, op, from));
                }
            }
            Request::InstallCapture { id, plan } => {
                let (store, ep) = (store.clone(), ep.clone());
                madsim::task::spawn(async move {
                    let answer = Answer::Unit(store.install_capture(&plan).await);
                    reply(&ep, from, id, 0, answer).await;
                });
            }
            Request::InstallPush { id, targets } => {
                let (store, ep) = (store.clone(), ep.clone());
                madsim::task::spawn(async move {
                    let answer = Answer::Unit(store.install_push(&targets).await);
                    reply(&ep, from, id, 0, answer).await;
                });
            }
            Request::CheckCapture { id } => {
                let (store, ep) = (store.clone(), ep.clone());
                madsim::task::spawn(async move {
                    let answer = Answer::Check(store.check_capture().await);
                    reply(&ep, from, id, 0, answer).await;
                });
            }
            Request::FeedOpen { id } => {
                let (tx, rx) = mpsc::unbounded_channel();
                feeds.retain(|_, s| !s.is_closed());
                feeds.insert(id, tx);
                madsim::task::spawn(serve_feed(store.clone(), ep.clone(), from, id, rx));
            }
            Request::Feed { id, seq, op } => {
                if let Some(s) = feeds.get(&id) {
                    let _ = s.send((seq, op, from));
                }
            }
            Request::Listen { id } => {
                let (tx, rx) = mpsc::unbounded_channel();
                listeners.retain(|_, s| !s.is_closed());
                listeners.insert(id, tx);
                madsim::task::spawn(serve_listener(store.clone(), ep.clone(), from, id, rx));
            }
            Request::Heard { id, seq } => {
                if let Some(s) = listeners.get(&id) {
                    let _ = s.send((seq, from));
                }
            }
        }
    }
}

/// One fence listener on the database node. Like a connection, it is a
/// reliable stream that dies when its owner stays silent: a poll sent
/// again is answered again from this copy, never with the next report.
async fn serve_listener(
    store: MemStore,
    ep: Arc<Endpoint>,
    owner: SocketAddr,
    id: u64,
    mut polls: mpsc::UnboundedReceiver<(u64, SocketAddr)>,
) {
    let mut listener = match store.fence_listener().await {
        Ok(listener) => listener,
        Err(e) => return reply(&ep, owner, id, 0, Answer::Unit(Err(e))).await,
    };
    reply(&ep, owner, id, 0, Answer::Unit(Ok(()))).await;
    let mut last: Option<(u64, Option<FenceReport>)> = None;
    loop {
        let Ok(Some((seq, from))) = timeout(IDLE_TIMEOUT, polls.recv()).await else {
            return;
        };
        if let Some((done, report)) = &last {
            if seq < *done {
                continue; // a stale retransmission
            }
            if seq == *done {
                reply(&ep, from, id, seq, Answer::Heard(report.clone())).await;
                continue;
            }
        }
        let report = match timeout(FEED_POLL, listener.next()).await {
            Ok(Ok(report)) => Some(report),
            Ok(Err(_)) => Some(FenceReport::Missed),
            Err(_) => None,
        };
        reply(&ep, from, id, seq, Answer::Heard(report.clone())).await;
        last = Some((seq, report));
    }
}

async fn reply(ep: &Endpoint, to: SocketAddr, id: u64, seq: u64, answer: Answer) {
    let _ = ep
        .send_to_raw(
            to,
            DB_REPLY,
            Box::new(Reply {
                id,
                seq,
                answer: Some(answer),
            }),
        )
        .await;
}

/// One feed on the database node. Like a replication connection, it dies
/// (releasing capture leadership) when its owner stays silent.
async fn serve_feed(
    store: MemStore,
    ep: Arc<Endpoint>,
    owner: SocketAddr,
    id: u64,
    mut ops: mpsc::UnboundedReceiver<(u64, FeedOp, SocketAddr)>,
) {
    let mut feed = match store.change_feed().await {
        Ok(Some(feed)) => feed,
        Ok(None) => return reply(&ep, owner, id, 0, Answer::Feed(Ok(None))).await,
        Err(e) => return reply(&ep, owner, id, 0, Answer::Feed(Err(e))).await,
    };
    let opened = feed.baseline().cloned();
    reply(&ep, owner, id, 0, Answer::Feed(Ok(Some(opened)))).await;
    // A replication connection is a reliable stream: a lost datagram is sent
    // again with its sequence number, and answered again from this copy.
    let mut last: Option<(u64, FeedAnswer)> = None;
    loop {
        let Ok(Some((seq, op, from))) = timeout(IDLE_TIMEOUT, ops.recv()).await else {
            return; // dropped: leadership released
        };
        if let Some((done, answer)) = &last {
            if seq < *done {
                continue; // a stale retransmission
            }
            if seq == *done {
                reply(&ep, from, id, seq, answer.to_answer()).await;
                continue;
            }
        }
        let answer = match op {
            FeedOp::Next(wait) => match feed.next(wait.min(FEED_POLL)).await {
                Ok(t) => FeedAnswer::Next(Ok((t, feed.source_end(), feed.idle_end()))),
                Err(e) => FeedAnswer::Next(Err(e)),
            },
            FeedOp::BaselineChunk => match feed.baseline_chunk().await {
                Ok(t) => FeedAnswer::Next(Ok((t, feed.source_end(), None))),
                Err(e) => FeedAnswer::Next(Err(e)),
            },
            FeedOp::EndBaseline => {
                feed.end_baseline().await;
                FeedAnswer::Unit(Ok(()))
            }
            FeedOp::Acknowledge(end) => FeedAnswer::Unit(feed.acknowledge(end).await),
            FeedOp::Reread(req) => FeedAnswer::Reread(feed.reread(&req).await),
        };
        reply(&ep, from, id, seq, answer.to_answer()).await;
        last = Some((seq, answer));
    }
}

/// A feed answer kept for retransmission.
enum FeedAnswer {
    Next(Result<(Option<SourceTransaction>, Lsn, Option<Lsn>), StoreError>),
    Unit(Result<(), StoreError>),
    Reread(Result<RereadChunk, StoreError>),
}

impl FeedAnswer {
    fn to_answer(&self) -> Answer {
        match self {
            FeedAnswer::Next(r) => {
                Answer::FeedNext(r.clone().map(|(t, end, idle)| (t.map(Box::new), end, idle)))
            }
            FeedAnswer::Unit(r) => Answer::Unit(r.clone()),
            FeedAnswer::Reread(r) => Answer::Reread(r.clone()),
        }
    }
}

/// One transaction on the database node: begins, serves operations in order,
/// and rolls back when its owner stays silent.
async fn transaction(
    store: MemStore,
    ep: Arc<Endpoint>,
    owner: SocketAddr,
    id: u64,
    give_up_at: Instant,
    mut ops: mpsc::UnboundedReceiver<(u64, Op, SocketAddr)>,
) {
    // A begin that gets the lock after its caller gave up is abandoned at once,
    // so stale begins cannot queue up and hold the lock in turn.
    let wait = give_up_at.saturating_duration_since(Instant::now());
    let Ok(Ok(mut tx)) = timeout(wait, store.begin()).await else {
        return;
    };
    let _ = ep
        .send_to_raw(
            owner,
            DB_REPLY,
            Box::new(Reply {
                id,
                seq: 0,
                answer: None,
            }),
        )
        .await;
    // The last answer, for a retransmission of its operation.
    let mut last: Option<(u64, Answer)> = None;
    loop {
        let Ok(Some((seq, op, from))) = timeout(IDLE_TIMEOUT, ops.recv()).await else {
            return; // dropped: rolled back
        };
        if let Some((done, answer)) = &last {
            if seq < *done {
                continue; // a stale retransmission
            }
            if seq == *done {
                reply(&ep, from, id, seq, answer.clone()).await;
                continue;
            }
        }
        let (answer, done) = match op {
            Op::Manifests => (Answer::Manifests(tx.manifests().await), false),
            Op::InsertManifest(m) => (Answer::Unit(tx.insert_manifest(&m).await), false),
            Op::AppliedConfigs => (Answer::AppliedConfigs(tx.applied_configs().await), false),
            Op::ApplyConfig(f) => (Answer::Unit(tx.apply_config(&f).await), false),
            Op::LockClient(c) => (Answer::Client(tx.lock_client(&c).await), false),
            Op::InsertClient(c) => (Answer::Inserted(tx.insert_client(&c).await), false),
            Op::CountRegistrations(u, since) => (
                Answer::Count(tx.count_registrations(&u, since).await),
                false,
            ),
            Op::SupersedeRebuildSessions(c, scope, now) => (
                Answer::Count(tx.supersede_rebuild_sessions(&c, &scope, now).await),
                false,
            ),
            Op::RebuildUsage(u, now) => (Answer::Usage(tx.rebuild_usage(&u, now).await), false),
            Op::PutClient(c) => (Answer::Unit(tx.put_client(&c).await), false),
            Op::Grants(u) => (Answer::Strings(tx.grants(&u).await), false),
            Op::DependencyValues(d, u) => {
                (Answer::Strings(tx.dependency_values(&d, &u).await), false)
            }
            Op::CaptureProgress => (Answer::Progress(tx.capture_progress().await), false),
            Op::RecordHeartbeat(b) => (Answer::Unit(tx.record_heartbeat(&b).await), false),
            Op::CaptureHealth => (Answer::Health(tx.capture_health().await), false),
            Op::ScopeMembers(s) => (Answer::Members(tx.scope_members(&s).await), false),
            Op::ScopeSize(s) => (Answer::Count(tx.scope_size(&s).await), false),
            Op::HasStaleProjections(v) => {
                (Answer::Inserted(tx.has_stale_projections(v).await), false)
            }
            Op::StaleScopeMembers(scope, v) => (
                Answer::Projections(tx.stale_scope_members(&scope, v).await),
                false,
            ),
            Op::Projections(t, rows) => {
                (Answer::Projections(tx.projections(&t, &rows).await), false)
            }
            Op::DependencyRowsById(r, ids) => (
                Answer::Dependencies(tx.dependency_rows_by_identity(&r, &ids).await),
                false,
            ),
            Op::DependencyRows(r, c, v) => (
                Answer::Dependencies(tx.dependency_rows(&r, &c, &v).await),
                false,
            ),
            Op::Materialize(m) => (Answer::Unit(tx.materialize(&m).await), false),
            Op::Quarantine(q, g) => (Answer::Unit(tx.quarantine(&q, g).await), false),
            Op::RecordBaselineChunk(i) => (Answer::Unit(tx.record_baseline_chunk(i).await), false),
            Op::HandOverBaseline => (Answer::Unit(tx.hand_over_baseline().await), false),
            Op::CompleteBaseline(f) => (Answer::Unit(tx.complete_baseline(&f).await), false),
            Op::ForgetTable(t) => (Answer::Count(tx.forget_table(&t).await), false),
            Op::Rematerializations => (
                Answer::Rematerializations(tx.rematerializations().await),
                false,
            ),
            Op::PutRematerializations(r) => {
                (Answer::Unit(tx.put_rematerializations(&r).await), false)
            }
            Op::ResetStream => (Answer::Generation(tx.reset_stream().await), false),
            Op::ScopeEffects(scope, after, through) => (
                Answer::Effects(tx.scope_effects(&scope, after, through).await),
                false,
            ),
            Op::StreamState => (Answer::Stream(tx.stream_state().await), false),
            Op::MembershipRules => (Answer::Rules(tx.membership_rules().await), false),
            Op::InsertMembershipRules(r) => {
                (Answer::Unit(tx.insert_membership_rules(&r).await), false)
            }
            Op::TokenKeys => (Answer::Keys(tx.token_keys().await), false),
            Op::InsertTokenKeys(k) => (Answer::Unit(tx.insert_token_keys(&k).await), false),
            Op::RotateTokenKeys(k) => (Answer::Unit(tx.rotate_token_keys(&k).await), false),
            Op::DropTokenKey(k) => (Answer::Inserted(tx.drop_token_key(&k).await), false),
            Op::Checkpoints(c) => (Answer::Checkpoints(tx.checkpoints(&c).await), false),
            Op::PutCheckpoints(c, p) => (Answer::Unit(tx.put_checkpoints(&c, &p).await), false),
            Op::PendingFences(c, max) => (Answer::Fences(tx.pending_fences(&c, max).await), false),
            Op::RetentionHold(g, w) => (Answer::Position(tx.retention_hold(g, w).await), false),
            Op::AdvanceFloor(f) => (Answer::Unit(tx.advance_floor(f).await), false),
            Op::CompactBelowFloor(max) => (
                Answer::Count(tx.compact_below_floor(max).await.map(|n| n as u64)),
                false,
            ),
            Op::ForgetTransactionsBelowFloor(max) => (
                Answer::Count(
                    tx.forget_transactions_below_floor(max)
                        .await
                        .map(|n| n as u64),
                ),
                false,
            ),
            Op::RetireClient(c) => (Answer::Inserted(tx.retire_client(&c).await), false),
            Op::ReconcileFences => (Answer::Count(tx.reconcile_fences().await), false),
            Op::ScopeCandidates(scope, after, through, max) => (
                Answer::Effects(tx.scope_candidates(&scope, after, through, max).await),
                false,
            ),
            Op::LastEffectBefore(scope, before) => (
                Answer::Position(tx.last_effect_before(&scope, before).await),
                false,
            ),
            Op::RebuildSession(c, r) => (Answer::Session(tx.rebuild_session(&c, &r).await), false),
            Op::StageRebuild(session, d) => {
                (Answer::Count(tx.stage_rebuild(&session, &d).await), false)
            }
            Op::StagedDigests(id, from, max) => (
                Answer::Members(tx.staged_digests(&id, from, max).await),
                false,
            ),
            Op::SealRebuildSession(id, d) => {
                (Answer::Unit(tx.seal_rebuild_session(&id, &d).await), false)
            }
            Op::StagedRows(id, from, max) => {
                (Answer::Staged(tx.staged_rows(&id, from, max).await), false)
            }
            Op::SweepRebuildSessions(now, max) => (
                Answer::Count(tx.sweep_rebuild_sessions(now, max).await),
                false,
            ),
            Op::ForgetRebuildSessions(before, max) => (
                Answer::Count(tx.forget_rebuild_sessions(before, max).await),
                false,
            ),
            Op::PushLedger(u, c, b, ids) => {
                (Answer::Ledger(tx.push_ledger(&u, &c, b, &ids).await), false)
            }
            Op::RecordPush(r) => (Answer::Unit(tx.record_push(&r).await), false),
            Op::BeginWrites(w) => (Answer::Unit(tx.begin_writes(&w).await), false),
            Op::FindRows(t, keys) => (Answer::Found(tx.find_rows(&t, &keys).await), false),
            Op::WriteRow(t, key, w) => (Answer::Written(tx.write_row(&t, &key, &w).await), false),
            Op::WriteRows(t, w) => (Answer::WrittenAll(tx.write_rows(&t, &w).await), false),
            Op::MarkGroup => (Answer::Unit(tx.mark_group().await), false),
            Op::CheckConstraints => (Answer::Refusal(tx.check_constraints().await), false),
            Op::UndoGroup => (Answer::Unit(tx.undo_group().await), false),
            Op::EndWrites => (Answer::Unit(tx.end_writes().await), false),
            Op::Commit => (Answer::Unit(Ok(())), true),
            Op::Rollback => return,
        };
        if done {
            let result = Answer::Unit(tx.commit().await);
            reply(&ep, from, id, seq, result.clone()).await;
            // Answers a retransmitted commit for a while, then is gone.
            while let Ok(Some((again, _, from))) = timeout(ANSWER_TIMEOUT, ops.recv()).await {
                if again == seq {
                    reply(&ep, from, id, seq, result.clone()).await;
                }
            }
            return;
        }
        reply(&ep, from, id, seq, answer.clone()).await;
        last = Some((seq, answer));
    }
}

/// The server side: a `Store` over the network.
#[derive(Clone)]
pub struct RemoteStore {
    next_id: Arc<AtomicU64>,
    tripwire: Option<Arc<Tripwire>>,
}

impl RemoteStore {
    /// A store that talks to [`DATABASE`]; `node` keeps transaction IDs of
    /// different server incarnations apart. Its transactions stop at the
    /// points `tripwire` arms, for the crasher to kill the server there.
    pub fn new(node: u64, tripwire: Option<Arc<Tripwire>>) -> RemoteStore {
        RemoteStore {
            next_id: Arc::new(AtomicU64::new(node << 40)),
            tripwire,
        }
    }
}

/// A transaction held open on the database node.
pub struct RemoteTx {
    ep: Arc<Endpoint>,
    id: u64,
    seq: u64,
    finished: bool,
    tripwire: Option<Arc<Tripwire>>,
}

impl Drop for RemoteTx {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // Like a closed connection: the database rolls back at once (if the message arrives).
        let (ep, id, seq) = (self.ep.clone(), self.id, self.seq + 1);
        madsim::task::spawn(async move {
            if let Ok(db) = DATABASE.parse::<SocketAddr>() {
                let request = Request::Op {
                    id,
                    seq,
                    op: Op::Rollback,
                };
                let _ = ep.send_to_raw(db, DB_REQUEST, Box::new(request)).await;
            }
        });
    }
}

fn lost() -> StoreError {
    StoreError::Unavailable("the database did not answer".into())
}

async fn answer(ep: &Endpoint, id: u64, seq: u64) -> Result<Option<Answer>, StoreError> {
    answer_within(ep, id, seq, ANSWER_TIMEOUT).await
}

async fn answer_within(
    ep: &Endpoint,
    id: u64,
    seq: u64,
    wait: Duration,
) -> Result<Option<Answer>, StoreError> {
    let arrival = async {
        loop {
            let Ok((payload, _)) = ep.recv_from_raw(DB_REPLY).await else {
                continue;
            };
            if let Ok(reply) = payload.downcast::<Reply>()
                && reply.id == id
                && reply.seq == seq
            {
                return reply.answer;
            }
        }
    };
    timeout(wait, arrival).await.map_err(|_| lost())
}

impl RemoteStore {
    /// One request outside any transaction, from a fresh endpoint, and its answer.
    async fn one_shot(&self, request: impl FnOnce(u64) -> Request) -> Result<Answer, StoreError> {
        let ep = Endpoint::bind("0.0.0.0:0").await.map_err(|_| lost())?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let db: SocketAddr = DATABASE.parse().map_err(|_| lost())?;
        ep.send_to_raw(db, DB_REQUEST, Box::new(request(id)))
            .await
            .map_err(|_| lost())?;
        answer(&ep, id, 0).await?.ok_or_else(lost)
    }
}

impl Store for RemoteStore {
    type Tx = RemoteTx;
    type Feed = RemoteFeed;
    type Fences = RemoteFenceListener;

    async fn fence_listener(&self) -> Result<RemoteFenceListener, StoreError> {
        let ep = Endpoint::bind("0.0.0.0:0").await.map_err(|_| lost())?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let db: SocketAddr = DATABASE.parse().map_err(|_| lost())?;
        ep.send_to_raw(db, DB_REQUEST, Box::new(Request::Listen { id }))
            .await
            .map_err(|_| lost())?;
        match answer(&ep, id, 0).await?.ok_or_else(lost)? {
            Answer::Unit(Ok(())) => Ok(RemoteFenceListener { ep, id, seq: 0 }),
            Answer::Unit(Err(e)) => Err(e),
            _ => Err(mismatch()),
        }
    }

    async fn install_capture(&self, plan: &CapturePlan) -> Result<(), StoreError> {
        let plan = plan.clone();
        match self
            .one_shot(|id| Request::InstallCapture { id, plan })
            .await?
        {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn install_push(&self, targets: &[WriteTarget]) -> Result<(), StoreError> {
        let targets = targets.to_vec();
        match self
            .one_shot(|id| Request::InstallPush { id, targets })
            .await?
        {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn check_capture(&self) -> Result<Option<CaptureProblem>, StoreError> {
        match self.one_shot(|id| Request::CheckCapture { id }).await? {
            Answer::Check(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn change_feed(&self) -> Result<Option<RemoteFeed>, StoreError> {
        let ep = Endpoint::bind("0.0.0.0:0").await.map_err(|_| lost())?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let db: SocketAddr = DATABASE.parse().map_err(|_| lost())?;
        ep.send_to_raw(db, DB_REQUEST, Box::new(Request::FeedOpen { id }))
            .await
            .map_err(|_| lost())?;
        // Opening a replication connection takes longer than one statement
        // (here: the store's lock, which its transactions hold).
        let opened = answer_within(&ep, id, 0, ANSWER_TIMEOUT * FEED_TRANSMISSIONS as u32).await;
        match opened?.ok_or_else(lost)? {
            Answer::Feed(Ok(Some(baseline))) => Ok(Some(RemoteFeed {
                ep,
                id,
                seq: 0,
                source_end: 0,
                idle_end: None,
                baseline,
                tripwire: self.tripwire.clone(),
            })),
            Answer::Feed(Ok(None)) => Ok(None),
            Answer::Feed(Err(e)) => Err(e),
            _ => Err(mismatch()),
        }
    }

    async fn begin_snapshot(&self) -> Result<RemoteTx, StoreError> {
        // The database node's MemStore runs transactions one at a time.
        self.begin().await
    }

    async fn fresh_secret(&self) -> Result<[u8; 32], StoreError> {
        use madsim::rand::RngCore;
        let mut secret = [0u8; 32];
        madsim::rand::thread_rng().fill_bytes(&mut secret);
        Ok(secret)
    }

    async fn begin(&self) -> Result<RemoteTx, StoreError> {
        let ep = Endpoint::bind("0.0.0.0:0").await.map_err(|_| lost())?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let db: SocketAddr = DATABASE.parse().map_err(|_| lost())?;
        let give_up_at = Instant::now() + ANSWER_TIMEOUT;
        ep.send_to_raw(db, DB_REQUEST, Box::new(Request::Begin { id, give_up_at }))
            .await
            .map_err(|_| lost())?;
        if let Err(e) = answer(&ep, id, 0).await {
            // The begin may have taken the lock after all: release it.
            let rollback = Request::Op {
                id,
                seq: 1,
                op: Op::Rollback,
            };
            let _ = ep.send_to_raw(db, DB_REQUEST, Box::new(rollback)).await;
            return Err(e);
        }
        Ok(RemoteTx {
            ep: Arc::new(ep),
            id,
            seq: 0,
            finished: false,
            tripwire: self.tripwire.clone(),
        })
    }
}

impl RemoteTx {
    async fn call(&mut self, op: Op) -> Result<Answer, StoreError> {
        if let (Some(wire), Some(point)) = (&self.tripwire, crash_point(&op)) {
            wire.reach(point).await;
        }
        self.seq += 1;
        let db: SocketAddr = DATABASE.parse().map_err(|_| lost())?;
        let request = |op| Request::Op {
            id: self.id,
            seq: self.seq,
            op,
        };
        if thread_rng().gen_bool(CONNECTION_DROP) {
            // The connection is closed with the operation in flight, or
            // before it: the database runs what reached it (a commit
            // included), then sees the close and rolls back the rest.
            if thread_rng().gen_bool(0.5) {
                let _ = self
                    .ep
                    .send_to_raw(db, DB_REQUEST, Box::new(request(op)))
                    .await;
            }
            let close = Request::Op {
                id: self.id,
                seq: self.seq + 1,
                op: Op::Rollback,
            };
            let _ = self.ep.send_to_raw(db, DB_REQUEST, Box::new(close)).await;
            self.finished = true;
            sleep(ANSWER_TIMEOUT).await;
            return Err(lost());
        }
        let share = ANSWER_TIMEOUT / TX_TRANSMISSIONS;
        let mut outcome = Err(lost());
        for _ in 0..TX_TRANSMISSIONS {
            self.ep
                .send_to_raw(db, DB_REQUEST, Box::new(request(op.clone())))
                .await
                .map_err(|_| lost())?;
            outcome = answer_within(&self.ep, self.id, self.seq, share).await;
            if outcome.is_ok() {
                break;
            }
        }
        outcome?.ok_or_else(lost)
    }
}

/// The point a tripwire can stop `op` at, if any.
fn crash_point(op: &Op) -> Option<CrashPoint> {
    match op {
        // The stage is written in this transaction; reading its digest back
        // is the first step of sealing it.
        Op::StagedDigests(_, 0, _) => Some(CrashPoint::MidStaging),
        // A page is rendered from the rows it reads.
        Op::StagedRows(_, 0, _) => Some(CrashPoint::FirstPage),
        Op::StagedRows(..) => Some(CrashPoint::LaterPage),
        Op::CompleteBaseline(_) => Some(CrashPoint::MidBaseline),
        // A chunk after the first: those before it committed.
        Op::RecordBaselineChunk(i) if *i > 0 => Some(CrashPoint::BaselineCutShort),
        Op::RecordPush(_) => Some(CrashPoint::MidPush),
        Op::PutCheckpoints(..) => Some(CrashPoint::MidPull),
        _ => None,
    }
}

/// What one `next` on the database node answered: the transaction, the
/// feed's source end, and its idle end.
type FeedNext = (Option<Box<SourceTransaction>>, Lsn, Option<Lsn>);

/// A fence listener held open on the database node.
pub struct RemoteFenceListener {
    ep: Endpoint,
    id: u64,
    seq: u64,
}

impl FenceListener for RemoteFenceListener {
    async fn next(&mut self) -> Result<FenceReport, StoreError> {
        let db: SocketAddr = DATABASE.parse().map_err(|_| lost())?;
        loop {
            self.seq += 1;
            // Sent again (same sequence number) a few times before the
            // connection counts as lost, as TCP would; a lost connection
            // ends the listener, and the engine hears that reports were missed.
            let mut heard = Err(lost());
            for _ in 0..FEED_TRANSMISSIONS {
                let request = Request::Heard {
                    id: self.id,
                    seq: self.seq,
                };
                self.ep
                    .send_to_raw(db, DB_REQUEST, Box::new(request))
                    .await
                    .map_err(|_| lost())?;
                heard =
                    answer_within(&self.ep, self.id, self.seq, ANSWER_TIMEOUT + FEED_POLL).await;
                if heard.is_ok() {
                    break;
                }
            }
            match heard?.ok_or_else(lost)? {
                Answer::Heard(Some(report)) => return Ok(report),
                Answer::Heard(None) => {}
                _ => return Err(mismatch()),
            }
        }
    }
}

/// A change feed held open on the database node.
pub struct RemoteFeed {
    ep: Endpoint,
    id: u64,
    seq: u64,
    source_end: Lsn,
    idle_end: Option<Lsn>,
    baseline: Option<Baseline>,
    tripwire: Option<Arc<Tripwire>>,
}

impl RemoteFeed {
    /// Sends `op`, retransmitting it (same sequence number) a few times
    /// before the connection counts as lost, as TCP would.
    async fn call(&mut self, op: FeedOp) -> Result<Answer, StoreError> {
        self.seq += 1;
        let db: SocketAddr = DATABASE.parse().map_err(|_| lost())?;
        let mut outcome = Err(lost());
        for _ in 0..FEED_TRANSMISSIONS {
            let request = Request::Feed {
                id: self.id,
                seq: self.seq,
                op: op.clone(),
            };
            self.ep
                .send_to_raw(db, DB_REQUEST, Box::new(request))
                .await
                .map_err(|_| lost())?;
            outcome = answer(&self.ep, self.id, self.seq).await;
            if outcome.is_ok() {
                break;
            }
        }
        outcome?.ok_or_else(lost)
    }
}

impl ChangeFeed for RemoteFeed {
    fn baseline(&self) -> Option<&Baseline> {
        self.baseline.as_ref()
    }

    async fn baseline_chunk(&mut self) -> Result<Option<SourceTransaction>, StoreError> {
        match self.call(FeedOp::BaselineChunk).await? {
            Answer::FeedNext(r) => Ok(r?.0.map(|t| *t)),
            _ => Err(mismatch()),
        }
    }

    async fn end_baseline(&mut self) {
        // MemFeed's stream does not depend on its baseline's chunks: a
        // lost answer here leaves nothing behind.
        let _ = self.call(FeedOp::EndBaseline).await;
        self.baseline = None;
    }

    async fn next(&mut self, wait: Duration) -> Result<Option<SourceTransaction>, StoreError> {
        let deadline = Instant::now() + wait;
        self.idle_end = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let next = match self.call(FeedOp::Next(left)).await? {
                Answer::FeedNext(r) => r?,
                _ => return Err(mismatch()),
            };
            self.source_end = self.source_end.max(next.1);
            self.idle_end = next.2;
            match next.0 {
                Some(t) => return Ok(Some(*t)),
                None if Instant::now() >= deadline => return Ok(None),
                None => continue,
            }
        }
    }

    async fn reread(&mut self, req: &RereadRequest) -> Result<RereadChunk, StoreError> {
        match self.call(FeedOp::Reread(req.clone())).await? {
            Answer::Reread(r) => r,
            _ => Err(mismatch()),
        }
    }

    fn source_end(&self) -> Lsn {
        self.source_end
    }

    fn idle_end(&self) -> Option<Lsn> {
        self.idle_end
    }

    async fn acknowledge_idle(&mut self, end_lsn: Lsn) -> Result<(), StoreError> {
        // The database node's feed is a MemFeed, which judges no slot.
        self.acknowledge(end_lsn).await
    }

    async fn acknowledge(&mut self, end_lsn: Lsn) -> Result<(), StoreError> {
        if let Some(wire) = &self.tripwire {
            wire.reach(CrashPoint::BeforeAcknowledge).await;
        }
        match self.call(FeedOp::Acknowledge(end_lsn)).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }
}

impl RemoteTx {
    /// An operation whose answer is `()`.
    async fn unit(&mut self, op: Op) -> Result<(), StoreError> {
        match self.call(op).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }
}

fn mismatch() -> StoreError {
    StoreError::Integrity("the database answered another operation".into())
}

impl StoreTx for RemoteTx {
    async fn manifests(&mut self) -> Result<Vec<Manifest>, StoreError> {
        match self.call(Op::Manifests).await? {
            Answer::Manifests(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn insert_manifest(&mut self, m: &Manifest) -> Result<(), StoreError> {
        match self.call(Op::InsertManifest(m.clone())).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn applied_configs(&mut self) -> Result<Vec<String>, StoreError> {
        match self.call(Op::AppliedConfigs).await? {
            Answer::AppliedConfigs(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn apply_config(&mut self, fingerprint: &str) -> Result<(), StoreError> {
        match self.call(Op::ApplyConfig(fingerprint.to_owned())).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn lock_client(&mut self, client_id: &str) -> Result<Option<ClientRecord>, StoreError> {
        match self.call(Op::LockClient(client_id.to_owned())).await? {
            Answer::Client(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn insert_client(&mut self, c: &ClientRecord) -> Result<bool, StoreError> {
        match self.call(Op::InsertClient(c.clone())).await? {
            Answer::Inserted(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn count_registrations(
        &mut self,
        user_id: &str,
        since_micros: i64,
    ) -> Result<u64, StoreError> {
        match self
            .call(Op::CountRegistrations(user_id.to_owned(), since_micros))
            .await?
        {
            Answer::Count(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn supersede_rebuild_sessions(
        &mut self,
        client_id: &str,
        scope: &ScopeId,
        now_micros: i64,
    ) -> Result<u64, StoreError> {
        let op = Op::SupersedeRebuildSessions(client_id.to_owned(), scope.clone(), now_micros);
        match self.call(op).await? {
            Answer::Count(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn rebuild_usage(
        &mut self,
        user_id: &str,
        now_micros: i64,
    ) -> Result<RebuildUsage, StoreError> {
        match self
            .call(Op::RebuildUsage(user_id.to_owned(), now_micros))
            .await?
        {
            Answer::Usage(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn put_client(&mut self, c: &ClientRecord) -> Result<(), StoreError> {
        match self.call(Op::PutClient(c.clone())).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn grants(&mut self, user_id: &str) -> Result<Vec<String>, StoreError> {
        match self.call(Op::Grants(user_id.to_owned())).await? {
            Answer::Strings(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn dependency_values(
        &mut self,
        source: &DependencyAssignment,
        user_id: &str,
    ) -> Result<Vec<String>, StoreError> {
        match self
            .call(Op::DependencyValues(source.clone(), user_id.to_owned()))
            .await?
        {
            Answer::Strings(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn capture_progress(&mut self) -> Result<CaptureProgress, StoreError> {
        match self.call(Op::CaptureProgress).await? {
            Answer::Progress(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn record_heartbeat(&mut self, beat: &Heartbeat) -> Result<(), StoreError> {
        match self.call(Op::RecordHeartbeat(*beat)).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn capture_health(&mut self) -> Result<CaptureHealth, StoreError> {
        match self.call(Op::CaptureHealth).await? {
            Answer::Health(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn scope_members(
        &mut self,
        scope: &ScopeId,
    ) -> Result<Vec<(RowIdentity, Digest)>, StoreError> {
        match self.call(Op::ScopeMembers(scope.clone())).await? {
            Answer::Members(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn scope_size(&mut self, scope: &ScopeId) -> Result<u64, StoreError> {
        match self.call(Op::ScopeSize(scope.clone())).await? {
            Answer::Count(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn projections(
        &mut self,
        table_id: &str,
        rows: &[RowIdentity],
    ) -> Result<Vec<Projection>, StoreError> {
        match self
            .call(Op::Projections(table_id.to_owned(), rows.to_vec()))
            .await?
        {
            Answer::Projections(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn dependency_rows_by_identity(
        &mut self,
        relation: &str,
        identities: &[String],
    ) -> Result<Vec<DependencyRow>, StoreError> {
        match self
            .call(Op::DependencyRowsById(
                relation.to_owned(),
                identities.to_vec(),
            ))
            .await?
        {
            Answer::Dependencies(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn dependency_rows(
        &mut self,
        relation: &str,
        column: &str,
        values: &[String],
    ) -> Result<Vec<DependencyRow>, StoreError> {
        match self
            .call(Op::DependencyRows(
                relation.to_owned(),
                column.to_owned(),
                values.to_vec(),
            ))
            .await?
        {
            Answer::Dependencies(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn materialize(&mut self, m: &Materialization) -> Result<(), StoreError> {
        match self.call(Op::Materialize(Box::new(m.clone()))).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn reset_stream(&mut self) -> Result<u64, StoreError> {
        match self.call(Op::ResetStream).await? {
            Answer::Generation(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn record_baseline_chunk(&mut self, index: u64) -> Result<(), StoreError> {
        self.unit(Op::RecordBaselineChunk(index)).await
    }

    async fn hand_over_baseline(&mut self) -> Result<(), StoreError> {
        self.unit(Op::HandOverBaseline).await
    }

    async fn complete_baseline(&mut self, covered_fences: &[u64]) -> Result<(), StoreError> {
        self.unit(Op::CompleteBaseline(covered_fences.to_vec()))
            .await
    }

    async fn quarantine(
        &mut self,
        q: &Quarantine,
        stream_generation: u64,
    ) -> Result<(), StoreError> {
        match self
            .call(Op::Quarantine(q.clone(), stream_generation))
            .await?
        {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn forget_table(&mut self, table_id: &str) -> Result<u64, StoreError> {
        match self.call(Op::ForgetTable(table_id.to_owned())).await? {
            Answer::Count(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn rematerializations(&mut self) -> Result<Vec<Rematerialization>, StoreError> {
        match self.call(Op::Rematerializations).await? {
            Answer::Rematerializations(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn put_rematerializations(
        &mut self,
        records: &[Rematerialization],
    ) -> Result<(), StoreError> {
        self.unit(Op::PutRematerializations(records.to_vec())).await
    }

    async fn has_stale_projections(&mut self, schema_version: u64) -> Result<bool, StoreError> {
        match self.call(Op::HasStaleProjections(schema_version)).await? {
            Answer::Inserted(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn stale_scope_members(
        &mut self,
        scope: &ScopeId,
        schema_version: u64,
    ) -> Result<Vec<Projection>, StoreError> {
        match self
            .call(Op::StaleScopeMembers(scope.clone(), schema_version))
            .await?
        {
            Answer::Projections(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn stream_state(&mut self) -> Result<StreamState, StoreError> {
        match self.call(Op::StreamState).await? {
            Answer::Stream(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn membership_rules(&mut self) -> Result<Vec<MembershipRules>, StoreError> {
        match self.call(Op::MembershipRules).await? {
            Answer::Rules(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn insert_membership_rules(
        &mut self,
        rules: &[MembershipRules],
    ) -> Result<(), StoreError> {
        match self.call(Op::InsertMembershipRules(rules.to_vec())).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn token_keys(&mut self) -> Result<Vec<TokenKey>, StoreError> {
        match self.call(Op::TokenKeys).await? {
            Answer::Keys(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn insert_token_keys(&mut self, keys: &[TokenKey]) -> Result<(), StoreError> {
        match self.call(Op::InsertTokenKeys(keys.to_vec())).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn rotate_token_keys(&mut self, fresh: &[TokenKey]) -> Result<(), StoreError> {
        match self.call(Op::RotateTokenKeys(fresh.to_vec())).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn drop_token_key(&mut self, key_id: &str) -> Result<bool, StoreError> {
        match self.call(Op::DropTokenKey(key_id.to_owned())).await? {
            Answer::Inserted(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn checkpoints(
        &mut self,
        client_id: &str,
    ) -> Result<BTreeMap<ScopeId, Checkpoint>, StoreError> {
        match self.call(Op::Checkpoints(client_id.to_owned())).await? {
            Answer::Checkpoints(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn put_checkpoints(
        &mut self,
        client_id: &str,
        checkpoints: &[(ScopeId, Checkpoint)],
    ) -> Result<(), StoreError> {
        match self
            .call(Op::PutCheckpoints(
                client_id.to_owned(),
                checkpoints.to_vec(),
            ))
            .await?
        {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn retention_hold(
        &mut self,
        stream_generation: u64,
        window: std::time::Duration,
    ) -> Result<Option<StreamPosition>, StoreError> {
        match self
            .call(Op::RetentionHold(stream_generation, window))
            .await?
        {
            Answer::Position(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn advance_floor(&mut self, floor: StreamPosition) -> Result<(), StoreError> {
        match self.call(Op::AdvanceFloor(floor)).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn compact_below_floor(&mut self, max: usize) -> Result<usize, StoreError> {
        match self.call(Op::CompactBelowFloor(max)).await? {
            Answer::Count(r) => r.map(|n| n as usize),
            _ => Err(mismatch()),
        }
    }

    async fn forget_transactions_below_floor(&mut self, max: usize) -> Result<usize, StoreError> {
        match self.call(Op::ForgetTransactionsBelowFloor(max)).await? {
            Answer::Count(r) => r.map(|n| n as usize),
            _ => Err(mismatch()),
        }
    }

    async fn retire_client(&mut self, client_id: &str) -> Result<bool, StoreError> {
        match self.call(Op::RetireClient(client_id.to_owned())).await? {
            Answer::Inserted(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn pending_fences(
        &mut self,
        client_id: &str,
        max: usize,
    ) -> Result<Vec<u64>, StoreError> {
        match self
            .call(Op::PendingFences(client_id.to_owned(), max))
            .await?
        {
            Answer::Fences(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn reconcile_fences(&mut self) -> Result<u64, StoreError> {
        match self.call(Op::ReconcileFences).await? {
            Answer::Count(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn scope_candidates(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
        max: usize,
    ) -> Result<Vec<Effect>, StoreError> {
        match self
            .call(Op::ScopeCandidates(scope.clone(), after, through, max))
            .await?
        {
            Answer::Effects(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn last_effect_before(
        &mut self,
        scope: &ScopeId,
        before: StreamPosition,
    ) -> Result<Option<StreamPosition>, StoreError> {
        match self
            .call(Op::LastEffectBefore(scope.clone(), before))
            .await?
        {
            Answer::Position(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn rebuild_session(
        &mut self,
        client_id: &str,
        rebuild_id: &CanonicalUuid,
    ) -> Result<Option<RebuildSession>, StoreError> {
        match self
            .call(Op::RebuildSession(client_id.to_owned(), *rebuild_id))
            .await?
        {
            Answer::Session(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn stage_rebuild(
        &mut self,
        session: &RebuildSession,
        digests: &[(RowIdentity, Digest)],
    ) -> Result<u64, StoreError> {
        match self
            .call(Op::StageRebuild(
                Box::new(session.clone()),
                digests.to_vec(),
            ))
            .await?
        {
            Answer::Count(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn staged_digests(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<(RowIdentity, Digest)>, StoreError> {
        match self.call(Op::StagedDigests(*session_id, from, max)).await? {
            Answer::Members(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn seal_rebuild_session(
        &mut self,
        session_id: &CanonicalUuid,
        digest: &Digest,
    ) -> Result<(), StoreError> {
        match self
            .call(Op::SealRebuildSession(*session_id, *digest))
            .await?
        {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn staged_rows(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<StagedRow>, StoreError> {
        match self.call(Op::StagedRows(*session_id, from, max)).await? {
            Answer::Staged(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn sweep_rebuild_sessions(
        &mut self,
        now_micros: i64,
        max: usize,
    ) -> Result<u64, StoreError> {
        match self.call(Op::SweepRebuildSessions(now_micros, max)).await? {
            Answer::Count(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn forget_rebuild_sessions(
        &mut self,
        expired_before: i64,
        max: usize,
    ) -> Result<u64, StoreError> {
        match self
            .call(Op::ForgetRebuildSessions(expired_before, max))
            .await?
        {
            Answer::Count(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn scope_effects(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
    ) -> Result<Vec<Effect>, StoreError> {
        match self
            .call(Op::ScopeEffects(scope.clone(), after, through))
            .await?
        {
            Answer::Effects(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn push_ledger(
        &mut self,
        user_id: &str,
        client_id: &str,
        batch_id: CanonicalUuid,
        mutation_ids: &[CanonicalUuid],
    ) -> Result<LedgerEntries, StoreError> {
        let op = Op::PushLedger(
            user_id.to_owned(),
            client_id.to_owned(),
            batch_id,
            mutation_ids.to_vec(),
        );
        match self.call(op).await? {
            Answer::Ledger(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn record_push(&mut self, r: &PushRecord) -> Result<(), StoreError> {
        self.unit(Op::RecordPush(Box::new(r.clone()))).await
    }

    async fn begin_writes(&mut self, w: &Writer) -> Result<(), StoreError> {
        self.unit(Op::BeginWrites(w.clone())).await
    }

    async fn find_rows(
        &mut self,
        target: &WriteTarget,
        keys: &[String],
    ) -> Result<Vec<FoundRow>, StoreError> {
        match self
            .call(Op::FindRows(Box::new(target.clone()), keys.to_vec()))
            .await?
        {
            Answer::Found(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn write_row(
        &mut self,
        target: &WriteTarget,
        key: &str,
        write: &RowWrite,
    ) -> Result<WriteResult, StoreError> {
        let op = Op::WriteRow(Box::new(target.clone()), key.to_owned(), write.clone());
        match self.call(op).await? {
            Answer::Written(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn write_rows(
        &mut self,
        target: &WriteTarget,
        writes: &[(String, RowWrite)],
    ) -> Result<Option<Vec<WriteResult>>, StoreError> {
        let op = Op::WriteRows(Box::new(target.clone()), writes.to_vec());
        match self.call(op).await? {
            Answer::WrittenAll(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn mark_group(&mut self) -> Result<(), StoreError> {
        self.unit(Op::MarkGroup).await
    }

    async fn check_constraints(&mut self) -> Result<Option<Refusal>, StoreError> {
        match self.call(Op::CheckConstraints).await? {
            Answer::Refusal(r) => r,
            _ => Err(mismatch()),
        }
    }

    async fn undo_group(&mut self) -> Result<(), StoreError> {
        self.unit(Op::UndoGroup).await
    }

    async fn end_writes(&mut self) -> Result<(), StoreError> {
        self.unit(Op::EndWrites).await
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        self.finished = true;
        match self.call(Op::Commit).await? {
            Answer::Unit(r) => r,
            _ => Err(mismatch()),
        }
    }
}

/// Keeps retrying until the engine starts (the database may be unreachable for a while).
pub async fn start_engine(store: RemoteStore) -> actors::Engine {
    start_engine_with(store, actors::testkit::example_config(|s| s)).await
}

/// [`start_engine`] with `config`.
pub async fn start_engine_with(
    store: RemoteStore,
    config: actors::config::SyncConfig,
) -> actors::Engine {
    loop {
        match actors::Engine::start(store.clone(), config.clone()).await {
            Ok(engine) => return engine,
            Err(_) => sleep(Duration::from_millis(100)).await,
        }
    }
}
