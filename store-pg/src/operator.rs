//! Operator actions and reports (ADR 0012, ADR 0025): what `synchro stream
//! status` and `/metrics` report, `synchro stream reset`, and what
//! `synchro client list` / `show` print. Reads for an operator only: no
//! protocol answer depends on them, so they are PgStore's alone.

use actors::capture::CaptureHealth;
use actors::store::{Store, StoreError, StoreTx};
use protocol::position::{Boundary, StreamPosition};
use sqlx::Row;

use crate::{PgStore, db_error};

/// Further attempts of a reset that met a deadlock or a lost connection.
const RESET_ATTEMPTS: usize = 3;

/// The stream as the database records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamReport {
    pub generation: u64,
    /// The slot's name and where its stream began; `None` before the first feed.
    pub slot: Option<(String, u64)>,
    /// Whether the slot exists, and its WAL status (`lost` when invalidated).
    pub slot_present: Option<String>,
    /// The stream's baseline is not materialized (a new or reset stream).
    pub baseline_owed: bool,
    pub boundary: Boundary,
    /// The retention floor (ADR 0024): a cursor below it is stale.
    pub floor: StreamPosition,
    /// The class of the quarantine that blocks capture, if any.
    pub quarantine: Option<String>,
    /// The blocked transaction's commit LSN (for a broken installation,
    /// the end of durable progress).
    pub quarantine_lsn: Option<u64>,
    /// Relations still being rematerialized (ADR 0020), in the order they are re-read.
    pub rematerializing: Vec<RematerializingReport>,
    /// The WAL the slot holds back; `None` without a slot.
    pub wal: Option<SlotWal>,
    /// Capture as the leader's last heartbeat reports it.
    pub health: CaptureHealth,
    /// Rebuild sessions neither sealed-and-expired nor swept.
    pub rebuild_sessions: u64,
}

/// A relation still being rematerialized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RematerializingReport {
    pub relation: String,
    /// Rows re-read so far.
    pub rows: u64,
    /// The relation's size as the planner estimates it; `None` before its first `ANALYZE`.
    pub estimated_rows: Option<u64>,
}

/// What the replication slot holds back, in bytes of WAL behind the
/// database's current write position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotWal {
    /// Behind the slot's restart position: WAL PostgreSQL must keep.
    pub retained_bytes: u64,
    /// Behind the slot's confirmed position: WAL capture has not confirmed.
    pub unconfirmed_bytes: u64,
}

/// One client, as `synchro client list` and `show` print it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientReport {
    pub client_id: String,
    pub user_id: String,
    pub generation: u64,
    pub retired: bool,
    /// The installed schema version; `None` before its first connect.
    pub schema_version: Option<u64>,
    pub scope_set_version: u64,
    pub assigned_scopes: u64,
    /// Scopes with a checkpoint, and the last time one was acknowledged
    /// (seconds since the epoch).
    pub checkpoints: u64,
    pub last_acknowledged: Option<i64>,
    pub rebuild_sessions: u64,
    /// Push outcomes kept for replay.
    pub push_batches: u64,
    pub push_mutations: u64,
}

/// The client columns both reports read, by client.
const CLIENT_REPORT: &str = "SELECT c.client_id, c.user_id, c.generation, c.retired, \
       c.installed_version, c.scope_set_version, cardinality(c.assigned), \
       (SELECT count(*) FROM synchro.client_checkpoints k WHERE k.client_id = c.client_id), \
       (SELECT extract(epoch FROM max(k.acknowledged_at))::bigint \
          FROM synchro.client_checkpoints k WHERE k.client_id = c.client_id), \
       (SELECT count(*) FROM synchro.rebuild_sessions r \
          WHERE r.client_id = c.client_id AND NOT r.swept), \
       (SELECT count(*) FROM synchro.push_batches b \
          WHERE b.user_id = c.user_id AND b.client_id = c.client_id), \
       (SELECT count(*) FROM synchro.push_mutations m \
          WHERE m.user_id = c.user_id AND m.client_id = c.client_id) \
     FROM synchro.clients c";

/// At most this many clients are listed.
pub const CLIENT_LIST_LIMIT: i64 = 1000;

fn client_report(r: &sqlx::postgres::PgRow) -> Result<ClientReport, StoreError> {
    let count = |i: usize| -> Result<u64, StoreError> {
        Ok(r.try_get::<i64, _>(i).map_err(db_error)?.max(0) as u64)
    };
    Ok(ClientReport {
        client_id: r.try_get(0).map_err(db_error)?,
        user_id: r.try_get(1).map_err(db_error)?,
        generation: count(2)?,
        retired: r.try_get(3).map_err(db_error)?,
        schema_version: r
            .try_get::<Option<i64>, _>(4)
            .map_err(db_error)?
            .map(|v| v.max(0) as u64),
        scope_set_version: count(5)?,
        assigned_scopes: r.try_get::<i32, _>(6).map_err(db_error)?.max(0) as u64,
        checkpoints: count(7)?,
        last_acknowledged: r.try_get(8).map_err(db_error)?,
        rebuild_sessions: count(9)?,
        push_batches: count(10)?,
        push_mutations: count(11)?,
    })
}

