//! WAL capture under faults: application writers on the database node race
//! the materializer, which runs in the real engine on a server node that
//! crashes at arbitrary points and reaches the database over a lossy link
//! (lost store messages, commit-unknown results, lost acknowledgements and
//! so redelivered transactions).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::capture::{EffectOp, SourceImage};
use actors::store::{MemStore, MemTx, Store, StoreTx};
use invariants::capture::{
    EffectKind, ObservedEffect, ObservedMembers, ObservedProjection, SourceCommit, SourceWrite,
};
use madsim::rand::{Rng, thread_rng};
use madsim::time::sleep;
use protocol::digest::{RowIdentity, row_digest};
use protocol::ids::ScopeId;
use protocol::json::{self, Value};
use protocol::manifest::Manifest;
use protocol::position::{Boundary, StreamPosition};

use crate::remote;
use crate::tripwire::{CrashPoint, Tripwire};

/// The replication slot lost mid-run (ADR 0010).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotLoss {
    /// The slot is dropped: capture must block, with nothing after its
    /// last materialized transaction materialized, ever.
    Dropped,
    /// A planted bug: the slot's WAL is lost and capture goes on from a
    /// new slot, as a server that recreated it silently would.
    SilentlyRecreated,
}

/// Rows the database holds before capture is installed: no version, no
/// projection. The server's first feed takes them as the baseline (ADR 0011).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Existing {
    pub notes: usize,
    /// A planted bug: the baseline leaves out the dependency rows.
    pub without_dependencies: bool,
}

/// Knobs of one capture run.
#[derive(Clone, Debug)]
pub struct CaptureScenario {
    pub writers: usize,
    pub transactions_per_writer: usize,
    pub packet_loss: f64,
    pub slot_loss: Option<SlotLoss>,
    pub existing: Option<Existing>,
    /// A planted bug: an idle feed never offers its idle end, so the slot
    /// keeps the WAL of capture's own writes.
    pub idle_end_withheld: bool,
    /// Halfway, the writers pause long enough for capture to idle (and
    /// confirm the WAL of its own heartbeats) while the server crashes on.
    pub idle_spell: Duration,
}

impl Default for CaptureScenario {
    fn default() -> Self {
        CaptureScenario {
            writers: 2,
            transactions_per_writer: 25,
            // Lost datagrams are retransmitted; a database connection dies
            // at 0.5% of operations, and the server crashes: failures are
            // frequent, yet capture makes progress.
            packet_loss: 0.01,
            slot_loss: None,
            existing: None,
            idle_end_withheld: false,
            idle_spell: Duration::from_secs(10),
        }
    }
}

/// What a capture run recorded.
#[derive(Clone, Debug, Default)]
pub struct CaptureTrace {
    pub history: Vec<SourceCommit>,
    pub effects: Vec<ObservedEffect>,
    pub projections: Vec<ObservedProjection>,
    /// Every scope's membership index at the end.
    pub members: Vec<ObservedMembers>,
    pub crashes: usize,
    /// Feed deliveries beyond one per committed transaction.
    pub redeliveries: u64,
    /// Faults in order, for the determinism check.
    pub events: Vec<String>,
    /// With a lost slot: the last commit before the loss, and the commits
    /// that were materialized (the history is cut there).
    pub slot_lost_after: Option<actors::capture::Lsn>,
    pub materialized_commits: usize,
    /// Where the baseline's chunks are (ADR 0011): commits the server had
    /// before its first feed opened are in it.
    pub baseline_span: Option<(actors::capture::Lsn, actors::capture::Lsn)>,
    /// The crash aimed at a baseline written but not committed happened.
    pub crashed_mid_baseline: bool,
    /// Over 10 s of idling after capture caught up: the WAL written
    /// meanwhile (capture's own heartbeats), and what the slot retains at
    /// the end.
    pub idle_wal: Option<(actors::capture::Lsn, actors::capture::Lsn)>,
}

pub(crate) const USERS: [&str; 3] = ["u0", "u1", "u2"];
pub(crate) const TEAMS: [&str; 2] = ["t0", "t1"];
pub(crate) const WHEN: &str = "2026-07-18 14:00:01+00";

pub(crate) fn image(cols: &[(&str, Option<String>)]) -> SourceImage {
    cols.iter()
        .map(|(c, v)| ((*c).to_owned(), v.clone()))
        .collect()
}

