//! The same seed gives the identical trace: every recorded request, answer
//! and fault, byte for byte. A different seed gives a different one.
#![cfg(madsim)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use madsim::runtime::Runtime;
use sim::{Scenario, Trace, run};

fn trace(seed: u64) -> Trace {
    let runtime = Runtime::with_seed_and_config(seed, madsim::Config::default());
    runtime.block_on(run(Scenario {
        clients: 3,
        connects_per_client: 6,
        ..Scenario::default()
    }))
}

fn fingerprint(t: &Trace) -> String {
    format!(
        "{:?}",
        (&t.connects, &t.events, t.retries, t.crashes, t.unavailable)
    )
}

#[test]
fn same_seed_same_trace() {
    let a = trace(11);
    let b = trace(11);
    assert!(!a.connects.is_empty() && !a.events.is_empty());
    assert_eq!(fingerprint(&a), fingerprint(&b));
    assert_ne!(fingerprint(&a), fingerprint(&trace(12)));
}
