//! Upgrades over live state: a database migrated up to an older schema,
//! with state in it, then connected by this PgStore.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::path::Path;

use actors::store::{Store, StoreTx};
use protocol::ids::CanonicalUuid;
use store_pg::PgStore;
use store_pg::cluster::PgCluster;

/// Applies the migrations up to and including `last` to the database.
async fn migrate_up_to(options: sqlx::postgres::PgConnectOptions, last: u32) {
    let all = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&all).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let version: u32 = name[..4].parse().unwrap();
        if version <= last {
            std::fs::copy(&path, dir.path().join(&name)).unwrap();
        }
    }
    let pool = sqlx::PgPool::connect_with(options).await.unwrap();
    sqlx::migrate::Migrator::new(dir.path())
        .await
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    pool.close().await;
}

/// Migration 0019 (ADR 0017): a rebuild session staged before it, whose
/// answered pages were stored, ends at the upgrade (its rebuild_id is then
/// answered 409), and its stage and pages are gone.
#[tokio::test]
async fn a_session_staged_before_rendered_pages_ends_at_the_upgrade() {
    let cluster = PgCluster::temp().unwrap();
    let options = cluster.create_database("upgrade").await.unwrap();
    migrate_up_to(options.clone(), 18).await;
    let pool = sqlx::PgPool::connect_with(options.clone()).await.unwrap();
    let far = i64::MAX / 2;
    sqlx::raw_sql(&format!(
        "INSERT INTO synchro.rebuild_sessions (session_id, client_id, rebuild_id, scope_id, \
         client_generation, schema_hash, stream_generation, membership_generation, \
         retention_generation, accepted_write_epoch, boundary_lsn, page_limit, expires_at, \
         digest, staged_rows) VALUES ('00000000-0000-4000-8000-000000000001', 'c1', \
         '00000000-0000-4000-8000-000000000002', 'user:u1', 1, '\\x{h}', 1, 1, 1, 0, 100, 10, \
         {far}, '\\x{h}', 1); \
         INSERT INTO synchro.rebuild_stage VALUES ('00000000-0000-4000-8000-000000000001', 0, \
         't', '\\x01', '{{\"id\":1}}', 'v1', '\\x{h}'); \
         INSERT INTO synchro.rebuild_pages VALUES ('00000000-0000-4000-8000-000000000001', 0, \
         '\\x7b7d');",
        h = "ab".repeat(32)
    ))
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;

    let store = PgStore::connect(options).await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let rebuild_id = CanonicalUuid::parse("00000000-0000-4000-8000-000000000002").unwrap();
    let session = tx
        .rebuild_session("c1", &rebuild_id)
        .await
        .unwrap()
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64;
    assert!(
        session.expires_at <= now,
        "the session ended at the upgrade: a continuation or a first request of it is 409"
    );
    assert!(
        tx.staged_rows(&session.session_id, 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        tx.rebuild_usage("u1", now).await.unwrap().total_rows,
        0,
        "it holds nothing of the budgets"
    );
    drop(tx);
    let pages: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('synchro.rebuild_pages')::text")
            .fetch_one(store.pool())
            .await
            .unwrap();
    assert_eq!(pages, None, "pages are no longer stored");
}