pub(crate) fn key(cols: &[(&str, &str)]) -> SourceImage {
    cols.iter()
        .map(|(c, v)| ((*c).to_owned(), Some((*v).to_owned())))
        .collect()
}

/// One random application write inside `tx`, recorded for the model.
fn random_write(
    tx: &mut MemTx,
    notes: &mut Vec<String>,
    writer: usize,
    counter: &mut u32,
    out: &mut Vec<SourceWrite>,
) {
    let mut rng = thread_rng();
    let pick = |list: &[String]| list[thread_rng().gen_range(0..list.len())].clone();
    let roll = if notes.is_empty() {
        0
    } else {
        rng.gen_range(0..10)
    };
    let put = |relation: &str, row: SourceImage, out: &mut Vec<SourceWrite>| {
        out.push(SourceWrite::Put {
            relation: relation.to_owned(),
            image: row,
        });
    };
    match roll {
        0 | 1 => {
            *counter += 1;
            let id = format!("n-{writer}-{counter}");
            let row = image(&[
                ("id", Some(id.clone())),
                (
                    "owner_id",
                    Some(USERS[rng.gen_range(0..USERS.len())].to_owned()),
                ),
                ("title", Some(format!("title {counter}"))),
                ("body", None),
                ("pinned", Some("f".into())),
                ("updated_at", Some(WHEN.into())),
                ("deleted_at", None),
            ]);
            tx.source_insert("public.notes", row.clone()).unwrap();
            notes.push(id);
            put("public.notes", row, out);
        }
        2..=4 => {
            let id = pick(notes);
            let changes = match rng.gen_range(0..4) {
                0 => image(&[(
                    "owner_id",
                    Some(USERS[rng.gen_range(0..USERS.len())].to_owned()),
                )]),
                1 => image(&[("deleted_at", Some(WHEN.into()))]),
                2 => image(&[("deleted_at", None)]),
                _ => image(&[("title", Some(format!("edit {}", rng.gen_range(0..1000))))]),
            };
            let k = key(&[("id", &id)]);
            tx.source_update("public.notes", &k, changes).unwrap();
            put(
                "public.notes",
                tx.source_row("public.notes", &k).unwrap(),
                out,
            );
        }
        5 => {
            // A hard delete, with its shares (what ON DELETE CASCADE does).
            let id = pick(notes);
            for team in TEAMS {
                let k = key(&[("note_id", &id), ("team_id", team)]);
                if tx.source_row("public.note_shares", &k).is_some() {
                    tx.source_delete("public.note_shares", &k).unwrap();
                    out.push(SourceWrite::Delete {
                        relation: "public.note_shares".into(),
                        key: vec![id.clone(), team.to_owned()],
                    });
                }
            }
            tx.source_delete("public.notes", &key(&[("id", &id)]))
                .unwrap();
            notes.retain(|n| *n != id);
            out.push(SourceWrite::Delete {
                relation: "public.notes".into(),
                key: vec![id],
            });
        }
        6 | 7 => {
            let id = pick(notes);
            let team = TEAMS[rng.gen_range(0..TEAMS.len())];
            let k = key(&[("note_id", &id), ("team_id", team)]);
            if tx.source_row("public.note_shares", &k).is_some() {
                tx.source_delete("public.note_shares", &k).unwrap();
                out.push(SourceWrite::Delete {
                    relation: "public.note_shares".into(),
                    key: vec![id, team.to_owned()],
                });
            } else {
                tx.source_insert("public.note_shares", k.clone()).unwrap();
                put("public.note_shares", k, out);
            }
        }
        _ => {
            let id = format!("tpl-{}", rng.gen_range(0..4));
            let row = image(&[
                ("id", Some(id.clone())),
                ("name", Some(format!("name {}", rng.gen_range(0..1000)))),
                ("body", Some("b".into())),
            ]);
            let k = key(&[("id", &id)]);
            if tx.source_row("public.templates", &k).is_some() {
                tx.source_update("public.templates", &k, row.clone())
                    .unwrap();
            } else {
                tx.source_insert("public.templates", row.clone()).unwrap();
            }
            put("public.templates", row, out);
        }
    }
}

