//! Materializer throughput and latency on the example app (issue 4):
//!
//! - row events materialized per second for 1-row and 100-row transactions,
//!   against raw pgoutput decoding of the same WAL (a second slot created at
//!   the same point), measured in the same run;
//! - the write floor of the same run: the time PostgreSQL takes to write the
//!   materializer's output rows again (projections, membership, effects,
//!   source transactions) into empty tables of the same columns and indexes,
//!   with one `INSERT ... SELECT` each in one transaction. No materializer
//!   that stores those rows can take less, so `raw / floor` bounds the share
//!   of raw decoding any of them can reach on the machine;
//! - how the materializer's groups split their time: preparing (reading
//!   prior state, computing the writes) against writing (the statements
//!   and the commit), the second also as a ratio to the write floor;
//! - commit-to-materialized latency p50/p99 of single-row transactions at a
//!   moderate rate (about 80 per second), with the materializer caught up.
//!
//! Run: `cargo bench -p store-pg --bench capture`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a load tool fails loudly

use std::time::{Duration, Instant};

use actors::Engine;
use actors::capture::CapturePlan;
use actors::store::Store;
use actors::testkit::example_config;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent};
use sqlx::PgPool;
use store_pg::capture::{FeedTarget, PUBLICATION};
use store_pg::cluster::PgCluster;
use store_pg::pgoutput::{Message, decode};
use store_pg::{example_store, write_floor};

const ROWS: usize = 20_000;

async fn raw_decoding(cluster: &PgCluster, db: &str, end: Lsn) -> usize {
    let config = ReplicationConfig::unix(
        cluster.dir().display().to_string(),
        5432,
        "postgres",
        "",
        db,
        format!("{db}_raw"),
        PUBLICATION,
    )
    .with_stop_lsn(end);
    let mut client = ReplicationClient::connect(config).await.unwrap();
    let mut rows = 0;
    while let Some(event) = client.recv().await.unwrap() {
        match event {
            ReplicationEvent::XLogData { data, .. } => {
                if let Message::Insert { .. } | Message::Update { .. } | Message::Delete { .. } =
                    decode(&data).unwrap()
                {
                    rows += 1;
                }
            }
            ReplicationEvent::StoppedAt { .. } => break,
            _ => {}
        }
    }
    rows
}

/// CPU time this process has used (user and system), from `/proc`: the
/// materializer's, its feed's decoding and this bench's polling, apart
/// from PostgreSQL's processes.
fn own_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // The fields after the command's closing parenthesis; utime and stime
    // are the 14th and 15th of the line, in clock ticks (100 a second).
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

async fn progress(pool: &PgPool) -> i64 {
    sqlx::query_scalar::<_, Option<i64>>("SELECT commit_lsn FROM synchro.capture_progress")
        .fetch_one(pool)
        .await
        .unwrap()
        .unwrap_or(-1)
}

/// Where the next WAL record goes: at or below the commit of an open transaction.
async fn lsn_now(conn: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0')::int8")
        .fetch_one(conn)
        .await
        .unwrap()
}

