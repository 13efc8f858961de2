//! The stream's lifecycle (ADR 0010): a lost replication slot blocks
//! capture and is never repaired silently, not even by a restart.

use std::time::Duration;

use protocol::json::{self, Value};
use protocol::position::Boundary;

use super::capture::ready_becomes;
use super::pull::{PullClient, note_row, pull_note};
use super::push::push_config;
use super::transport::{Node, Route};
use super::{CaptureWorld, Write};
use crate::Engine;
use crate::capture::{CaptureProblem, Lsn};
use crate::materializer::CaptureStatus;
use crate::store::{Store, StoreTx};

/// The slot is dropped behind the server's back: capture blocks with
/// `slot_lost`, readiness goes false, pull and rebuild answer `503
/// capture_blocked`, no commit after the loss is materialized, and a
/// restart does not create the slot again. The world must be fresh.
pub async fn slot_loss_blocks<W: CaptureWorld>(world: &W) {
    let store = world.store().clone();
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    let node = Node::from(&engine);
    let before = note(world, 900).await;
    progress_reaches(&store, before).await;
    let mut c = PullClient::connect(&store, &node, "sl-u", "sl-c").await;
    c.sync(10).await;
    assert_eq!(c.replica.scopes["user:sl-u"].rows.len(), 1);
    ready_becomes(&engine, true, "capture runs").await;

    world.lose_slot().await;
    let after = note(world, 901).await;
    ready_becomes(&engine, false, "the slot is lost").await;
    blocked(&engine).await;
    let unavailable = |status: u16, body: &[u8], retry_after: Option<u32>| {
        let v = json::parse(body).unwrap();
        let e = v.as_object().unwrap()["error"].as_object().unwrap().clone();
        assert_eq!(
            (status, e["code"].clone(), e["reason"].clone(), retry_after),
            (
                503,
                Value::string("temporary_unavailable"),
                Value::string("capture_blocked"),
                Some(5)
            )
        );
    };
    let r = c.send_raw(c.body(10)).await;
    unavailable(r.status, &r.body, r.retry_after);
    let attempt = c.new_attempt("user:sl-u");
    let r = node
        .send(Route::Rebuild, "sl-u", c.rebuild_body(&attempt, 10))
        .await;
    unavailable(r.status, &r.body, r.retry_after);
    not_materialized(&store, after).await;

    // A restart neither creates the slot again nor skips what it lost.
    drop(engine);
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    blocked(&engine).await;
    assert!(!engine.ready().await, "still not ready");
    not_materialized(&store, after).await;
}

/// A new note of user `sl-u`, committed by the application.
async fn note<W: CaptureWorld>(world: &W, n: u64) -> Lsn {
    let id = pull_note(n);
    world
        .write(&[Write::Insert("public.notes", &note_row(&id, "sl-u", "t"))])
        .await
}

/// Waits until capture has materialized everything through `lsn`.
async fn progress_reaches<S: Store>(store: &S, lsn: Lsn) {
    for _ in 0..1000 {
        let mut tx = store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        drop(tx);
        if matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn >= lsn) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("capture did not reach {lsn}");
}

/// Waits until the engine's capture is blocked by the lost slot, which the
/// store's progress records as its quarantine.
async fn blocked(engine: &Engine) {
    for _ in 0..1000 {
        if engine.capture_status() == CaptureStatus::Blocked(CaptureProblem::SlotLost) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("capture is not blocked: {:?}", engine.capture_status());
}

/// Nothing at or after `lsn` was materialized, and the quarantine names the lost slot.
async fn not_materialized<S: Store>(store: &S, lsn: Lsn) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut tx = store.begin().await.unwrap();
    let p = tx.capture_progress().await.unwrap();
    drop(tx);
    assert!(
        matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn < lsn),
        "{:?}",
        p.boundary
    );
    assert_eq!(
        p.quarantine.map(|q| q.problem),
        Some(CaptureProblem::SlotLost)
    );
}
