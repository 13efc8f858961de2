//! The capture suite on the in-memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::capture::{Lsn, SourceImage};
use actors::store::{MemStore, Store, StoreTx};
use actors::testkit::{CaptureWorld, Write, capture_suite, repair_resumes, truncate_blocks};

struct Mem {
    store: MemStore,
}

fn image(columns: &[(&str, Option<&str>)]) -> SourceImage {
    columns
        .iter()
        .map(|(c, v)| ((*c).to_owned(), v.map(str::to_owned)))
        .collect()
}

fn key(columns: &[(&str, &str)]) -> SourceImage {
    columns
        .iter()
        .map(|(c, v)| ((*c).to_owned(), Some((*v).to_owned())))
        .collect()
}

impl CaptureWorld for Mem {
    type S = MemStore;

    fn store(&self) -> &MemStore {
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
                    tx.source_update(r, &key(k), image(changes)).unwrap();
                }
                Write::Delete(r, k) => {
                    tx.source_delete(r, &key(k)).unwrap();
                }
                Write::Truncate(r) => tx.source_truncate(r).unwrap(),
            }
        }
        tx.commit().await.unwrap();
        before + 1
    }
}

#[tokio::test]
async fn direct_writes_become_per_scope_effects() {
    capture_suite(&Mem {
        store: MemStore::new(),
    })
    .await;
}

#[tokio::test]
async fn a_repair_resumes_capture_from_the_blocked_transaction() {
    repair_resumes(&Mem {
        store: MemStore::new(),
    })
    .await;
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
