#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
//! The synchro engine: protocol logic in actors over a thin, typed store.
//!
//! Runs unchanged on tokio and under the madsim simulator: no OS threads,
//! no real clock (callers pass the time in), no ambient entropy.

pub mod admission;
pub mod attempt;
pub mod capture;
pub mod config;
pub mod cursor;
pub mod engine;
pub mod error;
pub mod key_ring;
pub mod ledger;
pub mod materializer;
pub mod pull;
pub mod rebuild;
pub mod registry;
pub mod reply;
pub mod retention;
pub mod staging;
pub mod store;
pub mod stream;
pub mod visibility;

pub use engine::Engine;
pub use reply::Reply;
#[cfg(feature = "testkit")]
pub mod testkit;
