//! The adapter over real HTTP against a throwaway PostgreSQL cluster: the
//! shared connect suite on PgStore, the transport gates, readiness, and a
//! check that logs hold no credential, identity or body.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::io::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use actors::Engine;
use actors::config::{AuthConfig, SyncConfig};
use actors::testkit::{ConnectBody, Harness, HarnessFactory, connect_suite, example_config};
use protocol::json::{self, Value};
use server::adapter::{AppState, router};
use server::auth::{Authenticator, dev_token, hs256_secret};
use store_pg::cluster::PgCluster;
use store_pg::{PgStore, example_store};
use tokio::task::JoinHandle;

mod common;
use common::request;

struct Server {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

async fn start_server(store: PgStore, config: &SyncConfig, auth: Arc<Authenticator>) -> Server {
    let engine = Engine::start(store, config.clone()).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(AppState::new(engine, auth, &config.server));
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Server { addr, task }
}

struct Http {
    store: PgStore,
    server: Server,
    auth: Arc<Authenticator>,
    secret: Vec<u8>,
}

impl Http {
    fn token(&self, user: &str) -> String {
        dev_token(
            &self.secret,
            user,
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs(),
            &Default::default(),
        )
        .unwrap()
    }

    async fn exec(&self, sql: &str, a: &str, b: &str) {
        sqlx::query(sql)
            .bind(a)
            .bind(b)
            .execute(self.store.pool())
            .await
            .unwrap();
    }
}

impl Harness for Http {
    async fn connect(&mut self, user: &str, body: &Value) -> (u16, Value) {
        let auth = format!("Bearer {}", self.token(user));
        let headers = [
            ("authorization", auth.as_str()),
            ("content-type", "application/json"),
        ];
        let (status, h, body) = request(
            self.server.addr,
            "POST",
            "/sync/connect",
            &headers,
            json::to_canonical(body),
        )
        .await;
        assert_eq!(h.get("content-type").unwrap(), "application/json");
        (status, json::parse(&body).unwrap())
    }

    async fn restart(&mut self, config: &SyncConfig) {
        self.server.task.abort();
        // The operator migrates the tables with the config: every synced column exists.
        sqlx::raw_sql(
            "ALTER TABLE public.notes ADD COLUMN IF NOT EXISTS color text, ADD COLUMN IF NOT EXISTS rank int;
             ALTER TABLE public.templates ADD COLUMN IF NOT EXISTS rank int;",
        )
        .execute(self.store.pool())
        .await
        .unwrap();
        self.server = start_server(self.store.clone(), config, self.auth.clone()).await;
    }

    async fn grant(&mut self, user: &str, scope: &str, on: bool) {
        let sql = if on {
            "INSERT INTO synchro.scope_grants (user_id, scope_id) VALUES ($1, $2)"
        } else {
            "DELETE FROM synchro.scope_grants WHERE user_id = $1 AND scope_id = $2"
        };
        self.exec(sql, user, scope).await;
    }

    async fn team_member(&mut self, user: &str, team: &str, on: bool) {
        let sql = if on {
            "INSERT INTO public.team_members (user_id, team_id) VALUES ($1, $2)"
        } else {
            "DELETE FROM public.team_members WHERE user_id = $1 AND team_id = $2"
        };
        self.exec(sql, user, team).await;
    }

    async fn retire(&mut self, client_id: &str) {
        sqlx::query("UPDATE synchro.clients SET retired = true WHERE client_id = $1")
            .bind(client_id)
            .execute(self.store.pool())
            .await
            .unwrap();
    }
}

struct HttpFactory {
    cluster: PgCluster,
    databases: AtomicUsize,
    auth: Arc<Authenticator>,
    secret: Vec<u8>,
}

impl HttpFactory {
    async fn new(secret_dir: &std::path::Path) -> HttpFactory {
        let secret_file = secret_dir.join("hs256.secret").display().to_string();
        let secret = hs256_secret(std::path::Path::new(&secret_file)).unwrap();
        let auth = Arc::new(
            Authenticator::from_config(&AuthConfig::hs256(&secret_file))
                .await
                .unwrap(),
        );
        HttpFactory {
            cluster: PgCluster::temp().unwrap(),
            databases: AtomicUsize::new(0),
            auth,
            secret,
        }
    }
}

impl HarnessFactory for HttpFactory {
    type H = Http;

