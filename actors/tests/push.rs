//! The push suite on the in-memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::store::MemStore;
use actors::testkit::{MemWorld, push_suite};

#[tokio::test]
async fn every_push_outcome_on_memstore() {
    push_suite(&MemWorld {
        store: MemStore::new(),
    })
    .await;
}

#[tokio::test]
async fn push_primitives_conformance() {
    actors::testkit::push_store_suite(&MemStore::new()).await;
}
