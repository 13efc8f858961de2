//! Every column kind the catalog accepts, written by push with values of
//! every portable type: edge values, NUL, over-long strings, spellings a
//! column would rewrite. Whatever the value, the answer is terminal: a 200
//! outcome or a 400, never a 5xx that a client would retry for ever. And an
//! applied value is stored exactly as authored: no column rewrites it.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::Engine;
use actors::config::SyncConfig;
use actors::testkit::{PushClient, mutation, outcome, push_config};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRunner};
use protocol::json::{self, Value};
use store_pg::cluster::PgCluster;
use store_pg::example_store;

const KINDS_SQL: &str = r#"
CREATE TABLE public.kinds (
    id text PRIMARY KEY,
    c_text text, c_varchar varchar(5), c_char char(4), c_uuid uuid,
    c_smallint smallint, c_integer integer CHECK (c_integer IS DISTINCT FROM 13), c_bigint bigint,
    c_numeric numeric(6,2), c_real real, c_double double precision, c_bool boolean,
    c_ts timestamptz, c_date date, c_time time, c_json json, c_jsonb jsonb, c_bytea bytea
);
CREATE TABLE public.kinds_uuid (id uuid PRIMARY KEY, c_text text);
CREATE TABLE public.kinds_small (id smallint PRIMARY KEY, c_text text);
"#;

/// (field, column, portable type, extra TOML) of `public.kinds`.
const FIELDS: [(&str, &str, &str); 17] = [
    ("fld_k_text", "c_text", "string"),
    ("fld_k_varchar", "c_varchar", "string"),
    ("fld_k_char", "c_char", "string"),
    ("fld_k_uuid", "c_uuid", "string"),
    ("fld_k_smallint", "c_smallint", "int"),
    ("fld_k_integer", "c_integer", "int"),
    ("fld_k_bigint", "c_bigint", "int64"),
    ("fld_k_numeric", "c_numeric", "decimal"),
    ("fld_k_real", "c_real", "float"),
    ("fld_k_double", "c_double", "float"),
    ("fld_k_bool", "c_bool", "boolean"),
    ("fld_k_ts", "c_ts", "datetime"),
    ("fld_k_date", "c_date", "date"),
    ("fld_k_time", "c_time", "time"),
    ("fld_k_json", "c_json", "json"),
    ("fld_k_jsonb", "c_jsonb", "json"),
    ("fld_k_bytea", "c_bytea", "bytes"),
];

const UUID_LOWER: &str = "018f2b5e-7c42-7a1d-9d31-8a95bd6740ab";
const UUID_UPPER: &str = "018F2B5E-7C42-7A1D-9D31-8A95BD6740AB";

fn config() -> SyncConfig {
    let mut fields =
        vec![r#"{ field_id = "fld_k_id", column = "id", type = "string" }"#.to_owned()];
    for (f, c, ty) in FIELDS {
        let bounds = if ty == "decimal" {
            ", precision = 6, scale = 2"
        } else {
            ""
        };
        fields.push(format!(
            r#"{{ field_id = "{f}", column = "{c}", type = "{ty}", nullable = true, writable = true{bounds} }}"#
        ));
    }
    let tables = format!(
        r#"
[[tables]]
table_id = "tbl_kinds"
relation_id = "rel_kinds"
relation = "public.kinds"
name = "kinds"
primary_key = "id"
fields = [{}]
scopes = [{{ constant = "kinds" }}]

[[tables]]
table_id = "tbl_kinds_uuid"
relation_id = "rel_kinds_uuid"
relation = "public.kinds_uuid"
name = "kinds_uuid"
primary_key = "id"
fields = [{{ field_id = "fld_ku_id", column = "id", type = "string" }}, {{ field_id = "fld_ku_text", column = "c_text", type = "string", nullable = true, writable = true }}]
scopes = [{{ constant = "kinds" }}]

[[tables]]
table_id = "tbl_kinds_small"
relation_id = "rel_kinds_small"
relation = "public.kinds_small"
name = "kinds_small"
primary_key = "id"
fields = [{{ field_id = "fld_ks_id", column = "id", type = "int" }}, {{ field_id = "fld_ks_text", column = "c_text", type = "string", nullable = true, writable = true }}]
scopes = [{{ constant = "kinds" }}]
"#,
        fields.join(", ")
    );
    let text = actors::testkit::EXAMPLE_CONFIG.to_owned() + &tables;
    let mut c = SyncConfig::from_toml(&text).unwrap();
    let base = push_config();
    c.capture = base.capture;
    c
}

async fn start(name: &str) -> (PgCluster, PushClient) {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, name).await;
    sqlx::raw_sql(KINDS_SQL)
        .execute(store.pool())
        .await
        .unwrap();
    let engine = Engine::start(store, config()).await.unwrap();
    let c = PushClient::connect(&engine, "u1", "c1").await;
    (cluster, c)
}

