//! Every structural case of the four request kinds: the spec's examples are
//! accepted, and each defect gets its exact status and code.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests and benches fail loudly

use protocol::error::{ErrorCode, ErrorKind, ProtocolError, UpgradeRequired};
use protocol::json::{self, Value};
use protocol::wire::connect::{ConnectRequest, ConnectSchema, semver_precedence};
use protocol::wire::pull::PullRequest;
use protocol::wire::push::{Operation, PushRequest};
use protocol::wire::rebuild::RebuildRequest;

const HASH: &str = "21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea";

fn parse(text: &str) -> Value {
    json::parse(text.as_bytes()).unwrap()
}

/// Sets (or with `None` removes) the member at a path of object names / array indexes.
fn edit(mut v: Value, path: &[&str], new: Option<Value>) -> Value {
    fn walk(v: &mut Value, path: &[&str], new: Option<Value>) {
        let (head, rest) = path.split_first().unwrap();
        match v {
            Value::Object(o) if rest.is_empty() => match new {
                Some(n) => {
                    o.insert((*head).to_owned(), n);
                }
                None => {
                    o.remove(*head);
                }
            },
            Value::Object(o) => walk(o.get_mut(*head).unwrap(), rest, new),
            Value::Array(a) => {
                let i: usize = head.parse().unwrap();
                if rest.is_empty() {
                    match new {
                        Some(n) => a[i] = n,
                        None => {
                            a.remove(i);
                        }
                    }
                } else {
                    walk(&mut a[i], rest, new)
                }
            }
            _ => panic!("bad path"),
        }
    }
    walk(&mut v, path, new);
    v
}

/// The request text, keeping every number lexeme exactly as written
/// (canonical output would turn `4.0` into `4` before the parser sees it).
fn body(v: &Value) -> Vec<u8> {
    fn write(v: &Value, out: &mut String) {
        match v {
            Value::Number(n) => out.push_str(n.lexeme()),
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(item, out);
                }
                out.push(']');
            }
            Value::Object(members) => {
                out.push('{');
                for (i, (k, item)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    json::write_value(&Value::String(k.clone()), out);
                    out.push(':');
                    write(item, out);
                }
                out.push('}');
            }
            other => json::write_value(other, out),
        }
    }
    let mut out = String::new();
    write(v, &mut out);
    out.into_bytes()
}

/// The status and code of a rejection; `None` when the request was accepted.
fn code(r: Result<impl std::fmt::Debug, ProtocolError>) -> Option<(u16, ErrorCode)> {
    r.err().map(|e| (e.status(), e.code()))
}

const INVALID: Option<(u16, ErrorCode)> = Some((400, ErrorCode::InvalidRequest));
const INVALID_SCHEMA: Option<(u16, ErrorCode)> = Some((400, ErrorCode::InvalidSchemaReference));

fn connect_example() -> Value {
    parse(
        r#"{
  "client_id": "ios-device-123",
  "client_generation": 4,
  "platform": "ios",
  "app_version": "3.0.1",
  "protocol_version": 3,
  "schema_reset": false,
  "schema": {"version": 7, "hash": "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"},
  "scope_set_version": 12,
  "known_scopes": {
    "documents_user:u_123": {"cursor": "opaque-incremental-cursor-a"},
    "templates_public": {"cursor": "opaque-incremental-cursor-c"},
    "project:p_old": {"cursor": null}
  }
}"#,
    )
}

fn connect(v: &Value) -> Result<ConnectRequest, ProtocolError> {
    ConnectRequest::parse(&body(v), Some(&semver::Version::new(3, 0, 0)))
}

#[test]
fn connect_example_is_accepted() {
    let r = connect(&connect_example()).unwrap();
    assert_eq!(r.client_generation, Some(4));
    assert!(matches!(r.schema, ConnectSchema::Installed(s) if s.version == 7));
    assert_eq!(r.known_scopes.len(), 3);
    assert!(!r.schema_reset);
    assert!(r.seed_receipts.is_empty());
}

