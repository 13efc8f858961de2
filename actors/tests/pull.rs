//! The pull suite on the in-memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::store::MemStore;
use actors::testkit::{MemWorld, example_mem_store, pull_suite};

#[tokio::test]
async fn pull_pages_cursors_and_checksums() {
    pull_suite(&MemWorld {
        store: example_mem_store(7).await,
    })
    .await;
}

#[tokio::test]
async fn pull_state_conformance() {
    actors::testkit::pull_store_suite(&actors::store::MemStore::new()).await;
}

/// A pull that fails after its writes, at commit, commits nothing: no
/// acknowledgement and no assignment change; its retry (four attempts)
/// answers 503, and the next pull does both.
#[tokio::test]
async fn a_pull_that_fails_at_commit_writes_nothing() {
    use actors::Engine;
    use actors::store::{Store, StoreTx};
    use actors::testkit::{CaptureWorld, PullClient, Write, pull_note, push_config};
    use protocol::json::Value;

    let world = MemWorld {
        store: example_mem_store(9).await,
    };
    let store = world.store.clone();
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    let mut c = PullClient::connect(&store, &engine, "fm-u", "fm-c").await;
    c.sync(10).await;
    let n = pull_note(1);
    let row = [
        ("id", Some(n.as_str())),
        ("owner_id", Some("fm-u")),
        ("title", Some("t")),
        ("body", None),
        ("pinned", Some("f")),
        ("updated_at", Some("2026-07-18 14:00:01.5+00")),
        ("deleted_at", None),
    ];
    world.write(&[Write::Insert("public.notes", &row)]).await;
    // Once it is captured, one pull delivers it with a new cursor.
    let mut delivered = 0;
    for _ in 0..500 {
        delivered += c.pull(10).await.changes;
        if delivered > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(delivered, 1);
    world.grant("fm-u", "team:fm", true).await;
    let acknowledged = c.checkpoints().await;
    let version = |store: MemStore| async move {
        let mut tx = store.begin().await.unwrap();
        tx.lock_client("fm-c")
            .await
            .unwrap()
            .unwrap()
            .scope_set_version
    };
    let before = version(store.clone()).await;
    store.fail_checkpoint_commits(4);
    let (s, v, retry_after) = c.send(c.body(10)).await;
    assert_eq!(s, 503, "{v:?}");
    assert_eq!(
        v.as_object().unwrap()["error"].as_object().unwrap()["code"],
        Value::string("temporary_unavailable")
    );
    assert_eq!(retry_after, Some(5));
    assert_eq!(c.checkpoints().await, acknowledged, "nothing acknowledged");
    assert_eq!(
        version(store.clone()).await,
        before,
        "no assignment written"
    );
    // The same request again: acknowledged, and the scope added.
    let a = c.pull(10).await;
    assert_eq!(a.rebuild, ["team:fm"]);
    assert_eq!(version(store.clone()).await, before + 1);
    assert_ne!(
        c.checkpoints().await,
        acknowledged,
        "the cursor acknowledged"
    );
}
