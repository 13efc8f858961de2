//! PgStore: the `actors::store` traits on PostgreSQL through sqlx, the
//! migrations of schema `synchro`, validation of the sync config against
//! the live catalog, and the embedded cluster helper.
//!
//! Thin by design: each method is one statement, and no protocol decision
//! is made here.
#![cfg(not(madsim))]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod capture;
pub mod catalog;
pub mod cluster;
mod materialized;
pub mod pgoutput;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use actors::capture::{
    CapturePlan, CaptureProblem, CaptureProgress, DependencyRow, Effect, Materialization,
    Projection, Quarantine,
};
use actors::config::DependencyAssignment;
use actors::store::{ClientRecord, Store, StoreError, StoreTx};
use protocol::digest::{Digest, RowIdentity};
use protocol::ids::ScopeId;
use protocol::json;
use protocol::manifest::{Manifest, SchemaRef};
use protocol::position::{Boundary, StreamPosition};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Postgres, Row, Transaction};

use crate::capture::{FeedTarget, PgFeed};

/// The store on one PostgreSQL database.
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    options: PgConnectOptions,
    feed_target: FeedTarget,
    /// What `install_capture` installed; the feed checks relations against it.
    plan: Arc<Mutex<Option<CapturePlan>>>,
}

/// Maps a driver error: transient ones are retryable, the rest are integrity failures.
fn db_error(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::Database(d)
            if d.code()
                .is_some_and(|c| c.starts_with("40") || c == "23505") =>
        {
            StoreError::Unavailable(format!(
                "retryable database conflict ({})",
                d.code().unwrap_or_default()
            ))
        }
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_) => StoreError::Unavailable("database connection failed".into()),
        sqlx::Error::Database(d) => {
            StoreError::Unavailable(format!("database error {}", d.code().unwrap_or_default()))
        }
        _ => StoreError::Integrity(format!("unexpected database result: {e}")),
    }
}

impl PgStore {
    /// Connects a pool and applies the migrations. The replication
    /// connection of capture uses the same server and `password`, if any.
    pub async fn connect(options: PgConnectOptions) -> Result<PgStore, StoreError> {
        PgStore::connect_with_password(options, None).await
    }

    /// [`PgStore::connect`] for a server that needs a password.
    pub async fn connect_with_password(
        options: PgConnectOptions,
        password: Option<&str>,
    ) -> Result<PgStore, StoreError> {
        let feed_target = FeedTarget::new(&options, password);
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect_with(options.clone())
            .await
            .map_err(db_error)?;
        sqlx::migrate!("./migrations")
            .run(&pool)
            .await
            .map_err(|e| StoreError::Unavailable(format!("migrations failed: {e}")))?;
        Ok(PgStore {
            pool,
            options,
            feed_target,
            plan: Arc::new(Mutex::new(None)),
        })
    }

    /// The pool, for operator tasks and tests.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// One PostgreSQL transaction.
pub struct PgTx {
    tx: Transaction<'static, Postgres>,
}

impl Store for PgStore {
    type Tx = PgTx;
    type Feed = PgFeed;

    async fn install_capture(&self, plan: &CapturePlan) -> Result<(), StoreError> {
        capture::install(self, plan).await?;
        *self
            .plan
            .lock()
            .map_err(|_| StoreError::Integrity("capture plan lock poisoned".into()))? =
            Some(plan.clone());
        Ok(())
    }

    async fn check_capture(&self) -> Result<Option<CaptureProblem>, StoreError> {
        let plan = self
            .plan
            .lock()
            .map_err(|_| StoreError::Integrity("capture plan lock poisoned".into()))?
            .clone();
        match plan {
            Some(plan) => capture::check(self, &plan).await,
            None => Err(StoreError::Integrity("capture is not installed".into())),
        }
    }

    async fn change_feed(&self) -> Result<Option<PgFeed>, StoreError> {
        capture::open(self).await
    }

    async fn begin(&self) -> Result<PgTx, StoreError> {
        Ok(PgTx {
            tx: self.pool.begin().await.map_err(db_error)?,
        })
    }
}

fn counter(v: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| StoreError::Integrity(format!("negative {what}")))
}

