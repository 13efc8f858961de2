//! The app evolves under faults (ADR 0020): application writers on the
//! database node write notes (with bodies), shares and templates while the
//! server, on a lossy link, crashes now and then; halfway, the server
//! restarts with a config that syncs the notes' `body`, registers the
//! templates table over its existing rows and moves shared notes from
//! `team:` to `group:` scopes. At the end every scope must hold exactly
//! what the new config places in it (`invariants::evolution`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::capture::{CapturePlan, EffectOp};
use actors::config::SyncConfig;
use actors::store::{MemStore, MemTx, Store, StoreTx};
use actors::testkit::{EXAMPLE_RELATIONS, config_after, config_before};
use invariants::capture::{ObservedEffect, ObservedMembers};
use invariants::evolution::Held;
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::Handle;
use madsim::time::sleep;
use protocol::ids::ScopeId;
use protocol::json::{self, Value};
use protocol::position::StreamPosition;

use crate::capture::{TEAMS, USERS, WHEN, image, key, observe, stream_begun};
use crate::remote;

/// A planted bug: the rematerialization of one relation reads no rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkippedRelation {
    /// The table registered later keeps none of its existing rows.
    Templates,
    /// Notes keep their old membership (and miss the new field).
    Notes,
}

/// Knobs of one evolution run.
#[derive(Clone, Debug)]
pub struct EvolutionScenario {
    pub writers: usize,
    pub transactions_per_writer: usize,
    pub packet_loss: f64,
    pub skipped: Option<SkippedRelation>,
}

impl Default for EvolutionScenario {
    fn default() -> Self {
        EvolutionScenario {
            writers: 2,
            transactions_per_writer: 30,
            packet_loss: 0.01,
            skipped: None,
        }
    }
}

/// What an evolution run recorded.
#[derive(Clone, Debug, Default)]
pub struct EvolutionTrace {
    /// Each scope's rows after applying its effects in order.
    pub held: Held,
    /// Each scope's rows by the new config's rules over the final source.
    pub expected: Held,
    pub effects: Vec<ObservedEffect>,
    pub members: Vec<ObservedMembers>,
    pub crashes: usize,
    /// Held rows that are not in the current manifest (a row that does not
    /// decode under it, or whose digest does not recompute).
    pub undecodable: Vec<String>,
    /// Rows re-read by the rematerialization.
    pub reread_rows: u64,
}

/// A body, or none.
fn body() -> Option<String> {
    let n: u32 = thread_rng().gen_range(0..4);
    (n > 0).then(|| format!("body {n}"))
}

/// A note written before the new config that no write touches after it.
fn frozen(id: &str) -> bool {
    id.starts_with("n-") && id.ends_with(['0', '2', '4', '6', '8'])
}

/// One random application write. Templates written before the new config
/// (`tpl-0..3`) are not written after it (`tpl-4..7`): the rows the table
/// held when it was registered reach clients only by rematerialization.
fn random_write(
    tx: &mut MemTx,
    notes: &mut Vec<String>,
    writer: usize,
    counter: &mut u32,
    after: bool,
) {
    let mut rng = thread_rng();
    // Each writer's first two notes (one of them frozen) come first.
    let roll = if *counter < 2 || notes.iter().all(|n| after && frozen(n)) {
        0
    } else {
        rng.gen_range(0..10)
    };
    // After the new config, half the notes written before it are left
    // alone: they, too, reach clients only by rematerialization.
    let open: Vec<String> = notes
        .iter()
        .filter(|n| !after || !frozen(n))
        .cloned()
        .collect();
    let pick = |_: &[String]| open[thread_rng().gen_range(0..open.len())].clone();
    match roll {
        0 | 1 => {
            *counter += 1;
            let id = format!("{}-{writer}-{counter}", if after { "m" } else { "n" });
            let owner = USERS[rng.gen_range(0..USERS.len())].to_owned();
            let row = image(&[
                ("id", Some(id.clone())),
                ("owner_id", Some(owner)),
                ("title", Some(format!("title {counter}"))),
                ("body", body()),
                ("pinned", Some("f".into())),
                ("updated_at", Some(WHEN.into())),
                ("deleted_at", None),
            ]);
            tx.source_insert("public.notes", row).unwrap();
            notes.push(id);
        }
        2..=4 => {
            let id = pick(notes);
            let changes = match rng.gen_range(0..3) {
                0 => image(&[(
                    "owner_id",
                    Some(USERS[rng.gen_range(0..USERS.len())].to_owned()),
                )]),
                1 => image(&[("body", body())]),
                _ => image(&[("title", Some(format!("edit {}", rng.gen_range(0..1000))))]),
            };
            tx.source_update("public.notes", &key(&[("id", &id)]), changes)
                .unwrap();
        }
        5 => {
            // A hard delete, with its shares (what ON DELETE CASCADE does);
            // a frozen note is kept.
            let id = pick(notes);
            if frozen(&id) {
                return;
            }
            for team in TEAMS {
                let k = key(&[("note_id", &id), ("team_id", team)]);
                if tx.source_row("public.note_shares", &k).is_some() {
                    tx.source_delete("public.note_shares", &k).unwrap();
                }
            }
            tx.source_delete("public.notes", &key(&[("id", &id)]))
                .unwrap();
            notes.retain(|n| *n != id);
        }
        6 | 7 => {
            let id = pick(notes);
            let team = TEAMS[rng.gen_range(0..TEAMS.len())];
            let k = key(&[("note_id", &id), ("team_id", team)]);
            if tx.source_row("public.note_shares", &k).is_some() {
                tx.source_delete("public.note_shares", &k).unwrap();
            } else {
                tx.source_insert("public.note_shares", k).unwrap();
            }
        }
        _ => {
            let id = format!("tpl-{}", rng.gen_range(0..4) + if after { 4 } else { 0 });
            let row = image(&[
                ("id", Some(id.clone())),
                ("name", Some(format!("name {}", rng.gen_range(0..1000)))),
                ("body", Some("b".into())),
            ]);
            let k = key(&[("id", &id)]);
            if tx.source_row("public.templates", &k).is_some() {
                tx.source_update("public.templates", &k, row).unwrap();
            } else {
                tx.source_insert("public.templates", row).unwrap();
            }
        }
    }
}

