//! One abusive user beside ordinary ones, under faults; and the planted
//! bugs the admission invariants must catch. Run with:
//! `RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target/sim MADSIM_TEST_SEED=1 MADSIM_TEST_NUM=32 cargo test -p sim --test abuse`
#![cfg(madsim)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use invariants::admission::{check_fair, check_rate, check_registrations};
use sim::abuse::{AbuseScenario, AbuseTrace, config, ordinary_users, run_abuse};

fn reproduce(test: &str) -> String {
    let seed = madsim::runtime::Handle::current().seed();
    format!(
        "reproduce with: MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo test -p sim --test abuse {test}"
    )
}

/// Every admission invariant's violations in `trace`.
fn violations(scenario: &AbuseScenario, trace: &AbuseTrace) -> Vec<String> {
    let limits = config(false).limits;
    let cap = limits.registrations_per_user_per_hour;
    let mut v = trace.problems.clone();
    // The abuser's pages within its rate (an answer arrives within a
    // second of its admission).
    v.extend(
        check_rate(
            &trace.answers,
            sim::abuse::ABUSER,
            limits.requests_per_user_per_second,
            limits.request_burst_per_user,
            1_000_000,
        )
        .err()
        .unwrap_or_default(),
    );
    v.extend(
        check_fair(&trace.answers, &ordinary_users(scenario))
            .err()
            .unwrap_or_default(),
    );
    v.extend(trace.session_violations.iter().cloned());
    v.extend(
        check_registrations(&trace.bound, cap)
            .err()
            .unwrap_or_default(),
    );
    v
}

#[madsim::test]
async fn an_abuser_beside_ordinary_users() {
    let reproduce = reproduce("an_abuser_beside_ordinary_users");
    let scenario = AbuseScenario::default();
    let trace = run_abuse(scenario.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}\n{reproduce}"));
    let v = violations(&scenario, &trace);
    assert!(
        v.is_empty(),
        "{} violation(s), first: {}\n{reproduce}",
        v.len(),
        v[0]
    );
    eprintln!(
        "answers {} (abuser: {} 200, {} 429, {} 409, {} 503; ordinary: {} 200, {} 503) session samples {} crashes {}",
        trace.answers.len(),
        trace.count(true, 200),
        trace.count(true, 429),
        trace.count(true, 409),
        trace.count(true, 503),
        trace.count(false, 200),
        trace.count(false, 503),
        trace.samples,
        trace.crashes
    );
    // The abuser met its limits; the ordinary users were served.
    assert!(
        trace.count(true, 429) > 0,
        "the abuser was never refused\n{reproduce}"
    );
    assert!(trace.count(false, 200) > 0, "{reproduce}");
    assert!(trace.samples > 0, "{reproduce}");
}

/// A planted bug: admission computes every user's page share as zero, so
/// ordinary users are refused too; the fairness judge catches it.
#[madsim::test]
async fn refusing_ordinary_users_is_caught() {
    let reproduce = reproduce("refusing_ordinary_users_is_caught");
    let scenario = AbuseScenario {
        plant_zero_share: true,
        ..AbuseScenario::default()
    };
    let trace = run_abuse(scenario.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}\n{reproduce}"));
    let refused = check_fair(&trace.answers, &ordinary_users(&scenario));
    assert!(
        refused.is_err_and(|v| v.iter().any(|m| m.contains("429"))),
        "an ordinary user was never refused\n{reproduce}"
    );
}

/// A planted bug: a new attempt supersedes no session. With a budget too
/// large to stop them, sessions pile up per client and scope.
#[madsim::test]
async fn sessions_that_are_not_superseded_are_caught() {
    let reproduce = reproduce("sessions_that_are_not_superseded_are_caught");
    let scenario = AbuseScenario {
        plant_no_supersede: true,
        plant_blind_usage: true,
        ..AbuseScenario::default()
    };
    let trace = run_abuse(scenario)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{reproduce}"));
    assert!(
        trace
            .session_violations
            .iter()
            .any(|v| v.contains("live sessions of")),
        "{:?}\n{reproduce}",
        trace.session_violations.first()
    );
}

/// A planted bug: usage counts no staged row, so no budget holds; the
/// abuser's clients stage past it.
#[madsim::test]
async fn a_budget_that_does_not_hold_is_caught() {
    let reproduce = reproduce("a_budget_that_does_not_hold_is_caught");
    let scenario = AbuseScenario {
        plant_blind_usage: true,
        ..AbuseScenario::default()
    };
    let trace = run_abuse(scenario)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{reproduce}"));
    assert!(
        trace
            .session_violations
            .iter()
            .any(|v| v.contains("past its")),
        "{:?}\n{reproduce}",
        trace.session_violations.first()
    );
}
