//! Connect under lost requests, lost responses, server crashes and
//! assignment changes. Run with:
//! `RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target/sim MADSIM_TEST_SEED=1 MADSIM_TEST_NUM=32 cargo test -p sim`
#![cfg(madsim)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use sim::{Scenario, run};

#[madsim::test]
async fn connect_under_faults() {
    let seed = madsim::runtime::Handle::current().seed();
    let trace = run(Scenario::default()).await;
    eprintln!(
        "stats: crashes {} retries {} unavailable {} connects {} elapsed {:?}",
        trace.crashes,
        trace.retries,
        trace.unavailable,
        trace.connects.len(),
        madsim::time::TimeHandle::current().elapsed()
    );
    // The faults happened: the server crashed and messages were lost.
    assert!(
        trace.crashes >= 1 && trace.retries >= 1,
        "crashes {} retries {}",
        trace.crashes,
        trace.retries
    );
    let scenario = Scenario::default();
    let (contested, own): (Vec<_>, Vec<_>) = trace
        .connects
        .iter()
        .partition(|o| o.client_id == "client-contested");
    assert_eq!(
        own.len(),
        scenario.clients * scenario.connects_per_client,
        "every connect was answered"
    );
    // One user won the contested ID; each other user was refused once and stopped.
    let winners: std::collections::BTreeSet<_> = contested
        .iter()
        .filter(|o| o.status == 200)
        .map(|o| o.user.as_str())
        .collect();
    assert_eq!(winners.len(), 1, "exactly one user bound the contested ID");
    assert_eq!(
        contested.iter().filter(|o| o.status == 401).count(),
        scenario.users - 1,
        "every other user was refused"
    );
    if let Err(violations) = invariants::check_connects(&trace.connects) {
        panic!(
            "{} invariant violation(s), first: {}\nreproduce with: MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo test -p sim --test connect",
            violations.len(),
            violations[0]
        );
    }
    // Every non-200 answer here would be a protocol error the clients did not provoke.
    for o in &own {
        assert_eq!(
            o.status,
            200,
            "unexpected error: {}",
            String::from_utf8_lossy(&o.body)
        );
    }
}
