//! Push under faults: clients push sealed batches over a lossy link and
//! retry the identical bytes until answered (lost requests, lost responses,
//! commit-unknown results), sometimes send one batch twice at once, reuse
//! completed mutations in new batches, and push atomic groups. The server
//! (the real engine, materializer included) crashes mid-push, and the
//! application writes the same rows directly on the database node. The
//! `invariants::push` checker judges the answers and the captured version
//! chains.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::capture::EffectOp;
use actors::ledger::contract::WriteTarget;
use actors::store::{MemStore, Store, StoreTx};
use actors::testkit::{ConnectBody, note_mutation, push_config};
use invariants::push::{DirectWrite, PendingAfterCapture, PushExchange, VersionChain};
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::Handle;
use madsim::time::sleep;
use protocol::ids::ScopeId;
use protocol::json::{self, Object, Value};
use protocol::position::StreamPosition;

use crate::link::Link;
use crate::now_micros;

/// The first body byte names the endpoint.
const CONNECT: u8 = 0;
const PUSH: u8 = 1;
/// Notes per user that the user's clients write (a small pool, so they collide).
const POOL: usize = 5;

/// 503s in a row after which a sealed batch counts as never answered (the
/// server crashes and loses messages, but recovers within seconds).
const MAX_UNAVAILABLE_IN_A_ROW: usize = 150;

/// Note `k` of `user-N`'s pool: `notes.id` is a `uuid` column, so a key
/// is a UUID in its printed form.
fn note_key(user: &str, k: usize) -> String {
    let u: usize = user.trim_start_matches("user-").parse().unwrap_or(0);
    format!("00000000-0000-4000-8000-{u:06x}{k:06x}")
}

/// Knobs of one push run.
#[derive(Clone, Debug)]
pub struct PushScenario {
    pub clients: usize,
    pub users: usize,
    pub batches_per_client: usize,
    pub packet_loss: f64,
    pub server_crashes: usize,
    /// How long a push's commit is decoded before it is visible (ADR 0014).
    pub fence_visibility_lag: Duration,
    /// A planted bug: fences are satisfied only where visible.
    pub plant_fences_by_visibility: bool,
    /// A planted bug: the server reads a key of the wrong JSON type
    /// leniently before the engine sees it (issue 29), so the batch gets
    /// per-mutation outcomes instead of its `400`.
    pub plant_coerced_keys: bool,
    /// The share of sealed batches holding a key the server must refuse
    /// whole (`400`): alternately a number for the string key and a key
    /// no column keeps.
    pub poisoned_share: f64,
}

impl Default for PushScenario {
    fn default() -> Self {
        PushScenario {
            clients: 4,
            users: 2,
            batches_per_client: 12,
            packet_loss: 0.02,
            server_crashes: 4,
            fence_visibility_lag: Duration::from_secs(5),
            plant_fences_by_visibility: false,
            plant_coerced_keys: false,
            poisoned_share: 0.12,
        }
    }
}

/// What a push run recorded.
#[derive(Clone, Debug, Default)]
pub struct PushTrace {
    pub exchanges: Vec<PushExchange>,
    pub direct: Vec<DirectWrite>,
    pub chains: Vec<VersionChain>,
    pub crashes: usize,
    /// Identical requests sent again after no answer came.
    pub retries: usize,
    /// Batches sent twice at once.
    pub duplicates: usize,
    /// Answers `503` (the database did not answer in time, or a crash).
    pub unavailable: usize,
    /// Problems the harness itself saw (unexpected statuses).
    pub problems: Vec<String>,
    /// Each client's pending fences once capture passed every commit.
    pub pending: Vec<PendingAfterCapture>,
}

/// The server node: the real engine; the first body byte names the endpoint.
async fn server_main(coerce_keys: bool) {
    crate::serve_engine(None, move |engine, user, body| async move {
        match body.split_first() {
            Some((&CONNECT, body)) => engine.connect(&user, body.to_vec(), now_micros()).await,
            Some((_, body)) if coerce_keys => engine.push(&user, coerced(body), now_micros()).await,
            Some((_, body)) => engine.push(&user, body.to_vec(), now_micros()).await,
            None => engine.push(&user, Vec::new(), now_micros()).await,
        }
    })
    .await;
}

