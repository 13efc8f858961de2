//! PgStore on a throwaway cluster: the store-conformance suite, migrations,
//! and config validation against the live catalog.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::config::SyncConfig;
use actors::testkit::{EXAMPLE_CONFIG, example_config, store_suite};
use store_pg::cluster::PgCluster;
use store_pg::{PgStore, catalog, example_store};

#[tokio::test]
async fn pgstore() {
    let cluster = PgCluster::temp().unwrap();

    // The conformance suite, on the same operations as MemStore.
    let store = example_store(&cluster, "conformance").await;
    store_suite(&store).await;

    // The cluster runs with logical decoding available, with room for a
    // capture (slot and walsender) per test database.
    catalog::check_server(store.pool()).await.unwrap();
    for (setting, want) in [("max_wal_senders", "64"), ("max_replication_slots", "64")] {
        let got: String = sqlx::query_scalar(&format!("SHOW {setting}"))
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(got, want, "{setting}");
    }
    // A role without privileges is told exactly what it lacks.
    sqlx::raw_sql("CREATE ROLE weak LOGIN")
        .execute(store.pool())
        .await
        .unwrap();
    let weak = sqlx::postgres::PgPoolOptions::new()
        .connect_with(cluster.connect_options("conformance").username("weak"))
        .await
        .unwrap();
    let problems = catalog::check_server(&weak).await.unwrap_err();
    assert_eq!(
        problems,
        [
            "the role lacks CREATE on the database (needed for schema synchro)",
            "the role lacks the REPLICATION attribute (needed for logical decoding)",
            "the role lacks CREATEROLE and is not a member of synchro_writer (needed for push)",
        ]
    );

    // Migrations are idempotent: connecting again applies nothing new.
    let again = PgStore::connect(cluster.connect_options("conformance"))
        .await
        .unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(again.pool())
        .await
        .unwrap();
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .count();
    assert_eq!(n as usize, files);

    catalog_validation(&cluster).await;
}

async fn problems(store: &PgStore, config: &SyncConfig) -> Vec<String> {
    catalog::validate(store.pool(), config)
        .await
        .err()
        .unwrap_or_default()
}

/// Asserts exactly one problem containing `expected` for the example config edited by `edit`.
async fn rejects(store: &PgStore, edit: impl Fn(String) -> String, expected: &str) {
    let config = SyncConfig::from_toml(&edit(EXAMPLE_CONFIG.to_owned())).unwrap();
    let p = problems(store, &config).await;
    assert!(
        p.len() == 1 && p[0].contains(expected),
        "expected one problem with `{expected}`, got {p:?}"
    );
}

