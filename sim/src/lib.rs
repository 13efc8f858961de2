//! Deterministic simulation of synchro under madsim: the real `Engine` on a
//! `MemStore`, on a server node that crashes and restarts, with client nodes
//! connecting over a lossy link. One seed fixes everything.
//!
//! Build and run only with `RUSTFLAGS="--cfg madsim"` (see docs/TESTING.md).
#![cfg(madsim)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a test harness fails loudly

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub mod abuse;
pub mod capture;
pub mod evolution;
mod link;
pub mod pull;
pub mod push;
pub mod remote;
pub mod system;
pub mod tripwire;

use actors::store::MemStore;
use actors::testkit::ConnectBody;
use invariants::ConnectObservation;
use madsim::net::{Endpoint, NetSim};
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::Handle;
use madsim::time::{Instant, TimeHandle, sleep, sleep_until};
use protocol::json::{self, Value};
use tokio::sync::mpsc;
use tripwire::{CrashPoint, Tripwire};

pub(crate) const SERVER: &str = "10.0.0.1:7000";
/// A second server process on the same database, which never crashes:
/// while the first leads capture it stands by, and it leads once the
/// first is gone.
pub(crate) const STANDBY: &str = "10.0.0.3:7000";
pub(crate) const REQUEST: u64 = 1;
pub(crate) const RESPONSE: u64 = 2;
/// Largest datagram either side accepts.
pub(crate) const MAX_FRAME: usize = 1 << 20;

/// Knobs of one simulated run.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub clients: usize,
    pub users: usize,
    /// Extra clients, one per user, whose first connects all claim one new
    /// `client_id` at once: exactly one user may win it.
    pub contested: bool,
    pub connects_per_client: usize,
    pub packet_loss: f64,
    pub server_crashes: bool,
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            clients: 6,
            users: 3,
            contested: true,
            connects_per_client: 12,
            packet_loss: 0.05,
            server_crashes: true,
        }
    }
}

/// What a run recorded.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub connects: Vec<ConnectObservation>,
    /// Faults and operator actions, in order, for the determinism check and debugging.
    pub events: Vec<String>,
    /// Requests sent again because no answer came in time.
    pub retries: usize,
    /// Server crashes (each followed by a restart).
    pub crashes: usize,
    /// Answers `503 temporary_unavailable` (the database did not answer in time).
    pub unavailable: usize,
}

/// The nodes every scenario runs: the database node serving `store`, and
/// the server node running `server` (at [`SERVER`]), with every message
/// lost at `packet_loss`. Returns the database node, for the application.
pub(crate) fn start_nodes<F, Fut>(
    store: &MemStore,
    packet_loss: f64,
    server: F,
) -> madsim::runtime::NodeHandle
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    let handle = Handle::current();
    NetSim::current().update_config(|c| c.packet_loss_rate = packet_loss);
    let database = remote::database_node(&handle, store.clone());
    handle
        .create_node()
        .name("server")
        .ip("10.0.0.1".parse().expect("ip"))
        .init(server)
        .build();
    database
}

/// Starts the standby server node (at [`STANDBY`]) running `server`.
pub(crate) fn start_standby<F, Fut>(server: F)
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    Handle::current()
        .create_node()
        .name("standby")
        .ip("10.0.0.3".parse().expect("ip"))
        .init(server)
        .build();
}

/// Kills and restarts the server node `crashes` times, each after a pause
/// drawn from `between` (milliseconds), and each time a tripwire of `trips`
/// fires; `crashed` is told of each (with the point, for a tripwire). Ends
/// when the random crashes are done and the tripwire is disarmed.
pub(crate) fn crash_server(
    crashes: usize,
    between: std::ops::Range<u64>,
    mut trips: Option<mpsc::UnboundedReceiver<CrashPoint>>,
    crashed: impl Fn(Option<CrashPoint>) + Send + 'static,
) -> madsim::task::JoinHandle<()> {
    let handle = Handle::current();
    madsim::task::spawn(async move {
        let mut left = crashes;
        let pause = |between: &std::ops::Range<u64>| {
            Instant::now() + Duration::from_millis(thread_rng().gen_range(between.clone()))
        };
        let mut next = pause(&between);
        loop {
            let listening = trips.is_some();
            let tripped = async {
                match trips.as_mut() {
                    Some(t) => t.recv().await,
                    None => std::future::pending().await,
                }
            };
            // `Some(None)`: a random crash; `Some(Some(p))`: a tripwire at
            // `p`; `None`: the tripwire was disarmed.
            let cause = tokio::select! {
                biased;
                _ = sleep_until(next), if left > 0 => {
                    left -= 1;
                    next = pause(&between);
                    Some(None)
                }
                point = tripped, if listening => point.map(Some),
                else => break,
            };
            let Some(cause) = cause else {
                trips = None;
                continue;
            };
            handle.kill("server");
            sleep(Duration::from_millis(thread_rng().gen_range(20..300))).await;
            handle.restart("server");
            crashed(cause);
        }
    })
}

