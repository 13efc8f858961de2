#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]
//! The Synchro protocol version 3 wire contract, with no I/O.
//!
//! Everything here is pure and total: every function returns an error for
//! bad input instead of panicking. The engine, the HTTP adapter, the
//! simulator's model client and the invariant checkers all use this crate,
//! so it is the single definition of the contract's bytes.

pub mod digest;
pub mod error;
pub mod ids;
pub mod json;
pub mod limits;
pub mod manifest;
mod members;
pub mod sha256;
pub mod value;

pub use members::ShapeError;
pub mod fingerprint;
pub mod position;
pub mod token;
pub mod wire;
