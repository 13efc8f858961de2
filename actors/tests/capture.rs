//! The capture suite on the in-memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::store::MemStore;
use actors::testkit::{
    HandOver, MemWorld as Mem, capture_suite, invalid_owners, repair_resumes, truncate_blocks,
};

#[tokio::test]
async fn direct_writes_become_per_scope_effects() {
    capture_suite(&Mem {
        store: MemStore::new(),
    })
    .await;
}

#[tokio::test]
async fn a_repair_resumes_capture_from_the_blocked_transaction() {
    for owner in invalid_owners() {
        let world = Mem {
            store: MemStore::new(),
        };
        repair_resumes(&world, &owner).await;
    }
}

#[tokio::test]
async fn capture_state_conformance() {
    actors::testkit::capture_store_suite(&MemStore::new()).await;
}

#[tokio::test]
async fn truncate_blocks_capture() {
    truncate_blocks(&Mem {
        store: MemStore::new(),
    })
    .await;
}

#[tokio::test]
async fn a_lost_slot_blocks_capture() {
    actors::testkit::slot_loss_blocks(&Mem {
        store: actors::testkit::example_mem_store(5).await,
    })
    .await;
}

#[tokio::test]
async fn existing_rows_arrive_as_the_baseline() {
    actors::testkit::baseline_adopts_existing_rows(&Mem {
        store: actors::testkit::example_mem_store(6).await,
    })
    .await;
}

#[tokio::test]
async fn a_baseline_cut_short_is_handed_over() {
    for (seed, how) in [(16, HandOver::Crash), (17, HandOver::SnapshotLimit)] {
        let world = Mem {
            store: actors::testkit::example_mem_store(seed).await,
        };
        actors::testkit::baseline_cut_short_is_handed_over(&world, how).await;
    }
}

#[tokio::test]
async fn a_stream_reset_recovers_a_lost_slot() {
    actors::testkit::stream_reset_recovers(
        &Mem {
            store: actors::testkit::example_mem_store(7).await,
        },
        actors::testkit::Broken::SlotLost,
    )
    .await;
}

#[tokio::test]
async fn a_stream_reset_recovers_a_poisoned_transaction() {
    actors::testkit::stream_reset_recovers(
        &Mem {
            store: actors::testkit::example_mem_store(8).await,
        },
        actors::testkit::Broken::Poisoned,
    )
    .await;
}

#[tokio::test]
async fn a_config_change_rematerializes_its_relations() {
    let world = Mem {
        store: actors::testkit::example_mem_store(7).await,
    };
    actors::testkit::rematerialization_suite(&world).await;
}

#[tokio::test]
async fn an_older_leader_gives_way_to_a_newer_config() {
    let world = Mem {
        store: actors::testkit::example_mem_store(9).await,
    };
    actors::testkit::an_older_leader_gives_way(&world).await;
}
