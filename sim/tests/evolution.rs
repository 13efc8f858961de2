//! The app evolves under faults (ADR 0020): the config changes mid-run
//! (a field synced over a column with values, a table registered over its
//! rows, a `via` rule's template) while writers write and the server
//! crashes over a lossy link; then a process of the old deploy restarts
//! and must be refused. Run with:
//! `RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target/sim MADSIM_TEST_SEED=1 MADSIM_TEST_NUM=32 cargo test -p sim --test evolution`
#![cfg(madsim)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use sim::evolution::{
    EvolutionScenario, EvolutionTrace, MEMBERSHIPS, SkippedRelation, run_evolution,
};

fn reproduce(test: &str) -> String {
    let seed = madsim::runtime::Handle::current().seed();
    format!(
        "reproduce with: MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo test -p sim --test evolution {test}"
    )
}

/// The evolution invariant, the membership index and every device over a
/// trace.
fn judged(trace: &EvolutionTrace) -> Result<(), Vec<String>> {
    if !trace.unowned_before.is_empty() {
        return Err(trace.unowned_before.clone());
    }
    invariants::evolution::check_replaced_refused(trace.replaced_refused)?;
    if trace.old_process {
        invariants::evolution::check_old_process_gave_way(trace.old_process_leads)?;
    }
    if !trace.undecodable.is_empty() {
        return Err(trace.undecodable.clone());
    }
    if !trace.device_errors.is_empty() {
        return Err(trace.device_errors.clone());
    }
    invariants::evolution::check_evolved(&trace.expected, &trace.held)
        .and_then(|()| invariants::capture::check_members(&trace.effects, &trace.members))?;
    for device in &trace.devices {
        let teams = MEMBERSHIPS
            .iter()
            .find(|(user, _)| *user == device.user)
            .map_or(&[][..], |(_, teams)| *teams);
        invariants::evolution::check_device(&trace.expected, teams, device)?;
    }
    Ok(())
}

async fn run(scenario: EvolutionScenario, reproduce: &str) -> EvolutionTrace {
    match run_evolution(scenario).await {
        Ok(t) => t,
        Err(e) => panic!("{e}\n{reproduce}"),
    }
}

#[madsim::test]
async fn every_scope_converges_under_the_new_config() {
    let reproduce = reproduce("every_scope_converges_under_the_new_config");
    let scenario = EvolutionScenario {
        old_process: true,
        ..EvolutionScenario::default()
    };
    let trace = run(scenario, &reproduce).await;
    eprintln!(
        "stats: scopes {} rows held {} re-read {} crashes {} elapsed {:?}",
        trace.held.len(),
        trace.held.values().map(|h| h.len()).sum::<usize>(),
        trace.reread_rows,
        trace.crashes,
        madsim::time::TimeHandle::current().elapsed()
    );
    assert!(trace.reread_rows > 0, "rows were re-read\n{reproduce}");
    assert_eq!(
        trace.devices.len(),
        MEMBERSHIPS.len(),
        "every device settled\n{reproduce}"
    );
    assert!(
        trace.expected.contains_key("templates_public"),
        "templates existed before they were registered\n{reproduce}"
    );
    if let Err(v) = judged(&trace) {
        panic!("{} violation(s), first: {}\n{reproduce}", v.len(), v[0]);
    }
}

/// An existing database (ADR 0011) whose baseline a crash cuts short
/// after its first chunk committed (ADR 0030): the slot is kept, the rows
/// not yet read are re-read beside the stream, and then the config
/// changes as in every run. Every scope and device converges.
#[madsim::test]
async fn a_baseline_cut_short_converges() {
    let reproduce = reproduce("a_baseline_cut_short_converges");
    let scenario = EvolutionScenario {
        // With the shares, three chunks: the first writes the dependency
        // rows, and the third is computed while the second writes (ADR 0036).
        existing_notes: 2500,
        ..EvolutionScenario::default()
    };
    let trace = run(scenario, &reproduce).await;
    assert!(
        trace.baseline_cut_short,
        "the crash cut the baseline short
{reproduce}"
    );
    assert!(
        trace.held.values().map(|h| h.len()).sum::<usize>() > 2500,
        "the existing rows are held
{reproduce}"
    );
    if let Err(v) = judged(&trace) {
        panic!(
            "{} violation(s), first: {}
{reproduce}",
            v.len(),
            v[0]
        );
    }
}

