//! Retention on PostgreSQL (docs/adr/0024): what holds the floor back, the
//! floor's movement, compaction below it, and a client's retirement. One
//! statement per operation, except retirement, which releases several
//! tables under the client's row lock.

use std::time::Duration;

use actors::store::StoreError;
use protocol::position::StreamPosition;

use crate::materialized::bounds;
use crate::sql::to_i64;
use crate::stream::row_position;
use crate::{PgTx, db_error};

impl PgTx {
    pub(crate) async fn read_retention_hold(
        &mut self,
        stream_generation: u64,
        window: Duration,
    ) -> Result<Option<StreamPosition>, StoreError> {
        // A session's boundary is a transaction end, (lsn, max, max), or
        // the generation start, (-1, 0, 0), as `bounds` stores them.
        let row = sqlx::query(
            "SELECT h.commit_lsn, h.event_ordinal, h.effect_ordinal FROM ( \
               SELECT k.commit_lsn, k.event_ordinal, k.effect_ordinal \
               FROM synchro.client_checkpoints k JOIN synchro.clients c USING (client_id) \
               WHERE NOT c.retired AND k.stream_generation = $1 \
                 AND k.acknowledged_at > now() - make_interval(secs => $2) \
               UNION ALL \
               SELECT coalesce(s.boundary_lsn, -1), \
                 CASE WHEN s.boundary_lsn IS NULL THEN 0 ELSE 9223372036854775807 END, \
                 CASE WHEN s.boundary_lsn IS NULL THEN 0 ELSE 9223372036854775807 END \
               FROM synchro.rebuild_sessions s JOIN synchro.clients c USING (client_id) \
               WHERE NOT c.retired AND s.stream_generation = $1 \
                 AND s.created_at > now() - make_interval(secs => $2) \
                 AND NOT EXISTS (SELECT 1 FROM synchro.client_checkpoints k \
                   WHERE k.client_id = s.client_id AND k.scope_id = s.scope_id \
                     AND k.stream_generation = $1 AND k.acknowledged_at >= s.created_at) \
             ) h, synchro.stream f \
             WHERE (h.commit_lsn, h.event_ordinal, h.effect_ordinal) \
               >= (f.floor_lsn, f.floor_event, f.floor_effect) \
             ORDER BY 1, 2, 3 LIMIT 1",
        )
        .bind(to_i64(stream_generation)?)
        .bind(window.as_secs_f64())
        .fetch_optional(&mut *self.tx)
        .await
        .map_err(db_error)?;
        row.as_ref().map(row_position).transpose()
    }

    pub(crate) async fn write_floor(&mut self, floor: StreamPosition) -> Result<(), StoreError> {
        let f = bounds(floor)?;
        sqlx::query(
            "UPDATE synchro.stream SET floor_lsn = $1, floor_event = $2, floor_effect = $3 \
             WHERE (floor_lsn, floor_event, floor_effect) < ($1, $2, $3)",
        )
        .bind(f.0)
        .bind(f.1)
        .bind(f.2)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(())
    }

    /// Deletes up to `max` deletions and removals below the floor, never
    /// waiting on a row the materializer holds (it may be superseding it):
    /// such a row is left for the next pass, so the two never deadlock.
    pub(crate) async fn delete_below_floor(&mut self, max: usize) -> Result<usize, StoreError> {
        let done = sqlx::query(
            "DELETE FROM synchro.scope_effects d USING ( \
               SELECT e.scope_id, e.commit_lsn, e.event_ordinal, e.effect_ordinal \
               FROM synchro.scope_effects e, synchro.stream f \
               WHERE e.op <> 0 \
                 AND (e.commit_lsn, e.event_ordinal, e.effect_ordinal) \
                   <= (f.floor_lsn, f.floor_event, f.floor_effect) \
                 AND EXISTS (SELECT 1 FROM synchro.scope_effects l WHERE l.scope_id = e.scope_id \
                   AND (l.commit_lsn, l.event_ordinal, l.effect_ordinal) \
                     > (e.commit_lsn, e.event_ordinal, e.effect_ordinal)) \
               ORDER BY e.commit_lsn, e.event_ordinal, e.effect_ordinal LIMIT $1 \
               FOR UPDATE OF e SKIP LOCKED) v \
             WHERE d.scope_id = v.scope_id AND d.commit_lsn = v.commit_lsn \
               AND d.event_ordinal = v.event_ordinal AND d.effect_ordinal = v.effect_ordinal",
        )
        .bind(to_i64(max as u64)?)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        let deleted = done.rows_affected() as usize;
        assert!(deleted <= max, "a compaction batch never exceeds its limit");
        Ok(deleted)
    }

    pub(crate) async fn delete_transactions_below_floor(
        &mut self,
        max: usize,
    ) -> Result<usize, StoreError> {
        let done = sqlx::query(
            "DELETE FROM synchro.source_transactions WHERE commit_lsn IN ( \
               SELECT t.commit_lsn FROM synchro.source_transactions t, synchro.stream f \
               WHERE t.commit_lsn < f.floor_lsn ORDER BY t.commit_lsn LIMIT $1)",
        )
        .bind(to_i64(max as u64)?)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(done.rows_affected() as usize)
    }

    pub(crate) async fn write_retirement(&mut self, client_id: &str) -> Result<bool, StoreError> {
        let user: Option<String> = sqlx::query_scalar(
            "UPDATE synchro.clients SET retired = true WHERE client_id = $1 RETURNING user_id",
        )
        .bind(client_id)
        .fetch_optional(&mut *self.tx)
        .await
        .map_err(db_error)?;
        let Some(user) = user else { return Ok(false) };
        for statement in [
            "DELETE FROM synchro.client_checkpoints WHERE client_id = $1",
            "DELETE FROM synchro.rebuild_sessions WHERE client_id = $1",
        ] {
            sqlx::query(statement)
                .bind(client_id)
                .execute(&mut *self.tx)
                .await
                .map_err(db_error)?;
        }
        for statement in [
            "DELETE FROM synchro.push_mutations WHERE user_id = $1 AND client_id = $2",
            "DELETE FROM synchro.push_batches WHERE user_id = $1 AND client_id = $2",
        ] {
            sqlx::query(statement)
                .bind(&user)
                .bind(client_id)
                .execute(&mut *self.tx)
                .await
                .map_err(db_error)?;
        }
        Ok(true)
    }
}
