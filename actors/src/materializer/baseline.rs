//! The baseline (ADR 0011, ADR 0030): the captured rows that existed when
//! the stream's slot was created, materialized before the stream's first
//! transaction. Each chunk commits in its own store transaction with the
//! rematerialization record of every relation it read (the identity of its
//! last row), so no transaction is held for the whole database. A crash
//! before the first chunk commits leaves nothing: the next feed takes the
//! baseline again under a new slot. A crash after it leaves the slot and
//! the records: the next feed hands the rows not yet read over to re-reads
//! (ADR 0020), which read each relation on from where its record stopped.

use std::collections::{BTreeMap, BTreeSet};

use protocol::position::Boundary;
use tokio::sync::watch;
use tokio::time::{Duration, Instant};

use super::{CaptureStatus, Model, step};
use crate::capture::{
    BASELINE_CHUNK_ROWS, Baseline, CaptureProblem, ChangeFeed, Lsn, Materialization,
    Rematerialization, SourceTransaction,
};
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
    /// Committed, or handed over; the boundary and durable end after it
    /// (unchanged when it held no row), and the records as committed.
    Done {
        boundary: Boundary,
        end_lsn: Lsn,
        records: Vec<Rematerialization>,
    },
    /// A row that cannot be materialized: this chunk is rolled back,
    /// capture blocks.
    Quarantined {
        commit_lsn: Lsn,
        problem: CaptureProblem,
    },
}

/// Each captured relation's record as the baseline reads it: all owed
/// from the start when it begins, then each one moved to the last row read
/// and released when the feed moves past it. Feeds read one relation after
/// another, each in identity order, so the rows of a relation up to its
/// record are exactly those committed.
struct Records {
    records: BTreeMap<String, Rematerialization>,
    /// The relation being read.
    reading: Option<String>,
}

impl Records {
    fn new(model: &Model) -> Records {
        let records = (model.fingerprints.iter())
            .map(|(relation, fingerprint)| {
                let r = Rematerialization {
                    relation: relation.clone(),
                    fingerprint: fingerprint.clone(),
                    pending: true,
                    after: None,
                    rows: 0,
                };
                (relation.clone(), r)
            })
            .collect();
        Records {
            records,
            reading: None,
        }
    }

    /// Moves the records past `chunk`; the records it changed.
    fn read(&mut self, chunk: &SourceTransaction) -> Result<Vec<Rematerialization>, StoreError> {
        let mut changed: BTreeSet<String> = BTreeSet::new();
        for e in &chunk.events {
            if self.reading.as_deref() != Some(e.relation.as_str()) {
                if let Some(r) = self.reading.take().and_then(|d| self.records.get_mut(&d)) {
                    r.pending = false;
                    r.after = None;
                }
                let r = self.records.get(&e.relation).ok_or_else(|| {
                    StoreError::Integrity("the baseline read a relation not captured".into())
                })?;
                if !r.pending || r.rows > 0 {
                    return Err(StoreError::Integrity(
                        "the baseline came back to a relation it had read".into(),
                    ));
                }
                self.reading = Some(e.relation.clone());
            }
            if let Some(r) = self.records.get_mut(&e.relation) {
                r.after = Some(e.identity.clone());
                r.rows += 1;
            }
            changed.insert(e.relation.clone());
        }
        // A relation the chunk moved past was released in it.
        let released = self.records.values().filter(|r| !r.pending);
        changed.extend(released.map(|r| r.relation.clone()));
        Ok((self.records.values())
            .filter(|r| changed.contains(&r.relation))
            .cloned()
            .collect())
    }

    /// Every record released: the baseline read every row.
    fn finish(&mut self) -> Vec<Rematerialization> {
        self.reading = None;
        for r in self.records.values_mut() {
            r.pending = false;
            r.after = None;
        }
        self.records.values().cloned().collect()
    }
}

/// Hands a baseline over to re-reads (ADR 0030): a crash cut it short, or
/// it read under its snapshot for as long as it may.
pub(super) async fn hand_over<S: Store>(store: &S) -> Result<(), StoreError> {
    let mut tx = store.begin().await?;
    tx.hand_over_baseline().await?;
    tx.commit().await?;
    tracing::info!("baseline: handed over; the rows not yet read are re-read");
    Ok(())
}

