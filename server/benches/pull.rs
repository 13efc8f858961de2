//! Pull latency and throughput over HTTP on PostgreSQL (issue 11), through
//! the real adapter, engine, materializer and PgStore on a throwaway cluster:
//!
//! - steady pull: a 1,000-row scope with no change since the cursor;
//! - changed pull: 100 rows of that scope updated, one page of 100 changes;
//! - catch-up: 100,000 effects pulled from the stream's start at limit 1000,
//!   against a plain keyset SQL read of the same effect rows (1000 per
//!   query) measured in the same run, before and after the pull (averaged),
//!   on a vacuumed table.
//!
//! Each client keeps one HTTP/1.1 connection (keep-alive). The steady and
//! changed pulls are applied by `invariants::pull::Replica` (every row and
//! scope checksum verified, in the measured time); the catch-up client only
//! parses each page and installs its cursors, so that it measures the
//! server (its pages are the same bytes the tests verify).
//! Run: `cargo bench -p server --bench pull`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a load tool fails loudly

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actors::Engine;
use actors::config::AuthConfig;
use actors::store::{Store, StoreTx};
use actors::testkit::push_config;
use protocol::json;
use protocol::position::Boundary;
use server::adapter::{AppState, router};
use server::auth::{Authenticator, hs256_secret};
use sqlx::Row;
use store_pg::PgStore;
use store_pg::cluster::PgCluster;

#[path = "served.rs"]
mod served;
use served::Served;
#[path = "pulling.rs"]
mod pulling;
use pulling::{Client, Http, ms, percentile};

const SCOPE_ROWS: usize = 1_000;
const CHANGED: usize = 100;
const STEADY_ROUNDS: usize = 300;
const CHANGED_ROUNDS: usize = 30;
/// `SYNCHRO_BENCH_CATCH_UP` overrides it for a quick look.
const CATCH_UP: usize = 100_000;

/// Waits until capture has materialized the transaction whose commit
/// record starts after `lsn`.
async fn settle(store: &PgStore, lsn: u64) {
    loop {
        let mut tx = store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        drop(tx);
        if matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn >= lsn) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `sql` in its own transaction; where its commit record will start.
async fn write(store: &PgStore, sql: &str, text: &str, a: i64, b: i64) -> u64 {
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query(sql)
        .bind(text)
        .bind(a)
        .bind(b)
        .execute(&mut *tx)
        .await
        .unwrap();
    let lsn: i64 = sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0')::bigint")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    lsn as u64
}

async fn insert_notes(store: &PgStore, owner: &str, from: usize, n: usize) -> u64 {
    write(
        store,
        "INSERT INTO public.notes (id, owner_id, title, pinned, updated_at) \
         SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(g), 12, '0'))::uuid, $1, 'note ' || g, false, \
                '2026-07-18 14:00:01+00' \
         FROM generate_series($2::bigint, $3::bigint) g",
        owner,
        from as i64,
        (from + n - 1) as i64,
    )
    .await
}

/// The plain SQL read of a scope's effect rows with the rows they serve
/// (their projections', ADR 0037), 1000 per keyset query.
async fn raw_read(store: &PgStore, scope: &str) -> (Duration, usize) {
    let start = Instant::now();
    let mut after = (-1i64, 0i64, 0i64);
    let mut n = 0;
    loop {
        let rows = sqlx::query(
            "SELECT e.*, p.row_json, p.version AS row_version, p.digest, p.schema_version \
             FROM synchro.scope_effects e LEFT JOIN synchro.projections p \
             ON e.op <> 1 AND p.table_id = e.table_id AND p.identity = e.identity \
             WHERE e.scope_id = $1 \
             AND (e.commit_lsn, e.event_ordinal, e.effect_ordinal) > ($2, $3, $4) \
             ORDER BY e.commit_lsn, e.event_ordinal, e.effect_ordinal LIMIT 1000",
        )
        .bind(scope)
        .bind(after.0)
        .bind(after.1)
        .bind(after.2)
        .fetch_all(store.pool())
        .await
        .unwrap();
        let Some(last) = rows.last() else {
            return (start.elapsed(), n);
        };
        n += rows.len();
        after = (
            last.get("commit_lsn"),
            last.get("event_ordinal"),
            last.get("effect_ordinal"),
        );
    }
}

#[tokio::main]
async fn main() {
    let cluster = PgCluster::temp().unwrap();
    let store = store_pg::example_store(&cluster, "pull_bench").await;
    let secrets = tempfile::tempdir().unwrap();
    let secret_file = secrets.path().join("hs256.secret").display().to_string();
    let secret = hs256_secret(std::path::Path::new(&secret_file)).unwrap();
    let auth = Arc::new(
        Authenticator::from_config(&AuthConfig::hs256(&secret_file))
            .await
            .unwrap(),
    );
    let mut config = push_config();
    config.limits = actors::testkit::benchmark_limits();
    // The floor stays at the stream's start: the catch-up pulls from there,
    // and no compaction pass during the bench may make that cursor stale.
    config.retention.compact_interval_seconds = 86_400;
    let engine = Engine::start(store.clone(), config).await.unwrap();
    // The notes below reach clients as changes only once the stream has
    // begun: written before, a baseline would take them, which stores no
    // effects (ADR 0033), and the origin cursors would miss them.
    actors::testkit::stream_begun(&store).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut state = AppState::new(engine.clone(), auth, &Default::default());
    // `SYNCHRO_BENCH_METRICS=1`: requests counted, and /metrics scraped
    // every second (Prometheus scrapes every 15 s), to measure the cost.
    if std::env::var("SYNCHRO_BENCH_METRICS").is_ok_and(|v| v == "1") {
        let metrics = Arc::new(server::metrics::Metrics::new().unwrap());
        state = state.with_metrics(metrics.clone());
        let store = store.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                metrics.scrape(&engine, &store).await;
            }
        });
        println!("with /metrics: requests counted, scraped every second");
    }
    tokio::spawn(async move {
        axum::serve(listener, router(state)).await.unwrap();
    });
    println!(
        "pull over HTTP on PostgreSQL {} (adapter + engine + PgStore)",
        cluster.dir().display()
    );

    let which = std::env::var("SYNCHRO_BENCH").unwrap_or_default();
    if which != "rebuild" {
        pull_bench(&store, addr, &secret).await;
    }
    if which != "pull" {
        rebuild_bench(
            &store,
            addr,
            &secret,
            &cluster.url("pull_bench"),
            &secret_file,
        )
        .await;
    }
}