/// The planted bug's request: every number key read leniently, as the
/// UUID with that number (`notes.id` is a `uuid` column, so its bare text
/// would still be refused by intake).
fn coerced(body: &[u8]) -> Vec<u8> {
    let Ok(Value::Object(mut request)) = json::parse(body) else {
        return body.to_vec();
    };
    let Some(Value::Array(mutations)) = request.get_mut("mutations") else {
        return body.to_vec();
    };
    for m in mutations {
        let Value::Object(m) = m else { continue };
        let Some(Value::Object(pk)) = m.get_mut("pk") else {
            continue;
        };
        for key in pk.values_mut() {
            if let Value::Number(n) = key {
                let n = n.as_exact_i64().unwrap_or(0);
                *key = Value::string(format!("00000000-0000-4000-8000-{n:012x}"));
            }
        }
    }
    json::to_canonical(&Value::Object(request))
}

fn text<'v>(v: &'v Value, member: &str) -> Option<&'v str> {
    v.as_object()?.get(member)?.as_str()
}

/// One client: connect, then sealed batches over its user's note pool.
async fn client_main(
    index: usize,
    user: String,
    batches: usize,
    poisoned_share: f64,
    trace: Arc<Mutex<PushTrace>>,
) {
    let mut link = Link::bind((index as u64) << 40).await;
    let client_id = format!("push-client-{index}");
    let connect = json::to_canonical(&ConnectBody::fresh(&client_id).to_json());
    let (generation, schema) = loop {
        let answers = link
            .call(&user, CONNECT, &connect, false, &|| {
                trace.lock().expect("trace").retries += 1
            })
            .await;
        let Some((200, body)) = answers.into_iter().find(|(s, _)| *s == 200) else {
            sleep(Duration::from_millis(200)).await;
            continue;
        };
        let v = json::parse(&body).expect("json");
        let o = v.as_object().expect("object");
        let s = o["schema"].as_object().expect("schema");
        break (
            o["client_generation"].clone(),
            json::object([
                ("version", s["version"].clone()),
                ("hash", s["hash"].clone()),
            ]),
        );
    };
    let mut known: BTreeMap<String, String> = BTreeMap::new();
    let mut completed: Vec<Value> = Vec::new();
    let mut next_mutation = (index as u64) << 32;
    let mut poisons = 0;
    for b in 0..batches {
        let mut rng = thread_rng();
        let atomic = rng.gen_bool(0.2);
        let n = rng.gen_range(1..=4);
        let mut keys: Vec<usize> = (0..POOL).collect();
        let mut mutations = Vec::new();
        if !atomic && !completed.is_empty() && rng.gen_bool(0.15) {
            // An unchanged completed mutation in a new batch.
            mutations.push(completed[rng.gen_range(0..completed.len())].clone());
        }
        for _ in 0..n {
            let k = keys.remove(rng.gen_range(0..keys.len()));
            let note = note_key(&user, k);
            next_mutation += 1;
            let title = json::object([
                ("fld_notes_title", Value::string(format!("{client_id} {b}"))),
                ("fld_notes_pinned", Value::Bool(rng.gen_bool(0.5))),
            ]);
            let m = match known.get(&note) {
                None => note_mutation(next_mutation, &note, &schema, "insert", None, Some(title)),
                Some(v) => match rng.gen_range(0..10) {
                    0..=5 => note_mutation(
                        next_mutation,
                        &note,
                        &schema,
                        "update",
                        Some(v),
                        Some(title),
                    ),
                    6 => note_mutation(
                        next_mutation,
                        &note,
                        &schema,
                        "update",
                        Some("stale"),
                        Some(title),
                    ),
                    7 => note_mutation(next_mutation, &note, &schema, "delete", Some(v), None),
                    _ => note_mutation(next_mutation, &note, &schema, "insert", None, Some(title)),
                },
            };
            mutations.push(m);
        }
        // Now and then a key no column can hold (U+0000), or a key of the
        // wrong JSON type (a number for the string key): the sealed batch
        // must get a terminal 400 on every try, never a 503 or a 200.
        let poisoned = rng.gen_bool(poisoned_share);
        if poisoned {
            next_mutation += 1;
            poisons += 1;
            let key = format!("{}\0", note_key(&user, 0));
            let title = json::object([("fld_notes_title", Value::string("poisoned"))]);
            let mut m = note_mutation(next_mutation, &key, &schema, "insert", None, Some(title));
            if poisons % 2 == 1
                && let Value::Object(m) = &mut m
                && let Some(Value::Object(pk)) = m.get_mut("pk")
            {
                pk.insert("fld_notes_id".into(), Value::int(5));
            }
            mutations.push(m);
        }
        let mut body = Object::new();
        body.insert("client_id".into(), Value::string(&client_id));
        body.insert("client_generation".into(), generation.clone());
        body.insert(
            "batch_id".into(),
            Value::string(format!(
                "40000000-0000-4000-8000-{:012x}",
                ((index as u64) << 24) + b as u64
            )),
        );
        body.insert("schema".into(), schema.clone());
        body.insert("mutations".into(), Value::Array(mutations.clone()));
        if atomic {
            body.insert("atomic".into(), Value::Bool(true));
        }
        let request = json::to_canonical(&Value::Object(body));
        let twice = rng.gen_bool(0.2);
        if twice {
            trace.lock().expect("trace").duplicates += 1;
        }
        // A retry must be able to cure a 503: a batch that only ever gets
        // 503s has no terminal answer, and its client would retry for ever.
        let mut unavailable_in_a_row = 0;
        loop {
            if unavailable_in_a_row > MAX_UNAVAILABLE_IN_A_ROW {
                trace.lock().expect("trace").problems.push(format!(
                    "{client_id} batch {b}: no terminal answer after {MAX_UNAVAILABLE_IN_A_ROW} tries"
                ));
                break;
            }
            let answers = link
                .call(&user, PUSH, &request, twice, &|| {
                    trace.lock().expect("trace").retries += 1
                })
                .await;
            let mut done = None;
            for (status, response) in answers {
                if status == 503 {
                    trace.lock().expect("trace").unavailable += 1;
                    continue;
                }
                let mut t = trace.lock().expect("trace");
                t.exchanges.push(PushExchange {
                    client_id: client_id.clone(),
                    request: request.clone(),
                    status,
                    response: response.clone(),
                });
                if status != 200 && !(poisoned && status == 400) {
                    t.problems.push(format!(
                        "{client_id} batch {b}: status {status}: {}",
                        String::from_utf8_lossy(&response)
                    ));
                }
                done = Some(response);
            }
            let Some(response) = done else {
                // Retryable: the identical sealed batch again after a pause.
                unavailable_in_a_row += 1;
                sleep(Duration::from_millis(200)).await;
                continue;
            };
            let Ok(r) = json::parse(&response) else { break };
            for list in ["accepted", "rejected"] {
                let Some(Value::Array(outcomes)) = r.as_object().and_then(|o| o.get(list)) else {
                    continue;
                };
                for o in outcomes {
                    let note = o
                        .as_object()
                        .and_then(|o| o.get("pk"))
                        .and_then(|pk| text(pk, "fld_notes_id"))
                        .map(str::to_owned);
                    if let (Some(note), Some(v)) = (note, text(o, "server_version")) {
                        known.insert(note, v.to_owned());
                    }
                    if text(o, "code") != Some("atomic_batch_rejected")
                        && let Some(m) = mutations
                            .iter()
                            .find(|m| text(m, "mutation_id") == text(o, "mutation_id"))
                    {
                        completed.push(m.clone());
                    }
                }
            }
            break;
        }
        sleep(Duration::from_millis(thread_rng().gen_range(10..150))).await;
    }
}

