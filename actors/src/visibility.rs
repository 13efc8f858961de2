//! Waiting for capture to make a client's own accepted writes visible
//! (issue 28, ADR 0022). A pull or rebuild that finds one of its client's
//! fences pending would answer `503 capture_pending`, and the client would
//! wait out `Retry-After`, though capture materializes a commit in
//! milliseconds. Instead the request waits, holding no connection or
//! transaction, until the materializer reports every one of those fences
//! satisfied (an event per committed group, not a poll), up to a bound;
//! then it runs again from the start in a new snapshot. Only past the
//! bound is the answer 503.
//!
//! The materializer of this process reports its commits at once. Every
//! process also listens to the store (ADR 0028), which tells it what the
//! capture of any process satisfied: so a process that does not lead
//! capture wakes its waiting requests too. A report heard twice (by a
//! leader, from itself and from the store) only removes a fence twice.
//!
//! The materializer also reports how long it expects to take to catch up
//! (the WAL it has yet to take over the rate it takes it at), which the
//! 503 past the bound gives as `Retry-After` instead of a fixed 5 s.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

use crate::store::{FenceListener, FenceReport, Store};

/// Groups of satisfied fences a waiter may fall behind by before it simply
/// runs again.
const BACKLOG: usize = 1024;

/// Fences a waiting request waits for at most: one with more runs again
/// once these are satisfied and, if more remain, waits again.
pub const MAX_WAITED_FENCES: usize = 64;

/// How long a listener that failed waits before it listens again.
const RELISTEN: Duration = Duration::from_secs(1);

/// `Retry-After` when capture has told nothing recent: the adapter's old
/// fixed value.
const UNKNOWN_RETRY_SECONDS: u32 = 5;

/// A catch-up estimate older than this is no longer news.
const ESTIMATE_FRESH: Duration = Duration::from_secs(5);

/// The longest `Retry-After` a capture estimate gives.
const MAX_RETRY_SECONDS: u32 = 60;

/// What the materializer reports to waiting requests: the fences each
/// committed group satisfied, and how long it expects to catch up.
#[derive(Clone)]
pub struct CaptureReports {
    sender: broadcast::Sender<FenceReport>,
    /// The latest catch-up estimate, and when it was made.
    catch_up: Arc<Mutex<Option<(Duration, Instant)>>>,
    /// What this process materialized since it started.
    materialized: Arc<MaterializedCounts>,
}

/// Source transactions and row events this process committed as leader,
/// and the time their groups took, in microseconds.
#[derive(Debug, Default)]
pub struct MaterializedCounts {
    transactions: AtomicU64,
    rows: AtomicU64,
    preparing_us: AtomicU64,
    writing_us: AtomicU64,
}

/// What this process materialized as capture leader since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Materialized {
    pub transactions: u64,
    pub rows: u64,
    /// Reading the committed groups' prior state and computing their writes.
    pub preparing: Duration,
    /// Running the committed groups' writes and committing them.
    pub writing: Duration,
}

/// The two halves of one group's database transaction: the materializer
/// computes while its backend waits, then the backend writes while it
/// waits (docs/PERFORMANCE.md).
#[derive(Clone, Copy, Debug)]
pub struct GroupTimes {
    pub preparing: Duration,
    pub writing: Duration,
}

impl Default for CaptureReports {
    fn default() -> Self {
        CaptureReports {
            sender: broadcast::channel(BACKLOG).0,
            catch_up: Arc::default(),
            materialized: Arc::default(),
        }
    }
}

impl CaptureReports {
    /// The materializer committed these fences satisfied.
    pub fn satisfied(&self, fences: &[u64]) {
        if !fences.is_empty() {
            // No receiver is no one waiting: nothing to do.
            let _ = self.sender.send(FenceReport::Satisfied(fences.into()));
        }
    }

    /// Reports may have been lost: every waiting request runs again.
    pub fn missed(&self) {
        let _ = self.sender.send(FenceReport::Missed);
    }

