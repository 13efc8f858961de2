//! The engine: one call per endpoint, each a typed message to the actor that
//! owns the state. This is the "canonical extension function" of the wire
//! spec; the HTTP adapter only authenticates and forwards bytes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use protocol::error::{ErrorKind, ProtocolError};
use protocol::json;
use tokio::sync::{Semaphore, mpsc, oneshot, watch};

use crate::admission::{Admission, RequestPermit};
use crate::capture::{CaptureHealth, CapturePlan, ReadinessLimits};
use crate::config::SyncConfig;
use crate::ledger::{self, Ledger};
use crate::materializer::{self, CaptureStatus, MaterializerLimits};
use crate::pull::Puller;
use crate::rebuild::Rebuilder;
use crate::registry::{Registry, RegistryError};
use crate::reply::Reply;
use crate::retention;
use crate::store::Store;
use crate::visibility::{self, CaptureReports, Visibility};

enum RegistryMsg {
    Connect {
        user_id: String,
        body: Vec<u8>,
        now_micros: i64,
        reply: oneshot::Sender<Reply>,
        in_flight: RequestPermit,
    },
    Schema {
        reply: oneshot::Sender<Reply>,
    },
    Tables {
        reply: oneshot::Sender<Reply>,
    },
    Health {
        reply: oneshot::Sender<Option<CaptureHealth>>,
    },
}

/// One request for the ledger, the puller or the rebuilder.
struct RequestMsg {
    user_id: String,
    body: Vec<u8>,
    now_micros: i64,
    reply: oneshot::Sender<Reply>,
    /// The user's request in flight, until the work ends (even when the
    /// caller stopped waiting for it).
    in_flight: RequestPermit,
}

/// Handles to the running actors. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    registry: mpsc::Sender<RegistryMsg>,
    ledger: mpsc::Sender<RequestMsg>,
    puller: mpsc::Sender<RequestMsg>,
    rebuilder: mpsc::Sender<RequestMsg>,
    /// Pull pages being built; a pull that finds none free answers 429.
    #[cfg_attr(not(feature = "testkit"), allow(dead_code))]
    pull_pages: Arc<Semaphore>,
    /// The flood gate every request passes first.
    admission: Arc<Admission>,
    capture: watch::Receiver<CaptureStatus>,
    /// What the materializer reports: fences, catch-up, totals.
    reports: CaptureReports,
    /// The retention task runs while the engine lives.
    _retention: retention::Running,
    /// Fence reports from every process's capture are heard while it lives.
    _fence_reports: visibility::Listening,
    /// Latched by the first `500 sync_integrity_failure`: durable state broke
    /// an invariant, so this process stays unready until it restarts.
    integrity_failed: Arc<AtomicBool>,
    readiness: ReadinessLimits,
    /// When the store last failed to report health: until `UNREACHABLE_HOLD`
    /// after, readiness answers false at once without asking again.
    unreachable_since: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
}

/// How long a health read may take before readiness is false.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a failed health read answers readiness by itself.
const UNREACHABLE_HOLD: Duration = Duration::from_secs(2);

/// How long a request refused by the flood gate waits for its answer.
const FLOOD_PAUSE: Duration = Duration::from_millis(100);

/// How many requests may wait for the registry before callers wait too.
const REGISTRY_INBOX: usize = 1024;
/// Connects executing at once. Each is one store transaction; the client
/// row lock serializes the connects of one client, so different clients
/// proceed in parallel. When all permits are taken the inbox fills and
/// callers wait (backpressure, not unbounded tasks).
const PARALLEL_CONNECTS: usize = 64;
/// Pushes executing at once; the client row lock serializes one client's.
const PARALLEL_PUSHES: usize = 64;
/// Pulls in progress at once (validating, or building their page); more wait.
const PARALLEL_PULLS: usize = 256;

