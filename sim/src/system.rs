//! The whole system under faults (issue 14): the real client library
//! (`client::Client` on a `MemoryStore`) on several devices of several
//! users, against the real engine on a server node that crashes (at random
//! and inside rebuilds), over a link that loses requests and answers and
//! sometimes sends a push twice at once, while the application writes,
//! moves, shares and deletes rows on the database node, an operator grants
//! and revokes team scopes, and devices go offline, write, and restart
//! from their local store.
//!
//! Judged at quiescence by `invariants::system`: each device holds exactly
//! the server's rows of exactly its assigned scopes, no outbox write is
//! lost or applied twice, every accepted insert reached every device of its
//! user, and no terminal checksum ever differed.
//!
//! A [`SystemMutant`] plants a server bug in what one device receives; the
//! same judge must then fail.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::store::{MemStore, Store, StoreTx};
use actors::testkit::{cursor_bindings, cursor_position, mint_cursor, push_config};
use client::local::{
    Holding, LocalError, LocalStore, QueuedWrite, SealedBatch, Session, SettledOutcome, Transition,
};
use client::{Answer, Client, Config, Endpoint, MemoryStore, SyncError, Transport, TransportError};
use client::{Write, WriteOp};
use invariants::pull::{CursorStep, Delivered, FloorSeen};
use invariants::system::{Authored, ClientEnd, GrantChange, HeldRow, ServerEnd, Settled};
use invariants::tokens::TokenUse;
use madsim::net::NetSim;
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::Handle;
use madsim::time::sleep;
use protocol::digest::Digest;
use protocol::json::{self, Value};
use protocol::position::StreamPosition;

use crate::tripwire::{CrashPoint, Tripwire};
use crate::{MAX_FRAME, REQUEST, RESPONSE, SERVER, decode_response, encode_request, now_micros};

/// A server bug planted in what one device receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SystemMutant {
    /// One terminal pull page loses one of its upserts.
    DropChange,
    /// A push sent again after its answer was lost is executed again: its
    /// new rows now exist, so the inserts answer `row_already_exists`.
    ReExecute,
    /// One pull page's cursor of a scope stands one effect too far: past
    /// an upsert that came after the page, which the device then never gets.
    CursorTooFar,
    /// A rebuild continuation is answered with the page before it again (a
    /// stale stored page).
    StaleRebuildPage,
    /// A client bug: the device takes row checksums as sent, unverified,
    /// and one page carries a row whose title a server bug changed after
    /// its checksum was computed.
    TrustedChecksum,
    /// A client bug: a scope the server removes leaves the device's active
    /// set, but its rows stay.
    KeepRemovedRows,
    /// Compaction deletes, each pass, the latest effect above the floor
    /// that is not its scope's last: a change some device never receives.
    CompactAboveFloor,
    /// A key rotation deletes the old keys instead of keeping them
    /// verify-only: the cursors and continuations devices hold are forged.
    RotationForgetsKeys,
}

impl SystemMutant {
    /// Whether the bug fires on an answer a device receives (so the
    /// device's transport records that it fired), not on the server's own.
    fn fires_on_an_answer(self) -> bool {
        !matches!(
            self,
            SystemMutant::CompactAboveFloor | SystemMutant::RotationForgetsKeys
        )
    }
}

/// Knobs of one whole-system run.
#[derive(Clone, Debug)]
pub struct SystemScenario {
    pub users: usize,
    /// Devices per user.
    pub devices: usize,
    /// Rounds of each device (a write, a restart or an absence, then a sync).
    pub rounds: usize,
    pub packet_loss: f64,
    /// Random server crashes (tripwires inside rebuilds come on top).
    pub server_crashes: usize,
    /// How often a push is sent twice at once.
    pub duplicate_push: f64,
    pub mutant: Option<SystemMutant>,
}

impl Default for SystemScenario {
    fn default() -> Self {
        SystemScenario {
            users: 2,
            devices: 2,
            rounds: 14,
            packet_loss: 0.03,
            server_crashes: 3,
            duplicate_push: 0.2,
            mutant: None,
        }
    }
}

/// What a whole-system run recorded.
#[derive(Clone, Debug, Default)]
pub struct SystemTrace {
    /// Problems the harness saw (a device's error that no fault explains).
    pub violations: Vec<String>,
    pub clients: Vec<ClientEnd>,
    pub server: ServerEnd,
    pub crashes: usize,
    /// The aimed crashes, by the point each stopped the server at.
    pub tripped: Vec<CrashPoint>,
    /// Requests that got no answer in time.
    pub lost: usize,
    /// Pushes sent twice at once.
    pub duplicated: usize,
    pub restarts: usize,
    pub offline: usize,
    pub writes: usize,
    pub pages: u32,
    pub rebuilt: usize,
    pub mutated: bool,
    /// Each answered pull's user scopes beside the retention floor.
    pub floor: Vec<FloorSeen>,
    /// Each answered pull's user scopes: the cursors presented and issued,
    /// the effects between, and what the page carried.
    pub cursor_steps: Vec<CursorStep>,
    /// Token key rotations the operator completed (ADR 0025).
    pub rotations: usize,
    /// Every answered pull and rebuild, with the keys of its tokens.
    pub token_uses: Vec<TokenUse>,
}

/// Grant changes as the operator made them.
type GrantLog = Arc<Mutex<Vec<GrantChange>>>;

/// A device's local store, watched for the per-page check: the commit that
/// applies a pull or rebuild page (the first commit without outbox changes
/// after its answer, before the next request) must leave the device holding
/// rows only of scopes its user was assigned while that page was made
/// (`invariants::system::assigned_during`, judged by the operator's log).
#[derive(Clone)]
pub struct Watched {
    inner: Arc<Mutex<MemoryStore>>,
    watch: Arc<Watch>,
}

