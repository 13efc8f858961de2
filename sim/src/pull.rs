//! Pull under faults: clients pull over a lossy link (lost requests and
//! lost responses, each retried with the identical bytes), push now and
//! then (so `capture_pending` happens), while the server crashes and
//! restarts and the application writes, moves, shares, soft-deletes and
//! deletes rows on the database node, and an operator grants and revokes
//! team scopes. Each client applies every page to an
//! `invariants::pull::Replica`, exactly as the spec tells a client to.
//!
//! Judged by `invariants::pull`: every page is one a conforming server may
//! send; no installed cursor passes an undelivered effect; checkpoints
//! never move backward; after quiescence every client's copy of every
//! assigned scope is the server's, digest for digest.
//!
//! A [`Mutant`] tampers with what a client receives, as a server bug would
//! send it; the same checks must then fail.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::capture::{EffectOp, SourceImage};
use actors::store::{MemStore, Store, StoreTx};
use actors::testkit::{
    ConnectBody, cursor_bindings, cursor_generation, cursor_position, mint_cursor, note_columns,
    note_mutation, push_config,
};
use invariants::pull::{EffectView, RebuildStep, Rebuilding, Replica};
use invariants::rebuild::PageLog;
use invariants::system::GrantChange;
use madsim::net::NetSim;
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::Handle;
use madsim::time::sleep;
use protocol::ids::ScopeId;
use protocol::json::{self, Value};
use protocol::position::{Boundary, StreamPosition};

use crate::link::Link;
use crate::now_micros;
use crate::tripwire::{CrashPoint, Tripwire};

const CONNECT: u8 = 0;
const PUSH: u8 = 1;
const PULL: u8 = 2;
const REBUILD: u8 = 3;
/// Notes the application writes (shared by every user: they move between owners).
const POOL: usize = 10;
const TEAMS: usize = 2;

/// A server bug planted in what clients receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutant {
    /// One page loses one of its changes.
    DropChange,
    /// One cursor is issued one effect past where it may stand.
    CursorTooFar,
    /// One rebuild page loses one of its records.
    DropRecord,
    /// After a stream reset, a pull judges a cursor of the old generation
    /// current and continues from its position with a new one.
    CrossGeneration,
    /// The store renders rebuild pages from the rows as they are now, not
    /// as staged (ADR 0017): in the store, so every client's pages. The
    /// mutant's client has the application change a row of each page it
    /// gets, and replays the page once capture took the change.
    LivePages,
    /// The store never sees a client's fence pending: a pull right after
    /// a push is served from before the push was captured.
    UnseenFences,
    /// The store keeps a row's earlier upsert in a scope where a later one
    /// should replace it, while the row's projection, which pages serve
    /// (ADR 0037), moves on: a client past the kept effect never receives
    /// the change.
    KeptBackReplacements,
}

/// Knobs of one pull run.
#[derive(Clone, Debug)]
pub struct PullScenario {
    pub clients: usize,
    pub users: usize,
    pub pulls_per_client: usize,
    pub packet_loss: f64,
    pub server_crashes: usize,
    pub mutant: Option<Mutant>,
    /// Mid-run, the slot is lost and an operator resets the stream (ADR 0012).
    pub reset: bool,
    /// A second server process serves the odd clients: it stands by while
    /// the first leads capture, hears its fence reports (ADR 0028), and
    /// leads while the first is down.
    pub standby: bool,
}

impl Default for PullScenario {
    fn default() -> Self {
        PullScenario {
            clients: 4,
            users: 3,
            pulls_per_client: 12,
            packet_loss: 0.03,
            server_crashes: 3,
            mutant: None,
            reset: false,
            standby: false,
        }
    }
}

/// What a pull run recorded.
#[derive(Clone, Debug, Default)]
pub struct PullTrace {
    /// Violations of `invariants::pull`, and problems the harness saw.
    pub violations: Vec<String>,
    /// The run has a planted bug: it ends at its first violation.
    pub planted: bool,
    pub pages: usize,
    pub changes: usize,
    pub retries: usize,
    pub capture_pending: usize,
    pub unavailable: usize,
    pub crashes: usize,
    pub rebuild_pages: usize,
    /// Rebuild attempts that had to start over (409 `rebuild_restart_required`).
    pub restarts: usize,
    /// Rebuild pages requested again and compared.
    pub replays: usize,
    /// Reconnects that renewed a client's generation (its cursors stale).
    pub reconnects: usize,
    /// Local rows the run damaged.
    pub damages: usize,
    /// Terminal checksums that caught a local copy the run had damaged.
    pub mismatches: usize,
    /// The crash points the server died at.
    pub tripped: BTreeSet<CrashPoint>,
    /// The longest time capture stood still while commits waited, before
    /// quiescence (sampled each simulated second).
    pub longest_capture_stall: Duration,
    /// Whether the planted mutant fired.
    pub mutated: bool,
    /// Stream resets the operator made.
    pub resets: usize,
    /// Clients that applied a pull page (and so hold cursors).
    pub pulled: BTreeSet<String>,
    /// Pulls that presented a cursor of an older stream generation.
    pub stale_generations: usize,
    /// Every push the server accepted: (client, note).
    pub accepted: Vec<(String, String)>,
    /// Every checkpoint read, per (client, scope), in order.
    pub checkpoints: BTreeMap<(String, String), Vec<(u64, StreamPosition)>>,
}

/// The row identity of the note with this key.
fn note_identity(note: &str) -> Vec<u8> {
    protocol::digest::RowIdentity::new(
        "tbl_notes",
        "fld_notes_id",
        &protocol::value::TypedValue::String(note.to_owned()),
    )
    .as_bytes()
    .to_vec()
}

fn note_key(k: usize) -> String {
    format!("00000000-0000-4000-8000-{:012x}", 0x5000 + k)
}

/// The server node: the real engine, stopping where `tripwire` arms it;
/// the first body byte names the endpoint.
pub(crate) async fn server_main(tripwire: Arc<Tripwire>) {
    crate::serve_engine(Some(tripwire), route).await;
}

