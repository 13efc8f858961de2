//! What pull and rebuild share: a request answered in one snapshot
//! transaction, run again when the snapshot loses a race, and the outer
//! steps of the dispatch before their own (bind, retirement, the
//! generation and schema gates).

use std::future::Future;

use protocol::error::{ErrorKind, ProtocolError, UnavailableReason};
use protocol::ids::ScopeId;
use protocol::manifest::{Manifest, SchemaRef};

use crate::capture::CaptureProgress;
use crate::registry::{Registry, store_error};
use crate::reply::Reply;
use crate::store::{ClientRecord, RequestFrame, Store, StoreError, StoreTx};
use crate::visibility::{MAX_WAITED_FENCES, Visibility};

/// How often an attempt whose snapshot lost a write conflict runs again
/// before it answers 503.
const SNAPSHOT_ATTEMPTS: usize = 4;

/// Why one attempt failed: a store failure (an operational one is retried),
/// the protocol answer, or writes of the client still awaiting capture
/// (waited for, then `capture_pending`).
pub enum Failure {
    Store(StoreError),
    Protocol(ProtocolError),
    /// These fences of the client are pending (at most `MAX_WAITED_FENCES`).
    Pending(Vec<u64>),
}

impl From<StoreError> for Failure {
    fn from(e: StoreError) -> Failure {
        Failure::Store(e)
    }
}

impl From<ProtocolError> for Failure {
    fn from(e: ProtocolError) -> Failure {
        Failure::Protocol(e)
    }
}

/// No attempt starts once this long has passed since the first: a
/// database that is gone (a connection is awaited at most 2 s) is answered
/// `503` after one attempt, not after every attempt waited for it.
const RETRY_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);

/// Runs `attempt` until it answers: a snapshot that lost a write conflict
/// (or a lost connection) runs again, and the client never sees it; one
/// that finds the client's writes awaiting capture runs again once capture
/// reports them materialized, within `visibility.bound` from the start.
pub async fn retried<F, Fut>(visibility: &Visibility, mut attempt: F) -> Reply
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Vec<u8>, Failure>>,
{
    let deadline = tokio::time::Instant::now() + visibility.bound;
    loop {
        // Watched before the attempt's snapshot: no report falls between.
        let mut watch = visibility.reports.watch();
        match attempts(&mut attempt).await {
            Err(pending) => {
                // Checked first: a watch that fell behind answers at once,
                // which must not run attempts past the bound.
                if tokio::time::Instant::now() >= deadline
                    || !watch.satisfied(&pending, deadline).await
                {
                    let mut reply = Reply::error(&ProtocolError::new(ErrorKind::CapturePending));
                    reply.retry_after = Some(visibility.reports.retry_after());
                    return reply;
                }
            }
            Ok(reply) => return reply,
        }
    }
}

/// Up to `SNAPSHOT_ATTEMPTS` of `attempt`: its answer, or the client's
/// fences that await capture.
async fn attempts<F, Fut>(attempt: &mut F) -> Result<Reply, Vec<u64>>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Vec<u8>, Failure>>,
{
    let mut last = None;
    let started = tokio::time::Instant::now();
    for _ in 0..SNAPSHOT_ATTEMPTS {
        if last.is_some() && started.elapsed() >= RETRY_BUDGET {
            break;
        }
        match attempt().await {
            Ok(body) => return Ok(Reply::ok(body)),
            Err(Failure::Store(StoreError::Unavailable(m))) => {
                last = Some(StoreError::Unavailable(m));
            }
            Err(Failure::Store(e)) => return Ok(Reply::error(&store_error(e))),
            Err(Failure::Protocol(e)) => return Ok(Reply::error(&e)),
            Err(Failure::Pending(fences)) => {
                assert!(!fences.is_empty(), "a pending answer names its fences");
                return Err(fences);
            }
        }
    }
    let e = last.unwrap_or(StoreError::Unavailable("no attempt".into()));
    Ok(Reply::error(&store_error(e)))
}

/// The request's first read, its frame: it fixes the boundary B (the
/// snapshot holds exactly the state materialized through it) and reads
/// the named client with what the later steps need of it.
pub async fn frame<T: StoreTx + Send>(
    tx: &mut T,
    named: Option<&str>,
) -> Result<RequestFrame, StoreError> {
    tx.request_frame(named, MAX_WAITED_FENCES).await
}

