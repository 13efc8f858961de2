//! The HTTP adapter and the pieces of the `synchro` binary.
#![cfg(not(madsim))]
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used, clippy::panic))]

pub mod adapter;
pub mod auth;
pub mod listener;
pub mod metrics;
pub mod parse_errors;
pub mod progress;
