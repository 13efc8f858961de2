//! The capture suite: the same application writes on any store, and the
//! same expected per-scope effects after the real engine (materializer
//! included) has run. MemStore and PgStore both pass it, so they agree.

use std::collections::BTreeMap;
use std::time::Duration;

use protocol::digest::row_digest;
use protocol::ids::ScopeId;
use protocol::json::{self, Value};
use protocol::manifest::Manifest;
use protocol::position::{Boundary, StreamPosition};

use super::example_config;
use crate::Engine;
use crate::capture::{CaptureProblem, CaptureProgress, Effect, EffectOp, Lsn};
use crate::materializer::CaptureStatus;
use crate::store::{Store, StoreTx};

/// One application write, in PostgreSQL's text forms (what the app's SQL does).
#[derive(Clone, Copy, Debug)]
pub enum Write<'a> {
    /// `INSERT INTO relation (columns) VALUES (...)`.
    Insert(&'a str, &'a [(&'a str, Option<&'a str>)]),
    /// `UPDATE relation SET changes WHERE key`.
    Update(
        &'a str,
        &'a [(&'a str, &'a str)],
        &'a [(&'a str, Option<&'a str>)],
    ),
    /// `DELETE FROM relation WHERE key`.
    Delete(&'a str, &'a [(&'a str, &'a str)]),
    /// `TRUNCATE relation`.
    Truncate(&'a str),
}

