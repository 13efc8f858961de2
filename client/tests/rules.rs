//! The client's rules against the real engine (in process, over MemStore,
//! with capture running), through a transport that can lose answers,
//! refuse, delay and tamper: every rule of the client side of the spec
//! that a server can exercise.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actors::Engine;
use actors::store::MemStore;
use actors::testkit::{
    CaptureWorld, MemWorld, Write as AppWrite, example_mem_store, push_config, stream_begun,
};
use client::local::{LocalStore, Transition};
use client::{
    Answer, Client, Config, Endpoint, MemoryStore, SyncError, Transport, TransportError, Write,
    WriteOp,
};
use protocol::json::{self, Value};

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// What the transport does to one request.
enum Fault {
    Pass,
    /// The server executes the request; its answer is lost.
    LoseAnswer,
    /// The server never sees the request; this answer comes instead.
    Answer(Answer),
    /// The answer's body is replaced by this function's output.
    Tamper(fn(Vec<u8>) -> Vec<u8>),
}

/// The fault of the `n`th request to an endpoint, given its body.
type Plan = Box<dyn FnMut(Endpoint, usize, &[u8]) -> Fault + Send>;
/// Every request carried, in order.
type Sent = Arc<Mutex<Vec<(Endpoint, Vec<u8>)>>>;

/// An in-process transport to the engine as `user`, recording every
/// request it carries, with a fault plan.
#[derive(Clone)]
struct Wire {
    engine: Engine,
    user: String,
    sent: Sent,
    plan: Arc<Mutex<Plan>>,
}

impl Wire {
    fn new(engine: &Engine, user: &str) -> Wire {
        Wire {
            engine: engine.clone(),
            user: user.into(),
            sent: Arc::default(),
            plan: Arc::new(Mutex::new(Box::new(|_, _, _| Fault::Pass))),
        }
    }

    fn plan(&self, mut plan: impl FnMut(Endpoint, usize) -> Fault + Send + 'static) {
        *self.plan.lock().unwrap() = Box::new(move |e, n, _| plan(e, n));
    }

    fn plan_with_body(&self, plan: impl FnMut(Endpoint, usize, &[u8]) -> Fault + Send + 'static) {
        *self.plan.lock().unwrap() = Box::new(plan);
    }

    fn sent(&self, endpoint: Endpoint) -> Vec<Vec<u8>> {
        let sent = self.sent.lock().unwrap();
        sent.iter()
            .filter(|(e, _)| *e == endpoint)
            .map(|(_, b)| b.clone())
            .collect()
    }
}

impl Transport for Wire {
    async fn post(&mut self, endpoint: Endpoint, body: &[u8]) -> Result<Answer, TransportError> {
        let n = {
            let mut sent = self.sent.lock().unwrap();
            sent.push((endpoint, body.to_vec()));
            sent.iter().filter(|(e, _)| *e == endpoint).count()
        };
        let fault = (self.plan.lock().unwrap())(endpoint, n, body);
        if let Fault::Answer(a) = fault {
            return Ok(a);
        }
        let (user, body, now) = (self.user.as_str(), body.to_vec(), now_micros());
        let reply = match endpoint {
            Endpoint::Connect => self.engine.connect(user, body, now).await,
            Endpoint::Push => self.engine.push(user, body, now).await,
            Endpoint::Pull => self.engine.pull(user, body, now).await,
            Endpoint::Rebuild => self.engine.rebuild(user, body, now).await,
        };
        let mut answer = Answer {
            status: reply.status,
            retry_after: reply.retry_after.map(|s| s.to_string()),
            body: reply.body,
        };
        match fault {
            Fault::LoseAnswer => Err(TransportError("the answer was lost".into())),
            Fault::Tamper(f) => {
                answer.body = f(answer.body);
                Ok(answer)
            }
            _ => Ok(answer),
        }
    }
}

struct World {
    world: MemWorld,
    engine: Engine,
}

