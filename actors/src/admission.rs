//! Admission control (dispatch step 8), fair per user: one user, however
//! many `client_id`s it uses, never takes what the others need; and the
//! flood gate before dispatch.
//!
//! - The flood gate: a token bucket per user over requests of every
//!   endpoint, far above what a client makes, and a bound on the user's
//!   requests in the server at once, judged before anything of the
//!   request is read (ADR 0018), so that a flood costs the database
//!   nothing.
//! - Pages: pull and rebuild share the instance's page permits, and one
//!   user holds at most `limits.pages_per_user` of them at once.
//! - Rates: a token bucket per user and kind (page requests; pushed
//!   mutations), refilled by the request's server time (the engine reads
//!   no clock), so that a flood is refused before it costs more.
//!
//! Only a user over its share is answered `429 retry_later`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use protocol::error::{ErrorKind, ProtocolError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::LimitsConfig;

/// Users whose state is kept before idle ones are forgotten.
const USERS_KEPT: usize = 10_000;

/// A bucket holds tokens in millionths, so that refills by the microsecond are exact.
const UNIT: u128 = 1_000_000;

/// How long a page waits for one of the instance's permits before 429: a
/// moment's crowd queues instead of being refused.
const PAGE_WAIT: std::time::Duration = std::time::Duration::from_millis(250);

/// The page permits and per-user shares of one process.
pub struct Admission {
    pages: Arc<Semaphore>,
    limits: LimitsConfig,
    users: Mutex<BTreeMap<String, UserShare>>,
}

/// What one user holds and may still spend.
#[derive(Clone, Debug)]
struct UserShare {
    /// Requests in the server, from the flood gate to their answer.
    in_flight: usize,
    pages: usize,
    requests: Bucket,
    mutations: Bucket,
    stages: Bucket,
    flood: Bucket,
}

/// A token bucket: `tokens` (in millionths) as of `at_micros`.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: u128,
    at_micros: i64,
}

impl Bucket {
    fn full(burst: u64, now_micros: i64) -> Bucket {
        Bucket {
            tokens: u128::from(burst) * UNIT,
            at_micros: now_micros,
        }
    }

    /// Refills at `per_minute` up to `burst`, then takes `cost` whole
    /// tokens if it holds them.
    fn take(&mut self, cost: u64, per_minute: u64, burst: u64, now_micros: i64) -> bool {
        // A clock that went back refills nothing.
        let elapsed = u128::try_from(now_micros.saturating_sub(self.at_micros)).unwrap_or(0);
        let cap = u128::from(burst) * UNIT;
        self.tokens = cap.min(self.tokens + elapsed * u128::from(per_minute) / 60);
        self.at_micros = self.at_micros.max(now_micros);
        let cost = u128::from(cost) * UNIT;
        if self.tokens < cost {
            return false;
        }
        self.tokens -= cost;
        true
    }

    fn is_full(&self, burst: u64) -> bool {
        self.tokens >= u128::from(burst) * UNIT
    }
}

/// A page being built: one of the instance's permits and one of the
/// user's share, both returned on drop.
pub struct PagePermit {
    _page: OwnedSemaphorePermit,
    _share: UserHold,
}

/// A request in the server, past the flood gate: one of its user's
/// requests in flight, returned on drop.
pub struct RequestPermit {
    _held: UserHold,
}

/// One unit of what a user holds (a page, a request in flight),
/// returned on drop.
struct UserHold {
    admission: Arc<Admission>,
    user_id: String,
    count: fn(&mut UserShare) -> &mut usize,
}

impl UserHold {
    /// Takes one unit of `count` from `user_id`'s `share`.
    fn take(
        admission: &Arc<Admission>,
        share: &mut UserShare,
        user_id: &str,
        count: fn(&mut UserShare) -> &mut usize,
    ) -> UserHold {
        *count(share) += 1;
        UserHold {
            admission: admission.clone(),
            user_id: user_id.to_owned(),
            count,
        }
    }
}

impl Drop for UserHold {
    fn drop(&mut self) {
        let mut users = self.admission.lock();
        if let Some(u) = users.get_mut(&self.user_id) {
            let held = (self.count)(u);
            assert!(*held > 0, "what a user holds never goes below zero");
            *held -= 1;
        }
    }
}

