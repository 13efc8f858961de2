//! The HTTP listener's bounds over real sockets (issue 24, items 4 and 7):
//! idle and trickling connections are closed, a body that does not arrive
//! in time is answered 408, a connection past the cap is answered 503, an
//! encoded body 415, and what hyper answers itself (a head past the limit
//! 431, a malformed request line or two different `Content-Length`s 400),
//! each with the error envelope.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use actors::Engine;
use actors::config::AuthConfig;
use actors::testkit::{example_config, example_mem_store};
use protocol::json::{self, Value};
use server::adapter::{AppState, router};
use server::auth::{Authenticator, dev_token, hs256_secret};
use server::listener::{HttpLimits, MAX_HEAD_OCTETS, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Listening {
    addr: SocketAddr,
    token: String,
    _secrets: tempfile::TempDir,
}

/// A server on MemStore (the listener does not care) with these bounds.
async fn listening(max_connections: usize, header_ms: u64, body_ms: u64) -> Listening {
    let secrets = tempfile::tempdir().unwrap();
    let secret_file = secrets.path().join("hs256.secret").display().to_string();
    let secret = hs256_secret(std::path::Path::new(&secret_file)).unwrap();
    let auth = Arc::new(
        Authenticator::from_config(&AuthConfig::hs256(&secret_file))
            .await
            .unwrap(),
    );
    let mut config = example_config(|s| s);
    config.server.body_timeout_ms = body_ms;
    let engine = Engine::start(example_mem_store(1).await, config.clone())
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = HttpLimits {
        max_connections,
        header_timeout: Duration::from_millis(header_ms),
        max_head_octets: MAX_HEAD_OCTETS,
    };
    let app = router(AppState::new(engine, auth, &config.server));
    tokio::spawn(serve(listener, app, limits, std::future::pending()));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    Listening {
        addr,
        token: dev_token(&secret, "alice", now, &Default::default()).unwrap(),
        _secrets: secrets,
    }
}

/// Everything the server sends until it closes (or 5 s pass: a failure).
async fn until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the server kept the connection open");
    out
}

/// The status and the error code of an HTTP/1.1 answer.
fn answer(raw: &[u8]) -> (u16, String, String) {
    let text = String::from_utf8_lossy(raw);
    let status = text[9..12].parse().unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let v = json::parse(body.as_bytes()).unwrap();
    let code = v.as_object().unwrap()["error"].as_object().unwrap()["code"]
        .as_str()
        .unwrap()
        .to_owned();
    (status, code, head.to_ascii_lowercase())
}

#[tokio::test]
async fn an_idle_connection_is_closed() {
    let s = listening(8, 300, 300).await;
    let mut idle = TcpStream::connect(s.addr).await.unwrap();
    assert!(until_closed(&mut idle).await.is_empty());
}

#[tokio::test]
async fn trickled_headers_are_cut_off() {
    let s = listening(8, 300, 300).await;
    let mut slow = TcpStream::connect(s.addr).await.unwrap();
    slow.write_all(b"POST /sync/connect HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        // A header line now and then does not extend the deadline.
        if slow.write_all(b"x-slow: 1\r\n").await.is_err() {
            break;
        }
    }
    until_closed(&mut slow).await;
}

#[tokio::test]
async fn a_kept_alive_connection_is_closed_when_idle() {
    let s = listening(8, 300, 300).await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut first = vec![0u8; 4096];
    let n = c.read(&mut first).await.unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 "));
    // Then nothing more: the connection closes once the timeout passed.
    until_closed(&mut c).await;
}

#[tokio::test]
async fn a_trickled_body_is_answered_408() {
    let s = listening(8, 2_000, 300).await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /sync/connect HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\n\
         content-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"client_id\"",
        s.token
    );
    c.write_all(head.as_bytes()).await.unwrap();
    let raw = until_closed(&mut c).await;
    let (status, code, _) = answer(&raw);
    assert_eq!((status, code.as_str()), (408, "invalid_request"));
}

#[tokio::test]
async fn an_encoded_body_is_answered_415() {
    let s = listening(8, 2_000, 2_000).await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /sync/connect HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {}\r\n\
         content-type: application/json\r\ncontent-encoding: gzip\r\n\
         content-length: 2\r\nconnection: close\r\n\r\n{{}}",
        s.token
    );
    c.write_all(head.as_bytes()).await.unwrap();
    let (status, code, _) = answer(&until_closed(&mut c).await);
    assert_eq!((status, code.as_str()), (415, "invalid_request"));
}

/// The answer to `raw` sent alone on a new connection.
async fn answer_to(s: &Listening, raw: &[u8]) -> (u16, String, String) {
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(raw).await.unwrap();
    answer(&until_closed(&mut c).await)
}

#[tokio::test]
async fn what_hyper_answers_itself_carries_the_envelope() {
    let s = listening(8, 2_000, 2_000).await;
    // Twice the limit: hyper parses a head that a single read completed
    // even a little past it.
    let long = "a".repeat(2 * MAX_HEAD_OCTETS);
    let too_large = format!("GET /ready HTTP/1.1\r\nhost: x\r\nx-long: {long}\r\n\r\n");
    let (status, code, head) = answer_to(&s, too_large.as_bytes()).await;
    assert_eq!((status, code.as_str()), (431, "invalid_request"));
    assert!(head.contains("content-type: application/json"), "{head}");
    for malformed in [
        &b"GARBAGE\r\n\r\n"[..],
        b"GET /ready HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n",
        b"POST /sync/connect HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\
          content-length: 3\r\n\r\n{}",
    ] {
        let (status, code, head) = answer_to(&s, malformed).await;
        assert_eq!(
            (status, code.as_str()),
            (400, "invalid_request"),
            "{}",
            String::from_utf8_lossy(malformed)
        );
        assert!(head.contains("connection: close"), "{head}");
    }
    // On a kept-alive connection too, after an answer of the app's own.
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\nGARBAGE\r\n\r\n")
        .await
        .unwrap();
    let raw = until_closed(&mut c).await;
    let text = String::from_utf8_lossy(&raw);
    let second = text.rfind("HTTP/1.1 ").unwrap();
    assert!(second > 0, "two answers: {text}");
    let (status, code, _) = answer(&raw[second..]);
    assert_eq!((status, code.as_str()), (400, "invalid_request"), "{text}");
}

#[tokio::test]
async fn a_connection_past_the_cap_is_answered_503() {
    let s = listening(2, 5_000, 5_000).await;
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        c.write_all(b"GET /ready HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = vec![0u8; 4096];
        assert!(c.read(&mut buf).await.unwrap() > 0, "served");
        held.push(c);
    }
    let mut third = TcpStream::connect(s.addr).await.unwrap();
    let (status, code, head) = answer(&until_closed(&mut third).await);
    assert_eq!((status, code.as_str()), (503, "temporary_unavailable"));
    assert!(head.contains("retry-after: 5"), "{head}");
    // A connection that closes makes room again.
    drop(held.pop());
    let mut ok = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        c.write_all(b"GET /ready HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let raw = until_closed(&mut c).await;
        if !raw.starts_with(b"HTTP/1.1 503") {
            ok = Some(raw);
            break;
        }
    }
    let raw = ok.expect("room again after a connection closed");
    let text = String::from_utf8_lossy(&raw);
    let v: Value = json::parse(text.split_once("\r\n\r\n").unwrap().1.as_bytes()).unwrap();
    assert!(v.as_object().unwrap().contains_key("ready"), "{text}");
}