impl PgStore {
    /// What `synchro stream status` prints.
    pub async fn stream_report(&self) -> Result<StreamReport, StoreError> {
        let mut tx = self.begin().await?;
        let stream = tx.stream_state().await?;
        let generation = stream.generation;
        let progress = tx.capture_progress().await?;
        let owed: Vec<_> = (tx.rematerializations().await?.into_iter())
            .filter(|r| r.pending)
            .collect();
        let health = tx.capture_health().await?;
        drop(tx);
        let mut rematerializing = Vec::with_capacity(owed.len());
        let mut conn = self.pool.acquire().await.map_err(db_error)?;
        for r in owed {
            let estimated_rows = crate::reread::estimated_rows(&mut conn, &r.relation).await?;
            rematerializing.push(RematerializingReport {
                estimated_rows: estimated_rows.map(|e| e.max(r.rows)),
                relation: r.relation,
                rows: r.rows,
            });
        }
        drop(conn);
        let wal: Option<(i64, i64)> = sqlx::query_as(
            "SELECT (pg_current_wal_lsn() - s.restart_lsn)::bigint, \
                    (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint \
             FROM synchro.capture_slot r JOIN pg_replication_slots s \
               ON s.slot_name = r.slot_name AND s.database = current_database() \
             WHERE s.restart_lsn IS NOT NULL",
        )
        .fetch_optional(&self.pool)
        .await
        .map_err(db_error)?;
        let rebuild_sessions: i64 =
            sqlx::query_scalar("SELECT count(*) FROM synchro.rebuild_sessions WHERE NOT swept")
                .fetch_one(&self.pool)
                .await
                .map_err(db_error)?;
        let slot: Option<(String, i64, Option<String>)> = sqlx::query_as(
            "SELECT r.slot_name, r.consistent_lsn, \
               (SELECT coalesce(s.wal_status, 'present') FROM pg_replication_slots s \
                WHERE s.slot_name = r.slot_name AND s.database = current_database()) \
             FROM synchro.capture_slot r",
        )
        .fetch_optional(&self.pool)
        .await
        .map_err(db_error)?;
        Ok(StreamReport {
            generation,
            slot_present: slot.as_ref().and_then(|s| s.2.clone()),
            slot: slot.map(|(name, lsn, _)| (name, lsn.max(0) as u64)),
            baseline_owed: progress.baseline_owed,
            boundary: progress.boundary,
            floor: stream.floor,
            quarantine: (progress.quarantine.as_ref()).map(|q| q.problem.as_str().to_owned()),
            quarantine_lsn: progress.quarantine.as_ref().map(|q| q.commit_lsn),
            rematerializing,
            wal: wal.map(|(retained, unconfirmed)| SlotWal {
                retained_bytes: retained.max(0) as u64,
                unconfirmed_bytes: unconfirmed.max(0) as u64,
            }),
            health,
            rebuild_sessions: rebuild_sessions.max(0) as u64,
        })
    }

    /// `synchro quarantine retry`: forgets the recorded quarantine, so that
    /// the leader's next attempt (every `[capture] retry_ms`) is judged
    /// afresh; a cause not repaired quarantines it again. Whether one was
    /// recorded.
    pub async fn clear_quarantine(&self) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE synchro.capture_progress SET quarantine_lsn = NULL, quarantine_class = NULL \
             WHERE quarantine_class IS NOT NULL",
        )
        .execute(&self.pool)
        .await
        .map_err(db_error)?;
        Ok(done.rows_affected() > 0)
    }

    /// The clients of `user_id`, by client ID, at most `CLIENT_LIST_LIMIT`.
    pub async fn clients_of(&self, user_id: &str) -> Result<Vec<ClientReport>, StoreError> {
        let rows = sqlx::query(&format!(
            "{CLIENT_REPORT} WHERE c.user_id = $1 ORDER BY c.client_id LIMIT {CLIENT_LIST_LIMIT}"
        ))
        .bind(user_id)
        .fetch_all(&self.pool)
        .await
        .map_err(db_error)?;
        rows.iter().map(client_report).collect()
    }

    /// One client; `None` when no such client ever connected or pushed.
    pub async fn client_report(&self, client_id: &str) -> Result<Option<ClientReport>, StoreError> {
        let row = sqlx::query(&format!("{CLIENT_REPORT} WHERE c.client_id = $1"))
            .bind(client_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error)?;
        row.as_ref().map(client_report).transpose()
    }

    /// The stream reset: one transaction begins a new stream generation and
    /// owes its baseline; the capture leader (any `synchro serve` on this
    /// database) drops the old slot, creates a new one and materializes the
    /// baseline under its snapshot. The new generation. A reset that meets
    /// a deadlock (with a pull reading what it truncates) is tried again.
    pub async fn reset_stream(&self) -> Result<u64, StoreError> {
        let mut attempt = 0;
        loop {
            let result = async {
                let mut tx = self.begin().await?;
                let generation = tx.reset_stream().await?;
                tx.commit().await?;
                Ok(generation)
            }
            .await;
            match result {
                Err(StoreError::Unavailable(_)) if attempt < RESET_ATTEMPTS => attempt += 1,
                other => return other,
            }
        }
    }
}
