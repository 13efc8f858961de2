//! Push latency and throughput on the example app (issue 5):
//!
//! - one client pushing 100-mutation batches (inserts, then updates with
//!   their current base versions): latency p50/p99 and mutations per
//!   second, against the same DML run directly over one connection in one
//!   transaction (same triggers, same capture), and against one set-based
//!   statement per batch (the floor), measured in the same run;
//! - 16 clients pushing 100-insert batches at once: mutations per second.
//!
//! Run: `cargo bench -p store-pg --bench push`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a load tool fails loudly

use std::time::{Duration, Instant};

use actors::Engine;
use actors::testkit::{
    PushClient, note_columns, note_id, note_mutation, outcome, push_config, version_of,
};
use sqlx::PgPool;
use store_pg::cluster::PgCluster;
use store_pg::example_store;

const BATCH: u64 = 100;
const ROUNDS: u64 = 60;
const CLIENTS: u64 = 16;
const CONCURRENT_ROUNDS: u64 = 10;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn report(what: &str, mut times: Vec<Duration>) -> Duration {
    times.sort();
    let (p50, p99) = (percentile(&times, 0.5), percentile(&times, 0.99));
    let total: Duration = times.iter().sum();
    let rate = (times.len() as u64 * BATCH) as f64 / total.as_secs_f64();
    println!(
        "{what:<34} p50 {:>7.2} ms  p99 {:>7.2} ms  {:>8.0} mutations/s",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        rate
    );
    p50
}

/// Key `n` of round `r`, client `c`.
fn key(c: u64, r: u64, n: u64) -> u64 {
    (c << 32) + (r << 12) + n
}

/// The same inserts and updates as plain SQL in one transaction.
async fn raw_round(pool: &PgPool, r: u64, update: bool) -> Duration {
    let start = Instant::now();
    let mut tx = pool.begin().await.unwrap();
    for n in 0..BATCH {
        let id = note_id(key(999, r, n));
        if update {
            sqlx::query("UPDATE public.notes SET title = $2, pinned = $3, updated_at = $4::timestamptz WHERE id = $1::uuid")
                .bind(&id)
                .bind("raw updated")
                .bind(true)
                .bind("2026-07-18 14:00:01+00")
                .execute(&mut *tx)
                .await
                .unwrap();
        } else {
            sqlx::query(
                "INSERT INTO public.notes (id, owner_id, title, pinned, updated_at) \
                 VALUES ($1::uuid, $2, $3, $4, $5::timestamptz)",
            )
            .bind(&id)
            .bind("bench")
            .bind("raw")
            .bind(false)
            .bind("2026-07-18 14:00:01+00")
            .execute(&mut *tx)
            .await
            .unwrap();
        }
    }
    tx.commit().await.unwrap();
    start.elapsed()
}

/// The same inserts and updates as one set-based statement in one
/// transaction: the least a batch's writes can cost with the same triggers.
async fn set_round(pool: &PgPool, r: u64, update: bool) -> Duration {
    let ids: Vec<String> = (0..BATCH).map(|n| note_id(key(998, r, n))).collect();
    let start = Instant::now();
    let mut tx = pool.begin().await.unwrap();
    let statement = if update {
        "UPDATE public.notes AS n SET title = 'set updated', pinned = true, \
         updated_at = '2026-07-18 14:00:01+00'::timestamptz \
         FROM unnest($1::uuid[]) AS u(id) WHERE n.id = u.id"
    } else {
        "INSERT INTO public.notes (id, owner_id, title, pinned, updated_at) \
         SELECT id, 'bench', 'set', false, '2026-07-18 14:00:01+00'::timestamptz \
         FROM unnest($1::uuid[]) AS u(id)"
    };
    let done = sqlx::query(statement)
        .bind(&ids)
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_eq!(done.rows_affected(), BATCH);
    tx.commit().await.unwrap();
    start.elapsed()
}