impl Admission {
    /// Admission over `pages` (the instance's page permits) within `limits`.
    pub fn new(pages: Arc<Semaphore>, limits: LimitsConfig) -> Arc<Admission> {
        Arc::new(Admission {
            pages,
            limits,
            users: Mutex::new(BTreeMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, UserShare>> {
        // No code panics while holding it; a poisoned map is still consistent.
        self.users.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A pull or rebuild page for `user_id`: within the user's request
    /// rate and page share, then one of the instance's permits (waiting up
    /// to `PAGE_WAIT` for one).
    pub async fn admit_page(
        self: &Arc<Self>,
        user_id: &str,
        now_micros: i64,
    ) -> Result<PagePermit, ProtocolError> {
        let share = {
            let l = &self.limits;
            let mut users = self.lock();
            let share = self.share(&mut users, user_id, now_micros);
            let per_minute = l.requests_per_user_per_second.saturating_mul(60);
            if share.pages >= l.pages_per_user
                || !share
                    .requests
                    .take(1, per_minute, l.request_burst_per_user, now_micros)
            {
                return Err(busy());
            }
            UserHold::take(self, share, user_id, |u| &mut u.pages)
        };
        let page = match self.pages.clone().try_acquire_owned() {
            Ok(page) => page,
            Err(_) => tokio::time::timeout(PAGE_WAIT, self.pages.clone().acquire_owned())
                .await
                .map_err(|_| busy())?
                .map_err(|_| busy())?,
        };
        Ok(PagePermit {
            _page: page,
            _share: share,
        })
    }

    /// Any request of `user_id`, before dispatch: within the user's flood
    /// gate (its request rate, and its requests in flight). Past it, 429
    /// before the request is read. The permit is held until the answer.
    pub fn admit_request(
        self: &Arc<Self>,
        user_id: &str,
        now_micros: i64,
    ) -> Result<RequestPermit, ProtocolError> {
        let l = &self.limits;
        let per_minute = l.flood_requests_per_user_per_second.saturating_mul(60);
        let mut users = self.lock();
        let share = self.share(&mut users, user_id, now_micros);
        if share.in_flight >= l.requests_in_flight_per_user
            || !share
                .flood
                .take(1, per_minute, l.flood_burst_per_user, now_micros)
        {
            return Err(busy());
        }
        Ok(RequestPermit {
            _held: UserHold::take(self, share, user_id, |u| &mut u.in_flight),
        })
    }

    /// A new rebuild session staged for `user_id`, within the user's
    /// staging rate (each stage writes its whole scope).
    pub fn admit_stage(&self, user_id: &str, now_micros: i64) -> Result<(), ProtocolError> {
        let rate = self.limits.rebuild_stages_per_user_per_minute;
        self.spend(user_id, now_micros, |u| &mut u.stages, 1, rate, rate)
    }

    /// A push of `mutations` for `user_id`, within the user's mutation rate.
    pub fn admit_push(
        &self,
        user_id: &str,
        mutations: usize,
        now_micros: i64,
    ) -> Result<(), ProtocolError> {
        let l = &self.limits;
        let cost = u64::try_from(mutations).unwrap_or(u64::MAX);
        let per_minute = l.mutations_per_user_per_second.saturating_mul(60);
        self.spend(
            user_id,
            now_micros,
            |u| &mut u.mutations,
            cost,
            per_minute,
            l.mutation_burst_per_user,
        )
    }

    /// Takes `cost` from one of the user's buckets, refilled at
    /// `per_minute` up to `burst`; 429 when it does not hold them.
    fn spend(
        &self,
        user_id: &str,
        now_micros: i64,
        bucket: impl FnOnce(&mut UserShare) -> &mut Bucket,
        cost: u64,
        per_minute: u64,
        burst: u64,
    ) -> Result<(), ProtocolError> {
        let mut users = self.lock();
        let share = self.share(&mut users, user_id, now_micros);
        match bucket(share).take(cost, per_minute, burst, now_micros) {
            true => Ok(()),
            false => Err(busy()),
        }
    }

    /// The user's share, created full; idle users are forgotten when
    /// too many are kept (a forgotten user starts full again, which it
    /// would be by now).
    fn share<'m>(
        &self,
        users: &'m mut BTreeMap<String, UserShare>,
        user_id: &str,
        now_micros: i64,
    ) -> &'m mut UserShare {
        let l = &self.limits;
        if users.len() >= USERS_KEPT && !users.contains_key(user_id) {
            users.retain(|_, u| {
                u.in_flight > 0
                    || u.pages > 0
                    || !u.requests.is_full(l.request_burst_per_user)
                    || !u.mutations.is_full(l.mutation_burst_per_user)
                    || !u.stages.is_full(l.rebuild_stages_per_user_per_minute)
                    || !u.flood.is_full(l.flood_burst_per_user)
            });
        }
        users
            .entry(user_id.to_owned())
            .or_insert_with(|| UserShare {
                in_flight: 0,
                pages: 0,
                requests: Bucket::full(l.request_burst_per_user, now_micros),
                mutations: Bucket::full(l.mutation_burst_per_user, now_micros),
                stages: Bucket::full(l.rebuild_stages_per_user_per_minute, now_micros),
                flood: Bucket::full(l.flood_burst_per_user, now_micros),
            })
    }
}

fn busy() -> ProtocolError {
    ProtocolError::new(ErrorKind::RetryLater)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn limits() -> LimitsConfig {
        LimitsConfig {
            pages_per_user: 2,
            requests_per_user_per_second: 10,
            request_burst_per_user: 3,
            mutations_per_user_per_second: 100,
            mutation_burst_per_user: 150,
            rebuild_stages_per_user_per_minute: 2,
            flood_requests_per_user_per_second: 20,
            flood_burst_per_user: 4,
            requests_in_flight_per_user: 2,
            ..LimitsConfig::default()
        }
    }

    #[tokio::test]
    async fn a_user_holds_at_most_its_share_of_pages() {
        let a = Admission::new(Arc::new(Semaphore::new(3)), limits());
        let p1 = a.admit_page("alice", 0).await.unwrap();
        let _p2 = a.admit_page("alice", 0).await.unwrap();
        assert!(
            a.admit_page("alice", 0).await.is_err(),
            "alice is at her share"
        );
        let _b = a.admit_page("bob", 0).await.unwrap();
        assert!(
            a.admit_page("carol", 0).await.is_err(),
            "every permit is held past the wait"
        );
        // A permit freed while a page waits is taken.
        let waiting = {
            let a = a.clone();
            tokio::spawn(async move { a.admit_page("carol", 0).await.is_ok() })
        };
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        drop(p1);
        assert!(waiting.await.unwrap(), "carol waited for alice's page");
    }

    #[tokio::test]
    async fn a_rate_refills_with_the_request_time() {
        let a = Admission::new(Arc::new(Semaphore::new(100)), limits());
        for _ in 0..3 {
            drop(a.admit_page("alice", 0).await.unwrap());
        }
        assert!(
            a.admit_page("alice", 0).await.is_err(),
            "the burst is spent"
        );
        assert!(
            a.admit_page("alice", 99_999).await.is_err(),
            "not yet a token"
        );
        drop(a.admit_page("alice", 100_000).await.unwrap());
        drop(a.admit_page("bob", 0).await.unwrap());
        // A clock that goes back refills nothing and takes nothing away.
        assert!(a.admit_page("alice", 50_000).await.is_err());
    }

    #[test]
    fn stages_spend_the_staging_rate() {
        let a = Admission::new(Arc::new(Semaphore::new(1)), limits());
        for _ in 0..2 {
            a.admit_stage("alice", 0).unwrap();
        }
        assert!(a.admit_stage("alice", 0).is_err(), "2 a minute");
        a.admit_stage("bob", 0).unwrap();
        a.admit_stage("alice", 30_000_000).unwrap();
    }

    #[test]
    fn the_flood_gate_counts_every_request_of_a_user() {
        let a = Admission::new(Arc::new(Semaphore::new(1)), limits());
        for _ in 0..4 {
            drop(a.admit_request("alice", 0).unwrap());
        }
        assert!(a.admit_request("alice", 0).is_err(), "the burst is spent");
        drop(a.admit_request("bob", 0).unwrap());
        assert!(a.admit_request("alice", 49_999).is_err(), "not yet a token");
        drop(a.admit_request("alice", 50_000).unwrap());
    }

    #[test]
    fn the_flood_gate_bounds_a_users_requests_in_flight() {
        let a = Admission::new(Arc::new(Semaphore::new(1)), limits());
        let first = a.admit_request("alice", 0).unwrap();
        let second = a.admit_request("alice", 0).unwrap();
        assert!(a.admit_request("alice", 0).is_err(), "two in flight");
        let _bob = a.admit_request("bob", 0).unwrap();
        drop(first);
        let third = a.admit_request("alice", 0).unwrap();
        drop((second, third));
        // The refused request spent no token: of the burst of 4, one is left.
        drop(a.admit_request("alice", 0).unwrap());
        assert!(a.admit_request("alice", 0).is_err(), "the burst is spent");
    }

    #[test]
    fn pushes_spend_mutations() {
        let a = Admission::new(Arc::new(Semaphore::new(1)), limits());
        a.admit_push("alice", 100, 0).unwrap();
        assert!(a.admit_push("alice", 100, 0).is_err(), "50 left");
        a.admit_push("alice", 50, 0).unwrap();
        a.admit_push("bob", 150, 0).unwrap();
        a.admit_push("alice", 100, 1_000_000).unwrap();
        assert!(
            a.admit_push("alice", 1_000, 10_000_000).is_err(),
            "above the burst"
        );
    }
}
