//! The app evolves under faults (ADR 0020): application writers on the
//! database node write notes (with bodies), shares and templates while the
//! server, on a lossy link, crashes now and then; halfway, the server
//! restarts with a config that syncs the notes' `body`, registers the
//! templates table over its existing rows and moves shared notes
//! (and the teams' scopes) from `team:` to `group:` scopes. Devices of
//! each user (the real client library) sync throughout: they hold rows and
//! cursors of the old schema when the config changes, and follow whatever
//! connect and pull tell them. At the end every scope must hold exactly
//! what the new config places in it, and every device exactly its scopes'
//! rows (`invariants::evolution`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actors::capture::{CapturePlan, Effect, EffectOp};
use actors::config::SyncConfig;
use actors::materializer::CaptureStatus;
use actors::store::{MemStore, MemTx, Store, StoreTx};
use actors::testkit::{EXAMPLE_RELATIONS, config_after, config_before};
use client::{Client, LocalStore, MemoryStore, SyncError};
use invariants::capture::{ObservedEffect, ObservedMembers};
use invariants::evolution::{DeviceEnd, Held};
use madsim::net::NetSim;
use madsim::rand::{Rng, thread_rng};
use madsim::runtime::Handle;
use madsim::time::sleep;
use protocol::ids::ScopeId;
use protocol::json::{self, Value};
use protocol::position::StreamPosition;

use crate::capture::{TEAMS, USERS, WHEN, image, key, observe, stream_begun};
use crate::link::ClientLink;
use crate::tripwire::{CrashPoint, Tripwire};

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
    /// Whether a device of each user syncs throughout.
    pub devices: bool,
    pub skipped: Option<SkippedRelation>,
    /// A planted client bug: devices keep the rows of a scope the server
    /// removes (the `team:` scopes the new config replaces).
    pub devices_keep_removed_rows: bool,
    /// A planted bug: the store forgets the configs processes started
    /// with, so the old deploy's process, restarting, brings its config back.
    pub forgets_applied_configs: bool,
    /// Notes that exist before capture is installed (with shares): the
    /// baseline's rows. With more than one chunk of them, the server
    /// crashes once after its first chunk committed, and the baseline is
    /// handed over to re-reads (ADR 0030).
    pub existing_notes: usize,
    /// A planted bug: the hand-over owes no relation, so the rows the
    /// baseline had not read are lost.
    pub handover_forgets_rows: bool,
    /// A second process of the old deploy runs all along, beside the
    /// server, and is still running after the deploy.
    pub old_process: bool,
}