/// An application session: small transactions with pauses; halfway it
/// reports in and waits until the new config is active.
async fn writer(
    store: MemStore,
    index: usize,
    transactions: usize,
    notes: Arc<Mutex<Vec<String>>>,
    halfway: Arc<AtomicUsize>,
    switched: Arc<AtomicBool>,
) {
    let mut counter = 0;
    for t in 0..transactions {
        let after = t >= transactions / 2;
        if t == transactions / 2 {
            halfway.fetch_add(1, Ordering::Relaxed);
            while !switched.load(Ordering::Relaxed) {
                sleep(Duration::from_millis(10)).await;
            }
        }
        sleep(Duration::from_millis(thread_rng().gen_range(5..80))).await;
        let mut tx = store.begin().await.unwrap();
        {
            let mut notes = notes.lock().unwrap();
            for _ in 0..thread_rng().gen_range(1..4) {
                random_write(&mut tx, &mut notes, index, &mut counter, after);
            }
        }
        tx.commit().await.unwrap();
    }
}

/// The server node: the real engine under whichever config is current.
async fn server(config: Arc<Mutex<SyncConfig>>) {
    let incarnation: u32 = thread_rng().r#gen();
    let config = config.lock().unwrap().clone();
    let _engine = remote::start_engine_with(
        remote::RemoteStore::new(u64::from(incarnation), None),
        config,
    )
    .await;
    std::future::pending::<()>().await;
}

/// Waits until capture has materialized through `last` and no relation is
/// owed a rematerialization.
async fn settled(store: &MemStore, last: actors::capture::Lsn) -> Result<(), String> {
    crate::capture::catch_up(store, last).await?;
    for _ in 0..600 {
        let mut tx = store.begin().await.map_err(|e| e.to_string())?;
        let p = tx.capture_progress().await.map_err(|e| e.to_string())?;
        drop(tx);
        if p.rematerializing.is_empty() {
            return Ok(());
        }
        sleep(Duration::from_millis(100)).await;
    }
    Err("the rematerialization did not end within 60 simulated seconds".into())
}