async fn throughput(cluster: &PgCluster, db: &str, rows_per_tx: usize) {
    let store = example_store(cluster, db).await;
    let pool = store.pool().clone();
    let mut config = example_config(|s| s);
    if let Ok(v) = std::env::var("GROUP_EVENTS") {
        config.capture.group_events = v.parse().unwrap();
    }
    // Both slots start before the workload, so both see the same WAL. The
    // stream's slot is created here, not by the engine's first feed: a slot
    // the engine finds unrecorded began with the stream and owes no baseline
    // (ADR 0011), so the workload reaches capture as changes. Created by the
    // engine after the workload, the rows would be read by a baseline instead.
    store
        .install_capture(&CapturePlan::new(&config))
        .await
        .unwrap();
    let stream_slot = FeedTarget::new(&cluster.connect_options(db), None).slot();
    for slot in [stream_slot, format!("{db}_raw")] {
        sqlx::query(&format!(
            "SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput')"
        ))
        .execute(&pool)
        .await
        .unwrap();
    }
    let txs = ROWS / rows_per_tx;
    sqlx::raw_sql(&format!(
        "DO $$ BEGIN FOR t IN 0..{} LOOP
           INSERT INTO public.notes (id, owner_id, title, body)
             SELECT gen_random_uuid(), 'user-' || (i % 50), 'title ' || i, repeat('x', 80)
             FROM generate_series(1, {rows_per_tx}) i;
           COMMIT;
         END LOOP; END $$",
        txs - 1
    ))
    .execute(&pool)
    .await
    .unwrap();
    // A marker transaction: its commit is the last one of the workload.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO public.templates (id, name, body) VALUES ('marker', 'm', 'm')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let last = lsn_now(&mut tx).await;
    tx.commit().await.unwrap();
    let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();

    let start = Instant::now();
    let raw = raw_decoding(cluster, db, Lsn::parse(&end).unwrap()).await;
    let raw_s = start.elapsed().as_secs_f64();
    assert_eq!(raw, ROWS + 1);

    let start = Instant::now();
    let cpu = own_cpu();
    let engine = Engine::start(store.clone(), config).await.unwrap();
    while progress(&pool).await < last {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mat_s = start.elapsed().as_secs_f64();
    let cpu_us = (own_cpu() - cpu).as_secs_f64() * 1e6;
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM synchro.scope_effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(effects as usize, ROWS + 1, "one effect per inserted row");
    let done = engine.materialized();
    drop(engine);
    let (effects_b, projections_b, members_b, notes_b): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT pg_total_relation_size('synchro.scope_effects'), \
         pg_total_relation_size('synchro.projections'), \
         pg_total_relation_size('synchro.scope_members'), pg_total_relation_size('public.notes')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    println!(
        "stored, with indexes: effects {:.1} MB ({} bytes a row), projections {:.1} MB, \
         members {:.1} MB; the notes themselves {:.1} MB",
        effects_b as f64 / 1e6,
        effects_b / ROWS as i64,
        projections_b as f64 / 1e6,
        members_b as f64 / 1e6,
        notes_b as f64 / 1e6,
    );
    let floor_s = write_floor(&pool, &OUTPUT).await.as_secs_f64();
    println!(
        "{txs} transactions of {rows_per_tx} row(s): raw decoding {:>8.0} rows/s; materialized {:>8.0} rows/s ({:.0}% of raw); \
         write floor {:.3} s ({:.0}% of raw), materialized {:.2}x the floor; this process's CPU {:.0} us/row; \
         groups: preparing {:.3} s, writing {:.3} s ({:.2}x the floor)",
        ROWS as f64 / raw_s,
        ROWS as f64 / mat_s,
        100.0 * raw_s / mat_s,
        floor_s,
        100.0 * raw_s / floor_s,
        mat_s / floor_s,
        cpu_us / ROWS as f64,
        done.preparing.as_secs_f64(),
        done.writing.as_secs_f64(),
        done.writing.as_secs_f64() / floor_s,
    );
}

/// The materializer's output tables: what its write floor writes again.
const OUTPUT: [&str; 4] = [
    "projections",
    "scope_members",
    "scope_effects",
    "source_transactions",
];

async fn latency(cluster: &PgCluster) {
    let store = example_store(cluster, "latency").await;
    let pool = store.pool().clone();
    let _engine = Engine::start(store.clone(), example_config(|s| s))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut samples = Vec::new();
    for i in 0..600 {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO public.notes (id, owner_id, title) VALUES (gen_random_uuid(), $1, 'x')",
        )
        .bind(format!("user-{}", i % 50))
        .execute(&mut *tx)
        .await
        .unwrap();
        let lsn = lsn_now(&mut tx).await;
        tx.commit().await.unwrap();
        let committed = Instant::now();
        while progress(&pool).await < lsn {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        if i >= 100 {
            samples.push(committed.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    samples.sort();
    let pct = |p: f64| samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)];
    println!(
        "commit-to-materialized latency, {} single-row transactions at ~80/s: p50 {:.2} ms, p99 {:.2} ms",
        samples.len(),
        pct(0.50).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3
    );
}

#[tokio::main]
async fn main() {
    // Warnings (a failed store call, a reopened feed) would explain a slow run.
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .try_init();
    let cluster = PgCluster::temp().unwrap();
    println!("materializer on the notes example, {ROWS} inserted rows per workload");
    let sizes = std::env::var("SYNCHRO_BENCH_TX_ROWS").unwrap_or_else(|_| "1,100".into());
    for rows in sizes.split(',') {
        let rows: usize = rows.trim().parse().expect("SYNCHRO_BENCH_TX_ROWS: numbers");
        throughput(&cluster, &format!("tx_of_{rows}"), rows).await;
    }
    latency(&cluster).await;
}