struct Watch {
    client_id: String,
    /// The user's scopes no operator changes: its own and the shared one.
    fixed: Vec<String>,
    user: String,
    grants: GrantLog,
    /// The span of the page answered last, until it is applied or the next
    /// request goes out.
    page: Mutex<Option<(i64, i64)>>,
    /// When the last connect or pull answered 200 was sent. The server
    /// reconciles the assignment it records only there, after that
    /// instant; a rebuild is judged by the recorded one (ADR 003: "Rebuild
    /// does not reconcile assignment").
    reconciled_after: Mutex<Option<i64>>,
    /// Every row put since the last judgement: a row a later page of the
    /// same sync replaced is judged too.
    puts: Mutex<Vec<Holding>>,
    trace: Arc<Mutex<SystemTrace>>,
}

impl Watched {
    fn new(client_id: &str, user: &str, grants: GrantLog, trace: Arc<Mutex<SystemTrace>>) -> Self {
        Watched {
            inner: Arc::new(Mutex::new(MemoryStore::new())),
            watch: Arc::new(Watch {
                client_id: client_id.to_owned(),
                fixed: vec![format!("user:{user}"), "templates_public".to_owned()],
                user: user.to_owned(),
                grants,
                page: Mutex::new(None),
                reconciled_after: Mutex::new(None),
                puts: Mutex::new(Vec::new()),
                trace,
            }),
        }
    }

    fn store(&self) -> std::sync::MutexGuard<'_, MemoryStore> {
        self.inner.lock().expect("store")
    }

    /// A request goes out: the page answered before it was applied or not.
    fn request_sent(&self) {
        *self.watch.page.lock().expect("page") = None;
    }

    /// A 200 answer to a request sent at `sent`. A pull page was made
    /// under the assignment at some instant since; a rebuild page under
    /// the one recorded since the last reconciliation.
    fn answered(&self, endpoint: Endpoint, sent: i64) {
        let mut reconciled = self.watch.reconciled_after.lock().expect("reconciled");
        let since = match endpoint {
            Endpoint::Connect | Endpoint::Pull => *reconciled.insert(sent),
            Endpoint::Rebuild => reconciled.unwrap_or(sent),
            Endpoint::Push => return,
        };
        if endpoint != Endpoint::Connect {
            *self.watch.page.lock().expect("page") = Some((since, now_micros()));
        }
    }

    /// The rows put since the last call.
    fn take_puts(&self) -> Vec<Holding> {
        std::mem::take(&mut *self.watch.puts.lock().expect("puts"))
    }

    /// The per-page check, once the page's transition is committed.
    fn judge(&self, span: (i64, i64)) {
        let holdings = self.store().all_holdings().expect("holdings");
        let scopes: std::collections::BTreeSet<&str> =
            holdings.iter().map(|h| h.scope.as_str()).collect();
        let w = &self.watch;
        let grants = w.grants.lock().expect("grants");
        if let Err(m) =
            invariants::system::assigned_during(scopes, &w.fixed, &grants, &w.user, span)
        {
            w.trace
                .lock()
                .expect("trace")
                .violations
                .push(format!("{}: {m}", w.client_id));
        }
    }
}

impl LocalStore for Watched {
    fn session(&self) -> Result<Option<Session>, LocalError> {
        self.store().session()
    }
    fn holdings(&self, scope: &str) -> Result<Vec<Holding>, LocalError> {
        self.store().holdings(scope)
    }
    fn all_holdings(&self) -> Result<Vec<Holding>, LocalError> {
        self.store().all_holdings()
    }
    fn queued(&self) -> Result<Vec<QueuedWrite>, LocalError> {
        self.store().queued()
    }
    fn sealed(&self) -> Result<Vec<SealedBatch>, LocalError> {
        self.store().sealed()
    }
    fn outcomes(&self) -> Result<Vec<SettledOutcome>, LocalError> {
        self.store().outcomes()
    }
    fn commit(&mut self, t: Transition) -> Result<(), LocalError> {
        // (A write, a seal or a settle changes the outbox; a page never does.)
        let applies_page = t.outbox.is_empty();
        let put = t.put.clone();
        self.store().commit(t)?;
        self.watch.puts.lock().expect("puts").extend(put);
        let answered = self
            .watch
            .page
            .lock()
            .expect("page")
            .take_if(|_| applies_page);
        if let Some(span) = answered {
            self.judge(span);
        }
        Ok(())
    }
}

/// A device's transport: one datagram per try (two at once for a
/// duplicated push), the first answer within 800 ms, else no answer (the
/// client's own rules retry).
pub struct SimTransport {
    ep: madsim::net::Endpoint,
    server: SocketAddr,
    user: String,
    next_id: u64,
    buf: Vec<u8>,
    duplicate_push: f64,
    mutant: Option<SystemMutant>,
    /// The push whose answer the `ReExecute` bug lost, to execute again.
    lost_push: Option<Vec<u8>>,
    /// The last rebuild page answered, for the `StaleRebuildPage` bug.
    last_rebuild_page: Option<Vec<u8>>,
    /// The server's store, where the `CursorTooFar` bug reads effects and
    /// mints its cursor.
    store: MemStore,
    /// The device's store, told of each request and page answered.
    local: Watched,
    trace: Arc<Mutex<SystemTrace>>,
}

