//! The app evolves (ADR 0020): a restart with a config that adds a field
//! over a column that already holds values, registers a table over
//! existing rows, and changes a `via` rule's template. The relations'
//! rows are rematerialized beside live writes; meanwhile the scopes they
//! feed answer `503`; afterwards every scope holds exactly its rows under
//! the current manifest and rules, and a client's copy verifies.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use protocol::digest::{RowIdentity, row_digest};
use protocol::ids::ScopeId;
use protocol::json::{self, Value};
use protocol::position::StreamPosition;

use super::capture::{fast_config, rematerialized, settle, stream_begun};
use super::pull::PullClient;
use super::transport::{Node, Transport};
use super::{CaptureWorld, Write};
use crate::Engine;
use crate::capture::{CaptureProgress, Effect};
use crate::config::SyncConfig;
use crate::materializer::CaptureStatus;
use crate::store::{Store, StoreTx};

const N1: &str = "00000000-0000-4000-8000-000000000e01";
const N2: &str = "00000000-0000-4000-8000-000000000e02";
const N3: &str = "00000000-0000-4000-8000-000000000e03";
const T: &str = "2026-07-18 14:00:01+00";

/// The example config before: no `body` field, no templates table, notes
/// shared into `team:` scopes.
pub fn config_before() -> SyncConfig {
    fast_config(|s| {
        let body = s
            .lines()
            .find(|l| l.contains("fld_notes_body"))
            .unwrap()
            .to_owned();
        without_templates(s.replace(&format!("{body}\n"), ""))
    })
}

/// The example config without its templates table (the last it registers).
pub fn without_templates(config: String) -> String {
    let at = config
        .find("[[tables]]\ntable_id = \"tbl_templates\"")
        .expect("the example config registers templates");
    config[..at].to_owned()
}

/// The example config after: `body` synced, templates registered, notes
/// shared into `group:` scopes; rematerialized in chunks of two rows,
/// paced to half of the time (ADR 0027).
pub fn config_after() -> SyncConfig {
    let mut config = fast_config(|s| s.replace("team:{team_id}", "group:{team_id}"));
    config.capture.rematerialize_chunk_rows = 2;
    config.capture.rematerialize_share = 50;
    config
}

fn note<'a>(id: &'a str, owner: &'a str, body: Option<&'a str>) -> [(&'a str, Option<&'a str>); 7] {
    [
        ("id", Some(id)),
        ("owner_id", Some(owner)),
        ("title", Some("t")),
        ("body", body),
        ("pinned", Some("f")),
        ("updated_at", Some(T)),
        ("deleted_at", None),
    ]
}

async fn progress<S: Store>(store: &S) -> CaptureProgress {
    let mut tx = store.begin().await.unwrap();
    tx.capture_progress().await.unwrap()
}

/// Each row's last effect in `scope`, through the current boundary: what
/// a client that applied them all holds (a removal holds nothing).
async fn held<S: Store>(store: &S, scope: &str) -> BTreeMap<RowIdentity, Effect> {
    let mut tx = store.begin().await.unwrap();
    let through = tx.capture_progress().await.unwrap().boundary;
    let effects = tx
        .scope_effects(
            &ScopeId::parse(scope).unwrap(),
            StreamPosition::GenerationStart,
            through,
        )
        .await
        .unwrap();
    let mut held = BTreeMap::new();
    for e in effects {
        match e.op.row() {
            Some(_) => held.insert(e.identity.clone(), e),
            None => held.remove(&e.identity),
        };
    }
    held
}

