//! Fence reports between processes (ADR 0028). The materializer's commit
//! notifies `synchro_fences` with the fences it satisfied (PostgreSQL
//! delivers a notification only once its transaction commits, and never
//! one of a transaction rolled back). Every process listens on a
//! connection of its own, so that a process that does not lead capture
//! wakes the requests waiting for their client's writes.

use actors::store::{FenceListener, FenceReport, StoreError};
use sqlx::postgres::{PgListener, PgPoolOptions};

use crate::{ACQUIRE_TIMEOUT, PgStore, db_error};

/// The notification channel.
const CHANNEL: &str = "synchro_fences";

/// Fences in one notification: 256 of at most 19 digits and a comma stay
/// under PostgreSQL's 8,000-byte payload.
const FENCES_PER_REPORT: i64 = 256;

/// Ends a statement whose CTEs satisfy the fences in `$1` (an `int8[]`):
/// notifies them, in parts of [`FENCES_PER_REPORT`].
pub(crate) fn notify_satisfied() -> String {
    format!(
        "SELECT pg_notify('{CHANNEL}', string_agg(f::text, ',' ORDER BY n)) \
         FROM unnest($1::int8[]) WITH ORDINALITY AS u(f, n) \
         GROUP BY (n - 1) / {FENCES_PER_REPORT}"
    )
}

/// A process's listener, on a connection of its own (outside the request
/// pool, so that waiting requests never wait for it).
pub struct PgFenceListener {
    listener: PgListener,
}

impl PgStore {
    pub(crate) async fn listen_fences(&self) -> Result<PgFenceListener, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .connect_lazy_with(self.options.clone());
        let mut listener = PgListener::connect_with(&pool).await.map_err(db_error)?;
        listener.listen(CHANNEL).await.map_err(db_error)?;
        Ok(PgFenceListener { listener })
    }
}

impl FenceListener for PgFenceListener {
    async fn next(&mut self) -> Result<FenceReport, StoreError> {
        match self.listener.try_recv().await.map_err(db_error)? {
            Some(n) => Ok(parse(n.payload()).map_or(FenceReport::Missed, FenceReport::Satisfied)),
            // The connection was lost, and with it what was sent meanwhile;
            // the next call connects again.
            None => Ok(FenceReport::Missed),
        }
    }
}

/// A payload's fences; `None` for one this version did not write.
fn parse(payload: &str) -> Option<std::sync::Arc<[u64]>> {
    payload
        .split(',')
        .map(|f| f.parse().ok())
        .collect::<Option<Vec<u64>>>()
        .map(Into::into)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_is_its_fences_or_nothing() {
        assert_eq!(parse("3,17,4").as_deref(), Some(&[3, 17, 4][..]));
        assert_eq!(parse("").as_deref(), None);
        assert_eq!(parse("3,x").as_deref(), None);
        assert_eq!(parse("-1").as_deref(), None);
        // The longest part fits a payload.
        let longest = vec![i64::MAX.to_string(); FENCES_PER_REPORT as usize].join(",");
        assert!(longest.len() < 8000);
    }
}
