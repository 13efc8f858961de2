//! `GET /metrics` (ADR 0025): the Prometheus text exposition, on a
//! listener of its own (`synchro serve --metrics-listen`), off unless given.
//!
//! Requests are counted and timed as they pass the adapter (a middleware
//! that reads the status and the error code the adapter attached). Capture,
//! the slot, rebuild sessions and the pool are sampled when scraped, from
//! the shared heartbeat and the catalog, so any process reports the
//! leader's capture. The metric names are a contract for dashboards and
//! alerts (`docs/ops/`): add, never rename.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actors::Engine;
use actors::materializer::CaptureStatus;
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus::{
    CounterVec, Encoder, Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use protocol::error::ErrorCode;
use store_pg::PgStore;

/// Latency buckets, in seconds: a pull answered from memory to a rebuild
/// page staged under load.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A scrape waits at most this long for the store; past it the store's
/// figures keep their last values and `synchro_store_up` is 0.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(5);

/// The error code of an answer, which the adapter attaches to the response
/// for the counters here.
#[derive(Clone, Copy, Debug)]
pub struct AnsweredCode(pub ErrorCode);

/// Every metric this process exports.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    durations: HistogramVec,
    capture_pending: IntCounter,
    admission_rejected: IntCounterVec,
    ready: IntGauge,
    store_up: IntGauge,
    capture_leader: IntGauge,
    capture_blocked: IntGaugeVec,
    lag_seconds: Gauge,
    lag_bytes: IntGauge,
    retained_wal: IntGauge,
    materialized_transactions: IntCounter,
    materialized_rows: IntCounter,
    materializer_seconds: CounterVec,
    rebuild_sessions: IntGauge,
    pool: IntGaugeVec,
    /// Scrapes sample one at a time: the counters above move by deltas.
    sampling: tokio::sync::Mutex<()>,
}

/// A metric's definition was refused by the registry (a name taken twice):
/// a programming error, found by the first test that builds `Metrics`.
#[derive(Debug)]
pub struct MetricsError(prometheus::Error);

impl std::fmt::Display for MetricsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "metrics: {}", self.0)
    }
}

impl From<prometheus::Error> for MetricsError {
    fn from(e: prometheus::Error) -> MetricsError {
        MetricsError(e)
    }
}

/// The endpoint a path names; everything else is `other` (the label's
/// values stay few whatever clients send).
pub fn endpoint(path: &str) -> &'static str {
    match path {
        "/sync/connect" => "connect",
        "/sync/push" => "push",
        "/sync/pull" => "pull",
        "/sync/rebuild" => "rebuild",
        "/sync/schema" => "schema",
        "/sync/tables" => "tables",
        "/ready" => "ready",
        _ => "other",
    }
}