async fn world(seed: u64) -> World {
    let store: MemStore = example_mem_store(seed).await;
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    stream_begun(&store).await;
    World {
        world: MemWorld { store },
        engine,
    }
}

fn config() -> Config {
    Config {
        pull_limit: 2,
        rebuild_limit: 2,
        backoff_base: Duration::from_millis(1),
        backoff_cap: Duration::from_millis(20),
        ..Config::default()
    }
}

type Device = Client<MemoryStore, Wire>;

fn device(w: &World, user: &str, client_id: &str, seed: u64) -> Device {
    let wire = Wire::new(&w.engine, user);
    Client::open(MemoryStore::new(), wire, client_id, config(), seed).unwrap()
}

fn note_id(n: u64) -> String {
    format!("00000000-0000-4000-8000-{n:012x}")
}

fn insert_note(n: u64, title: &str) -> Write {
    Write {
        table: "tbl_notes".into(),
        pk: Value::string(note_id(n)),
        op: WriteOp::Insert {
            columns: match json::object([
                ("fld_notes_title", Value::string(title)),
                ("fld_notes_pinned", Value::Bool(false)),
            ]) {
                Value::Object(o) => o,
                _ => unreachable!(),
            },
        },
        client_version: client::datetime(now_micros()),
    }
}

fn retitle(c: &Device, n: u64, title: &str) -> Write {
    let pk = Value::string(note_id(n));
    let base = c
        .version_of("tbl_notes", &pk)
        .unwrap()
        .expect("a known version");
    Write {
        table: "tbl_notes".into(),
        pk,
        op: WriteOp::Update {
            base_version: base,
            columns: match json::object([("fld_notes_title", Value::string(title))]) {
                Value::Object(o) => o,
                _ => unreachable!(),
            },
        },
        client_version: client::datetime(now_micros()),
    }
}

