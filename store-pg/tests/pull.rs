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
    sqlx::query("UPDATE synchro.scope_effects SET row_json = '{\"fld_notes_id\":1}', schema_version = NULL WHERE scope_id = 'user:iu'")
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