/// Runs the evolution on `world` (a fresh store with the example relations).
pub async fn rematerialization_suite<W: CaptureWorld>(world: &W) {
    let store = world.store().clone();
    let before = Engine::start(store.clone(), config_before()).await.unwrap();
    stream_begun(&store).await;
    let lsn = world
        .write(&[
            Write::Insert("public.notes", &note(N1, "ev-alice", Some("b1"))),
            Write::Insert("public.notes", &note(N2, "ev-bob", None)),
            Write::Insert(
                "public.templates",
                &[
                    ("id", Some("tpl-e")),
                    ("name", Some("n")),
                    ("body", Some("x")),
                ],
            ),
            Write::Insert(
                "public.note_shares",
                &[("note_id", Some(N1)), ("team_id", Some("red"))],
            ),
        ])
        .await;
    settle(&store, lsn).await;
    assert_eq!(held(&store, "team:red").await.len(), 1);
    assert!(progress(&store).await.rematerializing.is_empty());

    // The new config, with capture held elsewhere: the old engine gives
    // way, and until its relations are rematerialized their scopes wait.
    drop(before);
    let feed = hold_capture(&store).await;
    let after = Engine::start(store.clone(), config_after()).await.unwrap();
    let node = Node::new(after.clone(), Arc::new(Transport::direct));
    let owed: BTreeSet<String> = ["public.notes", "public.templates"]
        .map(str::to_owned)
        .into();
    assert_eq!(progress(&store).await.rematerializing, owed);
    let mut alice = PullClient::connect(&store, &node, "ev-alice", "ev-c").await;
    let (status, body, retry_after) = alice.send(alice.body(10)).await;
    assert_eq!(status, 503, "{body:?}");
    assert_eq!(super::push::error_code(&body), "temporary_unavailable");
    assert!(retry_after.is_some());
    // The application keeps writing while the rows are read again.
    let lsn = world
        .write(&[
            Write::Update("public.notes", &[("id", N2)], &[("body", Some("b2"))]),
            Write::Insert("public.notes", &note(N3, "ev-alice", Some("b3"))),
        ])
        .await;
    drop(feed);
    settle(&store, lsn).await;
    rematerialized(&store).await;

    // Every scope holds exactly its rows, in the current manifest: each
    // held row's digest recomputes under it, and equals the index's.
    let manifest = {
        let mut tx = store.begin().await.unwrap();
        tx.manifests().await.unwrap().pop().unwrap()
    };
    type Rows<'a> = &'a [(&'a str, Option<&'a str>)];
    let expect: [(&str, Rows<'_>); 5] = [
        ("user:ev-alice", &[(N1, Some("b1")), (N3, Some("b3"))]),
        ("user:ev-bob", &[(N2, Some("b2"))]),
        ("group:red", &[(N1, Some("b1"))]),
        ("team:red", &[]),
        ("templates_public", &[("tpl-e", None)]),
    ];
    for (scope, rows) in expect {
        let held = held(&store, scope).await;
        let mut keys = Vec::new();
        for e in held.values() {
            let r = e.op.row().unwrap();
            assert_eq!(r.schema_version, Some(manifest.schema_version()), "{scope}");
            let table = manifest.table(&e.table_id).unwrap();
            let row = json::parse(r.row.as_bytes()).unwrap();
            let decoded = table.decode_row(row.as_object().unwrap()).unwrap();
            let digest = row_digest(&manifest.hash(), table, &e.identity, &decoded, &r.version);
            assert_eq!(digest, r.digest, "{scope}: the row digest recomputes");
            let key = e.key.as_str().unwrap().to_owned();
            let body = row.as_object().unwrap().get("fld_notes_body").cloned();
            keys.push((key, body));
        }
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        let want: Vec<(String, Option<Value>)> = rows
            .iter()
            .map(|(k, b)| {
                let body = (e_is_note(k)).then(|| b.map_or(Value::Null, Value::string));
                ((*k).to_owned(), body)
            })
            .collect();
        assert_eq!(keys, want, "{scope}");
        let mut tx = store.begin().await.unwrap();
        let members = tx
            .scope_members(&ScopeId::parse(scope).unwrap())
            .await
            .unwrap();
        let from_effects: Vec<_> = held
            .iter()
            .map(|(i, e)| (i.clone(), e.op.row().unwrap().digest))
            .collect();
        assert_eq!(members, from_effects, "{scope}: the index is the effects'");
    }

    // A client's copy verifies every row and checksum.
    alice.sync(10).await;
    let local = &alice.replica.scopes["user:ev-alice"].rows;
    assert_eq!(local.len(), 2);
    let mut tx = store.begin().await.unwrap();
    let members = tx
        .scope_members(&ScopeId::parse("user:ev-alice").unwrap())
        .await
        .unwrap();
    let digests: Vec<_> = local.values().map(|r| r.digest).collect();
    let want: Vec<_> = members.into_iter().map(|(_, d)| d).collect();
    assert_eq!(digests, want);
    drop(tx);

    // The templates table removed: its rows leave every scope with it, and
    // a client of the new schema syncs (a removal is class 4: it rebuilds).
    let mut removed = config_after();
    removed.tables.retain(|t| t.table_id != "tbl_templates");
    let last = Engine::start(store.clone(), removed).await.unwrap();
    // The process still on the older config serves no page.
    let (status, body, _) = alice.send(alice.body(10)).await;
    assert_eq!(status, 503, "{body:?}");
    assert_eq!(super::push::error_code(&body), "temporary_unavailable");
    drop(after);
    let node = Node::new(last.clone(), Arc::new(Transport::direct));
    assert!(held(&store, "templates_public").await.is_empty());
    let mut tx = store.begin().await.unwrap();
    let shared = ScopeId::parse("templates_public").unwrap();
    assert!(tx.scope_members(&shared).await.unwrap().is_empty());
    drop(tx);
    rematerialized(&store).await;
    let mut fresh = PullClient::connect(&store, &node, "ev-alice", "ev-c2").await;
    fresh.sync(10).await;
    assert_eq!(fresh.replica.scopes["user:ev-alice"].rows.len(), 2);
    assert!(fresh.replica.scopes["templates_public"].rows.is_empty());
    drop(last);

    // A process of an older deploy, restarted, is refused and writes
    // nothing (ADR 0020 §8); the operator's roll-back returns to a config
    // on purpose, and the newest start wins again after it.
    let mut regrouped = config_after();
    regrouped.tables.retain(|t| t.table_id != "tbl_templates");
    let removed = regrouped.clone();
    for t in &mut regrouped.tables {
        for rule in &mut t.scopes {
            if let crate::config::MembershipRule::Dependency { template, .. } = rule {
                *template = template.replace("group:", "team:");
            }
        }
    }
    drop(
        Engine::start(store.clone(), regrouped.clone())
            .await
            .unwrap(),
    );
    let stored = stored_config(&store).await;
    assert_replaced(Engine::start(store.clone(), removed.clone()).await, 1);
    assert_replaced(Engine::start(store.clone(), config_after()).await, 2);
    assert_eq!(
        stored_config(&store).await,
        stored,
        "a refused start writes nothing"
    );
    let mut rolled_back = removed.clone();
    rolled_back.roll_back = true;
    drop(Engine::start(store.clone(), rolled_back).await.unwrap());
    assert_ne!(
        stored_config(&store).await,
        stored,
        "the roll-back's rules are the newest"
    );
    drop(Engine::start(store.clone(), removed).await.unwrap());
    assert_replaced(Engine::start(store.clone(), regrouped).await, 1);
}

/// A rolling deploy whose newer config registers a table while the older
/// process still leads capture (ADR 0020 §6): the older gives way, and
/// never blocks the stream the newer one then leads, not even for a
/// moment, though a write to the new table may reach it first (its model
/// cannot read it); the new table's rows reach their scope.
pub async fn an_older_leader_gives_way<W: CaptureWorld>(world: &W) {
    let store = world.store().clone();
    // The two configs differ only by the table: no relation both capture
    // changed its model.
    let older = Engine::start(store.clone(), fast_config(without_templates))
        .await
        .unwrap();
    stream_begun(&store).await;
    capture_becomes(&older, "the older process leads", |s| {
        matches!(s, CaptureStatus::Running { .. })
    })
    .await;
    // Every status the older process passes through, until it gives way.
    let watched = older.clone();
    let statuses = tokio::spawn(async move {
        let mut seen = Vec::new();
        for _ in 0..10_000 {
            let status = watched.capture_status();
            if seen.last() != Some(&status) {
                seen.push(status.clone());
            }
            if status == CaptureStatus::Superseded {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        seen
    });
    let newer = Engine::start(store.clone(), fast_config(|s| s))
        .await
        .unwrap();
    let template = [
        ("id", Some("tpl-r")),
        ("name", Some("n")),
        ("body", Some("x")),
    ];
    let lsn = world
        .write(&[Write::Insert("public.templates", &template)])
        .await;
    let seen = statuses.await.unwrap();
    assert_eq!(seen.last(), Some(&CaptureStatus::Superseded), "{seen:?}");
    assert!(
        !seen.iter().any(|s| matches!(s, CaptureStatus::Blocked(_))),
        "the older process never blocks capture: {seen:?}"
    );
    let p = settle(&store, lsn).await;
    assert_eq!(p.quarantine, None, "nothing blocked the stream");
    rematerialized(&store).await;
    assert_eq!(held(&store, "templates_public").await.len(), 1);
    assert!(matches!(
        newer.capture_status(),
        CaptureStatus::Running { .. }
    ));
}

/// Waits (up to 10 s) until `engine`'s capture status satisfies `want`.
async fn capture_becomes(engine: &Engine, what: &str, want: impl Fn(&CaptureStatus) -> bool) {
    for _ in 0..2000 {
        if want(&engine.capture_status()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{what}: not in 10 s ({:?})", engine.capture_status());
}

/// What the store holds of the configs processes started with.
async fn stored_config<S: Store>(store: &S) -> (Vec<String>, usize, usize) {
    let mut tx = store.begin().await.unwrap();
    (
        tx.applied_configs().await.unwrap(),
        tx.manifests().await.unwrap().len(),
        tx.membership_rules().await.unwrap().len(),
    )
}

fn assert_replaced(start: Result<Engine, crate::registry::RegistryError>, newer: usize) {
    match start {
        Err(e @ crate::registry::RegistryError::Replaced { .. }) => {
            assert!(
                e.to_string().contains("--roll-back"),
                "the refusal says the way out: {e}"
            );
            assert!(
                matches!(e, crate::registry::RegistryError::Replaced { newer: n } if n == newer)
            );
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a replaced config started"),
    }
}

fn e_is_note(key: &str) -> bool {
    key.starts_with("00000000-")
}

/// Takes capture's leadership (once the engine that held it let go).
async fn hold_capture<S: Store>(store: &S) -> S::Feed {
    for _ in 0..2000 {
        if let Some(feed) = store.change_feed().await.unwrap() {
            return feed;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("capture's leadership was not released in 10 s");
}