/// Steady, changed and catch-up pulls, and the plain read.
async fn pull_bench(store: &PgStore, addr: SocketAddr, secret: &[u8]) {
    let store = store.clone();
    // A 1,000-row scope, pulled to its end.
    let lsn = insert_notes(&store, "steady", 1, SCOPE_ROWS).await;
    settle(&store, lsn).await;
    let mut c = Client::connect(&store, addr, secret, "steady").await;
    assert_eq!(c.sync(1000).await, SCOPE_ROWS);
    let mut steady = Vec::with_capacity(STEADY_ROUNDS);
    for _ in 0..STEADY_ROUNDS {
        let start = Instant::now();
        let (more, n) = c.pull(1000).await;
        steady.push(start.elapsed());
        assert!(!more && n == 0);
    }
    steady.sort();
    println!(
        "steady pull, unchanged {SCOPE_ROWS}-row scope:      p50 {:>7.3} ms  p99 {:>7.3} ms",
        ms(percentile(&steady, 0.5)),
        ms(percentile(&steady, 0.99))
    );

    // 100 of its rows changed, then one page of 100 changes.
    let mut changed = Vec::with_capacity(CHANGED_ROUNDS);
    for r in 0..CHANGED_ROUNDS {
        let lsn = write(
            &store,
            "UPDATE public.notes SET title = $1 WHERE owner_id = 'steady' AND id IN \
             (SELECT id FROM public.notes WHERE owner_id = 'steady' ORDER BY id LIMIT $2 + $3)",
            &format!("round {r}"),
            CHANGED as i64,
            0,
        )
        .await;
        settle(&store, lsn).await;
        let start = Instant::now();
        let (more, n) = c.pull(1000).await;
        changed.push(start.elapsed());
        assert!(!more && n == CHANGED, "{n}");
    }
    changed.sort();
    println!(
        "changed pull, {CHANGED} of {SCOPE_ROWS} rows:             p50 {:>7.3} ms  p99 {:>7.3} ms",
        ms(percentile(&changed, 0.5)),
        ms(percentile(&changed, 0.99))
    );

    // Catch-up of 100,000 effects at limit 1000, and the plain read.
    let catch_up = std::env::var("SYNCHRO_BENCH_CATCH_UP")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CATCH_UP);
    let mut lsn = 0;
    for batch in 0..(catch_up / 10_000) {
        lsn = insert_notes(&store, "catchup", 1_000_000 + batch * 10_000, 10_000).await;
    }
    settle(&store, lsn).await;
    // Autovacuum would otherwise run during one measurement and not the
    // other: both start from a vacuumed, analyzed table.
    sqlx::raw_sql(
        "VACUUM ANALYZE synchro.scope_effects, synchro.projections, synchro.scope_members",
    )
    .execute(store.pool())
    .await
    .unwrap();
    let (raw_before, _) = raw_read(&store, "user:catchup").await;
    let mut c = Client::connect(&store, addr, secret, "catchup").await;
    let start = Instant::now();
    let mut n = 0;
    let mut round_trips = Duration::ZERO;
    loop {
        let (more, k, rt) = c.pull_cursors(1000).await;
        n += k;
        round_trips += rt;
        if !more {
            break;
        }
    }
    let pull = start.elapsed();
    assert_eq!(n, catch_up);
    let (raw_after, raw_n) = raw_read(&store, "user:catchup").await;
    assert_eq!(raw_n, catch_up);
    // The plain read before and after the pull, averaged.
    let raw = (raw_before + raw_after) / 2;
    println!(
        "catch-up, {catch_up} effects at limit 1000:   {:>7.0} ms  {:>7.0} changes/s",
        ms(pull),
        n as f64 / pull.as_secs_f64()
    );
    println!(
        "  of which HTTP round trips:             {:>7.0} ms",
        ms(round_trips)
    );
    println!(
        "plain SQL read of the same effect rows:  {:>7.0} ms  round trips/raw {:.2}x",
        ms(raw),
        round_trips.as_secs_f64() / raw.as_secs_f64()
    );
    let _ = c.user;
}

