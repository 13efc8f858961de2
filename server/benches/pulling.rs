//! Bench clients that pull over HTTP: one keep-alive connection per user,
//! a replica that verifies every row and scope checksum.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a load tool fails loudly
#![allow(dead_code)] // not every bench uses every part

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use actors::store::{Store, StoreTx};
use actors::testkit::origin_cursor;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use invariants::pull::Replica;
use protocol::json;
use server::auth::dev_token;
use store_pg::PgStore;

/// The `p` quantile of sorted samples.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Milliseconds, for printing.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// An `Authorization` value for `user`: an HS256 token signed now.
pub fn bearer(secret: &[u8], user: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    format!(
        "Bearer {}",
        dev_token(secret, user, now, &Default::default()).unwrap()
    )
}

/// One keep-alive HTTP connection as one user.
pub struct Http {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    bearer: String,
}

impl Http {
    pub async fn open(addr: SocketAddr, bearer: String) -> Http {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        Http { sender, bearer }
    }

    pub async fn post(&mut self, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        let req = hyper::Request::builder()
            .method("POST")
            .uri(path)
            .header("host", "localhost")
            .header("authorization", &self.bearer)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        self.sender.ready().await.unwrap();
        let response = self.sender.send_request(req).await.unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, body.to_vec())
    }
}

/// A connected client with a replica, every scope started from its origin.
pub struct Client {
    pub http: Http,
    pub replica: Replica,
    pub user: String,
    pub client_id: String,
}

impl Client {
    pub async fn connect(store: &PgStore, addr: SocketAddr, secret: &[u8], user: &str) -> Client {
        let mut http = Http::open(addr, bearer(secret, user)).await;
        let client_id = format!("{user}-client");
        let body = json::to_canonical(&actors::testkit::ConnectBody::fresh(&client_id).to_json());
        let (status, body) = http.post("/sync/connect", body).await;
        assert_eq!(status, 200);
        let mut tx = store.begin().await.unwrap();
        let manifest = tx.manifests().await.unwrap().pop().unwrap();
        drop(tx);
        let mut replica = Replica::new(manifest);
        replica.connected(&body).unwrap();
        let scopes: Vec<String> = replica.scopes.keys().cloned().collect();
        for s in scopes {
            let cursor = origin_cursor(store, user, &client_id, 1, &s).await;
            replica.scopes.get_mut(&s).unwrap().cursor = Some(cursor);
        }
        Client {
            http,
            replica,
            user: user.into(),
            client_id,
        }
    }

    /// One pull, applied; (has_more, changes).
    pub async fn pull(&mut self, limit: u16) -> (bool, usize) {
        let body = self.replica.request(&self.client_id, 1, limit);
        let (status, page) = self.http.post("/sync/pull", body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&page));
        let a = self.replica.apply(&page).unwrap();
        assert!(a.mismatched.is_empty() && a.rebuild.is_empty(), "{a:?}");
        (a.has_more, a.changes)
    }

    /// One pull whose page is only parsed and its cursors installed: the
    /// server's cost without the client's verification. Also the round
    /// trip (request sent to the page's last byte received).
    pub async fn pull_cursors(&mut self, limit: u16) -> (bool, usize, Duration) {
        let body = self.replica.request(&self.client_id, 1, limit);
        let start = Instant::now();
        let (status, page) = self.http.post("/sync/pull", body).await;
        let round_trip = start.elapsed();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&page));
        let v = json::parse(&page).unwrap();
        let o = v.as_object().unwrap();
        for (scope, token) in o["scope_cursors"].as_object().unwrap() {
            let cursor = token.as_str().unwrap().to_owned();
            self.replica.scopes.get_mut(scope).unwrap().cursor = Some(cursor);
        }
        let changes = match &o["changes"] {
            json::Value::Array(a) => a.len(),
            _ => panic!("changes"),
        };
        (
            o["has_more"] == json::Value::Bool(true),
            changes,
            round_trip,
        )
    }

    /// Pulls to a terminal page; the changes seen.
    pub async fn sync(&mut self, limit: u16) -> usize {
        let mut n = 0;
        loop {
            let (more, c) = self.pull(limit).await;
            n += c;
            if !more {
                return n;
            }
        }
    }
}
