//! Response shapes: required and forbidden members, exactly as the spec lists them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests and benches fail loudly

use std::collections::BTreeMap;
use std::sync::Arc;

use protocol::digest::Digest;
use protocol::ids::{ScopeId, ServerVersion};
use protocol::json::{self, Value};
use protocol::manifest::Manifest;
use protocol::wire::connect::{AffectedScopes, ConnectResponse, SchemaAction, UnsupportedReason};
use protocol::wire::pull::{Change, ChangeOp, PageEnd, PullResponse};
use protocol::wire::push::{
    ConflictCode, ConflictState, Outcome, OutcomeHead, PartitionError, PushRequest, PushResponse,
    TerminalCode,
};
use protocol::wire::rebuild::{RebuildEnd, RebuildPage, Record};
use protocol::wire::{AssignmentDelta, PageRow, PrimaryKey, RowImage};

fn manifest() -> Arc<Manifest> {
    let text = include_str!("fixtures/connect_schema_definition.json");
    Arc::new(Manifest::from_json(json::parse(text.as_bytes()).unwrap()).unwrap())
}

fn scope(s: &str) -> ScopeId {
    ScopeId::parse(s).unwrap()
}

fn keys(v: &Value) -> Vec<String> {
    v.as_object().unwrap().keys().cloned().collect()
}

fn connect(schema: SchemaAction) -> Value {
    ConnectResponse {
        server_time: "2026-07-18T14:00:00.000000Z".into(),
        client_generation: 4,
        scope_set_version: 13,
        schema,
        scopes: AssignmentDelta {
            add: vec![(scope("documents_shared"), None)],
            remove: vec![scope("project:p_old")],
        },
        scope_cursor_updates: BTreeMap::from([(scope("documents_user:u_123"), None)]),
    }
    .to_json()
}

const ENVELOPE: [&str; 7] = [
    "client_generation",
    "protocol_version",
    "schema",
    "scope_cursor_updates",
    "scope_set_version",
    "scopes",
    "server_time",
];

