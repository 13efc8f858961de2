//! Raw pgoutput decoding throughput: the SQL decoding functions (one call,
//! and batches with slot advance) against streaming replication
//! (pgwire-replication), on the same WAL, in the same run. Every message is
//! decoded with `store_pg::pgoutput`. Input to the ChangeFeed choice of
//! issue 4 (docs/PERFORMANCE.md).
//! Run: `cargo bench -p store-pg --bench decoding`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a load tool fails loudly

use std::time::Instant;

use pgwire_replication::{Lsn, ReplicationClient, ReplicationConfig, ReplicationEvent};
use sqlx::PgPool;
use store_pg::cluster::PgCluster;
use store_pg::pgoutput::{Message, decode};

const ROWS: usize = 20_000;
const OPTIONS: &str = "'proto_version', '1', 'publication_names', 'bench_pub', 'messages', 'true'";

/// Decodes one message and counts it if it is a row event.
fn row_events(bytes: &[u8]) -> usize {
    match decode(bytes).expect("decodes") {
        Message::Insert { .. } | Message::Update { .. } | Message::Delete { .. } => 1,
        _ => 0,
    }
}

async fn sql_one_call(pool: &PgPool, db: &str) -> usize {
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(&format!(
        "SELECT data FROM pg_logical_slot_peek_binary_changes('{db}_once', NULL, NULL, {OPTIONS})"
    ))
    .fetch_all(pool)
    .await
    .unwrap();
    rows.iter().map(|r| row_events(r)).sum()
}

async fn sql_batched(pool: &PgPool, db: &str, batch: i32) -> usize {
    let mut total = 0;
    loop {
        let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(&format!(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes('{db}_batched', NULL, {batch}, {OPTIONS})"
        ))
        .fetch_all(pool)
        .await
        .unwrap();
        let Some((last, _)) = rows.last() else {
            return total;
        };
        total += rows.iter().map(|(_, d)| row_events(d)).sum::<usize>();
        sqlx::query(&format!(
            "SELECT pg_replication_slot_advance('{db}_batched', '{last}'::pg_lsn)"
        ))
        .execute(pool)
        .await
        .unwrap();
    }
}

async fn streaming(cluster: &PgCluster, db: &str, end: Lsn) -> usize {
    let config = ReplicationConfig::unix(
        cluster.dir().display().to_string(),
        5432,
        "postgres",
        "",
        db,
        format!("{db}_stream"),
        "bench_pub",
    )
    .with_stop_lsn(end);
    let mut client = ReplicationClient::connect(config).await.unwrap();
    let mut total = 0;
    while let Some(event) = client.recv().await.unwrap() {
        match event {
            ReplicationEvent::XLogData { data, .. } => total += row_events(&data),
            ReplicationEvent::StoppedAt { .. } => break,
            _ => {}
        }
    }
    total
}

async fn run(cluster: &PgCluster, db: &str, rows_per_tx: usize) {
    let pool = PgPool::connect_with(cluster.create_database(db).await.unwrap())
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE bench_rows (id bigint PRIMARY KEY, owner text NOT NULL, title text NOT NULL, body text);
         CREATE PUBLICATION bench_pub FOR TABLE bench_rows;",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Slots are cluster-wide: one set per database, all created before the workload.
    for kind in ["once", "batched", "stream"] {
        sqlx::query(&format!(
            "SELECT pg_create_logical_replication_slot('{db}_{kind}', 'pgoutput')"
        ))
        .execute(&pool)
        .await
        .unwrap();
    }
    let txs = ROWS / rows_per_tx;
    sqlx::raw_sql(&format!(
        "DO $$ BEGIN FOR t IN 0..{} LOOP
           INSERT INTO bench_rows SELECT t * {rows_per_tx} + i, 'user-' || (i % 50), 'title ' || i, repeat('x', 80)
             FROM generate_series(1, {rows_per_tx}) i;
           COMMIT;
         END LOOP; END $$",
        txs - 1
    ))
    .execute(&pool)
    .await
    .unwrap();
    let end: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    let end = Lsn::parse(&end).unwrap();

    let report = |name: &str, rows: usize, start: Instant| {
        let s = start.elapsed().as_secs_f64();
        println!(
            "  {name:<34} {rows:>6} row events in {:>7.1} ms = {:>8.0} rows/s",
            s * 1e3,
            rows as f64 / s
        );
        assert_eq!(rows, ROWS, "{name} saw every row event");
    };
    println!("{txs} transactions of {rows_per_tx} row(s):");
    let start = Instant::now();
    report("SQL peek, one call", sql_one_call(&pool, db).await, start);
    let start = Instant::now();
    report(
        "SQL peek 1000 + advance, batched",
        sql_batched(&pool, db, 1000).await,
        start,
    );
    let start = Instant::now();
    report(
        "streaming (pgwire-replication)",
        streaming(cluster, db, end).await,
        start,
    );
}

#[tokio::main]
async fn main() {
    let cluster = PgCluster::temp().unwrap();
    println!(
        "raw pgoutput decoding, {ROWS} row events per workload, decoded with store_pg::pgoutput"
    );
    run(&cluster, "one_row_tx", 1).await;
    run(&cluster, "hundred_row_tx", 100).await;
}
