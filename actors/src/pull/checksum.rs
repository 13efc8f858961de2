//! Terminal scope checksums, cached. A scope's digest at a boundary is a
//! function of (stream generation, schema, scope, the scope's last effect
//! at or before the boundary): the membership index and its row digests
//! change only in a materialization, and every change of a scope's members
//! (a row joining, leaving, changing, deleted) writes an effect in that
//! scope in the same transaction. So a steady pull of an unchanged scope
//! reads one index entry, not every row. Debug builds (every test and the
//! simulator) recompute each cache hit and assert it equal.

use std::collections::BTreeMap;
use std::sync::Mutex;

use protocol::digest::{Digest, ScopeDigest};
use protocol::ids::ScopeId;
use protocol::position::{Boundary, StreamPosition};

use crate::store::{StoreError, StoreTx};

/// What determines a scope's digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    stream_generation: u64,
    schema_hash: Digest,
    last_effect: Option<StreamPosition>,
}

/// Scopes kept at most; past this the cache starts over (it is only a cache).
const MAX_CACHED_SCOPES: usize = 100_000;

/// The latest digest computed for each scope.
#[derive(Default)]
pub struct ChecksumCache {
    scopes: Mutex<BTreeMap<ScopeId, (Key, Digest)>>,
}

impl ChecksumCache {
    /// The digest of `scope` at `boundary`, read in the caller's snapshot.
    pub async fn digest<T: StoreTx>(
        &self,
        tx: &mut T,
        stream_generation: u64,
        schema_hash: &Digest,
        scope: &ScopeId,
        boundary: Boundary,
    ) -> Result<Digest, StoreError> {
        // Every effect at or before the boundary is before its transaction end.
        let end = match boundary {
            Boundary::GenerationStart => StreamPosition::GenerationStart,
            Boundary::TransactionEnd { commit_lsn } => {
                StreamPosition::TransactionEnd { commit_lsn }
            }
        };
        let key = Key {
            stream_generation,
            schema_hash: *schema_hash,
            last_effect: tx.last_effect_before(scope, end).await?,
        };
        let cached = self
            .lock()
            .get(scope)
            .filter(|(k, _)| *k == key)
            .map(|(_, d)| *d);
        if let Some(d) = cached {
            #[cfg(debug_assertions)]
            assert_eq!(
                d,
                compute(tx, schema_hash, scope).await?,
                "a cached scope digest is the digest"
            );
            return Ok(d);
        }
        let d = compute(tx, schema_hash, scope).await?;
        let mut scopes = self.lock();
        if scopes.len() >= MAX_CACHED_SCOPES {
            scopes.clear();
        }
        scopes.insert(scope.clone(), (key, d));
        Ok(d)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<ScopeId, (Key, Digest)>> {
        // A poisoned cache is still a valid cache: entries are written whole.
        self.scopes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The scope digest over the membership index, in row-identity order.
async fn compute<T: StoreTx>(
    tx: &mut T,
    schema_hash: &Digest,
    scope: &ScopeId,
) -> Result<Digest, StoreError> {
    let members = tx.scope_members(scope).await?;
    let mut d = ScopeDigest::new(schema_hash, scope.as_str(), members.len() as u64);
    for (identity, row) in &members {
        d.push(identity, row);
    }
    d.finish()
        .map_err(|e| StoreError::Integrity(format!("scope digest: {e:?}")))
}
