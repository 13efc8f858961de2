//! How a store operation fails: a leaf, so that the contracts a store
//! speaks (capture, the ledger's, the stream's) can name it without
//! importing the store.

use std::fmt;

/// A store operation failed. Every kind rolls the transaction back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// An operational failure a retry can cure (connection lost, serialization
    /// failure, resources exhausted, shutdown): retryable 503.
    Unavailable(String),
    /// The request carried a value the database cannot hold (invalid text, a
    /// number out of range, a non-canonical spelling): terminal, never retried.
    Data(String),
    /// Durable state violates an invariant: 500 `sync_integrity_failure`.
    Integrity(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Unavailable(m) => write!(f, "store unavailable: {m}"),
            StoreError::Data(m) => write!(f, "store refused a request value: {m}"),
            StoreError::Integrity(m) => write!(f, "store integrity: {m}"),
        }
    }
}

impl std::error::Error for StoreError {}
