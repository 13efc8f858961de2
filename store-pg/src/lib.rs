//! PgStore: the `actors::store` traits on PostgreSQL through sqlx, the
//! migrations of schema `synchro`, validation of the sync config against
//! the live catalog, and the embedded cluster helper.
//!
//! Thin by design: each method is one statement, and no protocol decision
//! is made here.
#![cfg(not(madsim))]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

mod baseline;
pub mod capture;
pub mod catalog;
pub mod cluster;
mod fences;
mod frame;
mod ledger;
mod materialized;
pub mod operator;
pub mod pgoutput;
mod push;
mod rebuild;
mod reread;
mod retention;
mod sql;
mod sqlstate;
mod stream;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use actors::capture::{
    CaptureHealth, CapturePlan, CaptureProblem, CaptureProgress, DependencyRow, Effect, Heartbeat,
    Materialization, Projection, Quarantine, Rematerialization,
};
use actors::config::DependencyAssignment;
use actors::ledger::contract::{
    FoundRow, LedgerEntries, PushRecord, Refusal, RowWrite, WriteResult, WriteTarget, Writer,
};
use actors::staging::{RebuildSession, RebuildUsage, StagedRow};
use actors::store::{
    ClientRecord, LedgerLookup, PushFrame, RequestFrame, Store, StoreError, StoreTx,
};
use actors::stream::{Checkpoint, MembershipRules, StreamState};
use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{CanonicalUuid, ScopeId};
use protocol::json;
use protocol::manifest::{Manifest, SchemaRef};
use protocol::position::{Boundary, StreamPosition};
use protocol::token::TokenKey;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
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
    /// What `install_push` read from the catalog: each written relation's types.
    writes: push::WriteCatalog,
}

/// Every driver error becomes a store failure in one place (`sqlstate`).
use sqlstate::store_error as db_error;

/// How long a request waits for a database connection before it fails
/// (`503`): a database that is gone is reported at once, not after retries.
pub const ACQUIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Connections of capture's own pool ([`Store::capture_store`]): the
/// materializer's group, and a second for what runs beside it.
const CAPTURE_CONNECTIONS: u32 = 2;

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
        // A lost database fails a request in seconds, never in the default 30.
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(ACQUIRE_TIMEOUT)
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
            writes: Default::default(),
        })
    }

    /// A snapshot transaction, its commit `lazy` or not until it says otherwise.
    async fn snapshot(&self, lazy: bool) -> Result<PgTx, StoreError> {
        // Every read of a pull walks an index range in its order (a scope's
        // candidates, its members). For a scope that is most of its table
        // the planner would rather read it by a bitmap or a sequential scan
        // and sort it, which costs more and does not stop at a page's
        // limit; JIT compiling costs more than these short statements take.
        // A lazy commit is set here too: one simple query, one round trip.
        let begin = format!(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; \
             SELECT set_config('enable_bitmapscan', 'off', true), \
             set_config('enable_sort', 'off', true), set_config('jit', 'off', true){}",
            if lazy {
                ", set_config('synchronous_commit', 'off', true)"
            } else {
                ""
            }
        );
        Ok(PgTx {
            tx: self.pool.begin_with(begin).await.map_err(db_error)?,
            writes: self.writes.clone(),
            savepoint_open: false,
            defer_pending: false,
            check_each_write: false,
            lazy,
        })
    }

    /// The pool, for operator tasks and tests.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The same store over a new pool of at most `connections` (a pool of
    /// one shows what holds a connection). Capture keeps its own.
    pub fn with_connections(&self, connections: u32) -> PgStore {
        assert!(connections > 0, "a pool holds at least one connection");
        PgStore {
            pool: PgPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(ACQUIRE_TIMEOUT)
                .connect_lazy_with(self.options.clone()),
            ..self.clone()
        }
    }
}

/// Binds a client record's columns as `$1..$10`, in the table's order.
fn bind_client<'q>(
    q: sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>,
    c: &'q ClientRecord,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    let assigned: Vec<&str> = c.assigned.iter().map(ScopeId::as_str).collect();
    q.bind(&c.client_id)
        .bind(&c.user_id)
        .bind(c.generation as i64)
        .bind(c.retired)
        .bind(c.installed_schema.map(|s| s.version as i64))
        .bind(c.installed_schema.map(|s| s.hash.to_hex()))
        .bind(c.scope_set_version as i64)
        .bind(assigned)
        .bind(c.accepted_write_epoch as i64)
        .bind(c.continued)
        .bind(
            c.ever_assigned
                .iter()
                .map(ScopeId::as_str)
                .collect::<Vec<_>>(),
        )
}

