#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
//! A client of the Synchro protocol, version 3, written from the wire
//! spec's client rules: a local copy of the rows of every assigned scope
//! (with provenance: a row held by two scopes stays until both remove it),
//! an outbox of sealed batches that survives a restart and is resent byte
//! for byte until a terminal answer, every `row_checksum` verified before
//! apply and every terminal scope checksum recomputed before a cursor is
//! installed, and the retry, reconnect and restart rules.
//!
//! - [`Client`] ([`sync`]): connect, push, pull, rebuild, and the
//!   application's view of its rows and outcomes.
//! - [`LocalStore`] ([`local`]): where the state is kept; [`MemoryStore`]
//!   (deterministic, for tests and the simulator) and, with the `sqlite`
//!   feature, [`SqliteStore`].
//! - [`Transport`] ([`transport`]): how a request reaches the server;
//!   [`HttpTransport`] outside the simulator.

pub mod local;
pub mod outbox;
pub mod page;
pub mod retry;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod sync;
pub mod transport;

pub use local::{LocalStore, MemoryStore};
pub use outbox::{Write, WriteOp};
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;
pub use sync::{Client, Config, PullReport, PushReport, RowView, SyncError, WriteError};
#[cfg(not(madsim))]
pub use transport::HttpTransport;
pub use transport::{Answer, Endpoint, Transport, TransportError};

/// `unix_micros` as the wire's datetime form (a write's `client_version`).
pub fn datetime(unix_micros: i64) -> String {
    protocol::wire::format_server_time(unix_micros)
}