impl Engine {
    /// Loads the registry from `store`, installs capture and starts the actors.
    pub async fn start<S: Store>(store: S, config: SyncConfig) -> Result<Engine, RegistryError> {
        let registry = Arc::new(Registry::load(store.clone(), config.clone()).await?);
        store
            .install_capture(&CapturePlan::new(&config))
            .await
            .map_err(RegistryError::Store)?;
        store
            .install_push(&ledger::write_targets(&config))
            .await
            .map_err(RegistryError::Store)?;
        let pull_pages = Arc::new(Semaphore::new(config.server.pull_pages));
        let admission = Admission::new(pull_pages.clone(), config.limits.clone());
        let ledger = Arc::new(
            Ledger::new(
                store.clone(),
                &config,
                registry.history().clone(),
                admission.clone(),
            )
            .map_err(RegistryError::Config)?,
        );
        let push_tx = serve_requests(ledger, PARALLEL_PUSHES, |ledger, m| async move {
            ledger.push(&m.user_id, &m.body, m.now_micros).await
        });
        let visibility = Visibility {
            reports: CaptureReports::default(),
            bound: Duration::from_millis(config.server.capture_wait_ms),
        };
        let puller = Arc::new(Puller::new(
            store.clone(),
            registry.clone(),
            admission.clone(),
            visibility.clone(),
        ));
        let pull_tx = serve_requests(puller, PARALLEL_PULLS, |puller, m| async move {
            puller.pull(&m.user_id, &m.body, m.now_micros).await
        });
        let rebuilder = Arc::new(Rebuilder::new(
            store.clone(),
            registry.clone(),
            admission.clone(),
            config.limits.clone(),
            visibility.clone(),
        ));
        let rebuild_tx = serve_requests(rebuilder, PARALLEL_PULLS, |rebuilder, m| async move {
            rebuilder.rebuild(&m.user_id, &m.body, m.now_micros).await
        });
        let limits = MaterializerLimits {
            heartbeat: Duration::from_millis(config.capture.heartbeat_ms),
            retry: Duration::from_millis(config.capture.retry_ms),
            group_transactions: config.capture.group_transactions,
            group_events: config.capture.group_events,
            rematerialize_chunk_rows: config.capture.rematerialize_chunk_rows,
            rematerialize_share: config.capture.rematerialize_share,
            baseline_snapshot: Duration::from_millis(config.capture.baseline_snapshot_ms),
        };
        let capture_store = store
            .capture_store()
            .await
            .map_err(|e| RegistryError::Config(e.to_string()))?;
        let capture = materializer::spawn(
            capture_store.clone(),
            &config,
            limits,
            visibility.reports.clone(),
        )
        .await
        .map_err(RegistryError::Config)?;
        let retention = retention::spawn(capture_store, config.retention.clone(), capture.clone());
        let fence_reports = visibility.reports.listen(store.clone());
        let (tx, mut rx) = mpsc::channel::<RegistryMsg>(REGISTRY_INBOX);
        let permits = Arc::new(Semaphore::new(PARALLEL_CONNECTS));
        tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                match msg {
                    RegistryMsg::Connect {
                        user_id,
                        body,
                        now_micros,
                        reply,
                        in_flight,
                    } => {
                        let Ok(permit) = permits.clone().acquire_owned().await else {
                            break;
                        };
                        let registry = registry.clone();
                        tokio::spawn(async move {
                            let r = registry
                                .connect(&user_id, &body, now_micros)
                                .await
                                .map(|c| c.to_body());
                            let _ = reply.send(r.into());
                            drop((permit, in_flight));
                        });
                    }
                    RegistryMsg::Schema { reply } => {
                        let _ = reply.send(Reply::ok(json::to_canonical(&registry.schema_json())));
                    }
                    RegistryMsg::Tables { reply } => {
                        let _ = reply.send(Reply::ok(json::to_canonical(&registry.tables_json())));
                    }
                    RegistryMsg::Health { reply } => {
                        let _ = reply.send(registry.capture_health().await);
                    }
                }
            }
        });
        Ok(Engine {
            registry: tx,
            ledger: push_tx,
            puller: pull_tx,
            rebuilder: rebuild_tx,
            pull_pages,
            admission,
            capture,
            reports: visibility.reports,
            _retention: retention,
            _fence_reports: fence_reports,
            integrity_failed: Arc::new(AtomicBool::new(false)),
            unreachable_since: Arc::default(),
            readiness: ReadinessLimits {
                max_heartbeat_age: Duration::from_millis(config.capture.max_heartbeat_age_ms),
                max_lag: Duration::from_millis(config.capture.max_lag_ms),
                max_lag_bytes: config.capture.max_lag_bytes,
            },
        })
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> RegistryMsg) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.registry.send(make(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Latches readiness off when `reply` reports an integrity failure.
    fn watched(&self, reply: Reply) -> Reply {
        if reply.status == 500 && !self.integrity_failed.swap(true, Ordering::SeqCst) {
            tracing::error!("sync_integrity_failure: unready until restarted");
        }
        reply
    }

    /// Whether a request answered `500 sync_integrity_failure` since start.
    pub fn integrity_failed(&self) -> bool {
        self.integrity_failed.load(Ordering::SeqCst)
    }

    /// `POST /sync/connect` for an authenticated user.
    pub async fn connect(&self, user_id: &str, body: Vec<u8>, now_micros: i64) -> Reply {
        let in_flight = match self.flood_gate(user_id, now_micros).await {
            Ok(permit) => permit,
            Err(refused) => return refused,
        };
        let user_id = user_id.to_owned();
        let reply = self
            .ask(|reply| RegistryMsg::Connect {
                user_id,
                body,
                now_micros,
                reply,
                in_flight,
            })
            .await
            .unwrap_or_else(unavailable);
        self.watched(reply)
    }

    /// `POST /sync/push` for an authenticated user.
    pub async fn push(&self, user_id: &str, body: Vec<u8>, now_micros: i64) -> Reply {
        self.request(&self.ledger, user_id, body, now_micros).await
    }

    /// `POST /sync/pull` for an authenticated user.
    pub async fn pull(&self, user_id: &str, body: Vec<u8>, now_micros: i64) -> Reply {
        self.request(&self.puller, user_id, body, now_micros).await
    }

    /// `POST /sync/rebuild` for an authenticated user.
    pub async fn rebuild(&self, user_id: &str, body: Vec<u8>, now_micros: i64) -> Reply {
        self.request(&self.rebuilder, user_id, body, now_micros)
            .await
    }

    /// The flood gate, before dispatch (ADR 0018): past it, `429` after
    /// `FLOOD_PAUSE`, so that a client that retries at once, ignoring
    /// `Retry-After`, is slowed instead of spinning a core on refusals.
    async fn flood_gate(&self, user_id: &str, now_micros: i64) -> Result<RequestPermit, Reply> {
        match self.admission.admit_request(user_id, now_micros) {
            Ok(permit) => Ok(permit),
            Err(e) => {
                tokio::time::sleep(FLOOD_PAUSE).await;
                Err(Reply::error(&e))
            }
        }
    }

    /// One request to an actor's inbox, and its reply.
    async fn request(
        &self,
        to: &mpsc::Sender<RequestMsg>,
        user_id: &str,
        body: Vec<u8>,
        now_micros: i64,
    ) -> Reply {
        let in_flight = match self.flood_gate(user_id, now_micros).await {
            Ok(permit) => permit,
            Err(refused) => return refused,
        };
        let (reply, rx) = oneshot::channel();
        let msg = RequestMsg {
            user_id: user_id.to_owned(),
            body,
            now_micros,
            reply,
            in_flight,
        };
        if to.send(msg).await.is_err() {
            return unavailable();
        }
        self.watched(rx.await.unwrap_or_else(|_| unavailable()))
    }

    /// Takes every pull page permit until the guard drops, so that pulls
    /// meet admission control (tests of `429 retry_later`).
    #[cfg(feature = "testkit")]
    pub async fn occupy_pull_pages(&self) -> tokio::sync::OwnedSemaphorePermit {
        let all = u32::try_from(self.pull_pages.available_permits()).unwrap_or(u32::MAX);
        #[allow(clippy::expect_used)]
        self.pull_pages
            .clone()
            .acquire_many_owned(all)
            .await
            .expect("the semaphore is never closed")
    }

    /// `GET /sync/schema`.
    pub async fn schema(&self) -> Reply {
        self.ask(|reply| RegistryMsg::Schema { reply })
            .await
            .unwrap_or_else(unavailable)
    }

    /// `GET /sync/tables`.
    pub async fn tables(&self) -> Reply {
        self.ask(|reply| RegistryMsg::Tables { reply })
            .await
            .unwrap_or_else(unavailable)
    }

    /// Whether this process can serve: no integrity failure was answered,
    /// the registry runs, the store answers, and capture (led by this or
    /// another process) keeps up by the shared heartbeat.
    /// Bounded: a store that does not answer within `HEALTH_TIMEOUT` is not
    /// ready, and then for `UNREACHABLE_HOLD` readiness answers at once.
    pub async fn ready(&self) -> bool {
        if self.integrity_failed() {
            return false;
        }
        let held = |u: &std::sync::MutexGuard<'_, Option<tokio::time::Instant>>| {
            u.is_some_and(|at| at.elapsed() < UNREACHABLE_HOLD)
        };
        if held(&self.unreachable()) {
            return false;
        }
        let health = self.capture_health().await;
        *self.unreachable() = match health {
            None => Some(tokio::time::Instant::now()),
            Some(_) => None,
        };
        health.is_some_and(|h| h.is_ready(&self.readiness))
    }

    fn unreachable(&self) -> std::sync::MutexGuard<'_, Option<tokio::time::Instant>> {
        self.unreachable_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What capture is doing now.
    pub fn capture_status(&self) -> CaptureStatus {
        self.capture.borrow().clone()
    }

    /// Capture as the leader's shared heartbeat reports it, whichever
    /// process leads; `None` when the store does not answer.
    pub async fn capture_health(&self) -> Option<CaptureHealth> {
        tokio::time::timeout(
            HEALTH_TIMEOUT,
            self.ask(|reply| RegistryMsg::Health { reply }),
        )
        .await
        .ok()
        .flatten()
        .flatten()
    }

    /// What this process materialized as capture leader since it started,
    /// and the time it took.
    pub fn materialized(&self) -> crate::visibility::Materialized {
        self.reports.materialized()
    }
}

