//! Operating synchro (issue 26, ADR 0025), against the real binary on a
//! private cluster: `/metrics` scraped and checked by promtool, its values
//! following requests, a held-back capture and a dropped slot; and every
//! operator command: `client list / show / retire`, `keys list / rotate /
//! retire`, `quarantine show / retry`.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::ffi::OsStr;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use actors::store::{Store, StoreTx};
use actors::testkit::{ConnectBody, note_columns, note_mutation};
use base64::Engine as _;
use invariants::pull::{RebuildStep, Rebuilding, Replica};
use protocol::json::{self, Value};
use sqlx::PgPool;
use store_pg::PgStore;
use store_pg::cluster::PgCluster;

mod common;

/// A `synchro serve` process, its address, and its metrics address.
struct Process {
    child: Child,
    addr: SocketAddr,
    metrics: Option<SocketAddr>,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(dir: &std::path::Path, url: &str, with_metrics: bool) -> Process {
    let (config, data) = (dir.join("config.toml"), dir.join("data"));
    let mut args: Vec<&OsStr> = vec![
        OsStr::new("--listen"),
        OsStr::new("127.0.0.1:0"),
        OsStr::new("--database-url"),
        OsStr::new(url),
        OsStr::new("--config"),
        config.as_os_str(),
        OsStr::new("--data-dir"),
        data.as_os_str(),
    ];
    if with_metrics {
        args.extend([OsStr::new("--metrics-listen"), OsStr::new("127.0.0.1:0")]);
    }
    let (child, addr, lines) = common::spawn_serve_lines(&args, Stdio::null());
    let metrics = lines.iter().find_map(|l| {
        l.strip_prefix("synchro: metrics at http://")?
            .strip_suffix("/metrics")?
            .parse()
            .ok()
    });
    assert_eq!(metrics.is_some(), with_metrics, "{lines:?}");
    Process {
        child,
        addr,
        metrics,
    }
}

async fn setup(cluster: &PgCluster, name: &str) -> (tempfile::TempDir, String, PgPool) {
    common::upstream_setup(cluster, name).await
}

/// One request as `user`: status and body.
async fn send(addr: SocketAddr, path: &str, user: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
    let headers = [("x-user", user), ("content-type", "application/json")];
    let (status, _, body) = common::request(addr, "POST", path, &headers, body).await;
    (status, body)
}

async fn ready(addr: SocketAddr) -> bool {
    common::request(addr, "GET", "/ready", &[], vec![]).await.0 == 200
}

async fn wait_ready(addr: SocketAddr) {
    let start = Instant::now();
    while !ready(addr).await {
        assert!(start.elapsed() < Duration::from_secs(60), "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs `synchro ARGS --database-url URL`: success, stdout, stderr.
fn synchro(args: &[&str], url: &str) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_synchro"))
        .args(args)
        .args(["--database-url", url])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn code(body: &[u8]) -> String {
    let v = json::parse(body).unwrap();
    v.as_object().unwrap()["error"].as_object().unwrap()["code"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The `key_id` a cursor or continuation names in its payload.
fn key_id(token: &str) -> String {
    let payload = token.split('.').nth(1).unwrap();
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .unwrap();
    json::parse(&bytes).unwrap().as_object().unwrap()["key_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A connected client with its local replica, over HTTP.
struct Device {
    user: String,
    client_id: String,
    generation: u64,
    replica: Replica,
    attempts: u64,
}

impl Device {
    async fn connect(addr: SocketAddr, store: &PgStore, user: &str, client_id: &str) -> Device {
        let body = json::to_canonical(&ConnectBody::fresh(client_id).to_json());
        let (status, b) = send(addr, "/sync/connect", user, body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
        let mut tx = store.begin().await.unwrap();
        let manifest = tx.manifests().await.unwrap().pop().unwrap();
        drop(tx);
        let mut replica = Replica::new(manifest);
        replica.connected(&b).unwrap();
        let v = json::parse(&b).unwrap();
        Device {
            user: user.into(),
            client_id: client_id.into(),
            generation: actors::testkit::int_member(&v, "client_generation"),
            replica,
            attempts: 0,
        }
    }

    fn attempt(&mut self, scope: &str) -> Rebuilding {
        self.attempts += 1;
        Rebuilding::new(
            scope,
            &format!("00000000-0000-4000-8000-{:012x}", self.attempts),
        )
    }

    /// One rebuild page of `attempt` through `addr`, applied.
    async fn rebuild_page(
        &mut self,
        addr: SocketAddr,
        attempt: &mut Rebuilding,
        limit: u16,
    ) -> (u16, Vec<u8>, Option<RebuildStep>) {
        let body = self
            .replica
            .rebuild_request(attempt, &self.client_id, self.generation, limit);
        let (status, b) = send(addr, "/sync/rebuild", &self.user, body).await;
        let step = (status == 200).then(|| self.replica.apply_rebuild(attempt, &b).unwrap());
        (status, b, step)
    }

    /// Rebuilds what needs it and pulls to a terminal page through `addr`.
    async fn sync(&mut self, addr: SocketAddr) {
        for scope in self.replica.needs_rebuild() {
            let mut attempt = self.attempt(&scope);
            loop {
                let (status, b, step) = self.rebuild_page(addr, &mut attempt, 1000).await;
                assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
                match step.unwrap() {
                    RebuildStep::Done => break,
                    RebuildStep::More(_) => {}
                    RebuildStep::Mismatch => panic!("checksum mismatch"),
                }
            }
        }
        let (status, b) = self.pull_raw(addr).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
        self.replica.apply(&b).unwrap();
    }

    async fn pull_raw(&self, addr: SocketAddr) -> (u16, Vec<u8>) {
        let body = self.replica.request(&self.client_id, self.generation, 100);
        send(addr, "/sync/pull", &self.user, body).await
    }

    fn cursor(&self, scope: &str) -> String {
        self.replica.scopes[scope].cursor.clone().unwrap()
    }

    fn push_body(&self, batch: u64) -> Vec<u8> {
        let schema = self.replica.schema_reference();
        json::to_canonical(&json::object([
            ("client_id", Value::string(&self.client_id)),
            ("client_generation", Value::int(self.generation as i64)),
            (
                "batch_id",
                Value::string(format!("20000000-0000-4000-8000-{batch:012}")),
            ),
            ("schema", schema.clone()),
            (
                "mutations",
                Value::Array(vec![note_mutation(
                    1,
                    &format!("30000000-0000-4000-8000-{batch:012}"),
                    &schema,
                    "insert",
                    None,
                    Some(note_columns("pushed")),
                )]),
            ),
        ]))
    }
}

async fn insert_notes(pool: &PgPool, owner: &str, n: usize) {
    for i in 0..n {
        sqlx::query("INSERT INTO public.notes (owner_id, title) VALUES ($1, $2)")
            .bind(owner)
            .bind(format!("note {i}"))
            .execute(pool)
            .await
            .unwrap();
    }
}

/// Waits until `what` holds, up to `limit`.
async fn eventually<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < limit, "never: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------- metrics

/// A scrape of `/metrics`, which promtool must accept as it is.
async fn scrape(addr: SocketAddr) -> String {
    let (status, headers, body) = common::request(addr, "GET", "/metrics", &[], vec![]).await;
    assert_eq!(status, 200);
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4"),
        "{headers:?}"
    );
    let text = String::from_utf8(body).unwrap();
    promtool_accepts(&text);
    text
}

/// `promtool check metrics` (Debian package `prometheus`, which `.ci/run`
/// installs): the exposition parses, and passes its lint.
fn promtool_accepts(text: &str) {
    use std::io::Write;
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian package prometheus) is installed");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The value of the sample `series` (name and labels as exposed), if any.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn value(text: &str, series: &str) -> f64 {
    sample(text, series).unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

#[tokio::test]
async fn metrics_are_scraped_parsed_and_follow_capture() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, pool) = setup(&cluster, "metrics").await;
    // A pool of its own size, which the gauge reports.
    let config = dir.path().join("config.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("[server]\n"));
    std::fs::write(
        &config,
        text.replacen("[server]\n", "[server]\ndatabase_connections = 7\n", 1),
    )
    .unwrap();
    let server = serve(dir.path(), &url, true);
    let metrics = server.metrics.unwrap();
    wait_ready(server.addr).await;

    let text = scrape(metrics).await;
    for name in [
        "synchro_ready 1",
        "synchro_capture_leader 1",
        "synchro_capture_blocked{reason=\"\"} 0",
        "synchro_store_up 1",
        "synchro_rebuild_sessions_active 0",
    ] {
        assert!(text.lines().any(|l| l == name), "{name} in\n{text}");
    }
    for name in [
        "synchro_capture_lag_seconds",
        "synchro_capture_lag_bytes",
        "synchro_replication_slot_retained_wal_bytes",
        "synchro_materialized_transactions_total",
        "synchro_materialized_rows_total",
        "synchro_db_pool_connections{state=\"max\"}",
        "process_resident_memory_bytes",
        "process_open_fds",
    ] {
        assert!(sample(&text, name).is_some(), "{name} in\n{text}");
    }
    assert_eq!(
        value(&text, "synchro_db_pool_connections{state=\"max\"}"),
        7.0,
        "[server] database_connections"
    );
    // Every metric the shipped alerts and dashboard use is exported.
    for file in ["alerts.yml", "grafana-dashboard.json"] {
        let path = format!("{}/../docs/ops/{file}", env!("CARGO_MANIFEST_DIR"));
        let used = std::fs::read_to_string(&path).unwrap();
        let names = used.match_indices("synchro_").map(|(at, _)| {
            let rest = &used[at..];
            let end = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        });
        for name in names {
            let family = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("# TYPE {family} "))),
                "{file} uses {name}, which /metrics does not export"
            );
        }
    }

    // Requests count up, by endpoint and status.
    let connects = "synchro_http_requests_total{endpoint=\"connect\",status=\"200\"}";
    let before = sample(&text, connects).unwrap_or(0.0);
    let store = PgStore::connect(cluster.connect_options("metrics"))
        .await
        .unwrap();
    for i in 0..3 {
        Device::connect(server.addr, &store, "m", &format!("metrics-{i}")).await;
    }
    let (status, _) = send(server.addr, "/sync/pull", "m", b"{}".to_vec()).await;
    assert_eq!(status, 400);
    let text = scrape(metrics).await;
    assert_eq!(value(&text, connects), before + 3.0);
    assert_eq!(
        value(
            &text,
            "synchro_http_requests_total{endpoint=\"pull\",status=\"400\"}"
        ),
        1.0
    );
    assert!(
        value(
            &text,
            "synchro_http_request_duration_seconds_count{endpoint=\"connect\"}"
        ) >= 3.0
    );

    // Source writes are materialized and counted.
    let rows = value(&text, "synchro_materialized_rows_total");
    insert_notes(&pool, "m", 5).await;
    eventually(Duration::from_secs(30), "5 rows materialized", || async {
        value(&scrape(metrics).await, "synchro_materialized_rows_total") >= rows + 5.0
    })
    .await;
    let prepare = "synchro_materializer_seconds_total{phase=\"prepare\"}";
    let write = "synchro_materializer_seconds_total{phase=\"write\"}";
    let text = scrape(metrics).await;
    assert!(value(&text, prepare) > 0.0, "{prepare} counts\n{text}");
    assert!(value(&text, write) > 0.0, "{write} counts\n{text}");

    // Capture held back: a lock on what the materializer writes. Lag and
    // retained WAL rise while source writes go on.
    let settled = scrape(metrics).await;
    let (lag0, wal0, prepare0) = (
        value(&settled, "synchro_capture_lag_bytes"),
        value(&settled, "synchro_replication_slot_retained_wal_bytes"),
        value(&settled, prepare),
    );
    let mut hold = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE synchro.projections IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *hold)
        .await
        .unwrap();
    insert_notes(&pool, "m", 200).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let held = scrape(metrics).await;
    let (lag1, wal1, seconds1) = (
        value(&held, "synchro_capture_lag_bytes"),
        value(&held, "synchro_replication_slot_retained_wal_bytes"),
        value(&held, "synchro_capture_lag_seconds"),
    );
    assert!(lag1 > lag0 + 10_000.0, "lag bytes rose: {lag0} -> {lag1}");
    assert!(
        wal1 > wal0 + 10_000.0,
        "retained WAL rose: {wal0} -> {wal1}"
    );
    assert!(seconds1 >= 1.5, "lag seconds rose: {seconds1}");
    assert_eq!(
        value(&held, "synchro_ready"),
        0.0,
        "held capture is unready"
    );

    // Released, capture catches up: both fall.
    hold.rollback().await.unwrap();
    eventually(Duration::from_secs(60), "lag and WAL fall", || async {
        sqlx::query("CHECKPOINT").execute(&pool).await.unwrap();
        let t = scrape(metrics).await;
        value(&t, "synchro_capture_lag_bytes") < lag1
            && value(&t, "synchro_replication_slot_retained_wal_bytes") < wal1
            && value(&t, "synchro_capture_lag_seconds") < 1.0
            && value(&t, "synchro_ready") == 1.0
    })
    .await;
    // The held group waited in its first read of projections: preparing.
    let prepare1 = value(&scrape(metrics).await, prepare);
    assert!(
        prepare1 >= prepare0 + 1.5,
        "the held group's wait counts as preparing: {prepare0} -> {prepare1}"
    );

    // A dropped slot: unready, and blocked with its reason.
    sqlx::raw_sql(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
         WHERE active_pid IS NOT NULL",
    )
    .execute(&pool)
    .await
    .unwrap();
    eventually(Duration::from_secs(10), "the slot is dropped", || async {
        sqlx::raw_sql("SELECT pg_drop_replication_slot('synchro_metrics')")
            .execute(&pool)
            .await
            .is_ok()
    })
    .await;
    eventually(
        Duration::from_secs(30),
        "blocked by the lost slot",
        || async {
            let t = scrape(metrics).await;
            sample(&t, "synchro_capture_blocked{reason=\"slot_lost\"}") == Some(1.0)
                && value(&t, "synchro_ready") == 0.0
                && sample(&t, "synchro_capture_blocked{reason=\"\"}").is_none()
        },
    )
    .await;
    // The operator resets the stream; both follow back.
    let (ok, _, err) = synchro(&["stream", "reset", "--confirm"], &url);
    assert!(ok, "{err}");
    eventually(Duration::from_secs(60), "ready after the reset", || async {
        let t = scrape(metrics).await;
        value(&t, "synchro_ready") == 1.0
            && value(&t, "synchro_capture_blocked{reason=\"\"}") == 0.0
    })
    .await;
}

// ------------------------------------------------------ operator commands

#[tokio::test]
async fn clients_are_listed_shown_and_retired() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, pool) = setup(&cluster, "clients").await;
    let server = serve(dir.path(), &url, false);
    wait_ready(server.addr).await;
    let store = PgStore::connect(cluster.connect_options("clients"))
        .await
        .unwrap();
    insert_notes(&pool, "ada", 3).await;
    let mut phone = Device::connect(server.addr, &store, "ada", "phone").await;
    Device::connect(server.addr, &store, "ada", "tablet").await;
    Device::connect(server.addr, &store, "bob", "laptop").await;
    phone.sync(server.addr).await;
    let (status, b) = send(server.addr, "/sync/push", "ada", phone.push_body(1)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));

