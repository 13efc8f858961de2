//! The push suite: every outcome of the wire spec's push section through the
//! real engine, on any store. MemStore and PgStore both pass it unchanged;
//! what only PostgreSQL has (row security, deferrable constraints, real
//! concurrency) is tested in `store-pg`.

use protocol::digest::{Digest, RowIdentity, row_digest};
use protocol::ids::ServerVersion;
use protocol::json::{self, Object, Value};
use protocol::manifest::Manifest;

use super::capture::{CaptureWorld, Write};
use super::{ConnectBody, example_config};
use crate::Engine;
use crate::config::{LimitsConfig, SyncConfig};
use crate::store::{Store, StoreTx};

/// 2026-07-18T14:00:01Z, the spec example's server time.
pub const NOW: i64 = 1_784_383_201_000_000;
/// The server time of a push at [`NOW`].
pub const NOW_TEXT: &str = "2026-07-18T14:00:01.000000Z";

/// Admission limits that no benchmark reaches: a benchmark measures the
/// path of one user at full speed, not admission (ADR 0015).
pub fn benchmark_limits() -> LimitsConfig {
    LimitsConfig {
        requests_per_user_per_second: 1_000_000,
        request_burst_per_user: 1_000_000,
        flood_requests_per_user_per_second: 1_000_000,
        flood_burst_per_user: 1_000_000,
        mutations_per_user_per_second: 1_000_000_000,
        mutation_burst_per_user: 1_000_000_000,
        ..LimitsConfig::default()
    }
}

/// The example config with writable template fields (a table without
/// `deleted_at`, so deletes are hard) and short capture limits.
pub fn push_config() -> SyncConfig {
    push_config_with(|s| s)
}

/// The text of the push config: the example config (`text`) with writable
/// templates, for a `synchro serve` process that must share its schema.
pub fn push_config_toml(text: String) -> String {
    text.replace(
        r#"{ field_id = "fld_templates_name", column = "name", type = "string" }"#,
        r#"{ field_id = "fld_templates_name", column = "name", type = "string", writable = true }"#,
    )
    .replace(
        r#"{ field_id = "fld_templates_body", column = "body", type = "string" }"#,
        r#"{ field_id = "fld_templates_body", column = "body", type = "string", writable = true }"#,
    )
}

/// The push config after `edit` was applied to the example config's text.
pub fn push_config_with(edit: impl Fn(String) -> String) -> SyncConfig {
    let mut config = example_config(|s| push_config_toml(edit(s)));
    config.capture.heartbeat_ms = 20;
    config.capture.retry_ms = 20;
    config
}

/// A connected client that pushes through an engine.
#[derive(Clone)]
pub struct PushClient {
    pub engine: Engine,
    pub user: String,
    pub client_id: String,
    pub generation: u64,
    /// The current schema reference, as JSON.
    pub schema: Value,
}

impl PushClient {
    /// Connects a fresh client of `user`.
    pub async fn connect(engine: &Engine, user: &str, client_id: &str) -> PushClient {
        let r = engine
            .connect(
                user,
                json::to_canonical(&ConnectBody::fresh(client_id).to_json()),
                NOW,
            )
            .await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = json::parse(&r.body).unwrap();
        let o = v.as_object().unwrap();
        let s = o["schema"].as_object().unwrap();
        PushClient {
            engine: engine.clone(),
            user: user.into(),
            client_id: client_id.into(),
            generation: super::int(&o["client_generation"]),
            schema: json::object([
                ("version", s["version"].clone()),
                ("hash", s["hash"].clone()),
            ]),
        }
    }

    /// A batch body of these mutations.
    pub fn batch(&self, batch: u64, mutations: Vec<Value>, atomic: bool) -> Value {
        let mut o = Object::new();
        o.insert("client_id".into(), Value::string(&self.client_id));
        o.insert(
            "client_generation".into(),
            Value::int(self.generation as i64),
        );
        o.insert("batch_id".into(), Value::string(batch_id(batch)));
        o.insert("schema".into(), self.schema.clone());
        o.insert("mutations".into(), Value::Array(mutations));
        if atomic {
            o.insert("atomic".into(), Value::Bool(true));
        }
        Value::Object(o)
    }

    /// Pushes `body`: status, parsed body, raw bytes.
    pub async fn push(&self, body: &Value) -> (u16, Value, Vec<u8>) {
        self.push_as(&self.user, body).await
    }

    /// Pushes `body` authenticated as `user`.
    pub async fn push_as(&self, user: &str, body: &Value) -> (u16, Value, Vec<u8>) {
        let t0 = std::time::Instant::now();
        let bytes = json::to_canonical(body);
        let t1 = std::time::Instant::now();
        let r = self.engine.push(user, bytes, NOW).await;
        let t2 = std::time::Instant::now();
        let v = json::parse(&r.body).unwrap();
        if std::env::var("PUSH_TIMING").is_ok() {
            eprintln!(
                "TIMING client canon {:?} engine {:?} parse {:?}",
                t1 - t0,
                t2 - t1,
                t2.elapsed()
            );
        }
        (r.status, v, r.body)
    }
}

/// A canonical batch UUID.
pub fn batch_id(n: u64) -> String {
    format!("10000000-0000-4000-8000-{n:012x}")
}

/// A canonical mutation UUID.
pub fn mutation_id(n: u64) -> String {
    format!("20000000-0000-4000-8000-{n:012x}")
}

/// A canonical note ID.
pub fn note_id(n: u64) -> String {
    format!("30000000-0000-4000-8000-{n:012x}")
}

/// One mutation object.
pub fn mutation(
    n: u64,
    table: &str,
    pk: (&str, &str),
    schema: &Value,
    op: &str,
    base: Option<&str>,
    columns: Option<Value>,
) -> Value {
    let mut o = Object::new();
    o.insert("mutation_id".into(), Value::string(mutation_id(n)));
    o.insert("table".into(), Value::string(table));
    o.insert("pk".into(), json::object([(pk.0, Value::string(pk.1))]));
    o.insert("authored_schema".into(), schema.clone());
    o.insert("op".into(), Value::string(op));
    o.insert(
        "client_version".into(),
        Value::string("2026-07-18T13:59:01.000000Z"),
    );
    if let Some(b) = base {
        o.insert("base_version".into(), Value::string(b));
    }
    if let Some(c) = columns {
        o.insert("columns".into(), c);
    }
    Value::Object(o)
}

/// A note mutation.
pub fn note_mutation(
    n: u64,
    note: &str,
    schema: &Value,
    op: &str,
    base: Option<&str>,
    columns: Option<Value>,
) -> Value {
    mutation(
        n,
        "tbl_notes",
        ("fld_notes_id", note),
        schema,
        op,
        base,
        columns,
    )
}

