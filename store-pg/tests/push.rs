//! Push on a throwaway cluster: the push suite (as on MemStore), and what
//! only PostgreSQL has: row security, deferrable constraints checked at the
//! end of each push unit, triggers, and real concurrency.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeSet;

use actors::Engine;
use actors::testkit::{
    PushClient, note_columns, note_id, note_mutation, outcome, push_config, push_suite, version_of,
};
use protocol::json::{self, Value};
use store_pg::cluster::PgCluster;
use store_pg::{PgStore, PgWorld, example_store};

fn code(o: &Value) -> Option<String> {
    o.as_object()
        .unwrap()
        .get("code")
        .map(|c| c.as_str().unwrap().to_owned())
}

async fn sql(store: &PgStore, text: &str) {
    sqlx::raw_sql(text).execute(store.pool()).await.unwrap();
}

async fn engine(store: &PgStore) -> Engine {
    Engine::start(store.clone(), push_config()).await.unwrap()
}

#[tokio::test]
async fn every_push_outcome_on_postgres() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let cluster = PgCluster::temp().unwrap();
    let world = PgWorld {
        store: example_store(&cluster, "push").await,
    };
    push_suite(&world).await;
    // Capture satisfies every fence the pushes left.
    let mut pending: i64 = -1;
    for _ in 0..2000 {
        pending = sqlx::query_scalar("SELECT count(*) FROM synchro.pending_fences")
            .fetch_one(world.store.pool())
            .await
            .unwrap();
        if pending == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(pending, 0);
}

/// A push write leaves a fence pending for its client, in its transaction.
#[tokio::test]
async fn push_writes_leave_fences() {
    use actors::ledger::contract::{RowWrite, WriteResult, Writer};
    use actors::store::{Store, StoreTx};
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "fences").await;
    let config = push_config();
    let target = actors::ledger::write_targets(&config).remove(0);
    store
        .install_push(std::slice::from_ref(&target))
        .await
        .unwrap();
    store
        .install_capture(&actors::capture::CapturePlan::new(&config))
        .await
        .unwrap();
    let mut tx = store.begin().await.unwrap();
    tx.begin_writes(&Writer {
        user_id: "u1".into(),
        client_id: "c-fence".into(),
        check_each_write: true,
    })
    .await
    .unwrap();
    let insert = RowWrite::Insert {
        values: vec![
            ("owner_id".into(), Some("u1".into())),
            ("title".into(), Some("t".into())),
        ],
    };
    let key = note_id(1);
    let WriteResult::Written { version, .. } = tx.write_row(&target, &key, &insert).await.unwrap()
    else {
        panic!("not written");
    };
    tx.end_writes().await.unwrap();
    tx.commit().await.unwrap();
    let (fence_client, stored): (String, String) = sqlx::query_as(
        "SELECT p.client_id, v.version FROM synchro.pending_fences p \
         JOIN synchro.row_versions v ON v.fence = p.fence WHERE v.key = $1",
    )
    .bind(&key)
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!((fence_client.as_str(), stored), ("c-fence", version));
    // A write outside push (no writer) leaves none.
    sqlx::raw_sql(&format!(
        "UPDATE public.notes SET title = 'direct' WHERE id = '{key}'"
    ))
    .execute(store.pool())
    .await
    .unwrap();
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM synchro.pending_fences")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(pending, 1);
}

/// The push primitives, as on MemStore.
#[tokio::test]
async fn push_primitives_conformance() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "primitives").await;
    actors::testkit::push_store_suite(&store).await;
    // The suite's outcome that its batch's answer holds is stored once
    // (migration 0025); the one it does not hold is a copy.
    let kept: Vec<(bool, Option<i32>)> = sqlx::query_as(
        "SELECT outcome IS NULL, outcome_at FROM synchro.push_mutations \
         WHERE batch_id = $1::uuid ORDER BY mutation_id",
    )
    .bind(actors::testkit::batch_id(3))
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert_eq!(kept, [(true, Some(13)), (false, None)]);
}