impl StoreTx for PgTx {
    async fn manifests(&mut self) -> Result<Vec<Manifest>, StoreError> {
        let rows = sqlx::query(
            "SELECT version, hash, definition FROM synchro.schema_manifests ORDER BY version",
        )
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?;
        rows.iter()
            .map(|r| {
                let (version, hash, definition): (i64, String, String) = (
                    r.try_get(0).map_err(db_error)?,
                    r.try_get(1).map_err(db_error)?,
                    r.try_get(2).map_err(db_error)?,
                );
                let bad = |what: &str| {
                    StoreError::Integrity(format!("stored manifest {version}: {what}"))
                };
                let value = json::parse(definition.as_bytes())
                    .map_err(|_| bad("definition is not JSON"))?;
                let m =
                    Manifest::from_json(value).map_err(|_| bad("definition does not verify"))?;
                if m.schema_version() as i64 != version || m.hash().to_hex() != hash {
                    return Err(bad("version or hash differs from the definition"));
                }
                Ok(m)
            })
            .collect()
    }

    async fn insert_manifest(&mut self, m: &Manifest) -> Result<(), StoreError> {
        let max: Option<i64> =
            sqlx::query_scalar("SELECT max(version) FROM synchro.schema_manifests")
                .fetch_one(&mut *self.tx)
                .await
                .map_err(db_error)?;
        if max.is_some_and(|v| v >= m.schema_version() as i64) {
            return Err(StoreError::Integrity(
                "manifest versions must increase".into(),
            ));
        }
        sqlx::query(
            "INSERT INTO synchro.schema_manifests (version, hash, definition) VALUES ($1, $2, $3)",
        )
        .bind(m.schema_version() as i64)
        .bind(m.hash().to_hex())
        .bind(json::to_canonical_string(&m.to_json()))
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(())
    }