/// One application session on the database node: small transactions with pauses.
async fn writer(
    store: MemStore,
    index: usize,
    transactions: usize,
    notes: Arc<Mutex<Vec<String>>>,
    history: Arc<Mutex<Vec<SourceCommit>>>,
    gates: Vec<(usize, Arc<AtomicBool>)>,
    (spell_at, spell): (usize, Duration),
) {
    let mut counter = 0;
    for t in 0..transactions {
        if t == spell_at {
            sleep(spell).await;
        }
        // Transaction `at` of a gate waits for it (the baseline done, the slot lost).
        while gates
            .iter()
            .any(|(at, g)| *at == t && !g.load(Ordering::Relaxed))
        {
            sleep(Duration::from_millis(10)).await;
        }
        sleep(Duration::from_millis(thread_rng().gen_range(5..80))).await;
        write_one(&store, index, &mut counter, &notes, &history).await;
    }
}

/// One application transaction of a few random writes, recorded in `history`.
async fn write_one(
    store: &MemStore,
    index: usize,
    counter: &mut u32,
    notes: &Mutex<Vec<String>>,
    history: &Mutex<Vec<SourceCommit>>,
) {
    {
        let mut tx = store.begin().await.unwrap();
        let mut writes = Vec::new();
        let n = thread_rng().gen_range(1..4);
        {
            let mut notes = notes.lock().unwrap();
            for _ in 0..n {
                random_write(&mut tx, &mut notes, index, counter, &mut writes);
            }
        }
        // The version each written row has now, for the version invariant.
        let mut versions = BTreeMap::new();
        for w in &writes {
            let (relation, key) = match w {
                SourceWrite::Put { relation, image } => {
                    (relation, image.get("id").cloned().flatten())
                }
                SourceWrite::Delete { relation, key } => (relation, key.first().cloned()),
            };
            let table_id = match relation.as_str() {
                "public.notes" => "tbl_notes",
                "public.templates" => "tbl_templates",
                _ => continue, // note_shares is not registered
            };
            if let Some(key) = key
                && let Some(v) = tx.row_version(table_id, &key)
            {
                versions.insert(key, v);
            }
        }
        // Recorded under the store lock, so the history is in commit order.
        history.lock().unwrap().push(SourceCommit {
            commit_lsn: tx.source_commit_lsn(),
            writes,
            versions,
        });
        tx.commit().await.unwrap();
    }
}

/// The server node for capture: the real engine, materializer included,
/// stopping where `tripwire` arms it.
async fn capture_server(tripwire: Arc<Tripwire>) {
    let incarnation: u32 = thread_rng().r#gen();
    let _engine = remote::start_engine(remote::RemoteStore::new(
        u64::from(incarnation),
        Some(tripwire),
    ))
    .await;
    std::future::pending::<()>().await;
}

/// Writes the rows that exist before capture is installed, in one
/// transaction no trigger sees: notes of every user, some shared with a
/// team, and templates. Their ids join `notes`, so the writers race the
/// baseline over them.
async fn write_existing(
    store: &MemStore,
    existing: Existing,
    notes: &Mutex<Vec<String>>,
) -> Result<SourceCommit, String> {
    let mut rng = thread_rng();
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    for (relation, key) in actors::testkit::EXAMPLE_RELATIONS {
        tx.create_relation(relation, key);
    }
    let mut writes = Vec::new();
    let mut ids = Vec::new();
    for i in 0..existing.notes {
        let id = format!("n-e-{i}");
        let row = image(&[
            ("id", Some(id.clone())),
            ("owner_id", Some(USERS[i % USERS.len()].to_owned())),
            ("title", Some(format!("existing {i}"))),
            ("body", None),
            ("pinned", Some("f".into())),
            ("updated_at", Some(WHEN.into())),
            ("deleted_at", None),
        ]);
        tx.source_insert("public.notes", row.clone())
            .map_err(|e| format!("{e:?}"))?;
        writes.push(SourceWrite::Put {
            relation: "public.notes".into(),
            image: row,
        });
        if rng.gen_range(0..3) == 0 {
            let share = key(&[("note_id", &id), ("team_id", TEAMS[i % TEAMS.len()])]);
            tx.source_insert("public.note_shares", share.clone())
                .map_err(|e| format!("{e:?}"))?;
            writes.push(SourceWrite::Put {
                relation: "public.note_shares".into(),
                image: share,
            });
        }
        ids.push(id);
    }
    for t in 0..2 {
        let row = image(&[
            ("id", Some(format!("tpl-{t}"))),
            ("name", Some("existing".into())),
            ("body", Some("b".into())),
        ]);
        tx.source_insert("public.templates", row.clone())
            .map_err(|e| format!("{e:?}"))?;
        writes.push(SourceWrite::Put {
            relation: "public.templates".into(),
            image: row,
        });
    }
    tx.commit().await.map_err(|e| e.to_string())?;
    notes.lock().unwrap().extend(ids);
    // Below every commit the stream can have: the baseline holds it.
    Ok(SourceCommit {
        commit_lsn: 0,
        writes,
        versions: BTreeMap::new(),
    })
}

