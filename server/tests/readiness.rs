//! Readiness over HTTP on PostgreSQL: every process that can serve is ready
//! (capture is judged by the leader's durable heartbeat, whoever leads), a
//! standby takes over capture when the leader dies, and an integrity
//! failure latches a process unready.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use actors::testkit::{ConnectBody, note_columns, note_id, note_mutation};
use protocol::json::{self, Value};
use sqlx::PgPool;
use store_pg::cluster::PgCluster;

mod common;

/// One request as `user` (the trusted upstream header); status and body.
async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    user: &str,
    body: Vec<u8>,
) -> (u16, Vec<u8>) {
    let headers = [("x-user", user), ("content-type", "application/json")];
    let (status, _, body) = common::request(addr, method, path, &headers, body).await;
    (status, body)
}

/// A fresh client's first connect through `addr`: its generation and schema reference.
async fn connect(addr: SocketAddr, user: &str, client: &str) -> (Value, Value) {
    let body = json::to_canonical(&ConnectBody::fresh(client).to_json());
    let (status, b) = request(addr, "POST", "/sync/connect", user, body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    let c = json::parse(&b).unwrap();
    let o = c.as_object().unwrap();
    let s = o["schema"].as_object().unwrap();
    let schema = json::object([
        ("version", s["version"].clone()),
        ("hash", s["hash"].clone()),
    ]);
    (o["client_generation"].clone(), schema)
}

/// A `synchro serve` process and the address it listens on.
struct Process {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(dir: &std::path::Path, url: &str) -> Process {
    let (child, addr) = common::serve_dir(dir, Some(url), Stdio::null());
    Process { child, addr }
}

async fn ready(addr: SocketAddr) -> bool {
    request(addr, "GET", "/ready", "", vec![]).await.0 == 200
}

async fn wait_ready(addr: SocketAddr, what: &str) {
    let start = Instant::now();
    while !ready(addr).await {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{what} never became ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Connects a fresh client through `addr`, then pushes one note through it.
async fn connect_and_push(addr: SocketAddr, user: &str, client: &str, n: u64) {
    let (generation, schema) = connect(addr, user, client).await;
    let push = json::object([
        ("client_id", Value::string(client)),
        ("client_generation", generation),
        (
            "batch_id",
            Value::string(format!("10000000-0000-4000-8000-{n:012}")),
        ),
        ("schema", schema.clone()),
        (
            "mutations",
            Value::Array(vec![note_mutation(
                n,
                &note_id(n),
                &schema,
                "insert",
                None,
                Some(note_columns("two processes")),
            )]),
        ),
    ]);
    let (status, b) = request(addr, "POST", "/sync/push", user, json::to_canonical(&push)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains(r#""status":"applied""#));
}

async fn setup(cluster: &PgCluster, name: &str) -> (tempfile::TempDir, String, PgPool) {
    common::upstream_setup(cluster, name).await
}

#[tokio::test]
async fn two_processes_are_both_ready_and_one_takes_over_capture() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, pool) = setup(&cluster, "two").await;
    let first = serve(dir.path(), &url);
    wait_ready(first.addr, "the first process").await;
    let second = serve(dir.path(), &url);
    wait_ready(second.addr, "the second process (a capture standby)").await;
    // Both serve connect and push.
    connect_and_push(first.addr, "alice", "via-first", 1).await;
    connect_and_push(second.addr, "bob", "via-second", 2).await;
    assert!(ready(first.addr).await && ready(second.addr).await);

    // Kill the leader (the first, which started capture): the second takes
    // over capture, materializes what is written next, and stays ready.
    let leader_pid: Option<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted LIMIT 1",
    )
    .fetch_optional(&pool)
    .await
    .unwrap();
    assert!(leader_pid.is_some(), "a leader holds the capture lock");
    drop(first);
    let before: Option<i64> = sqlx::query_scalar("SELECT commit_lsn FROM synchro.capture_progress")
        .fetch_one(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO public.notes (owner_id, title) VALUES ('carol', 'after the leader died')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let start = Instant::now();
    loop {
        let now: Option<i64> =
            sqlx::query_scalar("SELECT commit_lsn FROM synchro.capture_progress")
                .fetch_one(&pool)
                .await
                .unwrap();
        if now.is_some() && now != before {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no process took over capture"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_ready(second.addr, "the new leader").await;
    connect_and_push(second.addr, "carol", "after-takeover", 3).await;
    assert!(ready(second.addr).await);
}

#[tokio::test]
async fn an_integrity_failure_latches_unready() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, pool) = setup(&cluster, "latch").await;
    let server = serve(dir.path(), &url);
    wait_ready(server.addr, "the server").await;
    connect_and_push(server.addr, "alice", "c1", 1).await;
    // Durable state broken behind the server's back: the row's version is gone.
    sqlx::query("DELETE FROM synchro.row_versions")
        .execute(&pool)
        .await
        .unwrap();
    let (generation, schema) = connect(server.addr, "alice", "c2").await;
    let update = json::object([
        ("client_id", Value::string("c2")),
        ("client_generation", generation),
        (
            "batch_id",
            Value::string("10000000-0000-4000-8000-000000000099"),
        ),
        ("schema", schema.clone()),
        (
            "mutations",
            Value::Array(vec![note_mutation(
                9,
                &note_id(1),
                &schema,
                "update",
                Some("any"),
                Some(json::object([("fld_notes_title", Value::string("x"))])),
            )]),
        ),
    ]);
    let (status, b) = request(
        server.addr,
        "POST",
        "/sync/push",
        "alice",
        json::to_canonical(&update),
    )
    .await;
    assert_eq!(status, 500, "{}", String::from_utf8_lossy(&b));
    assert!(String::from_utf8_lossy(&b).contains(r#""code":"sync_integrity_failure""#));
    // Unready from then on, although the database answers and capture runs.
    for _ in 0..5 {
        let (status, body) = request(server.addr, "GET", "/ready", "", vec![]).await;
        assert_eq!((status, body.as_slice()), (503, &br#"{"ready":false}"#[..]));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // A restart (after the operator repaired the cause) clears it.
    drop(server);
    let again = serve(dir.path(), &url);
    wait_ready(again.addr, "the restarted server").await;
}

/// `synchro stream`, as an operator runs it: the slot is dropped by hand,
/// so `/ready` is false and status says so; a reset without `--confirm`
/// changes nothing; with it, the server takes the new baseline and is ready
/// again, and the rows written while the slot was gone are in it.
#[tokio::test]
async fn an_operator_resets_the_stream_after_the_slot_is_dropped() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, pool) = setup(&cluster, "reset").await;
    let server = serve(dir.path(), &url);
    wait_ready(server.addr, "the server").await;
    let stream = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_synchro"))
            .arg("stream")
            .args(args)
            .args(["--database-url", &url])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // The slot is dropped behind the server's back, then a note is written.
    sqlx::raw_sql(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
         WHERE active_pid IS NOT NULL",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut dropped = false;
    for _ in 0..200 {
        if sqlx::raw_sql("SELECT pg_drop_replication_slot('synchro_reset')")
            .execute(&pool)
            .await
            .is_ok()
        {
            dropped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(dropped, "the slot was dropped");
    sqlx::raw_sql(
        "INSERT INTO public.notes (id, owner_id, title) \
         VALUES ('00000000-0000-4000-8000-00000000abcd', 'ru', 'lost with the slot')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let start = Instant::now();
    while ready(server.addr).await {
        assert!(start.elapsed() < Duration::from_secs(30), "never unready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (ok, out, _) = stream(&["status"]);
    assert!(ok);
    assert!(out.contains("stream generation: 1"), "{out}");
    assert!(out.contains(", missing"), "{out}");
    assert!(out.contains("capture: blocked (slot_lost)"), "{out}");

    let (ok, _, err) = stream(&["reset"]);
    assert!(!ok, "a reset needs --confirm");
    assert!(err.contains("--confirm"), "{err}");
    let generation: i64 = sqlx::query_scalar("SELECT generation FROM synchro.stream")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(generation, 1, "nothing changed");

    let (ok, out, err) = stream(&["reset", "--confirm"]);
    assert!(ok, "{err}");
    assert!(out.contains("generation 2"), "{out}");
    wait_ready(server.addr, "the reset stream").await;
    let (ok, out, _) = stream(&["status"]);
    assert!(ok);
    assert!(out.contains("stream generation: 2"), "{out}");
    assert!(out.contains("baseline: materialized"), "{out}");
    assert!(out.contains("capture: not blocked"), "{out}");
    let projected: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM synchro.projections WHERE key = '00000000-0000-4000-8000-00000000abcd'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        projected, 1,
        "the note written while the slot was gone is in the baseline"
    );
}
