//! Scenario suites shared by every way of running the engine: in memory
//! (`actors` tests, MemStore) and over real HTTP against PostgreSQL
//! (`server` tests, PgStore). One definition of the expected behaviour, two
//! worlds. Built only with the `testkit` feature.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use protocol::json::{self, Value};
use protocol::manifest::Manifest;

use crate::config::SyncConfig;

mod capture;
mod evolution;
mod pull;
mod push;
mod rebuild;
mod retention;
mod stream;
mod transport;
pub use capture::{
    CaptureWorld, MemWorld, Write, capture_store_suite, capture_suite, fast_config, invalid_owners,
    rematerialized, repair_resumes, settle, stream_begun, truncate_blocks,
};
pub use evolution::{
    an_older_leader_gives_way, config_after, config_before, rematerialization_suite,
    without_templates,
};
pub use pull::{
    PullClient, a_pull_waits_for_its_own_writes, a_standby_hears_the_leaders_fence_reports,
    cursor_bindings, cursor_generation, cursor_position, mint_cursor, note_row, origin_cursor,
    pull_note, pull_store_suite, pull_suite, pull_suite_via,
};
pub use push::{
    NOW, NOW_TEXT, PushClient, batch_id, benchmark_limits, mutation, mutation_id, note_columns,
    note_id, note_mutation, outcome, push_config, push_config_toml, push_store_suite, push_suite,
    version_of,
};
pub use rebuild::{rebuild_store_suite, rebuild_suite, rebuild_suite_via};
pub use retention::retention_suite;
pub use stream::{
    Broken, HandOver, baseline_adopts_existing_rows, baseline_cut_short_is_handed_over,
    slot_loss_blocks, stream_reset_recovers,
};
pub use transport::{Answer, Node, Route, Serve, Transport};

/// The example config (`examples/notes/config.toml`).
pub const EXAMPLE_CONFIG: &str = include_str!("../../../examples/notes/config.toml");

/// The example config parsed, after `edit` was applied to its text.
pub fn example_config(edit: impl Fn(String) -> String) -> SyncConfig {
    SyncConfig::from_toml(&edit(EXAMPLE_CONFIG.to_owned())).unwrap()
}

/// The column types of `examples/notes/schema.sql` that store a value
/// differently from its text, for MemStore to keep what PostgreSQL keeps.
pub const EXAMPLE_COLUMN_TYPES: [(&str, &str, &str); 2] = [
    ("public.notes", "id", "uuid"),
    ("public.note_shares", "note_id", "uuid"),
];

/// The example app's relations and their keys (a dependency relation's:
/// the columns its rule reads), as the application creates them.
pub const EXAMPLE_RELATIONS: [(&str, &[&str]); 3] = [
    ("public.notes", &["id"]),
    ("public.templates", &["id"]),
    ("public.note_shares", &["note_id", "team_id"]),
];

/// An empty MemStore with the example app's relations, whose source
/// columns have the example schema's types.
pub async fn example_mem_store(seed: u64) -> crate::store::MemStore {
    let store = crate::store::MemStore::with_seed(seed);
    for (relation, column, ty) in EXAMPLE_COLUMN_TYPES {
        store.declare_column_type(relation, column, ty).await;
    }
    let mut tx = crate::store::Store::begin(&store).await.unwrap();
    for (relation, key) in EXAMPLE_RELATIONS {
        tx.create_relation(relation, key);
    }
    crate::store::StoreTx::commit(tx).await.unwrap();
    store
}

/// One running engine with its own empty database.
#[allow(async_fn_in_trait)]
pub trait Harness {
    /// `POST /sync/connect` as `user`; the status and parsed body.
    async fn connect(&mut self, user: &str, body: &Value) -> (u16, Value);
    /// Stops the engine and starts it again on the same database with `config`.
    async fn restart(&mut self, config: &SyncConfig);
    /// Adds or removes a row of `synchro.scope_grants`.
    async fn grant(&mut self, user: &str, scope: &str, on: bool);
    /// Adds or removes a row of the example's `public.team_members`.
    async fn team_member(&mut self, user: &str, team: &str, on: bool);
    /// Retires a client identity (an operator action).
    async fn retire(&mut self, client_id: &str);
}

/// Makes fresh harnesses.
#[allow(async_fn_in_trait)]
pub trait HarnessFactory {
    type H: Harness;
    /// A new engine on a new, empty database, started with `config`.
    async fn fresh(&self, config: &SyncConfig) -> Self::H;
}

/// A connect request body.
#[derive(Clone)]
pub struct ConnectBody {
    pub client_id: String,
    pub generation: Option<u64>,
    pub schema: Value,
    pub scope_set_version: u64,
    pub known: Vec<(String, Option<String>)>,
    pub reset: bool,
    pub app_version: String,
    pub protocol_version: i64,
    /// `seed_receipts` (omitted when empty).
    pub seed_receipts: Vec<(String, String)>,
}