async fn catalog_validation(cluster: &PgCluster) {
    let store = example_store(cluster, "catalog").await;
    assert_eq!(
        problems(&store, &example_config(|s| s)).await,
        Vec::<String>::new()
    );
    let exec = |sql: &'static str| {
        let pool = store.pool().clone();
        async move { sqlx::raw_sql(sql).execute(&pool).await.unwrap() }
    };
    let retarget = |table: &'static str| {
        move |s: String| {
            s.replace(
                "relation = \"public.templates\"",
                &format!("relation = \"public.{table}\""),
            )
        }
    };

    rejects(
        &store,
        |s| s.replace("public.notes\"\nname", "public.missing\"\nname"),
        "table tbl_notes: relation public.missing does not exist",
    )
    .await;

    exec("CREATE TABLE public.t_composite (id text, name text NOT NULL, body text NOT NULL, PRIMARY KEY (id, name))").await;
    rejects(
        &store,
        retarget("t_composite"),
        "table tbl_templates: the primary key must be one column, not id, name",
    )
    .await;

    exec("CREATE TABLE public.t_nokey (id text NOT NULL, name text NOT NULL, body text NOT NULL)")
        .await;
    rejects(
        &store,
        retarget("t_nokey"),
        "table tbl_templates: relation public.t_nokey has no primary key",
    )
    .await;

    exec("CREATE TABLE public.t_deferrable (id text, name text NOT NULL, body text NOT NULL, PRIMARY KEY (id) DEFERRABLE)").await;
    rejects(
        &store,
        retarget("t_deferrable"),
        "table tbl_templates: the primary key must not be deferrable",
    )
    .await;

    exec("CREATE TABLE public.t_floatkey (id float8 PRIMARY KEY, name text NOT NULL, body text NOT NULL)").await;
    let p = problems(&store, &example_config(retarget("t_floatkey"))).await;
    assert!(p.iter().any(|p| p.contains("table tbl_templates, column id: the column syncs as float, but the config declares string")), "{p:?}");
    assert!(p.iter().any(|p| p.contains("table tbl_templates, column id: a primary key must be smallint, integer, bigint, text, varchar or uuid")), "{p:?}");

    exec("CREATE TABLE public.t_full (id text PRIMARY KEY, name text NOT NULL, body text NOT NULL); ALTER TABLE public.t_full REPLICA IDENTITY FULL").await;
    rejects(
        &store,
        retarget("t_full"),
        "table tbl_templates: relation public.t_full must have REPLICA IDENTITY DEFAULT",
    )
    .await;

    exec("CREATE TABLE public.t_nocol (id text PRIMARY KEY, name text NOT NULL)").await;
    rejects(
        &store,
        retarget("t_nocol"),
        "table tbl_templates, column body: no such column in public.t_nocol",
    )
    .await;

    exec("CREATE TABLE public.t_int (id text PRIMARY KEY, name text NOT NULL, body integer NOT NULL)").await;
    rejects(
        &store,
        retarget("t_int"),
        "table tbl_templates, column body: the column syncs as int, but the config declares string",
    )
    .await;

    exec("CREATE TABLE public.t_nullable (id text PRIMARY KEY, name text NOT NULL, body text)")
        .await;
    rejects(
        &store,
        retarget("t_nullable"),
        "table tbl_templates, column body: declared not nullable, but the column allows NULL",
    )
    .await;

    exec("CREATE TABLE public.t_numeric (id text PRIMARY KEY, name text NOT NULL, body numeric NOT NULL)").await;
    rejects(
        &store,
        retarget("t_numeric"),
        "table tbl_templates, column body: is numeric without precision and scale",
    )
    .await;

    exec("CREATE TABLE public.t_timestamp (id text PRIMARY KEY, name text NOT NULL, body timestamp NOT NULL)").await;
    rejects(
        &store,
        retarget("t_timestamp"),
        "table tbl_templates, column body: is timestamp without time zone",
    )
    .await;

    exec("CREATE TABLE public.t_point (id text PRIMARY KEY, name text NOT NULL, body point NOT NULL)").await;
    rejects(
        &store,
        retarget("t_point"),
        "table tbl_templates, column body: has type point, which has no portable type",
    )
    .await;

    // Decimal bounds must match the column's.
    exec("CREATE TABLE public.t_money (id text PRIMARY KEY, name text NOT NULL, body numeric(10,2) NOT NULL)").await;
    let decimal = |p: u32| {
        move |s: String| {
            retarget("t_money")(s).replace(
                r#"{ field_id = "fld_templates_body", column = "body", type = "string" }"#,
                &format!(r#"{{ field_id = "fld_templates_body", column = "body", type = "decimal", precision = {p}, scale = 2 }}"#),
            )
        }
    };
    assert_eq!(
        problems(&store, &example_config(decimal(10))).await,
        Vec::<String>::new()
    );
    rejects(&store, decimal(12), "table tbl_templates, column body: numeric bounds Some((10, 2)) differ from the declared Some((12, 2))").await;

    // Dependency relations are checked too.
    rejects(
        &store,
        |s| {
            s.replace(
                "relation = \"public.team_members\"",
                "relation = \"public.teams\"",
            )
        },
        "assignment.dependency relation public.teams does not exist",
    )
    .await;
    rejects(
        &store,
        |s| {
            s.replace(
                "via = \"public.note_shares\", key = \"note_id\"",
                "via = \"public.note_shares\", key = \"nid\"",
            )
        },
        "table tbl_notes: dependency relation public.note_shares has no column nid",
    )
    .await;
}

