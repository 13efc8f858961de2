//! The baseline of an existing database (ADR 0011, issue 13): a `synchro
//! serve` process adopts a database that already holds 1,000,000 rows
//! (notes, and shares of every fourth note), against a plain `COPY (SELECT
//! ...) TO STDOUT` of the same tables read by a client in the same run.
//! Reports rows/s, the ratio to COPY, and the server's peak RSS. Then, as
//! the floor of any baseline that materializes: the time to write the
//! baseline's own projections, membership and dependency rows again into
//! empty tables of the same shape and indexes (`INSERT ... SELECT`, one
//! transaction, nothing computed), and the baseline's ratio to it.
//! Then the rematerialization of a config change (ADR 0020): the baseline
//! runs without the notes' `body`, and a restart syncs it, so every note is
//! re-read, projected and delivered again; its time, rows/s, ratio to the
//! same write floor measured after it, and the server's peak RSS. Meanwhile
//! readers of another scope (`templates_public`, 1,000 rows, which the
//! change does not touch) pull steadily, and their pull latency is compared
//! with the same readers' on the same process once it is done (idle).
//!
//! Between the two, on a second database of the same rows, a baseline is
//! killed (`SIGKILL`) once half its rows committed, and a new process
//! hands the rest over to re-reads (ADR 0030): the time to the kill, from
//! the restart to nothing owed, and their sum against the uninterrupted
//! baseline.
//!
//! Run: `cargo bench -p server --bench baseline` (`SYNCHRO_BENCH_BASELINE_ROWS`
//! sets the row count, 1,250,000 by default: 1,000,000 notes and 250,000
//! shares; `SYNCHRO_BENCH_CHUNK_ROWS` the rematerialization's chunk, 512 by
//! default; `SYNCHRO_BENCH_REMAT_SHARE` its share of wall time, 100 percent
//! by default; `SYNCHRO_BENCH_REMAT=0` stops before the rematerialization).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a load tool fails loudly

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actors::store::{Store, StoreTx};
use futures_util::StreamExt;
use sqlx::PgPool;
use store_pg::cluster::PgCluster;
use store_pg::{PgStore, write_floor};

#[path = "served.rs"]
mod served;
use served::Served;
#[path = "pulling.rs"]
mod pulling;
use pulling::{Client, ms, percentile};

/// Readers of the templates during and after the rematerialization.
const READERS: usize = 4;
/// Each reader's pause between pulls (about 80 pulls a second in all).
const READER_THINK: Duration = Duration::from_millis(50);
/// How long the readers pull once the rematerialization is done. A minute
/// (about 4,500 pulls): over 20 s (1,500 pulls) the idle p99 alone moved
/// the ratio by a factor of two between runs.
const IDLE: Duration = Duration::from_secs(60);
/// The templates the readers hold.
const TEMPLATES: usize = 1_000;

/// A process's peak resident set, in KiB.
fn peak_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Reads `sql`'s COPY output to its end; the bytes read.
async fn copy_out(pool: &PgPool, sql: &str) -> usize {
    let mut conn = pool.acquire().await.unwrap();
    let mut stream = conn.copy_out_raw(sql).await.unwrap();
    let mut bytes = 0;
    while let Some(chunk) = stream.next().await {
        bytes += chunk.unwrap().len();
    }
    bytes
}

