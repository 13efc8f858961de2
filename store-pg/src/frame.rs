//! The first read of a pull or a rebuild in one statement (ADR 0027):
//! capture progress, the stream, and the named client locked, with its
//! unsatisfied fences and its checkpoints. Each round trip of a request
//! can wait for a core while capture is busy beside it, so a request makes
//! as few as it can.

use actors::store::{RequestFrame, StoreError};
use sqlx::Row;

use crate::materialized::{progress_at, progress_columns};
use crate::sql::{to_i64, to_u64};
use crate::stream::{
    CHECKPOINT_ARRAYS, STREAM_COLUMNS, UNSATISFIED_FENCES, checkpoints_at, stream_at,
};
use crate::{CLIENT_COLUMNS, CLIENT_WIDTH as CLIENT, PgTx, client_at, db_error};

/// Columns of each part, in the statement's order.
const PROGRESS: usize = 7;
const STREAM: usize = 5;

impl PgTx {
    pub(crate) async fn read_request_frame(
        &mut self,
        client_id: Option<&str>,
        max_fences: usize,
    ) -> Result<RequestFrame, StoreError> {
        // The client's row is locked by the subquery that reads it; an
        // absent client (or none named) leaves its columns null.
        let sql = format!(
            "SELECT {progress}, {STREAM_COLUMNS}, {CLIENT_COLUMNS}, \
               ARRAY({UNSATISFIED_FENCES}), k.* \
             FROM synchro.capture_progress p CROSS JOIN synchro.stream s \
             LEFT JOIN LATERAL (SELECT * FROM synchro.clients WHERE client_id = $1 FOR UPDATE) c \
               ON true \
             CROSS JOIN LATERAL (SELECT {CHECKPOINT_ARRAYS} \
               FROM synchro.client_checkpoints k WHERE k.client_id = $1) k",
            progress = progress_columns(),
        );
        let r = sqlx::query(&sql)
            .bind(client_id)
            .bind(to_i64(max_fences as u64)?)
            .fetch_one(&mut *self.tx)
            .await
            .map_err(db_error)?;
        let progress = progress_at(&r, 0)?;
        let stream = stream_at(&r, PROGRESS)?;
        let client = match client_id {
            Some(id) => client_at(&r, PROGRESS + STREAM, id)?,
            None => None,
        };
        let fences: Vec<i64> = r.try_get(PROGRESS + STREAM + CLIENT).map_err(db_error)?;
        let frame = RequestFrame {
            progress,
            stream,
            pending_fences: fences.into_iter().map(to_u64).collect::<Result<_, _>>()?,
            checkpoints: checkpoints_at(&r, PROGRESS + STREAM + CLIENT + 1)?,
            client,
        };
        assert!(
            frame.pending_fences.len() <= max_fences,
            "at most the fences asked for"
        );
        assert!(
            frame.pending_fences.windows(2).all(|w| w[0] < w[1]),
            "fences in order"
        );
        Ok(frame)
    }
}
