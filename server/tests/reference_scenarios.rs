//! The reference implementation's scenarios that our server once failed
//! (issue 29, ADR 0016), against the real binary over HTTP on a throwaway
//! PostgreSQL cluster: a row deleted by a cascade, deferrable constraints
//! checked at the end of each push unit, a typed key of the wrong type, a
//! damaged stored row, a restart on an unchanged config whose tables share
//! field IDs, and an empty scope ID.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sqlx::PgPool;
use store_pg::cluster::PgCluster;

mod common;

/// The application's tables. Every synced table names its key `id` and its
/// owner `owner`, as the reference's own manifests do.
const SCHEMA: &str = "
CREATE TABLE public.parents (id text PRIMARY KEY, owner text NOT NULL, value text NOT NULL);
CREATE TABLE public.children (
    id text PRIMARY KEY, owner text NOT NULL, value text NOT NULL,
    parent_id text NOT NULL REFERENCES public.parents (id) ON DELETE CASCADE);
-- A trigger writes a log row that references its document before the
-- document exists: the state holds again at the end of the write.
CREATE TABLE public.docs (id text PRIMARY KEY, owner text NOT NULL, value text NOT NULL);
CREATE TABLE public.doc_log (
    doc_id text NOT NULL REFERENCES public.docs (id) DEFERRABLE INITIALLY IMMEDIATE);
CREATE FUNCTION public.log_doc() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
  INSERT INTO public.doc_log VALUES (NEW.id);
  RETURN NEW;
END $$;
CREATE TRIGGER log_doc BEFORE INSERT ON public.docs FOR EACH ROW EXECUTE FUNCTION public.log_doc();
-- Rows that reference each other.
CREATE TABLE public.links (
    id text PRIMARY KEY, owner text NOT NULL, value text NOT NULL,
    partner text REFERENCES public.links (id) DEFERRABLE INITIALLY IMMEDIATE);
-- A deferrable reference that can fail at the end of a unit.
CREATE TABLE public.items (
    id text PRIMARY KEY, owner text NOT NULL, value text NOT NULL,
    parent_id text REFERENCES public.parents (id) DEFERRABLE INITIALLY IMMEDIATE);
CREATE TABLE public.counters (id integer PRIMARY KEY, owner text NOT NULL, value text NOT NULL);
CREATE TABLE public.tags (id text PRIMARY KEY, owner text NOT NULL, grp text);
";

/// One synced table: `id`, `owner`, a writable `value`, and `extra`
/// writable fields, in the owner's scope.
fn table(name: &str, key: &str, extra: &[&str]) -> String {
    let mut fields = vec![
        format!("{{ field_id = \"id\", column = \"id\", type = \"{key}\" }}"),
        "{ field_id = \"owner\", column = \"owner\", type = \"string\" }".to_owned(),
        "{ field_id = \"value\", column = \"value\", type = \"string\", writable = true }"
            .to_owned(),
    ];
    fields.extend(extra.iter().map(|f| {
        format!("{{ field_id = \"{f}\", column = \"{f}\", type = \"string\", nullable = true, writable = true }}")
    }));
    format!(
        "[[tables]]\ntable_id = \"{name}\"\nrelation_id = \"rel_{name}\"\nrelation = \"public.{name}\"\n\
         name = \"{name}\"\nprimary_key = \"id\"\nowner_column = \"owner\"\nfields = [\n  {}\n]\n\
         scopes = [{{ template = \"user:{{owner}}\" }}]\n",
        fields.join(",\n  ")
    )
}

/// The config; `tags_rule` places each tag.
fn config(tags_rule: &str) -> String {
    let mut c = String::from(
        "[auth]\nmode = \"upstream\"\nheader = \"x-user\"\n\n\
         [assignment]\nuser_scope = \"user:{user_id}\"\n\n\
         [capture]\nheartbeat_ms = 100\nretry_ms = 100\n\n",
    );
    for t in [
        table("parents", "string", &[]),
        table("children", "string", &["parent_id"]),
        table("docs", "string", &[]),
        table("links", "string", &["partner"]),
        table("items", "string", &["parent_id"]),
        table("counters", "int", &[]),
    ] {
        c.push_str(&t);
        c.push('\n');
    }
    c.push_str(&format!(
        "[[tables]]\ntable_id = \"tags\"\nrelation_id = \"rel_tags\"\nrelation = \"public.tags\"\n\
         name = \"tags\"\nprimary_key = \"id\"\nfields = [\n  \
         {{ field_id = \"id\", column = \"id\", type = \"string\" }},\n  \
         {{ field_id = \"owner\", column = \"owner\", type = \"string\" }},\n  \
         {{ field_id = \"grp\", column = \"grp\", type = \"string\", nullable = true }},\n]\n\
         scopes = [{tags_rule}]\n"
    ));
    c
}

