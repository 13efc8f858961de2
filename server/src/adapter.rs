//! The HTTP adapter: authenticate, apply transport gates (content type, body
//! limit while reading), call the one engine function, forward its status
//! and bytes. No protocol semantics live here.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actors::config::ServerConfig;
use actors::{Engine, Reply};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use protocol::error::{ErrorKind, ProtocolError};
use protocol::limits::{MAX_BODY_OCTETS, RETRY_AFTER_SECONDS};

use crate::auth::Authenticator;
use crate::metrics::{self, AnsweredCode, Metrics};

/// What every handler needs.
#[derive(Clone)]
pub struct AppState {
    pub engine: Engine,
    pub auth: Arc<Authenticator>,
    /// A request's body must arrive within this once its head did.
    pub body_timeout: Duration,
    /// Counts and times requests when `/metrics` is served.
    pub metrics: Option<Arc<Metrics>>,
}

impl AppState {
    /// The state of `engine` and `auth`, with the config's body deadline.
    pub fn new(engine: Engine, auth: Arc<Authenticator>, server: &ServerConfig) -> AppState {
        AppState {
            engine,
            auth,
            body_timeout: Duration::from_millis(server.body_timeout_ms),
            metrics: None,
        }
    }

    /// The same state, counting requests into `metrics`.
    pub fn with_metrics(self, metrics: Arc<Metrics>) -> AppState {
        AppState {
            metrics: Some(metrics),
            ..self
        }
    }
}

/// The routes of the wire spec that exist so far.
pub fn router(state: AppState) -> Router {
    let counted = state.metrics.clone();
    let app = Router::new()
        .route("/sync/connect", post(connect))
        .route("/sync/push", post(push))
        .route("/sync/pull", post(pull))
        .route("/sync/rebuild", post(rebuild))
        .route("/ready", get(ready))
        .route("/sync/schema", get(schema))
        .route("/sync/tables", get(tables))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn(access_log))
        .with_state(state);
    match counted {
        Some(m) => app.layer(middleware::from_fn_with_state(m, metrics::count)),
        None => app,
    }
}

/// Logs method, path, status and latency: never headers, bodies or
/// identities. At debug level (`RUST_LOG=server::adapter=debug` turns it
/// on): a busy server's every request at info would flood the log.
async fn access_log(request: Request, next: Next) -> Response {
    let (method, path, start) = (
        request.method().clone(),
        request.uri().path().to_owned(),
        Instant::now(),
    );
    let response = next.run(request).await;
    tracing::debug!(%method, %path, status = response.status().as_u16(), micros = start.elapsed().as_micros() as u64, "request");
    response
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

fn respond(reply: Reply) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, reply.body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(seconds) = reply.retry_after {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    if let Some(code) = reply.code {
        response.extensions_mut().insert(AnsweredCode(code));
    }
    response
}

fn reject(e: ProtocolError) -> Response {
    respond(Reply::error(&e))
}

/// Whether the request declares a JSON body (`application/json`, parameters allowed).
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
}

/// Steps 1 and the transport gates: the user, then a JSON body within the limit.
async fn intake(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(String, Bytes), Response> {
    let user = state.auth.authenticate(headers).await.map_err(|refusal| {
        tracing::debug!(%refusal, "request refused: no valid credential");
        reject(ErrorKind::AuthRequired.into())
    })?;
    if !is_json(headers) {
        return Err(reject(ProtocolError::invalid_request(
            "Content-Type must be application/json",
        )));
    }
    // No body encoding is supported: a compressed body is refused, not
    // read as JSON.
    let encoded = headers.get_all(header::CONTENT_ENCODING).iter().any(|v| {
        !v.to_str()
            .is_ok_and(|v| v.trim().eq_ignore_ascii_case("identity"))
    });
    if encoded {
        return Err(envelope(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Content-Encoding is not supported; send the body as it is",
        ));
    }
    // The limit is enforced while reading: a larger body is never buffered
    // whole; a body that trickles in is cut off at the deadline.
    let read = axum::body::to_bytes(body, MAX_BODY_OCTETS);
    let bytes = match tokio::time::timeout(state.body_timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(_)) => {
            return Err(reject(ProtocolError::invalid_request(
                "request body exceeds 1048576 octets",
            )));
        }
        Err(_) => {
            return Err(envelope(
                StatusCode::REQUEST_TIMEOUT,
                "the request body did not arrive in time",
            ));
        }
    };
    Ok((user, bytes))
}

async fn connect(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match intake(&state, &headers, body).await {
        Ok((user, bytes)) => respond(
            state
                .engine
                .connect(&user, bytes.to_vec(), now_micros())
                .await,
        ),
        Err(response) => response,
    }
}

/// The push result is the stored canonical response: forwarded unchanged.
async fn push(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match intake(&state, &headers, body).await {
        Ok((user, bytes)) => respond(state.engine.push(&user, bytes.to_vec(), now_micros()).await),
        Err(response) => response,
    }
}

async fn pull(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match intake(&state, &headers, body).await {
        Ok((user, bytes)) => respond(state.engine.pull(&user, bytes.to_vec(), now_micros()).await),
        Err(response) => response,
    }
}

async fn rebuild(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match intake(&state, &headers, body).await {
        Ok((user, bytes)) => respond(
            state
                .engine
                .rebuild(&user, bytes.to_vec(), now_micros())
                .await,
        ),
        Err(response) => response,
    }
}

/// Every non-200 answer carries the error envelope, unknown routes included.
fn envelope(status: StatusCode, message: &'static str) -> Response {
    let mut response = reject(ProtocolError::invalid_request(message));
    *response.status_mut() = status;
    response
}

async fn no_route() -> Response {
    envelope(StatusCode::NOT_FOUND, "no such route")
}

async fn wrong_method() -> Response {
    envelope(
        StatusCode::METHOD_NOT_ALLOWED,
        "the route does not take this method",
    )
}

async fn ready(State(state): State<AppState>) -> Response {
    let ready = state.engine.ready().await;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    // The operator status: a running baseline's progress.
    let body = match state.engine.capture_status() {
        actors::materializer::CaptureStatus::Baseline(p) => {
            let mut o = protocol::json::Object::new();
            o.insert("baseline".into(), crate::progress::json(&p));
            o.insert("ready".into(), protocol::json::Value::Bool(ready));
            protocol::json::to_canonical(&protocol::json::Value::Object(o))
        }
        _ if ready => br#"{"ready":true}"#.to_vec(),
        _ => br#"{"ready":false}"#.to_vec(),
    };
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if !ready {
        headers.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
    }
    response
}

async fn schema(State(state): State<AppState>) -> Response {
    respond(state.engine.schema().await)
}

async fn tables(State(state): State<AppState>) -> Response {
    respond(state.engine.tables().await)
}