/// The application on the database node: retitles notes of the pools directly.
async fn direct_writer(
    store: MemStore,
    target: WriteTarget,
    users: usize,
    stop: Arc<AtomicBool>,
    trace: Arc<Mutex<PushTrace>>,
) {
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        sleep(Duration::from_millis(thread_rng().gen_range(40..160))).await;
        let user = format!("user-{}", thread_rng().gen_range(0..users));
        let note = note_key(&user, thread_rng().gen_range(0..POOL));
        let mut tx = store.begin().await.expect("begin");
        let key: actors::capture::SourceImage = [("id".to_owned(), Some(note.clone()))].into();
        let Some(row) = tx.source_row("public.notes", &key) else {
            continue;
        };
        if row.get("deleted_at").cloned().flatten().is_some() {
            continue;
        }
        n += 1;
        let changes = [
            ("title".to_owned(), Some(format!("direct {n}"))),
            (
                "updated_at".to_owned(),
                Some("2026-07-18 14:00:01+00".to_owned()),
            ),
        ]
        .into();
        tx.source_update("public.notes", &key, changes)
            .expect("update");
        let found = tx
            .find_rows(&target, std::slice::from_ref(&note))
            .await
            .expect("find");
        let version = found[0].version.clone().expect("a version").version;
        tx.commit().await.expect("commit");
        trace.lock().expect("trace").direct.push(DirectWrite {
            table_id: "tbl_notes".into(),
            key: note,
            version,
        });
    }
}

