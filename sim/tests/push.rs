//! Push under faults: response loss with retry, duplicate and concurrent
//! pushes, mutation reuse, atomic groups, server crashes mid-push, and
//! direct application writes racing the pushes. Run with:
//! `RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target/sim MADSIM_TEST_SEED=1 MADSIM_TEST_NUM=32 cargo test -p sim --test push`
#![cfg(madsim)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use sim::push::{PushScenario, run_push};

#[madsim::test]
async fn push_under_faults() {
    let seed = madsim::runtime::Handle::current().seed();
    let reproduce = format!(
        "reproduce with: MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo test -p sim --test push"
    );
    let trace = match run_push(PushScenario::default()).await {
        Ok(t) => t,
        Err(e) => panic!("{e}\n{reproduce}"),
    };
    assert!(
        trace.problems.is_empty(),
        "{:?}\n{reproduce}",
        trace.problems
    );
    let stats = match invariants::push::check_push(&trace.exchanges, &trace.chains, &trace.direct) {
        Ok(s) => s,
        Err(v) => panic!(
            "{} push violation(s), first: {}\n{reproduce}",
            v.len(),
            v[0]
        ),
    };
    eprintln!(
        "stats: {stats:?} retries {} duplicates {} unavailable {} crashes {} direct {} chains {} elapsed {:?}",
        trace.retries,
        trace.duplicates,
        trace.unavailable,
        trace.crashes,
        trace.direct.len(),
        trace.chains.len(),
        madsim::time::TimeHandle::current().elapsed()
    );
    assert!(trace.crashes >= 1, "the server crashed\n{reproduce}");
    assert!(
        stats.applied > 0 && stats.conflicts > 0,
        "{stats:?}\n{reproduce}"
    );
}