    async fn fresh(&self, config: &SyncConfig) -> Http {
        let n = self.databases.fetch_add(1, Ordering::Relaxed);
        let store = example_store(&self.cluster, &format!("h{n}")).await;
        let server = start_server(store.clone(), config, self.auth.clone()).await;
        Http {
            store,
            server,
            auth: self.auth.clone(),
            secret: self.secret.clone(),
        }
    }
}

/// Captures log output.
#[derive(Clone, Default)]
struct LogBuffer(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits until capture has materialized the stream's baseline.
async fn baseline_ended(store: &PgStore) {
    use actors::store::{Store, StoreTx};
    for _ in 0..1000 {
        let mut tx = store.begin().await.unwrap();
        if !tx.capture_progress().await.unwrap().baseline_owed {
            return;
        }
        drop(tx);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the baseline did not end in 20 s");
}

fn error_code(body: &[u8]) -> (String, Value) {
    let v = json::parse(body).unwrap();
    let e = v.as_object().unwrap()["error"].clone();
    (
        e.as_object().unwrap()["code"].as_str().unwrap().to_owned(),
        e,
    )
}

// One runtime thread, so the log subscriber set below sees every task.
#[tokio::test(flavor = "current_thread")]
async fn http_against_postgres() {
    let logs = LogBuffer::default();
    let writer = logs.clone();
    // The access log is at debug level: on for the adapter, as an operator
    // would turn it on.
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "info,server::adapter=debug",
        ))
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let secrets = tempfile::tempdir().unwrap();
    let factory = HttpFactory::new(secrets.path()).await;

    // Every connect scenario, over HTTP, on PostgreSQL.
    connect_suite(&factory).await;

    // Transport gates.
    let h = factory.fresh(&example_config(|s| s)).await;
    let addr = h.server.addr;
    let body = json::to_canonical(&ConnectBody::fresh("client-9b2e").to_json());
    let token = h.token("user-7f3a");
    let bearer = format!("Bearer {token}");
    for headers in [
        vec![("content-type", "application/json")],
        vec![
            ("authorization", "Bearer not-a-jwt"),
            ("content-type", "application/json"),
        ],
        vec![
            ("authorization", token.as_str()),
            ("content-type", "application/json"),
        ],
        vec![
            ("authorization", "Basic dXNlcjpwdw=="),
            ("content-type", "application/json"),
        ],
        vec![("content-type", "text/plain")], // authentication comes first
    ] {
        let (status, _, b) = request(addr, "POST", "/sync/connect", &headers, body.clone()).await;
        assert_eq!(
            (status, error_code(&b).0.as_str()),
            (401, "auth_required"),
            "{headers:?}"
        );
    }
    for content_type in [None, Some("text/plain"), Some("application/jsonx")] {
        let mut headers = vec![("authorization", bearer.as_str())];
        headers.extend(content_type.map(|c| ("content-type", c)));
        let (status, _, b) = request(addr, "POST", "/sync/connect", &headers, body.clone()).await;
        assert_eq!(
            (status, error_code(&b).0.as_str()),
            (400, "invalid_request"),
            "{content_type:?}"
        );
    }
    let headers = [
        ("authorization", bearer.as_str()),
        ("content-type", "application/json; charset=utf-8"),
    ];
    let (status, _, _) = request(addr, "POST", "/sync/connect", &headers, body.clone()).await;
    assert_eq!(status, 200);
    // The body limit, enforced while reading.
    let mut big = body.clone();
    big.truncate(big.len() - 1);
    big.extend(std::iter::repeat_n(b' ', 1_048_577 - big.len() - 1));
    big.push(b'}');
    assert_eq!(big.len(), 1_048_577);
    let (status, _, b) = request(addr, "POST", "/sync/connect", &headers, big.clone()).await;
    assert_eq!(
        (status, error_code(&b).0.as_str()),
        (400, "invalid_request")
    );
    big.truncate(1_048_576 - 1);
    big.push(b'}');
    // Exactly at the limit the body is read, parsed and answered (it repeats
    // this client's fresh first connect, so it gets the same answer).
    let (status, _, b) = request(addr, "POST", "/sync/connect", &headers, big).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));

    // Push over HTTP: the stored canonical bytes come back unchanged, and a
    // replay gets the same bytes.
    let connect: Value = json::parse(
        &request(addr, "POST", "/sync/connect", &headers, body.clone())
            .await
            .2,
    )
    .unwrap();
    let o = connect.as_object().unwrap();
    let schema = o["schema"].as_object().unwrap();
    let push_body = json::to_canonical(&json::object([
        ("client_id", Value::string("client-9b2e")),
        ("client_generation", o["client_generation"].clone()),
        (
            "batch_id",
            Value::string("10000000-0000-4000-8000-0000000000aa"),
        ),
        (
            "schema",
            json::object([
                ("version", schema["version"].clone()),
                ("hash", schema["hash"].clone()),
            ]),
        ),
        (
            "mutations",
            Value::Array(vec![actors::testkit::note_mutation(
                1,
                &actors::testkit::note_id(1),
                &json::object([
                    ("version", schema["version"].clone()),
                    ("hash", schema["hash"].clone()),
                ]),
                "insert",
                None,
                Some(actors::testkit::note_columns("over http")),
            )]),
        ),
    ]));
    // The push lands after the baseline: a row the baseline reads reaches
    // a client by rebuild (ADR 0033), not as a change after the stream's start.
    baseline_ended(&h.store).await;
    let (status, h_push, first) =
        request(addr, "POST", "/sync/push", &headers, push_body.clone()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&first));
    assert_eq!(h_push.get("content-type").unwrap(), "application/json");
    assert!(actors::testkit::outcome(&json::parse(&first).unwrap(), 1).0);
    let (status, _, again) = request(addr, "POST", "/sync/push", &headers, push_body).await;
    assert_eq!((status, again), (200, first));
    let mut big_push = b"{\"client_id\":\"client-9b2e\",\"pad\":\"".to_vec();
    big_push.extend(std::iter::repeat_n(b'x', 1_048_577));
    let (status, _, b) = request(addr, "POST", "/sync/push", &headers, big_push).await;
    assert_eq!(
        (status, error_code(&b).0.as_str()),
        (400, "invalid_request")
    );

    // Pull over HTTP: a fresh client's scopes rebuild first (the origin
    // cursor stands in for rebuild, issue 12); then the page carries the
    // pushed row, which the replica verifies with every terminal checksum.
    let manifest = {
        use actors::store::{Store, StoreTx};
        let mut tx = h.store.begin().await.unwrap();
        tx.manifests().await.unwrap().pop().unwrap()
    };
    let mut replica = invariants::pull::Replica::new(manifest);
    replica.connected(&json::to_canonical(&connect)).unwrap();
    let generation = actors::testkit::int_member(&connect, "client_generation");
    // Right after the push, until capture has the write: 503 capture_pending.
    let mut page = Vec::new();
    for _ in 0..500 {
        let (status, _, b) = request(
            addr,
            "POST",
            "/sync/pull",
            &headers,
            replica.request("client-9b2e", generation, 100),
        )
        .await;
        page = b;
        if status != 503 {
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&page));
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let applied = replica.apply(&page).unwrap();
    assert_eq!(
        applied.rebuild.len(),
        replica.scopes.len(),
        "every scope starts with a rebuild"
    );
    let scopes: Vec<String> = replica.scopes.keys().cloned().collect();
    for s in &scopes {
        let cursor =
            actors::testkit::origin_cursor(&h.store, "user-7f3a", "client-9b2e", generation, s)
                .await;
        replica.scopes.get_mut(s).unwrap().cursor = Some(cursor);
    }
    let mut pulled = None;
    for _ in 0..500 {
        let (status, response_headers, page) = request(
            addr,
            "POST",
            "/sync/pull",
            &headers,
            replica.request("client-9b2e", generation, 100),
        )
        .await;
        if status == 503 {
            assert_eq!(error_code(&page).0, "capture_pending");
            assert_eq!(response_headers.get("retry-after").unwrap(), "5");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            continue;
        }
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&page));
        pulled = Some(replica.apply(&page).unwrap());
        break;
    }
    let pulled = pulled.expect("capture_pending cleared");
    assert_eq!((pulled.changes, pulled.has_more), (1, false));
    assert!(
        pulled.mismatched.is_empty(),
        "every terminal checksum verifies"
    );
    assert_eq!(replica.scopes["user:user-7f3a"].rows.len(), 1);
    let forged = {
        let mut v = json::parse(&replica.request("client-9b2e", generation, 100)).unwrap();
        if let Value::Object(o) = &mut v
            && let Some(Value::Object(scopes)) = o.get_mut("scopes")
        {
            scopes.insert(
                "user:user-7f3a".into(),
                json::object([("cursor", Value::string("ic1.e30.AAAA"))]),
            );
        }
        json::to_canonical(&v)
    };
    let (status, _, b) = request(addr, "POST", "/sync/pull", &headers, forged).await;
    assert_eq!(
        (status, error_code(&b).0.as_str()),
        (400, "invalid_request")
    );
    let other = format!("Bearer {}", h.token("user-other"));
    let other_headers = [
        ("authorization", other.as_str()),
        ("content-type", "application/json"),
    ];
    let (status, _, b) = request(
        addr,
        "POST",
        "/sync/pull",
        &other_headers,
        replica.request("client-9b2e", generation, 100),
    )
    .await;
    assert_eq!((status, error_code(&b).0.as_str()), (401, "auth_required"));

    // Operator routes. Readiness also needs capture running (it starts
    // with the engine), so it may take a moment to turn true.
    let mut ready = request(addr, "GET", "/ready", &[], vec![]).await;
    for _ in 0..500 {
        if ready.0 == 200 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        ready = request(addr, "GET", "/ready", &[], vec![]).await;
    }
    let (status, h1, b) = ready;
    assert_eq!(
        (
            status,
            b.as_slice(),
            h1.get("content-type").unwrap().to_str().unwrap()
        ),
        (200, &br#"{"ready":true}"#[..], "application/json")
    );
    let (status, _, b) = request(addr, "GET", "/sync/schema", &[], vec![]).await;
    assert_eq!(status, 200);
    let m = protocol::manifest::Manifest::from_json(json::parse(&b).unwrap()).unwrap();
    assert_eq!(m.tables().len(), 2);
    let (status, _, b) = request(addr, "GET", "/sync/tables", &[], vec![]).await;
    assert_eq!(status, 200);
    assert!(
        String::from_utf8(b)
            .unwrap()
            .contains(r#""relation":"public.notes""#)
    );

    // Unknown routes and wrong methods answer with the envelope too.
    for (method, path, status) in [
        ("GET", "/sync/nothing", 404),
        ("POST", "/", 404),
        ("GET", "/sync/push", 405),
        ("POST", "/ready", 405),
        ("DELETE", "/sync/connect", 405),
    ] {
        let (got, headers_out, b) = request(addr, method, path, &headers, vec![]).await;
        let (code, e) = error_code(&b);
        assert_eq!(
            (got, code.as_str()),
            (status, "invalid_request"),
            "{method} {path}"
        );
        assert_eq!(e.as_object().unwrap()["retryable"], Value::Bool(false));
        assert_eq!(headers_out.get("content-type").unwrap(), "application/json");
    }

    // A lost database: 503 temporary_unavailable with Retry-After, and not ready.
    let lost = PgCluster::temp().unwrap();
    let store = example_store(&lost, "gone").await;
    let server = start_server(store, &example_config(|s| s), h.auth.clone()).await;
    lost.stop();
    let (status, headers_out, b) =
        request(server.addr, "POST", "/sync/connect", &headers, body.clone()).await;
    let (code, e) = error_code(&b);
    assert_eq!((status, code.as_str()), (503, "temporary_unavailable"));
    assert_eq!(e.as_object().unwrap()["retryable"], Value::Bool(true));
    assert_eq!(headers_out.get("retry-after").unwrap(), "5");
    let (status, headers_out, b) = request(server.addr, "GET", "/ready", &[], vec![]).await;
    assert_eq!((status, b.as_slice()), (503, &br#"{"ready":false}"#[..]));
    assert_eq!(headers_out.get("retry-after").unwrap(), "5");
    h.server.task.abort();

    // Logs: request lines, and nothing sensitive.
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(text.contains("path=/sync/connect status=200"), "{text}");
    assert!(text.contains("path=/sync/push status=200"), "{text}");
    for secret in [
        token.as_str(),
        "user-7f3a",
        "client-9b2e",
        "alice",
        "ios-device",
        "opaque-cursor",
        "over http",
        "30000000-0000-4000-8000-000000000001",
    ] {
        assert!(!text.contains(secret), "the logs contain `{secret}`");
    }
}
