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
