//! The pull suite on the in-memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::testkit::{MemWorld, example_mem_store, pull_suite};

#[tokio::test]
async fn pull_pages_cursors_and_checksums() {
    pull_suite(&MemWorld {
        store: example_mem_store(7).await,
    })
    .await;
}

#[tokio::test]
async fn a_pull_waits_for_capture() {
    let store = example_mem_store(13).await;
    actors::testkit::a_pull_waits_for_its_own_writes(&store, &store).await;
}

#[tokio::test]
async fn a_standby_hears_the_leaders_fence_reports() {
    let store = example_mem_store(17).await;
    actors::testkit::a_standby_hears_the_leaders_fence_reports(&store).await;
}

/// The planted bug: commits tell no listener. The standby's pull then
/// waits for its own bound, and the scenario fails.
#[tokio::test]
#[should_panic(expected = "woken by the leader's report")]
async fn a_standby_that_hears_nothing_is_caught() {
    let store = example_mem_store(19).await;
    store.plant_fence_reports_withheld();
    actors::testkit::a_standby_hears_the_leaders_fence_reports(&store).await;
}

#[tokio::test]
async fn pull_state_conformance() {
    actors::testkit::pull_store_suite(&actors::store::MemStore::new()).await;
}

#[tokio::test]
async fn rebuild_sessions_and_pages() {
    actors::testkit::rebuild_suite(&MemWorld {
        store: example_mem_store(11).await,
    })
    .await;
}

#[tokio::test]
async fn rebuild_state_conformance() {
    actors::testkit::rebuild_store_suite(&actors::store::MemStore::new()).await;
}