/// The rows a rebuild stages and serves (`SYNCHRO_BENCH_REBUILD` overrides it).
const REBUILD_ROWS: usize = 100_000;
/// The rows staged while the server's peak memory is measured
/// (`SYNCHRO_BENCH_STAGE_ROWS` overrides it).
const STAGE_ROWS: usize = 1_000_000;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A process's resident set now, and its peak since the last reset, in KiB.
fn rss_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// A connected client's rebuild request of `scope` at limit 1000.
fn rebuild_body(
    client_id: &str,
    schema: &json::Value,
    scope: &str,
    rebuild_id: &str,
    cursor: json::Value,
) -> Vec<u8> {
    json::to_canonical(&json::object([
        ("client_id", json::Value::string(client_id)),
        ("client_generation", json::Value::int(1)),
        ("schema", schema.clone()),
        ("scope", json::Value::string(scope)),
        ("rebuild_id", json::Value::string(rebuild_id)),
        ("cursor", cursor),
        ("limit", json::Value::int(1000)),
    ]))
}

/// Inserts `rows` notes of `owner` in batches of 10,000 and waits for capture.
async fn insert_many(store: &PgStore, owner: &str, from: usize, rows: usize) {
    let mut lsn = 0;
    for batch in 0..rows.div_ceil(10_000) {
        let n = (rows - batch * 10_000).min(10_000);
        lsn = insert_notes(store, owner, from + batch * 10_000, n).await;
    }
    settle(store, lsn).await;
    sqlx::raw_sql(
        "VACUUM ANALYZE synchro.scope_effects, synchro.projections, synchro.scope_members",
    )
    .execute(store.pool())
    .await
    .unwrap();
}

/// The plain `INSERT ... SELECT` of a scope's staged columns into a table
/// of one row per staged row, rolled back.
async fn plain_stage(store: &PgStore, scope: &str) -> Duration {
    let mut tx = store.pool().begin().await.unwrap();
    sqlx::query(
        "CREATE TEMP TABLE plain_stage (session_id uuid, ordinal bigint, table_id text, \
         identity bytea, row_json text, version text, digest bytea, \
         PRIMARY KEY (session_id, ordinal)) ON COMMIT DROP",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let start = Instant::now();
    sqlx::query(
        "INSERT INTO plain_stage (session_id, ordinal, table_id, identity, row_json, version, digest) \
         SELECT gen_random_uuid(), row_number() OVER (ORDER BY m.identity) - 1, p.table_id, \
         p.identity, p.row_json, p.version, p.digest \
         FROM synchro.scope_members m \
         JOIN synchro.projections p ON p.table_id = m.table_id AND p.identity = m.identity \
         WHERE m.scope_id = $1",
    )
    .bind(scope)
    .execute(&mut *tx)
    .await
    .unwrap();
    let took = start.elapsed();
    tx.rollback().await.unwrap();
    took
}

/// What the rebuild tables hold per staged row (every relation of them,
/// indexes and TOAST included), and what the projections hold per row.
async fn stored_bytes_per_row(store: &PgStore, staged: usize) -> (f64, f64) {
    let (kept, projected, rows): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT coalesce(sum(pg_total_relation_size(to_regclass(t))), 0)::int8 \
                 FROM unnest(ARRAY['synchro.rebuild_stage', 'synchro.rebuild_pages']) AS t), \
                pg_total_relation_size('synchro.projections'), \
                (SELECT count(*) FROM synchro.projections)",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    (kept as f64 / staged as f64, projected as f64 / rows as f64)
}