impl ConnectBody {
    /// A fresh client's first connect.
    pub fn fresh(client_id: &str) -> ConnectBody {
        ConnectBody {
            client_id: client_id.into(),
            generation: None,
            schema: json::parse(br#"{"version":0,"hash":""}"#).unwrap(),
            scope_set_version: 0,
            known: Vec::new(),
            reset: false,
            app_version: "1.2.0".into(),
            protocol_version: 3,
            seed_receipts: Vec::new(),
        }
    }

    /// A continuing client's connect after applying `response`.
    pub fn after(client_id: &str, response: &Value) -> ConnectBody {
        let o = response.as_object().unwrap();
        let mut known: Vec<(String, Option<String>)> = Vec::new();
        let scopes = o["scopes"].as_object().unwrap();
        if let Value::Array(add) = &scopes["add"] {
            for a in add {
                known.push((
                    a.as_object().unwrap()["id"].as_str().unwrap().to_owned(),
                    None,
                ));
            }
        }
        let schema = o["schema"].as_object().unwrap();
        ConnectBody {
            client_id: client_id.into(),
            generation: Some(int(&o["client_generation"])),
            schema: json::object([
                ("version", schema["version"].clone()),
                ("hash", schema["hash"].clone()),
            ]),
            scope_set_version: int(&o["scope_set_version"]),
            known,
            reset: false,
            app_version: "1.2.0".into(),
            protocol_version: 3,
            seed_receipts: Vec::new(),
        }
    }

    /// The JSON body.
    pub fn to_json(&self) -> Value {
        let mut o = json::Object::new();
        o.insert("client_id".into(), Value::string(&self.client_id));
        if let Some(g) = self.generation {
            o.insert("client_generation".into(), Value::int(g as i64));
        }
        o.insert("platform".into(), Value::string("ios"));
        o.insert("app_version".into(), Value::string(&self.app_version));
        o.insert("protocol_version".into(), Value::int(self.protocol_version));
        if self.reset {
            o.insert("schema_reset".into(), Value::Bool(true));
        }
        o.insert("schema".into(), self.schema.clone());
        o.insert(
            "scope_set_version".into(),
            Value::int(self.scope_set_version as i64),
        );
        let known = self.known.iter().map(|(s, c)| {
            let cursor = c.as_ref().map_or(Value::Null, |c| Value::string(c.clone()));
            (s.clone(), json::object([("cursor", cursor)]))
        });
        o.insert("known_scopes".into(), Value::Object(known.collect()));
        if !self.seed_receipts.is_empty() {
            let receipts = self
                .seed_receipts
                .iter()
                .map(|(s, r)| (s.clone(), Value::string(r.clone())));
            o.insert("seed_receipts".into(), Value::Object(receipts.collect()));
        }
        Value::Object(o)
    }
}

/// The integer member `name` of a response object.
pub fn int_member(v: &Value, name: &str) -> u64 {
    int(&v.as_object().unwrap()[name])
}

fn int(v: &Value) -> u64 {
    match v {
        Value::Number(n) => n.as_exact_i64().unwrap() as u64,
        _ => panic!("not an integer: {v:?}"),
    }
}

fn member<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    let mut v = v;
    for p in path {
        v = v
            .as_object()
            .unwrap_or_else(|| panic!("{p}: not an object"))
            .get(*p)
            .unwrap_or_else(|| panic!("missing {p}"));
    }
    v
}

fn has(v: &Value, name: &str) -> bool {
    v.as_object().unwrap().contains_key(name)
}

fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::Array(a) => a.iter().map(|s| s.as_str().unwrap().to_owned()).collect(),
        _ => panic!("not an array"),
    }
}

fn added(v: &Value) -> Vec<String> {
    match member(v, &["scopes", "add"]) {
        Value::Array(a) => a
            .iter()
            .map(|e| {
                assert_eq!(
                    member(e, &["cursor"]),
                    &Value::Null,
                    "additions have null cursors"
                );
                member(e, &["id"]).as_str().unwrap().to_owned()
            })
            .collect(),
        _ => panic!(),
    }
}

fn removed(v: &Value) -> Vec<String> {
    strings(member(v, &["scopes", "remove"]))
}

fn action(v: &Value) -> &str {
    member(v, &["schema", "action"]).as_str().unwrap()
}

/// Asserts the members every action requires and forbids.
fn assert_action_shape(v: &Value) {
    let schema = member(v, &["schema"]);
    let (def, affected, reason) = (
        has(v, "schema_definition"),
        has(v, "affected_scopes"),
        has(schema, "reason"),
    );
    match action(v) {
        "none" => assert!(!def && !affected && !reason),
        "replace" => assert!(def && !affected && !reason),
        "rebuild_local" => assert!(
            def && affected && !reason && !strings(member(v, &["affected_scopes"])).is_empty()
        ),
        "unsupported" => assert!(!def && !affected && reason),
        other => panic!("unknown action {other}"),
    }
    if def {
        let m = Manifest::from_json(member(v, &["schema_definition"]).clone()).unwrap();
        assert_eq!(
            Value::int(m.schema_version() as i64),
            *member(schema, &["version"])
        );
        assert_eq!(Value::string(m.hash().to_hex()), *member(schema, &["hash"]));
    }
    assert_eq!(member(v, &["protocol_version"]), &Value::int(3));
    assert!(has(v, "scope_cursor_updates") && has(v, "server_time"));
}