    async fn lock_client(&mut self, client_id: &str) -> Result<Option<ClientRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT user_id, generation, retired, installed_version, installed_hash, scope_set_version, assigned \
             FROM synchro.clients WHERE client_id = $1 FOR UPDATE",
        )
        .bind(client_id)
        .fetch_optional(&mut *self.tx)
        .await
        .map_err(db_error)?;
        let Some(r) = row else { return Ok(None) };
        let installed_version: Option<i64> = r.try_get(3).map_err(db_error)?;
        let installed_hash: Option<String> = r.try_get(4).map_err(db_error)?;
        let installed_schema = match (installed_version, installed_hash) {
            (Some(v), Some(h)) => Some(SchemaRef {
                version: counter(v, "schema version")?,
                hash: Digest::from_hex(&h)
                    .ok_or(StoreError::Integrity("stored schema hash".into()))?,
            }),
            _ => None,
        };
        let assigned: Vec<String> = r.try_get(6).map_err(db_error)?;
        Ok(Some(ClientRecord {
            user_id: r.try_get(0).map_err(db_error)?,
            client_id: client_id.to_owned(),
            generation: counter(r.try_get(1).map_err(db_error)?, "generation")?,
            retired: r.try_get(2).map_err(db_error)?,
            installed_schema,
            scope_set_version: counter(r.try_get(5).map_err(db_error)?, "scope_set_version")?,
            assigned: assigned
                .iter()
                .map(|s| ScopeId::parse(s).ok_or(StoreError::Integrity("stored scope ID".into())))
                .collect::<Result<BTreeSet<_>, _>>()?,
        }))
    }

    async fn put_client(&mut self, c: &ClientRecord) -> Result<(), StoreError> {
        let assigned: Vec<&str> = c.assigned.iter().map(ScopeId::as_str).collect();
        sqlx::query(
            "INSERT INTO synchro.clients \
               (client_id, user_id, generation, retired, installed_version, installed_hash, scope_set_version, assigned) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (client_id) DO UPDATE SET user_id = EXCLUDED.user_id, generation = EXCLUDED.generation, \
               retired = EXCLUDED.retired, installed_version = EXCLUDED.installed_version, \
               installed_hash = EXCLUDED.installed_hash, scope_set_version = EXCLUDED.scope_set_version, \
               assigned = EXCLUDED.assigned",
        )
        .bind(&c.client_id)
        .bind(&c.user_id)
        .bind(c.generation as i64)
        .bind(c.retired)
        .bind(c.installed_schema.map(|s| s.version as i64))
        .bind(c.installed_schema.map(|s| s.hash.to_hex()))
        .bind(c.scope_set_version as i64)
        .bind(&assigned)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(())
    }

    async fn grants(&mut self, user_id: &str) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar("SELECT scope_id FROM synchro.scope_grants WHERE user_id = $1 ORDER BY scope_id COLLATE \"C\"")
            .bind(user_id)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)
    }

    async fn dependency_values(
        &mut self,
        source: &DependencyAssignment,
        user_id: &str,
    ) -> Result<Vec<String>, StoreError> {
        // Identifiers were validated as plain lowercase identifiers; quoting keeps them exact.
        let (schema, table) = source
            .relation
            .split_once('.')
            .unwrap_or(("public", &source.relation));
        let sql = format!(
            r#"SELECT DISTINCT "{value}"::text FROM "{schema}"."{table}" WHERE "{user}"::text = $1 AND "{value}" IS NOT NULL"#,
            value = source.value_column,
            user = source.user_column,
        );
        sqlx::query_scalar(&sql)
            .bind(user_id)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)
    }

    async fn capture_progress(&mut self) -> Result<CaptureProgress, StoreError> {
        self.read_capture_progress().await
    }

    async fn projections(
        &mut self,
        table_id: &str,
        rows: &[RowIdentity],
    ) -> Result<Vec<Projection>, StoreError> {
        self.read_projections(table_id, rows).await
    }

    async fn dependency_rows_by_identity(
        &mut self,
        relation: &str,
        identities: &[String],
    ) -> Result<Vec<DependencyRow>, StoreError> {
        self.read_dependency_rows_by_identity(relation, identities)
            .await
    }

    async fn dependency_rows(
        &mut self,
        relation: &str,
        column: &str,
        values: &[String],
    ) -> Result<Vec<DependencyRow>, StoreError> {
        self.read_dependency_rows(relation, column, values).await
    }

    async fn materialize(&mut self, m: &Materialization) -> Result<(), StoreError> {
        self.write_materialization(m).await
    }

    async fn quarantine(&mut self, q: &Quarantine) -> Result<(), StoreError> {
        self.write_quarantine(q).await
    }

    async fn scope_effects(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
    ) -> Result<Vec<Effect>, StoreError> {
        self.read_scope_effects(scope, after, through).await
    }

    async fn commit(self) -> Result<(), StoreError> {
        self.tx.commit().await.map_err(db_error)
    }
}

/// A new database in `cluster` holding the example app's tables, with the store on it.
#[cfg(feature = "testkit")]
#[allow(clippy::expect_used)] // test support fails loudly
pub async fn example_store(cluster: &cluster::PgCluster, name: &str) -> PgStore {
    let store = PgStore::connect(
        cluster
            .create_database(name)
            .await
            .expect("create database"),
    )
    .await
    .expect("connect");
    sqlx::raw_sql(include_str!("../../examples/notes/schema.sql"))
        .execute(store.pool())
        .await
        .expect("example schema");
    store
}

#[cfg(feature = "testkit")]
#[allow(clippy::expect_used)] // test support fails loudly
impl actors::testkit::ConformanceStore for PgStore {
    async fn add_grant(&self, user: &str, scope: &str) {
        sqlx::query("INSERT INTO synchro.scope_grants (user_id, scope_id) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(user)
            .bind(scope)
            .execute(&self.pool)
            .await
            .expect("insert grant");
    }

    async fn add_dependency_row(&self, source: &DependencyAssignment, user: &str, value: &str) {
        let (schema, table) = source
            .relation
            .split_once('.')
            .unwrap_or(("public", &source.relation));
        let sql = format!(
            r#"INSERT INTO "{schema}"."{table}" ("{}", "{}") VALUES ($1, $2) ON CONFLICT DO NOTHING"#,
            source.user_column, source.value_column
        );
        sqlx::query(&sql)
            .bind(user)
            .bind(value)
            .execute(&self.pool)
            .await
            .expect("insert dependency row");
    }
}