    let (ok, out, err) = synchro(&["client", "list", "--user", "ada"], &url);
    assert!(ok, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].starts_with("phone  generation 1  active"), "{out}");
    assert!(
        lines[1].starts_with("tablet  generation 1  active"),
        "{out}"
    );
    let (ok, out, _) = synchro(&["client", "list", "--user", "nobody"], &url);
    assert!(ok);
    assert_eq!(out.trim(), "no clients");

    let (ok, out, err) = synchro(&["client", "show", "--client-id", "phone"], &url);
    assert!(ok, "{err}");
    for line in [
        "client: phone",
        "user: ada",
        "generation: 1",
        "retired: no",
        "push outcomes kept: 1 batches, 1 mutations",
    ] {
        assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
    }
    assert!(
        out.contains("checkpoints: 2 scopes, last acknowledged"),
        "{out}"
    );
    let (ok, _, err) = synchro(&["client", "show", "--client-id", "ghost"], &url);
    assert!(!ok);
    assert!(err.contains("no such client"), "{err}");

    // Retirement needs --confirm, then every endpoint answers 409.
    let (ok, _, err) = synchro(&["client", "retire", "--client-id", "phone"], &url);
    assert!(!ok && err.contains("--confirm"), "{err}");
    let (status, _) = phone.pull_raw(server.addr).await;
    assert_eq!(status, 200, "nothing changed without --confirm");
    let (ok, _, err) = synchro(
        &["client", "retire", "--client-id", "phone", "--confirm"],
        &url,
    );
    assert!(ok, "{err}");
    let connect = json::to_canonical(&ConnectBody::fresh("phone").to_json());
    let (status, b) = send(server.addr, "/sync/connect", "ada", connect).await;
    assert_eq!((status, code(&b).as_str()), (409, "client_retired"));
    let (status, b) = send(server.addr, "/sync/push", "ada", phone.push_body(2)).await;
    assert_eq!((status, code(&b).as_str()), (409, "client_retired"));
    let (status, b) = phone.pull_raw(server.addr).await;
    assert_eq!((status, code(&b).as_str()), (409, "client_retired"));
    let mut attempt = phone.attempt("user:ada");
    let (status, b, _) = phone.rebuild_page(server.addr, &mut attempt, 10).await;
    assert_eq!((status, code(&b).as_str()), (409, "client_retired"));
    let (ok, out, _) = synchro(&["client", "show", "--client-id", "phone"], &url);
    assert!(ok);
    assert!(out.lines().any(|l| l == "retired: yes"), "{out}");
    assert!(
        out.lines()
            .any(|l| l == "push outcomes kept: 0 batches, 0 mutations"),
        "retirement releases the ledger: {out}"
    );
}