/// The columns [`client_at`] decodes, over `synchro.clients c`.
const CLIENT_COLUMNS: &str = "c.user_id, c.generation, c.retired, c.installed_version, \
    c.installed_hash, c.scope_set_version, c.assigned, c.accepted_write_epoch, c.continued, \
    c.ever_assigned, c.registered_at";
/// How many columns [`CLIENT_COLUMNS`] names.
const CLIENT_WIDTH: usize = 11;

/// The client `client_id` in `r`'s columns from `at` ([`CLIENT_COLUMNS`]);
/// `None` where they are null (an outer join found no such client).
fn client_at(r: &PgRow, at: usize, client_id: &str) -> Result<Option<ClientRecord>, StoreError> {
    let get = |i: usize| at + i;
    let Some(user_id) = r.try_get::<Option<String>, _>(get(0)).map_err(db_error)? else {
        return Ok(None);
    };
    let installed_version: Option<i64> = r.try_get(get(3)).map_err(db_error)?;
    let installed_hash: Option<String> = r.try_get(get(4)).map_err(db_error)?;
    let installed_schema = match (installed_version, installed_hash) {
        (Some(v), Some(h)) => Some(SchemaRef {
            version: counter(v, "schema version")?,
            hash: Digest::from_hex(&h).ok_or(StoreError::Integrity("stored schema hash".into()))?,
        }),
        _ => None,
    };
    let scopes = |i: usize| -> Result<BTreeSet<ScopeId>, StoreError> {
        let ids: Vec<String> = r.try_get(get(i)).map_err(db_error)?;
        ids.iter()
            .map(|s| ScopeId::parse(s).ok_or(StoreError::Integrity("stored scope ID".into())))
            .collect()
    };
    Ok(Some(ClientRecord {
        user_id,
        client_id: client_id.to_owned(),
        generation: counter(r.try_get(get(1)).map_err(db_error)?, "generation")?,
        retired: r.try_get(get(2)).map_err(db_error)?,
        installed_schema,
        scope_set_version: counter(r.try_get(get(5)).map_err(db_error)?, "scope_set_version")?,
        assigned: scopes(6)?,
        ever_assigned: scopes(9)?,
        accepted_write_epoch: counter(
            r.try_get(get(7)).map_err(db_error)?,
            "accepted_write_epoch",
        )?,
        continued: r.try_get(get(8)).map_err(db_error)?,
        registered_at: r.try_get(get(10)).map_err(db_error)?,
    }))
}

/// One PostgreSQL transaction.
pub struct PgTx {
    tx: Transaction<'static, Postgres>,
    writes: push::WriteCatalog,
    /// A write's savepoint is open (released by the next write's).
    savepoint_open: bool,
    /// `SET CONSTRAINTS ALL DEFERRED` goes out with the next savepoint.
    defer_pending: bool,
    /// Deferrable constraints are checked after each write (each is a push unit).
    check_each_write: bool,
    /// The commit is set lazy (`synchronous_commit = off`).
    lazy: bool,
}

impl Store for PgStore {
    type Tx = PgTx;
    type Feed = PgFeed;
    type Fences = fences::PgFenceListener;

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

