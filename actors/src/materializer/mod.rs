//! The materializer actor: the only path from committed source writes to
//! pull-visible state. It reads whole source transactions in commit order
//! from the store's [`ChangeFeed`](crate::capture::ChangeFeed) and commits,
//! per source transaction and atomically, projections, dependency rows,
//! per-scope effects, satisfied fences and the progress row. Only then does
//! it acknowledge the feed, so a crash anywhere replays from durable
//! progress, and a replayed transaction (at or below progress) is skipped.
//!
//! A transaction that cannot be materialized is quarantined: capture stops
//! (no log-and-skip) and is retried from the same transaction every
//! `retry`, so a repair lets it resume.

mod model;
mod step;

use std::time::Duration;

use protocol::position::Boundary;
use tokio::sync::watch;
use tokio::time::{Instant, sleep, timeout};

use crate::capture::{CaptureProblem, ChangeFeed, Quarantine};
use crate::config::SyncConfig;
use crate::store::{Store, StoreError, StoreTx};
pub(crate) use model::Model;
use step::StepError;

/// What the materializer is doing, for readiness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaptureStatus {
    /// Not yet reading.
    Starting,
    /// Another process holds leadership.
    Standby,
    /// Reading and materializing; `heartbeat` is the last time it made progress
    /// or found the feed idle.
    Running {
        heartbeat: Instant,
        boundary: Boundary,
    },
    /// A quarantined transaction blocks capture.
    Blocked(CaptureProblem),
    /// The store or the feed failed; retrying.
    Unavailable,
}

/// Finite limits of the materializer loop.
#[derive(Clone, Copy, Debug)]
pub struct MaterializerLimits {
    /// How long an idle feed waits before the loop records a heartbeat.
    pub heartbeat: Duration,
    /// The pause before reopening a failed or blocked feed.
    pub retry: Duration,
}

impl Default for MaterializerLimits {
    fn default() -> MaterializerLimits {
        MaterializerLimits {
            heartbeat: Duration::from_secs(1),
            retry: Duration::from_secs(1),
        }
    }
}

/// Starts the materializer over `store` for the config whose current
/// manifest is the store's newest one. Returns its status.
pub async fn spawn<S: Store>(
    store: S,
    config: &SyncConfig,
    limits: MaterializerLimits,
) -> Result<watch::Receiver<CaptureStatus>, String> {
    let manifest = {
        let mut tx = store.begin().await.map_err(|e| e.to_string())?;
        tx.manifests()
            .await
            .map_err(|e| e.to_string())?
            .pop()
            .ok_or("no manifest is stored")?
    };
    let model = Model::new(config, manifest)?;
    let (status, receiver) = watch::channel(CaptureStatus::Starting);
    tokio::spawn(async move {
        loop {
            match store.change_feed().await {
                Ok(Some(feed)) => {
                    if let Err(e) = lead(&store, &model, feed, limits, &status).await {
                        tracing::warn!(error = %e, "materializer: store failed; reopening the feed");
                        if !matches!(*status.borrow(), CaptureStatus::Blocked(_)) {
                            status.send_replace(CaptureStatus::Unavailable);
                        }
                    }
                }
                Ok(None) => {
                    status.send_replace(CaptureStatus::Standby);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "materializer: cannot open the change feed");
                    status.send_replace(CaptureStatus::Unavailable);
                }
            }
            if status.is_closed() {
                return;
            }
            sleep(limits.retry).await;
        }
    });
    Ok(receiver)
}

/// Materializes from `feed` until the store fails or a transaction is quarantined.
async fn lead<S: Store>(
    store: &S,
    model: &Model,
    mut feed: S::Feed,
    limits: MaterializerLimits,
    status: &watch::Sender<CaptureStatus>,
) -> Result<(), StoreError> {
    let progress = {
        let mut tx = store.begin().await?;
        tx.capture_progress().await?
    };
    // Re-advance the slot to the durable point (a crash may have come
    // between the last commit and its acknowledgement).
    feed.acknowledge(progress.end_lsn).await?;
    let mut boundary = progress.boundary;
    let mut durable_end = progress.end_lsn;
    let mut blocked = progress.quarantine.map(|q| q.problem);
    match &blocked {
        Some(p) => status.send_replace(CaptureStatus::Blocked(p.clone())),
        None => status.send_replace(CaptureStatus::Running {
            heartbeat: Instant::now(),
            boundary,
        }),
    };
    loop {
        let source = match timeout(limits.heartbeat, feed.next()).await {
            Ok(next) => next?,
            Err(_idle) => {
                if status.is_closed() {
                    return Ok(()); // the engine is gone: give up leadership
                }
                if blocked.is_none() {
                    status.send_replace(CaptureStatus::Running {
                        heartbeat: Instant::now(),
                        boundary,
                    });
                }
                continue;
            }
        };
        let done = match boundary {
            Boundary::GenerationStart => false,
            Boundary::TransactionEnd { commit_lsn } => source.commit_lsn <= commit_lsn,
        };
        if done {
            // A redelivery of a durable transaction produces nothing new.
            feed.acknowledge(durable_end).await?;
            continue;
        }
        let mut tx = store.begin().await?;
        match step::materialize(&mut tx, model, &source).await {
            Ok(m) => {
                tx.materialize(&m).await?;
                tx.commit().await?;
                boundary = Boundary::TransactionEnd {
                    commit_lsn: source.commit_lsn,
                };
                durable_end = source.end_lsn;
                blocked = None;
                feed.acknowledge(durable_end).await?;
                status.send_replace(CaptureStatus::Running {
                    heartbeat: Instant::now(),
                    boundary,
                });
            }
            Err(StepError::Store(e)) => return Err(e),
            Err(StepError::Problem(problem)) => {
                drop(tx);
                let mut tx = store.begin().await?;
                tx.quarantine(&Quarantine {
                    commit_lsn: source.commit_lsn,
                    problem: problem.clone(),
                })
                .await?;
                tx.commit().await?;
                let blocked = CaptureStatus::Blocked(problem.clone());
                if *status.borrow() != blocked {
                    tracing::error!(
                        class = problem.as_str(),
                        "capture blocked: transaction quarantined"
                    );
                }
                status.send_replace(blocked);
                return Ok(());
            }
        }
    }
}