async fn push_round(c: &PushClient, r: u64, bases: Option<&[String]>) -> (Duration, Vec<String>) {
    let s = c.schema.clone();
    let mutations = (0..BATCH)
        .map(|n| {
            let id = note_id(key(0, r, n));
            match bases {
                None => note_mutation(
                    key(0, r, n),
                    &id,
                    &s,
                    "insert",
                    None,
                    Some(note_columns("pushed")),
                ),
                Some(b) => note_mutation(
                    key(1, r, n),
                    &id,
                    &s,
                    "update",
                    Some(&b[n as usize]),
                    Some(note_columns("updated")),
                ),
            }
        })
        .collect();
    let batch = if bases.is_some() { 10_000 + r } else { r };
    let body = c.batch(batch, mutations, false);
    let start = Instant::now();
    let (status, response, _) = c.push(&body).await;
    let elapsed = start.elapsed();
    assert_eq!(status, 200);
    let versions = (0..BATCH)
        .map(|n| {
            let m = if bases.is_some() {
                key(1, r, n)
            } else {
                key(0, r, n)
            };
            let (accepted, o) = outcome(&response, m);
            assert!(accepted, "{o:?}");
            version_of(&o)
        })
        .collect();
    (elapsed, versions)
}

#[tokio::main]
async fn main() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "push_bench").await;
    let pool = store.pool().clone();
    // Production capture settings (the suite's config polls every 20 ms).
    let mut config = push_config();
    config.capture = actors::config::CaptureConfig::default();
    config.limits = actors::testkit::benchmark_limits();
    let engine = Engine::start(store.clone(), config).await.unwrap();
    let c = PushClient::connect(&engine, "bench", "bench-0").await;
    println!("{BATCH}-mutation batches, {ROUNDS} rounds each, one client:");
    // Warm both paths (connections, plans) before measuring.
    for r in 0..5 {
        raw_round(&pool, 10_000 + r, false).await;
        push_round(&c, 20_000 + r, None).await;
    }
    let (mut raw_ins, mut raw_upd, mut push_ins, mut push_upd) = (vec![], vec![], vec![], vec![]);
    let (mut set_ins, mut set_upd) = (vec![], vec![]);
    for r in 0..ROUNDS {
        // Interleaved, so all see the same machine and the same capture load.
        raw_ins.push(raw_round(&pool, r, false).await);
        set_ins.push(set_round(&pool, r, false).await);
        let (t, versions) = push_round(&c, r, None).await;
        push_ins.push(t);
        raw_upd.push(raw_round(&pool, r, true).await);
        set_upd.push(set_round(&pool, r, true).await);
        push_upd.push(push_round(&c, r, Some(&versions)).await.0);
    }
    let ri = report("raw DML, 100 inserts", raw_ins);
    let si = report("set-based DML, 100 inserts", set_ins);
    let pi = report("push, 100 inserts", push_ins);
    let ru = report("raw DML, 100 updates", raw_upd);
    let su = report("set-based DML, 100 updates", set_upd);
    let pu = report("push, 100 updates (compare-and-swap)", push_upd);
    println!(
        "push / raw at p50: inserts {:.2}x, updates {:.2}x",
        pi.as_secs_f64() / ri.as_secs_f64(),
        pu.as_secs_f64() / ru.as_secs_f64()
    );
    println!(
        "push / set-based at p50: inserts {:.2}x, updates {:.2}x",
        pi.as_secs_f64() / si.as_secs_f64(),
        pu.as_secs_f64() / su.as_secs_f64()
    );

    println!("{CLIENTS} clients at once, {CONCURRENT_ROUNDS} batches of {BATCH} inserts each:");
    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        clients
            .push(PushClient::connect(&engine, &format!("user-{i}"), &format!("many-{i}")).await);
    }
    let start = Instant::now();
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            tokio::spawn(async move {
                let s = c.schema.clone();
                let mut times = Vec::new();
                for r in 0..CONCURRENT_ROUNDS {
                    let mutations = (0..BATCH)
                        .map(|n| {
                            let k = key(100 + i as u64, r, n);
                            note_mutation(
                                k,
                                &note_id(k),
                                &s,
                                "insert",
                                None,
                                Some(note_columns("many")),
                            )
                        })
                        .collect();
                    let body = c.batch(50_000 + r, mutations, false);
                    let t = Instant::now();
                    let (status, _, _) = c.push(&body).await;
                    assert_eq!(status, 200);
                    times.push(t.elapsed());
                }
                times
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let wall = start.elapsed();
    report(&format!("push, {CLIENTS} clients (per batch)"), all);
    println!(
        "{CLIENTS} clients: {:.0} mutations/s overall ({} mutations in {:.2} s)",
        (CLIENTS * CONCURRENT_ROUNDS * BATCH) as f64 / wall.as_secs_f64(),
        CLIENTS * CONCURRENT_ROUNDS * BATCH,
        wall.as_secs_f64()
    );
}