const GROUP_RULE: &str = "{ template = \"group:{grp}\" }";
const SHARED_RULE: &str = "{ constant = \"all_tags\" }";

struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(dir: &Path, url: &str) -> Server {
        let (child, addr) = common::serve_dir(dir, Some(url), Stdio::null());
        Server { child, addr }
    }

    /// SIGTERM, and the exit status (the drop after it finds the
    /// process already gone).
    fn stop(mut self) -> std::process::ExitStatus {
        Command::new("kill")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        self.child.wait().unwrap()
    }

    async fn post(&self, user: &str, path: &str, body: &Value) -> (u16, Value) {
        let headers = [("x-user", user), ("content-type", "application/json")];
        let (status, h, bytes) =
            common::request(self.addr, "POST", path, &headers, body.to_string().into()).await;
        assert_eq!(h.get("content-type").unwrap(), "application/json");
        let value = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!(
                "{path} answered {status} with a body that is not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        (status, value)
    }

    async fn ready(&self) -> bool {
        let (_, _, body) = common::request(self.addr, "GET", "/ready", &[], Vec::new()).await;
        let body: Value = serde_json::from_slice(&body).unwrap();
        body["ready"].as_bool().unwrap()
    }

    async fn ready_becomes(&self, want: bool, what: &str) {
        let start = Instant::now();
        while self.ready().await != want {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "timed out: {what}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A canonical UUID numbered `n`.
fn uuid(n: u64) -> String {
    format!("018f2b5e-7c42-7a1d-9d31-{n:012x}")
}

/// One client of one user.
struct Device {
    user: &'static str,
    client_id: &'static str,
    generation: u64,
    schema: Value,
    scope_set_version: u64,
    next: u64,
}

impl Device {
    async fn connect(server: &Server, user: &'static str, client_id: &'static str) -> Device {
        let body = json!({
            "client_id": client_id, "platform": "ios", "app_version": "1.0.0",
            "protocol_version": 3, "schema": {"version": 0, "hash": ""},
            "scope_set_version": 0, "known_scopes": {},
        });
        let (status, r) = server.post(user, "/sync/connect", &body).await;
        assert_eq!(status, 200, "{r}");
        Device {
            user,
            client_id,
            generation: r["client_generation"].as_u64().unwrap(),
            schema: json!({"version": r["schema"]["version"], "hash": r["schema"]["hash"]}),
            scope_set_version: r["scope_set_version"].as_u64().unwrap(),
            next: u64::from(client_id.as_bytes()[0]) << 32,
        }
    }

    fn id(&mut self) -> String {
        self.next += 1;
        uuid(self.next)
    }

    /// A mutation of `table` at key `pk`.
    fn mutation(
        &mut self,
        table: &str,
        pk: Value,
        op: &str,
        base: Option<&str>,
        columns: Option<Value>,
    ) -> Value {
        let mut m = json!({
            "mutation_id": self.id(), "table": table, "pk": {"id": pk},
            "authored_schema": self.schema, "op": op,
            "client_version": "2026-07-18T13:59:01.000000Z",
        });
        if let Some(b) = base {
            m["base_version"] = json!(b);
        }
        if let Some(c) = columns {
            m["columns"] = c;
        }
        m
    }

    fn insert(&mut self, table: &str, id: &str, columns: Value) -> Value {
        self.mutation(table, json!(id), "insert", None, Some(columns))
    }

    async fn push(&mut self, server: &Server, mutations: Vec<Value>, atomic: bool) -> (u16, Value) {
        let mut body = json!({
            "client_id": self.client_id, "client_generation": self.generation,
            "batch_id": self.id(), "schema": self.schema, "mutations": mutations,
        });
        if atomic {
            body["atomic"] = json!(true);
        }
        server.post(self.user, "/sync/push", &body).await
    }

    /// A push that must answer 200; its outcomes in request order.
    async fn outcomes(
        &mut self,
        server: &Server,
        mutations: Vec<Value>,
        atomic: bool,
    ) -> Vec<Value> {
        let ids: Vec<Value> = mutations.iter().map(|m| m["mutation_id"].clone()).collect();
        let (status, r) = self.push(server, mutations, atomic).await;
        assert_eq!(status, 200, "{r}");
        let all: Vec<&Value> = r["accepted"]
            .as_array()
            .unwrap()
            .iter()
            .chain(r["rejected"].as_array().unwrap())
            .collect();
        ids.iter()
            .map(|id| (*all.iter().find(|o| o["mutation_id"] == *id).unwrap()).clone())
            .collect()
    }

    /// Rebuilds `scope` to its final page: the final incremental cursor.
    async fn rebuild(&mut self, server: &Server, scope: &str) -> String {
        let rebuild_id = self.id();
        let mut cursor = Value::Null;
        let start = Instant::now();
        loop {
            let body = json!({
                "client_id": self.client_id, "client_generation": self.generation,
                "schema": self.schema, "scope": scope, "rebuild_id": rebuild_id,
                "cursor": cursor, "limit": 1000,
            });
            let (status, r) = server.post(self.user, "/sync/rebuild", &body).await;
            if status == 503 {
                // Capture has not yet passed an accepted push of this client.
                assert!(start.elapsed() < Duration::from_secs(60), "{r}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            assert_eq!(status, 200, "{r}");
            if r["has_more"] == json!(false) {
                return r["final_scope_cursor"].as_str().unwrap().to_owned();
            }
            cursor = r["cursor"].clone();
        }
    }

    async fn pull(&self, server: &Server, scope: &str, cursor: &str) -> (u16, Value) {
        let body = json!({
            "client_id": self.client_id, "client_generation": self.generation,
            "schema": self.schema, "scope_set_version": self.scope_set_version,
            "scopes": {scope: {"cursor": cursor}}, "limit": 1000,
        });
        server.post(self.user, "/sync/pull", &body).await
    }
}

fn code(o: &Value) -> &str {
    o["code"].as_str().unwrap_or("applied")
}

fn version(o: &Value) -> String {
    o["server_version"].as_str().unwrap().to_owned()
}

fn error(r: &Value) -> &str {
    r["error"]["code"].as_str().unwrap()
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Issue 29 item 1: a row an earlier write of the batch deleted by cascade
/// is `row_deleted`, with the committed state: fence-only in a non-atomic
/// batch, live again (row, checksum, version) after an atomic rollback.
async fn a_cascade_deleted_row_is_row_deleted(server: &Server, d: &mut Device) {
    let mutations = vec![
        d.insert("parents", "p1", json!({"value": "a"})),
        d.insert("children", "c1", json!({"value": "b", "parent_id": "p1"})),
        d.insert("parents", "p2", json!({"value": "a"})),
        d.insert("children", "c2", json!({"value": "b", "parent_id": "p2"})),
    ];
    let made = d.outcomes(server, mutations, false).await;
    assert!(made.iter().all(|o| code(o) == "applied"), "{made:?}");
    let [p1, c1, p2, c2] = [0, 1, 2, 3].map(|i| version(&made[i]));

    // Atomic: the group rolls back, and the child stands again.
    let mutations = vec![
        d.mutation("parents", json!("p2"), "delete", Some(&p2), None),
        d.mutation(
            "children",
            json!("c2"),
            "update",
            Some(&c2),
            Some(json!({"value": "x"})),
        ),
    ];
    let o = d.outcomes(server, mutations, true).await;
    assert_eq!(code(&o[0]), "atomic_batch_rejected");
    assert_eq!(o[1]["status"], "conflict", "{}", o[1]);
    assert_eq!(code(&o[1]), "row_deleted", "{}", o[1]);
    assert_eq!(
        version(&o[1]),
        c2,
        "the committed version after the rollback"
    );
    assert_eq!(o[1]["server_row"]["value"], "b");
    assert_eq!(o[1]["server_row"]["id"], "c2");
    assert_eq!(o[1]["row_checksum"]["digest"].as_str().unwrap().len(), 64);

    // Not atomic: the parent's delete applies, and the child is gone with it.
    let mutations = vec![
        d.mutation("parents", json!("p1"), "delete", Some(&p1), None),
        d.mutation(
            "children",
            json!("c1"),
            "update",
            Some(&c1),
            Some(json!({"value": "x"})),
        ),
        d.mutation("children", json!("c1"), "delete", Some(&c1), None),
    ];
    let o = d.outcomes(server, mutations, false).await;
    assert_eq!(code(&o[0]), "applied", "{}", o[0]);
    for o in &o[1..] {
        assert_eq!(
            (o["status"].as_str(), code(o)),
            (Some("conflict"), "row_deleted"),
            "{o}"
        );
        // A fence-only delete: its version, no row and no checksum.
        assert_ne!(version(o), c1);
        assert!(
            o.get("server_row").is_none() && o.get("row_checksum").is_none(),
            "{o}"
        );
    }
}

/// Issue 29 item 2: deferrable constraints wait for the end of the push unit.
async fn deferrable_constraints_wait_for_the_unit_end(
    server: &Server,
    pool: &PgPool,
    d: &mut Device,
) {
    // A trigger writes a row referencing its document before the document.
    let mutations = vec![d.insert("docs", "d1", json!({"value": "v"}))];
    let o = d.outcomes(server, mutations, false).await;
    assert_eq!(code(&o[0]), "applied", "{}", o[0]);
    let mutations = vec![d.insert("docs", "d2", json!({"value": "v"}))];
    let o = d.outcomes(server, mutations, true).await;
    assert_eq!(code(&o[0]), "applied", "{}", o[0]);
    assert_eq!(count(pool, "SELECT count(*) FROM public.doc_log").await, 2);

    // The end-of-group check fails: the last mutation owns the failure, and
    // nothing of the group is left.
    let mutations = vec![
        d.insert("items", "i1", json!({"value": "v", "parent_id": "missing"})),
        d.insert("parents", "p9", json!({"value": "v"})),
    ];
    let o = d.outcomes(server, mutations, true).await;
    assert_eq!(code(&o[0]), "atomic_batch_rejected", "{}", o[0]);
    assert_eq!(
        (o[1]["status"].as_str(), code(&o[1])),
        (Some("rejected_terminal"), "validation_failed"),
        "{}",
        o[1]
    );
    let left = "SELECT count(*) FROM public.items WHERE id = 'i1'";
    assert_eq!(count(pool, left).await, 0);
    assert_eq!(
        count(pool, "SELECT count(*) FROM public.parents WHERE id = 'p9'").await,
        0
    );
    // Not atomic, each mutation its own unit: only the dangling one fails.
    let mutations = vec![
        d.insert("items", "i1", json!({"value": "v", "parent_id": "missing"})),
        d.insert("items", "i2", json!({"value": "v"})),
    ];
    let o = d.outcomes(server, mutations, false).await;
    assert_eq!(code(&o[0]), "validation_failed", "{}", o[0]);
    assert_eq!(code(&o[1]), "applied", "{}", o[1]);

    // Two rows that reference each other, another table's write between.
    let mutations = vec![
        d.insert("links", "a", json!({"value": "v", "partner": "b"})),
        d.insert("counters", "7", json!({"value": "v"})),
        d.insert("links", "b", json!({"value": "v", "partner": "a"})),
    ];
    let mut mutations = mutations;
    mutations[1]["pk"]["id"] = json!(7);
    let o = d.outcomes(server, mutations, true).await;
    assert!(o.iter().all(|o| code(o) == "applied"), "{o:?}");
    assert_eq!(
        count(
            pool,
            "SELECT count(*) FROM public.links WHERE partner IS NOT NULL"
        )
        .await,
        2
    );
}

/// Issue 29 item 3: an `int` key sent as a string is the whole request's
/// `400 invalid_request`, atomic or not, and writes nothing.
async fn a_wrong_typed_key_is_400(server: &Server, pool: &PgPool, d: &mut Device) {
    for atomic in [false, true] {
        let mutations = vec![
            d.insert("parents", "p-untouched", json!({"value": "v"})),
            d.mutation(
                "counters",
                json!("5"),
                "insert",
                None,
                Some(json!({"value": "v"})),
            ),
        ];
        let (status, r) = d.push(server, mutations, atomic).await;
        assert_eq!((status, error(&r)), (400, "invalid_request"), "{r}");
    }
    let mutations = vec![d.mutation(
        "counters",
        json!(5),
        "insert",
        None,
        Some(json!({"value": "v"})),
    )];
    let o = d.outcomes(server, mutations, false).await;
    assert_eq!(code(&o[0]), "applied", "{}", o[0]);
    let untouched = "SELECT count(*) FROM public.parents WHERE id = 'p-untouched'";
    assert_eq!(count(pool, untouched).await, 0);
}

/// Issue 29 item 4: a damaged stored row fails the whole pull with `500
/// sync_integrity_failure` (no partial page, no cursor), and after the
/// repair the row is delivered exactly once.
async fn a_damaged_row_is_never_served(server: &Server, pool: &PgPool) {
    let mut d = Device::connect(server, "bob", "bob-1").await;
    let cursor = d.rebuild(server, "user:bob").await;
    sqlx::raw_sql(
        "INSERT INTO public.parents VALUES ('bob-1', 'bob', 'first');
         INSERT INTO public.parents VALUES ('bob-2', 'bob', 'second');",
    )
    .execute(pool)
    .await
    .unwrap();
    // The effect serves its row's projection (ADR 0037): the damage is there.
    let effect = "SELECT p.row_json FROM synchro.scope_effects e JOIN synchro.projections p \
                  USING (table_id, identity) WHERE e.scope_id = 'user:bob' AND e.key_json = '\"bob-2\"'";
    let start = Instant::now();
    let intact: String = loop {
        if let Some(text) = sqlx::query_scalar(effect)
            .fetch_optional(pool)
            .await
            .unwrap()
        {
            break text;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "capture did not materialize"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let damage = "UPDATE synchro.projections p SET row_json = $1 FROM synchro.scope_effects e \
                  WHERE e.scope_id = 'user:bob' AND e.key_json = '\"bob-2\"' \
                  AND p.table_id = e.table_id AND p.identity = e.identity";
    let damaged = intact.replacen("\"second\"", "", 1);
    assert_ne!(damaged, intact);
    sqlx::query(damage)
        .bind(&damaged)
        .execute(pool)
        .await
        .unwrap();
    let (status, r) = d.pull(server, "user:bob", &cursor).await;
    assert_eq!((status, error(&r)), (500, "sync_integrity_failure"), "{r}");
    assert!(r.get("changes").is_none(), "{r}");
    server
        .ready_becomes(false, "an integrity failure latches readiness")
        .await;
    let checkpoints = "SELECT count(*) FROM synchro.client_checkpoints WHERE client_id = 'bob-1'";
    assert_eq!(
        count(pool, checkpoints).await,
        0,
        "a failed pull acknowledges nothing"
    );

    sqlx::query(damage)
        .bind(&intact)
        .execute(pool)
        .await
        .unwrap();
    let (status, r) = d.pull(server, "user:bob", &cursor).await;
    assert_eq!(status, 200, "{r}");
    let keys: Vec<&str> = r["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["pk"]["id"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["bob-1", "bob-2"]);
    assert_eq!(r["changes"][1]["row"]["value"], "second");
    assert_eq!(r["has_more"], false);
    let next = r["scope_cursors"]["user:bob"].as_str().unwrap().to_owned();
    let (status, r) = d.pull(server, "user:bob", &next).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["changes"], json!([]), "delivered once");
    assert_eq!(count(pool, checkpoints).await, 1);
}

/// Issue 29 item 6: a row whose scope template renders to `''` blocks
/// capture as `invalid_scope_id` (readiness false); a repaired rule
/// materializes the same transaction.
async fn an_empty_scope_id_blocks_capture(server: &Server, pool: &PgPool) {
    sqlx::raw_sql("INSERT INTO public.tags VALUES ('t1', 'alice', '')")
        .execute(pool)
        .await
        .unwrap();
    server.ready_becomes(false, "capture is quarantined").await;
    let class = "SELECT quarantine_class FROM synchro.capture_progress";
    let start = Instant::now();
    loop {
        let q: Option<String> = sqlx::query_scalar(class).fetch_one(pool).await.unwrap();
        if q.is_some() {
            assert_eq!(q.as_deref(), Some("invalid_scope_id"));
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tagged = "SELECT count(*) FROM synchro.scope_effects WHERE key_json = '\"t1\"'";
    assert_eq!(count(pool, tagged).await, 0);
}

/// A private cluster with the application's tables, and the config file.
struct World {
    _cluster: PgCluster,
    url: String,
    pool: PgPool,
    dir: tempfile::TempDir,
}

impl World {
    async fn new() -> World {
        let cluster = PgCluster::temp().unwrap();
        cluster.create_database("reference").await.unwrap();
        let url = cluster.url("reference");
        let pool = PgPool::connect_with(cluster.connect_options("reference"))
            .await
            .unwrap();
        sqlx::raw_sql(SCHEMA).execute(&pool).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.toml"), config(GROUP_RULE)).unwrap();
        World {
            _cluster: cluster,
            url,
            pool,
            dir,
        }
    }

    /// The server on the config as it stands, once ready.
    async fn serve(&self) -> Server {
        let server = Server::start(self.dir.path(), &self.url);
        server.ready_becomes(true, "started").await;
        server
    }
}

#[tokio::test]
async fn a_cascade_deleted_row_is_row_deleted_over_http() {
    let w = World::new().await;
    let server = w.serve().await;
    let mut alice = Device::connect(&server, "alice", "alice-1").await;
    a_cascade_deleted_row_is_row_deleted(&server, &mut alice).await;
    assert!(server.stop().success());
}

#[tokio::test]
async fn deferrable_constraints_wait_for_the_unit_end_over_http() {
    let w = World::new().await;
    let server = w.serve().await;
    let mut alice = Device::connect(&server, "alice", "alice-1").await;
    deferrable_constraints_wait_for_the_unit_end(&server, &w.pool, &mut alice).await;
    assert!(server.stop().success());
}

#[tokio::test]
async fn a_wrong_typed_key_is_400_over_http() {
    let w = World::new().await;
    let server = w.serve().await;
    let mut alice = Device::connect(&server, "alice", "alice-1").await;
    a_wrong_typed_key_is_400(&server, &w.pool, &mut alice).await;
    assert!(server.stop().success());
}

/// Item 4, then the restart that clears the latched integrity failure.
#[tokio::test]
async fn a_damaged_row_is_never_served_over_http() {
    let w = World::new().await;
    let server = w.serve().await;
    a_damaged_row_is_never_served(&server, &w.pool).await;
    assert!(server.stop().success());
    let server = w.serve().await;
    assert!(server.ready().await);
    assert!(server.stop().success());
}

/// Item 5: the same config, whose tables share field IDs, starts again,
/// and a client carries on with its schema unchanged.
#[tokio::test]
async fn an_unchanged_config_with_shared_field_ids_starts_again() {
    let w = World::new().await;
    let server = w.serve().await;
    let mut alice = Device::connect(&server, "alice", "alice-1").await;
    let mutations = vec![alice.insert("parents", "p1", json!({"value": "a"}))];
    let o = alice.outcomes(&server, mutations, false).await;
    assert_eq!(code(&o[0]), "applied", "{}", o[0]);
    assert!(server.stop().success());
    let server = w.serve().await;
    let body = json!({
        "client_id": "alice-1", "client_generation": alice.generation, "platform": "ios",
        "app_version": "1.0.0", "protocol_version": 3, "schema": alice.schema,
        "scope_set_version": alice.scope_set_version, "known_scopes": {},
    });
    let (status, r) = server.post("alice", "/sync/connect", &body).await;
    assert_eq!(
        (status, &r["schema"]["action"]),
        (200, &json!("none")),
        "{r}"
    );
    assert!(server.stop().success());
}

/// Item 6, and its repair: tags belong to one shared scope instead; the
/// blocked transaction materializes and capture goes on.
#[tokio::test]
async fn an_empty_scope_id_blocks_capture_until_repaired() {
    let w = World::new().await;
    let server = w.serve().await;
    an_empty_scope_id_blocks_capture(&server, &w.pool).await;
    assert!(server.stop().success());
    std::fs::write(w.dir.path().join("config.toml"), config(SHARED_RULE)).unwrap();
    let server = Server::start(w.dir.path(), &w.url);
    let shared = "SELECT count(*) FROM synchro.scope_effects WHERE scope_id = 'all_tags' AND key_json = '\"t1\"'";
    let start = Instant::now();
    while count(&w.pool, shared).await != 1 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the repair did not materialize"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.ready_becomes(true, "repaired").await;
    let q: Option<String> =
        sqlx::query_scalar("SELECT quarantine_class FROM synchro.capture_progress")
            .fetch_one(&w.pool)
            .await
            .unwrap();
    assert_eq!(q, None);
    assert!(server.stop().success());
}