/// The standby server node: the same engine at [`crate::STANDBY`].
async fn standby_main() {
    let config = actors::testkit::example_config(|s| s);
    crate::serve_engine_at(crate::STANDBY, config, None, route).await;
}

/// Answers one request frame: its first byte names the endpoint.
pub(crate) async fn route(engine: actors::Engine, user: String, body: Vec<u8>) -> actors::Reply {
    match body.split_first() {
        Some((&CONNECT, body)) => engine.connect(&user, body.to_vec(), now_micros()).await,
        Some((&PUSH, body)) => engine.push(&user, body.to_vec(), now_micros()).await,
        Some((&REBUILD, body)) => engine.rebuild(&user, body.to_vec(), now_micros()).await,
        Some((_, body)) => engine.pull(&user, body.to_vec(), now_micros()).await,
        None => engine.pull(&user, Vec::new(), now_micros()).await,
    }
}

/// One call, resent until answered; the first answer.
async fn call(
    link: &mut Link,
    user: &str,
    kind: u8,
    body: &[u8],
    trace: &Mutex<PullTrace>,
) -> (u16, Vec<u8>) {
    let resent = || trace.lock().expect("trace").retries += 1;
    let mut answers = link.call(user, kind, body, false, &resent).await;
    answers.swap_remove(0)
}

/// One client as the run follows it.
pub struct Client {
    user: String,
    client_id: String,
    generation: u64,
    replica: Replica,
    link: Link,
    mutant: Option<Mutant>,
    /// This client's index, for its rebuild attempts' IDs.
    index: usize,
    attempts: u64,
    rebuilt: PageLog,
    /// Scopes whose local copy the run damaged: their terminal checksum
    /// must catch it (and they are rebuilt).
    damaged: BTreeSet<String>,
}

impl Client {
    fn note(&self, trace: &Mutex<PullTrace>, v: String) {
        trace.lock().expect("trace").violations.push(v);
    }

    /// Damages one local row of a scope (its stored digest no longer its
    /// content's), as a bad disk would; `false` when no scope holds a row.
    fn damage(&mut self) -> bool {
        let held: Vec<String> = (self.replica.scopes.iter())
            .filter(|(_, l)| !l.rows.is_empty())
            .map(|(s, _)| s.clone())
            .collect();
        if held.is_empty() {
            return false;
        }
        let scope = &held[thread_rng().gen_range(0..held.len())];
        let Some(l) = self.replica.scopes.get_mut(scope) else {
            return false;
        };
        let k = thread_rng().gen_range(0..l.rows.len());
        if let Some(row) = l.rows.values_mut().nth(k) {
            row.digest.0[0] ^= 0x5a;
        }
        self.damaged.insert(scope.clone());
        true
    }

    /// Connects again presenting a generation the client no longer has,
    /// with its scopes and cursors: the server renews the generation.
    async fn reconnect(&mut self, trace: &Mutex<PullTrace>) {
        self.connect_at(self.generation + 5, trace).await;
        trace.lock().expect("trace").reconnects += 1;
    }

    /// A `409 client_generation_expired` (a resent connect renewed the
    /// generation once more): connect again at the server's generation, as
    /// the spec tells a client to. `false` when the answer is not that.
    async fn adopt_generation(&mut self, answer: &[u8], trace: &Mutex<PullTrace>) -> bool {
        let Some(current) = json::parse(answer).ok().and_then(|v| {
            let e = v.as_object()?.get("error")?.as_object()?.clone();
            if e.get("code")?.as_str()? != "client_generation_expired" {
                return None;
            }
            match e.get("current_client_generation")? {
                Value::Number(n) => n.as_exact_i64().and_then(|i| u64::try_from(i).ok()),
                _ => None,
            }
        }) else {
            return false;
        };
        self.connect_at(current, trace).await;
        true
    }

    /// Connects presenting `generation`, the client's scopes and cursors.
    async fn connect_at(&mut self, generation: u64, trace: &Mutex<PullTrace>) {
        let mut body = ConnectBody::fresh(&self.client_id);
        body.generation = Some(generation);
        body.schema = self.replica.schema_reference();
        body.scope_set_version = self.replica.scope_set_version;
        body.known = self
            .replica
            .scopes
            .iter()
            .map(|(s, l)| (s.clone(), l.cursor.clone()))
            .collect();
        let body = json::to_canonical(&body.to_json());
        let (mut status, mut answer) =
            call(&mut self.link, &self.user, CONNECT, &body, trace).await;
        // A retryable answer: the identical request again after a pause.
        for _ in 0..20 {
            if status != 503 {
                break;
            }
            sleep(Duration::from_millis(thread_rng().gen_range(200..400))).await;
            (status, answer) = call(&mut self.link, &self.user, CONNECT, &body, trace).await;
        }
        if status != 200 {
            return; // a retry of a lost answer may see the renewal done; the next round goes on
        }
        let v = json::parse(&answer).expect("json");
        if let Value::Number(n) = &v.as_object().expect("object")["client_generation"] {
            self.generation = n.as_exact_i64().expect("generation") as u64;
        }
        if let Err(e) = self.replica.connected(&answer) {
            self.note(trace, format!("{}: a connect body: {e}", self.client_id));
        }
    }

    /// Rebuilds every scope that needs it through `/sync/rebuild`.
    async fn rebuild(&mut self, store: &MemStore, trace: &Mutex<PullTrace>) {
        let stale = self.replica.needs_rebuild();
        for scope in stale {
            self.rebuild_scope(&scope, store, trace).await;
        }
    }

