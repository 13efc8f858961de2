//! The baseline (ADR 0011): the captured rows that existed when the
//! stream's slot was created, materialized before the stream's first
//! transaction. All of it commits in one store transaction, so a crash
//! leaves nothing of it, and the next feed takes it again under a new slot
//! and snapshot: no row is missed, none is doubled.

use protocol::position::Boundary;
use tokio::sync::watch;
use tokio::time::{Duration, Instant};

use super::{CaptureStatus, Model, step};
use crate::capture::{BASELINE_CHUNK_ROWS, Baseline, CaptureProblem, ChangeFeed, Lsn};
use crate::store::{Store, StoreError, StoreTx};

/// How often a running baseline reports its progress.
const REPORT_EVERY: Duration = Duration::from_secs(2);

/// How far a baseline got: rows staged of all, and the rate so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BaselineProgress {
    pub staged: u64,
    pub total: u64,
    /// Rows per second since the baseline began.
    pub rate: u64,
}

impl BaselineProgress {
    /// Seconds left at the rate so far (`None` before any row is staged).
    pub fn seconds_left(&self) -> Option<u64> {
        (self.rate > 0).then(|| self.total.saturating_sub(self.staged).div_ceil(self.rate))
    }
}

/// What a baseline ended with.
pub(super) enum BaselineOutcome {
    /// Committed; the boundary and durable end after it (unchanged when it held no row).
    Done { boundary: Boundary, end_lsn: Lsn },
    /// A row that cannot be materialized: nothing committed, capture blocks.
    Quarantined {
        commit_lsn: Lsn,
        problem: CaptureProblem,
    },
}

/// Materializes `baseline` from `feed` in one store transaction.
pub(super) async fn materialize<S: Store>(
    store: &S,
    model: &Model,
    feed: &mut S::Feed,
    baseline: &Baseline,
    generation: u64,
    status: &watch::Sender<CaptureStatus>,
) -> Result<BaselineOutcome, StoreError> {
    let began = Instant::now();
    let mut reported = began;
    let mut progress = BaselineProgress {
        staged: 0,
        total: baseline.rows,
        rate: 0,
    };
    status.send_replace(CaptureStatus::Baseline(progress));
    tracing::info!(rows = baseline.rows, "baseline: staging the existing rows");
    let mut tx = store.begin().await?;
    let mut boundary = Boundary::GenerationStart;
    let mut end_lsn: Lsn = 0;
    while let Some(chunk) = feed.baseline_chunk().await? {
        assert!(
            chunk.events.len() <= BASELINE_CHUNK_ROWS,
            "a baseline chunk never exceeds its limit"
        );
        assert!(
            end_lsn <= chunk.commit_lsn && chunk.commit_lsn < chunk.end_lsn,
            "baseline chunks are positioned in order"
        );
        let mut outcome =
            step::materialize_group(&mut tx, model, std::slice::from_ref(&chunk)).await?;
        if let Some((commit_lsn, problem)) = outcome.problem {
            drop(tx); // rolls back every chunk
            return Ok(BaselineOutcome::Quarantined {
                commit_lsn,
                problem,
            });
        }
        if let Some(m) = &mut outcome.combined {
            m.stream_generation = generation;
            tx.materialize(m).await?;
        }
        boundary = Boundary::TransactionEnd {
            commit_lsn: chunk.commit_lsn,
        };
        end_lsn = chunk.end_lsn;
        progress.staged += chunk.events.len() as u64;
        if progress.staged > progress.total {
            return Err(StoreError::Integrity(
                "the baseline holds more rows than it announced".into(),
            ));
        }
        if reported.elapsed() >= REPORT_EVERY {
            reported = Instant::now();
            progress.rate = (progress.staged as f64 / began.elapsed().as_secs_f64()) as u64;
            report(&progress);
            status.send_replace(CaptureStatus::Baseline(progress));
        }
    }
    if progress.staged != progress.total {
        return Err(StoreError::Integrity(
            "the baseline holds fewer rows than it announced".into(),
        ));
    }
    tx.complete_baseline(&baseline.covered_fences).await?;
    tx.commit().await?;
    tracing::info!(
        rows = progress.staged,
        seconds = began.elapsed().as_secs_f64(),
        "baseline: materialized"
    );
    Ok(BaselineOutcome::Done { boundary, end_lsn })
}

fn report(p: &BaselineProgress) {
    tracing::info!(
        staged = p.staged,
        total = p.total,
        rows_per_second = p.rate,
        seconds_left = p.seconds_left(),
        "baseline: staging"
    );
}