/// A store with the example app's tables, written as the application would.
#[allow(async_fn_in_trait)]
pub trait CaptureWorld {
    type S: Store;
    /// The store (fresh, with the example tables and nothing else).
    fn store(&self) -> &Self::S;
    /// Commits `writes` as one source transaction. Returns an LSN at or below
    /// its commit LSN and above every earlier commit's.
    async fn write(&self, writes: &[Write<'_>]) -> Lsn;
    /// Adds or removes a row of `synchro.scope_grants` (an operator's SQL).
    async fn grant(&self, user: &str, scope: &str, on: bool);
    /// Retires a client identity (an operator action).
    async fn retire(&self, client_id: &str);
    /// Fault injection: the next `n` commits that write a checkpoint fail,
    /// at commit, after every write of their transaction, as a lost
    /// serialization race would.
    async fn fail_checkpoint_commits(&self, n: usize);
    /// Fault injection: the replication slot is dropped behind the
    /// server's back (as by hand, or invalidated by `max_slot_wal_keep_size`).
    async fn lose_slot(&self);
    /// Fault injection: the transaction that commits baseline chunk
    /// `index` fails once at its commit, as a crash there would; the
    /// chunks before it stay committed (ADR 0030).
    async fn cut_baseline_at(&self, index: u64);
    /// Whether the cut `cut_baseline_at` injected has failed its commit.
    async fn baseline_was_cut(&self) -> bool;
}

/// The capture world of MemStore: application writes straight into its source relations.
pub struct MemWorld {
    pub store: crate::store::MemStore,
}

fn image(columns: &[(&str, Option<&str>)]) -> crate::capture::SourceImage {
    columns
        .iter()
        .map(|(c, v)| ((*c).to_owned(), v.map(str::to_owned)))
        .collect()
}

fn key_image(columns: &[(&str, &str)]) -> crate::capture::SourceImage {
    columns
        .iter()
        .map(|(c, v)| ((*c).to_owned(), Some((*v).to_owned())))
        .collect()
}

impl CaptureWorld for MemWorld {
    type S = crate::store::MemStore;

    fn store(&self) -> &crate::store::MemStore {
        &self.store
    }

    async fn write(&self, writes: &[Write<'_>]) -> Lsn {
        let before = self.store.last_commit_lsn().await;
        let mut tx = self.store.begin().await.unwrap();
        for w in writes {
            match *w {
                Write::Insert(r, row) => {
                    tx.source_insert(r, image(row)).unwrap();
                }
                Write::Update(r, k, changes) => {
                    tx.source_update(r, &key_image(k), image(changes)).unwrap();
                }
                Write::Delete(r, k) => {
                    tx.source_delete(r, &key_image(k)).unwrap();
                }
                Write::Truncate(r) => tx.source_truncate(r).unwrap(),
            }
        }
        tx.commit().await.unwrap();
        // The commit's own position (a baseline may have moved the log on).
        let after = self.store.last_commit_lsn().await;
        if after > before { after } else { before + 1 }
    }

    async fn grant(&self, user: &str, scope: &str, on: bool) {
        if on {
            self.store.grant(user, scope).await;
        } else {
            self.store.revoke(user, scope).await;
        }
    }

    async fn retire(&self, client_id: &str) {
        let mut tx = self.store.begin().await.unwrap();
        assert!(tx.retire_client(client_id).await.unwrap());
        tx.commit().await.unwrap();
    }

    async fn lose_slot(&self) {
        self.store.lose_slot().await;
    }

    async fn fail_checkpoint_commits(&self, n: usize) {
        self.store.fail_checkpoint_commits(n);
    }

    async fn cut_baseline_at(&self, index: u64) {
        self.store.cut_baseline_at(index).await;
    }

    async fn baseline_was_cut(&self) -> bool {
        self.store.baseline_was_cut().await
    }
}

const N1: &str = "00000000-0000-4000-8000-000000000001";
const N2: &str = "00000000-0000-4000-8000-000000000002";
const N3: &str = "00000000-0000-4000-8000-000000000003";
const N4: &str = "00000000-0000-4000-8000-000000000004";
const T: &str = "2026-07-18 14:00:01.5+00";
/// One template row.
const TEMPLATE: [(&str, Option<&str>); 3] = [
    ("id", Some("tpl-1")),
    ("name", Some("Daily")),
    ("body", Some("x")),
];

fn note<'a>(id: &'a str, owner: &'a str) -> [(&'a str, Option<&'a str>); 7] {
    [
        ("id", Some(id)),
        ("owner_id", Some(owner)),
        ("title", Some("t")),
        ("body", None),
        ("pinned", Some("f")),
        ("updated_at", Some(T)),
        ("deleted_at", None),
    ]
}

/// Waits until everything committed before `lsn` is materialized (or capture blocks).
pub async fn settle<S: Store>(store: &S, lsn: Lsn) -> CaptureProgress {
    for _ in 0..2000 {
        let mut tx = store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        drop(tx);
        let past =
            matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn >= lsn);
        if past || p.quarantine.is_some() {
            return p;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("capture did not reach {lsn} in 10 s");
}

/// Completes the empty baseline that `feed`, the first of a fresh store,
/// owes, as the materializer would; the feed, still leading.
pub(crate) async fn complete_empty_baseline<S: Store>(store: &S, mut feed: S::Feed) -> S::Feed {
    use crate::capture::ChangeFeed;
    let owed = feed.baseline().cloned().unwrap();
    assert_eq!((owed.rows, owed.covered_fences.len()), (0, 0));
    assert!(feed.baseline_chunk().await.unwrap().is_none());
    let mut tx = store.begin().await.unwrap();
    tx.complete_baseline(&owed.covered_fences).await.unwrap();
    tx.commit().await.unwrap();
    feed
}

/// Waits (up to 10 s) until the stream has begun: the baseline is
/// materialized, and pull and rebuild no longer answer `capture_blocked`.
pub async fn stream_begun<S: Store>(store: &S) {
    for _ in 0..2000 {
        let mut tx = store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        drop(tx);
        if !p.baseline_owed {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the baseline was not materialized in 10 s");
}

/// Waits (up to 10 s) until no relation is owed a rematerialization (ADR 0020).
pub async fn rematerialized<S: Store>(store: &S) {
    for _ in 0..2000 {
        let mut tx = store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        drop(tx);
        if p.rematerializing.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the rematerialization did not end in 10 s");
}

/// Waits (up to 2 s) until the engine's readiness is `want`.
pub(super) async fn ready_becomes(engine: &Engine, want: bool, what: &str) {
    for _ in 0..400 {
        if engine.ready().await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("readiness did not become {want}: {what}");
}

/// The example config with capture limits short enough for tests.
pub fn fast_config(edit: impl Fn(String) -> String) -> crate::config::SyncConfig {
    let mut config = example_config(edit);
    config.capture.heartbeat_ms = 20;
    config.capture.max_heartbeat_age_ms = 2_000;
    config.capture.retry_ms = 20;
    config
}

/// Every effect of `scope` through the current boundary.
async fn effects<S: Store>(store: &S, scope: &str) -> Vec<Effect> {
    let mut tx = store.begin().await.unwrap();
    let through = tx.capture_progress().await.unwrap().boundary;
    tx.scope_effects(
        &ScopeId::parse(scope).unwrap(),
        StreamPosition::GenerationStart,
        through,
    )
    .await
    .unwrap()
}

/// What a client holds for a scope after applying its effects in order:
/// each row's identity and digest (tombstones included; a removal removes).
pub fn held_after(
    effects: &[Effect],
) -> Vec<(protocol::digest::RowIdentity, protocol::digest::Digest)> {
    let mut held = std::collections::BTreeMap::new();
    for e in effects {
        match e.op.row() {
            Some(r) => held.insert(e.identity.clone(), r.digest),
            None => held.remove(&e.identity),
        };
    }
    held.into_iter().collect()
}

/// `op key` for each effect, and checks each carried row's digest with the protocol crate.
fn summary(manifest: &Manifest, effects: &[Effect]) -> Vec<String> {
    effects
        .iter()
        .map(|e| {
            let key = json::to_canonical_string(&e.key);
            let op = match &e.op {
                EffectOp::Upsert(_) => "upsert",
                EffectOp::Tombstone(_) => "tombstone",
                EffectOp::Remove(_) => "delete",
            };
            let row = e.op.row();
            if let Some(r) = row {
                let table = manifest.table(&e.table_id).unwrap();
                let value = json::parse(r.row.as_bytes()).unwrap();
                let decoded = table.decode_row(value.as_object().unwrap()).unwrap();
                let digest = row_digest(&manifest.hash(), table, &e.identity, &decoded, &r.version);
                assert_eq!(digest, r.digest, "the row digest recomputes");
            }
            format!("{op} {key}")
        })
        .collect()
}

fn field(e: &Effect, field_id: &str) -> Value {
    let Some(r) = e.op.row() else {
        panic!("no row");
    };
    let row = json::parse(r.row.as_bytes()).unwrap();
    row.as_object().unwrap()[field_id].clone()
}

fn version(e: &Effect) -> String {
    e.op.version().as_str().to_owned()
}

/// Direct application writes become exactly the expected per-scope effects,
/// in commit order, with digests that recompute.
pub async fn capture_suite<W: CaptureWorld>(world: &W) {
    let store = world.store().clone();
    let engine = Engine::start(store.clone(), example_config(|s| s))
        .await
        .unwrap();
    // A write before the stream begins is in the baseline, which clients
    // receive by rebuild, not as effects (ADR 0033).
    stream_begun(&store).await;
    let manifest = {
        let mut tx = store.begin().await.unwrap();
        tx.manifests().await.unwrap().pop().unwrap()
    };
    let tpl2: [(&str, Option<&str>); 3] = [
        ("id", Some("tpl-2")),
        ("name", Some("Weekly")),
        ("body", Some("y")),
    ];
    let (n1, n2, n3, n4) = (
        note(N1, "alice"),
        note(N2, "bob"),
        note(N3, "carol"),
        note(N4, "carol"),
    );
    let steps: Vec<Vec<Write<'_>>> = vec![
        // 0: one template, one note.
        vec![
            Write::Insert("public.templates", &TEMPLATE),
            Write::Insert("public.notes", &n1),
        ],
        // 1: one transaction touching three scopes.
        vec![
            Write::Update("public.notes", &[("id", N1)], &[("title", Some("t2"))]),
            Write::Insert("public.notes", &n2),
            Write::Insert("public.templates", &tpl2),
        ],
        // 2: share n1 with team red: n1 enters team:red unchanged.
        vec![Write::Insert(
            "public.note_shares",
            &[("note_id", Some(N1)), ("team_id", Some("red"))],
        )],
        // 3: an update reaches both of n1's scopes.
        vec![Write::Update(
            "public.notes",
            &[("id", N1)],
            &[("pinned", Some("t"))],
        )],
        // 4: unshare: n1 leaves team:red.
        vec![Write::Delete(
            "public.note_shares",
            &[("note_id", N1), ("team_id", "red")],
        )],
        // 5: soft delete n1 (a tombstone), hard delete n2.
        vec![
            Write::Update("public.notes", &[("id", N1)], &[("deleted_at", Some(T))]),
            Write::Delete("public.notes", &[("id", N2)]),
        ],
        // 6: a row created and deleted in one transaction leaves nothing; n4 for carol.
        vec![
            Write::Insert("public.notes", &n3),
            Write::Delete("public.notes", &[("id", N3)]),
            Write::Insert("public.notes", &n4),
        ],
        // 7: n4 moves from carol to dave.
        vec![Write::Update(
            "public.notes",
            &[("id", N4)],
            &[("owner_id", Some("dave"))],
        )],
    ];
    // Each step is materialized before the next is written, so that each
    // is its own group: membership changes then cross group boundaries
    // (within one group they would net out).
    // The store keeps only each row's last effect in a scope, so the
    // history is read step by step, each step's new effects as they land.
    let names = [
        "user:alice",
        "user:bob",
        "templates_public",
        "team:red",
        "user:carol",
        "user:dave",
    ];
    let mut history: BTreeMap<&str, Vec<Effect>> = BTreeMap::new();
    let mut seen = StreamPosition::GenerationStart;
    let mut last = 0;
    for step in &steps {
        last = world.write(step).await;
        let progress = settle(&store, last).await;
        assert_eq!(progress.quarantine, None);
        let mut tx = store.begin().await.unwrap();
        for name in names {
            let new = tx
                .scope_effects(&ScopeId::parse(name).unwrap(), seen, progress.boundary)
                .await
                .unwrap();
            history.entry(name).or_default().extend(new);
        }
        seen = progress.boundary.into();
    }
    let progress = settle(&store, last).await;
    assert_eq!(progress.quarantine, None);
    // What is kept is each row's last effect of that history.
    for name in names {
        let mut last = BTreeMap::new();
        for e in &history[name] {
            last.insert((e.table_id.clone(), e.identity.clone()), e.clone());
        }
        let mut kept: Vec<Effect> = last.into_values().collect();
        kept.sort_by_key(Effect::position);
        assert_eq!(effects(&store, name).await, kept, "{name}");
    }
    let effects = |name: &str| history[name].clone();

    let n = |id: &str| format!("\"{id}\"");
    let alice = effects("user:alice");
    assert_eq!(
        summary(&manifest, &alice),
        [
            format!("upsert {}", n(N1)),
            format!("upsert {}", n(N1)),
            format!("upsert {}", n(N1)),
            format!("tombstone {}", n(N1)),
        ]
    );
    assert_eq!(
        field(&alice[0], "fld_notes_updated_at"),
        Value::string("2026-07-18T14:00:01.500000Z")
    );
    assert_eq!(field(&alice[0], "fld_notes_body"), Value::Null);
    assert_eq!(field(&alice[1], "fld_notes_title"), Value::string("t2"));
    assert_eq!(field(&alice[2], "fld_notes_pinned"), Value::Bool(true));
    assert_eq!(
        field(&alice[3], "fld_notes_deleted_at"),
        Value::string("2026-07-18T14:00:01.500000Z")
    );
    let bob = effects("user:bob");
    assert_eq!(
        summary(&manifest, &bob),
        [format!("upsert {}", n(N2)), format!("delete {}", n(N2))]
    );
    let public = effects("templates_public");
    assert_eq!(
        summary(&manifest, &public),
        ["upsert \"tpl-1\"", "upsert \"tpl-2\""]
    );
    let red = effects("team:red");
    assert_eq!(
        summary(&manifest, &red),
        [
            format!("upsert {}", n(N1)),
            format!("upsert {}", n(N1)),
            format!("delete {}", n(N1)),
        ]
    );
    // Entering a scope carries the row as it is, at its current version;
    // leaving one carries the version it has then.
    assert_eq!(version(&red[0]), version(&alice[1]));
    assert_eq!(version(&red[2]), version(&alice[2]));
    assert_eq!(field(&red[0], "fld_notes_title"), Value::string("t2"));
    // One update reaches both scopes at one event, with one version.
    assert_eq!(version(&red[1]), version(&alice[2]));
    assert_eq!(red[1].position(), alice[2].position());
    // Every change of the row made a new version.
    let versions: Vec<String> = alice.iter().map(version).collect();
    let mut unique = versions.clone();
    unique.dedup();
    assert_eq!(unique, versions);
    // The three-scope transaction: one commit, consecutive events, per-scope ordinals.
    let (a, b, p) = (&alice[1], &bob[0], &public[1]);
    assert_eq!((a.commit_lsn, a.commit_lsn), (b.commit_lsn, p.commit_lsn));
    assert_eq!(
        [a.event_ordinal, b.event_ordinal, p.event_ordinal],
        [0, 1, 2]
    );
    assert_eq!(
        [a.effect_ordinal, b.effect_ordinal, p.effect_ordinal],
        [0, 0, 0]
    );
    // Commit order: positions strictly increase within every scope.
    for list in [&alice, &bob, &public, &red] {
        assert!(list.windows(2).all(|w| w[0].position() < w[1].position()));
    }
    // A hard delete carries a version of its own (the deletion fence).
    assert_ne!(version(&bob[1]), version(&bob[0]));
    // n3 never existed for anyone; n4 moved, and leaving carol's scope it
    // carries the version the move made, the one dave's scope gets.
    let carol = effects("user:carol");
    assert_eq!(
        summary(&manifest, &carol),
        [format!("upsert {}", n(N4)), format!("delete {}", n(N4))]
    );
    let dave = effects("user:dave");
    assert_eq!(summary(&manifest, &dave), [format!("upsert {}", n(N4))]);
    // The membership index holds exactly what a client applying each
    // scope's effects holds, in row-identity order.
    for (name, list) in [
        ("user:alice", &alice),
        ("user:bob", &bob),
        ("templates_public", &public),
        ("team:red", &red),
        ("user:carol", &carol),
        ("user:dave", &dave),
    ] {
        let mut tx = store.begin().await.unwrap();
        let members = tx
            .scope_members(&ScopeId::parse(name).unwrap())
            .await
            .unwrap();
        assert_eq!(members, held_after(list), "{name}");
    }
    assert_eq!(version(&carol[1]), version(&dave[0]));
    assert_ne!(version(&carol[1]), version(&carol[0]));
    assert_eq!(field(&dave[0], "fld_notes_owner"), Value::string("dave"));
    // Idle and caught up: no lag.
    for _ in 0..400 {
        if let CaptureStatus::Running { lag_bytes: 0, .. } = engine.capture_status() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "capture never reported zero lag: {:?}",
        engine.capture_status()
    );
}

/// TRUNCATE of a registered relation quarantines its transaction and
/// blocks capture: readiness turns false and nothing after it is materialized.
pub async fn truncate_blocks<W: CaptureWorld>(world: &W) {
    let store = world.store().clone();
    let engine = Engine::start(store.clone(), fast_config(|s| s))
        .await
        .unwrap();
    stream_begun(&store).await;
    let lsn = world
        .write(&[Write::Insert("public.templates", &TEMPLATE)])
        .await;
    assert_eq!(settle(&store, lsn).await.quarantine, None);
    ready_becomes(&engine, true, "capture runs").await;

    let lsn = world.write(&[Write::Truncate("public.templates")]).await;
    let progress = settle(&store, lsn).await;
    let q = progress.quarantine.expect("the truncate is quarantined");
    assert_eq!(q.problem, CaptureProblem::Truncate);
    assert!(q.commit_lsn >= lsn);
    ready_becomes(&engine, false, "capture is blocked").await;
    assert_eq!(
        engine.capture_status(),
        CaptureStatus::Blocked(CaptureProblem::Truncate)
    );

    // Later writes wait behind the quarantined transaction, which is retried, not skipped.
    let later = world
        .write(&[Write::Insert("public.templates", &TEMPLATE)])
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut tx = store.begin().await.unwrap();
    let p = tx.capture_progress().await.unwrap();
    drop(tx);
    assert_eq!(
        p.quarantine.map(|q| q.problem),
        Some(CaptureProblem::Truncate)
    );
    assert!(matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn < later));
    let public = effects(&store, "templates_public").await;
    assert_eq!(public.len(), 1);
}

/// The owners whose `user:{owner_id}` is not a scope ID: one that would
/// exceed 512 octets, and the empty value, which names no scope.
pub fn invalid_owners() -> [String; 2] {
    ["x".repeat(600), String::new()]
}

/// A quarantined transaction is retried, not skipped: once the cause is
/// repaired (here, a rule that rendered `owner` into an invalid scope ID
/// is replaced), the same transaction materializes and capture resumes
/// behind it.
pub async fn repair_resumes<W: CaptureWorld>(world: &W, owner: &str) {
    let store = world.store().clone();
    let engine = Engine::start(store.clone(), fast_config(|s| s))
        .await
        .unwrap();
    // The stream is open: the note is a transaction of it, not of the baseline.
    ready_becomes(&engine, true, "capture runs").await;
    let note = [
        ("id", Some(N1)),
        ("owner_id", Some(owner)),
        ("title", Some("t")),
        ("body", None),
        ("pinned", Some("f")),
        ("updated_at", Some(T)),
        ("deleted_at", None),
    ];
    let blocked_at = world.write(&[Write::Insert("public.notes", &note)]).await;
    let progress = settle(&store, blocked_at).await;
    assert_eq!(
        progress.quarantine.map(|q| q.problem),
        Some(CaptureProblem::InvalidScopeId)
    );
    let later = world
        .write(&[Write::Insert("public.templates", &TEMPLATE)])
        .await;
    ready_becomes(&engine, false, "capture is blocked").await;
    drop(engine);

    // The repair: notes belong to one shared scope instead of their owner's.
    let repaired = fast_config(|s| {
        s.replace(
            "{ template = \"user:{owner_id}\" }",
            "{ constant = \"all_notes\" }",
        )
    });
    let engine = Engine::start(store.clone(), repaired).await.unwrap();
    let mut resumed = false;
    for _ in 0..2000 {
        let mut tx = store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        drop(tx);
        let past =
            matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn >= later);
        if past && p.quarantine.is_none() {
            resumed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(resumed, "capture did not resume after the repair");
    let manifest = {
        let mut tx = store.begin().await.unwrap();
        tx.manifests().await.unwrap().pop().unwrap()
    };
    let all = effects(&store, "all_notes").await;
    assert_eq!(summary(&manifest, &all), [format!("upsert \"{N1}\"")]);
    assert!(
        all[0].commit_lsn >= blocked_at && all[0].commit_lsn < later,
        "the same transaction"
    );
    let public = effects(&store, "templates_public").await;
    assert_eq!(summary(&manifest, &public), ["upsert \"tpl-1\""]);
    ready_becomes(&engine, true, "repaired").await;
}

/// The capture-state primitives on any store, with the same results: what a
/// materialization writes reads back exactly, and every write the
/// materializer's view of prior state forbids is an integrity failure that
/// rolls back. The store must be fresh.
pub async fn capture_store_suite<S: Store>(store: &S) {
    use std::collections::BTreeSet;

    use protocol::digest::Digest;
    use protocol::ids::ServerVersion;
    use protocol::value::{PortableType, decode_key};

    use crate::capture::{
        CapturedRow, DependencyRow, Heartbeat, Materialization, MaterializedTransaction,
        Membership, Projection, Quarantine,
    };
    use crate::store::StoreError;

    // A new stream owes its baseline: capture counts as blocked until the
    // first feed's (here empty) baseline is complete.
    let mut tx = store.begin().await.unwrap();
    assert!(tx.capture_progress().await.unwrap().baseline_owed);
    assert!(
        tx.capture_health().await.unwrap().blocked,
        "a baseline owed blocks"
    );
    drop(tx);
    store
        .install_capture(&crate::capture::CapturePlan::new(&example_config(|s| s)))
        .await
        .unwrap();
    let feed = store.change_feed().await.unwrap().unwrap();
    complete_empty_baseline(store, feed).await;
    let mut tx = store.begin().await.unwrap();
    assert!(!tx.capture_progress().await.unwrap().baseline_owed);
    assert!(
        matches!(
            tx.complete_baseline(&[]).await,
            Err(StoreError::Integrity(_))
        ),
        "no baseline is owed twice"
    );
    drop(tx);

    // The shared heartbeat: nothing before the first, then ages by the
    // store's clock, the lag as reported, and a quarantine blocking.
    let mut tx = store.begin().await.unwrap();
    let never = tx.capture_health().await.unwrap();
    assert_eq!(
        (
            never.heartbeat_age,
            never.caught_up_age,
            never.lag_bytes,
            never.blocked
        ),
        (None, None, 0, false)
    );
    tx.record_heartbeat(&Heartbeat {
        caught_up: false,
        lag_bytes: 5,
    })
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let behind = tx.capture_health().await.unwrap();
    assert!(
        behind
            .heartbeat_age
            .is_some_and(|a| a < Duration::from_secs(5))
    );
    assert_eq!((behind.caught_up_age, behind.lag_bytes), (None, 5));
    tx.record_heartbeat(&Heartbeat {
        caught_up: true,
        lag_bytes: 0,
    })
    .await
    .unwrap();
    let caught_up = tx.capture_health().await.unwrap();
    assert!(
        caught_up
            .caught_up_age
            .is_some_and(|a| a < Duration::from_secs(5))
    );
    assert_eq!(caught_up.lag_bytes, 0);
    tx.commit().await.unwrap();

    let manifest = Manifest::new(
        1,
        None,
        protocol::manifest::TransitionClass::Initial,
        1,
        example_config(|s| s).table_manifests().unwrap(),
    )
    .unwrap();
    let table = manifest.table("tbl_templates").unwrap();
    let key = decode_key(PortableType::String, &Value::string("tpl-1")).unwrap();
    let identity = protocol::digest::RowIdentity::of(table, &key);
    let row = json::parse(
        br#"{"fld_templates_body":"b","fld_templates_id":"tpl-1","fld_templates_name":"n"}"#,
    )
    .unwrap();
    let projection = |version: &str, scopes: &[&str]| Projection {
        table_id: "tbl_templates".into(),
        identity: identity.clone(),
        key: "tpl-1".into(),
        row: row.clone(),
        version: ServerVersion::parse(version).unwrap(),
        digest: Digest([7; 32]),
        schema_version: 1,
        tombstone: false,
        scopes: scopes.iter().map(|s| ScopeId::parse(s).unwrap()).collect(),
    };
    let scope = ScopeId::parse("templates_public").unwrap();
    let effect = |lsn: u64, op: EffectOp| Effect {
        scope: scope.clone(),
        commit_lsn: lsn,
        event_ordinal: 0,
        effect_ordinal: 0,
        table_id: "tbl_templates".into(),
        identity: identity.clone(),
        key: Value::string("tpl-1"),
        op,
    };
    let captured = CapturedRow {
        row: json::to_canonical_string(&row),
        version: ServerVersion::parse("v1").unwrap(),
        digest: Digest([7; 32]),
        schema_version: Some(1),
    };
    // A delete without a row still carries the version the row had.
    let removed = ServerVersion::parse("v2").unwrap();
    let share = DependencyRow {
        relation: "public.note_shares".into(),
        identity: r#"{"note_id":"n1","team_id":"red"}"#.into(),
        image: [("note_id", "n1"), ("team_id", "red")]
            .iter()
            .map(|(c, v)| ((*c).to_owned(), Some((*v).to_owned())))
            .collect(),
    };
    let at = |lsn: u64| Materialization {
        commit_lsn: lsn,
        end_lsn: lsn + 8,
        transactions: vec![MaterializedTransaction {
            commit_lsn: lsn,
            end_lsn: lsn + 8,
            row_events: 1,
        }],
        stream_generation: 1, // a fresh store's
        ..Materialization::default()
    };

    // Fresh: generation start, nothing stored.
    let mut tx = store.begin().await.unwrap();
    let p = tx.capture_progress().await.unwrap();
    assert_eq!(
        (p.boundary, p.end_lsn, p.quarantine),
        (Boundary::GenerationStart, 0, None)
    );
    assert!(
        tx.projections("tbl_templates", std::slice::from_ref(&identity))
            .await
            .unwrap()
            .is_empty()
    );
    tx.commit().await.unwrap();

    // A materialization writes everything and moves progress.
    let member = Membership {
        scope: ScopeId::parse("templates_public").unwrap(),
        table_id: "tbl_templates".into(),
        identity: identity.clone(),
    };
    let mut first = at(100);
    first
        .new_projections
        .push(projection("v1", &["templates_public"]));
    first.joined.push(member.clone());
    first.put_dependencies.push(share.clone());
    first
        .effects
        .push(effect(100, EffectOp::Upsert(captured.clone())));
    // A baseline chunk stores no effects (ADR 0033): one carrying any is refused.
    let mut tx = store.begin().await.unwrap();
    let baseline = Materialization {
        baseline: true,
        ..first.clone()
    };
    assert!(
        matches!(
            tx.materialize(&baseline).await,
            Err(StoreError::Integrity(_))
        ),
        "a baseline chunk with an effect"
    );
    drop(tx);
    let mut tx = store.begin().await.unwrap();
    tx.materialize(&first).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let p = tx.capture_progress().await.unwrap();
    assert_eq!(
        (p.boundary, p.end_lsn),
        (Boundary::TransactionEnd { commit_lsn: 100 }, 108)
    );
    assert_eq!(
        tx.projections("tbl_templates", std::slice::from_ref(&identity))
            .await
            .unwrap(),
        [projection("v1", &["templates_public"])]
    );
    // The membership index: the scope's rows with their digests.
    assert_eq!(
        tx.scope_members(&scope).await.unwrap(),
        [(identity.clone(), Digest([7; 32]))]
    );
    assert!(
        tx.scope_members(&ScopeId::parse("elsewhere").unwrap())
            .await
            .unwrap()
            .is_empty()
    );
    // Digests under another manifest are found, by scope.
    assert!(!tx.has_stale_projections(1).await.unwrap());
    assert!(tx.has_stale_projections(2).await.unwrap());
    // A digest under a newer manifest than the asked one is stale too
    // (a process started with an older config).
    assert!(tx.has_stale_projections(0).await.unwrap());
    assert_eq!(
        tx.stale_scope_members(&scope, 2).await.unwrap(),
        [projection("v1", &["templates_public"])]
    );
    assert!(tx.stale_scope_members(&scope, 1).await.unwrap().is_empty());
    assert!(
        tx.stale_scope_members(&ScopeId::parse("elsewhere").unwrap(), 2)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        tx.dependency_rows_by_identity(
            "public.note_shares",
            &[share.identity.clone(), "{}".into()]
        )
        .await
        .unwrap(),
        std::slice::from_ref(&share)
    );
    assert_eq!(
        tx.dependency_rows("public.note_shares", "note_id", &["n1".into(), "n2".into()])
            .await
            .unwrap(),
        std::slice::from_ref(&share)
    );
    assert!(
        tx.dependency_rows("public.note_shares", "team_id", &["n1".into()])
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        tx.scope_effects(
            &scope,
            StreamPosition::GenerationStart,
            Boundary::TransactionEnd { commit_lsn: 100 }
        )
        .await
        .unwrap(),
        [effect(100, EffectOp::Upsert(captured.clone()))]
    );
    // Position bounds: after the effect, or through an earlier boundary, nothing.
    assert!(
        tx.scope_effects(
            &scope,
            effect(100, EffectOp::Remove(removed.clone())).position(),
            Boundary::TransactionEnd { commit_lsn: 100 }
        )
        .await
        .unwrap()
        .is_empty()
    );
    assert!(
        tx.scope_effects(
            &scope,
            StreamPosition::GenerationStart,
            Boundary::TransactionEnd { commit_lsn: 99 }
        )
        .await
        .unwrap()
        .is_empty()
    );
    tx.commit().await.unwrap();

    // Each write the prior state forbids fails as an integrity failure and writes nothing.
    let mut twice = at(200);
    twice.new_projections.push(projection("v2", &[]));
    let mut absent = at(200);
    absent.removed_projections.push((
        "tbl_templates".into(),
        protocol::digest::RowIdentity::from_bytes(vec![1]),
    ));
    let mut replaced_absent = at(200);
    let mut other = projection("v2", &[]);
    other.identity = protocol::digest::RowIdentity::from_bytes(vec![2]);
    replaced_absent.put_projections.push(other);
    let mut same_position = at(200);
    same_position
        .effects
        .push(effect(200, EffectOp::Remove(removed.clone())));
    same_position
        .effects
        .push(effect(200, EffectOp::Remove(removed.clone())));
    let mut tx_twice = at(200);
    tx_twice.transactions.push(tx_twice.transactions[0]);
    let mut past_progress = at(200);
    past_progress
        .effects
        .push(effect(300, EffectOp::Remove(removed.clone())));
    // Progress advances, but the row's effect in the scope is earlier
    // than the one stored at 100: it cannot replace a later one.
    let mut earlier_effect = at(200);
    earlier_effect
        .effects
        .push(effect(50, EffectOp::Remove(removed.clone())));
    let mut progress_elsewhere = at(200);
    progress_elsewhere.commit_lsn = 250;
    let mut joined_twice = at(200);
    joined_twice.joined.push(member.clone());
    let mut left_absent = at(200);
    left_absent.left.push(Membership {
        scope: ScopeId::parse("elsewhere").unwrap(),
        ..member.clone()
    });
    for (what, m) in [
        ("joining a scope the row is in", joined_twice),
        ("leaving a scope the row is not in", left_absent),
        ("progress does not advance", at(100)),
        ("a new projection that exists", twice),
        ("removing an absent projection", absent),
        ("replacing an absent projection", replaced_absent),
        ("two effects at one position", same_position),
        ("one source transaction twice", tx_twice),
        ("an effect past the group's progress", past_progress),
        (
            "an effect earlier than its row's stored one",
            earlier_effect,
        ),
        (
            "progress other than the last transaction's",
            progress_elsewhere,
        ),
    ] {
        let mut tx = store.begin().await.unwrap();
        let r = tx.materialize(&m).await;
        assert!(matches!(r, Err(StoreError::Integrity(_))), "{what}: {r:?}");
        drop(tx);
        let mut tx = store.begin().await.unwrap();
        assert_eq!(
            tx.capture_progress().await.unwrap().end_lsn,
            108,
            "{what}: nothing written"
        );
        tx.commit().await.unwrap();
    }

    // Replacing, removing, and a quarantine that the next materialization clears.
    let mut second = at(300);
    second.put_projections.push(projection("v2", &[]));
    second.left.push(member.clone());
    second
        .removed_dependencies
        .push(("public.note_shares".into(), share.identity.clone()));
    second
        .effects
        .push(effect(300, EffectOp::Remove(removed.clone())));
    // A leader of another stream generation (a reset ran since it read its
    // progress) blocks nothing.
    let mut tx = store.begin().await.unwrap();
    let generation = tx.stream_state().await.unwrap().generation;
    let q = Quarantine {
        commit_lsn: 250,
        problem: CaptureProblem::Truncate,
    };
    assert!(matches!(
        tx.quarantine(&q, generation + 1).await,
        Err(StoreError::Unavailable(_))
    ));
    drop(tx);
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.capture_progress().await.unwrap().quarantine, None);
    tx.quarantine(&q, generation).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    assert!(
        tx.capture_health().await.unwrap().blocked,
        "a quarantine blocks"
    );
    let q = tx.capture_progress().await.unwrap().quarantine;
    assert_eq!(
        q,
        Some(Quarantine {
            commit_lsn: 250,
            problem: CaptureProblem::Truncate
        })
    );
    tx.materialize(&second).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let p = tx.capture_progress().await.unwrap();
    assert_eq!(
        (p.boundary, p.quarantine),
        (Boundary::TransactionEnd { commit_lsn: 300 }, None)
    );
    let stored = tx
        .projections("tbl_templates", std::slice::from_ref(&identity))
        .await
        .unwrap();
    assert_eq!(stored[0].scopes, BTreeSet::new());
    assert!(
        tx.scope_members(&scope).await.unwrap().is_empty(),
        "a row that left its scope is no member"
    );
    assert!(
        tx.dependency_rows("public.note_shares", "note_id", &["n1".into()])
            .await
            .unwrap()
            .is_empty()
    );
    let all = tx
        .scope_effects(
            &scope,
            StreamPosition::GenerationStart,
            Boundary::TransactionEnd { commit_lsn: 300 },
        )
        .await
        .unwrap();
    // The removal supersedes the row's upsert in the scope, which is
    // deleted with it: a store keeps only each row's last effect.
    assert_eq!(all, [effect(300, EffectOp::Remove(removed.clone()))]);
    let mut third = at(400);
    third
        .removed_projections
        .push(("tbl_templates".into(), identity.clone()));
    tx.materialize(&third).await.unwrap();
    assert!(
        tx.projections("tbl_templates", std::slice::from_ref(&identity))
            .await
            .unwrap()
            .is_empty()
    );
    tx.materialize(&at(450)).await.unwrap();
    tx.commit().await.unwrap();

    // The stream reset: a new generation, nothing of the old one, a
    // baseline owed; a write of the old generation is refused.
    let mut tx = store.begin().await.unwrap();
    let before = tx.stream_state().await.unwrap().generation;
    assert_eq!(tx.reset_stream().await.unwrap(), before + 1);
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.stream_state().await.unwrap().generation, before + 1);
    let p = tx.capture_progress().await.unwrap();
    assert_eq!(
        (p.boundary, p.end_lsn, p.quarantine, p.baseline_owed),
        (Boundary::GenerationStart, 0, None, true)
    );
    assert!(tx.capture_health().await.unwrap().blocked);
    assert!(tx.scope_members(&scope).await.unwrap().is_empty());
    assert!(
        tx.scope_effects(
            &scope,
            StreamPosition::GenerationStart,
            Boundary::TransactionEnd { commit_lsn: 500 }
        )
        .await
        .unwrap()
        .is_empty()
    );
    assert!(
        tx.dependency_rows_by_identity("public.note_shares", std::slice::from_ref(&share.identity))
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        matches!(
            tx.materialize(&at(500)).await,
            Err(StoreError::Unavailable(_))
        ),
        "a write of the old generation"
    );
    drop(tx);
    let mut tx = store.begin().await.unwrap();
    let mut current = at(500);
    current.stream_generation = before + 1;
    tx.materialize(&current).await.unwrap();
    drop(tx); // rolled back

    // The new baseline in chunks (ADR 0030): chunks commit in order, and
    // it is handed over only once a chunk of it committed, only once; the
    // hand-over lifts a chunk's quarantine.
    let integrity = |r: Result<(), StoreError>| matches!(r, Err(StoreError::Integrity(_)));
    let mut tx = store.begin().await.unwrap();
    assert!(
        integrity(tx.record_baseline_chunk(1).await),
        "chunk 1 first"
    );
    assert!(
        integrity(tx.hand_over_baseline().await),
        "a hand-over before any chunk committed"
    );
    drop(tx);
    let mut tx = store.begin().await.unwrap();
    tx.record_baseline_chunk(0).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    assert!(
        integrity(tx.record_baseline_chunk(0).await),
        "chunk 0 twice"
    );
    drop(tx);
    let mut tx = store.begin().await.unwrap();
    let chunk_problem = Quarantine {
        commit_lsn: 1,
        problem: crate::capture::CaptureProblem::InvalidValue,
    };
    tx.quarantine(&chunk_problem, before + 1).await.unwrap();
    tx.hand_over_baseline().await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let p = tx.capture_progress().await.unwrap();
    assert_eq!((p.baseline_owed, p.quarantine), (false, None));
    assert!(
        integrity(tx.hand_over_baseline().await),
        "handed over twice"
    );
    assert!(
        integrity(tx.record_baseline_chunk(1).await),
        "a chunk after the hand-over"
    );
    drop(tx);
}