    async fn capture_store(&self) -> Result<PgStore, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(CAPTURE_CONNECTIONS)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy_with(self.options.clone());
        Ok(PgStore {
            pool,
            ..self.clone()
        })
    }

    async fn install_push(&self, targets: &[WriteTarget]) -> Result<(), StoreError> {
        push::install(self, targets).await
    }

    async fn fence_listener(&self) -> Result<fences::PgFenceListener, StoreError> {
        self.listen_fences().await
    }

    async fn begin(&self) -> Result<PgTx, StoreError> {
        Ok(PgTx {
            tx: self.pool.begin().await.map_err(db_error)?,
            writes: self.writes.clone(),
            savepoint_open: false,
            defer_pending: false,
            check_each_write: false,
            lazy: false,
        })
    }

    async fn begin_snapshot(&self) -> Result<PgTx, StoreError> {
        self.snapshot(false).await
    }

    async fn begin_snapshot_lazily(&self) -> Result<PgTx, StoreError> {
        self.snapshot(true).await
    }

    async fn fresh_secret(&self) -> Result<[u8; 32], StoreError> {
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret)
            .map_err(|e| StoreError::Unavailable(format!("no entropy: {e}")))?;
        Ok(secret)
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

    async fn applied_configs(&mut self) -> Result<Vec<String>, StoreError> {
        sqlx::query_scalar("SELECT fingerprint FROM synchro.applied_configs ORDER BY applied_order")
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)
    }

    async fn apply_config(&mut self, fingerprint: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO synchro.applied_configs (fingerprint) VALUES ($1) \
             ON CONFLICT (fingerprint) DO UPDATE \
             SET applied_order = nextval('synchro.applied_configs_order')",
        )
        .bind(fingerprint)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(())
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
        let sql = format!(
            "SELECT {CLIENT_COLUMNS} FROM synchro.clients c WHERE c.client_id = $1 FOR UPDATE"
        );
        let row = sqlx::query(&sql)
            .bind(client_id)
            .fetch_optional(&mut *self.tx)
            .await
            .map_err(db_error)?;
        match row {
            None => Ok(None),
            Some(r) => client_at(&r, 0, client_id),
        }
    }

    async fn request_frame(
        &mut self,
        client_id: Option<&str>,
        max_fences: usize,
    ) -> Result<RequestFrame, StoreError> {
        self.read_request_frame(client_id, max_fences).await
    }

    async fn insert_client(&mut self, c: &ClientRecord) -> Result<bool, StoreError> {
        // A concurrent insert of the same ID waits for the other transaction,
        // then inserts nothing once that one commits.
        let done = bind_client(
            sqlx::query(
                "INSERT INTO synchro.clients \
                   (client_id, user_id, generation, retired, installed_version, installed_hash, \
                    scope_set_version, assigned, accepted_write_epoch, continued, ever_assigned, \
                    registered_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT (client_id) DO NOTHING",
            ),
            c,
        )
        .bind(c.registered_at)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn count_registrations(
        &mut self,
        user_id: &str,
        since_micros: i64,
    ) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM synchro.clients WHERE user_id = $1 AND registered_at >= $2",
        )
        .bind(user_id)
        .bind(since_micros)
        .fetch_one(&mut *self.tx)
        .await
        .map_err(db_error)?;
        counter(n, "registrations")
    }

    async fn put_client(&mut self, c: &ClientRecord) -> Result<(), StoreError> {
        let done = bind_client(
            sqlx::query(
                "UPDATE synchro.clients SET generation = $3, retired = $4, installed_version = $5, \
                   installed_hash = $6, scope_set_version = $7, assigned = $8, \
                   accepted_write_epoch = $9, continued = $10, ever_assigned = $11 \
                 WHERE client_id = $1 AND user_id = $2",
            ),
            c,
        )
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        if done.rows_affected() != 1 {
            return Err(StoreError::Integrity(
                "a client record replaced without its binding".into(),
            ));
        }
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

    async fn scope_members(
        &mut self,
        scope: &ScopeId,
    ) -> Result<Vec<(RowIdentity, Digest)>, StoreError> {
        self.read_scope_members(scope).await
    }

    async fn scope_size(&mut self, scope: &ScopeId) -> Result<u64, StoreError> {
        self.read_scope_size(scope).await
    }

    async fn record_heartbeat(&mut self, beat: &Heartbeat) -> Result<(), StoreError> {
        self.write_heartbeat(beat).await
    }

    async fn capture_health(&mut self) -> Result<CaptureHealth, StoreError> {
        self.read_capture_health().await
    }

    async fn has_stale_projections(&mut self, schema_version: u64) -> Result<bool, StoreError> {
        self.read_has_stale_projections(schema_version).await
    }

    async fn stale_scope_members(
        &mut self,
        scope: &ScopeId,
        schema_version: u64,
    ) -> Result<Vec<Projection>, StoreError> {
        self.read_stale_scope_members(scope, schema_version).await
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

    async fn reset_stream(&mut self) -> Result<u64, StoreError> {
        self.write_stream_reset().await
    }

    async fn record_baseline_chunk(&mut self, index: u64) -> Result<(), StoreError> {
        self.write_baseline_chunk(index).await
    }

    async fn hand_over_baseline(&mut self) -> Result<(), StoreError> {
        self.write_baseline_handed_over().await
    }

    async fn complete_baseline(&mut self, covered_fences: &[u64]) -> Result<(), StoreError> {
        self.write_baseline_done(covered_fences).await
    }

    async fn quarantine(
        &mut self,
        q: &Quarantine,
        stream_generation: u64,
    ) -> Result<(), StoreError> {
        self.write_quarantine(q, stream_generation).await
    }

    async fn forget_table(&mut self, table_id: &str) -> Result<u64, StoreError> {
        self.write_forgotten_table(table_id).await
    }

    async fn rematerializations(&mut self) -> Result<Vec<Rematerialization>, StoreError> {
        self.read_rematerializations().await
    }

    async fn put_rematerializations(
        &mut self,
        records: &[Rematerialization],
    ) -> Result<(), StoreError> {
        self.write_rematerializations(records).await
    }

    async fn scope_effects(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
    ) -> Result<Vec<Effect>, StoreError> {
        self.read_scope_effects(scope, after, through).await
    }

    async fn retention_hold(
        &mut self,
        stream_generation: u64,
        window: std::time::Duration,
    ) -> Result<Option<StreamPosition>, StoreError> {
        self.read_retention_hold(stream_generation, window).await
    }

    async fn advance_floor(&mut self, floor: StreamPosition) -> Result<(), StoreError> {
        self.write_floor(floor).await
    }

    async fn compact_below_floor(&mut self, max: usize) -> Result<usize, StoreError> {
        self.delete_below_floor(max).await
    }

    async fn forget_transactions_below_floor(&mut self, max: usize) -> Result<usize, StoreError> {
        self.delete_transactions_below_floor(max).await
    }

    async fn retire_client(&mut self, client_id: &str) -> Result<bool, StoreError> {
        self.write_retirement(client_id).await
    }

    async fn rebuild_session(
        &mut self,
        client_id: &str,
        rebuild_id: &CanonicalUuid,
    ) -> Result<Option<RebuildSession>, StoreError> {
        self.read_rebuild_session(client_id, rebuild_id).await
    }

    async fn stage_rebuild(
        &mut self,
        session: &RebuildSession,
        digests: &[(RowIdentity, Digest)],
    ) -> Result<u64, StoreError> {
        self.write_stage(session, digests).await
    }

    async fn staged_digests(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<(RowIdentity, Digest)>, StoreError> {
        self.read_staged_digests(session_id, from, max).await
    }

    async fn seal_rebuild_session(
        &mut self,
        session_id: &CanonicalUuid,
        digest: &Digest,
    ) -> Result<(), StoreError> {
        self.write_seal(session_id, digest).await
    }

    async fn staged_rows(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<StagedRow>, StoreError> {
        self.read_staged_rows(session_id, from, max).await
    }

    async fn supersede_rebuild_sessions(
        &mut self,
        client_id: &str,
        scope: &ScopeId,
        now_micros: i64,
    ) -> Result<u64, StoreError> {
        self.write_supersede(client_id, scope, now_micros).await
    }

    async fn rebuild_usage(
        &mut self,
        user_id: &str,
        now_micros: i64,
    ) -> Result<RebuildUsage, StoreError> {
        self.read_rebuild_usage(user_id, now_micros).await
    }

    async fn sweep_rebuild_sessions(
        &mut self,
        now_micros: i64,
        max: usize,
    ) -> Result<u64, StoreError> {
        self.write_sweep(now_micros, max).await
    }

    async fn forget_rebuild_sessions(
        &mut self,
        expired_before: i64,
        max: usize,
    ) -> Result<u64, StoreError> {
        self.write_forget(expired_before, max).await
    }

    async fn stream_state(&mut self) -> Result<StreamState, StoreError> {
        self.read_stream_state().await
    }

    async fn membership_rules(&mut self) -> Result<Vec<MembershipRules>, StoreError> {
        self.read_membership_rules().await
    }

    async fn insert_membership_rules(
        &mut self,
        rules: &[MembershipRules],
    ) -> Result<(), StoreError> {
        self.write_membership_rules(rules).await
    }

    async fn token_keys(&mut self) -> Result<Vec<TokenKey>, StoreError> {
        self.read_token_keys().await
    }

    async fn insert_token_keys(&mut self, keys: &[TokenKey]) -> Result<(), StoreError> {
        self.write_token_keys(keys).await
    }

    async fn rotate_token_keys(&mut self, fresh: &[TokenKey]) -> Result<(), StoreError> {
        self.rotate_keys(fresh).await
    }

    async fn drop_token_key(&mut self, key_id: &str) -> Result<bool, StoreError> {
        self.drop_key(key_id).await
    }

    async fn checkpoints(
        &mut self,
        client_id: &str,
    ) -> Result<BTreeMap<ScopeId, Checkpoint>, StoreError> {
        self.read_checkpoints(client_id).await
    }

    async fn put_checkpoints(
        &mut self,
        client_id: &str,
        checkpoints: &[(ScopeId, Checkpoint)],
    ) -> Result<(), StoreError> {
        self.write_checkpoints(client_id, checkpoints).await
    }

    async fn pending_fences(
        &mut self,
        client_id: &str,
        max: usize,
    ) -> Result<Vec<u64>, StoreError> {
        self.read_pending_fences(client_id, max).await
    }

    async fn reconcile_fences(&mut self) -> Result<u64, StoreError> {
        self.reconcile_satisfied_fences().await
    }

    async fn scope_candidates(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
        max: usize,
    ) -> Result<Vec<Effect>, StoreError> {
        self.read_scope_candidates(scope, after, through, max).await
    }

    async fn last_effect_before(
        &mut self,
        scope: &ScopeId,
        before: StreamPosition,
    ) -> Result<Option<StreamPosition>, StoreError> {
        self.read_last_effect_before(scope, before).await
    }

    async fn last_effects_before(
        &mut self,
        scopes: &[&ScopeId],
        before: StreamPosition,
    ) -> Result<Vec<Option<StreamPosition>>, StoreError> {
        self.read_last_effects_before(scopes, before).await
    }

    async fn push_ledger(
        &mut self,
        user_id: &str,
        client_id: &str,
        batch_id: CanonicalUuid,
        mutation_ids: &[CanonicalUuid],
    ) -> Result<LedgerEntries, StoreError> {
        self.read_push_ledger(user_id, client_id, batch_id, mutation_ids)
            .await
    }

    async fn record_push(&mut self, r: &PushRecord) -> Result<(), StoreError> {
        self.write_push_record(r).await
    }

    async fn push_frame(
        &mut self,
        user_id: &str,
        client_id: &str,
        lookup: Option<LedgerLookup<'_>>,
    ) -> Result<PushFrame, StoreError> {
        self.read_push_frame(user_id, client_id, lookup).await
    }

    async fn complete_push(
        &mut self,
        r: &PushRecord,
        client: Option<&ClientRecord>,
    ) -> Result<(), StoreError> {
        match client {
            None => self.write_push_record(r).await,
            Some(c) => self.write_push_record_and_client(r, c).await,
        }
    }

    async fn begin_writes(&mut self, w: &Writer) -> Result<(), StoreError> {
        self.start_writes(w).await
    }

    async fn find_rows(
        &mut self,
        target: &WriteTarget,
        keys: &[String],
    ) -> Result<Vec<FoundRow>, StoreError> {
        self.lock_rows(target, keys).await
    }

    async fn write_row(
        &mut self,
        target: &WriteTarget,
        key: &str,
        write: &RowWrite,
    ) -> Result<WriteResult, StoreError> {
        self.write(target, key, write).await
    }

    async fn write_rows(
        &mut self,
        target: &WriteTarget,
        writes: &[(String, RowWrite)],
    ) -> Result<Option<Vec<WriteResult>>, StoreError> {
        self.write_set(target, writes).await
    }

    async fn mark_group(&mut self) -> Result<(), StoreError> {
        self.open_group().await
    }

    async fn check_constraints(&mut self) -> Result<Option<Refusal>, StoreError> {
        self.deferred_check().await
    }

    async fn undo_group(&mut self) -> Result<(), StoreError> {
        self.close_group().await
    }

    async fn end_writes(&mut self) -> Result<(), StoreError> {
        self.stop_writes().await
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        if self.lazy {
            self.set_lazy(false).await?;
        }
        self.tx.commit().await.map_err(db_error)
    }

    async fn commit_lazily(mut self) -> Result<(), StoreError> {
        // The commit record is written, not flushed: the commit does not
        // queue behind another transaction's WAL (a rematerialization
        // writes a lot of it).
        if !self.lazy {
            self.set_lazy(true).await?;
        }
        self.tx.commit().await.map_err(db_error)
    }
}

impl PgTx {
    /// Sets whether this transaction's commit waits for its WAL flush.
    async fn set_lazy(&mut self, lazy: bool) -> Result<(), StoreError> {
        // Not lazy is the database's own setting, whatever it is.
        let sql = if lazy {
            "SET LOCAL synchronous_commit = off"
        } else {
            "SET LOCAL synchronous_commit TO DEFAULT"
        };
        sqlx::query(sql)
            .execute(&mut *self.tx)
            .await
            .map_err(db_error)?;
        self.lazy = lazy;
        Ok(())
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

/// The write floor of a bench: the time to write the rows of `tables`
/// (tables of `synchro`) again, as plainly as PostgreSQL can: into empty
/// copies of them (columns and indexes) in `public`, with one
/// `INSERT ... SELECT` each in one transaction, after a checkpoint so it
/// starts clean. Whatever stores those rows cannot take less.
#[cfg(feature = "testkit")]
#[allow(clippy::expect_used)] // test support fails loudly
pub async fn write_floor(pool: &sqlx::PgPool, tables: &[&str]) -> std::time::Duration {
    let mut conn = pool.acquire().await.expect("a connection");
    for t in tables {
        sqlx::raw_sql(&format!(
            "DROP TABLE IF EXISTS public.floor_{t}; \
             CREATE TABLE public.floor_{t} (LIKE synchro.{t} INCLUDING ALL)"
        ))
        .execute(&mut *conn)
        .await
        .expect("an empty copy");
    }
    sqlx::raw_sql("CHECKPOINT")
        .execute(&mut *conn)
        .await
        .expect("checkpoint");
    let copies: String = tables
        .iter()
        .map(|t| format!("INSERT INTO public.floor_{t} SELECT * FROM synchro.{t};"))
        .collect();
    let start = std::time::Instant::now();
    sqlx::raw_sql(&format!("BEGIN; {copies} COMMIT;"))
        .execute(&mut *conn)
        .await
        .expect("the copies");
    start.elapsed()
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

#[cfg(feature = "testkit")]
/// The capture world of PostgreSQL: application writes are plain SQL.
pub struct PgWorld {
    pub store: PgStore,
}

#[cfg(feature = "testkit")]
fn literal(v: Option<&str>) -> String {
    v.map_or("NULL".into(), sql::literal)
}

#[cfg(feature = "testkit")]
fn condition(key: &[(&str, &str)]) -> String {
    key.iter()
        .map(|(c, v)| format!("{c} = {}", literal(Some(v))))
        .collect::<Vec<_>>()
        .join(" AND ")
}

#[cfg(feature = "testkit")]
/// The SQL the application would run for `w`.
fn sql(w: &actors::testkit::Write<'_>) -> String {
    match *w {
        actors::testkit::Write::Insert(r, row) => format!(
            "INSERT INTO {r} ({}) VALUES ({})",
            row.iter().map(|(c, _)| *c).collect::<Vec<_>>().join(", "),
            row.iter()
                .map(|(_, v)| literal(*v))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        actors::testkit::Write::Update(r, key, changes) => format!(
            "UPDATE {r} SET {} WHERE {}",
            changes
                .iter()
                .map(|(c, v)| format!("{c} = {}", literal(*v)))
                .collect::<Vec<_>>()
                .join(", "),
            condition(key)
        ),
        actors::testkit::Write::Delete(r, key) => {
            format!("DELETE FROM {r} WHERE {}", condition(key))
        }
        actors::testkit::Write::Truncate(r) => format!("TRUNCATE {r} CASCADE"),
    }
}

#[cfg(feature = "testkit")]
#[allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)] // test support fails loudly
impl actors::testkit::CaptureWorld for PgWorld {
    type S = PgStore;

    fn store(&self) -> &PgStore {
        &self.store
    }

    async fn write(&self, writes: &[actors::testkit::Write<'_>]) -> actors::capture::Lsn {
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

    async fn grant(&self, user: &str, scope: &str, on: bool) {
        let sql = if on {
            "INSERT INTO synchro.scope_grants (user_id, scope_id) VALUES ($1, $2) ON CONFLICT DO NOTHING"
        } else {
            "DELETE FROM synchro.scope_grants WHERE user_id = $1 AND scope_id = $2"
        };
        sqlx::query(sql)
            .bind(user)
            .bind(scope)
            .execute(self.store.pool())
            .await
            .unwrap();
    }

    async fn retire(&self, client_id: &str) {
        let mut tx = self.store.begin().await.unwrap();
        assert!(tx.retire_client(client_id).await.unwrap());
        tx.commit().await.unwrap();
    }

    async fn lose_slot(&self) {
        // An active slot cannot be dropped: end its walsender first. The
        // materializer reconnects at once, so this may take a few rounds.
        let slot = self.store.feed_target.slot();
        for _ in 0..200 {
            sqlx::query(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
                 WHERE slot_name = $1 AND active_pid IS NOT NULL",
            )
            .bind(&slot)
            .execute(self.store.pool())
            .await
            .unwrap();
            let dropped = sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(&slot)
                .execute(self.store.pool())
                .await;
            if dropped.is_ok() {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("the slot could not be dropped");
    }

    async fn cut_baseline_at(&self, index: u64) {
        // A deferred constraint trigger fails the commit of the transaction
        // that records chunk `index`, once (a sequence counts outside it).
        let chunks = i64::try_from(index).unwrap() + 1;
        sqlx::raw_sql(&format!(
            "DROP SEQUENCE IF EXISTS synchro.test_cut_baselines; \
             CREATE SEQUENCE synchro.test_cut_baselines; \
             CREATE OR REPLACE FUNCTION synchro.test_cut_baseline() RETURNS trigger \
             LANGUAGE plpgsql AS $$ BEGIN \
               IF NEW.baseline_chunks = {chunks} \
                  AND nextval('synchro.test_cut_baselines') = 1 THEN \
                 RAISE EXCEPTION 'injected commit failure' USING ERRCODE = '08006'; \
               END IF; RETURN NULL; END $$; \
             DROP TRIGGER IF EXISTS test_cut_baseline ON synchro.capture_slot; \
             CREATE CONSTRAINT TRIGGER test_cut_baseline AFTER UPDATE \
             ON synchro.capture_slot DEFERRABLE INITIALLY DEFERRED \
             FOR EACH ROW EXECUTE FUNCTION synchro.test_cut_baseline();"
        ))
        .execute(self.store.pool())
        .await
        .unwrap();
    }

    async fn baseline_was_cut(&self) -> bool {
        sqlx::query_scalar("SELECT is_called FROM synchro.test_cut_baselines")
            .fetch_one(self.store.pool())
            .await
            .unwrap()
    }

    async fn fail_checkpoint_commits(&self, n: usize) {
        // A deferred constraint trigger runs at COMMIT, after every write
        // of the transaction; a sequence counts the failures outside the
        // transactions it fails.
        let n = i64::try_from(n).unwrap();
        sqlx::raw_sql(&format!(
            "DROP SEQUENCE IF EXISTS synchro.test_failing_commits; \
             CREATE SEQUENCE synchro.test_failing_commits; \
             CREATE OR REPLACE FUNCTION synchro.test_fail_commit() RETURNS trigger \
             LANGUAGE plpgsql AS $$ BEGIN \
               IF nextval('synchro.test_failing_commits') <= {n} THEN \
                 RAISE EXCEPTION 'injected commit failure' USING ERRCODE = '40001'; \
               END IF; RETURN NULL; END $$; \
             DROP TRIGGER IF EXISTS test_fail_commit ON synchro.client_checkpoints; \
             CREATE CONSTRAINT TRIGGER test_fail_commit AFTER INSERT OR UPDATE \
             ON synchro.client_checkpoints DEFERRABLE INITIALLY DEFERRED \
             FOR EACH ROW EXECUTE FUNCTION synchro.test_fail_commit();"
        ))
        .execute(self.store.pool())
        .await
        .unwrap();
    }
}