/// Staging and serving a scope over HTTP, against a plain `INSERT ...
/// SELECT` of the same rows; and the server's peak memory staging a larger one.
async fn rebuild_bench(
    store: &PgStore,
    addr: SocketAddr,
    secret: &[u8],
    database_url: &str,
    secret_file: &str,
) {
    let rows = env_or("SYNCHRO_BENCH_REBUILD", REBUILD_ROWS);
    insert_many(store, "rebuild", 5_000_000, rows).await;
    let bearer = pulling::bearer(secret, "rebuild");
    let mut http = Http::open(addr, bearer).await;
    let connect =
        json::to_canonical(&actors::testkit::ConnectBody::fresh("rebuild-client").to_json());
    assert_eq!(http.post("/sync/connect", connect).await.0, 200);
    let schema = {
        let mut tx = store.begin().await.unwrap();
        tx.manifests()
            .await
            .unwrap()
            .pop()
            .unwrap()
            .reference()
            .to_json()
    };
    let plain_before = plain_stage(store, "user:rebuild").await;
    let start = Instant::now();
    let id = "00000000-0000-4000-8000-00000000b001";
    let mut cursor = json::Value::Null;
    let mut first = None;
    let mut served = 0;
    loop {
        let body = rebuild_body(
            "rebuild-client",
            &schema,
            "user:rebuild",
            id,
            cursor.clone(),
        );
        let (status, page) = http.post("/sync/rebuild", body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&page));
        first.get_or_insert(start.elapsed());
        let v = json::parse(&page).unwrap();
        let o = v.as_object().unwrap();
        if let json::Value::Array(r) = &o["records"] {
            served += r.len();
        }
        if o["has_more"] != json::Value::Bool(true) {
            break;
        }
        cursor = o["cursor"].clone();
    }
    let total = start.elapsed();
    assert_eq!(served, rows);
    let plain_after = plain_stage(store, "user:rebuild").await;
    let plain = (plain_before + plain_after) / 2;
    let first = first.unwrap();
    let (kept, projected) = stored_bytes_per_row(store, rows).await;
    println!(
        "rebuild of {rows} rows at limit 1000 over HTTP: {:>7.0} ms  {:>7.0} rows/s",
        ms(total),
        rows as f64 / total.as_secs_f64()
    );
    println!(
        "  first request (staging, sealing, page 1): {:>7.0} ms; plain INSERT ... SELECT {:>5.0} ms: {:.2}x",
        ms(first),
        ms(plain),
        first.as_secs_f64() / plain.as_secs_f64()
    );
    println!(
        "  kept for the session once every page was answered: {kept:>5.0} bytes per staged row; \
         a projection {projected:>5.0} bytes per row: {:.2}x",
        kept / projected
    );

    // Peak memory while staging a larger scope, of a `synchro serve`
    // process of its own on the same database (a capture standby: this
    // process leads capture), so that its memory is the server's alone.
    let big = env_or("SYNCHRO_BENCH_STAGE_ROWS", STAGE_ROWS);
    insert_many(store, "rebuildbig", 10_000_000, big).await;
    let server = Served::start(database_url, secret_file).await;
    let bearer = pulling::bearer(secret, "rebuildbig");
    let mut http = Http::open(server.addr, bearer).await;
    let connect =
        json::to_canonical(&actors::testkit::ConnectBody::fresh("rebuildbig-client").to_json());
    assert_eq!(http.post("/sync/connect", connect).await.0, 200);
    // Linux: writing 5 resets the peak resident set to the current one.
    let pid = server.child.id();
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
    let (before, _) = rss_kib(pid);
    let start = Instant::now();
    let body = rebuild_body(
        "rebuildbig-client",
        &schema,
        "user:rebuildbig",
        id,
        json::Value::Null,
    );
    let (status, page) = http.post("/sync/rebuild", body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&page));
    let staged = start.elapsed();
    let (_, peak) = rss_kib(pid);
    println!(
        "staging {big} rows: {:>7.0} ms; server process RSS {:.1} MB before, peak {:.1} MB (+{:.1} MB)",
        ms(staged),
        before as f64 / 1024.0,
        peak as f64 / 1024.0,
        (peak.saturating_sub(before)) as f64 / 1024.0
    );
}
