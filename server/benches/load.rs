//! The load tool (issue 14): many real clients (`client::Client` over
//! HTTP) against a `synchro serve` process for a bounded time, each in a
//! loop of pull, write a note, push, think. Reports push and pull latency
//! percentiles (each HTTP request), throughput, answers by code, the
//! server's capture lag (how long a WAL position waits until it is
//! materialized) and its memory.
//!
//! ```text
//! cargo bench -p server --bench load                       # 10, 100 and 1000 clients, 20 s each
//! SYNCHRO_LOAD_CLIENTS=50 SYNCHRO_LOAD_SECONDS=10 cargo bench -p server --bench load
//! SYNCHRO_LOAD_ABUSE=1 SYNCHRO_LOAD_CLIENTS=100 cargo bench -p server --bench load
//! SYNCHRO_LOAD_ABUSE=1 SYNCHRO_LOAD_FLOODS=push,slow ...  # only some of the floods
//! SYNCHRO_LOAD_LIMITS="pages_per_user = 2; flood_burst_per_user = 90" ...  # other limits
//! SYNCHRO_LOAD_SOAK=1 SYNCHRO_LOAD_CLIENTS=100 SYNCHRO_LOAD_SECONDS=600 cargo bench -p server --bench load
//! SYNCHRO_LOAD_DB_CONNECTIONS=32 ...  # the requests' database pool ([server] database_connections)
//! ```
//!
//! The soak profile (issue 25) keeps 10,000 notes (100 per device) changing:
//! each device updates one of its own notes per loop instead of inserting,
//! and SQL updates 500 random notes a second beside it. It samples the
//! size of the `synchro` and `public` schemas every minute, and runs
//! twice: with compaction every 10 s, then without any
//! (`SYNCHRO_LOAD_SOAK=compaction` runs only the first).
//!
//! The abuse profile (issue 24) runs each count twice, without and then
//! with one abusive user beside the clients: a rebuild flood (fresh
//! `rebuild_id`s for its 20,000-row scope from 16 client IDs), a push flood
//! (1000-mutation batches at full speed), a registration flood and 200
//! slow connections that trickle their headers. The ordinary clients'
//! figures are reported apart from the abuser's, with the database's growth.
//!
//! Each client count gets its own server process on a fresh database of a
//! private cluster, so the figures do not carry over. Only loopback
//! addresses are ever targeted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // a load tool fails loudly

use std::collections::BTreeMap;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use client::{
    Answer, Client, Config, Endpoint, HttpTransport, MemoryStore, Transport, TransportError,
};
use client::{Write, WriteOp};
use protocol::json::{self, Value};
use sqlx::PgPool;
use store_pg::cluster::PgCluster;

#[path = "served.rs"]
mod served;
use served::Served;

/// The soak profile of one run.
#[derive(Clone, Copy)]
struct Soak {
    /// The server compacts (every 10 s) or never does.
    compaction: bool,
}

/// One answered (or lost) request.
struct Sample {
    endpoint: Endpoint,
    latency: Duration,
    /// The status and, for an error, its code.
    outcome: String,
}

#[derive(Default)]
struct Sink {
    measuring: AtomicBool,
    samples: Mutex<Vec<Sample>>,
    mutations: std::sync::atomic::AtomicU64,
    changes: std::sync::atomic::AtomicU64,
}

/// HTTP with every request's latency and outcome recorded while measuring.
struct Timed {
    inner: HttpTransport,
    sink: Arc<Sink>,
}

