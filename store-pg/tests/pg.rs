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

    // The cluster runs with logical decoding available.
    catalog::check_server(store.pool()).await.unwrap();
    // A role without privileges is told exactly what it lacks.
    sqlx::raw_sql("CREATE ROLE weak LOGIN").execute(store.pool()).await.unwrap();
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
    assert_eq!(n, 1);

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
