//! Rematerialization (ADR 0020): the rows of a relation whose capture model
//! changed are read again, in chunks, beside live capture. A feed reads each
//! chunk with its rows locked in a source transaction that also commits a
//! watermark, so the chunk is exactly the rows' state at the watermark's
//! position. When the watermark's transaction arrives, the chunk becomes its
//! events (`reread`), materialized like any transaction: projections,
//! membership and digests under the current model, effects where the
//! result differs from what is stored. Progress (the last identity read)
//! commits with the chunk's materialization, so a crash resumes at the
//! next chunk; a watermark of a chunk read before the crash finds no chunk
//! in flight and materializes as the empty transaction it is.

use std::collections::VecDeque;

use tokio::time::{Duration, Instant};

use super::model::Model;
use crate::capture::{
    ChangeFeed, Lsn, Rematerialization, RereadChunk, RereadRequest, SourceTransaction,
};
use crate::store::{Store, StoreError};

/// The re-reading one leader owes, and the chunk it has in flight.
pub(super) struct Rereading {
    /// Pending records in order: dependency relations first (a table's
    /// membership reads them), then registered tables.
    owed: VecDeque<Rematerialization>,
    in_flight: Option<InFlight>,
    /// Rows per chunk.
    chunk_rows: usize,
    /// When the next chunk may be read (ADR 0027).
    pace: Pace,
    /// The progress last logged: when, and the relation's rows then.
    reported: (Instant, u64),
}

/// How often a long rematerialization logs its progress.
const REPORT_EVERY: Duration = Duration::from_secs(2);

/// The seconds left at `per_second` for the progress log: `None` without
/// an estimate of the relation's size or a rate yet.
fn time_left(rows: u64, estimated: Option<u64>, per_second: f64) -> Option<u64> {
    let left = estimated?.saturating_sub(rows);
    (per_second >= 1.0).then(|| (left as f64 / per_second).ceil() as u64)
}

struct InFlight {
    watermark: String,
    chunk: RereadChunk,
    /// When its reading began.
    began: Instant,
}

/// Paces re-reading to a share of wall time (ADR 0027): after a chunk
/// that took `busy` from its read to its commit, the next waits
/// `busy * (100 - share) / share`. A rematerialization shares the cores
/// with the pulls beside it, and this keeps their latency.
#[derive(Debug, Clone, Copy)]
struct Pace {
    /// Percent of wall time spent re-reading, 1..=100.
    share: u32,
    /// No chunk is read before this.
    resume_at: Option<Instant>,
}

impl Pace {
    fn new(share: u32) -> Pace {
        assert!((1..=100).contains(&share), "a share is a percent");
        Pace {
            share,
            resume_at: None,
        }
    }

    /// The pause after a chunk that kept the leader `busy`.
    fn pause(&self, busy: Duration) -> Duration {
        busy * (100 - self.share) / self.share
    }

    /// A chunk that began at `began` committed at `now`.
    fn chunk_done(&mut self, began: Instant, now: Instant) {
        assert!(now >= began, "a chunk commits after it began");
        self.resume_at = Some(now + self.pause(now - began));
    }

    /// The pause left at `now`, if any.
    fn left(&self, now: Instant) -> Option<Duration> {
        self.resume_at
            .map(|at| at.saturating_duration_since(now))
            .filter(|d| !d.is_zero())
    }
}

impl Rereading {
    /// The pending records of `records`, in the order they are re-read.
    pub fn new(
        records: Vec<Rematerialization>,
        model: &Model,
        chunk_rows: usize,
        share: u32,
    ) -> Rereading {
        assert!(chunk_rows > 0, "a chunk reads rows");
        let (tables, dependencies): (Vec<_>, Vec<_>) = records
            .into_iter()
            .filter(|r| {
                r.pending
                    && (model.tables.contains_key(&r.relation)
                        || model.impacts.contains_key(&r.relation))
            })
            .partition(|r| model.tables.contains_key(&r.relation));
        let owed: VecDeque<Rematerialization> = dependencies.into_iter().chain(tables).collect();
        let resumed_at = owed.front().map_or(0, |r| r.rows);
        Rereading {
            owed,
            in_flight: None,
            chunk_rows,
            pace: Pace::new(share),
            reported: (Instant::now(), resumed_at),
        }
    }

    /// How long the loop may wait before the next chunk is due: `None`
    /// when no chunk is due (nothing owed, or one in flight).
    pub fn pause_left(&self) -> Option<Duration> {
        if self.owed.is_empty() || self.in_flight.is_some() {
            return None;
        }
        Some(self.pace.left(Instant::now()).unwrap_or(Duration::ZERO))
    }

    /// Relations still owed.
    pub fn owed(&self) -> usize {
        self.owed.len()
    }

