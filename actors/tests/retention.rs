//! The retention suite on the in-memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::testkit::{MemWorld, example_mem_store, retention_suite};

#[tokio::test]
async fn the_floor_follows_the_clients_and_compaction_changes_no_page() {
    retention_suite(&MemWorld {
        store: example_mem_store(17).await,
    })
    .await;
}