impl Metrics {
    /// Every metric, registered, with the process collector.
    pub fn new() -> Result<Metrics, MetricsError> {
        let registry = Registry::new();
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(c.clone()))?;
            Ok::<_, prometheus::Error>(c)
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok::<_, prometheus::Error>(c)
        };
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok::<_, prometheus::Error>(g)
        };
        let gauge_vec = |name: &str, help: &str, labels: &[&str]| {
            let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
            registry.register(Box::new(g.clone()))?;
            Ok::<_, prometheus::Error>(g)
        };
        let requests = counter_vec(
            "synchro_http_requests_total",
            "HTTP requests answered, by endpoint and status.",
            &["endpoint", "status"],
        )?;
        let durations = HistogramVec::new(
            HistogramOpts::new(
                "synchro_http_request_duration_seconds",
                "Time from a request's head to its answer, by endpoint.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["endpoint"],
        )?;
        registry.register(Box::new(durations.clone()))?;
        let lag_seconds = Gauge::new(
            "synchro_capture_lag_seconds",
            "Seconds since the capture leader last found nothing waiting in the WAL.",
        )?;
        registry.register(Box::new(lag_seconds.clone()))?;
        let process = prometheus::process_collector::ProcessCollector::for_self();
        registry.register(Box::new(process))?;
        let admission_rejected = counter_vec(
            "synchro_admission_rejected_total",
            "429 answers of admission control, by endpoint.",
            &["endpoint"],
        )?;
        // Exported at 0 from the start, so that a rate over them is defined.
        for endpoint in ["connect", "push", "pull", "rebuild"] {
            admission_rejected.with_label_values(&[endpoint]);
        }
        let materializer_seconds = CounterVec::new(
            Opts::new(
                "synchro_materializer_seconds_total",
                "Time the capture leader's committed groups took, by phase: prepare \
                 (reading prior state, computing the writes) and write (the writes and commit).",
            ),
            &["phase"],
        )?;
        registry.register(Box::new(materializer_seconds.clone()))?;
        for phase in ["prepare", "write"] {
            materializer_seconds.with_label_values(&[phase]);
        }
        Ok(Metrics {
            requests,
            durations,
            capture_pending: counter(
                "synchro_capture_pending_total",
                "503 capture_pending answers: a request waited for capture past its bound.",
            )?,
            admission_rejected,
            ready: gauge("synchro_ready", "1 when GET /ready answers 200.")?,
            store_up: gauge(
                "synchro_store_up",
                "1 when the last scrape could read the store's figures.",
            )?,
            capture_leader: gauge(
                "synchro_capture_leader",
                "1 when this process leads capture (materializing, or blocked).",
            )?,
            capture_blocked: gauge_vec(
                "synchro_capture_blocked",
                "1 while a quarantine blocks capture; the reason is its class.",
                &["reason"],
            )?,
            lag_seconds,
            lag_bytes: gauge(
                "synchro_capture_lag_bytes",
                "WAL bytes the replication slot has not confirmed as captured.",
            )?,
            retained_wal: gauge(
                "synchro_replication_slot_retained_wal_bytes",
                "WAL bytes PostgreSQL keeps for the replication slot.",
            )?,
            materialized_transactions: counter(
                "synchro_materialized_transactions_total",
                "Source transactions this process materialized as capture leader.",
            )?,
            materialized_rows: counter(
                "synchro_materialized_rows_total",
                "Source row changes this process materialized as capture leader.",
            )?,
            materializer_seconds,
            rebuild_sessions: gauge(
                "synchro_rebuild_sessions_active",
                "Rebuild sessions not yet swept.",
            )?,
            pool: gauge_vec(
                "synchro_db_pool_connections",
                "Connections of the database pool, by state (idle, in_use, max).",
                &["state"],
            )?,
            registry,
            sampling: tokio::sync::Mutex::new(()),
        })
    }

    /// Counts one answered request.
    pub fn answered(&self, endpoint: &str, status: u16, code: Option<ErrorCode>, took: Duration) {
        self.requests
            .with_label_values(&[endpoint, status_text(status)])
            .inc();
        self.durations
            .with_label_values(&[endpoint])
            .observe(took.as_secs_f64());
        match code {
            Some(ErrorCode::CapturePending) => self.capture_pending.inc(),
            Some(ErrorCode::RetryLater) => {
                self.admission_rejected.with_label_values(&[endpoint]).inc()
            }
            _ => {}
        }
    }

    /// Samples what is read at scrape time, then renders every metric.
    pub async fn scrape(&self, engine: &Engine, store: &PgStore) -> Vec<u8> {
        {
            let _one = self.sampling.lock().await;
            self.sample(engine, store).await;
        }
        let mut out = Vec::new();
        // Encoding into memory fails only on metrics that break the format,
        // which the registry refused when they were registered.
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::error!(error = %e, "metrics: cannot encode");
        }
        out
    }

    async fn sample(&self, engine: &Engine, store: &PgStore) {
        self.ready.set(i64::from(engine.ready().await));
        let status = engine.capture_status();
        let leads = matches!(
            status,
            CaptureStatus::Running { .. } | CaptureStatus::Baseline(_) | CaptureStatus::Blocked(_)
        );
        self.capture_leader.set(i64::from(leads));
        let done = engine.materialized();
        advance(&self.materialized_transactions, done.transactions);
        advance(&self.materialized_rows, done.rows);
        for (phase, total) in [("prepare", done.preparing), ("write", done.writing)] {
            let c = self.materializer_seconds.with_label_values(&[phase]);
            c.inc_by((total.as_secs_f64() - c.get()).max(0.0));
        }
        let pool = store.pool();
        let (size, idle) = (i64::from(pool.size()), pool.num_idle() as i64);
        self.pool.with_label_values(&["idle"]).set(idle);
        self.pool
            .with_label_values(&["in_use"])
            .set((size - idle).max(0));
        self.pool
            .with_label_values(&["max"])
            .set(i64::from(pool.options().get_max_connections()));
        let report = tokio::time::timeout(SAMPLE_TIMEOUT, store.stream_report()).await;
        let Ok(Ok(report)) = report else {
            self.store_up.set(0);
            return;
        };
        self.store_up.set(1);
        self.capture_blocked.reset();
        match &report.quarantine {
            Some(class) => self.capture_blocked.with_label_values(&[class]).set(1),
            None => self.capture_blocked.with_label_values(&[""]).set(0),
        }
        let age = report.health.caught_up_age.or(report.health.heartbeat_age);
        self.lag_seconds
            .set(age.map_or(f64::NAN, |a| a.as_secs_f64()));
        let wal = report.wal.unwrap_or(store_pg::operator::SlotWal {
            retained_bytes: 0,
            unconfirmed_bytes: 0,
        });
        self.lag_bytes.set(gauge_value(wal.unconfirmed_bytes));
        self.retained_wal.set(gauge_value(wal.retained_bytes));
        self.rebuild_sessions
            .set(gauge_value(report.rebuild_sessions));
    }
}