/// Runs an evolution scenario under the current seed.
pub async fn run_evolution(scenario: EvolutionScenario) -> Result<EvolutionTrace, String> {
    let store = MemStore::with_seed(thread_rng().r#gen());
    {
        let mut tx = store.begin().await.map_err(|e| e.to_string())?;
        for (relation, key) in EXAMPLE_RELATIONS {
            tx.create_relation(relation, key);
        }
        tx.commit().await.map_err(|e| e.to_string())?;
    }
    match scenario.skipped {
        Some(SkippedRelation::Templates) => store.plant_reread_skipping("public.templates").await,
        Some(SkippedRelation::Notes) => store.plant_reread_skipping("public.notes").await,
        None => {}
    }
    let config = Arc::new(Mutex::new(config_before()));
    let database = {
        let config = config.clone();
        crate::start_nodes(&store, scenario.packet_loss, move || server(config.clone()))
    };
    // Capture is installed before the application writes (as `synchro serve` does at start).
    store
        .install_capture(&CapturePlan::new(&config_before()))
        .await
        .map_err(|e| e.to_string())?;
    stream_begun(&store).await?;
    let notes = Arc::new(Mutex::new(Vec::new()));
    let halfway = Arc::new(AtomicUsize::new(0));
    let switched = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..scenario.writers)
        .map(|i| {
            database.spawn(writer(
                store.clone(),
                i,
                scenario.transactions_per_writer,
                notes.clone(),
                halfway.clone(),
                switched.clone(),
            ))
        })
        .collect();
    let crashes = Arc::new(AtomicUsize::new(0));
    let crasher = {
        let crashes = crashes.clone();
        crate::crash_server(4, 150..900, None, move |_| {
            crashes.fetch_add(1, Ordering::Relaxed);
        })
    };
    // Halfway, the deploy: the server restarts under the new config, and
    // the writers go on while its relations are rematerialized.
    while halfway.load(Ordering::Relaxed) < scenario.writers {
        sleep(Duration::from_millis(10)).await;
    }
    // Everything written so far is materialized under the old config.
    crate::capture::catch_up(&store, store.last_commit_lsn().await).await?;
    *config.lock().unwrap() = config_after();
    Handle::current().restart("server");
    switched.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.map_err(|e| format!("writer failed: {e}"))?;
    }
    crasher.await.map_err(|e| format!("crasher failed: {e}"))?;
    settled(&store, store.last_commit_lsn().await).await?;

    let mut trace = EvolutionTrace {
        crashes: crashes.load(Ordering::Relaxed),
        ..EvolutionTrace::default()
    };
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    trace.reread_rows = tx
        .rematerializations()
        .await
        .map_err(|e| e.to_string())?
        .iter()
        .map(|r| r.rows)
        .sum();
    trace.expected = invariants::evolution::expected_after(
        &tx.source_rows("public.notes"),
        &tx.source_rows("public.note_shares"),
        &tx.source_rows("public.templates"),
    );
    let manifest = tx.manifests().await.map_err(|e| e.to_string())?;
    let manifest = manifest.last().ok_or("no manifest")?;
    let through = tx
        .capture_progress()
        .await
        .map_err(|e| e.to_string())?
        .boundary;
    let mut scopes: BTreeSet<String> = trace.expected.keys().cloned().collect();
    scopes.extend(USERS.iter().map(|u| format!("user:{u}")));
    for t in TEAMS {
        scopes.extend([format!("team:{t}"), format!("group:{t}")]);
    }
    scopes.insert("templates_public".into());
    for s in &scopes {
        let scope = ScopeId::parse(s).ok_or("scope")?;
        let effects = tx
            .scope_effects(&scope, StreamPosition::GenerationStart, through)
            .await
            .map_err(|e| e.to_string())?;
        let mut held: BTreeMap<String, Value> = BTreeMap::new();
        for e in &effects {
            let key = match &e.key {
                Value::String(k) => k.clone(),
                other => json::to_canonical_string(other),
            };
            match &e.op {
                EffectOp::Upsert(r) | EffectOp::Tombstone(r) => {
                    let row = json::parse(r.row.as_bytes()).map_err(|_| "a row is not JSON")?;
                    held.insert(key, row);
                }
                EffectOp::Remove(_) => {
                    held.remove(&key);
                }
            }
        }
        // The rows held now must be in the current manifest, their digests
        // recomputing under it; superseded effects are never served.
        let last: BTreeMap<_, _> = effects.iter().map(|e| (&e.identity, e)).collect();
        for e in last.values().filter(|e| e.op.row().is_some()) {
            match observe(manifest, e) {
                Ok(o) => trace.effects.push(o),
                Err(why) => trace.undecodable.push(format!("{s}: {why}")),
            }
        }
        if !held.is_empty() {
            trace.held.insert(s.clone(), held);
        }
        let rows = tx.scope_members(&scope).await.map_err(|e| e.to_string())?;
        if !rows.is_empty() || !effects.is_empty() {
            trace.members.push(ObservedMembers {
                scope: s.clone(),
                rows: rows
                    .into_iter()
                    .map(|(i, d)| (i.as_bytes().to_vec(), d.0))
                    .collect(),
            });
        }
    }
    Ok(trace)
}