/// `request_id || user_len || user || body`.
pub(crate) fn encode_request(id: u64, user: &str, body: &[u8]) -> Vec<u8> {
    let mut f = id.to_be_bytes().to_vec();
    f.extend_from_slice(&(user.len() as u32).to_be_bytes());
    f.extend_from_slice(user.as_bytes());
    f.extend_from_slice(body);
    f
}

pub(crate) fn decode_request(f: &[u8]) -> Option<(u64, String, Vec<u8>)> {
    let id = u64::from_be_bytes(f.get(..8)?.try_into().ok()?);
    let n = u32::from_be_bytes(f.get(8..12)?.try_into().ok()?) as usize;
    let user = String::from_utf8(f.get(12..12 + n)?.to_vec()).ok()?;
    Some((id, user, f.get(12 + n..)?.to_vec()))
}

/// `request_id || status || body`.
pub(crate) fn encode_response(id: u64, status: u16, body: &[u8]) -> Vec<u8> {
    let mut f = id.to_be_bytes().to_vec();
    f.extend_from_slice(&status.to_be_bytes());
    f.extend_from_slice(body);
    f
}

pub(crate) fn decode_response(f: &[u8]) -> Option<(u64, u16, Vec<u8>)> {
    let id = u64::from_be_bytes(f.get(..8)?.try_into().ok()?);
    let status = u16::from_be_bytes(f.get(8..10)?.try_into().ok()?);
    Some((id, status, f.get(10..)?.to_vec()))
}