    /// Rebuilds `scope` in a new attempt at a random limit, starting over
    /// after a 409 or a checksum that does not verify; each page is
    /// retried with the identical request until answered, and now and then
    /// requested again, which must give the same bytes.
    async fn rebuild_scope(&mut self, scope: &str, store: &MemStore, trace: &Mutex<PullTrace>) {
        for _ in 0..8 {
            self.attempts += 1;
            let id = format!(
                "00000000-0000-4000-9000-{:06x}{:06x}",
                self.index, self.attempts
            );
            let mut attempt = Rebuilding::new(scope, &id);
            // Every third attempt at limit 1, so that scopes of two rows
            // or more are served over several pages in every run.
            let limit = if self.attempts % 3 == 1 {
                1
            } else {
                thread_rng().gen_range(1..=4)
            };
            // A planted bug that fired in an attempt that then restarted
            // did no harm yet: it is armed again.
            let mut dropped = false;
            loop {
                let body = self.rebuild_body(&attempt, limit);
                let (status, mut page) =
                    call(&mut self.link, &self.user, REBUILD, &body, trace).await;
                match status {
                    200 => {}
                    409 if self.adopt_generation(&page, trace).await => break,
                    409 => {
                        trace.lock().expect("trace").restarts += 1;
                        if dropped {
                            self.mutant = Some(Mutant::DropRecord);
                        }
                        break;
                    }
                    503 | 429 => {
                        sleep(Duration::from_millis(thread_rng().gen_range(4_000..6_000))).await;
                        continue;
                    }
                    // The scope was revoked since the client last pulled:
                    // the next pull reconciles it away. Only a grant can be
                    // revoked; the user's own and shared scopes never are.
                    400 if scope.starts_with("team:")
                        && attempt.continuation.is_none()
                        && page.windows(14).any(|w| w == b"is not assigne") =>
                    {
                        return;
                    }
                    s => {
                        self.note(
                            trace,
                            format!(
                                "{}: rebuild answered {s}: {}",
                                self.client_id,
                                String::from_utf8_lossy(&page)
                            ),
                        );
                        return;
                    }
                }
                if let Err(v) = self.rebuilt.record(&body, &page) {
                    self.note(trace, format!("{}: {v}", self.client_id));
                }
                let live_pages = self.mutant == Some(Mutant::LivePages);
                if live_pages || thread_rng().gen_bool(0.25) {
                    // Later in simulated time: the application writes
                    // meanwhile (for the live-pages bug, to a row of this
                    // page, and capture has time to take it).
                    if live_pages {
                        if touch_a_record(store, &page).await {
                            let touched = Boundary::TransactionEnd {
                                commit_lsn: store.last_commit_lsn().await,
                            };
                            for _ in 0..100 {
                                if boundary_now(store).await >= touched {
                                    break;
                                }
                                sleep(Duration::from_millis(100)).await;
                            }
                        }
                    } else {
                        sleep(Duration::from_millis(thread_rng().gen_range(0..2_000))).await;
                    }
                    let (again, replayed) =
                        call(&mut self.link, &self.user, REBUILD, &body, trace).await;
                    if again == 200 {
                        trace.lock().expect("trace").replays += 1;
                        if let Err(v) = self.rebuilt.record(&body, &replayed) {
                            self.note(trace, format!("{}: {v}", self.client_id));
                        }
                    }
                }
                if self.mutant == Some(Mutant::DropRecord)
                    && let Some(lost) = drop_record(&page)
                {
                    page = lost;
                    dropped = true;
                    self.mutant = None;
                    trace.lock().expect("trace").mutated = true;
                }
                trace.lock().expect("trace").rebuild_pages += 1;
                match self.replica.apply_rebuild(&mut attempt, &page) {
                    Ok(RebuildStep::More(_)) => {}
                    Ok(RebuildStep::Done) => return,
                    Ok(RebuildStep::Mismatch) => {
                        self.note(
                            trace,
                            format!(
                                "{}: the rebuilt checksum of {scope} does not verify",
                                self.client_id
                            ),
                        );
                        break;
                    }
                    Err(e) => {
                        self.note(
                            trace,
                            format!("{}: a rebuild page no server may send: {e}", self.client_id),
                        );
                        return;
                    }
                }
            }
        }
        self.note(
            trace,
            format!("{}: {scope} could not be rebuilt", self.client_id),
        );
    }

    /// The request of `attempt`'s next page.
    fn rebuild_body(&self, attempt: &Rebuilding, limit: u16) -> Vec<u8> {
        self.replica
            .rebuild_request(attempt, &self.client_id, self.generation, limit)
    }