impl SimTransport {
    async fn bind(
        index: usize,
        user: &str,
        scenario: &SystemScenario,
        mutant: Option<SystemMutant>,
        store: MemStore,
        local: Watched,
        trace: Arc<Mutex<SystemTrace>>,
    ) -> SimTransport {
        SimTransport {
            ep: madsim::net::Endpoint::bind("0.0.0.0:0")
                .await
                .expect("bind"),
            server: SERVER.parse().expect("address"),
            user: user.to_owned(),
            next_id: (index as u64) << 40,
            buf: vec![0u8; MAX_FRAME],
            duplicate_push: scenario.duplicate_push,
            mutant,
            lost_push: None,
            last_rebuild_page: None,
            store,
            local,
            trace,
        }
    }
}

impl Transport for SimTransport {
    async fn post(&mut self, endpoint: Endpoint, body: &[u8]) -> Result<Answer, TransportError> {
        let framed = crate::link::framed(endpoint, body);
        let twice = endpoint == Endpoint::Push && thread_rng().gen_bool(self.duplicate_push);
        if twice {
            self.trace.lock().expect("trace").duplicated += 1;
        }
        self.local.request_sent();
        let presented = match endpoint {
            Endpoint::Pull => Some((floor(&self.store).await, self.presented(body).await)),
            _ => None,
        };
        let sent = now_micros();
        let mut ids = Vec::new();
        for _ in 0..if twice { 2 } else { 1 } {
            self.next_id += 1;
            ids.push(self.next_id);
            let frame = encode_request(self.next_id, &self.user, &framed);
            let _ = self.ep.send_to(self.server, REQUEST, &frame).await;
        }
        let deadline = sleep(Duration::from_millis(800));
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                biased;
                _ = &mut deadline => {
                    self.trace.lock().expect("trace").lost += 1;
                    return Err(TransportError("no answer in time".into()));
                }
                got = self.ep.recv_from(RESPONSE, &mut self.buf) => {
                    let Ok((n, _)) = got else { continue };
                    if let Some((id, status, mut b)) = decode_response(&self.buf[..n])
                        && ids.contains(&id)
                    {
                        let uses = match endpoint {
                            Endpoint::Pull => Some("pull"),
                            Endpoint::Rebuild => Some("rebuild"),
                            _ => None,
                        };
                        if let Some(name) = uses {
                            let mut t = self.trace.lock().expect("trace");
                            let used = TokenUse::of(name, body, status, &b, t.rotations);
                            t.token_uses.push(used);
                        }
                        if status == 200 && let Some((before, presented)) = &presented {
                            self.judge_floor(*before, presented, &b).await;
                        }
                        if endpoint == Endpoint::Pull && status == 200
                            && self.mutant == Some(SystemMutant::DropChange)
                            && let Some(dropped) = drop_change(&b)
                        {
                            b = dropped;
                            self.mutant = None;
                            self.trace.lock().expect("trace").mutated = true;
                        }
                        if endpoint == Endpoint::Pull && status == 200
                            && self.mutant == Some(SystemMutant::TrustedChecksum)
                            && let Some(forged) = forge_row(&b)
                        {
                            b = forged;
                            self.mutant = None;
                            self.trace.lock().expect("trace").mutated = true;
                        }
                        if endpoint == Endpoint::Pull && status == 200
                            && self.mutant == Some(SystemMutant::CursorTooFar)
                            && let Some(far) = cursor_too_far(&self.store, &self.user, body, &b).await
                        {
                            b = far;
                            self.mutant = None;
                            self.trace.lock().expect("trace").mutated = true;
                        }
                        if endpoint == Endpoint::Push && status == 200
                            && self.mutant == Some(SystemMutant::ReExecute)
                        {
                            let inserts = contains(body, b"\"op\":\"insert\"");
                            let applied = contains(&b, b"\"applied\"");
                            if self.lost_push.is_none() && inserts && applied {
                                // The answer of a push that inserted rows is lost:
                                // the client must send the same bytes again.
                                self.lost_push = Some(body.to_vec());
                                return Err(TransportError("the answer was lost".into()));
                            }
                            if self.lost_push.as_deref() == Some(body)
                                && let Some(again) = re_executed(&b)
                            {
                                b = again;
                                self.mutant = None;
                                self.trace.lock().expect("trace").mutated = true;
                            }
                        }
                        if endpoint == Endpoint::Rebuild && status == 200 {
                            let continued = !contains(body, b"\"cursor\":null");
                            if continued && self.mutant == Some(SystemMutant::StaleRebuildPage)
                                && let Some(stale) = self.last_rebuild_page.take()
                            {
                                b = stale;
                                self.mutant = None;
                                self.trace.lock().expect("trace").mutated = true;
                            } else {
                                self.last_rebuild_page = Some(b.clone());
                            }
                        }
                        if status == 200 && let Some((_, presented)) = &presented {
                            self.record_cursor_steps(presented, &b).await;
                        }
                        if status == 200 {
                            if endpoint == Endpoint::Pull
                                && self.mutant == Some(SystemMutant::KeepRemovedRows)
                                && self.removes_held_scope(&b)
                            {
                                self.trace.lock().expect("trace").mutated = true;
                            }
                            self.local.answered(endpoint, sent);
                        }
                        return Ok(Answer { status, retry_after: None, body: b });
                    }
                }
            }
        }
    }
}