pub(crate) fn now_micros() -> i64 {
    let t = TimeHandle::current().now_time();
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// The server node's program: the real engine, on the database node's store,
/// behind a datagram endpoint; `route` answers each request.
pub(crate) async fn serve_engine<F, Fut>(tripwire: Option<Arc<Tripwire>>, route: F)
where
    F: Fn(actors::Engine, String, Vec<u8>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = actors::Reply> + Send + 'static,
{
    serve_engine_with(actors::testkit::example_config(|s| s), tripwire, route).await;
}

/// [`serve_engine`] with `config`.
pub(crate) async fn serve_engine_with<F, Fut>(
    config: actors::config::SyncConfig,
    tripwire: Option<Arc<Tripwire>>,
    route: F,
) where
    F: Fn(actors::Engine, String, Vec<u8>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = actors::Reply> + Send + 'static,
{
    serve_engine_at(SERVER, config, tripwire, route).await;
}

/// [`serve_engine_with`], listening at `address`.
pub(crate) async fn serve_engine_at<F, Fut>(
    address: &str,
    config: actors::config::SyncConfig,
    tripwire: Option<Arc<Tripwire>>,
    route: F,
) where
    F: Fn(actors::Engine, String, Vec<u8>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = actors::Reply> + Send + 'static,
{
    let incarnation: u32 = thread_rng().r#gen();
    let store = remote::RemoteStore::new(incarnation as u64, tripwire);
    let engine = remote::start_engine_with(store, config).await;
    let ep = Arc::new(Endpoint::bind(address).await.expect("bind"));
    let mut buf = vec![0u8; MAX_FRAME];
    loop {
        let Ok((n, from)) = ep.recv_from(REQUEST, &mut buf).await else {
            continue;
        };
        let Some((id, user, body)) = decode_request(&buf[..n]) else {
            continue;
        };
        let (engine, ep, route) = (engine.clone(), ep.clone(), route.clone());
        madsim::task::spawn(async move {
            let reply = route(engine, user, body).await;
            let _ = ep
                .send_to(
                    from,
                    RESPONSE,
                    &encode_response(id, reply.status, &reply.body),
                )
                .await;
        });
    }
}

/// The connect server.
async fn server_main() {
    serve_engine(None, |engine, user, body| async move {
        engine.connect(&user, body, now_micros()).await
    })
    .await;
}

/// Applies a 200 connect response to the client's next request.
fn advance(body: &mut ConnectBody, response: &Value) {
    let o = response.as_object().expect("object");
    let scopes = o["scopes"].as_object().expect("scopes");
    if let Value::Array(remove) = &scopes["remove"] {
        let gone: BTreeSet<&str> = remove.iter().filter_map(Value::as_str).collect();
        body.known.retain(|(s, _)| !gone.contains(s.as_str()));
    }
    if let Value::Array(add) = &scopes["add"] {
        for a in add {
            let id = a.as_object().expect("add")["id"]
                .as_str()
                .expect("id")
                .to_owned();
            body.known.push((id, None));
        }
    }
    let schema = o["schema"].as_object().expect("schema");
    if schema["action"].as_str() != Some("unsupported") {
        body.schema = json::object([
            ("version", schema["version"].clone()),
            ("hash", schema["hash"].clone()),
        ]);
    }
    if let Value::Number(n) = &o["client_generation"] {
        body.generation = n.as_exact_i64().map(|g| g as u64);
    }
    if let Value::Number(n) = &o["scope_set_version"] {
        body.scope_set_version = n.as_exact_i64().unwrap_or(0) as u64;
    }
}

/// One client node's program: sequential connects, each retried until answered.
async fn client_main(
    index: usize,
    client_id: String,
    user: String,
    connects: usize,
    trace: Arc<Mutex<Trace>>,
) {
    let ep = Endpoint::bind("0.0.0.0:0").await.expect("bind");
    let server: SocketAddr = SERVER.parse().expect("address");
    let mut body = ConnectBody::fresh(&client_id);
    let mut buf = vec![0u8; MAX_FRAME];
    let mut next_id = (index as u64) << 32;
    let mut done = 0;
    while done < connects {
        next_id += 1;
        let request = encode_request(next_id, &user, &json::to_canonical(&body.to_json()));
        // Retry the identical request until its response arrives (lost requests and responses).
        let (status, response) = loop {
            let _ = ep.send_to(server, REQUEST, &request).await;
            let deadline = sleep(Duration::from_millis(500));
            tokio::pin!(deadline);
            let answer = loop {
                tokio::select! {
                    biased;
                    _ = &mut deadline => break None,
                    got = ep.recv_from(RESPONSE, &mut buf) => {
                        let Ok((n, _)) = got else { continue };
                        match decode_response(&buf[..n]) {
                            Some((id, status, b)) if id == next_id => break Some((status, b)),
                            _ => continue, // a late answer to an earlier try
                        }
                    }
                }
            };
            if let Some(a) = answer {
                break a;
            }
            trace.lock().expect("trace").retries += 1;
        };
        if status == 503 {
            // Retryable: the identical request again after a pause; not a new connect.
            let error = String::from_utf8_lossy(&response);
            assert!(
                error.contains(r#""code":"temporary_unavailable""#)
                    && error.contains(r#""retryable":true"#),
                "a 503 must be retryable temporary_unavailable: {error}"
            );
            trace.lock().expect("trace").unavailable += 1;
            sleep(Duration::from_millis(200)).await;
            continue;
        }
        let known = body.known.iter().map(|(s, _)| s.clone()).collect();
        trace
            .lock()
            .expect("trace")
            .connects
            .push(ConnectObservation {
                user: user.clone(),
                client_id: client_id.clone(),
                known,
                status,
                body: response.clone(),
            });
        done += 1;
        if status == 200 {
            advance(
                &mut body,
                &json::parse(&response).expect("200 bodies are JSON"),
            );
        }
        if status == 401 {
            break; // the ID is another user's: nothing more to try
        }
        let pause = thread_rng().gen_range(10..200);
        sleep(Duration::from_millis(pause)).await;
    }
}

/// Runs `scenario` under the current seed and returns what it recorded.
pub async fn run(scenario: Scenario) -> Trace {
    let handle = Handle::current();
    let store = MemStore::new();
    let trace = Arc::new(Mutex::new(Trace::default()));
    NetSim::current().update_config(|c| c.packet_loss_rate = scenario.packet_loss);

    let database = remote::database_node(&handle, store.clone());
    let server = handle
        .create_node()
        .name("server")
        .ip("10.0.0.1".parse().expect("ip"))
        .init(server_main)
        .build();
    sleep(Duration::from_millis(50)).await;

    let mut clients = Vec::new();
    let contested = if scenario.contested {
        scenario.users
    } else {
        0
    };
    for i in 0..scenario.clients + contested {
        let user = format!("user-{}", i % scenario.users);
        let client_id = if i < scenario.clients {
            format!("client-{i}")
        } else {
            "client-contested".to_owned()
        };
        let (trace, connects) = (trace.clone(), scenario.connects_per_client);
        let node = handle
            .create_node()
            .name(format!("client-{i}"))
            .ip(format!("10.0.1.{}", i + 1).parse().expect("ip"))
            .build();
        clients.push(node.spawn(client_main(i, client_id, user, connects, trace)));
    }

    // Faults and operator actions while the clients run.
    let faults = {
        let (store, trace, handle) = (store.clone(), trace.clone(), handle.clone());
        let (users, crashes) = (scenario.users, scenario.server_crashes);
        madsim::task::spawn(async move {
            // The first fault is always a crash, so every seed exercises a restart.
            let mut first = true;
            loop {
                sleep(Duration::from_millis(thread_rng().gen_range(100..600))).await;
                let roll: u32 = if std::mem::take(&mut first) {
                    0
                } else {
                    thread_rng().gen_range(0..10)
                };
                let user = format!("user-{}", thread_rng().gen_range(0..users));
                let scope = format!("project:p{}", thread_rng().gen_range(0..3));
                let event = if roll < 1 && crashes {
                    handle.kill("server");
                    sleep(Duration::from_millis(thread_rng().gen_range(50..400))).await;
                    handle.restart("server");
                    trace.lock().expect("trace").crashes += 1;
                    "server crash and restart".to_owned()
                } else if roll < 6 {
                    store.grant(&user, &scope).await;
                    format!("grant {scope} to {user}")
                } else {
                    store.revoke(&user, &scope).await;
                    format!("revoke {scope} from {user}")
                };
                trace.lock().expect("trace").events.push(event);
            }
        })
    };
    for c in clients {
        c.await.expect("client");
    }
    faults.abort();
    let _ = (server, database);
    trace.lock().expect("trace").clone()
}