    /// One pull, retried until a page comes; the page applied and judged.
    /// `Some(terminal)` when a page was applied.
    async fn pull(&mut self, store: &MemStore, trace: &Mutex<PullTrace>) -> Option<bool> {
        self.rebuild(store, trace).await;
        let limit = thread_rng().gen_range(1..=6);
        let body = self
            .replica
            .request(&self.client_id, self.generation, limit);
        // This client's accepted pushes so far: a terminal answer holds them.
        let pushed: Vec<Vec<u8>> = (trace.lock().expect("trace").accepted.iter())
            .filter(|(client, _)| *client == self.client_id)
            .map(|(_, note)| note_identity(note))
            .collect();
        let mut page = loop {
            let (status, page) = call(&mut self.link, &self.user, PULL, &body, trace).await;
            match status {
                200 => break page,
                503 => {
                    let mut t = trace.lock().expect("trace");
                    if page.windows(15).any(|w| w == b"capture_pending") {
                        t.capture_pending += 1;
                    } else {
                        t.unavailable += 1;
                    }
                }
                429 => {}
                409 if self.adopt_generation(&page, trace).await => return None,
                s => {
                    self.note(
                        trace,
                        format!(
                            "{}: pull answered {s}: {}",
                            self.client_id,
                            String::from_utf8_lossy(&page)
                        ),
                    );
                    return None;
                }
            }
            // As Retry-After says (the adapter sends 5 seconds), with jitter.
            sleep(Duration::from_millis(thread_rng().gen_range(4_000..6_000))).await;
        };
        let received = boundary_now(store).await;
        let generation_now = {
            let mut tx = store.begin().await.expect("begin");
            tx.stream_state().await.expect("stream").generation
        };
        if let Some(m) = self.mutant.filter(|m| *m != Mutant::DropRecord)
            && let Some(mutated) = mutate(m, &page, self, store, received).await
        {
            page = mutated;
            self.mutant = None;
            trace.lock().expect("trace").mutated = true;
        }
        // No cursor is installed across generations: a scope's next cursor
        // belongs to the generation of the one it continues.
        if let Err(v) = across_generations(store, &self.replica, &page, trace).await {
            self.note(trace, format!("{}: {v}", self.client_id));
        }
        let applied = match self.replica.apply(&page) {
            Ok(a) => a,
            Err(e) => {
                self.note(
                    trace,
                    format!("{}: a page no server may send: {e}", self.client_id),
                );
                return None;
            }
        };
        {
            let mut t = trace.lock().expect("trace");
            t.pages += 1;
            t.changes += applied.changes;
            t.pulled.insert(self.client_id.clone());
        }
        for s in &applied.mismatched {
            if self.damaged.remove(s) {
                trace.lock().expect("trace").mismatches += 1;
                continue; // caught: its cursor is dropped, so it is rebuilt
            }
            self.note(
                trace,
                format!(
                    "{}: the terminal checksum of {s} differs from the local copy",
                    self.client_id
                ),
            );
        }
        if !applied.has_more {
            // A damaged row that a change overwrote (or removed) healed.
            self.damaged.clear();
            let own = format!("user:{}", self.user);
            if applied.cursors.contains(&own)
                && !applied.mismatched.contains(&own)
                && let Err(v) = invariants::pull::check_own_writes(
                    &own,
                    &pushed,
                    &self.replica.scopes[&own].rows,
                )
            {
                self.note(trace, format!("{}: {v}", self.client_id));
            }
        }
        for s in &applied.cursors {
            if let Err(v) = check_installed(store, s, &self.replica, received, generation_now).await
            {
                self.note(trace, format!("{}: {v}", self.client_id));
            }
        }
        let mut tx = store.begin().await.expect("begin");
        let checkpoints = tx.checkpoints(&self.client_id).await.expect("checkpoints");
        drop(tx);
        let mut t = trace.lock().expect("trace");
        for (scope, c) in checkpoints {
            t.checkpoints
                .entry((self.client_id.clone(), scope.as_str().to_owned()))
                .or_default()
                .push((c.stream_generation, c.position));
        }
        Some(!applied.has_more && applied.rebuild.is_empty() && applied.mismatched.is_empty())
    }
}

/// The scope's effects since the stream began through `through`, as the
/// checker sees them.
pub(crate) async fn effects_of(
    store: &MemStore,
    scope: &str,
    through: Boundary,
) -> Vec<EffectView> {
    let scope = ScopeId::parse(scope).expect("scope");
    let tx = store.begin().await.expect("begin");
    let effects = tx.journaled_effects(&scope, StreamPosition::GenerationStart, through);
    effects
        .into_iter()
        .map(|e| EffectView {
            identity: e.identity.as_bytes().to_vec(),
            position: e.position(),
            version: e.op.version().as_str().to_owned(),
            removes: matches!(e.op, EffectOp::Remove(_)),
            tombstone: matches!(e.op, EffectOp::Tombstone(_)),
        })
        .collect()
}

/// `invariants::pull::check_cursor` for the cursor just installed on `scope`.
/// Judged against the effects through `received`, the boundary when the
/// page arrived: at or past the page's own, so an effect materialized
/// since only counts as still to come.
async fn check_installed(
    store: &MemStore,
    scope: &str,
    replica: &Replica,
    received: Boundary,
    generation: u64,
) -> Result<(), String> {
    let local = &replica.scopes[scope];
    let Some(cursor) = &local.cursor else {
        return Ok(());
    };
    if cursor_generation(store, cursor).await != generation {
        // Issued before a reset that came since: stale, and the next pull
        // sends the scope to rebuild. The old effects are gone with it.
        return Ok(());
    }
    let at = cursor_position(store, cursor).await;
    let effects = effects_of(store, scope, received).await;
    invariants::pull::check_cursor(scope, &effects, at, &local.rows)
}

/// `invariants::pull::check_generations` for a pull page: each cursor it
/// returns against the one the client presented for that scope.
async fn across_generations(
    store: &MemStore,
    replica: &Replica,
    page: &[u8],
    trace: &Mutex<PullTrace>,
) -> Result<(), String> {
    let Ok(v) = json::parse(page) else {
        return Ok(()); // the replica reports a page that is not JSON
    };
    let Some(Value::Object(returned)) = v.as_object().and_then(|o| o.get("scope_cursors")) else {
        return Ok(());
    };
    let current = {
        let mut tx = store.begin().await.expect("begin");
        tx.stream_state().await.expect("stream").generation
    };
    let mut pairs = Vec::new();
    for (scope, local) in &replica.scopes {
        if let Some(presented) = &local.cursor {
            let before = cursor_generation(store, presented).await;
            if before < current {
                trace.lock().expect("trace").stale_generations += 1;
            }
            if let Some(Value::String(next)) = returned.get(scope) {
                pairs.push((scope.clone(), before, cursor_generation(store, next).await));
            }
        }
    }
    invariants::pull::check_generations(&pairs)
}

/// The capture boundary now.
pub(crate) async fn boundary_now(store: &MemStore) -> Boundary {
    let mut tx = store.begin().await.expect("begin");
    tx.capture_progress().await.expect("progress").boundary
}

/// Whether holding `held` differs from the state `e` leaves.
fn differs(held: Option<&invariants::pull::LocalRow>, e: &EffectView) -> bool {
    match held {
        None => !e.removes,
        Some(r) => e.removes || r.version != e.version || r.tombstone != e.tombstone,
    }
}

/// `e` is its row's last effect so far: nothing will cover it.
pub(crate) fn is_last(effects: &[EffectView], e: &EffectView) -> bool {
    !effects
        .iter()
        .any(|l| l.identity == e.identity && l.position > e.position)
}

