//! Retention on a throwaway cluster: the retention suite (as on MemStore).
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::testkit::retention_suite;
use store_pg::cluster::PgCluster;
use store_pg::{PgWorld, example_store};

#[tokio::test]
async fn the_floor_follows_the_clients_and_compaction_changes_no_page_on_postgres() {
    let cluster = PgCluster::temp().unwrap();
    let world = PgWorld {
        store: example_store(&cluster, "retention").await,
    };
    retention_suite(&world).await;
}