#[tokio::main]
async fn main() {
    let rows: usize = std::env::var("SYNCHRO_BENCH_BASELINE_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_250_000);
    let notes = rows * 4 / 5;
    let cluster = PgCluster::temp().unwrap();
    let store = store_pg::example_store(&cluster, "baseline_bench").await;
    let pool = store.pool().clone();
    fill(&pool, rows).await;

    let start = Instant::now();
    let bytes = copy_out(&pool, "COPY (SELECT * FROM public.note_shares) TO STDOUT").await
        + copy_out(&pool, "COPY (SELECT * FROM public.notes) TO STDOUT").await;
    let copy = start.elapsed();

    let secrets = tempfile::tempdir().unwrap();
    let secret_file = secrets.path().join("hs256.secret").display().to_string();
    let secret = server::auth::hs256_secret(std::path::Path::new(&secret_file)).unwrap();
    // The notes' `body` is not synced yet: the rematerialization below adds
    // it. The floor stays at the stream's start, so the readers' cursors
    // from its origin stay current.
    let without_body = |c: String| {
        let line = c
            .lines()
            .find(|l| l.contains("fld_notes_body"))
            .unwrap()
            .to_owned();
        c.replace(&format!("{line}\n"), "").replace(
            "[server]",
            "[retention]\ncompact_interval_seconds = 86400\n\n[server]",
        )
    };
    let server =
        Served::start_with(&cluster.url("baseline_bench"), &secret_file, without_body).await;
    // From the candidate slot's record to the baseline committed.
    let baseline = from_candidate(&pool, |done, _| done).await;
    let peak = peak_kib(server.child.id());
    let projected: i64 = sqlx::query_scalar("SELECT count(*) FROM synchro.projections")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        projected as usize,
        notes + TEMPLATES,
        "every note and template is projected"
    );
    let floor = write_floor(&pool, &OUTPUT).await;
    let baseline_peak = peak;
    println!(
        "baseline of {rows} rows: {:.2} s, {:.0} rows/s; write floor {:.2} s; \
         baseline {:.2}x the floor; server peak RSS {:.1} MB",
        baseline.as_secs_f64(),
        rows as f64 / baseline.as_secs_f64(),
        floor.as_secs_f64(),
        baseline.as_secs_f64() / floor.as_secs_f64(),
        baseline_peak as f64 / 1024.0,
    );
    drop(server);
    cut_at_half_way(&cluster, &secret_file, rows, baseline).await;
    if std::env::var("SYNCHRO_BENCH_REMAT").is_ok_and(|v| v == "0") {
        return;
    }
    // The rematerialization (ADR 0020): a restart with `body` synced, over
    // columns that all hold values, so every note is projected, digested
    // and delivered again.
    let start = Instant::now();
    let chunk_rows = std::env::var("SYNCHRO_BENCH_CHUNK_ROWS").unwrap_or_else(|_| "512".into());
    let share = std::env::var("SYNCHRO_BENCH_REMAT_SHARE").unwrap_or_else(|_| "100".into());
    let with_chunks = |c: String| {
        c.replace(
            "[server]",
            &format!(
                "[capture]\nrematerialize_chunk_rows = {chunk_rows}\n\
                 rematerialize_share = {share}\n\n\
                 [retention]\ncompact_interval_seconds = 86400\n\n[server]"
            ),
        )
    };
    let server =
        Served::start_with(&cluster.url("baseline_bench"), &secret_file, with_chunks).await;
    let readers = Readers::start(&store, server.addr, &secret).await;
    loop {
        let owed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM synchro.rematerializations WHERE pending")
                .fetch_one(&pool)
                .await
                .unwrap();
        if owed == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let remat = start.elapsed();
    let done = Instant::now();
    tokio::time::sleep(IDLE).await;
    let (during, idle) = readers.stop(done).await;
    let remat_peak = peak_kib(server.child.id());
    let reread: i64 = sqlx::query_scalar(
        "SELECT rows FROM synchro.rematerializations WHERE relation = 'public.notes'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(reread as usize, notes, "every note was re-read");
    let remat_floor = write_floor(&pool, &OUTPUT).await;
    println!(
        "rematerialization of {notes} notes (a field added over values, at a share of \
         {share}%): {:.2} s, {:.0} rows/s; \
         write floor {:.2} s, {:.2}x the floor; server peak RSS {:.1} MB",
        remat.as_secs_f64(),
        notes as f64 / remat.as_secs_f64(),
        remat_floor.as_secs_f64(),
        remat.as_secs_f64() / remat_floor.as_secs_f64(),
        remat_peak as f64 / 1024.0,
    );
    println!(
        "readers of templates_public ({READERS}, steady pulls every {} ms): \
         during the rematerialization p50 {:.2} ms, p99 {:.2} ms ({} pulls); \
         idle after it p50 {:.2} ms, p99 {:.2} ms ({} pulls); p99 {:.2}x idle",
        READER_THINK.as_millis(),
        ms(percentile(&during, 0.5)),
        ms(percentile(&during, 0.99)),
        during.len(),
        ms(percentile(&idle, 0.5)),
        ms(percentile(&idle, 0.99)),
        idle.len(),
        percentile(&during, 0.99).as_secs_f64() / percentile(&idle, 0.99).as_secs_f64(),
    );
    let peak = baseline_peak;
    println!(
        "baseline of {rows} rows ({notes} notes, {} shares): {:.2} s, {:.0} rows/s; \
         COPY of the same tables ({:.0} MB): {:.2} s; ratio {:.2}x; server peak RSS {:.1} MB; \
         write floor {:.2} s ({:.2}x COPY), baseline {:.2}x the floor",
        rows - notes,
        baseline.as_secs_f64(),
        rows as f64 / baseline.as_secs_f64(),
        bytes as f64 / 1e6,
        copy.as_secs_f64(),
        baseline.as_secs_f64() / copy.as_secs_f64(),
        peak as f64 / 1024.0,
        floor.as_secs_f64(),
        floor.as_secs_f64() / copy.as_secs_f64(),
        baseline.as_secs_f64() / floor.as_secs_f64()
    );
}

/// The time from the candidate slot's record until `reached(baseline_done,
/// baseline_chunks)` holds.
async fn from_candidate(pool: &PgPool, reached: impl Fn(bool, i64) -> bool) -> Duration {
    let mut began = None;
    loop {
        let slot: Option<(bool, i64)> =
            sqlx::query_as("SELECT baseline_done, baseline_chunks FROM synchro.capture_slot")
                .fetch_optional(pool)
                .await
                .unwrap();
        match slot {
            Some((done, chunks)) if reached(done, chunks) => {
                return began.map_or(Duration::ZERO, |b: Instant| b.elapsed());
            }
            Some(_) if began.is_none() => began = Some(Instant::now()),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Fills the example tables with `rows` rows that no trigger saw: four
/// fifths notes, the rest shares, and the templates.
async fn fill(pool: &PgPool, rows: usize) {
    let notes = rows * 4 / 5;
    sqlx::raw_sql(&format!(
        "INSERT INTO public.notes (id, owner_id, title, body, updated_at) \
         SELECT gen_random_uuid(), 'user-' || (g % 1000), 'note ' || g, repeat('x', 80), \
                '2026-07-18 14:00:00+00' FROM generate_series(1, {notes}) g; \
         INSERT INTO public.note_shares (note_id, team_id) \
         SELECT id, 'team-' || (row_number() OVER () % 50) FROM public.notes \
         ORDER BY id LIMIT {}; \
         INSERT INTO public.templates (id, name, body) \
         SELECT 'tpl-' || g, 'template ' || g, repeat('t', 80) FROM generate_series(1, {TEMPLATES}) g;",
        rows - notes
    ))
    .execute(pool)
    .await
    .unwrap();
    for sql in [
        "VACUUM ANALYZE public.notes, public.note_shares, public.templates",
        "CHECKPOINT",
    ] {
        sqlx::raw_sql(sql).execute(pool).await.unwrap();
    }
}

/// A baseline killed (`SIGKILL`) once half its rows are committed, then
/// restarted (ADR 0030): the slot is kept and the rows not yet read are
/// re-read. Its time to the killing, from the restart to nothing owed,
/// and in all, against the uninterrupted `baseline` of the same rows.
async fn cut_at_half_way(cluster: &PgCluster, secret_file: &str, rows: usize, baseline: Duration) {
    let store = store_pg::example_store(cluster, "baseline_cut").await;
    let pool = store.pool().clone();
    fill(&pool, rows).await;
    let half = (rows / 2).div_ceil(actors::capture::BASELINE_CHUNK_ROWS) as i64;
    let config = |c: String| {
        c.replace(
            "[server]",
            "[retention]\ncompact_interval_seconds = 86400\n\n[server]",
        )
    };
    let server = Served::start_with(&cluster.url("baseline_cut"), secret_file, config).await;
    let before = from_candidate(&pool, |_, chunks| chunks >= half).await;
    drop(server); // SIGKILL
    let restart = Instant::now();
    let _server = Served::start_with(&cluster.url("baseline_cut"), secret_file, config).await;
    loop {
        let owed: bool = sqlx::query_scalar(
            "SELECT NOT (SELECT baseline_done FROM synchro.capture_slot) \
               OR EXISTS (SELECT 1 FROM synchro.rematerializations WHERE pending)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        if !owed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = restart.elapsed();
    let projected: i64 = sqlx::query_scalar("SELECT count(*) FROM synchro.projections")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        projected as usize,
        rows * 4 / 5 + TEMPLATES,
        "every note and template is projected once"
    );
    let total = before + after;
    println!(
        "baseline of {rows} rows killed at half-way: {:.2} s to the kill, {:.2} s from the \
         restart to nothing owed, {:.2} s in all ({:.2}x the uninterrupted baseline)",
        before.as_secs_f64(),
        after.as_secs_f64(),
        total.as_secs_f64(),
        total.as_secs_f64() / baseline.as_secs_f64()
    );
}

/// Clients pulling only `templates_public`, steadily (nothing changes in
/// it), each pull's start and latency recorded.
struct Readers {
    running: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<(Instant, Duration)>>>,
}

impl Readers {
    /// Connects the readers and pulls their templates to the end; then
    /// each pulls again every [`READER_THINK`] until stopped.
    async fn start(store: &PgStore, addr: std::net::SocketAddr, secret: &[u8]) -> Readers {
        let running = Arc::new(AtomicBool::new(true));
        let mut tasks = Vec::new();
        for i in 0..READERS {
            let mut c = Client::connect(store, addr, secret, &format!("reader-{i}")).await;
            // Only the scope the change does not touch: the user's own is
            // fed by the notes, and answers 503 while they are re-read. (The
            // answer adds it back each time; the reader only installs cursors.)
            c.replica.scopes.retain(|s, _| s == "templates_public");
            let mut templates = 0;
            loop {
                let (more, n, _) = c.pull_cursors(1000).await;
                templates += n;
                if !more {
                    break;
                }
            }
            // The baseline's templates have no effects (ADR 0033): a
            // cursor minted at the origin pulls none of them; they are in
            // the scope's membership index, which a rebuild serves.
            assert_eq!(templates, 0, "no baseline effect");
            let mut tx = store.begin().await.unwrap();
            let scope = protocol::ids::ScopeId::parse("templates_public").unwrap();
            let members = tx.scope_members(&scope).await.unwrap().len();
            drop(tx);
            assert_eq!(members, TEMPLATES, "every template");
            let running = running.clone();
            tasks.push(tokio::spawn(async move {
                let mut samples = Vec::new();
                while running.load(Ordering::Relaxed) {
                    let start = Instant::now();
                    let (more, n, _) = c.pull_cursors(1000).await;
                    samples.push((start, start.elapsed()));
                    assert!(!more && n == 0, "nothing changes in the templates");
                    tokio::time::sleep(READER_THINK).await;
                }
                samples
            }));
        }
        Readers { running, tasks }
    }

    /// Stops the readers; their latencies before `done` and after it, each sorted.
    async fn stop(self, done: Instant) -> (Vec<Duration>, Vec<Duration>) {
        self.running.store(false, Ordering::Relaxed);
        let (mut during, mut idle) = (Vec::new(), Vec::new());
        for t in self.tasks {
            for (start, latency) in t.await.unwrap() {
                if start + latency <= done {
                    during.push(latency);
                } else if start >= done {
                    idle.push(latency);
                }
            }
        }
        during.sort();
        idle.sort();
        (during, idle)
    }
}

/// The baseline's output tables: what its write floor writes again.
const OUTPUT: [&str; 3] = ["projections", "scope_members", "dependency_rows"];