#[tokio::test]
async fn keys_rotate_without_forging_a_token_and_retire() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, pool) = setup(&cluster, "keys").await;
    let first = serve(dir.path(), &url, false);
    wait_ready(first.addr).await;
    // A second process, started before the rotation too.
    let second = serve(dir.path(), &url, false);
    wait_ready(second.addr).await;
    let store = PgStore::connect(cluster.connect_options("keys"))
        .await
        .unwrap();
    insert_notes(&pool, "kim", 3).await;
    let mut device = Device::connect(first.addr, &store, "kim", "k1").await;
    device.sync(first.addr).await;
    let old_cursor = device.cursor("user:kim");
    assert_eq!(key_id(&old_cursor), "ic-1");
    // A rebuild left after its first page: its continuation is under rc-1.
    let mut old_attempt = device.attempt("user:kim");
    let (status, _, step) = device.rebuild_page(first.addr, &mut old_attempt, 1).await;
    assert_eq!(status, 200);
    let Some(RebuildStep::More(old_continuation)) = step else {
        panic!("more pages")
    };
    assert_eq!(key_id(&old_continuation), "rc-1");

    let (ok, out, err) = synchro(&["keys", "list"], &url);
    assert!(ok, "{err}");
    assert_eq!(out, "ic-1  cursor  active\nrc-1  continuation  active\n");
    let (ok, _, err) = synchro(&["keys", "rotate"], &url);
    assert!(!ok && err.contains("--confirm"), "{err}");
    let (ok, _, err) = synchro(&["keys", "rotate", "--confirm"], &url);
    assert!(ok, "{err}");
    let (_, out, _) = synchro(&["keys", "list"], &url);
    assert_eq!(
        out,
        "ic-1  cursor  verify-only\nic-2  cursor  active\n\
         rc-1  continuation  verify-only\nrc-2  continuation  active\n"
    );

    // The old cursor and continuation still work, on both processes.
    for addr in [first.addr, second.addr] {
        let (status, b) = device.pull_raw(addr).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    }
    let (status, b, _) = device.rebuild_page(second.addr, &mut old_attempt, 1).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));

    // A process started after the rotation issues under the new keys, and
    // the processes started before verify them at once.
    let third = serve(dir.path(), &url, false);
    wait_ready(third.addr).await;
    let mut fresh = Device::connect(third.addr, &store, "kim", "k2").await;
    fresh.sync(third.addr).await;
    let new_cursor = fresh.cursor("user:kim");
    assert_eq!(key_id(&new_cursor), "ic-2");
    let (status, b) = fresh.pull_raw(second.addr).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    let mut attempt = fresh.attempt("user:kim");
    let (status, _, step) = fresh.rebuild_page(third.addr, &mut attempt, 1).await;
    assert_eq!(status, 200);
    let Some(RebuildStep::More(continuation)) = step else {
        panic!("more pages")
    };
    assert_eq!(key_id(&continuation), "rc-2");
    let (status, b, _) = fresh.rebuild_page(first.addr, &mut attempt, 1).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    // The processes started before take the new keys to issue with.
    let start = Instant::now();
    loop {
        device.sync(first.addr).await;
        if key_id(&device.cursor("user:kim")) == "ic-2" {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "ic-1 still issued"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Retiring: never the active key; a verify-only one, and tokens under
    // it are refused from then on.
    let with_old_cursor = String::from_utf8(device.replica.request(
        &device.client_id,
        device.generation,
        100,
    ))
    .unwrap()
    .replace(&device.cursor("user:kim"), &old_cursor)
    .into_bytes();
    let (status, b) = send(first.addr, "/sync/pull", "kim", with_old_cursor.clone()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    let (ok, _, err) = synchro(&["keys", "retire", "--key-id", "ic-2", "--confirm"], &url);
    assert!(!ok && err.contains("no such verify-only key"), "{err}");
    let (ok, _, err) = synchro(&["keys", "retire", "--key-id", "ic-1"], &url);
    assert!(!ok && err.contains("--confirm"), "{err}");
    let (ok, _, err) = synchro(&["keys", "retire", "--key-id", "ic-1", "--confirm"], &url);
    assert!(ok, "{err}");
    eventually(
        Duration::from_secs(20),
        "the retired key refused",
        || async {
            let (status, b) = send(first.addr, "/sync/pull", "kim", with_old_cursor.clone()).await;
            status == 400 && code(&b) == "invalid_request"
        },
    )
    .await;
    // The other process too, once its ring is `RELOAD_AGE` old.
    eventually(Duration::from_secs(20), "refused by the second", || async {
        let (status, b) = send(second.addr, "/sync/pull", "kim", with_old_cursor.clone()).await;
        status == 400 && code(&b) == "invalid_request"
    })
    .await;
}

#[tokio::test]
async fn a_quarantine_is_shown_and_retried_once_repaired() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, pool) = setup(&cluster, "quarantine").await;
    let server = serve(dir.path(), &url, false);
    wait_ready(server.addr).await;
    let (ok, out, err) = synchro(&["quarantine", "show"], &url);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "capture: not blocked");

    sqlx::raw_sql("ALTER TABLE public.notes DISABLE TRIGGER synchro_version")
        .execute(&pool)
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "quarantined", || async {
        synchro(&["quarantine", "show"], &url)
            .1
            .contains("capture: blocked (capture_disabled)")
    })
    .await;
    assert!(!ready(server.addr).await);
    let (_, out, _) = synchro(&["quarantine", "show"], &url);
    assert!(out.contains("what it means: a capture trigger"), "{out}");

    // Not repaired: the retry finds it blocked again.
    let (ok, _, err) = synchro(&["quarantine", "retry"], &url);
    assert!(!ok && err.contains("--confirm"), "{err}");
    let (ok, _, err) = synchro(&["quarantine", "retry", "--confirm"], &url);
    assert!(!ok, "not repaired yet");
    assert!(err.contains("blocked again (capture_disabled)"), "{err}");

    // Repaired, then retried: capture resumes and the server is ready.
    sqlx::raw_sql("ALTER TABLE public.notes ENABLE TRIGGER synchro_version")
        .execute(&pool)
        .await
        .unwrap();
    let (ok, out, err) = synchro(&["quarantine", "retry", "--confirm"], &url);
    assert!(ok, "{out}{err}");
    assert!(out.contains("capture resumed"), "{out}");
    wait_ready(server.addr).await;
    let (_, out, _) = synchro(&["quarantine", "show"], &url);
    assert_eq!(out.trim(), "capture: not blocked");
}