/// Row security of the application table is the write policy.
#[tokio::test]
async fn row_security_denials() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "rls").await;
    // Users see and write only their own notes; a pinned note cannot be written.
    sql(
        &store,
        "ALTER TABLE public.notes ALTER owner_id SET DEFAULT current_setting('synchro.user_id', true);
         ALTER TABLE public.notes ENABLE ROW LEVEL SECURITY;
         CREATE POLICY own ON public.notes
           USING (owner_id = current_setting('synchro.user_id', true))
           WITH CHECK (owner_id = current_setting('synchro.user_id', true) AND NOT pinned);",
    )
    .await;
    // Without the declarative rule, row security alone decides.
    let mut config = push_config();
    config.tables[0].owner_column = None;
    let engine = Engine::start(store.clone(), config).await.unwrap();
    let c = PushClient::connect(&engine, "u1", "c1").await;
    let s = &c.schema;
    let theirs = note_id(1);
    sql(
        &store,
        &format!(
            "INSERT INTO public.notes (id, owner_id, title) VALUES ('{theirs}', 'u2', 'hidden')"
        ),
    )
    .await;
    let pinned = json::object([
        ("fld_notes_title", Value::string("p")),
        ("fld_notes_pinned", Value::Bool(true)),
    ]);
    let mine = |n: u64| note_id(10 + n);
    let mutations = vec![
        // A live row that row security hides: never "absent", for every operation.
        note_mutation(1, &theirs, s, "insert", None, Some(note_columns("x"))),
        note_mutation(2, &theirs, s, "update", Some("v"), Some(note_columns("x"))),
        note_mutation(3, &theirs, s, "delete", Some("v"), None),
        // A new row failing WITH CHECK.
        note_mutation(4, &mine(4), s, "insert", None, Some(pinned.clone())),
        // An insert the policy allows (the owner is the server's, the user).
        note_mutation(5, &mine(5), s, "insert", None, Some(note_columns("ok"))),
    ];
    let (st, r, _) = c.push(&c.batch(1, mutations, false)).await;
    assert_eq!(st, 200, "{r:?}");
    for n in 1..=4 {
        let (accepted, o) = outcome(&r, n);
        assert!(!accepted);
        assert_eq!(
            code(&o).as_deref(),
            Some("policy_rejected"),
            "mutation {n}: {o:?}"
        );
        assert!(!o.as_object().unwrap().contains_key("server_version"));
    }
    let (accepted, o) = outcome(&r, 5);
    assert!(accepted, "{o:?}");
    let v = version_of(&o);
    // An update whose new row fails WITH CHECK; the row is unchanged after it.
    let (_, r, _) = c
        .push(&c.batch(
            2,
            vec![note_mutation(
                6,
                &mine(5),
                s,
                "update",
                Some(&v),
                Some(pinned),
            )],
            false,
        ))
        .await;
    assert_eq!(code(&outcome(&r, 6).1).as_deref(), Some("policy_rejected"));
    // A BEFORE trigger that keeps the row (returns NULL): zero rows changed.
    sql(
        &store,
        "CREATE FUNCTION public.keep_archived() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.title = 'archived' THEN
             INSERT INTO public.templates VALUES ('side-effect', 'n', 'b');
             RETURN NULL;
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER keep_archived BEFORE INSERT OR UPDATE ON public.notes
           FOR EACH ROW EXECUTE FUNCTION public.keep_archived();",
    )
    .await;
    let (_, r, _) = c
        .push(&c.batch(
            3,
            vec![
                note_mutation(
                    7,
                    &mine(5),
                    s,
                    "update",
                    Some(&v),
                    Some(note_columns("archived")),
                ),
                note_mutation(
                    8,
                    &mine(8),
                    s,
                    "insert",
                    None,
                    Some(note_columns("archived")),
                ),
            ],
            false,
        ))
        .await;
    assert_eq!(code(&outcome(&r, 7).1).as_deref(), Some("policy_rejected"));
    assert_eq!(code(&outcome(&r, 8).1).as_deref(), Some("policy_rejected"));
    // The trigger's own writes were rolled back with the zero-row write.
    let side: i64 = sqlx::query_scalar("SELECT count(*) FROM public.templates")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(side, 0);
    // The row and its version are untouched: the original version still applies.
    let (_, r, _) = c
        .push(&c.batch(
            4,
            vec![note_mutation(
                9,
                &mine(5),
                s,
                "update",
                Some(&v),
                Some(note_columns("fine")),
            )],
            false,
        ))
        .await;
    assert!(outcome(&r, 9).0);
}

