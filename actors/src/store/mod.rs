//! The storage boundary: typed transactional primitives with no protocol
//! decisions in them. `PgStore` (crate `store-pg`) and [`MemStore`] implement
//! the same traits; the store-conformance suite keeps them in agreement.

mod mem;

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;

pub use mem::MemStore;
use protocol::ids::ScopeId;
use protocol::manifest::{Manifest, SchemaRef};

use crate::config::DependencyAssignment;

/// A store operation failed. Both kinds roll the transaction back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// A transient failure (connection lost, serialization failure): retryable 503.
    Unavailable(String),
    /// Durable state violates an invariant: 500 `sync_integrity_failure`.
    Integrity(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Unavailable(m) => write!(f, "store unavailable: {m}"),
            StoreError::Integrity(m) => write!(f, "store integrity: {m}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// The durable state of one client identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientRecord {
    /// The user the client_id is bound to, forever.
    pub user_id: String,
    pub client_id: String,
    /// The current positive generation.
    pub generation: u64,
    /// Irreversibly retired: every request answers 409 `client_retired`.
    pub retired: bool,
    /// The schema the client last presented on connect (`None` before any).
    pub installed_schema: Option<SchemaRef>,
    /// The version of `assigned`; changes by exactly one when `assigned` changes.
    pub scope_set_version: u64,
    /// The authoritative assignment at `scope_set_version`.
    pub assigned: BTreeSet<ScopeId>,
}

/// A database handle that opens transactions.
pub trait Store: Clone + Send + Sync + 'static {
    type Tx: StoreTx;

    /// Opens a transaction.
    fn begin(&self) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;
}

/// One transaction. Dropping it without `commit` rolls it back.
pub trait StoreTx: Send {
    /// Every stored manifest, by ascending version.
    fn manifests(&mut self) -> impl Future<Output = Result<Vec<Manifest>, StoreError>> + Send;

    /// Stores a new manifest; its version must be above every stored one.
    fn insert_manifest(
        &mut self,
        m: &Manifest,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Reads and locks the client with this ID (under any user) until commit.
    fn lock_client(
        &mut self,
        client_id: &str,
    ) -> impl Future<Output = Result<Option<ClientRecord>, StoreError>> + Send;

    /// Inserts or replaces the client's record.
    fn put_client(
        &mut self,
        c: &ClientRecord,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Scopes granted to the user in `synchro.scope_grants`.
    fn grants(
        &mut self,
        user_id: &str,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;

    /// Values of `value_column` in the rows of the dependency relation whose `user_column` is the user.
    fn dependency_values(
        &mut self,
        source: &DependencyAssignment,
        user_id: &str,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;

    /// Makes every write of the transaction durable.
    fn commit(self) -> impl Future<Output = Result<(), StoreError>> + Send;
}