pub(crate) fn observe(
    manifest: &Manifest,
    e: &actors::capture::Effect,
) -> Result<ObservedEffect, String> {
    let kind = match &e.op {
        EffectOp::Upsert(r) | EffectOp::Tombstone(r) => {
            let row = json::parse(r.row.as_bytes()).map_err(|_| "effect row is not JSON")?;
            let table = manifest.table(&e.table_id).ok_or("unknown table")?;
            let decoded = table
                .decode_row(row.as_object().ok_or("row is not an object")?)
                .map_err(|_| "effect row does not decode")?;
            let identity = RowIdentity::of(table, table.row_key(&decoded).ok_or("no key")?);
            if identity != e.identity {
                return Err(format!(
                    "effect identity differs from its row in {}",
                    e.scope.as_str()
                ));
            }
            if row_digest(&manifest.hash(), table, &identity, &decoded, &r.version) != r.digest {
                return Err(format!(
                    "row digest does not recompute in {}",
                    e.scope.as_str()
                ));
            }
            if matches!(e.op, EffectOp::Upsert(_)) {
                EffectKind::Upsert(row)
            } else {
                EffectKind::Tombstone(row)
            }
        }
        EffectOp::Remove(_) => EffectKind::Delete,
    };
    Ok(ObservedEffect {
        version: e.op.version().as_str().to_owned(),
        identity: e.identity.as_bytes().to_vec(),
        digest: e.op.row().map(|r| r.digest.0),
        scope: e.scope.as_str().to_owned(),
        position: (e.commit_lsn, e.event_ordinal, e.effect_ordinal),
        key: match &e.key {
            Value::String(s) => s.clone(),
            other => json::to_canonical_string(other),
        },
        kind,
    })
}

/// Waits until capture has materialized every commit through `last`.
pub async fn catch_up(store: &MemStore, last: actors::capture::Lsn) -> Result<(), String> {
    for _ in 0..600 {
        let mut tx = store.begin().await.map_err(|e| e.to_string())?;
        let p = tx.capture_progress().await.map_err(|e| e.to_string())?;
        drop(tx);
        if let Some(q) = p.quarantine {
            return Err(format!("capture blocked: {}", q.problem));
        }
        if matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn >= last) {
            return Ok(());
        }
        sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "capture did not catch up to {last} within 60 simulated seconds"
    ))
}

/// Waits until the stream has begun: the (empty) baseline of a new
/// database is materialized, so every later commit is a transaction of the
/// stream (ADR 0011).
pub async fn stream_begun(store: &MemStore) -> Result<(), String> {
    for _ in 0..600 {
        if store.baseline_done().await {
            return Ok(());
        }
        sleep(Duration::from_millis(100)).await;
    }
    Err("the baseline was not materialized within 60 simulated seconds".into())
}

/// Waits until capture is blocked by the lost slot; the commit LSN it
/// materialized through.
async fn blocked_at(store: &MemStore) -> Result<actors::capture::Lsn, String> {
    for _ in 0..600 {
        let mut tx = store.begin().await.map_err(|e| e.to_string())?;
        let p = tx.capture_progress().await.map_err(|e| e.to_string())?;
        drop(tx);
        if let Some(q) = p.quarantine {
            if q.problem != actors::capture::CaptureProblem::SlotLost {
                return Err(format!(
                    "capture blocked by {}, not the lost slot",
                    q.problem
                ));
            }
            return Ok(match p.boundary {
                Boundary::GenerationStart => 0,
                Boundary::TransactionEnd { commit_lsn } => commit_lsn,
            });
        }
        sleep(Duration::from_millis(100)).await;
    }
    Err("capture did not block on the lost slot within 60 simulated seconds".into())
}

