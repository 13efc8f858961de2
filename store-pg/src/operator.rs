//! Operator actions on the capture stream (ADR 0012): what `synchro stream
//! status` reports, and `synchro stream reset`.

use actors::store::{Store, StoreError, StoreTx};
use protocol::position::{Boundary, StreamPosition};

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
    /// Relations still being rematerialized (ADR 0020), with the rows re-read so far.
    pub rematerializing: Vec<(String, u64)>,
}

impl PgStore {
    /// What `synchro stream status` prints.
    pub async fn stream_report(&self) -> Result<StreamReport, StoreError> {
        let mut tx = self.begin().await?;
        let stream = tx.stream_state().await?;
        let generation = stream.generation;
        let progress = tx.capture_progress().await?;
        let rematerializing = (tx.rematerializations().await?.into_iter())
            .filter(|r| r.pending)
            .map(|r| (r.relation, r.rows))
            .collect();
        drop(tx);
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
            quarantine: progress.quarantine.map(|q| q.problem.as_str().to_owned()),
            rematerializing,
        })
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