impl Transport for Timed {
    async fn post(&mut self, endpoint: Endpoint, body: &[u8]) -> Result<Answer, TransportError> {
        let start = Instant::now();
        let answer = self.inner.post(endpoint, body).await;
        if self.sink.measuring.load(Ordering::Relaxed) {
            let outcome = match &answer {
                Ok(a) if a.status == 200 => "200".to_owned(),
                Ok(a) => {
                    let code = json::parse(&a.body).ok().and_then(|v| {
                        let e = v.as_object()?.get("error")?.as_object()?;
                        Some(e.get("code")?.as_str()?.to_owned())
                    });
                    format!("{} {}", a.status, code.unwrap_or_default())
                }
                Err(_) => "no answer".to_owned(),
            };
            self.sink.samples.lock().unwrap().push(Sample {
                endpoint,
                latency: start.elapsed(),
                outcome,
            });
        }
        answer
    }
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// One client's loop until `stop`: pull, write a note, push, think.
async fn device(
    mut c: Client<MemoryStore, Timed>,
    index: usize,
    sink: Arc<Sink>,
    stop: Arc<AtomicBool>,
    soak: bool,
) {
    let mut n = 0u64;
    let mut rng = index as u64 * 0x9e37_79b9_7f4a_7c15 + 1;
    while !stop.load(Ordering::Relaxed) {
        if let Ok(report) = c.pull().await
            && sink.measuring.load(Ordering::Relaxed)
        {
            sink.changes
                .fetch_add(report.changes as u64, Ordering::Relaxed);
        }
        n += 1;
        let write = match soak {
            true => match soak_update(&c, index, n) {
                Some(w) => w,
                None => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            false => Write {
                table: "tbl_notes".into(),
                pk: Value::string(format!("00000000-0000-4000-8000-{:06x}{n:06x}", index)),
                op: WriteOp::Insert {
                    columns: [
                        (
                            "fld_notes_title".to_owned(),
                            Value::string(format!("load {n}")),
                        ),
                        ("fld_notes_pinned".to_owned(), Value::Bool(false)),
                    ]
                    .into_iter()
                    .collect(),
                },
                client_version: client::datetime(now_micros()),
            },
        };
        c.write(&write).unwrap();
        if let Ok(report) = c.push().await
            && sink.measuring.load(Ordering::Relaxed)
        {
            let applied = report
                .outcomes
                .iter()
                .filter(|o| o.status == "applied")
                .count();
            sink.mutations.fetch_add(applied as u64, Ordering::Relaxed);
        }
        // Think 100 to 300 ms (a splitmix step: no shared generator).
        rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let think = 100 + (rng ^ (rng >> 31)) % 200;
        tokio::time::sleep(Duration::from_millis(think)).await;
    }
}

/// The columns of a note write that sets only its title.
fn title(text: String) -> json::Object {
    [("fld_notes_title".to_owned(), Value::string(text))]
        .into_iter()
        .collect()
}

/// The soak profile's note `k` of device `index` (seeded before the run).
fn soak_note(index: usize, k: usize) -> String {
    format!("00000000-0000-4000-9000-{index:06x}{k:06x}")
}

/// An update of the device's note `n % 100` at the version it holds.
fn soak_update(c: &Client<MemoryStore, Timed>, index: usize, n: u64) -> Option<Write> {
    use client::local::LocalStore;
    let pk = soak_note(index, (n % 100) as usize);
    let wanted = json::to_canonical_string(&Value::string(pk.clone()));
    let held = (c.store().all_holdings().ok()?.into_iter())
        .find(|h| h.table == "tbl_notes" && h.pk.contains(&wanted))?;
    Some(Write {
        table: "tbl_notes".into(),
        pk: Value::string(pk),
        op: WriteOp::Update {
            base_version: held.version,
            columns: title(format!("soak {n}")),
        },
        client_version: client::datetime(now_micros()),
    })
}

/// The soak profile's SQL writer: 500 random notes a second, in ten
/// statements of 50, until `stop`.
async fn soak_sql(pool: PgPool, clients: usize, stop: Arc<AtomicBool>) -> u64 {
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut updated = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let ids: Vec<String> = (0..50)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let note = (rng % (clients as u64 * 100)) as usize;
                soak_note(note / 100, note % 100)
            })
            .collect();
        let done = sqlx::query(
            "UPDATE public.notes SET title = 'sql ' || clock_timestamp()::text \
             WHERE id = ANY($1::uuid[])",
        )
        .bind(&ids)
        .execute(&pool)
        .await;
        if let Ok(d) = done {
            updated += d.rows_affected();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    updated
}

/// The sizes of the `synchro` schema, of its push ledger (which the spec
/// keeps until a client is retired), and of the `public` schema (heap,
/// indexes, TOAST).
async fn schema_bytes(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT coalesce(sum(pg_total_relation_size(c.oid)) FILTER (WHERE n.nspname = 'synchro'), 0)::int8, \
                coalesce(sum(pg_total_relation_size(c.oid)) FILTER (WHERE n.nspname = 'synchro' \
                  AND c.relname IN ('push_batches', 'push_mutations')), 0)::int8, \
                coalesce(sum(pg_total_relation_size(c.oid)) FILTER (WHERE n.nspname = 'public'), 0)::int8 \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relkind = 'r' AND n.nspname IN ('synchro', 'public')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A process's resident set now and at its peak, in MB.
fn rss(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
}

/// Capture lag, sampled every 25 ms: how long each sampled WAL position
/// waited until durable capture progress passed it.
async fn capture_lag(pool: PgPool, stop: Arc<AtomicBool>) -> Vec<Duration> {
    let mut waiting: std::collections::VecDeque<(Instant, i64)> = Default::default();
    let mut lags = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let (current, done): (i64, Option<i64>) = sqlx::query_as(
            "SELECT (pg_current_wal_insert_lsn() - '0/0')::int8, \
             (SELECT end_lsn FROM synchro.capture_progress)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        let now = Instant::now();
        while let Some(&(at, lsn)) = waiting.front() {
            if done.is_some_and(|d| d >= lsn) {
                lags.push(now - at);
                waiting.pop_front();
            } else {
                break;
            }
        }
        waiting.push_back((now, current));
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    lags
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// The abuser's user: 20,000 notes of its own, so each rebuild stages them.
const ABUSER: &str = "abuser";

/// What the abuser's floods got back, by endpoint and outcome.
#[derive(Default)]
struct Abused {
    answers: Mutex<BTreeMap<String, usize>>,
    /// How long each of its 1000-mutation pushes took, retries included.
    pushes: Mutex<Vec<Duration>>,
}

impl Abused {
    fn count(&self, what: &str, answer: &Result<Answer, TransportError>) {
        let outcome = match answer {
            Ok(a) => a.status.to_string(),
            Err(_) => "no answer".into(),
        };
        *self
            .answers
            .lock()
            .unwrap()
            .entry(format!("{what} {outcome}"))
            .or_default() += 1;
    }
}

/// A fresh connect of `client_id` over `t`: its generation and schema.
async fn abuser_connect(t: &mut HttpTransport, client_id: &str) -> Option<(i64, Value)> {
    let body = json::to_canonical(&actors::testkit::ConnectBody::fresh(client_id).to_json());
    let a = t.post(Endpoint::Connect, &body).await.ok()?;
    let v = json::parse(&a.body).ok()?;
    let o = v.as_object()?;
    let generation = match o.get("client_generation")? {
        Value::Number(n) => n.as_exact_i64()?,
        _ => return None,
    };
    let s = o.get("schema")?.as_object()?;
    let schema = json::object([
        ("version", s["version"].clone()),
        ("hash", s["hash"].clone()),
    ]);
    Some((generation, schema))
}

/// The rebuild flood: fresh attempts of the abuser's scope, from 16
/// client IDs at once, as fast as answers come.
async fn rebuild_flood(
    addr: std::net::SocketAddr,
    token: String,
    n: usize,
    seen: Arc<Abused>,
    stop: Arc<AtomicBool>,
) {
    let mut t = HttpTransport::bearer(addr, &token);
    let client_id = format!("abuser-rebuild-{n}");
    let Some((generation, schema)) = abuser_connect(&mut t, &client_id).await else {
        return;
    };
    let mut attempt = 0u64;
    while !stop.load(Ordering::Relaxed) {
        attempt += 1;
        let body = json::to_canonical(&json::object([
            ("client_id", Value::string(&client_id)),
            ("client_generation", Value::int(generation)),
            ("schema", schema.clone()),
            ("scope", Value::string(format!("user:{ABUSER}"))),
            (
                "rebuild_id",
                Value::string(format!("00000000-0000-4000-8000-{n:04x}{attempt:08x}")),
            ),
            ("cursor", Value::Null),
            ("limit", Value::int(1000)),
        ]));
        let a = t.post(Endpoint::Rebuild, &body).await;
        seen.count("rebuild", &a);
    }
}

/// The push flood: 1000-mutation batches, one after another.
async fn push_flood(
    mut c: Client<MemoryStore, HttpTransport>,
    seen: Arc<Abused>,
    stop: Arc<AtomicBool>,
) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..1000 {
            n += 1;
            let write = Write {
                table: "tbl_notes".into(),
                pk: Value::string(format!("00000000-0000-4000-8001-{n:012x}")),
                op: WriteOp::Insert {
                    columns: title(format!("flood {n}")),
                },
                client_version: client::datetime(now_micros()),
            };
            c.write(&write).unwrap();
        }
        let start = Instant::now();
        let r = c.push().await;
        seen.pushes.lock().unwrap().push(start.elapsed());
        *seen
            .answers
            .lock()
            .unwrap()
            .entry(format!(
                "push {}",
                if r.is_ok() {
                    "done"
                } else {
                    "refused or failed"
                }
            ))
            .or_default() += 1;
    }
}

/// The registration flood: a new client ID per request.
async fn registration_flood(
    addr: std::net::SocketAddr,
    token: String,
    seen: Arc<Abused>,
    stop: Arc<AtomicBool>,
) {
    let mut t = HttpTransport::bearer(addr, &token);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let body = json::to_canonical(
            &actors::testkit::ConnectBody::fresh(&format!("abuser-reg-{n}")).to_json(),
        );
        let a = t.post(Endpoint::Connect, &body).await;
        seen.count("connect", &a);
    }
}

/// Slow connections: each sends half a header, then a byte a second.
async fn slow_connection(addr: std::net::SocketAddr, seen: Arc<Abused>, stop: Arc<AtomicBool>) {
    use tokio::io::AsyncWriteExt;
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let _ = s
            .write_all(b"POST /sync/pull HTTP/1.1\r\nhost: x\r\n")
            .await;
        let mut closed = false;
        while !closed && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            closed = s.write_all(b"x").await.is_err();
        }
        *seen
            .answers
            .lock()
            .unwrap()
            .entry("slow connection closed".into())
            .or_default() += usize::from(closed);
    }
}