/// Step 1: the client the body names, as the request's frame found it
/// (locked), when it is bound to `user_id`; `None` when the body names
/// none (structure decides).
pub fn bind(
    user_id: &str,
    named: Option<&str>,
    found: Option<ClientRecord>,
) -> Result<Option<ClientRecord>, Failure> {
    if named.is_none() {
        return Ok(None);
    }
    match found {
        Some(c) if c.user_id == user_id => {
            assert!(
                named == Some(c.client_id.as_str()),
                "the frame's client is the named one"
            );
            Ok(Some(c))
        }
        _ => Err(ProtocolError::new(ErrorKind::AuthRequired).into()),
    }
}

/// Step 9's gates: capture must be running (`capture_blocked` otherwise)
/// and must have materialized every write accepted from the client: its
/// `pending` fences, as the request's frame read them (`Failure::Pending`
/// otherwise: waited for, then `capture_pending`).
pub fn capture_gates(progress: &CaptureProgress, pending: &[u64]) -> Result<(), Failure> {
    // A baseline still owed (a new or reset stream) blocks as a quarantine does.
    if progress.quarantine.is_some() || progress.baseline_owed {
        return Err(ProtocolError::new(ErrorKind::TemporaryUnavailable {
            reason: Some(UnavailableReason::CaptureBlocked),
        })
        .into());
    }
    if !pending.is_empty() {
        return Err(Failure::Pending(pending.to_vec()));
    }
    Ok(())
}

/// Step 9's evolution gate (ADR 0020), `503 temporary_unavailable`: a
/// process whose config is older than the newest stored manifest serves
/// no page (a rolling deploy's old process), and a scope that may hold
/// rows of a relation not yet all rematerialized under the current model
/// is not served (its rows could still be in the old model, or not yet in
/// their new scopes).
pub fn rematerialization_gate<'s, S: Store>(
    registry: &Registry<S>,
    progress: &CaptureProgress,
    mut scopes: impl Iterator<Item = &'s ScopeId>,
) -> Result<(), ProtocolError> {
    if progress.newest_schema_version > registry.current().schema_version() {
        return Err(
            ProtocolError::new(ErrorKind::TemporaryUnavailable { reason: None })
                .with_message("a newer configuration is active on another process"),
        );
    }
    if progress.rematerializing.is_empty()
        || !scopes.any(|s| registry.rematerializing(&progress.rematerializing, s))
    {
        return Ok(());
    }
    Err(
        ProtocolError::new(ErrorKind::TemporaryUnavailable { reason: None })
            .with_message("a table of this scope is being rematerialized"),
    )
}

/// A pull or rebuild that passed the gates presented the client's
/// generation: the identity is known from now on, and a fresh-sentinel
/// connect for it is `400 invalid_schema_reference` (ADR 0003 §2). Whether
/// the record changed (the caller writes it).
pub fn present_generation(client: &mut ClientRecord) -> bool {
    !std::mem::replace(&mut client.continued, true)
}

/// Steps 4 and 6: retirement, the exact current generation, then the
/// exact current schema.
pub fn gates(
    client: &ClientRecord,
    presented_generation: u64,
    schema: SchemaRef,
    current: &Manifest,
) -> Result<(), ProtocolError> {
    if client.retired {
        return Err(ProtocolError::new(ErrorKind::ClientRetired));
    }
    if presented_generation != client.generation {
        return Err(ProtocolError::new(ErrorKind::ClientGenerationExpired {
            current_client_generation: client.generation,
        }));
    }
    if schema != current.reference() {
        return Err(ProtocolError::new(ErrorKind::SchemaMismatch {
            current_schema: current.reference(),
            received_schema: schema,
        }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use protocol::position::Boundary;

    use super::*;

    fn progress(baseline_owed: bool) -> CaptureProgress {
        CaptureProgress {
            boundary: Boundary::GenerationStart,
            end_lsn: 0,
            quarantine: None,
            baseline_owed,
            rematerializing: Default::default(),
            newest_schema_version: 1,
        }
    }

    /// A baseline still owed blocks every pull and rebuild: its rows carry
    /// no effects, so a cursor issued before it ends would never receive
    /// the rows its later chunks commit (ADR 0033).
    #[test]
    fn a_baseline_owed_blocks() {
        let blocked = match capture_gates(&progress(true), &[]) {
            Err(Failure::Protocol(e)) => e,
            _ => panic!("a baseline owed let a request through"),
        };
        assert_eq!(
            blocked.kind(),
            &ErrorKind::TemporaryUnavailable {
                reason: Some(UnavailableReason::CaptureBlocked)
            }
        );
        assert!(capture_gates(&progress(false), &[]).is_ok());
        assert!(matches!(
            capture_gates(&progress(false), &[7]),
            Err(Failure::Pending(p)) if p == [7]
        ));
    }
}