/// Moves a counter up to `total`, a running total kept elsewhere.
fn advance(counter: &IntCounter, total: u64) {
    counter.inc_by(total.saturating_sub(counter.get()));
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The status label: the common ones without an allocation.
fn status_text(status: u16) -> &'static str {
    match status {
        200 => "200",
        400 => "400",
        401 => "401",
        404 => "404",
        405 => "405",
        408 => "408",
        409 => "409",
        410 => "410",
        413 => "413",
        415 => "415",
        422 => "422",
        426 => "426",
        429 => "429",
        500 => "500",
        503 => "503",
        _ => "other",
    }
}

/// The middleware that counts and times every request of the sync router.
pub async fn count(State(metrics): State<Arc<Metrics>>, request: Request, next: Next) -> Response {
    let (endpoint, start) = (endpoint(request.uri().path()), Instant::now());
    let response = next.run(request).await;
    let code = response.extensions().get::<AnsweredCode>().map(|c| c.0);
    metrics.answered(endpoint, response.status().as_u16(), code, start.elapsed());
    response
}

/// What the metrics listener serves.
#[derive(Clone)]
pub struct MetricsState {
    pub metrics: Arc<Metrics>,
    pub engine: Engine,
    pub store: PgStore,
}

/// The metrics listener's routes: `GET /metrics` only.
pub fn router(state: MetricsState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn metrics(State(state): State<MetricsState>) -> Response {
    let body = state.metrics.scrape(&state.engine, &state.store).await;
    let mut response = (StatusCode::OK, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_registers_and_requests_count_by_endpoint_and_code() {
        let m = Metrics::new().unwrap();
        m.answered("pull", 200, None, Duration::from_millis(3));
        m.answered("pull", 503, Some(ErrorCode::CapturePending), Duration::ZERO);
        m.answered("push", 429, Some(ErrorCode::RetryLater), Duration::ZERO);
        assert_eq!(m.requests.with_label_values(&["pull", "200"]).get(), 1);
        assert_eq!(m.capture_pending.get(), 1);
        assert_eq!(m.admission_rejected.with_label_values(&["push"]).get(), 1);
        assert_eq!(m.admission_rejected.with_label_values(&["pull"]).get(), 0);
        assert_eq!(endpoint("/sync/nowhere"), "other");
        assert_eq!(endpoint("/sync/rebuild"), "rebuild");
    }

    #[test]
    fn a_running_total_moves_its_counter_forward_only() {
        let c = IntCounter::new("c", "c").unwrap();
        advance(&c, 5);
        advance(&c, 7);
        advance(&c, 7);
        assert_eq!(c.get(), 7);
    }
}