/// Starts every flood of the abuser; they run until `stop`.
async fn abuse(
    addr: std::net::SocketAddr,
    secret: &[u8],
    seen: Arc<Abused>,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let token = server::auth::dev_token(secret, ABUSER, now, &Default::default()).unwrap();
    let floods = std::env::var("SYNCHRO_LOAD_FLOODS")
        .unwrap_or_else(|_| "rebuild,push,registration,slow".into());
    let on = |name: &str| floods.split(',').any(|f| f.trim() == name);
    let mut tasks = Vec::new();
    for n in 0..16 * usize::from(on("rebuild")) {
        tasks.push(tokio::spawn(rebuild_flood(
            addr,
            token.clone(),
            n,
            seen.clone(),
            stop.clone(),
        )));
    }
    let config = Config {
        max_tries: 3,
        ..Config::default()
    };
    let mut pusher = Client::open(
        MemoryStore::new(),
        HttpTransport::bearer(addr, &token),
        "abuser-push",
        config,
        7,
    )
    .unwrap();
    if on("push") && pusher.connect().await.is_ok() {
        tasks.push(tokio::spawn(push_flood(pusher, seen.clone(), stop.clone())));
    }
    if on("registration") {
        tasks.push(tokio::spawn(registration_flood(
            addr,
            token.clone(),
            seen.clone(),
            stop.clone(),
        )));
    }
    for _ in 0..200 * usize::from(on("slow")) {
        tasks.push(tokio::spawn(slow_connection(
            addr,
            seen.clone(),
            stop.clone(),
        )));
    }
    tasks
}