    /// Passes on what the store tells of every process's capture until
    /// the returned handle drops. A failed listener is reopened after
    /// [`RELISTEN`]; once a listener is open, the waiting requests are told
    /// that reports were missed, so that none waits on a report sent
    /// before it listened.
    pub fn listen<S: Store>(&self, store: S) -> Listening {
        let (running, mut stop) = watch::channel(());
        let reports = self.clone();
        tokio::spawn(async move {
            loop {
                let opened = tokio::select! {
                    biased;
                    _ = stop.changed() => return,
                    l = store.fence_listener() => l,
                };
                match opened {
                    Ok(mut listener) => {
                        // Only now is every commit heard: a request that
                        // read its fences before runs again.
                        reports.missed();
                        loop {
                            let heard = tokio::select! {
                                biased;
                                _ = stop.changed() => return,
                                r = listener.next() => r,
                            };
                            match heard {
                                Ok(FenceReport::Satisfied(fences)) => reports.satisfied(&fences),
                                Ok(FenceReport::Missed) => reports.missed(),
                                Err(e) => {
                                    tracing::warn!(error = %e, "fence reports: the listener failed; listening again");
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "fence reports: cannot listen; trying again");
                    }
                }
                tokio::select! {
                    biased;
                    _ = stop.changed() => return,
                    _ = tokio::time::sleep(RELISTEN) => {}
                }
            }
        });
        Listening {
            _stop: Arc::new(running),
        }
    }

    /// The materializer committed a group of `transactions` holding `rows`
    /// row events, in `times`.
    pub fn committed(&self, transactions: usize, rows: usize, times: GroupTimes) {
        let m = &self.materialized;
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        m.transactions
            .fetch_add(transactions as u64, Ordering::Relaxed);
        m.rows.fetch_add(rows as u64, Ordering::Relaxed);
        m.preparing_us
            .fetch_add(micros(times.preparing), Ordering::Relaxed);
        m.writing_us
            .fetch_add(micros(times.writing), Ordering::Relaxed);
    }

    /// What this process materialized since start.
    pub fn materialized(&self) -> Materialized {
        let m = &self.materialized;
        Materialized {
            transactions: m.transactions.load(Ordering::Relaxed),
            rows: m.rows.load(Ordering::Relaxed),
            preparing: Duration::from_micros(m.preparing_us.load(Ordering::Relaxed)),
            writing: Duration::from_micros(m.writing_us.load(Ordering::Relaxed)),
        }
    }

    /// A watch over what is reported from now on. Taken before the
    /// snapshot that finds fences pending, so no report falls between.
    pub fn watch(&self) -> FenceWatch {
        FenceWatch {
            receiver: self.sender.subscribe(),
        }
    }

    /// The materializer expects to have taken all the WAL it knows of within `eta`.
    pub fn catching_up(&self, eta: Duration) {
        *self.catch_up.lock().unwrap_or_else(PoisonError::into_inner) = Some((eta, Instant::now()));
    }

    /// `Retry-After` for `capture_pending`: the fresh catch-up estimate in
    /// whole seconds, at least 1 and at most 60; 5 without one (a standby
    /// process, or capture silent for a while).
    pub fn retry_after(&self) -> u32 {
        self.retry_after_at(Instant::now())
    }

    fn retry_after_at(&self, now: Instant) -> u32 {
        let estimate = *self.catch_up.lock().unwrap_or_else(PoisonError::into_inner);
        match estimate {
            Some((eta, at)) if now.saturating_duration_since(at) <= ESTIMATE_FRESH => {
                let seconds = eta.as_secs() + u64::from(eta.subsec_nanos() > 0);
                u32::try_from(seconds).map_or(MAX_RETRY_SECONDS, |s| s.clamp(1, MAX_RETRY_SECONDS))
            }
            _ => UNKNOWN_RETRY_SECONDS,
        }
    }
}

/// Keeps a process listening for fence reports while any clone lives.
#[derive(Clone, Debug)]
pub struct Listening {
    _stop: Arc<watch::Sender<()>>,
}

/// Reports since a request's attempt began.
pub struct FenceWatch {
    receiver: broadcast::Receiver<FenceReport>,
}

impl FenceWatch {
    /// Waits until every fence of `pending` is reported satisfied (true),
    /// or until `deadline` (false). Falling behind the reports, or reports
    /// missed, answers true: running again is the way to find out.
    pub async fn satisfied(&mut self, pending: &[u64], deadline: Instant) -> bool {
        let mut left: BTreeSet<u64> = pending.iter().copied().collect();
        while !left.is_empty() {
            // `timeout`, not `timeout_at`: the simulator has only the former.
            let remaining = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(remaining, self.receiver.recv()).await {
                Err(_) => return false,
                Ok(Ok(FenceReport::Satisfied(fences))) => {
                    for f in fences.iter() {
                        left.remove(f);
                    }
                }
                Ok(Ok(FenceReport::Missed) | Err(broadcast::error::RecvError::Lagged(_))) => {
                    return true;
                }
                Ok(Err(broadcast::error::RecvError::Closed)) => return false,
            }
        }
        true
    }
}

/// The rate capture takes WAL at, from its committed groups, and so how
/// long the WAL it has yet to take will need.
#[derive(Default)]
pub struct CatchUpMeter {
    last: Option<(Instant, u64)>,
    /// Bytes per second, smoothed.
    rate: Option<f64>,
}

impl CatchUpMeter {
    /// Weight of the newest sample.
    const SMOOTHING: f64 = 0.3;

    /// Capture's durable end moved to `end` at `now` with `lag` bytes
    /// still to take: the expected time to take them (`None` until a rate
    /// is known).
    pub fn committed(&mut self, end: u64, lag: u64, now: Instant) -> Option<Duration> {
        if let Some((at, before)) = self.last {
            let seconds = now.duration_since(at).as_secs_f64();
            if seconds > 0.0 && end > before {
                let sample = (end - before) as f64 / seconds;
                self.rate = Some(match self.rate {
                    Some(r) => r + Self::SMOOTHING * (sample - r),
                    None => sample,
                });
            }
        }
        self.last = Some((now, end));
        if lag == 0 {
            return Some(Duration::ZERO);
        }
        let rate = self.rate?;
        Some(Duration::from_secs_f64((lag as f64 / rate).min(3600.0)))
    }
}

/// How a pull or rebuild waits for its client's writes: the reports, and
/// the bound (`[server] capture_wait_ms`; zero answers at once).
#[derive(Clone)]
pub struct Visibility {
    pub reports: CaptureReports,
    pub bound: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_groups_add_up() {
        let reports = CaptureReports::default();
        assert_eq!(reports.materialized(), Materialized::default());
        for (preparing, writing) in [(3, 5), (7, 11)] {
            reports.committed(
                2,
                10,
                GroupTimes {
                    preparing: Duration::from_millis(preparing),
                    writing: Duration::from_millis(writing),
                },
            );
        }
        assert_eq!(
            reports.materialized(),
            Materialized {
                transactions: 4,
                rows: 20,
                preparing: Duration::from_millis(10),
                writing: Duration::from_millis(16),
            }
        );
    }

    #[tokio::test]
    async fn a_watch_sees_every_fence_reported_after_it_began() {
        let reports = CaptureReports::default();
        let mut watch = reports.watch();
        reports.satisfied(&[1, 7]);
        reports.satisfied(&[]);
        reports.satisfied(&[9]);
        let far = Instant::now() + Duration::from_secs(60);
        assert!(watch.satisfied(&[7, 9], far).await);
        let mut late = reports.watch();
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(
            !late.satisfied(&[1], soon).await,
            "reported before the watch"
        );
        let mut watch = reports.watch();
        for f in 0..BACKLOG as u64 + 1 {
            reports.satisfied(&[f]);
        }
        assert!(
            watch.satisfied(&[u64::MAX], far).await,
            "fell behind: run again"
        );
        let mut watch = reports.watch();
        reports.missed();
        assert!(
            watch.satisfied(&[u64::MAX], far).await,
            "reports missed: run again"
        );
    }

    #[tokio::test]
    async fn retry_after_follows_the_catch_up_estimate() {
        let reports = CaptureReports::default();
        assert_eq!(
            reports.retry_after(),
            UNKNOWN_RETRY_SECONDS,
            "no estimate yet"
        );
        reports.catching_up(Duration::ZERO);
        assert_eq!(reports.retry_after(), 1, "at least 1");
        reports.catching_up(Duration::from_millis(2_100));
        assert_eq!(reports.retry_after(), 3, "rounded up");
        reports.catching_up(Duration::from_secs(600));
        assert_eq!(reports.retry_after(), MAX_RETRY_SECONDS);
        let later = Instant::now() + ESTIMATE_FRESH + Duration::from_millis(1);
        assert_eq!(
            reports.retry_after_at(later),
            UNKNOWN_RETRY_SECONDS,
            "stale"
        );

        let mut meter = CatchUpMeter::default();
        let t0 = Instant::now();
        let second = |n: u64| t0 + Duration::from_secs(n);
        assert_eq!(meter.committed(1_000, 5_000, t0), None, "no rate yet");
        // 1,000 bytes a second: 5,000 left take 5 s.
        assert_eq!(
            meter.committed(2_000, 5_000, second(1)),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            meter.committed(3_000, 0, second(2)),
            Some(Duration::ZERO),
            "caught up"
        );
    }
}
