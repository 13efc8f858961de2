//! Waiting for capture to make a client's own accepted writes visible
//! (issue 28). A pull or rebuild that finds one of its client's fences
//! pending would answer `503 capture_pending`, and the client would wait
//! out `Retry-After`, though capture materializes a commit in milliseconds.
//! Instead the request waits, holding no connection or transaction, until
//! the materializer reports every one of those fences satisfied (an event
//! per committed group, not a poll), up to a bound; then it runs again from
//! the start in a new snapshot. Only past the bound is the answer 503.
//!
//! Only this process's materializer reports: a process that does not lead
//! capture waits the whole bound and runs once more.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::time::Instant;

/// Groups of satisfied fences a waiter may fall behind by before it simply
/// runs again.
const BACKLOG: usize = 1024;

/// Fences a waiting request waits for at most: one with more runs again
/// once these are satisfied and, if more remain, waits again.
pub const MAX_WAITED_FENCES: usize = 64;

/// Where the materializer reports the fences each committed group satisfied.
#[derive(Clone)]
pub struct SatisfiedFences {
    sender: broadcast::Sender<Arc<[u64]>>,
}

impl Default for SatisfiedFences {
    fn default() -> Self {
        SatisfiedFences {
            sender: broadcast::channel(BACKLOG).0,
        }
    }
}

impl SatisfiedFences {
    /// The materializer committed these fences satisfied.
    pub fn report(&self, fences: &[u64]) {
        if !fences.is_empty() {
            // No receiver is no one waiting: nothing to do.
            let _ = self.sender.send(fences.into());
        }
    }

    /// A watch over what is reported from now on. Taken before the
    /// snapshot that finds fences pending, so no report falls between.
    pub fn watch(&self) -> FenceWatch {
        FenceWatch {
            receiver: self.sender.subscribe(),
        }
    }
}

/// Reports since a request's attempt began.
pub struct FenceWatch {
    receiver: broadcast::Receiver<Arc<[u64]>>,
}

impl FenceWatch {
    /// Waits until every fence of `pending` is reported satisfied (true),
    /// or until `deadline` (false). Falling behind the reports answers
    /// true: running again is the way to find out.
    pub async fn satisfied(&mut self, pending: &[u64], deadline: Instant) -> bool {
        let mut left: BTreeSet<u64> = pending.iter().copied().collect();
        while !left.is_empty() {
            // `timeout`, not `timeout_at`: the simulator has only the former.
            let remaining = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(remaining, self.receiver.recv()).await {
                Err(_) => return false,
                Ok(Ok(fences)) => {
                    for f in fences.iter() {
                        left.remove(f);
                    }
                }
                Ok(Err(broadcast::error::RecvError::Lagged(_))) => return true,
                Ok(Err(broadcast::error::RecvError::Closed)) => return false,
            }
        }
        true
    }
}

/// How a pull or rebuild waits for its client's writes: the reports, and
/// the bound (`[server] capture_wait_ms`; zero answers at once).
#[derive(Clone)]
pub struct Visibility {
    pub fences: SatisfiedFences,
    pub bound: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_watch_sees_every_fence_reported_after_it_began() {
        let fences = SatisfiedFences::default();
        let mut watch = fences.watch();
        fences.report(&[1, 7]);
        fences.report(&[]);
        fences.report(&[9]);
        let far = Instant::now() + Duration::from_secs(60);
        assert!(watch.satisfied(&[7, 9], far).await);
        let mut late = fences.watch();
        let soon = Instant::now() + Duration::from_millis(50);
        assert!(
            !late.satisfied(&[1], soon).await,
            "reported before the watch"
        );
        let mut watch = fences.watch();
        for f in 0..BACKLOG as u64 + 1 {
            fences.report(&[f]);
        }
        assert!(
            watch.satisfied(&[u64::MAX], far).await,
            "fell behind: run again"
        );
    }
}