/// Runs a capture scenario under the current seed.
pub async fn run_capture(scenario: CaptureScenario) -> Result<CaptureTrace, String> {
    let store = MemStore::with_seed(thread_rng().r#gen());
    let history = Arc::new(Mutex::new(Vec::new()));
    let notes = Arc::new(Mutex::new(Vec::new()));
    if let Some(existing) = scenario.existing {
        let commit = write_existing(&store, existing, &notes).await?;
        history.lock().unwrap().push(commit);
        if existing.without_dependencies {
            store.plant_baseline_without_dependencies().await;
        }
    }
    let aimed: &[CrashPoint] = match scenario.existing {
        Some(_) => &[CrashPoint::MidBaseline],
        None => &[],
    };
    let (tripwire, trips) = Tripwire::arm(aimed);
    let tripwire = Arc::new(tripwire);
    let database = {
        let tripwire = tripwire.clone();
        crate::start_nodes(&store, scenario.packet_loss, move || {
            capture_server(tripwire.clone())
        })
    };

    // Capture is installed before the application writes (as `synchro serve` does at start).
    let config = actors::testkit::example_config(|s| s);
    store
        .install_capture(&actors::capture::CapturePlan::new(&config))
        .await
        .map_err(|e| e.to_string())?;
    if scenario.idle_end_withheld {
        store.plant_idle_end_withheld().await;
    }
    // The writers begin once the stream has (the baseline done), or, over
    // an existing database, race the baseline with their first halves.
    let baseline_done = Arc::new(AtomicBool::new(false));
    {
        let (store, gate) = (store.clone(), baseline_done.clone());
        database.spawn(async move {
            while !store.baseline_done().await {
                sleep(Duration::from_millis(20)).await;
            }
            gate.store(true, Ordering::Relaxed);
        });
    }
    let half = scenario.transactions_per_writer / 2;
    let mut gates = vec![match scenario.existing {
        Some(_) => (half, baseline_done.clone()),
        None => (0, baseline_done.clone()),
    }];
    // With a lost slot, the writers' second halves come after the loss.
    let lost = scenario.slot_loss.map(|_| Arc::new(AtomicBool::new(false)));
    if let Some(gate) = &lost {
        gates.push((half, gate.clone()));
    }
    let writers: Vec<_> = (0..scenario.writers)
        .map(|i| {
            database.spawn(writer(
                store.clone(),
                i,
                scenario.transactions_per_writer,
                notes.clone(),
                history.clone(),
                gates.clone(),
                (half, scenario.idle_spell),
            ))
        })
        .collect();
    let mut trace = CaptureTrace::default();
    // The slot is lost while the writers write.
    let loss = scenario.slot_loss.map(|kind| {
        let (store, history, notes) = (store.clone(), history.clone(), notes.clone());
        let own = scenario.writers; // the loss's own writes, as another session
        let lost = lost.clone().expect("a gate");
        // When every writer is halfway, so commits come after it.
        let at = scenario.writers * (scenario.transactions_per_writer / 2);
        database.spawn(async move {
            // ... and once capture materialized something, so the loss cuts
            // a stream that was running.
            loop {
                let materialized = match store.begin().await {
                    Ok(mut tx) => tx
                        .capture_progress()
                        .await
                        .is_ok_and(|p| p.boundary != Boundary::GenerationStart),
                    Err(_) => false,
                };
                if materialized && history.lock().unwrap().len() >= at {
                    break;
                }
                sleep(Duration::from_millis(thread_rng().gen_range(5..50))).await;
            }
            // The last commits before the loss: no feed can have read them
            // yet, so the lost slot takes them along.
            let mut counter = 0;
            for _ in 0..2 {
                write_one(&store, own, &mut counter, &notes, &history).await;
            }
            let before = store.last_commit_lsn().await;
            match kind {
                SlotLoss::Dropped => store.lose_slot().await,
                SlotLoss::SilentlyRecreated => store.lose_wal().await,
            }
            lost.store(true, Ordering::Relaxed);
            before
        })
    });
    // Crash the server (and with it the materializer) at arbitrary points,
    // and once with a baseline written but not committed.
    let events = Arc::new(Mutex::new(Vec::new()));
    let crasher = {
        let events = events.clone();
        crate::crash_server(6, 150..900, Some(trips), move |cause| {
            events.lock().unwrap().push(match cause {
                None => "server crash and restart".to_owned(),
                Some(point) => format!("server crash at {point:?} and restart"),
            });
        })
    };
    for w in writers {
        w.await.map_err(|e| format!("writer failed: {e}"))?;
    }
    if scenario.existing.is_some() {
        // The baseline is over when the writers are: stop aiming at it.
        catch_up(&store, 0).await?;
    }
    tripwire.disarm();
    crasher.await.map_err(|e| format!("crasher failed: {e}"))?;
    trace.events = events.lock().unwrap().clone();
    trace.crashes = trace.events.len();
    trace.crashed_mid_baseline = trace.events.iter().any(|e| e.contains("MidBaseline"));
    trace.history = history.lock().unwrap().clone();

    if let Some(loss) = loss {
        trace.slot_lost_after = Some(loss.await.map_err(|e| format!("slot loss failed: {e}"))?);
    }
    let last = trace.history.last().map_or(0, |c| c.commit_lsn);
    if scenario.slot_loss == Some(SlotLoss::Dropped) {
        // Capture blocks; what it materialized is judged as the history
        // through its boundary.
        let through = blocked_at(&store).await?;
        trace.history.retain(|c| c.commit_lsn <= through);
    } else {
        // Let capture catch up with everything committed, then idle.
        catch_up(&store, last).await?;
        let start = store.wal_end().await;
        sleep(Duration::from_secs(10)).await;
        let written = store.wal_end().await - start;
        trace.idle_wal = Some((written, store.retained_wal().await));
    }
    trace.materialized_commits = trace.history.len();
    trace.baseline_span = store.baseline_span().await;
    if let Some(first) = trace.history.first_mut()
        && first.commit_lsn == 0
    {
        // The versions the baseline gave the rows that had none (the
        // store's row versions then); later writes' versions are the writers'.
        first.versions = store.baseline_versions().await;
    }
    trace.redeliveries = store
        .feed_deliveries()
        .await
        .saturating_sub(trace.history.len() as u64);

    // Read everything materialized.
    let mut tx = store.begin().await.unwrap();
    let manifest = tx.manifests().await.unwrap().pop().ok_or("no manifest")?;
    let through = tx.capture_progress().await.unwrap().boundary;
    let mut scopes: Vec<String> = USERS.iter().map(|u| format!("user:{u}")).collect();
    scopes.extend(TEAMS.iter().map(|t| format!("team:{t}")));
    scopes.push("templates_public".into());
    for s in &scopes {
        let scope = ScopeId::parse(s).ok_or("scope")?;
        for e in tx.journaled_effects(&scope, StreamPosition::GenerationStart, through) {
            trace.effects.push(observe(&manifest, &e)?);
        }
    }
    if let Some(span) = trace.baseline_span {
        invariants::capture::fold_baseline(&mut trace.history, &mut trace.effects, span);
    }
    let mut keys: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for commit in &trace.history {
        for w in &commit.writes {
            if let SourceWrite::Put { relation, image } = w
                && relation != "public.note_shares"
            {
                let table = if relation == "public.notes" {
                    "tbl_notes"
                } else {
                    "tbl_templates"
                };
                keys.entry(table)
                    .or_default()
                    .extend(image.get("id").cloned().flatten());
            }
        }
    }
    for (table_id, ids) in keys {
        let table = manifest.table(table_id).ok_or("table")?;
        let ty = table.primary_key().field_type().ty;
        let identities: Vec<RowIdentity> = ids
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(|k| {
                RowIdentity::of(
                    table,
                    &protocol::value::decode_key(ty, &Value::string(k.clone())).unwrap(),
                )
            })
            .collect();
        for p in tx.projections(table_id, &identities).await.unwrap() {
            trace.projections.push(ObservedProjection {
                table_id: p.table_id.clone(),
                key: p.key.clone(),
                row: p.row.clone(),
                tombstone: p.tombstone,
                scopes: p.scopes.iter().map(|s| s.as_str().to_owned()).collect(),
            });
        }
    }
    let scopes: std::collections::BTreeSet<String> =
        trace.effects.iter().map(|e| e.scope.clone()).collect();
    for scope in scopes {
        let id = ScopeId::parse(&scope).ok_or("scope")?;
        let rows = tx.scope_members(&id).await.map_err(|e| e.to_string())?;
        trace.members.push(ObservedMembers {
            scope,
            rows: rows
                .into_iter()
                .map(|(i, d)| (i.as_bytes().to_vec(), d.0))
                .collect(),
        });
    }
    Ok(trace)
}
