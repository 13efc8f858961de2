//! WAL capture on a throwaway cluster: the capture suite (the same writes
//! and expected effects as MemStore), TRUNCATE blocking, and the key guard.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::capture::Lsn;
use actors::testkit::{CaptureWorld, Write, capture_suite, truncate_blocks};
use store_pg::cluster::PgCluster;
use store_pg::{PgStore, example_store};

struct Pg {
    store: PgStore,
}

fn literal(v: Option<&str>) -> String {
    v.map_or("NULL".into(), |s| format!("'{}'", s.replace('\'', "''")))
}

fn condition(key: &[(&str, &str)]) -> String {
    key.iter()
        .map(|(c, v)| format!("{c} = {}", literal(Some(v))))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// The SQL the application would run for `w`.
fn sql(w: &Write<'_>) -> String {
    match *w {
        Write::Insert(r, row) => format!(
            "INSERT INTO {r} ({}) VALUES ({})",
            row.iter().map(|(c, _)| *c).collect::<Vec<_>>().join(", "),
            row.iter()
                .map(|(_, v)| literal(*v))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Write::Update(r, key, changes) => format!(
            "UPDATE {r} SET {} WHERE {}",
            changes
                .iter()
                .map(|(c, v)| format!("{c} = {}", literal(*v)))
                .collect::<Vec<_>>()
                .join(", "),
            condition(key)
        ),
        Write::Delete(r, key) => format!("DELETE FROM {r} WHERE {}", condition(key)),
        Write::Truncate(r) => format!("TRUNCATE {r} CASCADE"),
    }
}

impl CaptureWorld for Pg {
    type S = PgStore;

    fn store(&self) -> &PgStore {
        &self.store
    }

    async fn write(&self, writes: &[Write<'_>]) -> Lsn {
        let mut tx = self.store.pool().begin().await.unwrap();
        for w in writes {
            sqlx::raw_sql(&sql(w)).execute(&mut *tx).await.unwrap();
        }
        // Where this transaction's commit record will start.
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        pgwire_replication::Lsn::parse(&lsn).unwrap().as_u64()
    }
}

#[tokio::test]
async fn capture_on_postgres() {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let cluster = PgCluster::temp().unwrap();
    let world = Pg {
        store: example_store(&cluster, "capture").await,
    };
    capture_suite(&world).await;

    // The deletion fence: a hard-deleted row keeps its version row.
    let (deleted,): (bool,) = sqlx::query_as(
        "SELECT deleted FROM synchro.row_versions WHERE table_id = 'tbl_notes' \
         AND key = '00000000-0000-4000-8000-000000000002'",
    )
    .fetch_one(world.store.pool())
    .await
    .unwrap();
    assert!(deleted);

    // The key guard: a synced row's primary key never changes.
    let err = sqlx::raw_sql(
        "UPDATE public.notes SET id = '00000000-0000-4000-8000-0000000000ff' \
         WHERE id = '00000000-0000-4000-8000-000000000001'",
    )
    .execute(world.store.pool())
    .await
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("primary key of a synced row cannot change")
    );

    let truncated = Pg {
        store: example_store(&cluster, "truncate").await,
    };
    truncate_blocks(&truncated).await;
}
