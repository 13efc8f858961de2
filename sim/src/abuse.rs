//! One abusive user beside ordinary ones (issue 24): the abuser registers
//! client IDs as fast as it can, starts rebuild after rebuild with fresh
//! `rebuild_id`s and floods pulls, from several nodes at once, while the
//! ordinary users sync at a person's pace, over lossy links, with the
//! server crashing. Judged by `invariants::admission`: no ordinary user is
//! ever answered 429 and nobody 500, at most one rebuild session lives per
//! client and scope (sampled all along on the database node), a user's
//! staging stays within its budget, and no user binds more client IDs than
//! its cap.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::capture::SourceImage;
use actors::config::SyncConfig;
use actors::store::{MemStore, Store, StoreTx};
use actors::testkit::ConnectBody;
use invariants::admission::{Answer, LiveSession};
use invariants::pull::{Rebuilding, Replica};
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::Handle;
use madsim::time::sleep;
use protocol::json::{self, Value};

use crate::link::Link;
use crate::now_micros;

const CONNECT: u8 = 0;
const PULL: u8 = 2;
const REBUILD: u8 = 3;

/// The abuser's user ID.
pub const ABUSER: &str = "abuser";

/// Knobs of one abuse run.
#[derive(Clone, Debug)]
pub struct AbuseScenario {
    pub ordinary_users: usize,
    pub pulls_per_user: usize,
    /// The abuser's nodes, each looping as fast as answers come.
    pub abuser_nodes: usize,
    pub packet_loss: f64,
    pub server_crashes: usize,
    /// A planted bug: every user's page share is zero.
    pub plant_zero_share: bool,
    /// Planted bugs in the store's rebuild sessions.
    pub plant_no_supersede: bool,
    pub plant_blind_usage: bool,
}

impl Default for AbuseScenario {
    fn default() -> Self {
        AbuseScenario {
            ordinary_users: 3,
            pulls_per_user: 20,
            abuser_nodes: 3,
            packet_loss: 0.02,
            server_crashes: 2,
            plant_zero_share: false,
            plant_no_supersede: false,
            plant_blind_usage: false,
        }
    }
}

/// What an abuse run recorded.
#[derive(Clone, Debug, Default)]
pub struct AbuseTrace {
    pub answers: Vec<Answer>,
    /// Every sample of the store's live sessions that broke a rule.
    pub session_violations: Vec<String>,
    pub samples: usize,
    /// Every bound client's user, at the end.
    pub bound: Vec<String>,
    pub crashes: usize,
    /// Protocol failures an ordinary client saw (a page it cannot apply).
    pub problems: Vec<String>,
}

impl AbuseTrace {
    /// How many answers `user`'s side got with `status`.
    pub fn count(&self, abuser: bool, status: u16) -> usize {
        (self.answers.iter())
            .filter(|a| (a.user == ABUSER) == abuser && a.status == status)
            .count()
    }
}

/// The run's limits: small, so that the abuser meets every one.
pub fn config(zero_share: bool) -> SyncConfig {
    let mut c = actors::testkit::example_config(|s| s);
    c.server.pull_pages = 6;
    let l = &mut c.limits;
    l.rebuild_rows_per_user = 10;
    l.rebuild_rows_total = 1_000;
    // An ordinary client resends a request every 800 ms until answered
    // (the sim's link), so while the server is slow it holds more than
    // one page, and spends more than one request a second.
    l.pages_per_user = if zero_share { 0 } else { 3 };
    l.requests_per_user_per_second = 2;
    l.request_burst_per_user = 6;
    // The flood gate (ADR 0018), above every ordinary user's requests of
    // all endpoints, below the abuser's.
    l.flood_requests_per_user_per_second = 5;
    l.flood_burst_per_user = 15;
    // Its bound on a user's requests in the server at once: the abuser's
    // nodes, each with resends in flight, pass it.
    l.requests_in_flight_per_user = 4;
    l.registrations_per_user_per_hour = 10;
    c
}

async fn server_main(config: SyncConfig) {
    crate::serve_engine_with(config, None, |engine, user, body| async move {
        let now = now_micros();
        match body.split_first() {
            Some((&CONNECT, body)) => engine.connect(&user, body.to_vec(), now).await,
            Some((&REBUILD, body)) => engine.rebuild(&user, body.to_vec(), now).await,
            Some((_, body)) => engine.pull(&user, body.to_vec(), now).await,
            None => engine.pull(&user, Vec::new(), now).await,
        }
    })
    .await;
}

fn record(trace: &Mutex<AbuseTrace>, user: &str, endpoint: &'static str, status: u16, at: i64) {
    trace.lock().expect("trace").answers.push(Answer {
        user: user.to_owned(),
        endpoint,
        status,
        at_micros: at,
    });
}

