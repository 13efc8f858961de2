//! Connect latency and throughput on PostgreSQL (embedded throwaway cluster),
//! through the real `Engine` and `PgStore`, without HTTP.
//! Run: `cargo bench -p server --bench connect`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a load tool fails loudly

use std::time::{Duration, Instant};

use actors::Engine;
use actors::testkit::{ConnectBody, example_config};
use protocol::json;
use store_pg::cluster::PgCluster;

/// Continuing connects per client after its first (fresh) one.
const ROUNDS: usize = 200;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

async fn client(engine: Engine, index: usize) -> Vec<Duration> {
    let user = format!("bench-user-{index}");
    let client_id = format!("bench-client-{index}");
    let first = engine
        .connect(
            &user,
            json::to_canonical(&ConnectBody::fresh(&client_id).to_json()),
            0,
        )
        .await;
    assert_eq!(first.status, 200);
    let body = json::to_canonical(
        &ConnectBody::after(&client_id, &json::parse(&first.body).unwrap()).to_json(),
    );
    let mut latencies = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        let reply = engine.connect(&user, body.clone(), 0).await;
        latencies.push(start.elapsed());
        assert_eq!(reply.status, 200);
    }
    latencies
}

#[tokio::main]
async fn main() {
    let cluster = PgCluster::temp().unwrap();
    let store = store_pg::example_store(&cluster, "bench").await;
    let engine = Engine::start(store, example_config(|s| s)).await.unwrap();
    println!(
        "connect on PostgreSQL {} (engine + PgStore, no HTTP), {ROUNDS} continuing connects per client",
        cluster.dir().display()
    );
    for clients in [1, 16] {
        let start = Instant::now();
        let tasks: Vec<_> = (0..clients)
            .map(|i| tokio::spawn(client(engine.clone(), i + clients * 1000)))
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        let elapsed = start.elapsed();
        all.sort();
        println!(
            "{clients:>2} concurrent clients: p50 {:>7.3} ms  p99 {:>7.3} ms  {:>6.0} connects/s",
            percentile(&all, 0.50).as_secs_f64() * 1e3,
            percentile(&all, 0.99).as_secs_f64() * 1e3,
            all.len() as f64 / elapsed.as_secs_f64()
        );
    }
}