/// The application changes a note or a template this rebuild page holds,
/// if it holds one: whether it did.
async fn touch_a_record(store: &MemStore, page: &[u8]) -> bool {
    let Ok(Value::Object(o)) = json::parse(page) else {
        return false;
    };
    let Some(Value::Array(records)) = o.get("records") else {
        return false;
    };
    let mut tx = store.begin().await.expect("begin");
    for r in records {
        let Some(Value::Object(pk)) = r.as_object().and_then(|r| r.get("pk")) else {
            continue;
        };
        let Some(id) = pk.values().next().and_then(Value::as_str) else {
            continue;
        };
        let key: SourceImage = [("id".to_owned(), Some(id.to_owned()))]
            .into_iter()
            .collect();
        for (table, column) in [("public.notes", "title"), ("public.templates", "body")] {
            if tx.source_row(table, &key).is_some() {
                let changed: SourceImage = [(column.to_owned(), Some(format!("touched {id}")))]
                    .into_iter()
                    .collect();
                return tx.source_update(table, &key, changed).is_ok() && tx.commit().await.is_ok();
            }
        }
    }
    false
}

/// The page as the planted bug would have sent it, if it applies here: the
/// bug must lose something the client would notice (a change that moves its
/// state and that no later effect replaces), or it did no harm.
async fn mutate(
    m: Mutant,
    page: &[u8],
    c: &Client,
    store: &MemStore,
    received: Boundary,
) -> Option<Vec<u8>> {
    let mut v = json::parse(page).ok()?;
    let o = match &mut v {
        Value::Object(o) => o,
        _ => return None,
    };
    match m {
        Mutant::DropRecord
        | Mutant::LivePages
        | Mutant::UnseenFences
        | Mutant::KeptBackReplacements => return None,
        Mutant::CrossGeneration => {
            let current = {
                let mut tx = store.begin().await.ok()?;
                tx.stream_state().await.ok()?.generation
            };
            let Some(Value::Array(rebuild)) = o.get("rebuild") else {
                return None;
            };
            // A scope sent to rebuild because its cursor is of an older
            // generation: the bug continues it from the old position instead.
            let mut victim = None;
            for s in rebuild {
                let scope = s.as_str()?;
                if let Some(token) = c.replica.scopes.get(scope).and_then(|l| l.cursor.clone())
                    && cursor_generation(store, &token).await < current
                {
                    victim = Some((scope.to_owned(), cursor_position(store, &token).await));
                    break;
                }
            }
            let (scope, at) = victim?;
            let b = cursor_bindings(store, &c.user, &c.client_id, c.generation, &scope, at).await;
            let token = mint_cursor(store, &b).await;
            if let Some(Value::Array(rebuild)) = o.get_mut("rebuild") {
                rebuild.retain(|s| s.as_str() != Some(scope.as_str()));
            }
            if let Some(Value::Object(cursors)) = o.get_mut("scope_cursors") {
                cursors.insert(scope, Value::string(token));
            }
        }
        Mutant::DropChange => {
            let Some(Value::Array(changes)) = o.get_mut("changes") else {
                return None;
            };
            let mut victim = None;
            for (i, change) in changes.iter().enumerate() {
                let ch = change.as_object()?;
                let scope = ch.get("scope")?.as_str()?;
                let version = ch.get("server_version")?.as_str()?;
                let identity = c.replica.identity_of(change)?;
                let effects = effects_of(store, scope, received).await;
                let Some(e) = effects.iter().rev().find(|e| e.identity == identity) else {
                    continue;
                };
                let held = c.replica.scopes.get(scope)?.rows.get(&identity);
                if e.version == version && differs(held, e) {
                    victim = Some(i);
                    break;
                }
            }
            changes.remove(victim?);
        }
        Mutant::CursorTooFar => {
            let Some(Value::Object(cursors)) = o.get_mut("scope_cursors") else {
                return None;
            };
            let mut replaced = None;
            for (scope, token) in cursors.iter() {
                let at = cursor_position(store, token.as_str()?).await;
                let effects = effects_of(store, scope, received).await;
                let Some(rows) = c.replica.scopes.get(scope).map(|s| &s.rows) else {
                    continue;
                };
                let next = effects.iter().find(|e| {
                    e.position > at && is_last(&effects, e) && differs(rows.get(&e.identity), e)
                });
                if let Some(next) = next {
                    let b = cursor_bindings(
                        store,
                        &c.user,
                        &c.client_id,
                        c.generation,
                        scope,
                        next.position,
                    )
                    .await;
                    replaced = Some((scope.clone(), mint_cursor(store, &b).await));
                    break;
                }
            }
            let (scope, token) = replaced?;
            cursors.insert(scope, Value::string(token));
        }
    }
    Some(json::to_canonical(&v))
}

/// The rebuild page with its first record lost, if it has one.
fn drop_record(page: &[u8]) -> Option<Vec<u8>> {
    let mut v = json::parse(page).ok()?;
    let Value::Object(o) = &mut v else {
        return None;
    };
    let Some(Value::Array(records)) = o.get_mut("records") else {
        return None;
    };
    if records.is_empty() {
        return None;
    }
    records.remove(0);
    Some(json::to_canonical(&v))
}

