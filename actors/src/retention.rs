//! Retention (docs/adr/0024): the stream's floor follows the clients, and
//! what no pull can serve any more is deleted below it.
//!
//! - The floor moves to the least position an active client may still
//!   present ([`StoreTx::retention_hold`]), never past the boundary an
//!   earlier pass saw (the guard: a cursor or rebuild being issued while a
//!   pass runs is not stale at once), and never back. A cursor below it is
//!   stale (`cursor::judge`), so its scope rebuilds.
//! - Below the floor, deletions and removals go in batches of
//!   `compact_batch`, one transaction each, with the records of the source
//!   transactions materialized there. Superseded effects never wait
//!   for this: the materializer deletes them as it supersedes them.
//!
//! The capture leader runs a pass every `compact_interval_seconds`
//! ([`spawn`]); `synchro compact` runs one at once.

use std::sync::Arc;

use protocol::position::{Boundary, StreamPosition};
use tokio::sync::watch;

use crate::config::RetentionConfig;
use crate::materializer::CaptureStatus;
use crate::store::{Store, StoreError, StoreTx};

/// What one pass did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Compaction {
    /// The floor after the pass.
    pub floor: StreamPosition,
    /// The floor moved in this pass.
    pub moved: bool,
    /// Effects deleted below the floor.
    pub deleted: u64,
    /// Records of source transactions below the floor forgotten.
    pub forgotten: u64,
    /// The materialized boundary when the pass began: the next pass's guard.
    pub seen: Guard,
}

/// A boundary an earlier pass saw, in its stream generation: the floor
/// never passes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Guard {
    pub generation: u64,
    pub boundary: Boundary,
}

/// One pass: moves the floor (not past `guard`; not at all without one),
/// then deletes below it until nothing removable is left. `on_batch` hears
/// the running count after each batch.
pub async fn compact<S: Store>(
    store: &S,
    config: &RetentionConfig,
    guard: Option<Guard>,
    mut on_batch: impl FnMut(u64),
) -> Result<Compaction, StoreError> {
    let mut tx = store.begin().await?;
    let stream = tx.stream_state().await?;
    let boundary = tx.capture_progress().await?.boundary;
    let mut floor = stream.floor;
    // A guard of an earlier stream generation (a reset since) guards nothing.
    if let Some(guard) = guard.filter(|g| g.generation == stream.generation) {
        assert!(
            guard.boundary <= boundary,
            "the materialized boundary only moves forward"
        );
        let guard = StreamPosition::from(guard.boundary);
        let hold = tx
            .retention_hold(stream.generation, config.window())
            .await?;
        let candidate = hold.map_or(guard, |h| h.min(guard));
        if candidate > floor {
            tx.advance_floor(candidate).await?;
            floor = candidate;
        }
    }
    assert!(
        floor <= StreamPosition::from(boundary),
        "the floor never passes the boundary"
    );
    tx.commit().await?;
    let moved = floor != stream.floor;
    let (mut deleted, mut forgotten_total) = (0u64, 0u64);
    loop {
        let mut tx = store.begin().await?;
        let n = tx.compact_below_floor(config.compact_batch).await?;
        let forgotten = tx
            .forget_transactions_below_floor(config.compact_batch)
            .await?;
        tx.commit().await?;
        assert!(
            n <= config.compact_batch && forgotten <= config.compact_batch,
            "a batch never exceeds its limit"
        );
        deleted += n as u64;
        forgotten_total += forgotten as u64;
        on_batch(deleted);
        if n < config.compact_batch && forgotten < config.compact_batch {
            break;
        }
        // Let capture and pulls in between batches.
        tokio::task::yield_now().await;
    }
    Ok(Compaction {
        floor,
        moved,
        deleted,
        forgotten: forgotten_total,
        seen: Guard {
            generation: stream.generation,
            boundary,
        },
    })
}

/// Runs a pass every `compact_interval_seconds` while this process leads
/// capture (`status` is `Running`). The guard of each pass is the boundary
/// the previous one saw, so the floor trails by one interval. The task
/// ends when the returned handle drops (with the engine), and lets go of
/// `status` then, so that the materializer, too, sees the engine gone.
pub fn spawn<S: Store>(
    store: S,
    config: RetentionConfig,
    mut status: watch::Receiver<CaptureStatus>,
) -> Running {
    let (running, mut stop) = watch::channel(());
    tokio::spawn(async move {
        let mut guard: Option<Guard> = None;
        loop {
            tokio::select! {
                biased;
                _ = stop.changed() => return,
                _ = tokio::time::sleep(config.interval()) => {}
            }
            if !matches!(*status.borrow_and_update(), CaptureStatus::Running { .. }) {
                guard = None;
                continue;
            }
            match compact(&store, &config, guard, |_| {}).await {
                Ok(c) => {
                    if c.moved || c.deleted > 0 {
                        tracing::info!(
                            floor = ?c.floor,
                            deleted = c.deleted,
                            "retention: floor moved and effects compacted"
                        );
                    }
                    guard = Some(c.seen);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "retention: compaction failed; retrying next interval");
                    guard = None;
                }
            }
        }
    });
    Running {
        _stop: Arc::new(running),
    }
}

/// Keeps the retention task running while any clone lives.
#[derive(Clone, Debug)]
pub struct Running {
    _stop: Arc<watch::Sender<()>>,
}