/// Columns of a note: a title and `pinned`.
pub fn note_columns(title: &str) -> Value {
    json::object([
        ("fld_notes_title", Value::string(title)),
        ("fld_notes_pinned", Value::Bool(false)),
    ])
}

fn members(v: &Value) -> &Object {
    v.as_object().unwrap()
}

/// The outcome of mutation `n` and whether it is in `accepted`.
pub fn outcome(response: &Value, n: u64) -> (bool, Value) {
    let id = mutation_id(n);
    for (array, accepted) in [("accepted", true), ("rejected", false)] {
        let Value::Array(a) = &members(response)[array] else {
            panic!("no {array}");
        };
        if let Some(o) = a
            .iter()
            .find(|o| members(o)["mutation_id"].as_str() == Some(&id))
        {
            return (accepted, o.clone());
        }
    }
    panic!("no outcome for mutation {n}");
}

/// `status` and `code` of an outcome.
fn status(o: &Value) -> (String, Option<String>) {
    let m = members(o);
    (
        m["status"].as_str().unwrap().to_owned(),
        m.get("code").map(|c| c.as_str().unwrap().to_owned()),
    )
}

/// The code of mutation `n`'s outcome, absent for `applied`.
fn code_of(response: &Value, n: u64) -> Option<String> {
    status(&outcome(response, n).1).1
}

/// The sorted member names of an outcome.
fn keys(o: &Value) -> Vec<String> {
    members(o).keys().cloned().collect()
}

/// The server version of an outcome.
pub fn version_of(o: &Value) -> String {
    members(o)["server_version"].as_str().unwrap().to_owned()
}

/// Checks that an outcome's row and checksum agree under `manifest`.
fn verify_row(manifest: &Manifest, o: &Value) {
    let m = members(o);
    let table = manifest.table(m["table"].as_str().unwrap()).unwrap();
    let row = table.decode_row(members(&m["server_row"])).unwrap();
    let key = table.row_key(&row).unwrap();
    let identity = RowIdentity::of(table, key);
    let version = ServerVersion::parse(m["server_version"].as_str().unwrap()).unwrap();
    let digest = row_digest(&manifest.hash(), table, &identity, &row, &version);
    let presented = Digest::from_checksum_json(&m["row_checksum"]).unwrap();
    assert_eq!(digest, presented, "the row checksum recomputes");
    // The outcome's pk is the row's.
    let pk = members(&m["pk"]);
    for (field, v) in pk {
        assert_eq!(&members(&m["server_row"])[field], v);
    }
}

pub(super) fn error_code(v: &Value) -> String {
    members(&members(v)["error"])["code"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// The identical fresh first connect replays until the client goes on; a
/// push is going on, so the sentinel is then refused (spec: Connect).
/// Admission of pushes is fair per user: past its mutation budget (a
/// burst of 3, then 1 a second here) a user's push answers 429 and applies
/// nothing, a replay is still answered (it precedes admission), and
/// another user pushes.
async fn mutation_rate<S: Store>(store: &S) {
    let mut limited = push_config();
    limited.limits.mutations_per_user_per_second = 1;
    limited.limits.mutation_burst_per_user = 3;
    let engine = Engine::start(store.clone(), limited).await.unwrap();
    let flood = PushClient::connect(&engine, "mr-flood", "mr-f").await;
    let calm = PushClient::connect(&engine, "mr-calm", "mr-c").await;
    let inserts = |c: &PushClient, batch: u64, from: u64, n: u64| {
        let mutations = (from..from + n)
            .map(|k| {
                let key = note_id(900 + k);
                note_mutation(
                    900 + k,
                    &key,
                    &c.schema,
                    "insert",
                    None,
                    Some(note_columns("r")),
                )
            })
            .collect();
        c.batch(900 + batch, mutations, false)
    };
    let first = inserts(&flood, 0, 0, 2);
    let (st, r, bytes) = flood.push(&first).await;
    assert_eq!(st, 200, "{r:?}");
    let (st, r, _) = flood.push(&inserts(&flood, 1, 2, 2)).await;
    assert_eq!(st, 429, "{r:?}");
    assert_eq!(
        members(&members(&r)["error"])["code"].as_str(),
        Some("retry_later")
    );
    let (st, again, replayed) = flood.push(&first).await;
    assert_eq!((st, replayed), (200, bytes), "{again:?}");
    let (st, r, _) = flood.push(&inserts(&flood, 2, 4, 1)).await;
    assert_eq!(st, 200, "one mutation is left: {r:?}");
    let (st, r, _) = calm.push(&inserts(&calm, 3, 10, 3)).await;
    assert_eq!(st, 200, "another user is not refused: {r:?}");
}

async fn first_connect_replay_closes_with_a_push(engine: &Engine) {
    let fresh = json::to_canonical(&ConnectBody::fresh("c-sentinel").to_json());
    let c = PushClient::connect(engine, "u1", "c-sentinel").await;
    let again = engine.connect("u1", fresh.clone(), NOW).await;
    assert_eq!(again.status, 200, "the retry of a lost first connect");
    // Even a push that applies nothing uses the generation.
    let unsynced = mutation(
        990,
        "tbl_nope",
        ("fld_x", "k"),
        &c.schema,
        "insert",
        None,
        Some(json::object([])),
    );
    let (st, _, _) = c.push(&c.batch(990, vec![unsynced], false)).await;
    assert_eq!(st, 200);
    let refused = engine.connect("u1", fresh, NOW).await;
    let body = json::parse(&refused.body).unwrap();
    assert_eq!(
        (refused.status, error_code(&body).as_str()),
        (400, "invalid_schema_reference")
    );
}

async fn current_manifest<S: Store>(store: &S) -> Manifest {
    let mut tx = store.begin().await.unwrap();
    tx.manifests().await.unwrap().pop().unwrap()
}

fn field<'o>(o: &'o Value, f: &str) -> &'o Value {
    &members(&members(o)["server_row"])[f]
}