async fn ok(h: &mut impl Harness, user: &str, body: &ConnectBody) -> Value {
    let (status, v) = h.connect(user, &body.to_json()).await;
    assert_eq!(status, 200, "{}", json::to_canonical_string(&v));
    assert_action_shape(&v);
    v
}

async fn fails(h: &mut impl Harness, user: &str, body: &Value) -> (u16, String, Value) {
    let (status, v) = h.connect(user, body).await;
    let error = member(&v, &["error"]).clone();
    let code = member(&error, &["code"]).as_str().unwrap().to_owned();
    assert_eq!(error.as_object().unwrap()["retryable"], Value::Bool(false));
    (status, code, error)
}

/// Every connect scenario of the wire spec's dispatch table and assignment rules.
pub async fn connect_suite<F: HarnessFactory>(f: &F) {
    seed_receipts_are_unverifiable(f).await;
    fresh_client_gets_replace_then_none(f).await;
    fresh_sentinel_rules(f).await;
    compatibility_gates(f).await;
    client_id_is_bound_to_its_user(f).await;
    retired_clients(f).await;
    registrations_are_capped_per_user(f).await;
    class_2_history_gets_replace(f).await;
    class_3_history(f).await;
    unknown_and_class_4_lineage_is_unsupported(f).await;
    explicit_reset(f).await;
    assignment_changes_step_the_version_by_one(f).await;
    generation_renewal(f).await;
}

async fn fresh_client_gets_replace_then_none<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    assert_eq!(action(&first), "replace");
    assert_eq!(member(&first, &["client_generation"]), &Value::int(1));
    assert_eq!(member(&first, &["scope_set_version"]), &Value::int(1));
    assert_eq!(added(&first), ["templates_public", "user:alice"]);
    assert!(removed(&first).is_empty());
    assert_eq!(
        json::to_canonical_string(member(&first, &["scope_cursor_updates"])),
        "{}"
    );
    let time = member(&first, &["server_time"]).as_str().unwrap();
    assert!(time.len() == 27 && time.ends_with('Z'), "{time}");
    // The inline manifest is the example's.
    let m = Manifest::from_json(member(&first, &["schema_definition"]).clone()).unwrap();
    assert_eq!(m.tables().len(), 2);
    assert_eq!(m.schema_version(), 1);

    let again = ok(&mut h, "alice", &ConnectBody::after("c1", &first)).await;
    assert_eq!(action(&again), "none");
    assert_eq!(member(&again, &["client_generation"]), &Value::int(1));
    assert_eq!(member(&again, &["scope_set_version"]), &Value::int(1));
    assert!(added(&again).is_empty() && removed(&again).is_empty());
}

async fn fresh_sentinel_rules<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    // Fresh sentinel paired with a generation.
    let mut body = ConnectBody::fresh("c1");
    body.generation = Some(1);
    let (status, code, error) = fails(&mut h, "alice", &body.to_json()).await;
    assert_eq!((status, code.as_str()), (400, "invalid_schema_reference"));
    assert_eq!(
        json::to_canonical_string(member(&error, &["received_schema"])),
        r#"{"hash":"","version":0}"#
    );
    // Nothing was written: the same client can still register fresh.
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    // The identical fresh request again (its response was lost): the same answer, no new generation.
    let retry = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    assert_eq!(action(&retry), "replace");
    assert_eq!(member(&retry, &["client_generation"]), &Value::int(1));
    assert_eq!(
        member(&retry, &["scope_set_version"]),
        member(&first, &["scope_set_version"])
    );
    assert_eq!(added(&retry), added(&first));
    // Once the client has presented its generation, the identity is known:
    // the fresh sentinel is refused.
    ok(&mut h, "alice", &ConnectBody::after("c1", &first)).await;
    let (status, code, _) = fails(&mut h, "alice", &ConnectBody::fresh("c1").to_json()).await;
    assert_eq!((status, code.as_str()), (400, "invalid_schema_reference"));
    // A known identity that omits its generation.
    let mut body = ConnectBody::after("c1", &first);
    body.generation = None;
    let (status, code, _) = fails(&mut h, "alice", &body.to_json()).await;
    assert_eq!((status, code.as_str()), (400, "invalid_schema_reference"));
    // A malformed reference.
    let mut body = ConnectBody::after("c1", &first);
    body.schema = json::parse(br#"{"version":1,"hash":"abc"}"#).unwrap();
    let (status, code, _) = fails(&mut h, "alice", &body.to_json()).await;
    assert_eq!((status, code.as_str()), (400, "invalid_schema_reference"));
    // Sentinel with schema_reset.
    let mut body = ConnectBody::fresh("c2");
    body.reset = true;
    let (status, code, _) = fails(&mut h, "alice", &body.to_json()).await;
    assert_eq!((status, code.as_str()), (400, "invalid_schema_reference"));
    // Other structural defects: invalid_request.
    let mut v = ConnectBody::fresh("c3").to_json();
    if let Value::Object(o) = &mut v {
        o.insert("user_id".into(), Value::string("mallory"));
    }
    let (status, code, _) = fails(&mut h, "alice", &v).await;
    assert_eq!((status, code.as_str()), (400, "invalid_request"));
    // Identities no database can store: a terminal 400, never a 503 that a
    // client would retry for ever.
    for (user, client) in [("alice", "c\u{0}4"), ("al\u{0}ice", "c5")] {
        for _ in 0..2 {
            let body = ConnectBody::fresh(client).to_json();
            let (status, code, _) = fails(&mut h, user, &body).await;
            assert_eq!(
                (status, code.as_str()),
                (400, "invalid_request"),
                "{user:?} {client:?}"
            );
        }
    }
}