/// One call; every answer is recorded (a resend after a lost answer is
/// another request, as on a real network).
async fn call(
    link: &mut Link,
    user: &str,
    kind: u8,
    body: &[u8],
    trace: &Mutex<AbuseTrace>,
) -> (u16, Vec<u8>) {
    let endpoint = match kind {
        CONNECT => "connect",
        REBUILD => "rebuild",
        _ => "pull",
    };
    let (status, answer) = link
        .call(user, kind, body, false, &|| {})
        .await
        .swap_remove(0);
    record(trace, user, endpoint, status, now_micros());
    (status, answer)
}

/// A fresh connect of `client_id`: its generation and connect body, if 200.
async fn connect(
    link: &mut Link,
    user: &str,
    client_id: &str,
    trace: &Mutex<AbuseTrace>,
) -> Option<(u64, Vec<u8>)> {
    let body = json::to_canonical(&ConnectBody::fresh(client_id).to_json());
    let (status, answer) = call(link, user, CONNECT, &body, trace).await;
    if status != 200 {
        return None;
    }
    let v = json::parse(&answer).ok()?;
    let g = match &v.as_object()?["client_generation"] {
        Value::Number(n) => n.as_exact_i64()? as u64,
        _ => return None,
    };
    Some((g, answer))
}

async fn replica(store: &MemStore) -> Replica {
    let mut tx = store.begin().await.expect("begin");
    let manifest = tx
        .manifests()
        .await
        .expect("manifests")
        .pop()
        .expect("manifest");
    Replica::new(manifest)
}

/// An ordinary user: one device that pulls at a person's pace (every
/// two seconds, within the run's rate of two a second), rebuilds
/// its own scope once, and waits as `Retry-After` says after a 503.
async fn ordinary(index: usize, pulls: usize, store: MemStore, trace: Arc<Mutex<AbuseTrace>>) {
    let user = format!("user-{index}");
    let client_id = format!("ordinary-{index}");
    let mut link = Link::bind(((index + 1) as u64) << 40).await;
    let (generation, body) = loop {
        if let Some(c) = connect(&mut link, &user, &client_id, &trace).await {
            break c;
        }
        sleep(Duration::from_secs(5)).await;
    };
    let mut replica = replica(&store).await;
    replica.connected(&body).expect("a connect body");
    let scope = format!("user:{user}");
    let mut rebuilt = false;
    for p in 0..pulls {
        if p == pulls / 2 && !rebuilt {
            let attempt = Rebuilding::new(&scope, &format!("00000000-0000-4000-8000-{index:012x}"));
            let body = replica.rebuild_request(&attempt, &client_id, generation, 100);
            let (status, _) = call(&mut link, &user, REBUILD, &body, &trace).await;
            rebuilt = status == 200;
        }
        let body = replica.request(&client_id, generation, 100);
        let (status, page) = call(&mut link, &user, PULL, &body, &trace).await;
        match status {
            200 => {
                if let Err(e) = replica.apply(&page) {
                    trace
                        .lock()
                        .expect("trace")
                        .problems
                        .push(format!("{client_id}: a page no server may send: {e}"));
                }
                sleep(Duration::from_millis(thread_rng().gen_range(1_500..2_500))).await;
            }
            _ => sleep(Duration::from_millis(thread_rng().gen_range(4_000..6_000))).await,
        }
    }
}

/// One node of the abuser: registrations, fresh rebuild attempts and
/// pulls, as fast as answers come, until `stop`.
async fn abuser(
    node: usize,
    store: MemStore,
    stop: Arc<AtomicBool>,
    trace: Arc<Mutex<AbuseTrace>>,
) {
    let mut link = Link::bind(((100 + node) as u64) << 40).await;
    let mut clients: Vec<(String, u64, Replica)> = Vec::new();
    let mut attempts = 0u64;
    let mut registered = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let roll = thread_rng().gen_range(0..10);
        if clients.is_empty() || roll == 0 {
            registered += 1;
            let client_id = format!("ab-{node}-{registered}");
            if let Some((g, body)) = connect(&mut link, ABUSER, &client_id, &trace).await {
                let mut r = replica(&store).await;
                r.connected(&body).expect("a connect body");
                clients.push((client_id, g, r));
            }
        } else {
            let (client_id, generation, r) = &clients[thread_rng().gen_range(0..clients.len())];
            if roll < 4 {
                attempts += 1;
                let scope = if roll < 3 {
                    "user:abuser"
                } else {
                    "templates_public"
                };
                let id = format!("00000000-0000-4000-9{node:03x}-{attempts:012x}");
                let body =
                    r.rebuild_request(&Rebuilding::new(scope, &id), client_id, *generation, 1);
                call(&mut link, ABUSER, REBUILD, &body, &trace).await;
            } else {
                let body = r.request(client_id, *generation, 100);
                call(&mut link, ABUSER, PULL, &body, &trace).await;
            }
        }
        sleep(Duration::from_millis(thread_rng().gen_range(20..60))).await;
    }
}

