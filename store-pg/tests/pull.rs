//! Pull on a throwaway cluster: the pull suite (as on MemStore), in
//! REPEATABLE READ snapshots, against the real materializer.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::testkit::pull_suite;
use store_pg::cluster::PgCluster;
use store_pg::{PgWorld, example_store};

#[tokio::test]
async fn every_pull_rule_on_postgres() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let cluster = PgCluster::temp().unwrap();
    let world = PgWorld {
        store: example_store(&cluster, "pull").await,
    };
    pull_suite(&world).await;
}

/// A pull waiting for its client's push holds none of a pool of one.
#[tokio::test]
async fn a_pull_waits_for_capture_without_a_connection() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "pull_wait").await;
    actors::testkit::a_pull_waits_for_its_own_writes(&store, &store.with_connections(1)).await;
}

/// A process that does not lead capture hears the leader's commits
/// through `LISTEN` (ADR 0028).
#[tokio::test]
async fn a_standby_hears_the_leaders_fence_reports() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "pull_standby").await;
    actors::testkit::a_standby_hears_the_leaders_fence_reports(&store).await;
}

#[tokio::test]
async fn pull_state_conformance() {
    let cluster = PgCluster::temp().unwrap();
    actors::testkit::pull_store_suite(&example_store(&cluster, "pull_conformance").await).await;
}

/// A captured row the current manifest cannot represent is a 500
/// `sync_integrity_failure` (never an omitted change), and latches readiness.
#[tokio::test]
async fn an_unrepresentable_row_is_an_integrity_failure() {
    use actors::Engine;
    use actors::testkit::{PullClient, Write, pull_note, push_config};
    let cluster = PgCluster::temp().unwrap();
    let world = PgWorld {
        store: example_store(&cluster, "pull_integrity").await,
    };
    let engine = Engine::start(world.store.clone(), push_config())
        .await
        .unwrap();
    actors::testkit::stream_begun(&world.store).await;
    let mut c = PullClient::connect(&world.store, &engine, "iu", "ic").await;
    c.sync(10).await;
    let n = pull_note(1);
    let row = [
        ("id", Some(n.as_str())),
        ("owner_id", Some("iu")),
        ("title", Some("t")),
        ("body", None),
        ("pinned", Some("f")),
        ("updated_at", Some("2026-07-18 14:00:01.5+00")),
        ("deleted_at", None),
    ];
    use actors::testkit::CaptureWorld;
    world.write(&[Write::Insert("public.notes", &row)]).await;
    // Wait for its effect, then break the captured row behind the server's back.
    for _ in 0..500 {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM synchro.scope_effects WHERE scope_id = 'user:iu'",
        )
        .fetch_one(world.store.pool())
        .await
        .unwrap();
        if n > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // The effect serves its projection's row (ADR 0037); an older schema
    // version makes pull judge the row under the current manifest.
    sqlx::query(
        "UPDATE synchro.projections p SET row_json = '{\"fld_notes_id\":1}', schema_version = 0 \
         FROM synchro.scope_effects e \
         WHERE e.scope_id = 'user:iu' AND p.table_id = e.table_id AND p.identity = e.identity",
    )
    .execute(world.store.pool())
    .await
    .unwrap();
    let (s, v, _) = c.send(c.body(10)).await;
    assert_eq!(s, 500, "{v:?}");
    assert_eq!(
        v.as_object().unwrap()["error"].as_object().unwrap()["code"],
        protocol::json::Value::string("sync_integrity_failure")
    );
    assert!(engine.integrity_failed(), "readiness latched off");
}

/// A pull's transaction is one snapshot: a materialization that commits
/// while it is open changes nothing it reads (progress, candidates,
/// members), and the next snapshot sees all of it.
#[tokio::test]
async fn a_pull_snapshot_sees_one_state() {
    use actors::Engine;
    use actors::store::{Store, StoreTx};
    use actors::testkit::{CaptureWorld, Write, note_row, pull_note, push_config};
    use protocol::ids::ScopeId;
    let cluster = PgCluster::temp().unwrap();
    let world = PgWorld {
        store: example_store(&cluster, "pull_snapshot").await,
    };
    let _engine = Engine::start(world.store.clone(), push_config())
        .await
        .unwrap();
    let store = &world.store;
    // A write before the stream begins is in the baseline, which has no
    // effects (ADR 0033): this test reads effects.
    actors::testkit::stream_begun(store).await;
    let scope = ScopeId::parse("user:su").unwrap();
    let settled_past = |before: actors::capture::CaptureProgress| async move {
        for _ in 0..1000 {
            let mut tx = store.begin().await.unwrap();
            let p = tx.capture_progress().await.unwrap();
            if p.boundary != before.boundary {
                return p;
            }
            drop(tx);
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        panic!("capture did not move");
    };
    let start = store
        .begin()
        .await
        .unwrap()
        .capture_progress()
        .await
        .unwrap();
    let first = pull_note(1);
    world
        .write(&[Write::Insert(
            "public.notes",
            &note_row(&first, "su", "one"),
        )])
        .await;
    let one = settled_past(start).await;
    let one_boundary = one.boundary;

    let mut snapshot = store.begin_snapshot().await.unwrap();
    let seen = snapshot.capture_progress().await.unwrap();
    assert_eq!(seen.boundary, one_boundary);
    let before = pull_state(&mut snapshot, &scope, seen.boundary).await;
    assert_eq!((before.0.len(), before.1.len()), (1, 1));
    // Another row, and a change of the first, commit meanwhile.
    world
        .write(&[
            Write::Insert("public.notes", &note_row(&pull_note(2), "su", "two")),
            Write::Update(
                "public.notes",
                &[("id", first.as_str())],
                &[("title", Some("changed"))],
            ),
        ])
        .await;
    let two = settled_past(one).await;
    assert_eq!(
        snapshot.capture_progress().await.unwrap().boundary,
        one_boundary
    );
    assert_eq!(
        pull_state(&mut snapshot, &scope, seen.boundary).await,
        before,
        "the snapshot is unchanged"
    );
    snapshot.commit().await.unwrap();

    let mut next = store.begin_snapshot().await.unwrap();
    assert_eq!(
        next.capture_progress().await.unwrap().boundary,
        two.boundary
    );
    let after = pull_state(&mut next, &scope, two.boundary).await;
    assert_eq!((after.0.len(), after.1.len()), (2, 2), "{after:?}");
    assert_ne!(after.1, before.1);
}

/// What a pull reads of one scope at `boundary`: its candidates and members.
async fn pull_state(
    tx: &mut store_pg::PgTx,
    scope: &protocol::ids::ScopeId,
    boundary: protocol::position::Boundary,
) -> (
    Vec<actors::capture::Effect>,
    Vec<(protocol::digest::RowIdentity, protocol::digest::Digest)>,
) {
    use actors::store::StoreTx;
    let start = protocol::position::StreamPosition::GenerationStart;
    let candidates = tx
        .scope_candidates(scope, start, boundary, 10)
        .await
        .unwrap();
    (candidates, tx.scope_members(scope).await.unwrap())
}

#[tokio::test]
async fn rebuild_on_postgres() {
    let cluster = PgCluster::temp().unwrap();
    let world = PgWorld {
        store: example_store(&cluster, "rebuild").await,
    };
    actors::testkit::rebuild_suite(&world).await;
}

#[tokio::test]
async fn rebuild_state_conformance() {
    let cluster = PgCluster::temp().unwrap();
    actors::testkit::rebuild_store_suite(&example_store(&cluster, "rebuild_conformance").await)
        .await;
}