/// Deferrable constraints are checked at the end of each push unit; an
/// atomic batch failing on its third mutation rolls everything back.
#[tokio::test]
async fn deferred_constraints_and_atomic_rollback() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "deferred").await;
    // A title must be unique, checked at the end of the unit.
    sql(
        &store,
        "ALTER TABLE public.notes ADD CONSTRAINT unique_title UNIQUE (title) DEFERRABLE INITIALLY DEFERRED;",
    )
    .await;
    let engine = engine(&store).await;
    let c = PushClient::connect(&engine, "u1", "c1").await;
    let s = &c.schema;
    let (a, b, d) = (note_id(1), note_id(2), note_id(3));
    // Non-atomic: each mutation is its own unit. The second duplicates the first's title.
    let (_, r, _) = c
        .push(&c.batch(
            1,
            vec![
                note_mutation(1, &a, s, "insert", None, Some(note_columns("same"))),
                note_mutation(2, &b, s, "insert", None, Some(note_columns("same"))),
                note_mutation(3, &d, s, "insert", None, Some(note_columns("other"))),
            ],
            false,
        ))
        .await;
    assert!(outcome(&r, 1).0);
    assert_eq!(
        code(&outcome(&r, 2).1).as_deref(),
        Some("validation_failed")
    );
    assert!(outcome(&r, 3).0);
    let va = version_of(&outcome(&r, 1).1);
    let vd = version_of(&outcome(&r, 3).1);
    // Atomic: inside the group the titles may clash temporarily (a swap); the
    // check runs at the group's end.
    let swap = vec![
        note_mutation(4, &a, s, "update", Some(&va), Some(note_columns("other"))),
        note_mutation(5, &d, s, "update", Some(&vd), Some(note_columns("same"))),
    ];
    let (_, r, _) = c.push(&c.batch(2, swap, true)).await;
    assert!(outcome(&r, 4).0 && outcome(&r, 5).0, "{r:?}");
    let va = version_of(&outcome(&r, 4).1);
    let vd = version_of(&outcome(&r, 5).1);
    // Atomic, failing at the group's end: the last mutation owns the failure.
    let clash = vec![
        note_mutation(6, &a, s, "update", Some(&va), Some(note_columns("x"))),
        note_mutation(7, &b, s, "insert", None, Some(note_columns("y"))),
        note_mutation(8, &d, s, "update", Some(&vd), Some(note_columns("x"))),
    ];
    let (_, r, _) = c.push(&c.batch(3, clash, true)).await;
    let accepted = r.as_object().unwrap()["accepted"].clone();
    assert_eq!(accepted, Value::Array(vec![]));
    assert_eq!(
        code(&outcome(&r, 6).1).as_deref(),
        Some("atomic_batch_rejected")
    );
    assert_eq!(
        code(&outcome(&r, 7).1).as_deref(),
        Some("atomic_batch_rejected")
    );
    assert_eq!(
        code(&outcome(&r, 8).1).as_deref(),
        Some("validation_failed")
    );
    // Nothing of the group is left: no b, and a keeps its title and version.
    let titles: Vec<String> = sqlx::query_scalar("SELECT title FROM public.notes ORDER BY title")
        .fetch_all(store.pool())
        .await
        .unwrap();
    assert_eq!(titles, ["other", "same"]);
    // Atomic, failing on its third mutation by a conflict: the first two are undone.
    let third = vec![
        note_mutation(9, &a, s, "update", Some(&va), Some(note_columns("p"))),
        note_mutation(10, &b, s, "insert", None, Some(note_columns("q"))),
        note_mutation(11, &d, s, "update", Some("stale"), Some(note_columns("r"))),
    ];
    let (_, r, _) = c.push(&c.batch(4, third, true)).await;
    let (_, o) = outcome(&r, 11);
    assert_eq!(code(&o).as_deref(), Some("version_conflict"));
    assert_eq!(version_of(&o), vd, "the committed state after the rollback");
    let o = o.as_object().unwrap();
    assert_eq!(
        o["server_row"].as_object().unwrap()["fld_notes_title"].as_str(),
        Some("same")
    );
    let count: i64 =
        sqlx::query_scalar("SELECT count(*) FROM public.notes WHERE title IN ('p', 'q')")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(count, 0);
}