/// Materializes `baseline` from `feed`, one store transaction per chunk,
/// reading under its snapshot for at most `snapshot_limit`.
pub(super) async fn materialize<S: Store>(
    store: &S,
    model: &Model,
    feed: &mut S::Feed,
    baseline: &Baseline,
    generation: u64,
    snapshot_limit: Duration,
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
    let mut records = Records::new(model);
    let mut boundary = Boundary::GenerationStart;
    let mut end_lsn: Lsn = 0;
    let mut index: u64 = 0;
    let mut next = feed.baseline_chunk().await?;
    if next.is_none() {
        // No row existed: completing it is the whole baseline.
        let mut tx = store.begin().await?;
        tx.put_rematerializations(&records.finish()).await?;
        tx.complete_baseline(&baseline.covered_fences).await?;
        tx.commit().await?;
    }
    // The next chunk, computed while the one before it wrote.
    let mut ahead: Option<Prepared<S::Tx>> = None;
    while let Some(chunk) = next {
        if index > 0 && began.elapsed() >= snapshot_limit {
            // Long enough under one snapshot: the rest is re-read.
            drop(ahead); // its transaction holds nothing written
            feed.end_baseline().await;
            hand_over(store).await?;
            let records = records.records.into_values().collect();
            return Ok(BaselineOutcome::Done {
                boundary,
                end_lsn,
                records,
            });
        }
        assert!(
            !chunk.events.is_empty() && chunk.events.len() <= BASELINE_CHUNK_ROWS,
            "a baseline chunk holds rows, never more than its limit"
        );
        assert!(
            end_lsn <= chunk.commit_lsn && chunk.commit_lsn < chunk.end_lsn,
            "baseline chunks are positioned in order"
        );
        // The last chunk commits with the baseline's completion.
        let following = feed.baseline_chunk().await?;
        progress.staged += chunk.events.len() as u64;
        if progress.staged > progress.total {
            return Err(StoreError::Integrity(
                "the baseline holds more rows than it announced".into(),
            ));
        }
        let Prepared { tx, outcome } = match ahead.take() {
            Some(prepared) => prepared,
            None => prepare(store, model, &chunk).await?,
        };
        if let Some((commit_lsn, problem)) = outcome.problem {
            drop(tx); // rolls this chunk back; those before it stay
            return Ok(BaselineOutcome::Quarantined {
                commit_lsn,
                problem,
            });
        }
        let mut m = outcome
            .combined
            .ok_or_else(|| StoreError::Integrity("a baseline chunk materialized nothing".into()))?;
        m.stream_generation = generation;
        if index == 0 {
            // The writes the snapshot holds are in the baseline's rows;
            // every scope they reach answers 503 until those rows are
            // read, here or by the re-reads a crash hands them to.
            m.fences.extend(&baseline.covered_fences);
        }
        let mut moved = records.read(&chunk)?;
        if index == 0 {
            // From the first commit on, every relation is owed until read.
            moved = records.records.values().cloned().collect();
        }
        let last = match following {
            Some(_) => None,
            None if progress.staged != progress.total => {
                return Err(StoreError::Integrity(
                    "the baseline holds fewer rows than it announced".into(),
                ));
            }
            None => Some(records.finish()),
        };
        // The next chunk reads only the dependency rows its `via` rules
        // join (its own rows were never materialized): it computes while
        // this one writes, unless this one writes dependency rows, which
        // it could not see before they commit (ADR 0036).
        let independent = m.put_dependencies.is_empty() && m.removed_dependencies.is_empty();
        let writing = tokio::spawn(write(tx, m, moved, index, last));
        if let Some(f) = following.as_ref().filter(|_| independent) {
            // A failure of either is reported once the write is known.
            let prepared = prepare(store, model, f).await;
            written(writing).await?;
            ahead = Some(prepared?);
        } else {
            written(writing).await?;
        }
        index += 1;
        boundary = Boundary::TransactionEnd {
            commit_lsn: chunk.commit_lsn,
        };
        end_lsn = chunk.end_lsn;
        if reported.elapsed() >= REPORT_EVERY {
            reported = Instant::now();
            progress.rate = (progress.staged as f64 / began.elapsed().as_secs_f64()) as u64;
            report(&progress);
            status.send_replace(CaptureStatus::Baseline(progress));
        }
        next = following;
    }
    assert!(ahead.is_none(), "no chunk is computed past the last one");
    if progress.staged != progress.total {
        return Err(StoreError::Integrity(
            "the baseline holds fewer rows than it announced".into(),
        ));
    }
    tracing::info!(
        rows = progress.staged,
        seconds = began.elapsed().as_secs_f64(),
        "baseline: materialized"
    );
    Ok(BaselineOutcome::Done {
        boundary,
        end_lsn,
        records: records.finish(),
    })
}

/// A chunk computed in its own store transaction, not yet written.
struct Prepared<T> {
    tx: T,
    outcome: step::GroupOutcome,
}

/// Opens a chunk's transaction and computes its writes.
async fn prepare<S: Store>(
    store: &S,
    model: &Model,
    chunk: &SourceTransaction,
) -> Result<Prepared<S::Tx>, StoreError> {
    let mut tx = store.begin().await?;
    let outcome = step::materialize_baseline_chunk(&mut tx, model, chunk).await?;
    Ok(Prepared { tx, outcome })
}

/// Writes a chunk, the records it moved and its index, and commits; the
/// last chunk (`finished`: every record released) completes the baseline.
/// It runs as a task of its own, so that the next chunk computes meanwhile,
/// and frees the chunk's writes there too.
async fn write<T: StoreTx>(
    mut tx: T,
    m: Materialization,
    moved: Vec<Rematerialization>,
    index: u64,
    finished: Option<Vec<Rematerialization>>,
) -> Result<(), StoreError> {
    tx.materialize(&m).await?;
    tx.put_rematerializations(&moved).await?;
    tx.record_baseline_chunk(index).await?;
    match finished {
        Some(records) => {
            tx.put_rematerializations(&records).await?;
            tx.complete_baseline(&[]).await?;
            // Durable before any client reads it: this flush takes every
            // chunk before it along.
            tx.commit().await
        }
        // Nothing of a chunk is served before the last one commits, and a
        // chunk a crash lost is re-read: its commit need not wait for its
        // flush.
        None => tx.commit_lazily().await,
    }
}

/// The outcome of a chunk's write task. A panic there (a broken
/// invariant) goes on here; the simulator's runtime stops on it itself.
async fn written(task: tokio::task::JoinHandle<Result<(), StoreError>>) -> Result<(), StoreError> {
    match task.await {
        Ok(done) => done,
        #[cfg(not(madsim))]
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(StoreError::Unavailable(format!(
            "a baseline chunk's write stopped: {e}"
        ))),
    }
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