/// Runs an actor's requests, at most `parallel` at once (one task each);
/// when all are busy the bounded inbox makes callers wait.
fn serve_requests<A, F, Fut>(actor: Arc<A>, parallel: usize, run: F) -> mpsc::Sender<RequestMsg>
where
    A: Send + Sync + 'static,
    F: Fn(Arc<A>, RequestParts) -> Fut + Copy + Send + 'static,
    Fut: std::future::Future<Output = Reply> + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel::<RequestMsg>(REGISTRY_INBOX);
    let permits = Arc::new(Semaphore::new(parallel));
    tokio::spawn(async move {
        while let Some(msg) = rx.recv().await {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let RequestMsg {
                user_id,
                body,
                now_micros,
                reply,
                in_flight,
            } = msg;
            let work = run(
                actor.clone(),
                RequestParts {
                    user_id,
                    body,
                    now_micros,
                },
            );
            tokio::spawn(async move {
                let _ = reply.send(work.await);
                drop((permit, in_flight));
            });
        }
    });
    tx
}

/// What an actor needs of one request.
struct RequestParts {
    user_id: String,
    body: Vec<u8>,
    now_micros: i64,
}

/// The actor is gone: the operation cannot complete.
fn unavailable() -> Reply {
    Reply::error(&ProtocolError::new(ErrorKind::TemporaryUnavailable {
        reason: None,
    }))
}