/// Runs a push scenario under the current seed.
pub async fn run_push(scenario: PushScenario) -> Result<PushTrace, String> {
    let handle = Handle::current();
    // The example schema's column types, so pushes are judged as on PostgreSQL.
    let store = actors::testkit::example_mem_store(thread_rng().r#gen()).await;
    store.lag_fence_visibility(scenario.fence_visibility_lag);
    if scenario.plant_fences_by_visibility {
        store.plant_fences_by_visibility().await;
    }
    let coerce_keys = scenario.plant_coerced_keys;
    let database = crate::start_nodes(&store, scenario.packet_loss, move || {
        server_main(coerce_keys)
    });
    let trace = Arc::new(Mutex::new(PushTrace::default()));
    let config = push_config();
    let target = actors::ledger::write_targets(&config).remove(0);
    store
        .install_capture(&actors::capture::CapturePlan::new(&config))
        .await
        .map_err(|e| e.to_string())?;
    // The version chains are the stream's: pushes begin after the baseline.
    crate::capture::stream_begun(&store).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = database.spawn(direct_writer(
        store.clone(),
        target,
        scenario.users,
        stop.clone(),
        trace.clone(),
    ));
    let mut clients = Vec::new();
    for i in 0..scenario.clients {
        let user = format!("user-{}", i % scenario.users);
        let node = handle
            .create_node()
            .name(format!("client-{i}"))
            .ip(format!("10.0.1.{}", i + 1).parse().expect("ip"))
            .build();
        clients.push(node.spawn(client_main(
            i,
            user,
            scenario.batches_per_client,
            scenario.poisoned_share,
            trace.clone(),
        )));
    }
    let crasher = {
        let trace = trace.clone();
        crate::crash_server(scenario.server_crashes, 200..1200, None, move |_| {
            trace.lock().expect("trace").crashes += 1;
        })
    };
    for c in clients {
        c.await.map_err(|e| format!("client failed: {e}"))?;
    }
    stop.store(true, Ordering::Relaxed);
    writer.await.map_err(|e| format!("writer failed: {e}"))?;
    crasher.await.map_err(|e| format!("crasher failed: {e}"))?;

    // Capture catches up with everything committed; then no fence is pending.
    crate::capture::catch_up(&store, store.last_commit_lsn().await).await?;
    let mut t = trace.lock().expect("trace").clone();
    for i in 0..scenario.clients {
        let client_id = format!("push-client-{i}");
        let fences = store.pending_fences(&client_id).await;
        t.pending.push(PendingAfterCapture { client_id, fences });
    }
    // Each note's version chain, from its owner's scope.
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    let through = tx
        .capture_progress()
        .await
        .map_err(|e| e.to_string())?
        .boundary;
    let mut chains: BTreeMap<String, VersionChain> = BTreeMap::new();
    for u in 0..scenario.users {
        let scope = ScopeId::parse(&format!("user:user-{u}")).ok_or("scope")?;
        for e in tx.journaled_effects(&scope, StreamPosition::GenerationStart, through) {
            let (EffectOp::Upsert(r) | EffectOp::Tombstone(r)) = &e.op else {
                continue;
            };
            let key = e.key.as_str().ok_or("a string key")?.to_owned();
            chains
                .entry(key.clone())
                .or_insert_with(|| VersionChain {
                    table_id: e.table_id.clone(),
                    key,
                    versions: Vec::new(),
                })
                .versions
                .push((r.version.as_str().to_owned(), r.row.as_bytes().to_vec()));
        }
    }
    t.chains = chains.into_values().collect();
    Ok(t)
}