async fn compatibility_gates<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let mut body = ConnectBody::fresh("c1");
    body.protocol_version = 2;
    let (status, code, error) = fails(&mut h, "alice", &body.to_json()).await;
    assert_eq!((status, code.as_str()), (426, "upgrade_required"));
    assert_eq!(
        member(&error, &["required_protocol_version"]),
        &Value::int(3)
    );
    assert_eq!(
        member(&error, &["received_protocol_version"]),
        &Value::int(2)
    );
    let mut body = ConnectBody::fresh("c1");
    body.app_version = "0.9.9".into();
    let (status, code, error) = fails(&mut h, "alice", &body.to_json()).await;
    assert_eq!((status, code.as_str()), (426, "upgrade_required"));
    assert_eq!(
        member(&error, &["minimum_client_version"]),
        &Value::string("1.0.0")
    );
    assert_eq!(
        member(&error, &["received_client_version"]),
        &Value::string("0.9.9")
    );
    // The gate comes before structural validation.
    let mut v = body.to_json();
    if let Value::Object(o) = &mut v {
        o.remove("platform");
    }
    assert_eq!(fails(&mut h, "alice", &v).await.0, 426);
}

async fn client_id_is_bound_to_its_user<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    // Another user presenting alice's client_id: 401, before every other check.
    let (status, code, _) = fails(&mut h, "bob", &ConnectBody::after("c1", &first).to_json()).await;
    assert_eq!((status, code.as_str()), (401, "auth_required"));
    let mut gated = ConnectBody::after("c1", &first);
    gated.protocol_version = 2;
    assert_eq!(fails(&mut h, "bob", &gated.to_json()).await.0, 401);
    // Alice is unaffected.
    assert_eq!(
        action(&ok(&mut h, "alice", &ConnectBody::after("c1", &first)).await),
        "none"
    );
}

async fn retired_clients<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    h.retire("c1").await;
    let (status, code, _) =
        fails(&mut h, "alice", &ConnectBody::after("c1", &first).to_json()).await;
    assert_eq!((status, code.as_str()), (409, "client_retired"));
    // A retired identity cannot be revived as fresh either.
    let (status, _, _) = fails(&mut h, "alice", &ConnectBody::fresh("c1").to_json()).await;
    assert_eq!(status, 409);
    // The 426 gate precedes retirement.
    let mut gated = ConnectBody::after("c1", &first);
    gated.protocol_version = 4;
    assert_eq!(fails(&mut h, "alice", &gated.to_json()).await.0, 426);
}

/// A user registers at most `limits.registrations_per_user_per_hour` new
/// client IDs; past them a new one answers 429 with Retry-After, while the
/// user's bound clients and other users go on.
async fn registrations_are_capped_per_user<F: HarnessFactory>(f: &F) {
    let mut config = example_config(|s| s);
    config.limits.registrations_per_user_per_hour = 3;
    let mut h = f.fresh(&config).await;
    let mut first = None;
    for i in 0..3 {
        let r = ok(&mut h, "flood", &ConnectBody::fresh(&format!("flood-{i}"))).await;
        first.get_or_insert(r);
    }
    // Refused, and retryable; the same request again is refused again
    // (a refusal registers nothing).
    for _ in 0..2 {
        let (status, v) = h
            .connect("flood", &ConnectBody::fresh("flood-3").to_json())
            .await;
        let error = member(&v, &["error"]);
        assert_eq!(
            (
                status,
                member(error, &["code"]),
                member(error, &["retryable"])
            ),
            (429, &Value::string("retry_later"), &Value::Bool(true)),
            "{v:?}"
        );
    }
    let first = first.unwrap();
    let again = ok(&mut h, "flood", &ConnectBody::after("flood-0", &first)).await;
    assert_eq!(action(&again), "none");
    ok(&mut h, "calm", &ConnectBody::fresh("calm-0")).await;
}