/// The title of each note the device holds, by key.
fn titles(c: &Device) -> Vec<(String, String)> {
    c.rows("tbl_notes")
        .unwrap()
        .into_iter()
        .map(|r| {
            let o = r.row.as_object().unwrap();
            (
                o["fld_notes_id"].as_str().unwrap().to_owned(),
                o["fld_notes_title"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Pulls until the device's copy has caught up with capture (a pull
/// terminates at the materialized boundary, which may trail a push).
async fn converge(c: &mut Device, want: usize) {
    for _ in 0..400 {
        c.pull().await.unwrap();
        if c.rows("tbl_notes").unwrap().len() == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{} notes never arrived", want);
}

/// Two devices of one user: offline writes on each, a conflict, and both
/// end holding the server's rows, every checksum verified on the way.
#[tokio::test]
async fn two_devices_converge_after_offline_writes_and_a_conflict() {
    let w = world(1).await;
    let mut a = device(&w, "u1", "device-a", 1);
    let mut b = device(&w, "u1", "device-b", 2);
    a.connect().await.unwrap();
    b.connect().await.unwrap();
    // Offline: each authors notes; nothing is sent yet.
    for n in 1..=3 {
        a.write(&insert_note(n, &format!("from a {n}"))).unwrap();
    }
    b.write(&insert_note(10, "from b")).unwrap();
    assert_eq!(a.pending().unwrap(), 3);
    assert!(a.transport_mut().sent(Endpoint::Push).is_empty(), "offline");
    // Back online.
    let (pushed, _) = a.sync().await.unwrap();
    assert_eq!(pushed.outcomes.len(), 3);
    assert!(
        pushed
            .outcomes
            .iter()
            .all(|o| o.status == "applied" && o.verified)
    );
    b.sync().await.unwrap();
    converge(&mut a, 4).await;
    converge(&mut b, 4).await;
    assert_eq!(titles(&a), titles(&b));
    // Both edit note 1 from the same version; b's lands first.
    let from_a = retitle(&a, 1, "a's title");
    let from_b = retitle(&b, 1, "b's title");
    b.write(&from_b).unwrap();
    b.push().await.unwrap();
    a.write(&from_a).unwrap();
    let pushed = a.push().await.unwrap();
    let o = &pushed.outcomes[0];
    assert_eq!(
        (o.status.as_str(), o.code.as_deref()),
        ("conflict", Some("version_conflict"))
    );
    assert!(o.verified, "the conflict's current row verified");
    assert!(
        o.object.contains("b's title"),
        "the conflict carries b's row"
    );
    // After pulling, both hold b's title; a's next edit is against it and lands.
    for _ in 0..400 {
        a.pull().await.unwrap();
        b.pull().await.unwrap();
        if titles(&a).iter().any(|(_, t)| t == "b's title") && titles(&a) == titles(&b) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(titles(&a), titles(&b));
    assert!(titles(&a).contains(&(note_id(1), "b's title".into())));
    a.write(&retitle(&a, 1, "a again")).unwrap();
    let pushed = a.push().await.unwrap();
    assert_eq!(pushed.outcomes[0].status, "applied");
}

/// A lost push answer: the identical bytes go again, the server replays,
/// and the write is applied once.
#[tokio::test]
async fn a_lost_push_answer_is_resent_byte_for_byte_and_applied_once() {
    let w = world(2).await;
    let mut a = device(&w, "u1", "device-a", 3);
    a.connect().await.unwrap();
    a.transport_mut().plan(|e, n| match (e, n) {
        (Endpoint::Push, 1 | 2) => Fault::LoseAnswer,
        _ => Fault::Pass,
    });
    a.write(&insert_note(1, "once")).unwrap();
    let pushed = a.push().await.unwrap();
    assert_eq!(pushed.outcomes.len(), 1);
    assert_eq!(
        pushed.outcomes[0].status, "applied",
        "the replay, not a conflict"
    );
    let sent = a.transport_mut().sent(Endpoint::Push);
    assert_eq!(sent.len(), 3);
    assert!(sent.iter().all(|b| *b == sent[0]), "resent byte for byte");
    converge(&mut a, 1).await;
    assert_eq!(a.pending().unwrap(), 0);
}

fn unavailable(code: &str, retry_after: &str) -> Answer {
    Answer {
        status: 503,
        retry_after: Some(retry_after.into()),
        body: format!(
            "{{\"error\":{{\"code\":\"{code}\",\"message\":\"try later\",\"retryable\":true}}}}"
        )
        .into_bytes(),
    }
}

/// 503 and 429 are retried with the same bytes after `Retry-After`; a
/// 400 is not retried, and its sealed batch is kept and sent unchanged.
#[tokio::test]
async fn retryable_answers_are_retried_and_terminal_ones_are_not() {
    let w = world(3).await;
    let mut a = device(&w, "u1", "device-a", 4);
    a.connect().await.unwrap();
    a.transport_mut().plan(|e, n| match (e, n) {
        (Endpoint::Pull, 1) => Fault::Answer(unavailable("capture_pending", "0.01")),
        (Endpoint::Pull, 2) => Fault::Answer(Answer {
            status: 429,
            ..unavailable("retry_later", "0")
        }),
        _ => Fault::Pass,
    });
    a.pull().await.unwrap();
    let pulls = a.transport_mut().sent(Endpoint::Pull);
    assert!(pulls.len() >= 3);
    assert_eq!(pulls[0], pulls[1]);
    assert_eq!(pulls[1], pulls[2]);

    let refusal = Answer {
        status: 400,
        retry_after: None,
        body: b"{\"error\":{\"code\":\"invalid_request\",\"message\":\"no\",\"retryable\":false}}"
            .to_vec(),
    };
    a.transport_mut().plan(move |e, n| match (e, n) {
        (Endpoint::Push, 1) => Fault::Answer(refusal.clone()),
        _ => Fault::Pass,
    });
    a.write(&insert_note(1, "kept")).unwrap();
    assert_eq!(
        a.push().await,
        Err(SyncError::Refused {
            status: 400,
            code: "invalid_request".into(),
            message: "no".into()
        })
    );
    assert_eq!(
        a.transport_mut().sent(Endpoint::Push).len(),
        1,
        "not retried"
    );
    assert_eq!(
        a.store().sealed().unwrap().len(),
        1,
        "the sealed batch is kept"
    );
    let pushed = a.push().await.unwrap();
    assert_eq!(pushed.outcomes[0].status, "applied");
    let sent = a.transport_mut().sent(Endpoint::Push);
    assert_eq!(sent[0], sent[1], "the same sealed bytes after the refusal");

    // Retries are bounded: an answer that stays retryable is reported.
    a.transport_mut()
        .plan(|_, _| Fault::Answer(unavailable("temporary_unavailable", "0")));
    assert_eq!(
        a.pull().await,
        Err(SyncError::Unavailable("temporary_unavailable".into()))
    );
}

/// A row whose content does not match its `row_checksum` fails the whole
/// page: nothing of it is applied, no cursor moves.
#[tokio::test]
async fn a_tampered_row_fails_the_page_and_changes_nothing() {
    let w = world(4).await;
    let mut a = device(&w, "u1", "device-a", 5);
    a.connect().await.unwrap();
    a.write(&insert_note(1, "genuine")).unwrap();
    a.push().await.unwrap();
    converge(&mut a, 1).await;
    let before = (a.session().clone(), a.store().all_holdings().unwrap());
    a.write(&retitle(&a, 1, "edited")).unwrap();
    a.push().await.unwrap();
    a.transport_mut().plan(|e, _| match e {
        Endpoint::Pull => Fault::Tamper(|body| {
            String::from_utf8(body)
                .unwrap()
                .replace("edited", "forged")
                .into_bytes()
        }),
        _ => Fault::Pass,
    });
    // Until capture has the edit, pages carry no row to forge.
    let mut refused = None;
    for _ in 0..400 {
        match a.pull().await {
            Err(e) => {
                refused = Some(e);
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
    match refused {
        Some(SyncError::Integrity(m)) => assert!(m.contains("row_checksum"), "{m}"),
        other => panic!("the forged row was not refused: {other:?}"),
    }
    let after = (a.session().clone(), a.store().all_holdings().unwrap());
    assert_eq!(after.1, before.1, "no row changed");
    assert_eq!(after.0.scopes, before.0.scopes, "no cursor moved");
    a.transport_mut().plan(|_, _| Fault::Pass);
    for _ in 0..400 {
        a.pull().await.unwrap();
        if titles(&a) == [(note_id(1), "edited".to_owned())] {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the genuine edit never arrived");
}

/// A local copy that no longer matches the server (a damaged disk) is
/// caught by the next terminal checksum, and only that scope is rebuilt.
#[tokio::test]
async fn a_damaged_local_copy_is_caught_and_only_its_scope_rebuilt() {
    let w = world(5).await;
    // u1 is in team t1; a note shared with it sits in two of u1's scopes.
    w.world.grant("u1", "team:t1", true).await;
    let mut a = device(&w, "u1", "device-a", 6);
    a.connect().await.unwrap();
    a.write(&insert_note(1, "shared")).unwrap();
    a.write(&insert_note(2, "mine")).unwrap();
    a.push().await.unwrap();
    let shared = note_id(1);
    w.world
        .write(&[AppWrite::Insert(
            "public.note_shares",
            &[("note_id", Some(shared.as_str())), ("team_id", Some("t1"))],
        )])
        .await;
    for _ in 0..400 {
        a.pull().await.unwrap();
        if a.store().holdings("team:t1").unwrap().len() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        a.store().holdings("team:t1").unwrap().len(),
        1,
        "shared into the team"
    );
    assert_eq!(a.store().holdings("user:u1").unwrap().len(), 2);
    // Damage the team's copy of the shared row.
    let mut damaged = a.store().holdings("team:t1").unwrap();
    damaged[0].digest[0] ^= 0x5a;
    let mut store = a.store().clone();
    store
        .commit(Transition {
            put: damaged,
            ..Transition::default()
        })
        .unwrap();
    let session = a.session().clone();
    let mut a = Client::open(store, a.transport_mut().clone(), "device-a", config(), 7).unwrap();
    assert_eq!(a.session(), &session, "reopened from its store");
    let report = a.pull().await.unwrap();
    assert_eq!(report.mismatched, vec!["team:t1".to_owned()]);
    assert_eq!(
        report.rebuilt,
        vec!["team:t1".to_owned()],
        "only that scope"
    );
    let team = a.store().holdings("team:t1").unwrap();
    assert_eq!(team.len(), 1);
    assert_ne!(team[0].digest, {
        let mut d = team[0].digest;
        d[0] ^= 0x5a;
        d
    });
    let again = a.pull().await.unwrap();
    assert!(
        again.mismatched.is_empty() && again.rebuilt.is_empty(),
        "healed"
    );
    // The row stays while one scope still holds it: unshare, and the user's copy remains.
    w.world
        .write(&[AppWrite::Delete(
            "public.note_shares",
            &[("note_id", shared.as_str()), ("team_id", "t1")],
        )])
        .await;
    for _ in 0..400 {
        a.pull().await.unwrap();
        if a.store().holdings("team:t1").unwrap().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(a.store().holdings("team:t1").unwrap().is_empty());
    assert_eq!(
        titles(&a).len(),
        2,
        "the user's scope still holds the shared note"
    );
}

/// A generation the server no longer has: the sealed batch was never
/// executed, so the client reconnects and seals its writes again.
#[tokio::test]
async fn an_expired_generation_reconnects_and_reseals() {
    let w = world(6).await;
    let mut a = device(&w, "u1", "device-a", 8);
    a.connect().await.unwrap();
    a.write(&insert_note(1, "after expiry")).unwrap();
    // As if the server had expired the generation the client holds.
    let mut store = a.store().clone();
    let mut session = a.session().clone();
    let old = session.generation.unwrap();
    session.generation = Some(old + 5);
    store
        .commit(Transition {
            session: Some(session),
            ..Transition::default()
        })
        .unwrap();
    let mut a = Client::open(store, a.transport_mut().clone(), "device-a", config(), 9).unwrap();
    let pushed = a.push().await.unwrap();
    assert_eq!(pushed.outcomes.len(), 1);
    assert_eq!(pushed.outcomes[0].status, "applied");
    let sent = a.transport_mut().sent(Endpoint::Push);
    assert_eq!(sent.len(), 2, "refused once, then sealed again");
    assert_ne!(sent[0], sent[1], "a new batch");
    let mutation = |b: &[u8]| {
        let v = json::parse(b).unwrap();
        let m = &v.as_object().unwrap()["mutations"];
        json::to_canonical_string(m)
    };
    assert_eq!(mutation(&sent[0]), mutation(&sent[1]), "the same mutations");
    assert_ne!(a.session().generation, Some(old + 5), "renewed");
    converge(&mut a, 1).await;
}

/// The server's `409 rebuild_restart_required` for `scope`.
fn restart_required(scope: &str) -> Answer {
    let body = format!(
        "{{\"error\":{{\"code\":\"rebuild_restart_required\",\"message\":\"restart\",\"retryable\":false,\"scope_id\":\"{scope}\"}}}}"
    );
    Answer {
        status: 409,
        retry_after: None,
        body: body.into_bytes(),
    }
}

/// The distinct `rebuild_id`s (attempts) of `scope` among rebuild requests.
fn rebuild_ids(rebuilds: &[Vec<u8>], scope: &str) -> std::collections::BTreeSet<String> {
    rebuilds
        .iter()
        .filter_map(|r| {
            let v = json::parse(r).unwrap();
            let o = v.as_object().unwrap();
            (o["scope"].as_str() == Some(scope))
                .then(|| o["rebuild_id"].as_str().unwrap().to_owned())
        })
        .collect()
}

/// A rebuild that must restart starts a new attempt (a new `rebuild_id`)
/// and installs the scope only once its checksum matches.
#[tokio::test]
async fn a_rebuild_restarts_with_a_new_attempt() {
    let w = world(7).await;
    let mut a = device(&w, "u1", "device-a", 10);
    a.connect().await.unwrap();
    for n in 1..=5 {
        a.write(&insert_note(n, &format!("note {n}"))).unwrap();
    }
    a.push().await.unwrap();
    converge(&mut a, 5).await;
    let mut b = device(&w, "u1", "device-b", 11);
    b.connect().await.unwrap();
    b.transport_mut().plan(|e, n| match (e, n) {
        // The second page of the first attempt: the session is gone.
        (Endpoint::Rebuild, 2) => Fault::Answer(restart_required("user:u1")),
        // A later page whose checksum is forged: a mismatch, a new attempt.
        (Endpoint::Rebuild, 5) => Fault::Tamper(|body| {
            let text = String::from_utf8(body).unwrap();
            match text.find("\"checksum\":{") {
                Some(at) => {
                    let digest = text[at..].find("\"digest\":\"").unwrap() + at + 10;
                    let mut t = text.into_bytes();
                    t[digest] = if t[digest] == b'0' { b'1' } else { b'0' };
                    t
                }
                None => text.into_bytes(),
            }
        }),
        _ => Fault::Pass,
    });
    let report = b.pull().await.unwrap();
    // templates_public (empty, one page: request 1) first, then user:u1.
    assert_eq!(
        report.rebuilt,
        vec!["templates_public".to_owned(), "user:u1".to_owned()]
    );
    let rebuilds = b.transport_mut().sent(Endpoint::Rebuild);
    assert_eq!(
        rebuild_ids(&rebuilds, "user:u1").len(),
        3,
        "a new attempt after the restart and after the mismatch"
    );
    assert_eq!(rebuilds.len(), 8, "1 + 1 + 3 + 3 pages");
    assert_eq!(titles(&b), titles(&a));
}

/// A connect answer as the engine would send it, with `schema` members
/// (`action` and what it needs) and `extra` top-level members.
fn connect_answer(c: &Device, schema: &[(&str, Value)], extra: &[(&str, Value)]) -> Answer {
    let m = c.manifest().unwrap().reference();
    let mut s: json::Object = [
        ("version".to_owned(), Value::int(m.version as i64)),
        ("hash".to_owned(), Value::string(m.hash.to_hex())),
    ]
    .into_iter()
    .collect();
    s.extend(schema.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    let mut o: json::Object = [
        ("server_time", Value::string("2026-12-01T00:00:00.000000Z")),
        ("protocol_version", Value::int(3)),
        (
            "client_generation",
            Value::int(c.session().generation.unwrap() as i64),
        ),
        (
            "scope_set_version",
            Value::int(c.session().scope_set_version as i64),
        ),
        ("schema", Value::Object(s)),
        (
            "scopes",
            json::object([
                ("add", Value::Array(vec![])),
                ("remove", Value::Array(vec![])),
            ]),
        ),
        ("scope_cursor_updates", Value::Object(json::Object::new())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    o.extend(extra.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    Answer {
        status: 200,
        retry_after: None,
        body: json::to_canonical(&Value::Object(o)),
    }
}

/// Each schema action: `rebuild_local` rebuilds exactly the affected
/// scopes, a definition that does not verify (or one that `none` forbids)
/// changes nothing, and `unsupported` stops push and pull until the
/// explicit schema reset.
#[tokio::test]
async fn schema_actions_are_applied_as_the_spec_says() {
    let w = world(8).await;
    let mut a = device(&w, "u1", "device-a", 12);
    a.connect().await.unwrap();
    a.pull().await.unwrap();
    assert!(
        a.session().scopes.values().all(Option::is_some),
        "every scope has a cursor"
    );
    let definition = a.manifest().unwrap().to_json();
    let once = |answer: Answer| {
        let mut answer = Some(answer);
        move |e: Endpoint, _| match (e, answer.take()) {
            (Endpoint::Connect, Some(a)) => Fault::Answer(a),
            _ => Fault::Pass,
        }
    };

    let answer = connect_answer(
        &a,
        &[("action", Value::string("rebuild_local"))],
        &[
            ("schema_definition", definition.clone()),
            (
                "affected_scopes",
                Value::Array(vec![Value::string("user:u1")]),
            ),
        ],
    );
    a.transport_mut().plan(once(answer));
    a.connect().await.unwrap();
    assert_eq!(
        a.session().scopes["user:u1"],
        None,
        "the affected scope is rebuilt"
    );
    assert!(
        a.session().scopes["templates_public"].is_some(),
        "and only it"
    );
    let report = a.pull().await.unwrap();
    assert_eq!(report.rebuilt, vec!["user:u1".to_owned()]);

    let before = a.session().clone();
    let forbidden = connect_answer(
        &a,
        &[("action", Value::string("none"))],
        &[("schema_definition", definition.clone())],
    );
    a.transport_mut().plan(once(forbidden));
    assert!(matches!(a.connect().await, Err(SyncError::Integrity(_))));
    let mut forged = definition.clone();
    if let Value::Object(o) = &mut forged {
        o.insert("schema_hash".into(), Value::string("0".repeat(64)));
    }
    let unverified = connect_answer(
        &a,
        &[("action", Value::string("replace"))],
        &[("schema_definition", forged)],
    );
    a.transport_mut().plan(once(unverified));
    assert!(matches!(a.connect().await, Err(SyncError::Integrity(_))));
    assert_eq!(
        a.session(),
        &before,
        "a refused connect answer changes nothing"
    );

    let unsupported = connect_answer(
        &a,
        &[
            ("action", Value::string("unsupported")),
            ("reason", Value::string("unknown_schema_lineage")),
        ],
        &[],
    );
    a.transport_mut().plan(once(unsupported));
    a.connect().await.unwrap();
    a.write(&insert_note(1, "kept while unsupported")).unwrap();
    let stopped = Err(SyncError::Unsupported("unknown_schema_lineage".into()));
    assert_eq!(a.push().await.map(|_| ()), stopped);
    assert_eq!(a.pull().await.map(|_| ()), stopped);
    let pushes = a.transport_mut().sent(Endpoint::Push).len();
    assert_eq!(pushes, 0, "no push was sent");
    // The explicit recovery: the server rebuilds every assigned scope.
    a.reset_schema().await.unwrap();
    assert_eq!(a.session().unsupported, None);
    assert!(
        a.session().scopes.values().all(Option::is_none),
        "every scope is rebuilt"
    );
    let pushed = a.push().await.unwrap();
    assert_eq!(
        pushed.outcomes[0].status, "applied",
        "the kept write is sent"
    );
    converge(&mut a, 1).await;
}

/// `422 schema_mismatch` on a push or a pull: the request never executed,
/// so the client connects again (learning the current schema) and goes on;
/// the refused batch's writes are sealed again.
#[tokio::test]
async fn a_schema_mismatch_reconnects_and_goes_on() {
    let w = world(9).await;
    let mut a = device(&w, "u1", "device-a", 13);
    a.connect().await.unwrap();
    let mismatch = || {
        Answer {
        status: 422,
        retry_after: None,
        body: b"{\"error\":{\"code\":\"schema_mismatch\",\"message\":\"not current\",\"retryable\":false}}"
            .to_vec(),
    }
    };
    a.transport_mut().plan(move |e, n| match (e, n) {
        (Endpoint::Push | Endpoint::Pull, 1) => Fault::Answer(mismatch()),
        _ => Fault::Pass,
    });
    a.write(&insert_note(1, "after a mismatch")).unwrap();
    let pushed = a.push().await.unwrap();
    assert_eq!(pushed.outcomes[0].status, "applied");
    let pushes = a.transport_mut().sent(Endpoint::Push);
    assert_eq!(pushes.len(), 2);
    assert_ne!(pushes[0], pushes[1], "sealed again in a new batch");
    converge(&mut a, 1).await;
    assert_eq!(
        a.transport_mut().sent(Endpoint::Connect).len(),
        3,
        "the first connect, then one per mismatch"
    );
}

/// A scope whose rebuild is refused as not assigned while every pull page
/// keeps it assigned (a grant revoked and given again between each rebuild
/// and pull) is reported as a transient race, and the next sync works.
#[tokio::test]
async fn an_assignment_that_keeps_changing_is_a_transient_error() {
    let w = world(10).await;
    let mut a = device(&w, "u1", "device-a", 14);
    a.connect().await.unwrap();
    let not_assigned = Answer {
        status: 400,
        retry_after: None,
        body: b"{\"error\":{\"code\":\"invalid_request\",\"message\":\"the scope is not assigned to this client\",\"retryable\":false}}".to_vec(),
    };
    a.transport_mut().plan(move |e, _| match e {
        Endpoint::Rebuild => Fault::Answer(not_assigned.clone()),
        _ => Fault::Pass,
    });
    assert_eq!(
        a.pull().await,
        Err(SyncError::AssignmentChanging("templates_public".into()))
    );
    assert_eq!(
        a.transport_mut().sent(Endpoint::Rebuild).len(),
        7,
        "three rounds of both scopes' rebuilds, then the first one's fourth refusal"
    );
    a.transport_mut().plan(|_, _| Fault::Pass);
    let report = a.pull().await.unwrap();
    assert_eq!(
        report.rebuilt.len(),
        2,
        "both scopes rebuilt once it settles"
    );
}

/// A rebuild told to restart on every attempt (its scope revoked and
/// granted again between each first page and its continuation) is a
/// transient error, not an integrity one: nothing of the scope is
/// installed, and the next sync rebuilds it.
#[tokio::test]
async fn a_rebuild_that_keeps_restarting_is_a_transient_error() {
    let w = world(11).await;
    let mut a = device(&w, "u1", "device-a", 15);
    a.connect().await.unwrap();
    for n in 1..=3 {
        a.write(&insert_note(n, &format!("note {n}"))).unwrap();
    }
    a.push().await.unwrap();
    converge(&mut a, 3).await;
    let mut b = device(&w, "u1", "device-b", 16);
    b.connect().await.unwrap();
    // Every continuation (a request with a cursor) must restart.
    b.transport_mut().plan_with_body(move |e, _, body| {
        if e == Endpoint::Rebuild && !body.windows(13).any(|w| w == b"\"cursor\":null") {
            Fault::Answer(restart_required("user:u1"))
        } else {
            Fault::Pass
        }
    });
    assert_eq!(
        b.pull().await,
        Err(SyncError::RebuildRestarting("user:u1".into()))
    );
    let rebuilds = b.transport_mut().sent(Endpoint::Rebuild);
    assert_eq!(
        rebuild_ids(&rebuilds, "user:u1").len(),
        4,
        "four attempts, each a new rebuild_id"
    );
    assert_eq!(
        b.session().scopes.get("user:u1"),
        Some(&None),
        "not installed"
    );
    assert!(b.rows("tbl_notes").unwrap().is_empty(), "nothing applied");
    b.transport_mut().plan(|_, _| Fault::Pass);
    converge(&mut b, 3).await;
    assert_eq!(titles(&b), titles(&a));
}