impl SimTransport {
    /// The client and the user scope cursors a pull request presents,
    /// with their positions.
    async fn presented(&self, request: &[u8]) -> (String, Vec<(String, StreamPosition)>) {
        let Ok(v) = json::parse(request) else {
            return (String::new(), Vec::new());
        };
        let o = v.as_object();
        let client = (o.and_then(|o| o.get("client_id")).and_then(Value::as_str))
            .unwrap_or_default()
            .to_owned();
        let Some(Value::Object(scopes)) = o.and_then(|o| o.get("scopes")) else {
            return (client, Vec::new());
        };
        let mut out = Vec::new();
        for (scope, s) in scopes.iter().filter(|(s, _)| s.starts_with("user:")) {
            if let Some(token) = s
                .as_object()
                .and_then(|o| o.get("cursor"))
                .and_then(Value::as_str)
                && let Some(position) = verified_position(&self.store, token).await
            {
                out.push((scope.clone(), position));
            }
        }
        (client, out)
    }

    /// Records each presented user scope of an answered pull beside the floor.
    async fn judge_floor(
        &self,
        floor_before: StreamPosition,
        (client, presented): &(String, Vec<(String, StreamPosition)>),
        page: &[u8],
    ) {
        let Ok(v) = json::parse(page) else { return };
        let rebuild = match v.as_object().and_then(|o| o.get("rebuild")) {
            Some(Value::Array(r)) => r.clone(),
            _ => return,
        };
        let floor_after = floor(&self.store).await;
        let mut t = self.trace.lock().expect("trace");
        for (scope, at) in presented {
            t.floor.push(FloorSeen {
                client: client.clone(),
                scope: scope.clone(),
                presented: *at,
                floor_before,
                floor_after,
                rebuilt: rebuild.contains(&Value::string(scope.as_str())),
            });
        }
    }

    /// Records each presented user scope that `page` issues a cursor for,
    /// with the scope's effects now (the page's cursors are behind them).
    async fn record_cursor_steps(
        &self,
        (client, presented): &(String, Vec<(String, StreamPosition)>),
        page: &[u8],
    ) {
        let Ok(v) = json::parse(page) else { return };
        let (Some(Value::Object(issued)), Some(Value::Array(changes))) = (
            v.as_object().and_then(|o| o.get("scope_cursors")),
            v.as_object().and_then(|o| o.get("changes")),
        ) else {
            return;
        };
        let manifest = {
            let mut tx = self.store.begin().await.expect("begin");
            tx.manifests().await.expect("manifests").pop()
        };
        let Some(manifest) = manifest else { return };
        let now = crate::pull::boundary_now(&self.store).await;
        let mut steps = Vec::new();
        for (scope, presented) in presented {
            let Some(token) = issued.get(scope).and_then(Value::as_str) else {
                continue;
            };
            let Some(issued) = verified_position(&self.store, token).await else {
                continue;
            };
            let mut effects = crate::pull::effects_of(&self.store, scope, now).await;
            effects.retain(|e| e.position > *presented);
            steps.push(CursorStep {
                client: client.clone(),
                scope: scope.clone(),
                presented: *presented,
                issued,
                effects,
                delivered: (changes.iter())
                    .filter_map(|c| Delivered::of(&manifest, scope, c))
                    .collect(),
            });
        }
        self.trace.lock().expect("trace").cursor_steps.extend(steps);
    }

    /// Whether `page` removes a scope the device holds rows of (so the
    /// `KeepRemovedRows` bug keeps them).
    fn removes_held_scope(&self, page: &[u8]) -> bool {
        let Ok(v) = json::parse(page) else {
            return false;
        };
        let removed = v
            .as_object()
            .and_then(|o| o.get("scope_updates"))
            .and_then(Value::as_object)
            .and_then(|u| u.get("remove"));
        let Some(Value::Array(removed)) = removed else {
            return false;
        };
        let store = self.local.store();
        removed
            .iter()
            .filter_map(Value::as_str)
            .any(|s| store.holdings(s).is_ok_and(|h| !h.is_empty()))
    }
}

/// The stream's retention floor now.
async fn floor(store: &MemStore) -> StreamPosition {
    let mut tx = store.begin().await.expect("begin");
    tx.stream_state().await.expect("stream").floor
}

/// A terminal pull page with its first upsert removed, if it has one: a
/// loss the page's own checksums must expose (an intermediate page's loss
/// can be covered by a later change of the same row before the checksum).
fn drop_change(page: &[u8]) -> Option<Vec<u8>> {
    let mut v = json::parse(page).ok()?;
    let Value::Object(o) = &mut v else {
        return None;
    };
    if o.get("has_more") != Some(&Value::Bool(false)) {
        return None;
    }
    // A scope sent to rebuild skips its checksum: its changes do not count.
    let rebuilt: Vec<Value> = match o.get("rebuild") {
        Some(Value::Array(r)) => r.clone(),
        _ => return None,
    };
    let Some(Value::Array(changes)) = o.get_mut("changes") else {
        return None;
    };
    let upsert = |c: &Value| {
        let c = c.as_object();
        let member = |k: &str| c.and_then(|c| c.get(k));
        member("op").and_then(Value::as_str) == Some("upsert")
            && member("scope").is_some_and(|s| !rebuilt.contains(s))
    };
    let k = changes.iter().position(upsert)?;
    changes.remove(k);
    Some(json::to_canonical(&v))
}