#[test]
fn connect_fresh_client() {
    let v = edit(connect_example(), &["client_generation"], None);
    let v = edit(v, &["schema"], Some(parse(r#"{"version":0,"hash":""}"#)));
    let v = edit(v, &["schema_reset"], None);
    let r = connect(&v).unwrap();
    assert_eq!(
        (r.client_generation, r.schema, r.schema_reset),
        (None, ConnectSchema::Fresh, false)
    );
}

#[test]
fn connect_protocol_and_runtime_gates_come_before_structure() {
    // 426 wins over a structural defect elsewhere in the body.
    let v = edit(
        connect_example(),
        &["protocol_version"],
        Some(Value::int(2)),
    );
    let v = edit(v, &["platform"], None);
    let e = connect(&v).unwrap_err();
    assert_eq!(e.status(), 426);
    assert_eq!(
        e.kind(),
        &ErrorKind::UpgradeRequired(UpgradeRequired::Protocol {
            required: 3,
            received: 2
        })
    );
    let v = edit(
        connect_example(),
        &["app_version"],
        Some(Value::string("2.9.9+build.7")),
    );
    let e = connect(&v).unwrap_err();
    assert_eq!(e.status(), 426);
    let text = json::to_canonical_string(&e.to_json());
    assert!(
        text.contains(
            r#""minimum_client_version":"3.0.0","received_client_version":"2.9.9+build.7""#
        )
    );
    // A prerelease of the minimum precedes it.
    let v = edit(
        connect_example(),
        &["app_version"],
        Some(Value::string("3.0.0-rc.1")),
    );
    assert_eq!(connect(&v).unwrap_err().status(), 426);
    // Build metadata does not count for precedence.
    let v = edit(
        connect_example(),
        &["app_version"],
        Some(Value::string("3.0.0+abc")),
    );
    assert!(connect(&v).is_ok());
    // Without a configured minimum only the protocol gate applies.
    let v = edit(
        connect_example(),
        &["app_version"],
        Some(Value::string("0.0.1")),
    );
    assert!(ConnectRequest::parse(&body(&v), None).is_ok());
}

#[test]
fn semver_precedence_follows_semver_2() {
    let order = [
        "1.0.0-alpha",
        "1.0.0-alpha.1",
        "1.0.0-alpha.beta",
        "1.0.0-beta",
        "1.0.0-beta.2",
        "1.0.0-beta.11",
        "1.0.0-rc.1",
        "1.0.0",
        "2.0.0",
        "2.1.0",
        "2.1.1",
    ];
    for w in order.windows(2) {
        let (a, b) = (
            semver::Version::parse(w[0]).unwrap(),
            semver::Version::parse(w[1]).unwrap(),
        );
        assert_eq!(
            semver_precedence(&a, &b),
            std::cmp::Ordering::Less,
            "{} < {}",
            w[0],
            w[1]
        );
    }
    let (a, b) = (
        semver::Version::parse("1.0.0+x").unwrap(),
        semver::Version::parse("1.0.0+y").unwrap(),
    );
    assert_eq!(semver_precedence(&a, &b), std::cmp::Ordering::Equal);
}

#[test]
fn connect_structural_cases() {
    let base = connect_example();
    let cases: Vec<(&str, Value)> = vec![
        (
            "unknown member",
            edit(base.clone(), &["user_id"], Some(Value::string("u"))),
        ),
        (
            "missing client_id",
            edit(base.clone(), &["client_id"], None),
        ),
        (
            "empty client_id",
            edit(base.clone(), &["client_id"], Some(Value::string(""))),
        ),
        (
            "long client_id",
            edit(
                base.clone(),
                &["client_id"],
                Some(Value::string("c".repeat(257))),
            ),
        ),
        (
            "null client_id",
            edit(base.clone(), &["client_id"], Some(Value::Null)),
        ),
        (
            "zero generation",
            edit(base.clone(), &["client_generation"], Some(Value::int(0))),
        ),
        (
            "null generation",
            edit(base.clone(), &["client_generation"], Some(Value::Null)),
        ),
        (
            "float generation",
            edit(base.clone(), &["client_generation"], Some(parse("4.0"))),
        ),
        (
            "string generation",
            edit(
                base.clone(),
                &["client_generation"],
                Some(Value::string("4")),
            ),
        ),
        (
            "generation beyond 2^53-1",
            edit(
                base.clone(),
                &["client_generation"],
                Some(parse("9007199254740992")),
            ),
        ),
        ("missing platform", edit(base.clone(), &["platform"], None)),
        (
            "empty platform",
            edit(base.clone(), &["platform"], Some(Value::string(""))),
        ),
        (
            "bad semver",
            edit(base.clone(), &["app_version"], Some(Value::string("3.0"))),
        ),
        (
            "leading-zero semver",
            edit(
                base.clone(),
                &["app_version"],
                Some(Value::string("03.0.1")),
            ),
        ),
        (
            "missing protocol_version",
            edit(base.clone(), &["protocol_version"], None),
        ),
        (
            "string protocol_version",
            edit(
                base.clone(),
                &["protocol_version"],
                Some(Value::string("3")),
            ),
        ),
        (
            "float protocol_version",
            edit(base.clone(), &["protocol_version"], Some(parse("3.0"))),
        ),
        (
            "null schema_reset",
            edit(base.clone(), &["schema_reset"], Some(Value::Null)),
        ),
        (
            "string schema_reset",
            edit(
                base.clone(),
                &["schema_reset"],
                Some(Value::string("false")),
            ),
        ),
        ("missing schema", edit(base.clone(), &["schema"], None)),
        (
            "negative scope_set_version",
            edit(base.clone(), &["scope_set_version"], Some(Value::int(-1))),
        ),
        (
            "missing scope_set_version",
            edit(base.clone(), &["scope_set_version"], None),
        ),
        (
            "missing known_scopes",
            edit(base.clone(), &["known_scopes"], None),
        ),
        (
            "known_scopes array",
            edit(base.clone(), &["known_scopes"], Some(parse("[]"))),
        ),
        (
            "scope entry without cursor",
            edit(
                base.clone(),
                &["known_scopes", "templates_public"],
                Some(parse("{}")),
            ),
        ),
        (
            "scope entry extra member",
            edit(
                base.clone(),
                &["known_scopes", "templates_public"],
                Some(parse(r#"{"cursor":null,"x":1}"#)),
            ),
        ),
        (
            "cursor number",
            edit(
                base.clone(),
                &["known_scopes", "templates_public", "cursor"],
                Some(Value::int(1)),
            ),
        ),
        (
            "empty cursor",
            edit(
                base.clone(),
                &["known_scopes", "templates_public", "cursor"],
                Some(Value::string("")),
            ),
        ),
        (
            "empty scope id",
            edit(
                base.clone(),
                &["known_scopes", ""],
                Some(parse(r#"{"cursor":null}"#)),
            ),
        ),
        (
            "empty seed_receipts",
            edit(base.clone(), &["seed_receipts"], Some(parse("{}"))),
        ),
        (
            "seed receipt number",
            edit(base.clone(), &["seed_receipts"], Some(parse(r#"{"s":1}"#))),
        ),
        ("top-level array", parse("[]")),
    ];
    for (what, v) in cases {
        assert_eq!(code(connect(&v)), INVALID, "{what}");
    }
    for raw in [
        &b"{"[..],
        b"",
        b"{\"client_id\":\"a\",\"client_id\":\"b\"}",
        b"\xff\xfe",
    ] {
        assert_eq!(code(ConnectRequest::parse(raw, None)), INVALID);
    }
}

#[test]
fn connect_schema_reference_cases() {
    let base = connect_example();
    for bad in [
        r#"{"version":0,"hash":"21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea"}"#,
        r#"{"version":8,"hash":""}"#,
        r#"{"version":8,"hash":"21D56A4F2191820E954F008EA32BA8DA8568A952CD01A45FD1A3FE16BBE8AAEA"}"#,
        r#"{"version":8,"hash":"21d56a4f"}"#,
        r#"{"version":8}"#,
        r#"{"version":8,"hash":"21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea","x":1}"#,
        r#"{"version":-1,"hash":""}"#,
        r#"{"version":0.0,"hash":""}"#,
        r#"{"version":"8","hash":"21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea"}"#,
        r#"null"#,
        r#""v8""#,
    ] {
        let e = connect(&edit(base.clone(), &["schema"], Some(parse(bad)))).unwrap_err();
        assert_eq!(Some((e.status(), e.code())), INVALID_SCHEMA, "{bad}");
        let body = json::to_canonical_string(&e.to_json());
        assert!(body.contains("\"received_schema\":"), "{body}");
    }
    // The fresh sentinel with a generation, or with schema_reset, is invalid_schema_reference.
    let fresh = parse(r#"{"version":0,"hash":""}"#);
    let with_generation = edit(base.clone(), &["schema"], Some(fresh.clone()));
    assert_eq!(code(connect(&with_generation)), INVALID_SCHEMA);
    let with_reset = edit(
        edit(with_generation, &["client_generation"], None),
        &["schema_reset"],
        Some(Value::Bool(true)),
    );
    assert_eq!(code(connect(&with_reset)), INVALID_SCHEMA);
    // Other structural defects keep invalid_request even with a bad schema.
    let both = edit(
        edit(base, &["schema"], Some(parse("null"))),
        &["platform"],
        None,
    );
    assert_eq!(code(connect(&both)), INVALID);
}

fn push_example() -> Value {
    parse(&format!(
        r#"{{
  "client_id": "ios-device-123",
  "client_generation": 4,
  "batch_id": "018f2b5e-7c42-7a1d-9d31-8a95bd674001",
  "schema": {{"version": 8, "hash": "{HASH}"}},
  "mutations": [
    {{"mutation_id": "018f2b5e-7c42-7a1d-9d31-8a95bd674011", "table": "tbl_documents", "pk": {{"fld_documents_id": "doc-100"}},
      "authored_schema": {{"version": 8, "hash": "{HASH}"}}, "op": "insert", "client_version": "2026-07-18T13:59:01.000000Z",
      "columns": {{"fld_documents_title": "Lower Body"}}}},
    {{"mutation_id": "018f2b5e-7c42-7a1d-9d31-8a95bd674012", "table": "tbl_documents", "pk": {{"fld_documents_id": "doc-101"}},
      "authored_schema": {{"version": 8, "hash": "{HASH}"}}, "op": "update", "base_version": "opaque-row-version-101",
      "client_version": "2026-07-18T13:59:02.000000Z", "columns": {{"fld_documents_title": "Upper Body"}}}},
    {{"mutation_id": "018f2b5e-7c42-7a1d-9d31-8a95bd674013", "table": "tbl_documents", "pk": {{"fld_documents_id": "doc-102"}},
      "authored_schema": {{"version": 8, "hash": "{HASH}"}}, "op": "delete", "base_version": "opaque-row-version-102",
      "client_version": "2026-07-18T13:59:03.000000Z"}}
  ]
}}"#
    ))
}

fn push(v: &Value) -> Result<PushRequest, ProtocolError> {
    PushRequest::parse(&body(v))
}

#[test]
fn push_example_is_accepted() {
    let r = push(&push_example()).unwrap();
    assert_eq!(r.mutations.len(), 3);
    assert!(!r.atomic);
    assert!(matches!(r.mutations[0].op, Operation::Insert { .. }));
    assert!(matches!(r.mutations[1].op, Operation::Update { .. }));
    assert!(matches!(r.mutations[2].op, Operation::Delete { .. }));
    // Empty insert columns are valid; int keys are valid.
    let v = edit(
        push_example(),
        &["mutations", "0", "columns"],
        Some(parse("{}")),
    );
    let v = edit(
        v,
        &["mutations", "0", "pk"],
        Some(parse(r#"{"fld_id":-7}"#)),
    );
    assert!(push(&v).is_ok());
    let v = edit(push_example(), &["atomic"], Some(Value::Bool(true)));
    assert!(push(&v).unwrap().atomic);
}

#[test]
fn push_structural_cases() {
    let base = push_example();
    let m0 = |path: &str, new: Option<Value>| edit(base.clone(), &["mutations", "0", path], new);
    let m1 = |path: &str, new: Option<Value>| edit(base.clone(), &["mutations", "1", path], new);
    let m2 = |path: &str, new: Option<Value>| edit(base.clone(), &["mutations", "2", path], new);
    let first = match &base.as_object().unwrap()["mutations"] {
        Value::Array(a) => a[0].clone(),
        _ => unreachable!(),
    };
    let cases: Vec<(&str, Value)> = vec![
        (
            "unknown envelope member",
            edit(base.clone(), &["depends_on"], Some(Value::int(1))),
        ),
        ("missing batch_id", edit(base.clone(), &["batch_id"], None)),
        (
            "uppercase batch_id",
            edit(
                base.clone(),
                &["batch_id"],
                Some(Value::string("018F2B5E-7C42-7A1D-9D31-8A95BD674001")),
            ),
        ),
        (
            "nil batch_id",
            edit(
                base.clone(),
                &["batch_id"],
                Some(Value::string("00000000-0000-0000-0000-000000000000")),
            ),
        ),
        (
            "missing generation",
            edit(base.clone(), &["client_generation"], None),
        ),
        (
            "fresh sentinel schema",
            edit(
                base.clone(),
                &["schema"],
                Some(parse(r#"{"version":0,"hash":""}"#)),
            ),
        ),
        (
            "malformed schema",
            edit(base.clone(), &["schema"], Some(parse(r#"{"version":8}"#))),
        ),
        (
            "atomic false",
            edit(base.clone(), &["atomic"], Some(Value::Bool(false))),
        ),
        (
            "atomic null",
            edit(base.clone(), &["atomic"], Some(Value::Null)),
        ),
        (
            "no mutations",
            edit(base.clone(), &["mutations"], Some(parse("[]"))),
        ),
        (
            "mutations object",
            edit(base.clone(), &["mutations"], Some(parse("{}"))),
        ),
        (
            "too many mutations",
            edit(
                base.clone(),
                &["mutations"],
                Some(Value::Array(vec![first.clone(); 1001])),
            ),
        ),
        ("upsert op", m0("op", Some(Value::string("upsert")))),
        ("unknown op", m0("op", Some(Value::string("resurrect")))),
        (
            "insert with base_version",
            m0("base_version", Some(Value::string("v1"))),
        ),
        ("insert without columns", m0("columns", None)),
        ("insert null columns", m0("columns", Some(Value::Null))),
        ("update without base_version", m1("base_version", None)),
        (
            "update empty base_version",
            m1("base_version", Some(Value::string(""))),
        ),
        (
            "update base_version with quote",
            m1("base_version", Some(Value::string("a\"b"))),
        ),
        (
            "update base_version too long",
            m1("base_version", Some(Value::string("v".repeat(65)))),
        ),
        ("update empty columns", m1("columns", Some(parse("{}")))),
        ("update without columns", m1("columns", None)),
        (
            "delete with columns",
            m2("columns", Some(parse(r#"{"a":1}"#))),
        ),
        ("delete without base_version", m2("base_version", None)),
        ("missing mutation_id", m0("mutation_id", None)),
        (
            "noncanonical mutation_id",
            m0(
                "mutation_id",
                Some(Value::string("018f2b5e7c427a1d9d318a95bd674011")),
            ),
        ),
        ("missing table", m0("table", None)),
        ("empty table", m0("table", Some(Value::string("")))),
        (
            "composite pk",
            m0("pk", Some(parse(r#"{"a":"1","b":"2"}"#))),
        ),
        ("empty pk", m0("pk", Some(parse("{}")))),
        ("null pk value", m0("pk", Some(parse(r#"{"a":null}"#)))),
        ("decimal pk value", m0("pk", Some(parse(r#"{"a":1.5}"#)))),
        ("float-spelled pk", m0("pk", Some(parse(r#"{"a":1.0}"#)))),
        (
            "pk beyond int",
            m0("pk", Some(parse(r#"{"a":2147483648}"#))),
        ),
        ("bool pk", m0("pk", Some(parse(r#"{"a":true}"#)))),
        ("missing authored_schema", m0("authored_schema", None)),
        ("missing client_version", m0("client_version", None)),
        (
            "non-UTC client_version",
            m0(
                "client_version",
                Some(Value::string("2026-07-18T13:59:01+02:00")),
            ),
        ),
        (
            "unknown mutation member",
            m0("depends_on_mutation_id", Some(Value::string("x"))),
        ),
        (
            "duplicate mutation id",
            m1(
                "mutation_id",
                Some(Value::string("018f2b5e-7c42-7a1d-9d31-8a95bd674011")),
            ),
        ),
    ];
    for (what, v) in cases {
        assert_eq!(code(push(&v)), INVALID, "{what}");
    }
    // Duplicate members inside a mutation are rejected by intake itself.
    let text = String::from_utf8(body(&base)).unwrap().replacen(
        "\"op\":\"insert\"",
        "\"op\":\"insert\",\"op\":\"insert\"",
        1,
    );
    assert_eq!(code(PushRequest::parse(text.as_bytes())), INVALID);
}

#[test]
fn push_limits_are_enforced_not_clamped() {
    let base = push_example();
    // 256 columns pass, 257 fail.
    let cols = |n: usize| {
        Value::Object(
            (0..n)
                .map(|i| (format!("f{i:03}"), Value::int(1)))
                .collect(),
        )
    };
    assert!(
        push(&edit(
            base.clone(),
            &["mutations", "0", "columns"],
            Some(cols(256))
        ))
        .is_ok()
    );
    assert_eq!(
        code(push(&edit(
            base.clone(),
            &["mutations", "0", "columns"],
            Some(cols(257))
        ))),
        INVALID
    );
    // A mutation just over 65,536 canonical octets fails.
    let big = |n: usize| parse(&format!(r#"{{"t":"{}"}}"#, "x".repeat(n)));
    assert!(
        push(&edit(
            base.clone(),
            &["mutations", "0", "columns"],
            Some(big(65_000))
        ))
        .is_ok()
    );
    assert_eq!(
        code(push(&edit(
            base.clone(),
            &["mutations", "0", "columns"],
            Some(big(65_536))
        ))),
        INVALID
    );
    // 1000 distinct mutations pass.
    let first = match &base.as_object().unwrap()["mutations"] {
        Value::Array(a) => a[0].clone(),
        _ => unreachable!(),
    };
    let many: Vec<Value> = (0..1000)
        .map(|i| {
            edit(
                first.clone(),
                &["mutation_id"],
                Some(Value::string(format!("018f2b5e-7c42-7a1d-9d31-{i:012}"))),
            )
        })
        .map(|m| edit(m, &["mutation_id"], None))
        .enumerate()
        .map(|(i, m)| {
            edit(
                m,
                &["mutation_id"],
                Some(Value::string(format!(
                    "018f2b5e-7c42-7a1d-9d31-{:012x}",
                    i + 1
                ))),
            )
        })
        .collect();
    assert_eq!(
        push(&edit(
            base.clone(),
            &["mutations"],
            Some(Value::Array(many))
        ))
        .unwrap()
        .mutations
        .len(),
        1000
    );
    // A body over 1 MiB fails before parsing; so does a canonical form over 1 MiB.
    let oversized = vec![b' '; 1_048_577];
    assert_eq!(code(PushRequest::parse(&oversized)), INVALID);
    // Under 1 MiB as sent, over 1 MiB canonical: `1e20` is 4 octets in and 21 out.
    let expanding = Value::Array(vec![parse("1e20"); 60_000]);
    let forty = vec![edit(
        first,
        &["columns"],
        Some(json::object([("f", expanding)])),
    )];
    assert!(
        body(&edit(
            base.clone(),
            &["mutations"],
            Some(Value::Array(forty.clone()))
        ))
        .len()
            < 1_048_576
    );
    let e = push(&edit(base, &["mutations"], Some(Value::Array(forty)))).unwrap_err();
    assert_eq!(Some((e.status(), e.code())), INVALID);
    assert!(e.message().contains("canonical"), "{}", e.message());
}

#[test]
fn atomic_batches_may_not_name_a_row_twice() {
    let base = edit(push_example(), &["atomic"], Some(Value::Bool(true)));
    let same_row = edit(
        base.clone(),
        &["mutations", "1", "pk"],
        Some(parse(r#"{"fld_documents_id":"doc-100"}"#)),
    );
    assert_eq!(code(push(&same_row)), INVALID);
    // The same key in a non-atomic batch is fine.
    let non_atomic = edit(same_row, &["atomic"], None);
    assert!(push(&non_atomic).is_ok());
    // The same key value in another table is another row.
    let other_table = edit(
        base.clone(),
        &["mutations", "1", "pk"],
        Some(parse(r#"{"fld_documents_id":"doc-100"}"#)),
    );
    let other_table = edit(
        other_table,
        &["mutations", "1", "table"],
        Some(Value::string("tbl_other")),
    );
    assert!(push(&other_table).is_ok());
}

fn pull_example() -> Value {
    parse(&format!(
        r#"{{"client_id":"ios-device-123","client_generation":4,"schema":{{"version":8,"hash":"{HASH}"}},
  "scope_set_version":13,"scopes":{{"documents_shared":{{"cursor":"opaque-incremental-cursor-c"}},
  "documents_user:u_123":{{"cursor":null}}}},"limit":500}}"#
    ))
}

#[test]
fn pull_cases() {
    let r = PullRequest::parse(&body(&pull_example())).unwrap();
    assert_eq!(
        (r.limit.get(), r.scopes.len(), r.scope_set_version),
        (500, 2, 13)
    );
    assert!(
        PullRequest::parse(&body(&edit(pull_example(), &["scopes"], Some(parse("{}"))))).is_ok()
    );
    let base = pull_example();
    let cases: Vec<(&str, Value)> = vec![
        (
            "limit 0",
            edit(base.clone(), &["limit"], Some(Value::int(0))),
        ),
        (
            "limit 1001",
            edit(base.clone(), &["limit"], Some(Value::int(1001))),
        ),
        (
            "limit -1",
            edit(base.clone(), &["limit"], Some(Value::int(-1))),
        ),
        (
            "limit 500.0",
            edit(base.clone(), &["limit"], Some(parse("500.0"))),
        ),
        (
            "limit string",
            edit(base.clone(), &["limit"], Some(Value::string("500"))),
        ),
        ("missing limit", edit(base.clone(), &["limit"], None)),
        ("missing scopes", edit(base.clone(), &["scopes"], None)),
        (
            "scope value null",
            edit(
                base.clone(),
                &["scopes", "documents_shared"],
                Some(Value::Null),
            ),
        ),
        (
            "scope cursor missing",
            edit(
                base.clone(),
                &["scopes", "documents_shared"],
                Some(parse("{}")),
            ),
        ),
        (
            "scope extra member",
            edit(
                base.clone(),
                &["scopes", "documents_shared"],
                Some(parse(r#"{"cursor":null,"since":1}"#)),
            ),
        ),
        (
            "missing scope_set_version",
            edit(base.clone(), &["scope_set_version"], None),
        ),
        (
            "negative scope_set_version",
            edit(base.clone(), &["scope_set_version"], Some(Value::int(-1))),
        ),
        (
            "fresh sentinel",
            edit(
                base.clone(),
                &["schema"],
                Some(parse(r#"{"version":0,"hash":""}"#)),
            ),
        ),
        (
            "unknown member",
            edit(base.clone(), &["checkpoint"], Some(Value::int(1))),
        ),
        (
            "zero generation",
            edit(base.clone(), &["client_generation"], Some(Value::int(0))),
        ),
        (
            "empty client_id",
            edit(base, &["client_id"], Some(Value::string(""))),
        ),
    ];
    for (what, v) in cases {
        assert_eq!(code(PullRequest::parse(&body(&v))), INVALID, "{what}");
    }
}

fn rebuild_example() -> Value {
    parse(&format!(
        r#"{{"client_id":"ios-device-123","client_generation":4,"schema":{{"version":8,"hash":"{HASH}"}},
  "scope":"documents_shared","rebuild_id":"018f2b5e-7c42-7a1d-9d31-8a95bd674101","cursor":null,"limit":1000}}"#
    ))
}

#[test]
fn rebuild_cases() {
    let r = RebuildRequest::parse(&body(&rebuild_example())).unwrap();
    assert_eq!(
        (r.cursor.as_deref(), r.limit.get(), r.scope.as_str()),
        (None, 1000, "documents_shared")
    );
    let cont = edit(
        rebuild_example(),
        &["cursor"],
        Some(Value::string("opaque-rebuild-continuation-a")),
    );
    assert_eq!(
        RebuildRequest::parse(&body(&cont))
            .unwrap()
            .cursor
            .as_deref(),
        Some("opaque-rebuild-continuation-a")
    );
    let base = rebuild_example();
    let cases: Vec<(&str, Value)> = vec![
        ("missing cursor", edit(base.clone(), &["cursor"], None)),
        (
            "numeric cursor",
            edit(base.clone(), &["cursor"], Some(Value::int(3))),
        ),
        (
            "limit 0",
            edit(base.clone(), &["limit"], Some(Value::int(0))),
        ),
        (
            "limit 1001",
            edit(base.clone(), &["limit"], Some(Value::int(1001))),
        ),
        (
            "bad rebuild_id",
            edit(
                base.clone(),
                &["rebuild_id"],
                Some(Value::string("not-a-uuid")),
            ),
        ),
        (
            "nil rebuild_id",
            edit(
                base.clone(),
                &["rebuild_id"],
                Some(Value::string("00000000-0000-0000-0000-000000000000")),
            ),
        ),
        ("missing scope", edit(base.clone(), &["scope"], None)),
        (
            "empty scope",
            edit(base.clone(), &["scope"], Some(Value::string(""))),
        ),
        (
            "scope array",
            edit(base.clone(), &["scope"], Some(parse(r#"["a"]"#))),
        ),
        ("unknown member", edit(base, &["page"], Some(Value::int(2)))),
    ];
    for (what, v) in cases {
        assert_eq!(code(RebuildRequest::parse(&body(&v))), INVALID, "{what}");
    }
}