/// Samples the store's live sessions until `stop`, judging each sample.
async fn sessions(
    store: MemStore,
    budget: u64,
    stop: Arc<AtomicBool>,
    trace: Arc<Mutex<AbuseTrace>>,
) {
    while !stop.load(Ordering::Relaxed) {
        sleep(Duration::from_millis(100)).await;
        let live: Vec<LiveSession> = (store.live_rebuild_sessions(now_micros()).await)
            .into_iter()
            .map(|s| LiveSession {
                client_id: s.client_id,
                user_id: s.user_id,
                scope: s.scope,
                rows: s.rows,
            })
            .collect();
        let mut t = trace.lock().expect("trace");
        t.samples += 1;
        if let Err(v) = invariants::admission::check_sessions(&live, budget) {
            t.session_violations.extend(v);
        }
    }
}

/// Notes of `owner` (the abuser's scope must hold rows to stage).
async fn seed(store: &MemStore, owner: &str, notes: usize) -> Result<(), String> {
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    for k in 0..notes {
        let row: SourceImage = [
            (
                "id",
                Some(format!(
                    "00000000-0000-4000-8000-{:06x}{k:06x}",
                    owner.len()
                )),
            ),
            ("owner_id", Some(owner.to_owned())),
            ("title", Some(format!("{owner} {k}"))),
            ("body", None),
            ("pinned", Some("f".to_owned())),
            ("updated_at", Some("2026-07-18 14:00:01+00".to_owned())),
            ("deleted_at", None),
        ]
        .into_iter()
        .map(|(c, v)| (c.to_owned(), v))
        .collect();
        tx.source_insert("public.notes", row)
            .map_err(|e| format!("{e:?}"))?;
    }
    tx.commit().await.map_err(|e| e.to_string())
}

/// Runs `scenario`.
pub async fn run_abuse(scenario: AbuseScenario) -> Result<AbuseTrace, String> {
    let handle = Handle::current();
    let store = actors::testkit::example_mem_store(thread_rng().r#gen()).await;
    if scenario.plant_no_supersede {
        store.plant_no_supersede().await;
    }
    if scenario.plant_blind_usage {
        store.plant_blind_rebuild_usage().await;
    }
    let config = config(scenario.plant_zero_share);
    let budget = config.limits.rebuild_rows_per_user;
    let database = {
        let config = config.clone();
        crate::start_nodes(&store, scenario.packet_loss, move || {
            server_main(config.clone())
        })
    };
    store
        .install_capture(&actors::capture::CapturePlan::new(&config))
        .await
        .map_err(|e| e.to_string())?;
    crate::pull::seed_templates(&store).await?;
    seed(&store, ABUSER, 6).await?;
    crate::capture::catch_up(&store, store.last_commit_lsn().await).await?;
    let trace = Arc::new(Mutex::new(AbuseTrace::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = database.spawn(sessions(store.clone(), budget, stop.clone(), trace.clone()));
    let mut abusers = Vec::new();
    for n in 0..scenario.abuser_nodes {
        let node = handle
            .create_node()
            .name(format!("abuser-{n}"))
            .ip(format!("10.0.2.{}", n + 1).parse().expect("ip"))
            .build();
        abusers.push(node.spawn(abuser(n, store.clone(), stop.clone(), trace.clone())));
    }
    let mut ordinaries = Vec::new();
    for i in 0..scenario.ordinary_users {
        let node = handle
            .create_node()
            .name(format!("ordinary-{i}"))
            .ip(format!("10.0.1.{}", i + 1).parse().expect("ip"))
            .build();
        let task = ordinary(i, scenario.pulls_per_user, store.clone(), trace.clone());
        ordinaries.push(node.spawn(task));
    }
    let crasher = {
        let trace = trace.clone();
        crate::crash_server(scenario.server_crashes, 1_000..8_000, None, move |_| {
            trace.lock().expect("trace").crashes += 1;
        })
    };
    for o in ordinaries {
        o.await
            .map_err(|e| format!("an ordinary user failed: {e}"))?;
    }
    stop.store(true, Ordering::Relaxed);
    for a in abusers {
        a.await.map_err(|e| format!("the abuser failed: {e}"))?;
    }
    sampler
        .await
        .map_err(|e| format!("the sampler failed: {e}"))?;
    crasher
        .await
        .map_err(|e| format!("the crasher failed: {e}"))?;
    let mut t = trace.lock().expect("trace").clone();
    t.bound = store.bound_users().await;
    Ok(t)
}

/// The users that stay within their share: every ordinary one.
pub fn ordinary_users(scenario: &AbuseScenario) -> BTreeSet<String> {
    (0..scenario.ordinary_users)
        .map(|i| format!("user-{i}"))
        .collect()
}