/// A pull page whose first upsert of a device's own note has another
/// title, its checksum unchanged (a device's notes change only by the
/// devices' edits, so the forged row tends to stay).
fn forge_row(page: &[u8]) -> Option<Vec<u8>> {
    let mut v = json::parse(page).ok()?;
    let Value::Object(o) = &mut v else {
        return None;
    };
    let Some(Value::Array(changes)) = o.get_mut("changes") else {
        return None;
    };
    let change = changes.iter_mut().find(|c| {
        let c = c.as_object();
        let op = c.and_then(|c| c.get("op")).and_then(Value::as_str);
        let id = c
            .and_then(|c| c.get("pk"))
            .and_then(Value::as_object)
            .and_then(|pk| pk.get("fld_notes_id"))
            .and_then(Value::as_str);
        op == Some("upsert") && id.is_some_and(|id| id.contains("-a000-"))
    })?;
    let Value::Object(c) = change else {
        return None;
    };
    let Some(Value::Object(row)) = c.get_mut("row") else {
        return None;
    };
    row.insert("fld_notes_title".into(), Value::string("forged"));
    Some(json::to_canonical(&v))
}

/// The pull page with the user scope's cursor moved past the first upsert
/// after it of a device's note that is its row's last effect so far (so
/// no later change is likely to cover it), if there is one. The cursor is
/// authentic: minted under the server's keys with the device's bindings.
async fn cursor_too_far(
    store: &MemStore,
    user: &str,
    request: &[u8],
    page: &[u8],
) -> Option<Vec<u8>> {
    let request = json::parse(request).ok()?;
    let request = request.as_object()?;
    let client_id = request.get("client_id")?.as_str()?;
    let Value::Number(generation) = request.get("client_generation")? else {
        return None;
    };
    let generation = u64::try_from(generation.as_exact_i64()?).ok()?;
    let mut v = json::parse(page).ok()?;
    let Value::Object(o) = &mut v else {
        return None;
    };
    let Some(Value::Object(cursors)) = o.get_mut("scope_cursors") else {
        return None;
    };
    let now = crate::pull::boundary_now(store).await;
    let mut moved = None;
    // The user's own scope, never revoked (a revoked scope is rebuilt when
    // granted again, which would heal the loss).
    for (scope, token) in cursors.iter().filter(|(s, _)| s.starts_with("user:")) {
        let at = cursor_position(store, token.as_str()?).await;
        let effects = crate::pull::effects_of(store, scope, now).await;
        // A device's own note: only the devices' rare edits change it again.
        let skipped = effects.iter().find(|e| {
            e.position > at
                && !e.removes
                && !e.tombstone
                && contains(&e.identity, b"-a000-")
                && crate::pull::is_last(&effects, e)
        });
        if let Some(e) = skipped {
            let b = cursor_bindings(store, user, client_id, generation, scope, e.position).await;
            moved = Some((scope.clone(), mint_cursor(store, &b).await));
            break;
        }
    }
    let (scope, token) = moved?;
    cursors.insert(scope, Value::string(token));
    Some(json::to_canonical(&v))
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The answer a server that executes a batch twice gives the second time:
/// every applied outcome is now a `row_already_exists` conflict, with the
/// row the first execution wrote.
fn re_executed(answer: &[u8]) -> Option<Vec<u8>> {
    let mut v = json::parse(answer).ok()?;
    let Value::Object(o) = &mut v else {
        return None;
    };
    let Some(Value::Array(accepted)) = o.insert("accepted".into(), Value::Array(Vec::new())) else {
        return None;
    };
    let mut conflicts = Vec::new();
    for mut outcome in accepted {
        if let Value::Object(m) = &mut outcome {
            m.insert("status".into(), Value::string("conflict"));
            m.insert("code".into(), Value::string("row_already_exists"));
            m.insert("message".into(), Value::string("the row already exists"));
        }
        conflicts.push(outcome);
    }
    if conflicts.is_empty() {
        return None;
    }
    if let Some(Value::Array(rejected)) = o.get_mut("rejected") {
        conflicts.append(rejected);
        *rejected = conflicts;
    }
    Some(json::to_canonical(&v))
}

type Device = Client<Watched, SimTransport>;

/// One device as the run follows it, and what it authored.
struct Run {
    client: Device,
    user: String,
    authored: Vec<Authored>,
    mismatched: Vec<String>,
}

/// A device's config. The bugs' devices take the limits their bug needs:
/// the stale-page bug's rebuilds at limit 1 (every scope of two rows or
/// more takes a continuation), the dropped change's pulls in one page (so
/// every page with a change is terminal, and its checksums judge it).
fn config(mutant: Option<SystemMutant>) -> Config {
    let mut pull_limit = thread_rng().gen_range(1..=4);
    let mut rebuild_limit = thread_rng().gen_range(1..=3);
    match mutant {
        Some(SystemMutant::StaleRebuildPage) => rebuild_limit = 1,
        Some(SystemMutant::DropChange) => pull_limit = 1000,
        _ => {}
    }
    Config {
        pull_limit,
        rebuild_limit,
        max_tries: 6,
        backoff_base: Duration::from_millis(100),
        backoff_cap: Duration::from_secs(3),
        max_pages: 400,
        ..Config::default()
    }
}

fn object(members: &[(&str, Value)]) -> json::Object {
    members
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect()
}

fn client_version() -> String {
    client::datetime(crate::now_micros())
}

/// One sync; an error a fault explains is left for the next round.
fn absorb(result: Result<(), SyncError>, run: &Run, trace: &Mutex<SystemTrace>) {
    match result {
        // (An assignment that kept changing is the operator's grants racing
        // the device's rounds: transient, as for the device.)
        Ok(())
        | Err(
            SyncError::Unreachable(_)
            | SyncError::Unavailable(_)
            | SyncError::AssignmentChanging(_)
            | SyncError::RebuildRestarting(_),
        ) => {}
        Err(e) => trace
            .lock()
            .expect("trace")
            .violations
            .push(format!("{}: {e}", run.client.session().client_id)),
    }
}

async fn sync(run: &mut Run, trace: &Mutex<SystemTrace>) {
    let result = match run.client.sync().await {
        Ok((_, pulled)) => {
            let mut t = trace.lock().expect("trace");
            t.pages += pulled.pages;
            t.rebuilt += pulled.rebuilt.len();
            Ok(())
        }
        Err(e) => Err(e),
    };
    run.mismatched.extend(run.client.take_mismatched());
    absorb(result, run, trace);
    judge_holdings(run, trace);
}

/// After every sync (every page applied, a failed one's included): the
/// device holds rows only of scopes it is assigned; a removed scope's rows
/// left with it, in the same transition.
fn judge_holdings(run: &Run, trace: &Mutex<SystemTrace>) {
    let session = run.client.session();
    let holdings = run.client.store().all_holdings().expect("holdings");
    if let Some(h) = holdings
        .iter()
        .find(|h| !session.scopes.contains_key(&h.scope))
    {
        trace.lock().expect("trace").violations.push(format!(
            "{}: holds a row of {}, which it is not assigned",
            session.client_id, h.scope
        ));
    }
    // And every row it holds, or held since the last sync, is one the
    // server sent: its content digests to the digest it holds (recomputed
    // here, apart from the client).
    let puts = run.client.store().take_puts();
    if let Some(m) = run.client.manifest()
        && let Some(h) = (holdings.iter().chain(&puts))
            .find(|h| !invariants::system::digests_to_itself(m, &held(h)))
    {
        trace.lock().expect("trace").violations.push(format!(
            "{}: holds a {} row in {} whose content is not its digest",
            session.client_id, h.table, h.scope
        ));
    }
}

/// A holding as the judge reads it.
fn held(h: &client::local::Holding) -> HeldRow {
    HeldRow {
        scope: h.scope.clone(),
        table: h.table.clone(),
        identity: h.identity.clone(),
        row: h.row.clone(),
        version: h.version.clone(),
        digest: Digest(h.digest),
    }
}

/// The client bug a mutant stands for, planted in a device just opened.
fn plant(client: &mut Device, mutant: Option<SystemMutant>) {
    match mutant {
        Some(SystemMutant::TrustedChecksum) => client.plant_trusting_row_checksums(),
        Some(SystemMutant::KeepRemovedRows) => client.plant_keeping_removed_rows(),
        _ => {}
    }
}

/// A device: rounds of a write (new or an edit), a restart from its local
/// store, or an absence, each followed by a sync.
async fn device_main(
    index: usize,
    user: String,
    scenario: SystemScenario,
    mutant: Option<SystemMutant>,
    store: MemStore,
    grants: GrantLog,
    trace: Arc<Mutex<SystemTrace>>,
) -> Run {
    let client_id = format!("device-{index}");
    let local = Watched::new(&client_id, &user, grants, trace.clone());
    let transport = SimTransport::bind(
        index,
        &user,
        &scenario,
        mutant,
        store,
        local.clone(),
        trace.clone(),
    )
    .await;
    let mut client = Client::open(
        local,
        transport,
        &client_id,
        config(mutant),
        thread_rng().r#gen(),
    )
    .expect("open");
    plant(&mut client, mutant);
    let mut run = Run {
        client,
        user,
        authored: Vec::new(),
        mismatched: Vec::new(),
    };
    // A planted bug needs an answer it can break (a page that removes a
    // scope the device holds, a push whose answer is lost, ...), and such
    // an answer can come late or not at all in a run's rounds: the bug's
    // device goes on, up to four times its rounds, until the bug fired.
    let fires_late = mutant.is_some_and(SystemMutant::fires_on_an_answer);
    let more = |round: usize| {
        round < scenario.rounds
            || (fires_late && round < 4 * scenario.rounds && !trace.lock().expect("trace").mutated)
    };
    let mut round = 0;
    while more(round) {
        let connected = run.client.manifest().is_some();
        match thread_rng().gen_range(0..10) {
            0..=3 if connected => {
                let note = format!("00000000-0000-4000-a000-{index:06x}{round:06x}");
                let write = Write {
                    table: "tbl_notes".into(),
                    pk: Value::string(note.clone()),
                    op: WriteOp::Insert {
                        columns: object(&[
                            ("fld_notes_title", Value::string(format!("by {index}"))),
                            ("fld_notes_pinned", Value::Bool(false)),
                        ]),
                    },
                    client_version: client_version(),
                };
                let mutation_id = run.client.write(&write).expect("a valid write");
                run.authored.push(Authored {
                    mutation_id,
                    note,
                    fresh_insert: true,
                });
                trace.lock().expect("trace").writes += 1;
            }
            4 | 5 if connected => {
                // An edit of a note the device holds, against the version it knows.
                let rows = run.client.rows("tbl_notes").expect("rows");
                if !rows.is_empty() {
                    let r = &rows[thread_rng().gen_range(0..rows.len())];
                    let pk =
                        r.pk.as_object()
                            .and_then(|o| o.get("fld_notes_id"))
                            .cloned();
                    if let Some(pk) = pk
                        && let Ok(Some(base)) = run.client.version_of("tbl_notes", &pk)
                    {
                        let write = Write {
                            table: "tbl_notes".into(),
                            pk: pk.clone(),
                            op: WriteOp::Update {
                                base_version: base,
                                columns: object(&[(
                                    "fld_notes_title",
                                    Value::string(format!("edit {index}.{round}")),
                                )]),
                            },
                            client_version: client_version(),
                        };
                        let mutation_id = run.client.write(&write).expect("a valid write");
                        run.authored.push(Authored {
                            mutation_id,
                            note: pk.as_str().unwrap_or_default().to_owned(),
                            fresh_insert: false,
                        });
                        trace.lock().expect("trace").writes += 1;
                    }
                }
            }
            6 => {
                // The app restarts: only the local store survives.
                run.mismatched.extend(run.client.take_mismatched());
                let (store, transport) = run.client.into_parts();
                run.client = Client::open(
                    store,
                    transport,
                    &client_id,
                    config(mutant),
                    thread_rng().r#gen(),
                )
                .expect("reopen");
                plant(&mut run.client, mutant);
                trace.lock().expect("trace").restarts += 1;
            }
            7 => {
                // Offline for a while; writes made meanwhile wait in the outbox.
                trace.lock().expect("trace").offline += 1;
                sleep(Duration::from_millis(thread_rng().gen_range(1_000..4_000))).await;
            }
            _ => {}
        }
        sync(&mut run, &trace).await;
        sleep(Duration::from_millis(thread_rng().gen_range(50..400))).await;
        round += 1;
    }
    run
}

/// At quiescence: syncs `run` until its outbox is empty and a pull ends
/// on a terminal page with capture caught up (a database connection may
/// still drop: the device tries again, as it would).
async fn settle(run: &mut Run, store: &MemStore, trace: &Mutex<SystemTrace>) -> Result<(), String> {
    for _ in 0..40 {
        crate::capture::catch_up(store, store.last_commit_lsn().await).await?;
        match run.client.sync().await {
            Ok(_) => {
                run.mismatched.extend(run.client.take_mismatched());
                if run.client.pending().map_err(|e| e.to_string())? == 0 {
                    return Ok(());
                }
            }
            Err(
                SyncError::Unreachable(_)
                | SyncError::Unavailable(_)
                | SyncError::AssignmentChanging(_)
                | SyncError::RebuildRestarting(_),
            ) => {
                run.mismatched.extend(run.client.take_mismatched());
            }
            Err(e) => {
                run.mismatched.extend(run.client.take_mismatched());
                absorb(Err(e), run, trace);
                return Ok(());
            }
        }
        sleep(Duration::from_millis(500)).await;
    }
    Err(format!("{} never settled", run.client.session().client_id))
}

/// The server's config: the example's. Without a planted bug, retention
/// moves the floor every second with a window of three, so that
/// compaction runs beside every pull, push and crash, and an absent device
/// falls below the floor. The compaction bug's run keeps the month-long
/// window (its losses must not be healed by floor rebuilds), and the other
/// bugs' runs keep the defaults, as their scenarios were tuned.
fn server_config(mutant: Option<SystemMutant>) -> actors::config::SyncConfig {
    let mut config = actors::testkit::example_config(|s| s);
    match mutant {
        None => {
            config.retention.compact_interval_seconds = 1;
            config.retention.window_seconds = 3;
            config.retention.compact_batch = 8;
        }
        Some(SystemMutant::CompactAboveFloor) => {
            config.retention.compact_interval_seconds = 1;
            config.retention.compact_batch = 8;
        }
        Some(_) => {}
    }
    config
}

/// The operator rotates the token keys `rotations` times while devices
/// sync and the server crashes (ADR 0025). Each rotation waits until devices hold
/// tokens issued since the one before (eight answered requests presented
/// some), so that there are tokens to keep working across it.
async fn rotate_keys(
    store: MemStore,
    mutant: Option<SystemMutant>,
    rotations: usize,
    stop: Arc<AtomicBool>,
    trace: Arc<Mutex<SystemTrace>>,
) -> Result<(), String> {
    let presented = |trace: &Mutex<SystemTrace>, rotations: usize| {
        let t = trace.lock().expect("trace");
        (t.token_uses.iter())
            .filter(|u| u.status == 200 && !u.keys.is_empty() && u.rotations_before == rotations)
            .count()
    };
    for rotation in 0..rotations {
        loop {
            sleep(Duration::from_millis(thread_rng().gen_range(1_000..4_000))).await;
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            if presented(&trace, rotation) >= 8 {
                break;
            }
        }
        actors::key_ring::rotate(&store)
            .await
            .map_err(|e| e.to_string())?;
        let mut t = trace.lock().expect("trace");
        t.rotations += 1;
        t.mutated |= mutant == Some(SystemMutant::RotationForgetsKeys);
    }
    Ok(())
}

/// The position a presented cursor stands for; `None` when the store's
/// keys do not verify it (the planted rotation bug forgot its key: the
/// token judge reports that refusal).
async fn verified_position(store: &MemStore, token: &str) -> Option<StreamPosition> {
    let ring = actors::stream::load_key_ring(store).await.ok()?;
    Some(ring.verify_cursor(token).ok()?.position)
}

/// Runs a whole-system scenario under the current seed.
pub async fn run_system(scenario: SystemScenario) -> Result<SystemTrace, String> {
    let handle = Handle::current();
    let store = actors::testkit::example_mem_store(thread_rng().r#gen()).await;
    match scenario.mutant {
        Some(SystemMutant::CompactAboveFloor) => store.plant_compaction_above_floor().await,
        Some(SystemMutant::RotationForgetsKeys) => store.plant_rotation_forgets_keys().await,
        _ => {}
    }
    let (tripwire, trips) = Tripwire::arm(&CrashPoint::SYSTEM);
    let tripwire = Arc::new(tripwire);
    let database = {
        let tripwire = tripwire.clone();
        let mutant = scenario.mutant;
        crate::start_nodes(&store, scenario.packet_loss, move || {
            crate::serve_engine_with(
                server_config(mutant),
                Some(tripwire.clone()),
                crate::pull::route,
            )
        })
    };
    let trace = Arc::new(Mutex::new(SystemTrace::default()));
    // (Before the setup's own catching up: a tripwire may stop the first
    // acknowledgement, and only the crasher lets it go on.)
    let crasher = {
        let trace = trace.clone();
        crate::crash_server(
            scenario.server_crashes,
            1_000..15_000,
            Some(trips),
            move |point| {
                let mut t = trace.lock().expect("trace");
                t.crashes += 1;
                t.tripped.extend(point);
            },
        )
    };
    store
        .install_capture(&actors::capture::CapturePlan::new(&push_config()))
        .await
        .map_err(|e| e.to_string())?;
    crate::pull::seed_templates(&store).await?;
    crate::capture::catch_up(&store, store.last_commit_lsn().await).await?;
    let users = scenario.users;
    let stop = Arc::new(AtomicBool::new(false));
    let app = database.spawn(crate::pull::application(store.clone(), users, stop.clone()));
    let grants: GrantLog = Arc::default();
    let ops = database.spawn(crate::pull::operator(
        store.clone(),
        users,
        stop.clone(),
        Some(grants.clone()),
    ));
    // Key rotations in the run without a planted bug and in the rotation
    // bug's: the other bugs' runs keep the scenario they were tuned in.
    let rotates = matches!(
        scenario.mutant,
        None | Some(SystemMutant::RotationForgetsKeys)
    );
    let rotator = database.spawn(rotate_keys(
        store.clone(),
        scenario.mutant,
        if rotates { 2 } else { 0 },
        stop.clone(),
        trace.clone(),
    ));
    let mut tasks = Vec::new();
    for i in 0..users * scenario.devices {
        let user = format!("user-{}", i % users);
        let node = handle
            .create_node()
            .name(format!("device-{i}"))
            .ip(format!("10.0.2.{}", i + 1).parse().expect("ip"))
            .build();
        // A server bug fires once, through device 0. The client bug that
        // keeps a removed scope's rows is in every device's library: it
        // fires wherever the operator removes a scope a device holds.
        let everywhere = scenario.mutant == Some(SystemMutant::KeepRemovedRows);
        let mutant = if i == 0 || everywhere {
            scenario.mutant
        } else {
            None
        };
        let (scenario, store, grants, trace) = (
            scenario.clone(),
            store.clone(),
            grants.clone(),
            trace.clone(),
        );
        tasks.push(node.spawn(device_main(i, user, scenario, mutant, store, grants, trace)));
    }
    let mut runs = Vec::new();
    for t in tasks {
        runs.push(t.await.map_err(|e| format!("device failed: {e}"))?);
    }
    tripwire.disarm();
    crasher.await.map_err(|e| format!("crasher failed: {e}"))?;
    // Quiescence: the application and the operator stop, the link heals,
    // every device sends its outbox, capture catches up, every device pulls.
    stop.store(true, Ordering::Relaxed);
    app.await.map_err(|e| format!("application failed: {e}"))?;
    ops.await.map_err(|e| format!("operator failed: {e}"))?;
    rotator
        .await
        .map_err(|e| format!("key rotation failed: {e}"))??;
    NetSim::current().update_config(|c| c.packet_loss_rate = 0.0);
    for run in &mut runs {
        settle(run, &store, &trace).await?;
    }
    // Each device pulls once more: another's last push may have come after its pull.
    crate::capture::catch_up(&store, store.last_commit_lsn().await).await?;
    for run in &mut runs {
        settle(run, &store, &trace).await?;
    }
    // And once more past the age at which the server reads its key ring
    // again: every device presents the tokens it holds, issued before a
    // late rotation perhaps, to a server that has read the rotated ring.
    if rotates {
        sleep(actors::key_ring::RELOAD_AGE + Duration::from_secs(1)).await;
        for run in &mut runs {
            settle(run, &store, &trace).await?;
        }
    }
    let mut t = trace.lock().expect("trace").clone();
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    t.server.manifest = tx.manifests().await.map_err(|e| e.to_string())?.pop();
    for run in &runs {
        let id = run.client.session().client_id.clone();
        let record = tx
            .lock_client(&id)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("a device without a record")?;
        let assigned: Vec<String> = record
            .assigned
            .iter()
            .map(|s| s.as_str().to_owned())
            .collect();
        for scope in &record.assigned {
            let members = tx.scope_members(scope).await.map_err(|e| e.to_string())?;
            t.server.members.insert(
                scope.as_str().to_owned(),
                members
                    .into_iter()
                    .map(|(i, d)| (i.as_bytes().to_vec(), d))
                    .collect(),
            );
        }
        t.server.assigned.insert(id.clone(), assigned);
        let store = run.client.store();
        let mut scopes = std::collections::BTreeMap::new();
        for scope in run.client.session().scopes.keys() {
            let rows = store.holdings(scope).map_err(|e| e.to_string())?;
            scopes.insert(
                scope.clone(),
                rows.into_iter()
                    .map(|h| (h.identity, Digest(h.digest)))
                    .collect(),
            );
        }
        t.clients.push(ClientEnd {
            client_id: id,
            user: run.user.clone(),
            scopes,
            authored: run.authored.clone(),
            outcomes: store
                .outcomes()
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|o| Settled {
                    mutation_id: o.mutation_id,
                    status: o.status,
                    code: o.code,
                })
                .collect(),
            pending: run.client.pending().map_err(|e| e.to_string())?,
            mismatched: run.mismatched.clone(),
            held: store
                .all_holdings()
                .map_err(|e| e.to_string())?
                .iter()
                .map(held)
                .collect(),
        });
    }
    drop(tx);
    Ok(t)
}