/// A planted bug: a baseline cut short is handed over owing nothing, so
/// the rows it had not read never reach a scope.
#[madsim::test]
async fn a_hand_over_that_forgets_rows_is_caught() {
    let reproduce = reproduce("a_hand_over_that_forgets_rows_is_caught");
    let scenario = EvolutionScenario {
        existing_notes: 1500,
        handover_forgets_rows: true,
        ..EvolutionScenario::default()
    };
    let trace = run(scenario, &reproduce).await;
    assert!(
        trace.baseline_cut_short,
        "the crash cut the baseline short
{reproduce}"
    );
    assert!(
        judged(&trace).is_err(),
        "the rows the hand-over forgot went unnoticed
{reproduce}"
    );
}

/// Runs a planted bug, which the invariants must catch.
async fn caught(skipped: SkippedRelation, reproduce: &str) {
    let scenario = EvolutionScenario {
        skipped: Some(skipped),
        ..EvolutionScenario::default()
    };
    let trace = run(scenario, reproduce).await;
    eprintln!(
        "reread {} judged {:?}\nheld {:?}",
        trace.reread_rows,
        judged(&trace),
        trace.held.get("user:u0")
    );
    // The server's state alone must show it: the run gives its devices
    // one attempt to settle, so their errors prove nothing.
    let mut server_only = trace.clone();
    server_only.devices.clear();
    server_only.device_errors.clear();
    assert!(
        judged(&server_only).is_err(),
        "skipping {skipped:?} went unnoticed in the server's state\n{reproduce}"
    );
}

/// A planted bug: the table registered over existing rows is not
/// rematerialized, so its rows never reach a scope.
#[madsim::test]
async fn a_table_left_out_is_caught() {
    let reproduce = reproduce("a_table_left_out_is_caught");
    caught(SkippedRelation::Templates, &reproduce).await;
}

/// A planted bug: the notes are not rematerialized, so shared notes keep
/// their old membership (and rows their old fields).
#[madsim::test]
async fn an_old_membership_is_caught() {
    let reproduce = reproduce("an_old_membership_is_caught");
    caught(SkippedRelation::Notes, &reproduce).await;
}

/// A planted client bug: devices keep the rows of the `team:` scopes the
/// new config removes. Only the device invariant can see it.
#[madsim::test]
async fn a_device_keeping_an_old_scopes_rows_is_caught() {
    let reproduce = reproduce("a_device_keeping_an_old_scopes_rows_is_caught");
    let scenario = EvolutionScenario {
        devices_keep_removed_rows: true,
        ..EvolutionScenario::default()
    };
    let trace = run(scenario, &reproduce).await;
    assert!(
        trace.undecodable.is_empty() && trace.device_errors.is_empty(),
        "the server side is sound\n{reproduce}"
    );
    let kept = trace
        .devices
        .iter()
        .filter(|d| d.held.keys().any(|s| s.starts_with("team:")))
        .count();
    assert!(kept > 0, "a device held a team: scope's rows\n{reproduce}");
    assert!(
        judged(&trace).is_err(),
        "a device keeping removed rows went unnoticed\n{reproduce}"
    );
}

/// A planted bug: the store forgets the configs processes started with,
/// so the old deploy's process, restarting, brings its config back. The
/// newer processes then serve nothing and cannot start again (the field
/// the old config removed cannot return), so the run may wedge; either
/// way the invariant names the cause.
#[madsim::test]
async fn a_replaced_config_that_starts_again_is_caught() {
    let reproduce = reproduce("a_replaced_config_that_starts_again_is_caught");
    let scenario = EvolutionScenario {
        forgets_applied_configs: true,
        ..EvolutionScenario::default()
    };
    let violation = "a process started under a config that a newer one replaced";
    match run_evolution(scenario).await {
        Err(e) => assert!(e.contains(violation), "{e}\n{reproduce}"),
        Ok(trace) => {
            let judged = judged(&trace);
            eprintln!("judged {judged:?}");
            assert!(
                judged.is_err_and(|v| v.iter().any(|v| v.contains(violation))),
                "a replaced config that started again went unnoticed\n{reproduce}"
            );
        }
    }
}