/// One batch from 8 tasks at once executes once; two clients racing on one
/// base version: exactly one wins.
#[tokio::test]
async fn concurrent_pushes() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "concurrent").await;
    let engine = engine(&store).await;
    let c = PushClient::connect(&engine, "u1", "c1").await;
    let s = c.schema.clone();
    let batch = c.batch(
        1,
        (0..20)
            .map(|i| note_mutation(i, &note_id(i), &s, "insert", None, Some(note_columns("n"))))
            .collect(),
        false,
    );
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (c, batch) = (c.clone(), batch.clone());
            tokio::spawn(async move { c.push(&batch).await })
        })
        .collect();
    let mut bodies = BTreeSet::new();
    for t in tasks {
        let (st, _, bytes) = t.await.unwrap();
        assert_eq!(st, 200);
        bodies.insert(bytes);
    }
    assert_eq!(
        bodies.len(),
        1,
        "every caller got the one execution's bytes"
    );
    let executions: i64 = sqlx::query_scalar("SELECT count(*) FROM synchro.push_batches")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(executions, 1);
    let epoch: i64 = sqlx::query_scalar(
        "SELECT accepted_write_epoch FROM synchro.clients WHERE client_id = 'c1'",
    )
    .fetch_one(store.pool())
    .await
    .unwrap();
    assert_eq!(epoch, 1);

    // Two clients of one user update one row from the same base version.
    let r = json::parse(&bodies.into_iter().next().unwrap()).unwrap();
    let v = version_of(&outcome(&r, 0).1);
    let d = PushClient::connect(&engine, "u1", "c2").await;
    let mut rounds = Vec::new();
    for (i, client) in [c.clone(), d.clone()].into_iter().enumerate() {
        let body = client.batch(
            10 + i as u64,
            vec![note_mutation(
                100 + i as u64,
                &note_id(0),
                &s,
                "update",
                Some(&v),
                Some(note_columns(&format!("w{i}"))),
            )],
            false,
        );
        rounds.push(tokio::spawn(async move { client.push(&body).await }));
    }
    let mut winners = 0;
    let mut conflicts = 0;
    for (i, t) in rounds.into_iter().enumerate() {
        let (st, r, _) = t.await.unwrap();
        assert_eq!(st, 200);
        let (accepted, o) = outcome(&r, 100 + i as u64);
        if accepted {
            winners += 1;
        } else {
            assert_eq!(code(&o).as_deref(), Some("version_conflict"));
            conflicts += 1;
        }
    }
    assert_eq!((winners, conflicts), (1, 1));
}

