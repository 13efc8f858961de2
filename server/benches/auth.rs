//! What verifying the bearer token costs, by algorithm: the verification
//! alone, and a continuing connect over HTTP (loopback, one keep-alive
//! connection, the real adapter, `Engine` and `PgStore`) whose token is
//! signed with each. HS256 is the baseline every ratio is taken against,
//! measured in the same run, in interleaved rounds (connects one by one in turn) so drift hits all alike.
//! Run: `cargo bench -p server --bench auth`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a load tool fails loudly

#[path = "../tests/signer/mod.rs"]
mod signer;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actors::Engine;
use actors::config::AuthConfig;
use actors::config::auth::TokenAuth;
use actors::testkit::{ConnectBody, example_config};
use axum::http::HeaderMap;
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use jsonwebtoken::Algorithm;
use protocol::json;
use serde_json::json;
use server::adapter::{AppState, router};
use server::auth::Authenticator;
use signer::{Signer, hmac_token};
use store_pg::cluster::PgCluster;

const ROUNDS: usize = 10;
/// Connects per algorithm per round.
const CONNECTS: usize = 100;
/// Verifications per algorithm per round.
const VERIFIES: usize = 1000;
const SECRET: &[u8] = b"bench-secret-of-at-least-thirty-two-octets";

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// A token for `user`, signed with `alg`.
fn token(signers: &[Signer], alg: Algorithm, user: &str) -> String {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = json!({"sub": user, "iat": t, "exp": t + 3600});
    match signers.iter().find(|s| s.alg == alg) {
        Some(signer) => signer.sign(&claims),
        None => hmac_token(SECRET, &json!({"alg": "HS256", "typ": "JWT"}), &claims),
    }
}

/// One keep-alive HTTP/1.1 connection making continuing connects.
struct Device {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    bearer: String,
    body: Vec<u8>,
}

impl Device {
    async fn start(addr: std::net::SocketAddr, bearer: String, client_id: &str) -> Device {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let mut device = Device {
            sender,
            bearer,
            body: json::to_canonical(&ConnectBody::fresh(client_id).to_json()),
        };
        let first = device.connect().await;
        device.body = json::to_canonical(
            &ConnectBody::after(client_id, &json::parse(&first).unwrap()).to_json(),
        );
        device
    }

    async fn connect(&mut self) -> Vec<u8> {
        let request = hyper::Request::post("/sync/connect")
            .header("host", "localhost")
            .header("authorization", &self.bearer)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(self.body.clone())))
            .unwrap();
        self.sender.ready().await.unwrap();
        let response = self.sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec()
    }
}

#[tokio::main]
async fn main() {
    let signers = [
        Signer::rsa("r1", "rsa-1.pem", Algorithm::RS256, true),
        Signer::ec("e1", Algorithm::ES256),
        Signer::ed25519("d1"),
    ];
    let dir = tempfile::tempdir().unwrap();
    let jwks_file = dir.path().join("jwks.json");
    let keys: Vec<_> = signers.iter().map(|s| s.jwk.clone()).collect();
    std::fs::write(&jwks_file, json!({ "keys": keys }).to_string()).unwrap();
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, SECRET).unwrap();
    let auth = Authenticator::from_config(&AuthConfig::Jwt(TokenAuth {
        jwks_file: Some(jwks_file.display().to_string()),
        secret_file: Some(secret_file.display().to_string()),
        ..TokenAuth::default()
    }))
    .await
    .unwrap();
    let auth = Arc::new(auth);

    let cluster = PgCluster::temp().unwrap();
    let store = store_pg::example_store(&cluster, "auth_bench").await;
    let mut config = example_config(|s| s);
    config.limits = actors::testkit::benchmark_limits();
    let engine = Engine::start(store, config.clone()).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(AppState::new(engine, auth.clone(), &config.server));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let algorithms = [
        Algorithm::HS256,
        Algorithm::RS256,
        Algorithm::ES256,
        Algorithm::EdDSA,
    ];
    let mut devices = Vec::new();
    let mut headers = Vec::new();
    for (i, &alg) in algorithms.iter().enumerate() {
        let user = format!("bench-{alg:?}");
        let bearer = format!("Bearer {}", token(&signers, alg, &user));
        let mut h = HeaderMap::new();
        h.insert("authorization", bearer.parse().unwrap());
        headers.push(h);
        devices.push(Device::start(addr, bearer, &format!("auth-bench-{i}")).await);
    }
    let mut verify = vec![Vec::new(); algorithms.len()];
    let mut connect = vec![Vec::new(); algorithms.len()];
    for _ in 0..ROUNDS {
        for (i, h) in headers.iter().enumerate() {
            let start = Instant::now();
            for _ in 0..VERIFIES {
                std::hint::black_box(auth.authenticate(h).await.unwrap());
            }
            verify[i].push(start.elapsed() / VERIFIES as u32);
        }
        for _ in 0..CONNECTS {
            for (i, device) in devices.iter_mut().enumerate() {
                let start = Instant::now();
                device.connect().await;
                connect[i].push(start.elapsed());
            }
        }
    }
    println!(
        "bearer verification and continuing connects over HTTP on PostgreSQL {}, \
         {ROUNDS} interleaved rounds",
        cluster.dir().display()
    );
    let mut baseline = None;
    for (i, alg) in algorithms.iter().enumerate() {
        verify[i].sort();
        connect[i].sort();
        let v = percentile(&verify[i], 0.5).as_secs_f64() * 1e6;
        let p50 = percentile(&connect[i], 0.5).as_secs_f64() * 1e3;
        let p99 = percentile(&connect[i], 0.99).as_secs_f64() * 1e3;
        let (v0, p0) = *baseline.get_or_insert((v, p50));
        println!(
            "{:<6} verify {v:>7.1} µs ({:>5.1}× HS256)   connect p50 {p50:>6.3} ms ({:>4.2}× HS256)  p99 {p99:>6.3} ms",
            format!("{alg:?}"),
            v / v0,
            p50 / p0,
        );
    }
}