    /// Reads the next chunk through `feed`, unless one is in flight or nothing is owed.
    pub async fn request<S: Store, F: ChangeFeed>(
        &mut self,
        store: &S,
        feed: &mut F,
        model: &Model,
    ) -> Result<(), StoreError> {
        let Some(record) = self.owed.front() else {
            return Ok(());
        };
        if self.in_flight.is_some() || self.pace.left(Instant::now()).is_some() {
            return Ok(());
        }
        let began = Instant::now();
        let nonce = store.fresh_secret().await?;
        let watermark: String = nonce[..12].iter().map(|b| format!("{b:02x}")).collect();
        let registered = model
            .tables
            .get(&record.relation)
            .map(|t| (t.manifest.table_id().to_owned(), t.primary_key.clone()));
        let req = RereadRequest {
            relation: record.relation.clone(),
            registered,
            after: record.after.clone(),
            limit: self.chunk_rows,
            watermark: watermark.clone(),
        };
        let chunk = feed.reread(&req).await?;
        assert!(
            chunk.events.len() <= self.chunk_rows,
            "a chunk within its limit"
        );
        self.in_flight = Some(InFlight {
            watermark,
            chunk,
            began,
        });
        Ok(())
    }

    /// Gives the in-flight chunk to the group's transaction that carries its
    /// watermark. Its commit LSN and the record it moves the relation to.
    pub fn fill(&mut self, group: &mut [SourceTransaction]) -> Option<(Lsn, Rematerialization)> {
        let flight = self.in_flight.as_ref()?;
        let record = self.owed.front()?;
        let t = group
            .iter_mut()
            .find(|t| t.watermark.as_ref() == Some(&flight.watermark))?;
        assert!(
            t.events.is_empty() && t.notes.is_empty(),
            "a watermark's transaction writes nothing else"
        );
        t.events = flight.chunk.events.clone();
        t.notes = flight.chunk.notes.clone();
        t.reread = true;
        let read = flight.chunk.events.len();
        let next = Rematerialization {
            relation: record.relation.clone(),
            fingerprint: record.fingerprint.clone(),
            pending: read == self.chunk_rows,
            after: flight
                .chunk
                .events
                .last()
                .map(|e| e.identity.clone())
                .or_else(|| record.after.clone()),
            rows: record.rows + read as u64,
        };
        Some((t.commit_lsn, next))
    }

    /// The filled chunk's materialization committed with `record`.
    pub fn committed(&mut self, record: &Rematerialization) {
        let estimated_rows = self.in_flight.as_ref().and_then(|f| f.chunk.estimated_rows);
        assert!(
            self.owed
                .front()
                .is_some_and(|o| o.relation == record.relation && record.rows >= o.rows),
            "chunks of the owed relation, in order, only forward"
        );
        if let Some(owed) = self.owed.front_mut() {
            *owed = record.clone();
        }
        if let Some(flight) = self.in_flight.take() {
            self.pace.chunk_done(flight.began, Instant::now());
        }
        let (at, rows_then) = self.reported;
        if !record.pending {
            tracing::info!(
                relation = %record.relation,
                rows = record.rows,
                "capture: a relation was rematerialized"
            );
            self.owed.pop_front();
            let resumed_at = self.owed.front().map_or(0, |r| r.rows);
            self.reported = (Instant::now(), resumed_at);
        } else if at.elapsed() >= REPORT_EVERY {
            let per_second =
                record.rows.saturating_sub(rows_then) as f64 / at.elapsed().as_secs_f64();
            // An estimate below what was read already is stale statistics.
            let estimated = estimated_rows.map(|e| e.max(record.rows));
            tracing::info!(
                relation = %record.relation,
                rows = record.rows,
                estimated_rows = estimated,
                rows_per_second = per_second as u64,
                seconds_left = time_left(record.rows, estimated, per_second),
                "capture: rematerializing"
            );
            self.reported = (Instant::now(), record.rows);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Pace, time_left};
    use tokio::time::{Duration, Instant};

    #[test]
    fn a_pace_pauses_for_the_rest_of_its_share() {
        let ms = Duration::from_millis;
        assert_eq!(Pace::new(100).pause(ms(80)), ms(0));
        assert_eq!(Pace::new(50).pause(ms(80)), ms(80));
        assert_eq!(Pace::new(25).pause(ms(80)), ms(240));
        assert_eq!(Pace::new(1).pause(ms(10)), ms(990));
        let mut pace = Pace::new(50);
        let began = Instant::now();
        assert_eq!(pace.left(began), None, "the first chunk is due at once");
        pace.chunk_done(began, began + ms(30));
        assert_eq!(pace.left(began + ms(30)), Some(ms(30)));
        assert_eq!(pace.left(began + ms(50)), Some(ms(10)));
        assert_eq!(pace.left(began + ms(60)), None);
        assert_eq!(pace.left(began + ms(70)), None);
    }

    #[test]
    #[should_panic(expected = "a share is a percent")]
    fn a_share_above_all_of_the_time_is_refused() {
        let _ = Pace::new(101);
    }

    #[test]
    fn time_left_needs_an_estimate_and_a_rate() {
        assert_eq!(time_left(1_000, Some(11_000), 500.0), Some(20));
        assert_eq!(time_left(1_000, Some(1_001), 3.0), Some(1));
        assert_eq!(time_left(5_000, Some(4_000), 500.0), Some(0));
        assert_eq!(time_left(1_000, None, 500.0), None);
        assert_eq!(time_left(1_000, Some(11_000), 0.0), None);
    }
}