/// A client: connect, then pulls (and now and then a push) with pauses.
async fn client_main(
    index: usize,
    user: String,
    pulls: usize,
    store: MemStore,
    mutant: Option<Mutant>,
    trace: Arc<Mutex<PullTrace>>,
    server: &'static str,
) -> Client {
    let mut link = Link::bind_to((index as u64) << 40, server).await;
    let client_id = format!("pull-client-{index}");
    let connect = json::to_canonical(&ConnectBody::fresh(&client_id).to_json());
    let (generation, body) = loop {
        let (status, body) = call(&mut link, &user, CONNECT, &connect, &trace).await;
        if status == 200 {
            let v = json::parse(&body).expect("json");
            let g = match &v.as_object().expect("object")["client_generation"] {
                Value::Number(n) => n.as_exact_i64().expect("generation") as u64,
                _ => panic!("no generation"),
            };
            break (g, body);
        }
        sleep(Duration::from_millis(200)).await;
    };
    let mut tx = store.begin().await.expect("begin");
    let manifest = tx
        .manifests()
        .await
        .expect("manifests")
        .pop()
        .expect("manifest");
    drop(tx);
    let schema = manifest.reference().to_json();
    let mut replica = Replica::new(manifest);
    replica.connected(&body).expect("a connect body");
    let mut c = Client {
        user,
        client_id,
        generation,
        replica,
        link,
        mutant,
        index,
        attempts: 0,
        rebuilt: PageLog::default(),
        damaged: BTreeSet::new(),
    };
    // A damaged copy is caught by the same check a planted bug trips, so
    // the bug's client keeps its copy intact.
    let damages = mutant.is_none();
    // A planted bug needs a page it can break (the cross-generation bug, a
    // page after the reset, which waits for every client's first page; the
    // cursor-moving bug, an effect past a page's cursor), and such a page
    // can come late when capture stalls: the bug's client pulls on, up to
    // four times as often, until the bug has fired.
    let keeps_cursors = c.mutant == Some(Mutant::CrossGeneration);
    let more = |p: usize| {
        p < pulls || (mutant.is_some() && p < 4 * pulls && !trace.lock().expect("trace").mutated)
    };
    let mut p = 0;
    while more(p) {
        if caught(&trace) {
            break;
        }
        // (A bug's client writes a row of its own, so it has a change and
        // a record to lose.)
        let seeded =
            matches!(c.mutant, Some(Mutant::DropRecord | Mutant::DropChange)) && p == pulls / 2 - 1;
        // (The run shows that the standby accepts pushes: its clients push
        // at every pull of the second half until one is accepted.)
        let owes_push = server == crate::STANDBY
            && p >= pulls / 2
            && !(trace.lock().expect("trace").accepted.iter()).any(|(id, _)| *id == c.client_id);
        if seeded || owes_push || thread_rng().gen_bool(0.1) {
            push_one(&mut c, &schema, index, p, &trace).await;
        }
        // Now and then a scope's local state is lost (a wiped cache): it is
        // rebuilt before the next pull. Or one of its rows is damaged on
        // disk: the next terminal checksum must catch it, and the client
        // rebuilds that scope.
        // Now and then the client reconnects presenting an old generation
        // (as a restored device does): it is renewed, so every cursor it
        // holds is stale, and the next pull sends each scope to rebuild.
        // (The cross-generation bug's client keeps its cursors for the
        // reset to make stale: it neither reconnects nor loses a scope.)
        if p > 0 && !keeps_cursors && thread_rng().gen_bool(0.05) {
            c.reconnect(&trace).await;
        }
        // (The planted record-losing bug needs a rebuild with records:
        // its client loses its own scope in the run's second half.)
        if c.mutant == Some(Mutant::DropRecord) && p >= pulls / 2 {
            for l in c.replica.scopes.values_mut() {
                if !l.rows.is_empty() {
                    l.cursor = None;
                }
            }
        } else if p > 0 && !keeps_cursors && thread_rng().gen_bool(0.15) {
            let scopes: Vec<String> = c.replica.scopes.keys().cloned().collect();
            if !scopes.is_empty() {
                let lost = &scopes[thread_rng().gen_range(0..scopes.len())];
                if let Some(l) = c.replica.scopes.get_mut(lost) {
                    l.cursor = None;
                }
            }
        }
        if damages && (p == pulls / 3 || thread_rng().gen_bool(0.1)) && c.damage() {
            trace.lock().expect("trace").damages += 1;
        }
        c.pull(&store, &trace).await;
        sleep(Duration::from_millis(thread_rng().gen_range(10..200))).await;
        p += 1;
    }
    c
}

/// Whether a run with a planted bug has caught it: the run ends there,
/// since what follows cannot un-catch it.
fn caught(trace: &Mutex<PullTrace>) -> bool {
    let t = trace.lock().expect("trace");
    t.planted && !t.violations.is_empty()
}

/// A sealed batch of one new note, retried until a terminal answer.
async fn push_one(
    c: &mut Client,
    schema: &Value,
    index: usize,
    p: usize,
    trace: &Mutex<PullTrace>,
) {
    let id = format!("00000000-0000-4000-9000-{:06x}{:06x}", index, p);
    let m = note_mutation(
        1 + p as u64,
        &id,
        schema,
        "insert",
        None,
        Some(note_columns("pushed")),
    );
    let body = json::to_canonical(&json::object([
        ("client_id", Value::string(&c.client_id)),
        ("client_generation", Value::int(c.generation as i64)),
        (
            "batch_id",
            Value::string(format!("50000000-0000-4000-8000-{:06x}{:06x}", index, p)),
        ),
        ("schema", schema.clone()),
        ("mutations", Value::Array(vec![m])),
    ]));
    for _ in 0..200 {
        let (status, answer) = call(&mut c.link, &c.user, PUSH, &body, trace).await;
        if status != 503 {
            let accepted = status == 200
                && json::parse(&answer).is_ok_and(|v| actors::testkit::outcome(&v, 1 + p as u64).0);
            if accepted {
                trace
                    .lock()
                    .expect("trace")
                    .accepted
                    .push((c.client_id.clone(), id));
            }
            return;
        }
        sleep(Duration::from_millis(100)).await;
    }
}