impl Default for EvolutionScenario {
    fn default() -> Self {
        EvolutionScenario {
            writers: 2,
            transactions_per_writer: 30,
            packet_loss: 0.01,
            devices: true,
            skipped: None,
            devices_keep_removed_rows: false,
            forgets_applied_configs: false,
            existing_notes: 0,
            handover_forgets_rows: false,
            old_process: false,
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
    /// Each device at the end.
    pub devices: Vec<DeviceEnd>,
    /// A device's error that no fault explains.
    pub device_errors: Vec<String>,
    /// How the old deploy's process fared when it restarted after the
    /// deploy: `Some(true)` refused, `Some(false)` started.
    pub replaced_refused: Option<bool>,
    /// Whether the scenario ran a second process of the old deploy all along.
    pub old_process: bool,
    /// Whether that process still led capture at the end (`None`: it
    /// never started).
    pub old_process_leads: Option<bool>,
    /// A crash cut the baseline short, and it was handed over (ADR 0030).
    pub baseline_cut_short: bool,
    /// Before the deploy, with existing rows: the notes not held in
    /// their owner's scope (`invariants::evolution::check_owned_notes`).
    pub unowned_before: Vec<String>,
}

/// The teams each user is a member of (`public.team_members`): their
/// `team:` scopes, `group:` ones under the new config.
pub const MEMBERSHIPS: [(&str, &[&str]); 3] =
    [("u0", &["t0"]), ("u1", &["t1"]), ("u2", &["t0", "t1"])];

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

/// A process of the old deploy restarts after the new config started (a
/// rolling deploy's laggard): tries to start the engine under the old
/// config until it gets an answer. Refused, it exits; started (a bug), it
/// keeps running, as such a process would.
async fn old_deploy_restarts(store: MemStore, refused: Arc<Mutex<Option<bool>>>) {
    // Once the new config is applied (its manifest stored), and a while after.
    loop {
        let applied = match store.begin().await {
            Ok(mut tx) => tx.manifests().await.map_or(0, |m| m.len()),
            Err(_) => 0,
        };
        if applied > 1 {
            break;
        }
        sleep(Duration::from_millis(50)).await;
    }
    sleep(Duration::from_millis(thread_rng().gen_range(200..1_000))).await;
    let incarnation: u32 = thread_rng().r#gen();
    loop {
        let store = crate::remote::RemoteStore::new(incarnation as u64, None);
        match actors::Engine::start(store, config_before()).await {
            Err(actors::registry::RegistryError::Replaced { .. }) => {
                *refused.lock().unwrap() = Some(true);
                return;
            }
            // The database did not answer in time: the process restarts.
            Err(_) => sleep(Duration::from_millis(100)).await,
            Ok(engine) => {
                *refused.lock().unwrap() = Some(false);
                let _running = engine;
                std::future::pending::<()>().await;
            }
        }
    }
}

/// A process of the old deploy that runs all along (a rolling deploy
/// that has not yet stopped it): a second engine under the old config
/// beside the server, which takes capture over whenever the server is
/// down. Once the new config started it must give capture away (ADR 0020
/// §6); `leads` says, every 50 ms, whether it leads.
async fn old_process_runs(config: SyncConfig, leads: Arc<Mutex<Option<bool>>>) {
    let incarnation: u32 = thread_rng().r#gen();
    let store = crate::remote::RemoteStore::new(incarnation as u64, None);
    let engine = crate::remote::start_engine_with(store, config).await;
    loop {
        let status = engine.capture_status();
        let leading = matches!(
            status,
            CaptureStatus::Running { .. } | CaptureStatus::Baseline(_) | CaptureStatus::Blocked(_)
        );
        *leads.lock().unwrap() = Some(leading);
        sleep(Duration::from_millis(50)).await;
    }
}

/// Starts the old deploy's process that runs all along ([`old_process_runs`]).
fn start_old_process(config: SyncConfig, leads: Arc<Mutex<Option<bool>>>) {
    Handle::current()
        .create_node()
        .name("old-process")
        .ip("10.0.0.5".parse().expect("ip"))
        .build()
        .spawn(old_process_runs(config, leads));
}

/// The server node: the real engine under whichever config is current.
async fn server(config: Arc<Mutex<SyncConfig>>, tripwire: Arc<Tripwire>) {
    let config = config.lock().unwrap().clone();
    crate::serve_engine_with(config, Some(tripwire), crate::pull::route).await;
}

/// Writes `n` notes (a third of them shared with a team) that exist
/// before capture is installed, in one transaction no trigger sees.
async fn write_existing(store: &MemStore, n: usize) -> Result<(), String> {
    let mut rng = thread_rng();
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    for i in 0..n {
        let id = format!("e-{i:05}");
        let row = image(&[
            ("id", Some(id.clone())),
            ("owner_id", Some(USERS[i % USERS.len()].to_owned())),
            ("title", Some(format!("existing {i}"))),
            ("body", body()),
            ("pinned", Some("f".into())),
            ("updated_at", Some(WHEN.into())),
            ("deleted_at", None),
        ]);
        tx.source_insert("public.notes", row)
            .map_err(|e| format!("{e:?}"))?;
        if rng.gen_range(0..3) == 0 {
            let share = key(&[("note_id", &id), ("team_id", TEAMS[i % TEAMS.len()])]);
            tx.source_insert("public.note_shares", share)
                .map_err(|e| format!("{e:?}"))?;
        }
    }
    tx.commit().await.map_err(|e| e.to_string())
}

type Device = Client<MemoryStore, ClientLink>;

/// One sync of a device, as an app does it: an unsupported schema is reset
/// (an upgraded app), a transient failure is left for the next round, and
/// anything else is recorded. Why the sync did not succeed, if it did not.
async fn sync_device(
    device: &mut Device,
    mismatched: &mut Vec<String>,
    errors: &Mutex<Vec<String>>,
) -> Result<(), String> {
    let result = device.sync().await;
    mismatched.extend(device.take_mismatched());
    let e = match result {
        Ok(_) => return Ok(()),
        Err(e) => e,
    };
    let why = e.to_string();
    match e {
        SyncError::Unsupported(_) => {
            let _ = device.reset_schema().await;
        }
        SyncError::Unreachable(_)
        | SyncError::Unavailable(_)
        | SyncError::AssignmentChanging(_)
        | SyncError::RebuildRestarting(_) => {}
        e => {
            let id = &device.session().client_id;
            errors.lock().unwrap().push(format!("{id}: {e}"));
        }
    }
    Err(why)
}

/// A device of `user`: syncs every second or two until `stop`,
/// now and then restarting from its local store; counts its successful
/// syncs in `synced`.
async fn device(
    index: usize,
    user: &'static str,
    keep_removed_rows: bool,
    large_pages: bool,
    synced: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    errors: Arc<Mutex<Vec<String>>>,
) -> (Device, Vec<String>) {
    let client_id = format!("device-{index}");
    // Pages of a few rows, or (over hundreds of existing rows) of many.
    let pages = |few: std::ops::RangeInclusive<u16>| match large_pages {
        false => thread_rng().gen_range(few),
        true => thread_rng().gen_range(100..=250),
    };
    let open = |store, transport| {
        let config = client::Config {
            pull_limit: pages(1..=4),
            rebuild_limit: pages(1..=3),
            max_tries: 6,
            backoff_base: Duration::from_millis(100),
            backoff_cap: Duration::from_secs(3),
            max_pages: 400,
            ..client::Config::default()
        };
        let mut client =
            Client::open(store, transport, &client_id, config, thread_rng().r#gen()).expect("open");
        if keep_removed_rows {
            client.plant_keeping_removed_rows();
        }
        client
    };
    let transport = ClientLink::bind((index as u64 + 1) << 40, user).await;
    let mut client = open(MemoryStore::new(), transport);
    let mut mismatched = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        if thread_rng().gen_bool(0.1) {
            // The app restarts: only the local store survives.
            let (store, transport) = client.into_parts();
            client = open(store, transport);
        }
        if sync_device(&mut client, &mut mismatched, &errors)
            .await
            .is_ok()
        {
            synced.fetch_add(1, Ordering::Relaxed);
        }
        sleep(Duration::from_millis(thread_rng().gen_range(1_000..3_000))).await;
    }
    (client, mismatched)
}

/// At quiescence: syncs until a sync succeeds, at most `attempts` times;
/// a device that never does is an error of the run's judgement, not of
/// the run.
async fn settle_device(
    device: &mut Device,
    attempts: usize,
    mismatched: &mut Vec<String>,
    errors: &Mutex<Vec<String>>,
) {
    let mut why = String::new();
    for _ in 0..attempts {
        match sync_device(device, mismatched, errors).await {
            Ok(()) => return,
            Err(e) => why = e,
        }
        sleep(Duration::from_millis(500)).await;
    }
    let id = &device.session().client_id;
    errors
        .lock()
        .unwrap()
        .push(format!("{id} never settled; last: {why}"));
}

/// What a device holds, by scope and row key.
fn device_end(device: &Device, user: &str, mismatched: Vec<String>) -> Result<DeviceEnd, String> {
    let mut held: Held = BTreeMap::new();
    for h in device.store().all_holdings().map_err(|e| e.to_string())? {
        let row = json::parse(h.row.as_bytes()).map_err(|_| "a held row is not JSON")?;
        let id = ["fld_notes_id", "fld_templates_id"]
            .iter()
            .find_map(|f| row.as_object()?.get(*f)?.as_str().map(str::to_owned))
            .unwrap_or_else(|| h.pk.clone());
        held.entry(h.scope).or_default().insert(id, row);
    }
    Ok(DeviceEnd {
        client_id: device.session().client_id.clone(),
        user: user.to_owned(),
        scopes: device.session().scopes.keys().cloned().collect(),
        held,
        mismatched,
    })
}

/// A scope's rows after applying its effects in order: row key -> wire row.
fn held_by(effects: &[Effect]) -> Result<BTreeMap<String, Value>, String> {
    let mut held: BTreeMap<String, Value> = BTreeMap::new();
    for e in effects {
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
    Ok(held)
}

/// The `user:` scopes' rows and the source's notes, once capture settled.
async fn owned_notes(store: &MemStore) -> Result<Result<(), Vec<String>>, String> {
    settled(store, store.last_commit_lsn().await).await?;
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    let through = tx
        .capture_progress()
        .await
        .map_err(|e| e.to_string())?
        .boundary;
    let mut held: Held = BTreeMap::new();
    for u in USERS {
        let scope = ScopeId::parse(&format!("user:{u}")).ok_or("scope")?;
        let effects = tx.journaled_effects(&scope, StreamPosition::GenerationStart, through);
        held.insert(format!("user:{u}"), held_by(&effects)?);
    }
    Ok(invariants::evolution::check_owned_notes(
        &tx.source_rows("public.notes"),
        &held,
    ))
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

/// Waits until every device has synced once more: then each holds rows of
/// the old schema when the deploy comes.
async fn synced_since(synced: &[Arc<AtomicUsize>]) -> Result<(), String> {
    let before: Vec<usize> = synced.iter().map(|s| s.load(Ordering::Relaxed)).collect();
    for _ in 0..600 {
        if synced
            .iter()
            .zip(&before)
            .all(|(s, b)| s.load(Ordering::Relaxed) > *b)
        {
            return Ok(());
        }
        sleep(Duration::from_millis(100)).await;
    }
    Err("a device did not sync within 60 simulated seconds before the deploy".into())
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
    if scenario.forgets_applied_configs {
        store.plant_forgets_applied_configs().await;
    }
    if scenario.existing_notes > 0 {
        write_existing(&store, scenario.existing_notes).await?;
    }
    if scenario.handover_forgets_rows {
        store.plant_handover_forgetting_rows().await;
    }
    let aimed: &[CrashPoint] = match scenario.existing_notes {
        0 => &[],
        _ => &[CrashPoint::BaselineCutShort],
    };
    let (tripwire, trips) = Tripwire::arm(aimed);
    let tripwire = Arc::new(tripwire);
    // Re-read chunks of a few rows, or (over hundreds of existing rows) of
    // many; at full speed (the default), or paced to half of the time
    // (ADR 0027).
    let bulk = scenario.existing_notes > 0;
    let full_speed = bulk || thread_rng().gen_bool(0.5);
    let sized = move |mut config: SyncConfig| {
        if bulk {
            config.capture.rematerialize_chunk_rows = 256;
        }
        config.capture.rematerialize_share = if full_speed { 100 } else { 50 };
        config
    };
    let config = Arc::new(Mutex::new(sized(config_before())));
    let teams = config_before().assignment.dependency[0].clone();
    for (user, member_of) in MEMBERSHIPS {
        for team in member_of {
            store.dependency_row(&teams, user, team, true).await;
        }
    }
    let database = {
        let (config, tripwire) = (config.clone(), tripwire.clone());
        crate::start_nodes(&store, scenario.packet_loss, move || {
            server(config.clone(), tripwire.clone())
        })
    };
    // Capture is installed before the application writes (as `synchro serve` does at start).
    store
        .install_capture(&CapturePlan::new(&config_before()))
        .await
        .map_err(|e| e.to_string())?;
    // The crashes begin with the baseline (a tripwire in it, when rows exist).
    let crashes = Arc::new(AtomicUsize::new(0));
    let crasher = {
        let crashes = crashes.clone();
        // A random crash after the first chunk cuts the baseline short
        // too; the tripwire makes sure one does.
        crate::crash_server(4, 150..900, Some(trips), move |_| {
            crashes.fetch_add(1, Ordering::Relaxed);
        })
    };
    stream_begun(&store).await?;
    let old_process_leads = Arc::new(Mutex::new(None));
    if scenario.old_process {
        start_old_process(sized(config_before()), old_process_leads.clone());
    }
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
    let stop = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(Mutex::new(Vec::new()));
    let handle = Handle::current();
    let synced: Vec<Arc<AtomicUsize>> = MEMBERSHIPS.iter().map(|_| Arc::default()).collect();
    let devices: Vec<_> = MEMBERSHIPS
        .iter()
        .take(if scenario.devices {
            MEMBERSHIPS.len()
        } else {
            0
        })
        .enumerate()
        .map(|(i, (user, _))| {
            let node = handle
                .create_node()
                .name(format!("device-{i}"))
                .ip(format!("10.0.3.{}", i + 1).parse().expect("ip"))
                .build();
            let t = node.spawn(device(
                i,
                user,
                scenario.devices_keep_removed_rows,
                scenario.existing_notes > 0,
                synced[i].clone(),
                stop.clone(),
                errors.clone(),
            ));
            (*user, t)
        })
        .collect();
    // Halfway, the deploy: the server restarts under the new config, and
    // the writers go on while its relations are rematerialized.
    while halfway.load(Ordering::Relaxed) < scenario.writers {
        sleep(Duration::from_millis(10)).await;
    }
    // Everything written so far is materialized under the old config.
    crate::capture::catch_up(&store, store.last_commit_lsn().await).await?;
    let unowned_before = match scenario.existing_notes {
        0 => Vec::new(),
        _ => owned_notes(&store).await?.err().unwrap_or_default(),
    };
    if scenario.devices {
        synced_since(&synced).await?;
    }
    if scenario.old_process {
        // The old deploy's second process runs when the deploy comes.
        for _ in 0..600 {
            if old_process_leads.lock().unwrap().is_some() {
                break;
            }
            sleep(Duration::from_millis(100)).await;
        }
    }
    *config.lock().unwrap() = sized(config_after());
    // A kill first: `restart` alone keeps the old incarnation's socket.
    Handle::current().kill("server");
    Handle::current().restart("server");
    switched.store(true, Ordering::Relaxed);
    let replaced = Arc::new(Mutex::new(None));
    handle
        .create_node()
        .name("old-server")
        .ip("10.0.0.3".parse().expect("ip"))
        .build()
        .spawn(old_deploy_restarts(store.clone(), replaced.clone()));
    let outcome = async {
        for w in writers {
            w.await.map_err(|e| format!("writer failed: {e}"))?;
        }
        tripwire.disarm();
        crasher.await.map_err(|e| format!("crasher failed: {e}"))?;
        stop.store(true, Ordering::Relaxed);
        let mut ended = Vec::new();
        for (user, t) in devices {
            ended.push((user, t.await.map_err(|e| format!("device failed: {e}"))?));
        }
        settled(&store, store.last_commit_lsn().await).await?;
        // Quiescence: the link heals and every device syncs to the end.
        NetSim::current().update_config(|c| c.packet_loss_rate = 0.0);
        let baseline_cut_short = store.baseline_handovers().await > 0;
        let mut trace = EvolutionTrace {
            crashes: crashes.load(Ordering::Relaxed),
            replaced_refused: *replaced.lock().unwrap(),
            old_process: scenario.old_process,
            old_process_leads: *old_process_leads.lock().unwrap(),
            baseline_cut_short,
            unowned_before,
            ..EvolutionTrace::default()
        };
        // A skipped relation is caught by the server's state alone (its
        // test asserts so), and its devices may never settle: one attempt
        // each, not forty, or those retries are most of the run.
        let attempts = if scenario.skipped.is_some() { 1 } else { 40 };
        for (user, (mut device, mut mismatched)) in ended {
            settle_device(&mut device, attempts, &mut mismatched, &errors).await;
            trace.devices.push(device_end(&device, user, mismatched)?);
        }
        trace.device_errors = errors.lock().unwrap().clone();
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
            let effects = tx.journaled_effects(&scope, StreamPosition::GenerationStart, through);
            let held = held_by(&effects)?;
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
        Ok::<EvolutionTrace, String>(trace)
    }
    .await;
    // A run that wedged still says how the old deploy's process fared.
    outcome.map_err(|e| {
        match invariants::evolution::check_replaced_refused(*replaced.lock().unwrap()) {
            Err(v) => format!("{e} (and: {})", v[0]),
            Ok(()) => e,
        }
    })
}