/// Every push rule that holds on every store.
pub async fn push_suite<W: CaptureWorld>(world: &W) {
    let store = world.store().clone();
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    let manifest = current_manifest(&store).await;
    let c = PushClient::connect(&engine, "u1", "c1").await;
    let s = &c.schema;
    let n1 = note_id(1);
    first_connect_replay_closes_with_a_push(&engine).await;
    mutation_rate(&store).await;

    // Insert: applied, with the server's owner and lifecycle values and a checksum.
    let body = c.batch(
        1,
        vec![note_mutation(
            1,
            &n1,
            s,
            "insert",
            None,
            Some(note_columns("a")),
        )],
        false,
    );
    let (st, r, bytes) = c.push(&body).await;
    assert_eq!(st, 200, "{r:?}");
    assert_eq!(members(&r)["server_time"].as_str(), Some(NOW_TEXT));
    assert_eq!(members(&r)["batch_id"].as_str(), Some(batch_id(1).as_str()));
    let (accepted, o) = outcome(&r, 1);
    assert!(accepted);
    assert_eq!(
        keys(&o),
        [
            "mutation_id",
            "outcome_schema",
            "pk",
            "row_checksum",
            "server_row",
            "server_version",
            "status",
            "table"
        ]
    );
    assert_eq!(status(&o), ("applied".into(), None));
    assert_eq!(members(&o)["outcome_schema"], *s);
    verify_row(&manifest, &o);
    assert_eq!(field(&o, "fld_notes_owner").as_str(), Some("u1"));
    assert_eq!(field(&o, "fld_notes_updated_at").as_str(), Some(NOW_TEXT));
    assert_eq!(field(&o, "fld_notes_deleted_at"), &Value::Null);
    let v1 = version_of(&o);
    // The response is canonical JSON.
    assert_eq!(json::to_canonical(&r), bytes);

    // Exact replay: same status and bytes, no second execution.
    let (st2, _, bytes2) = c.push(&body).await;
    assert_eq!((st2, &bytes2), (200, &bytes));
    // The same batch ID with other content: 409.
    let other = c.batch(
        1,
        vec![note_mutation(
            1,
            &n1,
            s,
            "insert",
            None,
            Some(note_columns("b")),
        )],
        false,
    );
    let (st, r, _) = c.push(&other).await;
    assert_eq!((st, error_code(&r).as_str()), (409, "idempotency_conflict"));

    // The conflict matrix on a live row.
    let cells = vec![
        note_mutation(2, &n1, s, "insert", None, Some(note_columns("x"))),
        note_mutation(3, &n1, s, "update", Some("stale"), Some(note_columns("x"))),
        note_mutation(4, &n1, s, "delete", Some("stale"), None),
        note_mutation(
            5,
            &note_id(99),
            s,
            "update",
            Some(&v1),
            Some(note_columns("x")),
        ),
        note_mutation(6, &note_id(99), s, "delete", Some(&v1), None),
        note_mutation(7, &n1, s, "update", Some(&v1), Some(note_columns("b"))),
    ];
    let (st, r, _) = c.push(&c.batch(2, cells, false)).await;
    assert_eq!(st, 200);
    for (n, code) in [
        (2, "row_already_exists"),
        (3, "version_conflict"),
        (4, "version_conflict"),
    ] {
        let (accepted, o) = outcome(&r, n);
        assert!(!accepted);
        assert_eq!(
            status(&o),
            ("conflict".into(), Some(code.into())),
            "mutation {n}"
        );
        assert_eq!(version_of(&o), v1, "the current version before mutation 7");
        assert_eq!(
            keys(&o),
            [
                "code",
                "message",
                "mutation_id",
                "outcome_schema",
                "pk",
                "row_checksum",
                "server_row",
                "server_version",
                "status",
                "table"
            ]
        );
        verify_row(&manifest, &o);
    }
    for n in [5, 6] {
        let (_, o) = outcome(&r, n);
        assert_eq!(
            status(&o),
            ("conflict".into(), Some("row_not_found".into()))
        );
        assert_eq!(
            keys(&o),
            [
                "code",
                "message",
                "mutation_id",
                "outcome_schema",
                "pk",
                "status",
                "table"
            ]
        );
    }
    let (accepted, o) = outcome(&r, 7);
    assert!(accepted);
    let v2 = version_of(&o);
    assert_ne!(v1, v2, "a write allocates a new version");
    assert_eq!(field(&o, "fld_notes_title").as_str(), Some("b"));
    // The rejected array keeps request order.
    let Value::Array(rejected) = &members(&r)["rejected"] else {
        panic!()
    };
    let order: Vec<&str> = rejected
        .iter()
        .map(|o| members(o)["mutation_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        order,
        [2, 3, 4, 5, 6]
            .map(mutation_id)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
    );

    // Soft delete: the tombstone comes back; every operation on it is row_deleted.
    let (_, r, _) = c
        .push(&c.batch(
            3,
            vec![note_mutation(8, &n1, s, "delete", Some(&v2), None)],
            false,
        ))
        .await;
    let (accepted, o) = outcome(&r, 8);
    assert!(accepted);
    assert_eq!(field(&o, "fld_notes_deleted_at").as_str(), Some(NOW_TEXT));
    verify_row(&manifest, &o);
    let v3 = version_of(&o);
    let on_tombstone = vec![
        note_mutation(9, &n1, s, "insert", None, Some(note_columns("x"))),
        note_mutation(10, &n1, s, "update", Some(&v3), Some(note_columns("x"))),
        note_mutation(11, &n1, s, "delete", Some(&v3), None),
    ];
    let (_, r, _) = c.push(&c.batch(4, on_tombstone, false)).await;
    for n in [9, 10, 11] {
        let (_, o) = outcome(&r, n);
        assert_eq!(status(&o), ("conflict".into(), Some("row_deleted".into())));
        assert_eq!(version_of(&o), v3);
        verify_row(&manifest, &o);
    }

    // Hard delete (no deleted_at): a fence-only state with a version and no row.
    let tpl = |n, op: &str, base: Option<&str>, cols: Option<Value>| {
        mutation(
            n,
            "tbl_templates",
            ("fld_templates_id", "tpl-9"),
            s,
            op,
            base,
            cols,
        )
    };
    let tpl_cols = || {
        json::object([
            ("fld_templates_name", Value::string("N")),
            ("fld_templates_body", Value::string("B")),
        ])
    };
    let (_, r, _) = c
        .push(&c.batch(5, vec![tpl(12, "insert", None, Some(tpl_cols()))], false))
        .await;
    let tv1 = version_of(&outcome(&r, 12).1);
    let (_, r, _) = c
        .push(&c.batch(6, vec![tpl(13, "delete", Some(&tv1), None)], false))
        .await;
    let (accepted, o) = outcome(&r, 13);
    assert!(accepted);
    assert_eq!(
        keys(&o),
        [
            "mutation_id",
            "outcome_schema",
            "pk",
            "server_version",
            "status",
            "table"
        ]
    );
    let tv2 = version_of(&o);
    let on_fence = vec![
        tpl(14, "insert", None, Some(tpl_cols())),
        tpl(15, "update", Some(&tv2), Some(tpl_cols())),
        tpl(16, "delete", Some(&tv2), None),
    ];
    let (_, r, _) = c.push(&c.batch(7, on_fence, false)).await;
    for n in [14, 15, 16] {
        let (_, o) = outcome(&r, n);
        assert_eq!(status(&o), ("conflict".into(), Some("row_deleted".into())));
        assert_eq!(
            keys(&o),
            [
                "code",
                "message",
                "mutation_id",
                "outcome_schema",
                "pk",
                "server_version",
                "status",
                "table"
            ]
        );
        assert_eq!(version_of(&o), tv2);
    }

    terminal_codes(world, &c, &manifest).await;
    request_errors(&store, &c).await;
    reuse_and_atomic(&store, &manifest, &c).await;
    replay_after_changes(world, &c, body, bytes).await;
}

/// Each terminal code, and their precedence.
async fn terminal_codes<W: CaptureWorld>(world: &W, c: &PushClient, manifest: &Manifest) {
    let s = &c.schema;
    let other = note_id(50);
    // A row of another user: the declarative rule hides it from u1.
    world
        .write(&[Write::Insert(
            "public.notes",
            &[
                ("id", Some(&other)),
                ("owner_id", Some("u2")),
                ("title", Some("theirs")),
                ("body", None),
                ("pinned", Some("f")),
                ("updated_at", Some("2026-07-18 13:00:00+00")),
                ("deleted_at", None),
            ],
        )])
        .await;
    let legacy_schema = json::object([
        ("version", Value::int(5)),
        ("hash", Value::string("deadbeef".repeat(8))),
    ]);
    let col = |f: &str, v: Value| {
        let mut o = note_columns("t");
        if let Value::Object(m) = &mut o {
            m.insert(f.into(), v);
        }
        o
    };
    let n = |i: u64| note_id(60 + i);
    let mutations = vec![
        // 20: a field the current schema cannot represent (authored under an unknown schema).
        mutation(
            20,
            "tbl_notes",
            ("fld_notes_id", &n(0)),
            &legacy_schema,
            "insert",
            None,
            Some(col("fld_notes_legacy_summary", Value::string("keep"))),
        ),
        // 21: schema_incompatible outranks policy_rejected (another owner authored).
        mutation(
            21,
            "tbl_notes",
            ("fld_notes_id", &n(1)),
            &legacy_schema,
            "insert",
            None,
            Some(json::object([
                ("fld_notes_zz", Value::int(1)),
                ("fld_notes_aa", Value::int(1)),
                ("fld_notes_owner", Value::string("u2")),
            ])),
        ),
        // 22: never a synced table.
        mutation(
            22,
            "tbl_nope",
            ("fld_nope_id", "x"),
            s,
            "insert",
            None,
            Some(json::object([])),
        ),
        // 23: policy_rejected outranks validation_failed (owner is also not writable).
        note_mutation(
            23,
            &n(3),
            s,
            "insert",
            None,
            Some(col("fld_notes_owner", Value::string("u2"))),
        ),
        // 24: a non-writable field.
        note_mutation(
            24,
            &n(4),
            s,
            "insert",
            None,
            Some(col("fld_notes_updated_at", Value::string(NOW_TEXT))),
        ),
        // 25: a value of the wrong type.
        note_mutation(
            25,
            &n(5),
            s,
            "insert",
            None,
            Some(col("fld_notes_title", Value::int(5))),
        ),
        // 26: null for a non-nullable field.
        note_mutation(
            26,
            &n(6),
            s,
            "insert",
            None,
            Some(col("fld_notes_title", Value::Null)),
        ),
        // 27: a required value that the source does not supply.
        note_mutation(
            27,
            &n(7),
            s,
            "insert",
            None,
            Some(json::object([("fld_notes_pinned", Value::Bool(true))])),
        ),
        // 28, 29: another user's row is hidden by the declarative rule.
        note_mutation(
            28,
            &other,
            s,
            "update",
            Some("any"),
            Some(note_columns("mine")),
        ),
        note_mutation(29, &other, s, "insert", None, Some(note_columns("mine"))),
        // 30: the key's own type is wrong: validation.
        mutation(
            30,
            "tbl_templates",
            ("fld_templates_id", "x"),
            s,
            "update",
            Some("v"),
            Some(json::object([("fld_templates_name", Value::int(1))])),
        ),
    ];
    let (st, r, _) = c.push(&c.batch(20, mutations, false)).await;
    assert_eq!(st, 200, "{r:?}");
    let expect = [
        (20, "schema_incompatible"),
        (21, "schema_incompatible"),
        (22, "table_not_synced"),
        (23, "policy_rejected"),
        (24, "validation_failed"),
        (25, "validation_failed"),
        (26, "validation_failed"),
        (27, "validation_failed"),
        (28, "policy_rejected"),
        (29, "policy_rejected"),
        (30, "validation_failed"),
    ];
    for (i, code) in expect {
        let (accepted, o) = outcome(&r, i);
        assert!(!accepted);
        assert_eq!(
            status(&o),
            ("rejected_terminal".into(), Some(code.into())),
            "mutation {i}"
        );
        if code != "schema_incompatible" {
            assert_eq!(
                keys(&o),
                [
                    "code",
                    "message",
                    "mutation_id",
                    "outcome_schema",
                    "pk",
                    "status",
                    "table"
                ],
                "mutation {i}"
            );
        }
    }
    let (_, o) = outcome(&r, 21);
    let m = members(&o);
    assert_eq!(
        keys(&o),
        [
            "authored_schema",
            "code",
            "current_schema",
            "incompatible_field_ids",
            "message",
            "mutation_id",
            "outcome_schema",
            "pk",
            "retryable",
            "status",
            "table"
        ]
    );
    assert_eq!(m["retryable"], Value::Bool(false));
    assert_eq!(m["authored_schema"], legacy_schema);
    assert_eq!(m["current_schema"], *s);
    assert_eq!(
        json::to_canonical_string(&m["incompatible_field_ids"]),
        r#"["fld_notes_aa","fld_notes_zz"]"#
    );
    let _ = manifest;
    // Nothing was written for any of them: the other user's row is unchanged.
    let (_, r, _) = c
        .push(&c.batch(
            21,
            vec![note_mutation(
                31,
                &n(7),
                s,
                "update",
                Some("v"),
                Some(note_columns("t")),
            )],
            false,
        ))
        .await;
    assert_eq!(code_of(&r, 31).as_deref(), Some("row_not_found"));
}

/// Whole-request errors: status and code.
async fn request_errors<S: Store>(store: &S, c: &PushClient) {
    let s = &c.schema;
    let one = |n| {
        vec![note_mutation(
            n,
            &note_id(n),
            s,
            "insert",
            None,
            Some(note_columns("e")),
        )]
    };
    // A client that never connected, and a client of another user: 401.
    let mut stranger = c.clone();
    stranger.client_id = "never-connected".into();
    let (st, r, _) = stranger.push(&stranger.batch(40, one(40), false)).await;
    assert_eq!((st, error_code(&r).as_str()), (401, "auth_required"));
    let (st, r, _) = c.push_as("u2", &c.batch(40, one(40), false)).await;
    assert_eq!((st, error_code(&r).as_str()), (401, "auth_required"));
    // Structure: duplicate mutation IDs, an empty update.
    let dup = vec![one(41).remove(0), one(41).remove(0)];
    let (st, r, _) = c.push(&c.batch(41, dup, false)).await;
    assert_eq!((st, error_code(&r).as_str()), (400, "invalid_request"));
    let empty_update = vec![note_mutation(
        42,
        &note_id(42),
        s,
        "update",
        Some("v"),
        Some(json::object([])),
    )];
    let (st, r, _) = c.push(&c.batch(42, empty_update, false)).await;
    assert_eq!((st, error_code(&r).as_str()), (400, "invalid_request"));
    // 1001 mutations: the limit is enforced, never clamped.
    let many = (0..1001)
        .map(|i| {
            note_mutation(
                1000 + i,
                &note_id(1000 + i),
                s,
                "insert",
                None,
                Some(note_columns("m")),
            )
        })
        .collect();
    let (st, r, _) = c.push(&c.batch(43, many, false)).await;
    assert_eq!((st, error_code(&r).as_str()), (400, "invalid_request"));
    // The generation gate, then the schema gate.
    let mut stale = c.clone();
    stale.generation += 1;
    let (st, r, _) = stale.push(&stale.batch(44, one(44), false)).await;
    assert_eq!(
        (st, error_code(&r).as_str()),
        (409, "client_generation_expired")
    );
    assert_eq!(
        members(&members(&r)["error"])["current_client_generation"],
        Value::int(c.generation as i64)
    );
    let mut old = c.clone();
    old.schema = json::object([
        ("version", Value::int(1)),
        ("hash", Value::string("ab".repeat(32))),
    ]);
    let (st, r, _) = old.push(&old.batch(45, one(45), false)).await;
    assert_eq!((st, error_code(&r).as_str()), (422, "schema_mismatch"));
    // A retired client (an operator action): 409, even for a batch it completed.
    let gone = PushClient::connect(&c.engine, &c.user, "retiring").await;
    let done = gone.batch(47, one(47), false);
    assert_eq!(gone.push(&done).await.0, 200);
    let mut tx = store.begin().await.unwrap();
    let mut record = tx.lock_client("retiring").await.unwrap().unwrap();
    record.retired = true;
    tx.put_client(&record).await.unwrap();
    tx.commit().await.unwrap();
    for body in [done, gone.batch(48, one(48), false)] {
        let (st, r, _) = gone.push(&body).await;
        assert_eq!((st, error_code(&r).as_str()), (409, "client_retired"));
    }
    // A key the database would store in another spelling, or cannot store
    // at all, is an invalid request, answered the same on every retry (never
    // a 503 that a sealed batch would be retried on for ever).
    let upper = "018F2B5E-7C42-7A1D-9D31-8A95BD6740AB";
    let nul = format!("{}\0", note_id(949));
    for key in [upper, nul.as_str(), "not-a-uuid"] {
        let bad = vec![note_mutation(
            949,
            key,
            s,
            "insert",
            None,
            Some(note_columns("k")),
        )];
        for _ in 0..2 {
            let (st, r, _) = c.push(&c.batch(949, bad.clone(), false)).await;
            assert_eq!(
                (st, error_code(&r).as_str()),
                (400, "invalid_request"),
                "{key:?}"
            );
        }
    }
    // A typed key of another JSON kind than its field's type (a number for
    // the string key) is an invalid typed primary key: 400, not an outcome.
    let mut numeric = note_mutation(
        952,
        &note_id(952),
        s,
        "insert",
        None,
        Some(note_columns("k")),
    );
    if let Value::Object(o) = &mut numeric {
        o.insert(
            "pk".into(),
            json::object([("fld_notes_id", json::parse(b"5").unwrap())]),
        );
    }
    for atomic in [false, true] {
        let (st, r, _) = c.push(&c.batch(952, vec![numeric.clone()], atomic)).await;
        assert_eq!(
            (st, error_code(&r).as_str()),
            (400, "invalid_request"),
            "atomic {atomic}"
        );
    }
    // Two spellings of one row in an atomic batch are not two rows: the
    // respelled one makes the request invalid.
    let lower = "018f2b5e-7c42-7a1d-9d31-8a95bd6740ab";
    let both = vec![
        note_mutation(947, lower, s, "insert", None, Some(note_columns("k"))),
        note_mutation(948, upper, s, "insert", None, Some(note_columns("k"))),
    ];
    let (st, r, _) = c.push(&c.batch(947, both, true)).await;
    assert_eq!((st, error_code(&r).as_str()), (400, "invalid_request"));
    // A column value the database cannot hold is that mutation's terminal
    // outcome; the rest of the batch proceeds.
    let cols = |title: &str| {
        json::object([
            ("fld_notes_title", Value::string(title)),
            ("fld_notes_pinned", Value::Bool(false)),
        ])
    };
    let mixed = vec![
        note_mutation(950, &note_id(950), s, "insert", None, Some(cols("a\0b"))),
        note_mutation(951, &note_id(951), s, "insert", None, Some(cols("fine"))),
    ];
    let (st, r, _) = c.push(&c.batch(950, mixed, false)).await;
    assert_eq!(st, 200);
    let (accepted, o) = outcome(&r, 950);
    assert!(!accepted);
    assert_eq!(members(&o)["code"], Value::string("validation_failed"));
    assert!(outcome(&r, 951).0);
    // A failed request did no work: the same mutations now execute.
    let (st, r, _) = c.push(&c.batch(46, one(44), false)).await;
    assert_eq!(st, 200);
    assert!(outcome(&r, 44).0);
}

/// Mutation reuse across batches, and atomic batches.
async fn reuse_and_atomic<S: Store>(store: &S, manifest: &Manifest, c: &PushClient) {
    let s = &c.schema;
    let n = |i: u64| note_id(100 + i);
    let ins = |m, i| note_mutation(m, &n(i), s, "insert", None, Some(note_columns("r")));
    let (_, first, _) = c.push(&c.batch(50, vec![ins(50, 0)], false)).await;
    let stored = outcome(&first, 50).1;
    // Reused unchanged in a new batch: the stored outcome, byte for byte, no re-execution.
    let (st, r, _) = c
        .push(&c.batch(51, vec![ins(50, 0), ins(51, 1)], false))
        .await;
    assert_eq!(st, 200);
    assert_eq!(
        json::to_canonical(&outcome(&r, 50).1),
        json::to_canonical(&stored)
    );
    assert!(outcome(&r, 51).0);
    // Reused with different content: 409.
    let changed = note_mutation(50, &n(0), s, "insert", None, Some(note_columns("changed")));
    let (st, r, _) = c.push(&c.batch(52, vec![changed], false)).await;
    assert_eq!((st, error_code(&r).as_str()), (409, "idempotency_conflict"));
    // An atomic batch may not reuse a completed mutation.
    let (st, r, _) = c
        .push(&c.batch(53, vec![ins(50, 0), ins(53, 3)], true))
        .await;
    assert_eq!((st, error_code(&r).as_str()), (400, "invalid_request"));
    // An atomic batch may not name one row twice.
    let (st, r, _) = c
        .push(&c.batch(54, vec![ins(54, 4), ins(55, 4)], true))
        .await;
    assert_eq!((st, error_code(&r).as_str()), (400, "invalid_request"));

    // An atomic batch whose third mutation conflicts: nothing applies.
    let v0 = version_of(&stored);
    let group = vec![
        ins(56, 6),
        note_mutation(57, &n(0), s, "update", Some(&v0), Some(note_columns("g"))),
        note_mutation(
            58,
            &n(1),
            s,
            "update",
            Some("stale"),
            Some(note_columns("g")),
        ),
    ];
    let (st, r, _) = c.push(&c.batch(55, group, true)).await;
    assert_eq!(st, 200);
    let Value::Array(accepted) = &members(&r)["accepted"] else {
        panic!()
    };
    assert!(accepted.is_empty());
    for m in [56, 57] {
        let (_, o) = outcome(&r, m);
        assert_eq!(
            status(&o),
            (
                "rejected_terminal".into(),
                Some("atomic_batch_rejected".into())
            )
        );
        assert_eq!(
            members(&o)["message"].as_str(),
            Some("atomic batch rejected")
        );
        assert_eq!(
            keys(&o),
            [
                "code",
                "message",
                "mutation_id",
                "outcome_schema",
                "pk",
                "status",
                "table"
            ]
        );
    }
    let (_, o) = outcome(&r, 58);
    assert_eq!(
        status(&o),
        ("conflict".into(), Some("version_conflict".into()))
    );
    // The rollback is real: the first two mutations' rows are as before.
    let check = vec![
        note_mutation(59, &n(6), s, "update", Some("v"), Some(note_columns("x"))),
        note_mutation(
            60,
            &n(0),
            s,
            "update",
            Some(&v0),
            Some(note_columns("after")),
        ),
    ];
    let (_, r, _) = c.push(&c.batch(56, check, false)).await;
    assert_eq!(code_of(&r, 59).as_deref(), Some("row_not_found"));
    assert!(outcome(&r, 60).0, "the atomic update never advanced v0");
    // A mutation rejected with its atomic batch cannot be reused outside one.
    let (st, r, _) = c.push(&c.batch(57, vec![ins(56, 6)], false)).await;
    assert_eq!((st, error_code(&r).as_str()), (400, "invalid_request"));
    // Request order decides which failure an atomic batch reports: a row
    // conflict before a terminal code found without the row, and the other way round.
    let not_synced = |m| {
        mutation(
            m,
            "tbl_nope",
            ("fld_nope_id", "x"),
            s,
            "insert",
            None,
            Some(json::object([])),
        )
    };
    let stale = |m| {
        note_mutation(
            m,
            &n(0),
            s,
            "update",
            Some("stale"),
            Some(note_columns("s")),
        )
    };
    let (_, r, _) = c
        .push(&c.batch(60, vec![ins(70, 20), stale(71), not_synced(72)], true))
        .await;
    assert_eq!(code_of(&r, 71).as_deref(), Some("version_conflict"));
    for m in [70, 72] {
        assert_eq!(code_of(&r, m).as_deref(), Some("atomic_batch_rejected"));
    }
    let (_, r, _) = c
        .push(&c.batch(61, vec![ins(73, 21), not_synced(74), stale(75)], true))
        .await;
    assert_eq!(code_of(&r, 74).as_deref(), Some("table_not_synced"));
    for m in [73, 75] {
        assert_eq!(code_of(&r, m).as_deref(), Some("atomic_batch_rejected"));
    }
    // An atomic batch that applies: every outcome applied.
    let (st, r, _) = c
        .push(&c.batch(58, vec![ins(61, 11), ins(62, 12)], true))
        .await;
    assert_eq!(st, 200);
    assert!(outcome(&r, 61).0 && outcome(&r, 62).0);
    // Push visibility: capture delivers the very row, version and checksum
    // the push echoed (pull will serve this projection).
    captured_as_echoed(store, manifest, &outcome(&r, 61).1).await;
    // A non-atomic response never carries atomic_batch_rejected, even when mixed.
    let (_, r, _) = c
        .push(&c.batch(59, vec![ins(63, 11), ins(64, 14)], false))
        .await;
    assert_eq!(code_of(&r, 63).as_deref(), Some("row_already_exists"));
    assert!(outcome(&r, 64).0);
}

/// Waits until capture has materialized the write of an applied outcome,
/// and checks that its projection is the echo: row, version and digest.
async fn captured_as_echoed<S: Store>(store: &S, manifest: &Manifest, applied: &Value) {
    let m = members(applied);
    let table = manifest.table(m["table"].as_str().unwrap()).unwrap();
    let row = table.decode_row(members(&m["server_row"])).unwrap();
    let identity = RowIdentity::of(table, table.row_key(&row).unwrap());
    let version = version_of(applied);
    for _ in 0..2000 {
        let mut tx = store.begin().await.unwrap();
        let found = tx
            .projections(table.table_id(), std::slice::from_ref(&identity))
            .await
            .unwrap();
        drop(tx);
        if let Some(p) = found.into_iter().find(|p| p.version.as_str() == version) {
            assert_eq!(
                json::to_canonical(&p.row),
                json::to_canonical(&m["server_row"])
            );
            assert_eq!(
                Some(p.digest),
                Digest::from_checksum_json(&m["row_checksum"])
            );
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    panic!("capture did not deliver the pushed version {version} in 10 s");
}

/// Replay stays byte-identical after a generation and a schema change; and
/// every write was captured with the version its outcome reported.
async fn replay_after_changes<W: CaptureWorld>(
    world: &W,
    c: &PushClient,
    body: Value,
    bytes: Vec<u8>,
) {
    let store = world.store().clone();
    // A generation the server did not issue renews it on connect.
    let mut renew = ConnectBody::fresh(&c.client_id);
    renew.generation = Some(c.generation + 5);
    renew.schema = c.schema.clone();
    let r = c
        .engine
        .connect(&c.user, json::to_canonical(&renew.to_json()), NOW)
        .await;
    assert_eq!(r.status, 200);
    let mut tx = store.begin().await.unwrap();
    let record = tx.lock_client(&c.client_id).await.unwrap().unwrap();
    drop(tx);
    // Every push that applied something stepped the epoch once.
    assert!(
        record.accepted_write_epoch >= 8,
        "epoch {}",
        record.accepted_write_epoch
    );
    // A schema change: a new manifest (class 2, a renamed table).
    let changed = {
        let mut config = push_config();
        config.tables[0].name = "notes_renamed".into();
        config
    };
    let engine2 = Engine::start(store.clone(), changed).await.unwrap();
    let c2 = PushClient {
        engine: engine2.clone(),
        ..c.clone()
    };
    let (st, _, replayed) = c2.push(&body).await;
    assert_eq!(
        (st, replayed),
        (200, bytes),
        "replay is byte-identical after the changes"
    );
    // First execution under the old schema now fails its gate.
    let fresh = c2.batch(
        90,
        vec![note_mutation(
            90,
            &note_id(90),
            &c.schema,
            "insert",
            None,
            Some(note_columns("z")),
        )],
        false,
    );
    let (st, r, _) = c2.push(&fresh).await;
    assert_eq!(st, 409, "the generation gate comes first: {r:?}");
}

/// The push primitives give the same results on every store: ledger
/// entries read back exactly, a second completion is an integrity failure,
/// and writes report what they did (and undo what they refuse).
/// `store` holds the example tables and nothing else.
pub async fn push_store_suite<S: Store>(store: &S) {
    use crate::ledger::contract::{
        LedgerEntries, PushRecord, Refusal, RowWrite, StoredBatch, StoredMutation, WriteResult,
        Writer,
    };
    use crate::store::{ClientRecord, StoreError};
    use protocol::ids::CanonicalUuid;

    let config = push_config();
    store
        .install_capture(&crate::capture::CapturePlan::new(&config))
        .await
        .unwrap();
    let targets = crate::ledger::write_targets(&config);
    store.install_push(&targets).await.unwrap();
    let notes = &targets[0];

    // The ledger.
    let id = |s: String| CanonicalUuid::parse(&s).unwrap();
    let record = PushRecord {
        user_id: "u1".into(),
        client_id: "c1".into(),
        batch: StoredBatch {
            batch_id: id(batch_id(1)),
            fingerprint: Digest([1; 32]),
            status: 200,
            body: b"{\"batch\":1}".to_vec(),
        },
        mutations: vec![StoredMutation {
            mutation_id: id(mutation_id(1)),
            batch_id: id(batch_id(1)),
            fingerprint: Digest([2; 32]),
            outcome: b"{\"outcome\":1}".to_vec(),
        }],
    };
    let mut tx = store.begin().await.unwrap();
    tx.record_push(&record).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let ids = [id(mutation_id(1)), id(mutation_id(2))];
    let got = tx
        .push_ledger("u1", "c1", id(batch_id(1)), &ids)
        .await
        .unwrap();
    assert_eq!(
        got,
        LedgerEntries {
            batch: Some(record.batch.clone()),
            mutations: record.mutations.clone(),
        }
    );
    // Identities are scoped to (user, client).
    let other = tx
        .push_ledger("u1", "c2", id(batch_id(1)), &ids)
        .await
        .unwrap();
    assert_eq!(other, LedgerEntries::default());
    // A completed identity cannot complete again.
    assert!(matches!(
        tx.record_push(&record).await,
        Err(StoreError::Integrity(_))
    ));
    drop(tx);

    // An outcome that its batch's answer holds verbatim (a store may keep
    // it once) reads back exactly, beside one that it does not hold.
    let held = b"{\"outcome\":3}".to_vec();
    let within = PushRecord {
        batch: StoredBatch {
            batch_id: id(batch_id(3)),
            fingerprint: Digest([3; 32]),
            status: 200,
            body: [&b"{\"accepted\":["[..], &held, &b"]}"[..]].concat(),
        },
        mutations: vec![
            StoredMutation {
                mutation_id: id(mutation_id(3)),
                batch_id: id(batch_id(3)),
                fingerprint: Digest([4; 32]),
                outcome: held,
            },
            StoredMutation {
                mutation_id: id(mutation_id(4)),
                batch_id: id(batch_id(3)),
                fingerprint: Digest([5; 32]),
                outcome: b"{\"outcome\":4}".to_vec(),
            },
        ],
        ..record.clone()
    };
    let mut tx = store.begin().await.unwrap();
    tx.record_push(&within).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let asked = [id(mutation_id(4)), id(mutation_id(3))];
    let mut got = tx
        .push_ledger("u1", "c1", id(batch_id(3)), &asked)
        .await
        .unwrap();
    got.mutations.sort_by_key(|m| m.mutation_id.to_string());
    assert_eq!(
        got,
        LedgerEntries {
            batch: Some(within.batch.clone()),
            mutations: within.mutations.clone(),
        }
    );
    drop(tx);

    // A push's frame and its completion read and write what the single
    // steps do (ADR 0031).
    let mut client = ClientRecord::fresh("u1", "c-frame", 1, 7);
    let framed = PushRecord {
        client_id: "c-frame".into(),
        ..record.clone()
    };
    let mut tx = store.begin().await.unwrap();
    assert!(tx.insert_client(&client).await.unwrap());
    client.continued = true;
    client.accepted_write_epoch = 1;
    let stranger = ClientRecord {
        client_id: "c1".into(),
        ..client.clone()
    };
    assert!(
        matches!(
            tx.complete_push(&framed, Some(&stranger)).await,
            Err(StoreError::Integrity(_))
        ),
        "the record and the client name one client"
    );
    tx.complete_push(&framed, Some(&client)).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let lookup = crate::store::LedgerLookup {
        batch_id: id(batch_id(1)),
        mutation_ids: &ids,
    };
    for (user, named, asked) in [
        ("u1", "c-frame", Some(lookup)),
        ("u1", "c-frame", None),
        ("u2", "c-frame", Some(lookup)),
        ("u1", "c-unknown", Some(lookup)),
    ] {
        let frame = tx.push_frame(user, named, asked).await.unwrap();
        assert_eq!(frame.client, tx.lock_client(named).await.unwrap());
        let bound = frame.client.as_ref().is_some_and(|c| c.user_id == user);
        let want = match asked {
            Some(l) if bound => (tx.push_ledger(user, named, l.batch_id, l.mutation_ids))
                .await
                .unwrap(),
            _ => LedgerEntries::default(),
        };
        assert_eq!(frame.ledger, want, "{user} {named} {asked:?}");
    }
    let frame = tx.push_frame("u1", "c-frame", Some(lookup)).await.unwrap();
    assert_eq!(frame.client.as_ref(), Some(&client), "the client written");
    assert_eq!(
        frame.ledger,
        LedgerEntries {
            batch: Some(framed.batch.clone()),
            mutations: framed.mutations.clone(),
        },
        "the ledger written"
    );
    assert!(matches!(
        tx.complete_push(&framed, None).await,
        Err(StoreError::Integrity(_))
    ));
    drop(tx);
    // A retired client's ledger is not read.
    let mut tx = store.begin().await.unwrap();
    client.retired = true;
    tx.put_client(&client).await.unwrap();
    let frame = tx.push_frame("u1", "c-frame", Some(lookup)).await.unwrap();
    assert_eq!(frame.client.as_ref(), Some(&client));
    assert_eq!(frame.ledger, LedgerEntries::default());
    drop(tx);
    // A client that is not bound is an integrity failure, as for put_client.
    let mut tx = store.begin().await.unwrap();
    let unbound = PushRecord {
        client_id: "c-unbound".into(),
        batch: StoredBatch {
            batch_id: id(batch_id(2)),
            ..record.batch.clone()
        },
        mutations: Vec::new(),
        ..record.clone()
    };
    let ghost = ClientRecord {
        client_id: "c-unbound".into(),
        ..client.clone()
    };
    assert!(matches!(
        tx.complete_push(&unbound, Some(&ghost)).await,
        Err(StoreError::Integrity(_))
    ));
    drop(tx);

    // Source writes.
    let writer = Writer {
        user_id: "u1".into(),
        client_id: "c1".into(),
        check_each_write: true,
    };
    let values = |title: &str| {
        vec![
            ("owner_id".to_owned(), Some("u1".to_owned())),
            ("title".to_owned(), Some(title.to_owned())),
            ("pinned".to_owned(), Some("f".to_owned())),
            (
                "updated_at".to_owned(),
                Some("2026-07-18 14:00:01+00".to_owned()),
            ),
        ]
    };
    let insert = |title: &str| RowWrite::Insert {
        values: values(title),
    };
    let (k1, k2, k3, k4) = (note_id(1), note_id(2), note_id(3), note_id(4));
    let mut tx = store.begin().await.unwrap();
    tx.begin_writes(&writer).await.unwrap();
    let WriteResult::Written { row, version } =
        tx.write_row(notes, &k1, &insert("one")).await.unwrap()
    else {
        panic!("not written");
    };
    let row = row.unwrap();
    assert_eq!(row["title"].as_deref(), Some("one"));
    assert_eq!(row["body"], None);
    let found = tx
        .find_rows(notes, std::slice::from_ref(&k1))
        .await
        .unwrap();
    assert_eq!(found[0].visible.as_ref(), Some(&row));
    assert_eq!(
        found[0]
            .version
            .as_ref()
            .map(|v| (v.version.clone(), v.deleted)),
        Some((version.clone(), false))
    );
    // Refusals and zero-row writes leave nothing.
    assert_eq!(
        tx.write_row(notes, &k1, &insert("again")).await.unwrap(),
        WriteResult::Refused(Refusal::DuplicateKey)
    );
    let missing_title = RowWrite::Insert {
        values: vec![("owner_id".to_owned(), Some("u1".to_owned()))],
    };
    assert_eq!(
        tx.write_row(notes, &k2, &missing_title).await.unwrap(),
        WriteResult::Refused(Refusal::Constraint)
    );
    let update = RowWrite::Update {
        values: vec![("title".to_owned(), Some("new".to_owned()))],
    };
    assert_eq!(
        tx.write_row(notes, &k4, &update).await.unwrap(),
        WriteResult::Unchanged
    );
    // A set is all or none.
    let set = vec![(k2.clone(), insert("two")), (k4.clone(), update.clone())];
    assert_eq!(tx.write_rows(notes, &set).await.unwrap(), None);
    let set = vec![(k2.clone(), insert("two")), (k3.clone(), insert("three"))];
    let written = tx.write_rows(notes, &set).await.unwrap().unwrap();
    assert_eq!(written.len(), 2);
    // A hard delete keeps the deletion fence.
    let WriteResult::Written { row: None, .. } =
        tx.write_row(notes, &k3, &RowWrite::Delete).await.unwrap()
    else {
        panic!("a delete reports no row");
    };
    // An undone group leaves nothing of its writes.
    tx.mark_group().await.unwrap();
    let WriteResult::Written { .. } = tx.write_row(notes, &k4, &insert("four")).await.unwrap()
    else {
        panic!("not written");
    };
    assert_eq!(tx.check_constraints().await.unwrap(), None);
    tx.undo_group().await.unwrap();
    tx.end_writes().await.unwrap();
    let keys = [k1.clone(), k2.clone(), k3.clone(), k4.clone()];
    let found = tx.find_rows(notes, &keys).await.unwrap();
    let state: Vec<(bool, Option<bool>)> = found
        .iter()
        .map(|f| (f.visible.is_some(), f.version.as_ref().map(|v| v.deleted)))
        .collect();
    assert_eq!(
        state,
        [
            (true, Some(false)),
            (true, Some(false)),
            (false, Some(true)),
            (false, None)
        ]
    );
    assert_eq!(
        found[1].visible.as_ref().unwrap()["title"].as_deref(),
        Some("two")
    );
    tx.commit().await.unwrap();

    // Values the database cannot keep as given. A key is refused for the
    // whole request (the uuid key column prints lowercase only, and no
    // text holds U+0000); a column value is refused for its write.
    let upper = "018F2B5E-7C42-7A1D-9D31-8A95BD6740AB".to_owned();
    for key in [upper, format!("{k1}\0"), "not-a-uuid".to_owned()] {
        let mut tx = store.begin().await.unwrap();
        let got = tx.find_rows(notes, &[key]).await;
        assert!(matches!(got, Err(StoreError::Data(_))), "{got:?}");
    }
    let mut tx = store.begin().await.unwrap();
    tx.begin_writes(&writer).await.unwrap();
    let nul = RowWrite::Update {
        values: vec![("title".to_owned(), Some("a\0b".to_owned()))],
    };
    assert_eq!(
        tx.write_row(notes, &k1, &nul).await.unwrap(),
        WriteResult::Refused(Refusal::Constraint)
    );
    assert_eq!(
        tx.write_rows(notes, &[(k1.clone(), nul)]).await.unwrap(),
        None
    );
    tx.end_writes().await.unwrap();
    drop(tx);
    // Identities: a client ID or user ID with U+0000 cannot be stored.
    let mut tx = store.begin().await.unwrap();
    let got = tx.lock_client("c\0").await;
    assert!(matches!(got, Err(StoreError::Data(_))), "{got:?}");
    drop(tx);
    let mut tx = store.begin().await.unwrap();
    let mut client = ClientRecord::fresh("u\0", "c-nul-user", 1, 0);
    let got = tx.insert_client(&client).await;
    assert!(matches!(got, Err(StoreError::Data(_))), "{got:?}");
    drop(tx);
    client.user_id = "u1".into();
    let mut tx = store.begin().await.unwrap();
    assert!(tx.insert_client(&client).await.unwrap());
    tx.commit().await.unwrap();
}
