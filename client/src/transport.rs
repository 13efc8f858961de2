//! How a request reaches the server: the [`Transport`] trait (one POST of
//! one body to one endpoint, its status, `Retry-After` and body), and
//! [`HttpTransport`], HTTP/1.1 to a `synchro serve` listener.
//!
//! Production traffic is HTTPS through a reverse proxy (the spec's
//! deployment rule); this transport speaks plain HTTP to a loopback or
//! private listener, as the demo, the tests and the load tool do.

use std::fmt;
use std::future::Future;

/// The four authenticated protocol endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Endpoint {
    Connect,
    Push,
    Pull,
    Rebuild,
}

impl Endpoint {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Connect => "/sync/connect",
            Endpoint::Push => "/sync/push",
            Endpoint::Pull => "/sync/pull",
            Endpoint::Rebuild => "/sync/rebuild",
        }
    }
}

/// A server's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    /// The `Retry-After` header's text, if any.
    pub retry_after: Option<String>,
    pub body: Vec<u8>,
}

/// A request that got no answer (a refused connection, a lost response).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportError(pub String);

impl fmt::Display for TransportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "transport: {}", self.0)
    }
}

impl std::error::Error for TransportError {}

/// One POST of `body` to `endpoint`, with the client's credential.
pub trait Transport {
    fn post(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
    ) -> impl Future<Output = Result<Answer, TransportError>>;
}

#[cfg(not(madsim))]
pub use http::HttpTransport;

#[cfg(not(madsim))]
mod http {
    use std::net::SocketAddr;

    use http_body_util::{BodyExt, Full};
    use hyper::body::Bytes;
    use hyper::client::conn::http1::SendRequest;
    use hyper_util::rt::TokioIo;

    use super::{Answer, Endpoint, Transport, TransportError};

    /// HTTP/1.1 to one listener, over one kept-alive connection (opened
    /// again after it fails), with fixed headers (the credential).
    pub struct HttpTransport {
        addr: SocketAddr,
        headers: Vec<(String, String)>,
        conn: Option<SendRequest<Full<Bytes>>>,
    }

    impl HttpTransport {
        /// A transport to `addr` sending `Authorization: Bearer <token>`.
        pub fn bearer(addr: SocketAddr, token: &str) -> HttpTransport {
            HttpTransport::with_headers(
                addr,
                vec![("authorization".into(), format!("Bearer {token}"))],
            )
        }

        /// A transport to `addr` sending `headers` with every request (a
        /// trusted upstream identity header, in tests behind no proxy).
        pub fn with_headers(addr: SocketAddr, headers: Vec<(String, String)>) -> HttpTransport {
            HttpTransport {
                addr,
                headers,
                conn: None,
            }
        }

        async fn connection(&mut self) -> Result<&mut SendRequest<Full<Bytes>>, TransportError> {
            let usable = match &mut self.conn {
                Some(c) => c.ready().await.is_ok(),
                None => false,
            };
            if !usable {
                let stream = tokio::net::TcpStream::connect(self.addr)
                    .await
                    .map_err(|e| TransportError(e.kind().to_string()))?;
                let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|e| TransportError(e.to_string()))?;
                tokio::spawn(conn);
                self.conn = Some(sender);
            }
            self.conn
                .as_mut()
                .ok_or_else(|| TransportError("no connection".into()))
        }
    }

    impl Transport for HttpTransport {
        async fn post(
            &mut self,
            endpoint: Endpoint,
            body: &[u8],
        ) -> Result<Answer, TransportError> {
            let mut req = hyper::Request::builder()
                .method("POST")
                .uri(endpoint.path())
                .header("host", "localhost")
                .header("content-type", "application/json");
            for (k, v) in &self.headers {
                req = req.header(k.as_str(), v.as_str());
            }
            let req = req
                .body(Full::new(Bytes::copy_from_slice(body)))
                .map_err(|e| TransportError(e.to_string()))?;
            let sent = self.connection().await?.send_request(req).await;
            let response = match sent {
                Ok(r) => r,
                Err(e) => {
                    self.conn = None;
                    return Err(TransportError(e.to_string()));
                }
            };
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let body = match response.into_body().collect().await {
                Ok(b) => b.to_bytes().to_vec(),
                Err(e) => {
                    self.conn = None;
                    return Err(TransportError(e.to_string()));
                }
            };
            Ok(Answer {
                status,
                retry_after,
                body,
            })
        }
    }
}
