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
    if let Err(v) = invariants::push::check_fences(&trace.pending) {
        panic!(
            "{} fence violation(s), first: {}\n{reproduce}",
            v.len(),
            v[0]
        );
    }
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

/// The planted bug of issue 24: a materialization satisfies only the pending
/// fences it can see, so a push decoded before it was visible leaves its
/// client pending for ever. The fence invariant catches it.
#[madsim::test]
async fn a_fence_satisfied_only_where_visible_is_caught() {
    let seed = madsim::runtime::Handle::current().seed();
    let scenario = PushScenario {
        plant_fences_by_visibility: true,
        ..PushScenario::default()
    };
    let trace = run_push(scenario).await.unwrap();
    assert!(
        invariants::push::check_fences(&trace.pending).is_err(),
        "the planted bug went unseen; reproduce with: MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo test -p sim --test push"
    );
}

/// The planted bug of issue 29: a key of the wrong JSON type read leniently
/// (a number as the UUID with that number) gets per-mutation outcomes
/// instead of the whole request's `400`. The push invariant catches it.
#[madsim::test]
async fn a_coerced_key_is_caught() {
    let seed = madsim::runtime::Handle::current().seed();
    let scenario = PushScenario {
        plant_coerced_keys: true,
        poisoned_share: 0.5,
        ..PushScenario::default()
    };
    let trace = run_push(scenario).await.unwrap();
    let violations =
        invariants::push::check_push(&trace.exchanges, &trace.chains, &trace.direct).unwrap_err();
    assert!(
        violations
            .iter()
            .any(|v| v.contains("key of the wrong type")),
        "the planted bug went unseen: {violations:?}; reproduce with: MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo test -p sim --test push"
    );
}