/// Every message a real pgoutput slot produces decodes, with the expected shape.
#[tokio::test]
async fn pgoutput_from_a_real_slot() {
    use store_pg::pgoutput::{Message, TupleValue, decode};

    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "capture").await;
    let pool = store.pool();
    // One statement (or explicit transaction) per call: four source transactions.
    for sql in [
        "CREATE PUBLICATION synchro_test FOR TABLE public.notes, public.templates",
        "SELECT pg_create_logical_replication_slot('synchro_test', 'pgoutput')",
        "INSERT INTO public.templates (id, name, body) VALUES ('t1', 'Squat', 'é€😀')",
        "BEGIN;
           UPDATE public.templates SET body = 'b2' WHERE id = 't1';
           SELECT pg_logical_emit_message(true, 'synchro.fence', 'fence-1');
           INSERT INTO public.notes (id, owner_id, title) VALUES ('018f2b5e-7c42-7a1d-9d31-8a95bd674001', 'alice', 'x');
         COMMIT;",
        "DELETE FROM public.templates WHERE id = 't1'",
        "TRUNCATE public.templates",
    ] {
        sqlx::raw_sql(sql).execute(pool).await.unwrap();
    }
    let rows: Vec<Vec<u8>> = sqlx::query_scalar(
        "SELECT data FROM pg_logical_slot_peek_binary_changes('synchro_test', NULL, NULL,
           'proto_version', '1', 'publication_names', 'synchro_test', 'messages', 'true')",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let messages: Vec<Message> = rows.iter().map(|m| decode(m).unwrap()).collect();
    let kinds: String = messages
        .iter()
        .map(|m| match m {
            Message::Begin { .. } => 'B',
            Message::Commit { .. } => 'C',
            Message::Relation { .. } => 'R',
            Message::Insert { .. } => 'I',
            Message::Update { .. } => 'U',
            Message::Delete { .. } => 'D',
            Message::Truncate { .. } => 'T',
            Message::LogicalMessage { .. } => 'M',
            Message::Type { .. } | Message::Origin { .. } => '?',
        })
        .collect();
    // Four transactions; a relation is described before its first row and
    // before a truncate; the transactional message arrives inside its
    // transaction, in order.
    assert_eq!(kinds, "BRICBUMRICBDCBRTC");
    let Message::Relation {
        namespace,
        name,
        replica_identity,
        columns,
        ..
    } = &messages[1]
    else {
        panic!()
    };
    assert_eq!(
        (namespace.as_str(), name.as_str(), *replica_identity),
        ("public", "templates", b'd')
    );
    let names: Vec<(&str, bool)> = columns.iter().map(|c| (c.name.as_str(), c.key)).collect();
    assert_eq!(names, [("id", true), ("name", false), ("body", false)]);
    let Message::Insert { new, .. } = &messages[2] else {
        panic!()
    };
    assert_eq!(new[2], TupleValue::Text("é€😀".as_bytes().to_vec()));
    let Message::LogicalMessage {
        transactional,
        prefix,
        content,
        ..
    } = &messages[6]
    else {
        panic!()
    };
    assert!(*transactional);
    assert_eq!(
        (prefix.as_str(), content.as_slice()),
        ("synchro.fence", &b"fence-1"[..])
    );
    // Replica identity default: an update without a key change sends no old tuple,
    // and a delete sends only the key.
    let Message::Update { old, new, .. } = &messages[5] else {
        panic!()
    };
    assert_eq!((old, &new[2]), (&None, &TupleValue::Text(b"b2".to_vec())));
    let Message::Delete { old, .. } = &messages[11] else {
        panic!()
    };
    assert_eq!(
        (&old[0], &old[1]),
        (&TupleValue::Text(b"t1".to_vec()), &TupleValue::Null)
    );
    // Commit LSNs increase, and each commit matches its begin.
    let mut last = 0;
    let mut begun = 0;
    for m in &messages {
        match m {
            Message::Begin { final_lsn, .. } => begun = *final_lsn,
            Message::Commit {
                commit_lsn,
                end_lsn,
                ..
            } => {
                assert_eq!(*commit_lsn, begun);
                assert!(*commit_lsn > last && end_lsn > commit_lsn);
                last = *commit_lsn;
            }
            _ => {}
        }
    }
}

/// Two users' first connects for one new client_id, at the same moment:
/// exactly one is bound, the other gets 401, and the binding never moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_first_connects_bind_exactly_one_user() {
    use actors::Engine;
    use actors::testkit::ConnectBody;
    use protocol::json;

    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "binding_race").await;
    let engine = Engine::start(store, example_config(|s| s)).await.unwrap();
    const ROUNDS: usize = 40;
    for round in 0..ROUNDS {
        let client_id = format!("race-{round}");
        let body = json::to_canonical(&ConnectBody::fresh(&client_id).to_json());
        let first = |user: &'static str| {
            let (engine, body) = (engine.clone(), body.clone());
            tokio::spawn(async move { engine.connect(user, body, 0).await })
        };
        let (alice, bob) = (first("alice"), first("bob"));
        let (alice, bob) = (alice.await.unwrap(), bob.await.unwrap());
        let mut statuses = [alice.status, bob.status];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 401], "round {round}");
        let (winner, loser) = if alice.status == 200 {
            ("alice", "bob")
        } else {
            ("bob", "alice")
        };
        // The binding holds: the winner goes on, the loser is refused again.
        let won = json::parse(if alice.status == 200 {
            &alice.body
        } else {
            &bob.body
        })
        .unwrap();
        let next = json::to_canonical(&ConnectBody::after(&client_id, &won).to_json());
        assert_eq!(engine.connect(winner, next.clone(), 0).await.status, 200);
        assert_eq!(engine.connect(loser, body.clone(), 0).await.status, 401);
        assert_eq!(engine.connect(loser, next, 0).await.status, 401);
    }
}