/// Every table's bytes (heap, indexes, TOAST) in the app's and synchro's schemas.
async fn table_bytes(pool: &PgPool) -> std::collections::BTreeMap<String, i64> {
    sqlx::query_as(
        "SELECT c.oid::regclass::text, pg_total_relation_size(c.oid) FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.relkind = 'r' AND n.nspname IN ('synchro', 'public')",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

async fn database_bytes(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT pg_database_size(current_database())")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn run(
    cluster: &PgCluster,
    clients: usize,
    seconds: u64,
    secret_file: &str,
    secret: &[u8],
    abused: bool,
    soak: Option<Soak>,
) {
    let name = format!(
        "load_{clients}{}{}",
        if abused { "_abused" } else { "" },
        match soak {
            Some(Soak { compaction: true }) => "_soak",
            Some(Soak { compaction: false }) => "_soak_nocompact",
            None => "",
        }
    );
    let store = store_pg::example_store(cluster, &name).await;
    let pool = store.pool().clone();
    // The abuser's scope: 20,000 notes.
    sqlx::raw_sql(&format!(
        "INSERT INTO public.notes (id, owner_id, title) \
         SELECT gen_random_uuid(), '{ABUSER}', 'n' || g FROM generate_series(1, 20000) g"
    ))
    .execute(&pool)
    .await
    .unwrap();
    // Each device keeps a connection: the default cap (512) would turn
    // the 1,000-device run into a test of the cap, as a deployment of that
    // size would raise it too.
    let users = clients.div_ceil(2);
    if soak.is_some() {
        // Each device's 100 notes, owned by its user.
        sqlx::raw_sql(&format!(
            "INSERT INTO public.notes (id, owner_id, title) \
             SELECT ('00000000-0000-4000-9000-' || lpad(to_hex(d), 6, '0') || lpad(to_hex(k), 6, '0'))::uuid, \
                    'user-' || (d % {users}), 'soak' \
             FROM generate_series(0, {clients} - 1) d, generate_series(0, 99) k"
        ))
        .execute(&pool)
        .await
        .unwrap();
    }
    let mut cap = format!("[server]\nmax_connections = {}", 2 * clients + 64);
    if let Ok(n) = std::env::var("SYNCHRO_LOAD_DB_CONNECTIONS") {
        cap.push_str(&format!("\ndatabase_connections = {n}"));
    }
    // Compaction every 10 s, or (to compare) never in the run.
    let retention = match soak {
        Some(Soak { compaction: true }) => "\n[retention]\ncompact_interval_seconds = 10\n",
        Some(Soak { compaction: false }) => "\n[retention]\ncompact_interval_seconds = 100000000\n",
        None => "",
    };
    let server = Served::start_with(&cluster.url(&name), secret_file, |c| {
        c.replacen("[server]", &cap, 1) + retention
    })
    .await;
    assert!(
        server.addr.ip().is_loopback(),
        "the load tool targets loopback only"
    );
    for _ in 0..600 {
        let ready: Option<bool> =
            sqlx::query_scalar("SELECT baseline_done FROM synchro.capture_slot")
                .fetch_optional(&pool)
                .await
                .unwrap();
        if ready == Some(true) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sink = Arc::new(Sink::default());
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let config = Config {
        pull_limit: 100,
        rebuild_limit: 1000,
        max_tries: 30,
        backoff_base: Duration::from_millis(100),
        backoff_cap: Duration::from_secs(5),
        ..Config::default()
    };
    // Every device connects and takes its first rebuilds before the clock starts.
    let mut devices = Vec::new();
    let mut joins = Vec::new();
    for i in 0..clients {
        let token = server::auth::dev_token(
            secret,
            &format!("user-{}", i % users),
            now,
            &Default::default(),
        )
        .unwrap();
        let transport = Timed {
            inner: HttpTransport::bearer(server.addr, &token),
            sink: sink.clone(),
        };
        let config = config.clone();
        joins.push(tokio::spawn(async move {
            let mut c = Client::open(
                MemoryStore::new(),
                transport,
                &format!("load-{i}"),
                config,
                i as u64,
            )
            .unwrap();
            c.connect().await.unwrap();
            c.pull().await.unwrap();
            c
        }));
    }
    for j in joins {
        devices.push(j.await.unwrap());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let lag = tokio::spawn(capture_lag(pool.clone(), stop.clone()));
    let seen = Arc::new(Abused::default());
    let size_before = database_bytes(&pool).await;
    let tables_before = table_bytes(&pool).await;
    let floods = match abused {
        true => abuse(server.addr, secret, seen.clone(), stop.clone()).await,
        false => Vec::new(),
    };
    sink.measuring.store(true, Ordering::Relaxed);
    let start = Instant::now();
    let tasks: Vec<_> = devices
        .into_iter()
        .enumerate()
        .map(|(i, c)| tokio::spawn(device(c, i, sink.clone(), stop.clone(), soak.is_some())))
        .collect();
    let sql = soak.map(|_| tokio::spawn(soak_sql(pool.clone(), clients, stop.clone())));
    let mut sizes = Vec::new();
    let mut peak_rss = 0.0f64;
    while start.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if soak.is_some() && start.elapsed().as_secs() / 60 >= sizes.len() as u64 {
            sizes.push(schema_bytes(&pool).await);
        }
        let (now_rss, _) = rss(server.child.id());
        peak_rss = peak_rss.max(now_rss);
        let (pushes, pulls) = {
            let s = sink.samples.lock().unwrap();
            let count = |e| s.iter().filter(|x| x.endpoint == e).count();
            (count(Endpoint::Push), count(Endpoint::Pull))
        };
        eprint!(
            "\r{clients} clients: {:>3} s, {pushes} pushes, {pulls} pulls, {} mutations applied, server RSS {now_rss:.0} MB   ",
            start.elapsed().as_secs(),
            sink.mutations.load(Ordering::Relaxed)
        );
        let _ = std::io::stderr().flush();
    }
    sink.measuring.store(false, Ordering::Relaxed);
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    for f in floods {
        f.abort();
    }
    let sql_updates = match sql {
        Some(t) => t.await.unwrap(),
        None => 0,
    };
    if soak.is_some() {
        sizes.push(schema_bytes(&pool).await);
    }
    let size_after = database_bytes(&pool).await;
    let mut grown: Vec<(i64, String)> = table_bytes(&pool)
        .await
        .into_iter()
        .map(|(t, after)| (after - tables_before.get(&t).copied().unwrap_or(0), t))
        .collect();
    grown.sort_by(|a, b| b.cmp(a));
    let mut lags = lag.await.unwrap();
    lags.sort();
    eprintln!();
    let samples = std::mem::take(&mut *sink.samples.lock().unwrap());
    let mut by_code: BTreeMap<String, usize> = BTreeMap::new();
    let mut latency: BTreeMap<&str, Vec<Duration>> = BTreeMap::new();
    for s in &samples {
        *by_code.entry(s.outcome.clone()).or_default() += 1;
        let e = match s.endpoint {
            Endpoint::Push => "push",
            Endpoint::Pull => "pull",
            Endpoint::Rebuild => "rebuild",
            Endpoint::Connect => "connect",
        };
        latency.entry(e).or_default().push(s.latency);
    }
    let (_, hwm) = rss(server.child.id());
    let secs = elapsed.as_secs_f64();
    println!(
        "{clients} clients ({users} users){}, {secs:.0} s: {:.0} mutations/s applied, {:.0} changes/s pulled",
        if abused { ", with the abuser" } else { "" },
        sink.mutations.load(Ordering::Relaxed) as f64 / secs,
        sink.changes.load(Ordering::Relaxed) as f64 / secs,
    );
    for (e, mut l) in latency {
        l.sort();
        println!(
            "  {e}: {} requests ({:.0}/s), p50 {}, p99 {}, max {}",
            l.len(),
            l.len() as f64 / secs,
            ms(percentile(&l, 0.5)),
            ms(percentile(&l, 0.99)),
            ms(l.last().copied().unwrap_or_default())
        );
    }
    println!("  answers: {by_code:?}");
    println!(
        "  capture lag: p50 {}, p99 {}, max {} ({} samples); server RSS peak {peak_rss:.0} MB while measured, {hwm:.0} MB over its life",
        ms(percentile(&lags, 0.5)),
        ms(percentile(&lags, 0.99)),
        ms(lags.last().copied().unwrap_or_default()),
        lags.len()
    );
    println!(
        "  database: {:.1} MB before, {:.1} MB after ({:+.1} MB)",
        size_before as f64 / 1e6,
        size_after as f64 / 1e6,
        (size_after - size_before) as f64 / 1e6
    );
    let most: Vec<String> = (grown.iter().take(5))
        .map(|(b, t)| format!("{t} {:+.1} MB", *b as f64 / 1e6))
        .collect();
    println!("  grew most: {}", most.join(", "));
    if let Some(soak) = soak {
        println!(
            "  soak ({}): {sql_updates} notes updated by SQL; by minute, MB: synchro without the push ledger + the ledger / public (ratio without the ledger):",
            if soak.compaction {
                "compaction every 10 s"
            } else {
                "no compaction"
            }
        );
        let line: Vec<String> = (sizes.iter().enumerate())
            .map(|(m, (ours, ledger, app))| {
                let rest = (ours - ledger) as f64;
                format!(
                    "{m}: {:.1} + {:.1} / {:.1} ({:.1}x)",
                    rest / 1e6,
                    *ledger as f64 / 1e6,
                    *app as f64 / 1e6,
                    rest / *app as f64
                )
            })
            .collect();
        println!("    {}", line.join(", "));
    }
    if abused {
        println!("  the abuser's answers: {:?}", seen.answers.lock().unwrap());
        let pushes: Vec<String> = seen.pushes.lock().unwrap().iter().map(|d| ms(*d)).collect();
        println!("  the abuser's pushes took: {}", pushes.join(", "));
    }
}

#[tokio::main]
async fn main() {
    let counts: Vec<usize> = std::env::var("SYNCHRO_LOAD_CLIENTS")
        .unwrap_or_else(|_| "10,100,1000".into())
        .split(',')
        .map(|n| n.trim().parse().expect("SYNCHRO_LOAD_CLIENTS: numbers"))
        .collect();
    let seconds: u64 = std::env::var("SYNCHRO_LOAD_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let cluster = PgCluster::temp().unwrap();
    let secrets = tempfile::tempdir().unwrap();
    let secret_file = secrets.path().join("hs256.secret").display().to_string();
    let secret = server::auth::hs256_secret(std::path::Path::new(&secret_file)).unwrap();
    let abuse = std::env::var("SYNCHRO_LOAD_ABUSE").is_ok_and(|v| v == "1");
    // `1`: with compaction, then without; `compaction`: only with it.
    let soak_mode = std::env::var("SYNCHRO_LOAD_SOAK").unwrap_or_default();
    let soak = soak_mode == "1" || soak_mode == "compaction";
    for clients in counts {
        if soak {
            let variants: &[bool] = if soak_mode == "1" {
                &[true, false]
            } else {
                &[true]
            };
            for &compaction in variants {
                let soak = Some(Soak { compaction });
                run(
                    &cluster,
                    clients,
                    seconds,
                    &secret_file,
                    &secret,
                    false,
                    soak,
                )
                .await;
            }
            continue;
        }
        run(
            &cluster,
            clients,
            seconds,
            &secret_file,
            &secret,
            false,
            None,
        )
        .await;
        if abuse {
            run(
                &cluster,
                clients,
                seconds,
                &secret_file,
                &secret,
                true,
                None,
            )
            .await;
        }
    }
}