/// The application on the database node: writes, moves, shares, deletes.
pub(crate) async fn application(store: MemStore, users: usize, stop: Arc<AtomicBool>) {
    let image = |pairs: &[(&str, Option<String>)]| -> SourceImage {
        pairs
            .iter()
            .map(|(c, v)| ((*c).to_owned(), v.clone()))
            .collect()
    };
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        sleep(Duration::from_millis(thread_rng().gen_range(100..400))).await;
        n += 1;
        let mut rng = thread_rng();
        let id = note_key(rng.gen_range(0..POOL));
        let owner = format!("user-{}", rng.gen_range(0..users));
        let key = image(&[("id", Some(id.clone()))]);
        let mut tx = store.begin().await.expect("begin");
        let exists = tx.source_row("public.notes", &key).is_some();
        let r = if !exists {
            tx.source_insert(
                "public.notes",
                image(&[
                    ("id", Some(id.clone())),
                    ("owner_id", Some(owner)),
                    ("title", Some(format!("t{n}"))),
                    ("body", None),
                    ("pinned", Some("f".into())),
                    ("updated_at", Some("2026-07-18 14:00:01+00".into())),
                    ("deleted_at", None),
                ]),
            )
            .map(|_| ())
        } else {
            match rng.gen_range(0..10) {
                0..=2 => tx
                    .source_update(
                        "public.notes",
                        &key,
                        image(&[("title", Some(format!("t{n}")))]),
                    )
                    .map(|_| ()),
                // Moves to another owner: leaves one user scope, enters another.
                3 | 4 => tx
                    .source_update("public.notes", &key, image(&[("owner_id", Some(owner))]))
                    .map(|_| ()),
                5 | 6 => {
                    let team = format!("t{}", rng.gen_range(0..TEAMS));
                    let share = image(&[("note_id", Some(id.clone())), ("team_id", Some(team))]);
                    if tx.source_row("public.note_shares", &share).is_some() {
                        tx.source_delete("public.note_shares", &share).map(|_| ())
                    } else {
                        tx.source_insert("public.note_shares", share).map(|_| ())
                    }
                }
                7 => {
                    let deleted = rng
                        .gen_bool(0.7)
                        .then(|| "2026-07-18 14:00:02+00".to_owned());
                    tx.source_update("public.notes", &key, image(&[("deleted_at", deleted)]))
                        .map(|_| ())
                }
                _ => {
                    for t in 0..TEAMS {
                        let share = image(&[
                            ("note_id", Some(id.clone())),
                            ("team_id", Some(format!("t{t}"))),
                        ]);
                        if tx.source_row("public.note_shares", &share).is_some() {
                            let _ = tx.source_delete("public.note_shares", &share);
                        }
                    }
                    tx.source_delete("public.notes", &key).map(|_| ())
                }
            }
        };
        if r.is_ok() {
            tx.commit().await.expect("commit");
        }
    }
}

/// A few templates before the clients come: the shared scope every client
/// rebuilds first (at limit 1) then takes several pages.
pub(crate) async fn seed_templates(store: &MemStore) -> Result<(), String> {
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    for k in 0..3 {
        let row: SourceImage = [
            ("id", format!("tpl-{k}")),
            ("name", format!("template {k}")),
            ("body", "-".to_owned()),
        ]
        .into_iter()
        .map(|(c, v)| (c.to_owned(), Some(v)))
        .collect();
        tx.source_insert("public.templates", row)
            .map_err(|e| format!("{e:?}"))?;
    }
    tx.commit().await.map_err(|e| e.to_string())
}

/// The longest time, until `stop`, that capture's boundary stood still
/// while a later commit waited.
async fn capture_stalls(store: MemStore, stop: Arc<AtomicBool>) -> Duration {
    const EVERY: Duration = Duration::from_secs(1);
    let (mut longest, mut current) = (Duration::ZERO, Duration::ZERO);
    let mut last_boundary = None;
    while !stop.load(Ordering::Relaxed) {
        sleep(EVERY).await;
        let committed = store.last_commit_lsn().await;
        let boundary = boundary_now(&store).await;
        let through = match boundary {
            Boundary::GenerationStart => 0,
            Boundary::TransactionEnd { commit_lsn } => commit_lsn,
        };
        if Some(boundary) == last_boundary && through < committed {
            current += EVERY;
            longest = longest.max(current);
        } else {
            current = Duration::ZERO;
        }
        last_boundary = Some(boundary);
    }
    longest
}

/// The operator: grants and revokes team scopes.
/// Each change is written to `log` (when given) with the span it happened in.
pub(crate) async fn operator(
    store: MemStore,
    users: usize,
    stop: Arc<AtomicBool>,
    log: Option<Arc<Mutex<Vec<GrantChange>>>>,
) {
    while !stop.load(Ordering::Relaxed) {
        sleep(Duration::from_millis(thread_rng().gen_range(200..900))).await;
        let user = format!("user-{}", thread_rng().gen_range(0..users));
        let scope = format!("team:t{}", thread_rng().gen_range(0..TEAMS));
        let granted = thread_rng().gen_bool(0.6);
        let from = now_micros();
        if granted {
            store.grant(&user, &scope).await;
        } else {
            store.revoke(&user, &scope).await;
        }
        if let Some(log) = &log {
            log.lock().expect("log").push(GrantChange {
                user,
                scope,
                granted,
                from,
                to: now_micros(),
            });
        }
    }
}

