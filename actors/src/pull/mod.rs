//! Pull (ADR 003). So far the page construction: per-scope eligibility and
//! deduplication before the global limit, the starvation-free merge, and
//! the greatest safe cursor of each scope. The pull actor that reads the
//! effects at one boundary and answers `/sync/pull` is not built yet.

pub mod page;