#[test]
fn connect_actions_have_their_required_and_forbidden_members() {
    let m = manifest();
    let none = connect(SchemaAction::None {
        current: m.reference(),
    });
    assert_eq!(keys(&none), ENVELOPE);
    let replace = connect(SchemaAction::Replace { current: m.clone() });
    let mut with_def = ENVELOPE.to_vec();
    with_def.push("schema_definition");
    with_def.sort();
    assert_eq!(keys(&replace), with_def);
    let affected = AffectedScopes::new(vec![
        scope("documents_user:u_123"),
        scope("documents_shared"),
        scope("documents_shared"),
    ])
    .unwrap();
    let rebuild = connect(SchemaAction::RebuildLocal {
        current: m.clone(),
        affected_scopes: affected,
    });
    let mut with_both = with_def.clone();
    with_both.insert(0, "affected_scopes");
    assert_eq!(keys(&rebuild), with_both);
    assert_eq!(
        json::to_canonical_string(&rebuild.as_object().unwrap()["affected_scopes"]),
        r#"["documents_shared","documents_user:u_123"]"#
    );
    let unsupported = connect(SchemaAction::Unsupported {
        current: m.reference(),
        reason: UnsupportedReason::UnknownSchemaLineage,
    });
    assert_eq!(keys(&unsupported), ENVELOPE);
    let schema = &unsupported.as_object().unwrap()["schema"];
    assert_eq!(keys(schema), ["action", "hash", "reason", "version"]);
    assert_eq!(
        keys(&none.as_object().unwrap()["schema"]),
        ["action", "hash", "version"]
    );
    // rebuild_local with no affected scope cannot be built.
    assert!(AffectedScopes::new(vec![]).is_none());
    // The inline definition is the spec's manifest, hash included.
    let def = &replace.as_object().unwrap()["schema_definition"];
    assert_eq!(Manifest::from_json(def.clone()).unwrap(), *m);
    let text = json::to_canonical_string(&none);
    assert!(text.contains(r#""scopes":{"add":[{"cursor":null,"id":"documents_shared"}],"remove":["project:p_old"]}"#), "{text}");
    assert!(text.contains(r#""scope_cursor_updates":{"documents_user:u_123":null}"#));
    assert!(text.contains(r#""protocol_version":3"#));
}

const H: &str = "21d56a4f2191820e954f008ea32ba8da8568a952cd01a45fd1a3fe16bbe8aaea";

fn request(n: usize, atomic: bool) -> PushRequest {
    let mutations: Vec<String> = (1..=n)
        .map(|i| {
            format!(
                r#"{{"mutation_id":"018f2b5e-7c42-7a1d-9d31-8a95bd67401{i}","table":"tbl_documents","pk":{{"fld_documents_id":"doc-{i}"}},
                "authored_schema":{{"version":8,"hash":"{H}"}},"op":"insert","client_version":"2026-07-18T13:59:01.000000Z","columns":{{}}}}"#
            )
        })
        .collect();
    let atomic = if atomic { r#","atomic":true"# } else { "" };
    let text = format!(
        r#"{{"client_id":"c","client_generation":4,"batch_id":"018f2b5e-7c42-7a1d-9d31-8a95bd674001","schema":{{"version":8,"hash":"{H}"}},"mutations":[{}]{atomic}}}"#,
        mutations.join(",")
    );
    PushRequest::parse(text.as_bytes()).unwrap()
}

fn head(r: &PushRequest, i: usize) -> OutcomeHead {
    let m = &r.mutations[i];
    OutcomeHead {
        mutation_id: m.mutation_id,
        table: m.table.clone(),
        pk: m.pk.clone(),
        outcome_schema: r.schema,
    }
}

fn image() -> RowImage {
    RowImage {
        row: json::parse(br#"{"fld_documents_id":"doc-1"}"#).unwrap(),
        checksum: Digest([7; 32]),
    }
}

fn page_row() -> PageRow {
    let row = json::parse(br#"{"fld_documents_id":"doc-1","fld_title":"a \"b\"\n"}"#).unwrap();
    PageRow {
        row: json::Canonical::of(&row),
        checksum: Digest([7; 32]),
    }
}

/// A body written member by member, parsed: it must be exactly the
/// canonical rendering of what it parses to.
fn written(body: &[u8]) -> Value {
    let v = json::parse(body).unwrap();
    assert_eq!(json::to_canonical(&v), body, "a written body is canonical");
    v
}

fn v(s: &str) -> ServerVersion {
    ServerVersion::parse(s).unwrap()
}

#[test]
fn push_outcomes_have_exact_members() {
    let r = request(6, false);
    let outcomes = vec![
        Outcome::Applied {
            head: head(&r, 0),
            server_version: v("v1"),
            row: Some(image()),
        },
        Outcome::Conflict {
            head: head(&r, 1),
            code: ConflictCode::VersionConflict,
            state: ConflictState::Row {
                image: image(),
                server_version: v("v2"),
            },
        },
        Outcome::Conflict {
            head: head(&r, 2),
            code: ConflictCode::RowDeleted,
            state: ConflictState::FenceOnly {
                server_version: v("v3"),
            },
        },
        Outcome::Conflict {
            head: head(&r, 3),
            code: ConflictCode::RowNotFound,
            state: ConflictState::Absent,
        },
        Outcome::Rejected {
            head: head(&r, 4),
            code: TerminalCode::PolicyRejected,
        },
        Outcome::SchemaIncompatible {
            head: head(&r, 5),
            authored_schema: r.schema,
            current_schema: r.schema,
            incompatible_field_ids: vec!["z".into(), "a".into(), "z".into()],
        },
    ];
    let resp = PushResponse::new(&r, "2026-07-18T14:00:01.000000Z".into(), outcomes).unwrap();
    let body = resp.to_json();
    assert_eq!(
        keys(&body),
        ["accepted", "batch_id", "rejected", "server_time"]
    );
    let arr = |name: &str| match &body.as_object().unwrap()[name] {
        Value::Array(a) => a.clone(),
        _ => panic!(),
    };
    let (accepted, rejected) = (arr("accepted"), arr("rejected"));
    assert_eq!(accepted.len(), 1);
    assert_eq!(rejected.len(), 5);
    let head_members = ["mutation_id", "outcome_schema", "pk", "table"];
    let with = |extra: &[&str]| {
        let mut k: Vec<String> = head_members
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect();
        k.sort();
        k
    };
    assert_eq!(
        keys(&accepted[0]),
        with(&["row_checksum", "server_row", "server_version", "status"])
    );
    assert_eq!(
        keys(&rejected[0]),
        with(&[
            "code",
            "message",
            "row_checksum",
            "server_row",
            "server_version",
            "status"
        ])
    );
    assert_eq!(
        keys(&rejected[1]),
        with(&["code", "message", "server_version", "status"])
    );
    assert_eq!(keys(&rejected[2]), with(&["code", "message", "status"]));
    assert_eq!(keys(&rejected[3]), with(&["code", "message", "status"]));
    assert_eq!(
        keys(&rejected[4]),
        with(&[
            "authored_schema",
            "code",
            "current_schema",
            "incompatible_field_ids",
            "message",
            "retryable",
            "status"
        ])
    );
    assert_eq!(
        json::to_canonical_string(&rejected[4].as_object().unwrap()["incompatible_field_ids"]),
        r#"["a","z"]"#
    );
    // Order within each array follows the request.
    let ids: Vec<_> = rejected
        .iter()
        .map(|o| o.as_object().unwrap()["mutation_id"].clone())
        .collect();
    assert!(
        ids.windows(2)
            .all(|w| json::to_canonical(&w[0]) < json::to_canonical(&w[1]))
    );
    // A fence-only applied delete omits row and checksum.
    let r1 = request(1, false);
    let fence_only = PushResponse::new(
        &r1,
        "t".into(),
        vec![Outcome::Applied {
            head: head(&r1, 0),
            server_version: v("v9"),
            row: None,
        }],
    )
    .unwrap();
    let accepted0 = match &fence_only.to_json().as_object().unwrap()["accepted"] {
        Value::Array(a) => a[0].clone(),
        _ => panic!(),
    };
    assert_eq!(keys(&accepted0), with(&["server_version", "status"]));
}

#[test]
fn push_partition_rules() {
    let r = request(3, false);
    let applied = |i| Outcome::Applied {
        head: head(&r, i),
        server_version: v("v"),
        row: None,
    };
    // One outcome per mutation, in request order.
    assert_eq!(
        PushResponse::new(&r, "t".into(), vec![applied(0), applied(1)]).unwrap_err(),
        PartitionError::NotOneToOne
    );
    assert_eq!(
        PushResponse::new(&r, "t".into(), vec![applied(1), applied(0), applied(2)]).unwrap_err(),
        PartitionError::NotOneToOne
    );
    let atomic_code = Outcome::Rejected {
        head: head(&r, 2),
        code: TerminalCode::AtomicBatchRejected,
    };
    assert_eq!(
        PushResponse::new(&r, "t".into(), vec![applied(0), applied(1), atomic_code]).unwrap_err(),
        PartitionError::AtomicCodeOutsideAtomicBatch
    );
    // Atomic: all applied, or none applied with exactly one real failure.
    let a = request(3, true);
    let aapplied = |i| Outcome::Applied {
        head: head(&a, i),
        server_version: v("v"),
        row: None,
    };
    let arejected = |i| Outcome::Rejected {
        head: head(&a, i),
        code: TerminalCode::AtomicBatchRejected,
    };
    let failing = Outcome::Rejected {
        head: head(&a, 2),
        code: TerminalCode::ValidationFailed,
    };
    assert!(PushResponse::new(&a, "t".into(), vec![aapplied(0), aapplied(1), aapplied(2)]).is_ok());
    let ok = PushResponse::new(
        &a,
        "t".into(),
        vec![arejected(0), arejected(1), failing.clone()],
    )
    .unwrap();
    let body = json::to_canonical_string(&ok.to_json());
    assert!(body.contains(r#""accepted":[]"#));
    assert!(body.contains(r#""code":"atomic_batch_rejected","message":"atomic batch rejected""#));
    assert_eq!(
        PushResponse::new(
            &a,
            "t".into(),
            vec![aapplied(0), arejected(1), failing.clone()]
        )
        .unwrap_err(),
        PartitionError::NotAnAtomicForm
    );
    let second_failure = Outcome::Rejected {
        head: head(&a, 1),
        code: TerminalCode::PolicyRejected,
    };
    assert_eq!(
        PushResponse::new(&a, "t".into(), vec![arejected(0), second_failure, failing]).unwrap_err(),
        PartitionError::NotAnAtomicForm
    );
}

fn pk() -> PrimaryKey {
    PrimaryKey {
        field_id: "fld_documents_id".into(),
        value: Value::string("doc-1"),
    }
}

#[test]
fn pull_pages() {
    let changes = vec![
        Change {
            scope: scope("s1"),
            table: "t".into(),
            pk: pk(),
            op: ChangeOp::Upsert(page_row()),
            server_version: v("v1"),
        },
        Change {
            scope: scope("s1"),
            table: "t".into(),
            pk: pk(),
            op: ChangeOp::Delete(None),
            server_version: v("v2"),
        },
        Change {
            scope: scope("s2"),
            table: "t".into(),
            pk: pk(),
            op: ChangeOp::Delete(Some(page_row())),
            server_version: v("v3"),
        },
    ];
    let more = written(
        &PullResponse {
            changes: changes.clone(),
            scope_set_version: 14,
            scope_cursors: BTreeMap::from([(scope("s1"), "ic1.x.y".to_owned())]),
            scope_updates: AssignmentDelta::default(),
            rebuild: vec![],
            end: PageEnd::More,
        }
        .to_body(),
    );
    assert_eq!(
        keys(&more),
        [
            "changes",
            "has_more",
            "rebuild",
            "scope_cursors",
            "scope_set_version",
            "scope_updates"
        ]
    );
    let text = json::to_canonical_string(&more);
    assert!(text.contains(r#""has_more":true"#));
    assert!(text.contains(r#""scope_updates":{"add":[],"remove":[]}"#));
    let Value::Array(c) = &more.as_object().unwrap()["changes"] else {
        panic!()
    };
    assert_eq!(
        keys(&c[0]),
        [
            "op",
            "pk",
            "row",
            "row_checksum",
            "scope",
            "server_version",
            "table"
        ]
    );
    assert_eq!(
        keys(&c[1]),
        ["op", "pk", "scope", "server_version", "table"]
    );
    assert_eq!(
        keys(&c[2]),
        [
            "op",
            "pk",
            "row",
            "row_checksum",
            "scope",
            "server_version",
            "table"
        ]
    );
    let terminal = written(
        &PullResponse {
            changes: vec![],
            scope_set_version: 14,
            scope_cursors: BTreeMap::new(),
            scope_updates: AssignmentDelta::default(),
            rebuild: vec![scope("s2")],
            end: PageEnd::Terminal {
                checksums: BTreeMap::from([
                    (scope("s1"), Digest([1; 32])),
                    (scope("s2"), Digest([2; 32])),
                ]),
            },
        }
        .to_body(),
    );
    assert_eq!(
        keys(&terminal),
        [
            "changes",
            "checksums",
            "has_more",
            "rebuild",
            "scope_cursors",
            "scope_set_version",
            "scope_updates"
        ]
    );
    assert!(json::to_canonical_string(&terminal).contains(r#""has_more":false"#));
}

#[test]
fn rebuild_pages() {
    let record = Record {
        table: "t".into(),
        pk: pk(),
        image: page_row(),
        server_version: v("v"),
    };
    let page = |end| {
        written(
            &RebuildPage {
                scope: scope("documents_shared"),
                records: vec![record.clone()],
                end,
            }
            .to_body(),
        )
    };
    let mid = page(RebuildEnd::More {
        cursor: "rc1.a.b".into(),
    });
    assert_eq!(keys(&mid), ["cursor", "has_more", "records", "scope"]);
    let last = page(RebuildEnd::Final {
        final_scope_cursor: "ic1.a.b".into(),
        checksum: Digest([5; 32]),
    });
    assert_eq!(
        keys(&last),
        [
            "checksum",
            "cursor",
            "final_scope_cursor",
            "has_more",
            "records",
            "scope"
        ]
    );
    let text = json::to_canonical_string(&last);
    assert!(text.contains(r#""cursor":null"#) && text.contains(r#""has_more":false"#));
    let Value::Array(records) = &mid.as_object().unwrap()["records"] else {
        panic!()
    };
    assert_eq!(
        keys(&records[0]),
        ["pk", "row", "row_checksum", "server_version", "table"]
    );
}

#[test]
fn written_checksums_and_rows_are_canonical() {
    for d in [Digest([0; 32]), Digest([0xab; 32])] {
        let mut text = String::new();
        d.write_checksum(&mut text);
        assert_eq!(text.as_bytes(), json::to_canonical(&d.checksum_json()));
    }
    let row = json::parse(br#"{"b":1.50,"a":[true,null,"\u00e9"]}"#).unwrap();
    let c = json::Canonical::of(&row);
    assert_eq!(c.as_str(), r#"{"a":[true,null,"é"],"b":1.5}"#);
    assert_eq!(c.to_value().unwrap(), row);
    assert_eq!(json::Canonical::stored(c.as_str().to_owned()), Some(c));
}

/// Damaged stored text is never spliced, in every build: a cut value, a
/// truncation, trailing bytes, or a JSON value that is not an object.
#[test]
fn damaged_stored_text_is_refused() {
    for damaged in [
        r#"{"id":,"title":"a"}"#,
        r#"{"id":"a","title":"#,
        r#"{"id":"a"}}"#,
        r#"{"id":"a"} {"#,
        r#"["id"]"#,
        r#""id""#,
        "",
    ] {
        assert_eq!(
            json::Canonical::stored(damaged.to_owned()),
            None,
            "{damaged}"
        );
    }
}

#[test]
#[should_panic(expected = "canonical order")]
fn an_object_writer_refuses_members_out_of_order() {
    let mut out = String::new();
    let mut o = json::ObjectWriter::new(&mut out);
    o.value("b", &Value::Null);
    o.value("a", &Value::Null);
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "stored text is canonical JSON")]
fn stored_text_must_be_canonical() {
    let _ = json::Canonical::stored(r#"{"b":1,"a":2}"#.to_owned());
}