#[tokio::test]
async fn stream_status_reports_lag_and_wal_as_json() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, _pool) = setup(&cluster, "status").await;
    let server = serve(dir.path(), &url, false);
    wait_ready(server.addr).await;
    let (ok, out, err) = synchro(&["stream", "status", "--json"], &url);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["stream_generation"], 1);
    assert_eq!(v["slot"]["name"], "synchro_status");
    assert_eq!(v["slot"]["state"], "present");
    assert!(v["slot"]["retained_wal_bytes"].as_u64().is_some(), "{v}");
    assert!(v["capture"]["lag_seconds"].as_f64().unwrap() < 5.0, "{v}");
    assert_eq!(v["capture"]["blocked"], serde_json::Value::Null);
    assert_eq!(v["baseline_owed"], false);
    let (ok, out, _) = synchro(&["stream", "status"], &url);
    assert!(ok);
    assert!(out.contains("slot holds: "), "{out}");
    assert!(out.contains("capture lag: caught up"), "{out}");
}

/// `--log-format json`: every line the server logs is one JSON object with
/// a level and a message, and none holds the user, the client or a token.
#[tokio::test]
async fn json_logs_are_one_object_per_line_without_identities() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, _pool) = setup(&cluster, "logs").await;
    let (config, data) = (dir.path().join("config.toml"), dir.path().join("data"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_synchro"))
        .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .args(["--database-url", &url])
        .arg("--config")
        .arg(&config)
        .arg("--data-dir")
        .arg(&data)
        // Every request logged, as an operator would turn it on.
        .env("RUST_LOG", "info,server::adapter=debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The log goes to stdout, beside the lines the binary prints itself.
    let (addr, logged) = {
        use std::io::BufRead;
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines();
        let addr: SocketAddr = loop {
            let line = lines.next().unwrap().unwrap();
            if let Some(a) = line.strip_prefix("synchro: listening on http://") {
                break a.parse().unwrap();
            }
        };
        (
            addr,
            std::thread::spawn(move || lines.map_while(Result::ok).collect::<Vec<_>>()),
        )
    };
    wait_ready(addr).await;
    let store = PgStore::connect(cluster.connect_options("logs"))
        .await
        .unwrap();
    let mut device = Device::connect(addr, &store, "logged-user", "logged-client").await;
    device.sync(addr).await;
    let cursor = device.cursor("user:logged-user");
    let (status, _) = send(addr, "/sync/pull", "logged-user", b"{}".to_vec()).await;
    assert_eq!(status, 400);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    child.wait().unwrap();
    let lines: Vec<String> = logged
        .join()
        .unwrap()
        .into_iter()
        .filter(|l| !l.is_empty() && !l.starts_with("synchro: "))
        .collect();
    assert!(lines.len() >= 4, "requests were logged:\n{lines:#?}");
    for line in &lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string(), "{line}");
        assert!(v["fields"]["message"].is_string(), "{line}");
    }
    let text = lines.join("\n");
    assert!(
        text.contains(r#""path":"/sync/pull""#) && text.contains(r#""status":400"#),
        "the access log is there:\n{text}"
    );
    for secret in ["logged-user", "logged-client", cursor.as_str()] {
        assert!(!text.contains(secret), "the log holds `{secret}`:\n{text}");
    }
}