fn v(text: &str) -> Value {
    json::parse(text.as_bytes()).unwrap()
}

fn insert(c: &PushClient, n: u64, table: &str, key: (&str, Value), columns: Value) -> Value {
    let mut m = mutation(
        n,
        table,
        (key.0, "placeholder"),
        &c.schema,
        "insert",
        None,
        Some(columns),
    );
    // `mutation` takes a string key; these tables also have an int key.
    if let Value::Object(o) = &mut m {
        o.insert("pk".into(), json::object([(key.0, key.1)]));
    }
    m
}

/// The outcome code of mutation `n`, or `applied` with the check that each
/// authored column came back exactly as authored.
fn judged(r: &Value, n: u64, authored: &Value) -> String {
    let (accepted, o) = outcome(r, n);
    let o = o.as_object().unwrap();
    if !accepted {
        return o["code"].as_str().unwrap().to_owned();
    }
    let row = o["server_row"].as_object().unwrap();
    for (field, value) in authored.as_object().unwrap() {
        assert_eq!(&row[field], value, "mutation {n}: {field} was rewritten");
    }
    "applied".into()
}

#[tokio::test]
async fn each_class_of_value_gets_its_terminal_answer() {
    let (_cluster, c) = start("kinds_fixed").await;
    let cases: Vec<(&str, Value, &str)> = vec![
        ("fld_k_text", v(r#""a\u0000b""#), "validation_failed"),
        (
            "fld_k_text",
            v(&format!("\"{}\"", "x".repeat(5000))),
            "applied",
        ),
        ("fld_k_varchar", v(r#""abcdef""#), "validation_failed"),
        ("fld_k_varchar", v(r#""abcd ""#), "applied"),
        ("fld_k_varchar", v(r#""abcde ""#), "validation_failed"),
        ("fld_k_char", v(r#""ab""#), "validation_failed"),
        ("fld_k_char", v(r#""abcd""#), "applied"),
        (
            "fld_k_uuid",
            v(r#""018F2B5E-7C42-7A1D-9D31-8A95BD6740AB""#),
            "validation_failed",
        ),
        (
            "fld_k_uuid",
            v(r#""018f2b5e7c427a1d9d318a95bd6740ab""#),
            "validation_failed",
        ),
        ("fld_k_uuid", v(r#""not-a-uuid""#), "validation_failed"),
        (
            "fld_k_uuid",
            v(r#""018f2b5e-7c42-7a1d-9d31-8a95bd6740ab""#),
            "applied",
        ),
        ("fld_k_smallint", v("40000"), "validation_failed"),
        ("fld_k_smallint", v("-32768"), "applied"),
        ("fld_k_integer", v("13"), "validation_failed"), // CHECK constraint
        ("fld_k_integer", v("2147483647"), "applied"),
        ("fld_k_bigint", v(r#""-9223372036854775808""#), "applied"),
        ("fld_k_numeric", v(r#""1.234""#), "validation_failed"), // beyond the scale
        ("fld_k_numeric", v(r#""9999.99""#), "applied"),
        ("fld_k_real", v("0.123456789"), "validation_failed"), // would round
        ("fld_k_real", v("1e+39"), "validation_failed"),       // out of range
        ("fld_k_real", v("0.1"), "applied"),
        ("fld_k_double", v("5e-324"), "applied"),
        ("fld_k_double", v("1.7976931348623157e+308"), "applied"),
        ("fld_k_ts", v(r#""0001-01-01T00:00:00.000000Z""#), "applied"),
        ("fld_k_ts", v(r#""9999-12-31T23:59:59.999999Z""#), "applied"),
        ("fld_k_date", v(r#""0001-01-01""#), "applied"),
        ("fld_k_time", v(r#""23:59:59.999999""#), "applied"),
        // The capture trigger reads the row as jsonb, which cannot hold it.
        (
            "fld_k_json",
            v(r#""{\"a\":\"\\u0000\"}""#),
            "validation_failed",
        ),
        (
            "fld_k_jsonb",
            v(r#""{\"a\":\"\\u0000\"}""#),
            "validation_failed",
        ),
        ("fld_k_jsonb", v(r#""{\"a\":1,\"b\":[1e+21]}""#), "applied"),
        ("fld_k_bytea", v(r#""AP8""#), "applied"),
        ("fld_k_bool", v("1"), "validation_failed"), // not of the type
    ];
    let mut mutations = Vec::new();
    for (i, (field, value, _)) in cases.iter().enumerate() {
        let columns = json::object([(*field, value.clone())]);
        let key = Value::string(format!("fixed-{i}"));
        mutations.push(insert(
            &c,
            100 + i as u64,
            "tbl_kinds",
            ("fld_k_id", key),
            columns,
        ));
    }
    let (status, r, _) = c.push(&c.batch(1, mutations, false)).await;
    assert_eq!(status, 200, "{r:?}");
    for (i, (field, value, expected)) in cases.iter().enumerate() {
        let authored = json::object([(*field, value.clone())]);
        assert_eq!(
            judged(&r, 100 + i as u64, &authored),
            *expected,
            "{field} = {value:?}"
        );
    }

    // Keys the key column would refuse or respell: the whole request is
    // invalid, the same on every retry, and nothing is stored.
    let keys: Vec<(&str, &str, Value)> = vec![
        (
            "tbl_kinds_uuid",
            "fld_ku_id",
            v(r#""018F2B5E-7C42-7A1D-9D31-8A95BD6740AB""#),
        ),
        (
            "tbl_kinds_uuid",
            "fld_ku_id",
            v(r#""{018f2b5e-7c42-7a1d-9d31-8a95bd6740ab}""#),
        ),
        ("tbl_kinds_uuid", "fld_ku_id", v(r#""not-a-uuid""#)),
        ("tbl_kinds", "fld_k_id", v(r#""k\u0000""#)),
        ("tbl_kinds_small", "fld_ks_id", v("40000")),
    ];
    for (i, (table, pk, key)) in keys.into_iter().enumerate() {
        let n = 200 + i as u64;
        let columns = json::object([]);
        let body = c.batch(
            n,
            vec![insert(&c, n, table, (pk, key.clone()), columns)],
            false,
        );
        for _ in 0..2 {
            let (status, r, _) = c.push(&body).await;
            let code = r.as_object().unwrap()["error"].as_object().unwrap()["code"].clone();
            assert_eq!(
                (status, code),
                (400, Value::string("invalid_request")),
                "{key:?}"
            );
        }
    }
    // The canonical spellings of the same keys are ordinary rows.
    let fine = vec![
        insert(
            &c,
            300,
            "tbl_kinds_uuid",
            ("fld_ku_id", v(r#""018f2b5e-7c42-7a1d-9d31-8a95bd6740ab""#)),
            json::object([]),
        ),
        insert(
            &c,
            301,
            "tbl_kinds_small",
            ("fld_ks_id", v("-32768")),
            json::object([]),
        ),
    ];
    let (status, r, _) = c.push(&c.batch(300, fine, false)).await;
    assert_eq!(status, 200);
    assert!(outcome(&r, 300).0 && outcome(&r, 301).0, "{r:?}");
}

/// A value of any portable type, including the edges and wrong kinds.
fn any_value() -> impl Strategy<Value = Value> {
    let texts = [
        "null",
        "true",
        "false",
        "0",
        "1",
        "13",
        "-1",
        "40000",
        "-32768",
        "2147483647",
        "-2147483648",
        "0.1",
        "0.5",
        "-1.5",
        "0.123456789",
        "1e+38",
        "1e+39",
        "5e-324",
        "1.7976931348623157e+308",
        "[]",
        "{}",
        r#""""#,
        r#""abcd""#,
        r#""abcdefgh""#,
        r#""ab  ""#,
        r#""a\u0000b""#,
        r#""é""#,
        r#""018F2B5E-7C42-7A1D-9D31-8A95BD6740AB""#,
        r#""018f2b5e-7c42-7a1d-9d31-8a95bd6740ab""#,
        r#""9223372036854775807""#,
        r#""-9223372036854775808""#,
        r#""01""#,
        r#""9999.99""#,
        r#""1.234""#,
        r#""12345.67""#,
        r#""-0""#,
        r#""0001-01-01T00:00:00.000000Z""#,
        r#""9999-12-31T23:59:59.999999Z""#,
        r#""2024-02-29""#,
        r#""0001-01-01""#,
        r#""23:59:59.999999""#,
        r#""00:00:00.000000""#,
        r#""{\"a\":\"\\u0000\"}""#,
        r#""[1e+21]""#,
        r#""9007199254740991""#,
        r#""{\"z\":1,\"a\":2}""#,
        r#""AP8""#,
        r#""AQ==""#,
    ];
    let long = Just(Value::string("y".repeat(70_000 / 4)));
    prop_oneof![
        10 => proptest::sample::select(texts.to_vec()).prop_map(v),
        1 => long,
    ]
}

#[tokio::test]
async fn random_values_always_get_a_terminal_answer() {
    let (_cluster, c) = start("kinds_random").await;
    let field_names: Vec<&str> = FIELDS.iter().map(|f| f.0).collect();
    let key = prop_oneof![
        16 => Just(("tbl_kinds", "fld_k_id", Value::string("fresh"))),
        8 => Just(("tbl_kinds", "fld_k_id", Value::string("r2"))),
        8 => Just(("tbl_kinds", "fld_k_id", Value::string(""))),
        1 => Just(("tbl_kinds", "fld_k_id", Value::string("r\u{0}"))),
        2 => Just(("tbl_kinds_uuid", "fld_ku_id", Value::string(UUID_LOWER))),
        1 => Just(("tbl_kinds_uuid", "fld_ku_id", Value::string(UUID_UPPER))),
        2 => Just(("tbl_kinds_small", "fld_ks_id", Value::int(7))),
        1 => Just(("tbl_kinds_small", "fld_ks_id", Value::int(40000))),
    ];
    let columns =
        proptest::collection::btree_map(proptest::sample::select(field_names), any_value(), 0..4);
    let batch = proptest::collection::vec((key, columns, any::<bool>()), 1..5);
    let mut runner = TestRunner::new(Config {
        cases: 96,
        ..Config::default()
    });
    let (mut executed, mut applied) = (0, 0);
    for b in 0..96u64 {
        let spec = batch.new_tree(&mut runner).unwrap().current();
        let mut mutations = Vec::new();
        let mut authored = Vec::new();
        for (i, ((table, pk, key), cols, is_update)) in spec.iter().enumerate() {
            let n = b * 10 + i as u64;
            // The other tables have one writable field.
            let cols: Value = match *table {
                "tbl_kinds" => Value::Object(
                    cols.iter()
                        .map(|(k, v)| ((*k).to_owned(), v.clone()))
                        .collect(),
                ),
                "tbl_kinds_uuid" => json::object([("fld_ku_text", Value::string("u"))]),
                _ => json::object([("fld_ks_text", Value::string("s"))]),
            };
            // "fresh" is a new row each time; the other keys repeat.
            let key = match key.as_str() {
                Some("fresh") => Value::string(format!("r-{n}")),
                _ => key.clone(),
            };
            let mut m = insert(&c, n, table, (pk, key), cols.clone());
            if *is_update && cols.as_object().is_some_and(|o| !o.is_empty()) {
                let o = match &mut m {
                    Value::Object(o) => o,
                    _ => unreachable!(),
                };
                o.insert("op".into(), Value::string("update"));
                o.insert("base_version".into(), Value::string("stale"));
            }
            mutations.push(m);
            authored.push((n, cols));
        }
        let (status, r, raw) = c.push(&c.batch(b + 1000, mutations, false)).await;
        match status {
            200 => {
                executed += 1;
                for (n, cols) in &authored {
                    let (accepted, o) = outcome(&r, *n);
                    let status = o.as_object().unwrap()["status"]
                        .as_str()
                        .unwrap()
                        .to_owned();
                    assert!(
                        matches!(
                            status.as_str(),
                            "applied" | "conflict" | "rejected_terminal"
                        ),
                        "{status}"
                    );
                    if accepted {
                        applied += 1;
                        judged(&r, *n, cols);
                    }
                }
            }
            400 => {}
            other => panic!("status {other}: {}", String::from_utf8_lossy(&raw)),
        }
    }
    // Most batches reach execution, and values do get written.
    assert!(executed >= 32, "only {executed} of 96 batches executed");
    assert!(applied >= 8, "only {applied} mutations applied");
}
