//! WAL capture under faults: direct writes racing the materializer, server
//! crashes at arbitrary points, lost store messages and redelivered
//! transactions. Run with:
//! `RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target/sim MADSIM_TEST_SEED=1 MADSIM_TEST_NUM=32 cargo test -p sim --test capture`
#![cfg(madsim)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use sim::capture::{CaptureScenario, run_capture};

#[madsim::test]
async fn capture_under_faults() {
    let seed = madsim::runtime::Handle::current().seed();
    let reproduce = format!(
        "reproduce with: MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo test -p sim --test capture"
    );
    let trace = match run_capture(CaptureScenario::default()).await {
        Ok(t) => t,
        Err(e) => panic!("{e}\n{reproduce}"),
    };
    eprintln!(
        "stats: commits {} effects {} projections {} crashes {} redeliveries {} elapsed {:?}",
        trace.history.len(),
        trace.effects.len(),
        trace.projections.len(),
        trace.crashes,
        trace.redeliveries,
        madsim::time::TimeHandle::current().elapsed()
    );
    assert!(trace.crashes >= 1, "the materializer crashed\n{reproduce}");
    assert!(!trace.effects.is_empty());
    let checked =
        invariants::capture::check_capture(&trace.history, &trace.effects, &trace.projections)
            .and_then(|()| invariants::capture::check_members(&trace.effects, &trace.members));
    assert!(!trace.members.is_empty(), "the membership index was read");
    if let Err(v) = checked {
        panic!(
            "{} capture violation(s), first: {}\n{reproduce}",
            v.len(),
            v[0]
        );
    }
}
