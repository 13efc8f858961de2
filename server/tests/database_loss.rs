//! Losing the database (issue 24, item 5), against the real binary on its
//! embedded cluster: a killed postmaster makes `/ready` answer 503 at once
//! and the process exit non-zero with a clear message; the next start
//! recovers; and a process that took over the cluster a crashed one left
//! running stops it when it stops gracefully.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use actors::testkit::EXAMPLE_CONFIG;

mod common;

/// `synchro serve` on its embedded cluster under `dir`, and its address.
fn serve(dir: &Path) -> (Child, SocketAddr) {
    common::serve_dir(dir, None, Stdio::piped())
}

fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    // The example's bootstrap_sql creates its tables on the embedded cluster.
    let config = EXAMPLE_CONFIG.replace(
        "mode = \"hs256\"\nsecret_file = \".synchro/hs256.secret\"",
        "mode = \"upstream\"\nheader = \"x-user\"",
    );
    std::fs::write(dir.path().join("config.toml"), config).unwrap();
    std::fs::write(
        dir.path().join("schema.sql"),
        include_str!("../../examples/notes/schema.sql"),
    )
    .unwrap();
    dir
}

async fn ready_status(addr: SocketAddr) -> u16 {
    common::request(addr, "GET", "/ready", &[], vec![]).await.0
}

async fn wait_ready(addr: SocketAddr) {
    let start = Instant::now();
    while ready_status(addr).await != 200 {
        assert!(start.elapsed() < Duration::from_secs(60), "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The postmaster's PID, from its pid file.
fn postmaster(dir: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(dir.join("data/pg/postmaster.pid")).ok()?;
    text.lines().next()?.trim().parse().ok()
}

fn alive(pid: u32) -> bool {
    Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn signal(pid: u32, name: &str) {
    assert!(
        Command::new("kill")
            .args([&format!("-{name}"), &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

/// Waits (up to 30 s) for `child` to exit; its exit code.
fn exit_code(child: &mut Child) -> Option<i32> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code();
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the process did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn a_killed_postmaster_fails_fast_and_the_process_exits() {
    let dir = setup();
    let (mut child, addr) = serve(dir.path());
    wait_ready(addr).await;
    let pid = postmaster(dir.path()).unwrap();
    signal(pid, "KILL");
    // /ready never waits for the database: each answer comes within 2 s,
    // and within a few seconds it is 503 or the process is gone. (A
    // backend may still answer for a moment after its postmaster died.)
    let start = Instant::now();
    loop {
        let asked = tokio::spawn(common::request(addr, "GET", "/ready", &[], vec![]));
        let answered = tokio::time::timeout(Duration::from_secs(2), asked)
            .await
            .expect("/ready answered within 2 s");
        match answered {
            Ok((503, _, _)) | Err(_) => break, // 503, or no process to answer
            Ok((status, _, _)) => assert_eq!(status, 200),
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "/ready still answered 200 10 s after the database was lost"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        exit_code(&mut child),
        Some(3),
        "a non-zero exit for the supervisor"
    );
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(
        stderr.contains("the embedded PostgreSQL stopped"),
        "{stderr}"
    );
    // The next start recovers the cluster and serves.
    let (mut again, addr) = serve(dir.path());
    wait_ready(addr).await;
    signal(again.id(), "TERM");
    assert_eq!(exit_code(&mut again), Some(0));
}

#[tokio::test]
async fn a_cluster_left_by_a_crash_is_stopped_by_the_next_graceful_stop() {
    let dir = setup();
    let (mut first, addr) = serve(dir.path());
    wait_ready(addr).await;
    let pid = postmaster(dir.path()).unwrap();
    signal(first.id(), "KILL");
    first.wait().unwrap();
    assert!(alive(pid), "the crash left PostgreSQL running");
    let (mut second, addr) = serve(dir.path());
    wait_ready(addr).await;
    assert_eq!(
        postmaster(dir.path()),
        Some(pid),
        "it took the running cluster over"
    );
    signal(second.id(), "TERM");
    assert_eq!(exit_code(&mut second), Some(0));
    let start = Instant::now();
    while alive(pid) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the graceful stop left PostgreSQL running"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
