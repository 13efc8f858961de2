//! The push suite on the in-memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::testkit::{MemWorld, push_suite};

#[tokio::test]
async fn every_push_outcome_on_memstore() {
    push_suite(&MemWorld {
        store: actors::testkit::example_mem_store(0).await,
    })
    .await;
}

#[tokio::test]
async fn push_primitives_conformance() {
    actors::testkit::push_store_suite(&actors::testkit::example_mem_store(0).await).await;
}

/// Arbitrary batches (known and unknown tables, fields, keys, schemas,
/// values, operations and bases) never make the engine panic or answer
/// outside the spec: a 200 partitions the batch exactly, and nothing else
/// but a 400 is possible here.
#[tokio::test]
async fn arbitrary_batches_get_a_spec_answer() {
    use actors::Engine;
    use actors::testkit::{PushClient, mutation, push_config};
    use proptest::prelude::*;
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, TestRunner};
    use protocol::json::{self, Value};

    let engine = Engine::start(actors::testkit::example_mem_store(0).await, push_config())
        .await
        .unwrap();
    let c = PushClient::connect(&engine, "u1", "c1").await;
    let value = prop_oneof![
        Just(Value::Null),
        Just(Value::Bool(true)),
        Just(Value::int(7)),
        "[a-z]{0,6}".prop_map(Value::string),
        Just(json::parse(b"1.5").unwrap()),
        Just(json::parse(br#"{"x":1}"#).unwrap()),
    ];
    let field = prop_oneof![
        Just("fld_notes_title"),
        Just("fld_notes_pinned"),
        Just("fld_notes_body"),
        Just("fld_notes_owner"),
        Just("fld_notes_updated_at"),
        Just("fld_templates_name"),
        Just("fld_nope"),
    ];
    let one = (
        prop_oneof![Just("tbl_notes"), Just("tbl_templates"), Just("tbl_nope")],
        prop_oneof![
            Just("fld_notes_id"),
            Just("fld_templates_id"),
            Just("fld_x")
        ],
        prop_oneof![
            Just("30000000-0000-4000-8000-000000000001"),
            Just("tpl-1"),
            Just("not-a-uuid")
        ],
        any::<bool>(),
        prop_oneof![Just("insert"), Just("update"), Just("delete")],
        prop_oneof![Just(None), Just(Some("stale"))],
        proptest::collection::btree_map(field, value, 0..4),
    );
    let mut runner = TestRunner::new(Config {
        cases: 64,
        ..Config::default()
    });
    let batches = proptest::collection::vec(one, 1..6);
    let mut n = 0u64;
    let mut answered = 0;
    for _ in 0..64 {
        let tree = batches.new_tree(&mut runner).unwrap();
        let spec = tree.current();
        n += 1;
        let mutations: Vec<Value> = spec
            .iter()
            .enumerate()
            .map(|(i, (table, pk_field, key, current, op, base, cols))| {
                let schema = if *current {
                    c.schema.clone()
                } else {
                    json::object([
                        ("version", Value::int(9)),
                        ("hash", Value::string("ab".repeat(32))),
                    ])
                };
                let columns = (*op != "delete").then(|| {
                    Value::Object(
                        cols.iter()
                            .map(|(k, v)| ((*k).to_owned(), v.clone()))
                            .collect(),
                    )
                });
                let base = if *op == "insert" {
                    None
                } else {
                    Some(base.unwrap_or("v"))
                };
                mutation(
                    n * 100 + i as u64,
                    table,
                    (pk_field, key),
                    &schema,
                    op,
                    base,
                    columns,
                )
            })
            .collect();
        let count = mutations.len();
        let (status, r, _) = c.push(&c.batch(n, mutations, false)).await;
        match status {
            200 => {
                let o = r.as_object().unwrap();
                let total = ["accepted", "rejected"]
                    .iter()
                    .map(|a| match &o[*a] {
                        Value::Array(x) => x.len(),
                        _ => panic!("no {a}"),
                    })
                    .sum::<usize>();
                assert_eq!(total, count, "{r:?}");
                answered += 1;
            }
            // An empty update, or a shape the parser refuses.
            400 => {}
            other => panic!("status {other}: {r:?}"),
        }
    }
    // Most batches are well formed: the engine, not the parser, answered them.
    assert!(
        answered >= 32,
        "only {answered} of 64 batches were executed"
    );
}