/// Values are cast to the column's type without its modifier, then assigned:
/// a value too long for `varchar(5)` fails instead of being cut, and one
/// that `char(4)` would pad fails instead of being padded.
#[tokio::test]
async fn values_are_checked_never_truncated() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "modifiers").await;
    sql(
        &store,
        "ALTER TABLE public.notes ALTER title TYPE varchar(5), ALTER body TYPE char(4);",
    )
    .await;
    let engine = engine(&store).await;
    let c = PushClient::connect(&engine, "u1", "c1").await;
    let s = &c.schema;
    let with_body = |title: &str, body: &str| {
        json::object([
            ("fld_notes_title", Value::string(title)),
            ("fld_notes_body", Value::string(body)),
            ("fld_notes_pinned", Value::Bool(false)),
        ])
    };
    let (_, r, _) = c
        .push(&c.batch(
            1,
            vec![
                note_mutation(
                    1,
                    &note_id(1),
                    s,
                    "insert",
                    None,
                    Some(with_body("abcdefg", "xy")),
                ),
                note_mutation(
                    2,
                    &note_id(2),
                    s,
                    "insert",
                    None,
                    Some(with_body("abc", "xyzzy")),
                ),
                note_mutation(
                    3,
                    &note_id(3),
                    s,
                    "insert",
                    None,
                    Some(with_body("abc", "wxyz")),
                ),
                note_mutation(
                    4,
                    &note_id(4),
                    s,
                    "insert",
                    None,
                    Some(with_body("abc", "xy")),
                ),
            ],
            false,
        ))
        .await;
    assert_eq!(
        code(&outcome(&r, 1).1).as_deref(),
        Some("validation_failed")
    );
    assert_eq!(
        code(&outcome(&r, 2).1).as_deref(),
        Some("validation_failed")
    );
    let (accepted, o) = outcome(&r, 3);
    assert!(accepted);
    let row = o.as_object().unwrap()["server_row"]
        .as_object()
        .unwrap()
        .clone();
    assert_eq!(row["fld_notes_title"].as_str(), Some("abc"));
    assert_eq!(row["fld_notes_body"].as_str(), Some("wxyz"));
    // char(4) would pad a shorter value: a silent rewrite, so it is refused.
    assert_eq!(
        code(&outcome(&r, 4).1).as_deref(),
        Some("validation_failed")
    );
}

/// A server role without CREATEROLE can push once an operator has created
/// `synchro_writer`, made the server's role a member, and granted it the tables.
#[tokio::test]
async fn an_operator_created_writer_role_needs_no_createrole() {
    use actors::store::Store;
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "operator").await;
    let config = push_config();
    let targets = actors::ledger::write_targets(&config);
    // The operator's part, as a superuser.
    sql(
        &store,
        "CREATE ROLE synchro_writer NOLOGIN NOBYPASSRLS NOINHERIT;
         CREATE ROLE limited LOGIN REPLICATION;
         GRANT synchro_writer TO limited;
         GRANT USAGE ON SCHEMA synchro TO synchro_writer, limited;
         GRANT SELECT ON synchro.row_versions TO synchro_writer;
         GRANT SELECT, INSERT, UPDATE, DELETE ON public.notes, public.templates TO synchro_writer;
         GRANT CREATE ON SCHEMA public TO limited;
         GRANT SELECT, INSERT ON public._sqlx_migrations TO limited;",
    )
    .await;
    let limited = PgStore::connect(cluster.connect_options("operator").username("limited"))
        .await
        .unwrap();
    store_pg::catalog::check_server(limited.pool())
        .await
        .unwrap_or_else(|p| {
            // CREATE on the database is not granted here; the writer role is fine.
            assert!(!p.iter().any(|m| m.contains("synchro_writer")), "{p:?}");
        });
    limited.install_push(&targets).await.unwrap();
    // Without the operator's role, the same server role cannot start push.
    sql(
        &store,
        "DROP OWNED BY synchro_writer; DROP ROLE synchro_writer;",
    )
    .await;
    let err = limited.install_push(&targets).await.unwrap_err();
    assert!(err.to_string().contains("CREATEROLE"), "{err}");
}
