//! `synchro serve` killed with SIGKILL between a materialization commit and
//! the slot acknowledgement, then restarted: no effect is duplicated and
//! none is missing.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use actors::testkit::EXAMPLE_CONFIG;
use sqlx::PgPool;
use store_pg::cluster::PgCluster;

fn serve(dir: &std::path::Path, url: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_synchro"))
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url", url])
        .arg("--config")
        .arg(dir.join("config.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// (commit_lsn, end_lsn) of durable progress, and the slot's confirmed point.
async fn positions(pool: &PgPool, slot: &str) -> (Option<i64>, i64, Option<i64>) {
    sqlx::query_as(
        "SELECT p.commit_lsn, p.end_lsn, \
         (SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = $1) \
         FROM synchro.capture_progress p",
    )
    .bind(slot)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn insert_note(pool: &PgPool, n: usize) -> i64 {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO public.notes (id, owner_id, title) VALUES (gen_random_uuid(), $1, $2)",
    )
    .bind(format!("u{}", n % 3))
    .bind(format!("note {n}"))
    .execute(&mut *tx)
    .await
    .unwrap();
    let lsn: i64 = sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0')::int8")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    lsn
}

async fn wait_for(pool: &PgPool, slot: &str, what: &str, done: impl Fn(Option<i64>) -> bool) {
    let start = Instant::now();
    loop {
        let (commit, _, _) = positions(pool, slot).await;
        if done(commit) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn sigkill_between_commit_and_acknowledgement() {
    let cluster = PgCluster::temp().unwrap();
    cluster.create_database("crash").await.unwrap();
    let url = cluster.url("crash");
    let dir = tempfile::tempdir().unwrap();
    let config = EXAMPLE_CONFIG.replace(
        "mode = \"hs256\"\nsecret_file = \".synchro/hs256.secret\"",
        "mode = \"upstream\"\nheader = \"x-user\"",
    );
    assert_ne!(config, EXAMPLE_CONFIG);
    std::fs::write(dir.path().join("config.toml"), config).unwrap();
    std::fs::write(
        dir.path().join("schema.sql"),
        include_str!("../../examples/notes/schema.sql"),
    )
    .unwrap();
    let pool = PgPool::connect_with(cluster.connect_options("crash"))
        .await
        .unwrap();
    let slot = "synchro_crash";

    let mut server = serve(dir.path(), &url);
    // Started: migrations, the example schema, and capture installed.
    let start = Instant::now();
    loop {
        let ready: bool = sqlx::query_scalar(
            "SELECT to_regclass('public.notes') IS NOT NULL \
             AND EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
        )
        .bind(slot)
        .fetch_one(&pool)
        .await
        .unwrap();
        if ready {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the server did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut written = 0;
    let mut hits = 0;
    for _ in 0..8 {
        let previous = positions(&pool, slot).await.0;
        for _ in 0..5 {
            insert_note(&pool, written).await;
            written += 1;
        }
        // Kill the moment progress moves past a commit: the acknowledgement
        // reaches the slot only with the next status update (every 200 ms).
        wait_for(&pool, slot, "progress", |c| c.is_some() && c != previous).await;
        server.kill().unwrap();
        server.wait().unwrap();
        let (_, end, confirmed) = positions(&pool, slot).await;
        if confirmed.is_some_and(|c| c < end) {
            hits += 1; // killed between the commit and the acknowledgement
        }
        server = serve(dir.path(), &url);
    }
    // Everything written is materialized after the last restart.
    let last = insert_note(&pool, written).await;
    written += 1;
    wait_for(&pool, slot, "catch-up", |c| c.is_some_and(|c| c >= last)).await;
    server.kill().unwrap();
    server.wait().unwrap();
    eprintln!("kills between commit and acknowledgement: {hits} of 8; notes {written}");
    assert!(
        hits >= 1,
        "no kill landed between a commit and its acknowledgement"
    );

    // Exactly one upsert per inserted note, in its owner's scope.
    let rows: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT n.title, e.scope_id, count(e.*) FROM public.notes n \
         LEFT JOIN synchro.scope_effects e ON e.key_json = to_jsonb(n.id::text)::text \
         GROUP BY n.title, e.scope_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        rows.len(),
        written,
        "every note has effects in exactly one scope"
    );
    let counts: BTreeMap<String, i64> = rows.iter().map(|(t, _, c)| (t.clone(), *c)).collect();
    for (title, count) in &counts {
        assert_eq!(*count, 1, "{title}: exactly one effect");
    }
    for (title, scope, _) in &rows {
        let n: usize = title.trim_start_matches("note ").parse().unwrap();
        assert_eq!(scope, &format!("user:u{}", n % 3));
    }
    let quarantined: Option<String> =
        sqlx::query_scalar("SELECT quarantine_class FROM synchro.capture_progress")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(quarantined, None);
}
