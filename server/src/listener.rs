//! The HTTP listener: hyper's HTTP/1 server with every bound explicit, so
//! that idle, slow or too many connections cannot hold the process.
//!
//! - At most `max_connections` connections are served at once. One past
//!   them is answered `503 temporary_unavailable` (with `Retry-After`) and
//!   closed; beyond a few such answers at once it is closed unanswered.
//! - A request's head must arrive within `header_timeout`. hyper restarts
//!   that timer whenever a kept-alive connection waits for its next
//!   request, so it is the idle timeout too.
//! - A head (request line and headers) is at most `max_head_octets`, the
//!   read buffer of each connection.
//! - The body deadline is the adapter's (`AppState::body_timeout`).
//! - What hyper answers itself (a request it cannot parse) carries the
//!   error envelope too (`parse_errors::Enveloped`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use protocol::error::{ErrorKind, ProtocolError};
use protocol::limits::RETRY_AFTER_SECONDS;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};

use crate::parse_errors::Enveloped;

/// Refusals written at once; past them a connection is closed unanswered.
const REFUSALS_AT_ONCE: usize = 64;

/// How long a refusal may take to write.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a graceful stop waits for open connections to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The pause after a failed accept (at the open-file limit, say).
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// The listener's bounds.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    /// hyper's minimum is 8192.
    pub max_head_octets: usize,
}

impl HttpLimits {
    /// The limits of a config's `[server]` section.
    pub fn of(server: &actors::config::ServerConfig) -> HttpLimits {
        HttpLimits {
            max_connections: server.max_connections,
            header_timeout: Duration::from_millis(server.header_timeout_ms),
            max_head_octets: MAX_HEAD_OCTETS,
        }
    }
}

/// Request line and headers together: far above what a client sends.
pub const MAX_HEAD_OCTETS: usize = 32 * 1024;

/// Serves `app` on `listener` until `shutdown`, then lets open connections
/// finish (up to `DRAIN_TIMEOUT`).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) {
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let refusals = Arc::new(Semaphore::new(REFUSALS_AT_ONCE));
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_head_octets.max(8192));
    let (stop, stopped) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                }
            },
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            if let Ok(refusal) = refusals.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(REFUSAL_TIMEOUT, refuse(stream)).await;
                    drop(refusal);
                });
            }
            continue;
        };
        let connection = builder.serve_connection(
            Enveloped::new(TokioIo::new(stream)),
            TowerToHyperService::new(app.clone()),
        );
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = stopped.changed() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
            drop(permit);
        });
    }
    let _ = stop.send(true);
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, connections.acquire_many(all)).await;
}

/// Answers a connection past the cap with 503 and closes it.
async fn refuse(mut stream: TcpStream) {
    let body = ProtocolError::new(ErrorKind::TemporaryUnavailable { reason: None })
        .with_message("the server is at its connection limit")
        .to_body();
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: {RETRY_AFTER_SECONDS}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    if stream.write_all(head.as_bytes()).await.is_ok() {
        let _ = stream.write_all(&body).await;
    }
    let _ = stream.shutdown().await;
}