/// Adds a field to the notes table, in config text.
fn add_notes_field(config: String, field: &str) -> String {
    config.replace(
        "  { field_id = \"fld_notes_pinned\"",
        &format!("  {field},\n  {{ field_id = \"fld_notes_pinned\""),
    )
}

async fn class_2_history_gets_replace<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    let v1 = ConnectBody::after("c1", &first);
    h.restart(&example_config(|s| {
        add_notes_field(s, r#"{ field_id = "fld_notes_color", column = "color", type = "string", nullable = true }"#)
    }))
    .await;
    let mut with_cursor = v1.clone();
    with_cursor.known[0].1 = Some("opaque-cursor".into());
    let r = ok(&mut h, "alice", &with_cursor).await;
    assert_eq!(action(&r), "replace");
    assert_eq!(member(&r, &["schema", "version"]), &Value::int(2));
    // The historical cursor cannot be carried over here, so it is invalidated.
    let updates = json::to_canonical_string(member(&r, &["scope_cursor_updates"]));
    assert_eq!(updates, format!(r#"{{"{}":null}}"#, with_cursor.known[0].0));
    // The new manifest is the child of the old one.
    let m = Manifest::from_json(member(&r, &["schema_definition"]).clone()).unwrap();
    assert_eq!(
        m.transition_class(),
        protocol::manifest::TransitionClass::Class2
    );
    assert_eq!(
        Some(m.parent_schema().unwrap().to_json()),
        Some(v1.schema.clone())
    );
    // A restart with the same config adds no version.
    h.restart(&example_config(|s| {
        add_notes_field(s, r#"{ field_id = "fld_notes_color", column = "color", type = "string", nullable = true }"#)
    }))
    .await;
    let again = ok(&mut h, "alice", &ConnectBody::after("c1", &r)).await;
    assert_eq!(action(&again), "none");
}

async fn class_3_history<F: HarnessFactory>(f: &F) {
    // A required new notes field needs rematerialization: alice's user scope is affected.
    let mut h = f.fresh(&example_config(|s| s)).await;
    h.team_member("alice", "t1", true).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    assert_eq!(added(&first), ["team:t1", "templates_public", "user:alice"]);
    h.restart(&example_config(|s| {
        add_notes_field(
            s,
            r#"{ field_id = "fld_notes_rank", column = "rank", type = "int" }"#,
        )
    }))
    .await;
    let r = ok(&mut h, "alice", &ConnectBody::after("c1", &first)).await;
    assert_eq!(action(&r), "rebuild_local");
    assert_eq!(
        strings(member(&r, &["affected_scopes"])),
        ["team:t1", "user:alice"]
    );

    // The same kind of change to templates, for a user not assigned templates_public: replace.
    let no_shared = |s: String| s.replace(r#"shared = ["templates_public"]"#, "shared = []");
    let mut h = f.fresh(&example_config(no_shared)).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    assert_eq!(added(&first), ["user:alice"]);
    h.restart(&example_config(|s| {
        no_shared(s).replace(
            r#"  { field_id = "fld_templates_body", column = "body", type = "string" },"#,
            r#"  { field_id = "fld_templates_body", column = "body", type = "string" },
  { field_id = "fld_templates_rank", column = "rank", type = "int" },"#,
        )
    }))
    .await;
    let r = ok(&mut h, "alice", &ConnectBody::after("c1", &first)).await;
    assert_eq!(action(&r), "replace");
}

async fn unknown_and_class_4_lineage_is_unsupported<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    let mut unknown = ConnectBody::after("c1", &first);
    unknown.schema = json::object([
        ("version", Value::int(1)),
        ("hash", Value::string("ab".repeat(32))),
    ]);
    let r = ok(&mut h, "alice", &unknown).await;
    assert_eq!(action(&r), "unsupported");
    assert_eq!(
        member(&r, &["schema", "reason"]),
        &Value::string("unknown_schema_lineage")
    );
    // Removing a field is class 4.
    h.restart(&example_config(|s| s.replace("  { field_id = \"fld_notes_pinned\", column = \"pinned\", type = \"boolean\", writable = true },\n", ""))).await;
    let r = ok(&mut h, "alice", &ConnectBody::after("c1", &first)).await;
    assert_eq!(action(&r), "unsupported");
    assert_eq!(
        member(&r, &["schema", "reason"]),
        &Value::string("incompatible_schema_transition")
    );
    assert_eq!(member(&r, &["schema", "version"]), &Value::int(2));
}

async fn explicit_reset<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    h.restart(&example_config(|s| s.replace("  { field_id = \"fld_notes_pinned\", column = \"pinned\", type = \"boolean\", writable = true },\n", ""))).await;
    let mut reset = ConnectBody::after("c1", &first);
    reset.reset = true;
    let r = ok(&mut h, "alice", &reset).await;
    assert_eq!(action(&r), "rebuild_local");
    assert_eq!(
        strings(member(&r, &["affected_scopes"])),
        ["templates_public", "user:alice"]
    );
    // With no assigned scope, reset is replace.
    let nothing = |s: String| {
        s.replace(r#"shared = ["templates_public"]"#, "shared = []")
            .replace(r#"user_scope = "user:{user_id}""#, r#"user_scope = """#)
    };
    let mut h = f.fresh(&example_config(nothing)).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    assert!(added(&first).is_empty());
    assert_eq!(member(&first, &["scope_set_version"]), &Value::int(0));
    let mut reset = ConnectBody::after("c1", &first);
    reset.reset = true;
    assert_eq!(action(&ok(&mut h, "alice", &reset).await), "replace");
}

async fn assignment_changes_step_the_version_by_one<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let mut last = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    let mut known = ConnectBody::after("c1", &last);
    let step = |h_last: &Value, body: &mut ConnectBody| {
        for s in removed(h_last) {
            body.known.retain(|(k, _)| *k != s);
        }
        for s in added(h_last) {
            body.known.push((s, None));
        }
        body.scope_set_version = int(member(h_last, &["scope_set_version"]));
    };
    // Grant: +1 and added.
    h.grant("alice", "project:p1", true).await;
    last = ok(&mut h, "alice", &known).await;
    assert_eq!(member(&last, &["scope_set_version"]), &Value::int(2));
    assert_eq!(added(&last), ["project:p1"]);
    step(&last, &mut known);
    // No change: same version, empty delta.
    last = ok(&mut h, "alice", &known).await;
    assert_eq!(member(&last, &["scope_set_version"]), &Value::int(2));
    assert!(added(&last).is_empty() && removed(&last).is_empty());
    // Revoke: +1 and removed.
    h.grant("alice", "project:p1", false).await;
    last = ok(&mut h, "alice", &known).await;
    assert_eq!(member(&last, &["scope_set_version"]), &Value::int(3));
    assert_eq!(removed(&last), ["project:p1"]);
    step(&last, &mut known);
    // Team membership through the dependency relation: +1.
    h.team_member("alice", "t7", true).await;
    last = ok(&mut h, "alice", &known).await;
    assert_eq!(member(&last, &["scope_set_version"]), &Value::int(4));
    assert_eq!(added(&last), ["team:t7"]);
    step(&last, &mut known);
    // A grant and a revoke at once are one change: +1.
    h.grant("alice", "project:p2", true).await;
    h.team_member("alice", "t7", false).await;
    last = ok(&mut h, "alice", &known).await;
    assert_eq!(member(&last, &["scope_set_version"]), &Value::int(5));
    assert_eq!(added(&last), ["project:p2"]);
    assert_eq!(removed(&last), ["team:t7"]);
    // Another user's grant changes nothing for alice.
    step(&last, &mut known);
    h.grant("bob", "project:p3", true).await;
    last = ok(&mut h, "alice", &known).await;
    assert_eq!(member(&last, &["scope_set_version"]), &Value::int(5));
    // A shared scope dropped from the config: removed, one step.
    h.restart(&example_config(|s| {
        s.replace(r#"shared = ["templates_public"]"#, "shared = []")
    }))
    .await;
    last = ok(&mut h, "alice", &known).await;
    assert_eq!(member(&last, &["scope_set_version"]), &Value::int(6));
    assert_eq!(removed(&last), ["templates_public"]);
    step(&last, &mut known);
    // And added back, on purpose (the config it returns to was replaced:
    // ADR 0020 §8): one more step.
    let mut back = example_config(|s| s);
    back.roll_back = true;
    h.restart(&back).await;
    last = ok(&mut h, "alice", &known).await;
    assert_eq!(member(&last, &["scope_set_version"]), &Value::int(7));
    assert_eq!(added(&last), ["templates_public"]);
    step(&last, &mut known);
    // A scope the client invented is removed, without a version step.
    known.known.push(("project:invented".into(), None));
    last = ok(&mut h, "alice", &known).await;
    assert_eq!(removed(&last), ["project:invented"]);
    assert_eq!(member(&last, &["scope_set_version"]), &Value::int(7));
}

async fn generation_renewal<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let first = ok(&mut h, "alice", &ConnectBody::fresh("c1")).await;
    let mut stale = ConnectBody::after("c1", &first);
    stale.generation = Some(7); // not the current generation (1)
    stale.known[0].1 = Some("opaque-cursor".into());
    // The next generation is the server's own next one, whatever was presented.
    let r = ok(&mut h, "alice", &stale).await;
    assert_eq!(member(&r, &["client_generation"]), &Value::int(2));
    let updates = json::to_canonical_string(member(&r, &["scope_cursor_updates"]));
    assert_eq!(updates, format!(r#"{{"{}":null}}"#, stale.known[0].0));
    // The new generation is current from then on.
    let next = ok(&mut h, "alice", &ConnectBody::after("c1", &r)).await;
    assert_eq!(member(&next, &["client_generation"]), &Value::int(2));
    // A generation at the edge of the portable range was never issued: it
    // renews like any other, and the generation issued is usable.
    for presented in [9_007_199_254_740_990, 9_007_199_254_740_991] {
        let mut edge = ConnectBody::after("c1", &next);
        edge.generation = Some(presented);
        let r = ok(&mut h, "alice", &edge).await;
        let issued = member(&r, &["client_generation"]).clone();
        assert!(
            issued == Value::int(3) || issued == Value::int(4),
            "{issued:?}"
        );
        let again = ok(&mut h, "alice", &ConnectBody::after("c1", &r)).await;
        assert_eq!(member(&again, &["client_generation"]), &issued);
        assert_eq!(action(&again), "none");
    }
    // A restored client unknown to the server starts at the server's first
    // generation, whatever it presented, and its cursors are not honoured.
    for (client, presented) in [("c2", 3), ("c3", 9_007_199_254_740_990)] {
        let mut restored = ConnectBody::after(client, &first);
        restored.generation = Some(presented);
        restored.known[0].1 = Some("opaque-cursor".into());
        let r = ok(&mut h, "alice", &restored).await;
        assert_eq!(member(&r, &["client_generation"]), &Value::int(1));
        let updates = json::to_canonical_string(member(&r, &["scope_cursor_updates"]));
        assert_eq!(updates, format!(r#"{{"{}":null}}"#, restored.known[0].0));
        let again = ok(&mut h, "alice", &ConnectBody::after(client, &r)).await;
        assert_eq!(member(&again, &["client_generation"]), &Value::int(1));
    }
}

/// A store whose operator-side tables the conformance suite can write.
#[allow(async_fn_in_trait)]
pub trait ConformanceStore: crate::store::Store {
    /// Inserts a row of `synchro.scope_grants`.
    async fn add_grant(&self, user: &str, scope: &str);
    /// Inserts a row of the dependency relation `source`.
    async fn add_dependency_row(
        &self,
        source: &crate::config::DependencyAssignment,
        user: &str,
        value: &str,
    );
}

impl ConformanceStore for crate::store::MemStore {
    async fn add_grant(&self, user: &str, scope: &str) {
        self.grant(user, scope).await;
    }

    async fn add_dependency_row(
        &self,
        source: &crate::config::DependencyAssignment,
        user: &str,
        value: &str,
    ) {
        self.dependency_row(source, user, value, true).await;
    }
}

/// The same operations on any store, with the same expected results.
pub async fn store_suite<S: ConformanceStore>(store: &S) {
    use std::collections::BTreeSet;

    use protocol::ids::ScopeId;
    use protocol::manifest::TransitionClass;

    use crate::store::{ClientRecord, StoreError, StoreTx};

    // Empty.
    let mut tx = store.begin().await.unwrap();
    assert!(tx.manifests().await.unwrap().is_empty());
    assert_eq!(tx.lock_client("c1").await.unwrap(), None);
    assert!(tx.grants("u1").await.unwrap().is_empty());
    tx.commit().await.unwrap();

    // Manifests: stored, listed in version order, byte-identical; versions only increase.
    let tables = example_config(|s| s).table_manifests().unwrap();
    let v1 = Manifest::new(1, None, TransitionClass::Initial, 1, tables.clone()).unwrap();
    let v2 = Manifest::new(
        2,
        Some(v1.reference()),
        TransitionClass::Class2,
        1,
        tables[..1].to_vec(),
    )
    .unwrap();
    let mut tx = store.begin().await.unwrap();
    tx.insert_manifest(&v1).await.unwrap();
    tx.insert_manifest(&v2).await.unwrap();
    assert!(matches!(
        tx.insert_manifest(&v2).await,
        Err(StoreError::Integrity(_))
    ));
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.manifests().await.unwrap(), vec![v1.clone(), v2.clone()]);
    drop(tx);

    // A dropped transaction writes nothing.
    let client = ClientRecord {
        user_id: "u1".into(),
        client_id: "c1".into(),
        generation: 1,
        retired: false,
        installed_schema: Some(v1.reference()),
        scope_set_version: 1,
        assigned: ["user:u1", "b", "a"]
            .iter()
            .map(|s| ScopeId::parse(s).unwrap())
            .collect(),
        ever_assigned: ["user:u1", "b", "a", "gone"]
            .iter()
            .map(|s| ScopeId::parse(s).unwrap())
            .collect(),
        accepted_write_epoch: 7,
        continued: true,
        registered_at: 1_000,
    };
    let mut tx = store.begin().await.unwrap();
    assert!(tx.insert_client(&client).await.unwrap());
    drop(tx);
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.lock_client("c1").await.unwrap(), None);
    // A record replaces only a binding that exists.
    assert!(matches!(
        tx.put_client(&client).await,
        Err(StoreError::Integrity(_))
    ));
    drop(tx);
    // A committed one is read back exactly, and replaced by a later put.
    let mut tx = store.begin().await.unwrap();
    assert!(tx.insert_client(&client).await.unwrap());
    tx.commit().await.unwrap();
    // A binding is never rewritten: another user's insert of the ID changes
    // nothing, and neither does a put under another user.
    let mut tx = store.begin().await.unwrap();
    let stolen = ClientRecord {
        user_id: "u2".into(),
        ..client.clone()
    };
    assert!(!tx.insert_client(&stolen).await.unwrap());
    assert!(matches!(
        tx.put_client(&stolen).await,
        Err(StoreError::Integrity(_))
    ));
    drop(tx);
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.lock_client("c1").await.unwrap(), Some(client.clone()));
    // Registrations count by the binding's time, per user.
    assert_eq!(tx.count_registrations("u1", 1_000).await.unwrap(), 1);
    assert_eq!(tx.count_registrations("u1", 1_001).await.unwrap(), 0);
    assert_eq!(tx.count_registrations("u2", 0).await.unwrap(), 0);
    let changed = ClientRecord {
        generation: 2,
        retired: true,
        installed_schema: None,
        scope_set_version: 2,
        assigned: BTreeSet::new(),
        ever_assigned: BTreeSet::new(),
        accepted_write_epoch: 8,
        continued: false,
        ..client.clone()
    };
    tx.put_client(&changed).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.lock_client("c1").await.unwrap(), Some(changed.clone()));
    // A put never moves the binding's time.
    tx.put_client(&ClientRecord {
        registered_at: 9_999,
        ..changed.clone()
    })
    .await
    .unwrap();
    assert_eq!(tx.lock_client("c1").await.unwrap(), Some(changed.clone()));
    assert_eq!(
        tx.lock_client("C1").await.unwrap(),
        None,
        "client IDs are exact"
    );
    tx.commit().await.unwrap();

    // A locked client row serializes a second transaction behind the first.
    let mut first = store.begin().await.unwrap();
    let seen = first.lock_client("c1").await.unwrap().unwrap();
    let second = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut tx = store.begin().await.unwrap();
            let c = tx.lock_client("c1").await.unwrap().unwrap();
            tx.commit().await.unwrap();
            c.generation
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    first
        .put_client(&ClientRecord {
            generation: seen.generation + 1,
            ..seen
        })
        .await
        .unwrap();
    first.commit().await.unwrap();
    assert_eq!(
        second.await.unwrap(),
        3,
        "the second transaction saw the first one's write"
    );

    // Grants and dependency rows are per user.
    store.add_grant("u1", "project:b").await;
    store.add_grant("u1", "project:a").await;
    store.add_grant("u2", "project:c").await;
    let source = example_config(|s| s).assignment.dependency[0].clone();
    store.add_dependency_row(&source, "u1", "t1").await;
    store.add_dependency_row(&source, "u1", "t2").await;
    store.add_dependency_row(&source, "u2", "t3").await;
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.grants("u1").await.unwrap(), ["project:a", "project:b"]);
    assert_eq!(tx.grants("u3").await.unwrap(), Vec::<String>::new());
    let mut teams = tx.dependency_values(&source, "u1").await.unwrap();
    teams.sort();
    assert_eq!(teams, ["t1", "t2"]);
    assert!(
        tx.dependency_values(&source, "nobody")
            .await
            .unwrap()
            .is_empty()
    );
    tx.commit().await.unwrap();
}

async fn seed_receipts_are_unverifiable<F: HarnessFactory>(f: &F) {
    let mut h = f.fresh(&example_config(|s| s)).await;
    let mut body = ConnectBody::fresh("c1");
    body.seed_receipts = vec![
        ("templates_public".into(), "opaque-receipt-1".into()),
        ("project:unassigned".into(), "opaque-receipt-2".into()),
    ];
    let r = ok(&mut h, "alice", &body).await;
    // The assigned seeded scope arrives with a null cursor (rebuild); the unassigned one is removed.
    assert_eq!(added(&r), ["templates_public", "user:alice"]);
    assert_eq!(removed(&r), ["project:unassigned"]);
    // A seeded scope the client already knows gets its cursor invalidated.
    let mut next = ConnectBody::after("c1", &r);
    next.known.retain(|(s, _)| s != "project:unassigned");
    for (s, c) in next.known.iter_mut() {
        if s == "templates_public" {
            *c = Some("opaque-seed-cursor".into());
        }
    }
    next.seed_receipts = vec![("templates_public".into(), "opaque-receipt-1".into())];
    let again = ok(&mut h, "alice", &next).await;
    assert!(added(&again).is_empty() && removed(&again).is_empty());
    assert_eq!(
        json::to_canonical_string(member(&again, &["scope_cursor_updates"])),
        r#"{"templates_public":null}"#
    );
}