/// Runs a pull scenario under the current seed.
pub async fn run_pull(scenario: PullScenario) -> Result<PullTrace, String> {
    let handle = Handle::current();
    let store = actors::testkit::example_mem_store(thread_rng().r#gen()).await;
    let (tripwire, trips) = Tripwire::arm(&CrashPoint::REBUILD);
    let tripwire = Arc::new(tripwire);
    let database = {
        let tripwire = tripwire.clone();
        crate::start_nodes(&store, scenario.packet_loss, move || {
            server_main(tripwire.clone())
        })
    };
    if scenario.standby {
        crate::start_standby(standby_main);
    }
    let trace = Arc::new(Mutex::new(PullTrace {
        planted: scenario.mutant.is_some(),
        ..PullTrace::default()
    }));
    store
        .install_capture(&actors::capture::CapturePlan::new(&push_config()))
        .await
        .map_err(|e| e.to_string())?;
    seed_templates(&store).await?;
    crate::capture::catch_up(&store, store.last_commit_lsn().await).await?;
    if scenario.mutant == Some(Mutant::LivePages) {
        store.plant_live_rebuild_pages().await;
    }
    if scenario.mutant == Some(Mutant::UnseenFences) {
        store.plant_unseen_fences().await;
    }
    if scenario.mutant == Some(Mutant::KeptBackReplacements) {
        store.plant_replacements_kept_back().await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let app = database.spawn(application(store.clone(), scenario.users, stop.clone()));
    let ops = database.spawn(operator(store.clone(), scenario.users, stop.clone(), None));
    let stalls = database.spawn(capture_stalls(store.clone(), stop.clone()));
    // A third of the way through the clients' pulls, so most come after
    // it, and once every client holds cursors of the old generation.
    let reset_after = scenario.clients * scenario.pulls_per_client / 3;
    let reset = scenario.reset.then(|| {
        database.spawn(reset_operator(
            store.clone(),
            trace.clone(),
            reset_after,
            scenario.clients,
        ))
    });
    let mut tasks = Vec::new();
    for i in 0..scenario.clients {
        let user = format!("user-{}", i % scenario.users);
        let node = handle
            .create_node()
            .name(format!("client-{i}"))
            .ip(format!("10.0.1.{}", i + 1).parse().expect("ip"))
            .build();
        // The mutant lives in one client (the store's in the store; that
        // client then replays every rebuild page it gets).
        let mutant = if i == 0 { scenario.mutant } else { None };
        let server = if scenario.standby && i % 2 == 1 {
            crate::STANDBY
        } else {
            crate::SERVER
        };
        tasks.push(node.spawn(client_main(
            i,
            user,
            scenario.pulls_per_client,
            store.clone(),
            mutant,
            trace.clone(),
            server,
        )));
    }
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
    let mut clients = Vec::new();
    for t in tasks {
        clients.push(t.await.map_err(|e| format!("client failed: {e}"))?);
    }
    tripwire.disarm();
    crasher.await.map_err(|e| format!("crasher failed: {e}"))?;
    if let Some(r) = reset {
        r.await.map_err(|e| format!("reset operator failed: {e}"))?;
    }
    // Quiescence: the application and the operator stop, the link heals,
    // capture catches up, and every client pulls to a terminal page.
    stop.store(true, Ordering::Relaxed);
    app.await.map_err(|e| format!("application failed: {e}"))?;
    ops.await.map_err(|e| format!("operator failed: {e}"))?;
    trace.lock().expect("trace").longest_capture_stall = stalls
        .await
        .map_err(|e| format!("stall sampler failed: {e}"))?;
    NetSim::current().update_config(|c| c.packet_loss_rate = 0.0);
    crate::capture::catch_up(&store, store.last_commit_lsn().await).await?;
    for c in &mut clients {
        if caught(&trace) {
            break;
        }
        let mut terminal = false;
        for _ in 0..400 {
            if c.pull(&store, &trace).await == Some(true) {
                terminal = true;
                break;
            }
        }
        if !terminal {
            trace.lock().expect("trace").violations.push(format!(
                "{}: no terminal page after quiescence",
                c.client_id
            ));
        }
    }
    let mut t = trace.lock().expect("trace").clone();
    // The store's bug has its chance on every rebuild page rendered.
    if scenario.mutant == Some(Mutant::LivePages) {
        t.mutated = t.rebuild_pages > 0;
    }
    // The store's bug has its chance on every pull after an accepted push.
    if scenario.mutant == Some(Mutant::UnseenFences) {
        t.mutated = !t.accepted.is_empty();
    }
    if scenario.mutant == Some(Mutant::KeptBackReplacements) {
        t.mutated = store.replacements_kept_back().await > 0;
    }
    if let Err(v) = invariants::pull::check_checkpoints(&t.checkpoints) {
        t.violations.push(v);
    }
    // Every assigned scope: the local copy is the server's.
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    for c in &clients {
        let record = tx
            .lock_client(&c.client_id)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("a client without a record")?;
        let local: Vec<&String> = c.replica.scopes.keys().collect();
        let assigned: Vec<String> = record
            .assigned
            .iter()
            .map(|s| s.as_str().to_owned())
            .collect();
        if local
            .iter()
            .map(|s| s.as_str())
            .ne(assigned.iter().map(String::as_str))
        {
            t.violations.push(format!(
                "{}: holds scopes {local:?}, assigned {assigned:?}",
                c.client_id
            ));
        }
        for scope in &record.assigned {
            let members = tx.scope_members(scope).await.map_err(|e| e.to_string())?;
            let server: Vec<(Vec<u8>, protocol::digest::Digest)> = members
                .into_iter()
                .map(|(i, d)| (i.as_bytes().to_vec(), d))
                .collect();
            let empty = BTreeMap::new();
            let rows = c
                .replica
                .scopes
                .get(scope.as_str())
                .map_or(&empty, |s| &s.rows);
            if let Err(v) =
                invariants::pull::check_converged(&c.client_id, scope.as_str(), rows, &server)
            {
                t.violations.push(v);
            }
        }
    }
    drop(tx);
    // No accepted push is lost: each reached its author (its own scope).
    for (client_id, note) in &t.accepted {
        let c = clients
            .iter()
            .find(|c| &c.client_id == client_id)
            .ok_or("an unknown author")?;
        let held = c
            .replica
            .scopes
            .get(&format!("user:{}", c.user))
            .is_some_and(|s| s.rows.contains_key(&note_identity(note)));
        if !held {
            t.violations
                .push(format!("{client_id}: the accepted push of {note} is lost"));
        }
    }
    Ok(t)
}

/// The operator's reset (ADR 0012), once mid-run: after `pages` pages and
/// a page applied by each of the `clients` (or fifteen simulated minutes:
/// capture can stall for minutes, and at five one client had applied no
/// page yet, so it held no cursor for the reset to make stale; seed 1041), the
/// slot is lost (the application keeps writing), capture blocks, then the
/// stream is reset.
async fn reset_operator(
    store: MemStore,
    trace: Arc<Mutex<PullTrace>>,
    pages: usize,
    clients: usize,
) {
    for _ in 0..9000 {
        {
            let t = trace.lock().expect("trace");
            if t.pages >= pages && t.pulled.len() >= clients {
                break;
            }
        }
        sleep(Duration::from_millis(100)).await;
    }
    sleep(Duration::from_millis(thread_rng().gen_range(0..3_000))).await;
    store.lose_slot().await;
    sleep(Duration::from_millis(thread_rng().gen_range(1_000..4_000))).await;
    let mut tx = store.begin().await.expect("begin");
    tx.reset_stream().await.expect("reset");
    tx.commit().await.expect("commit");
    trace.lock().expect("trace").resets += 1;
}
