//! The whole system under faults: the real client library on every
//! device, the real engine, every fault at once. Run with:
//! `RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target/sim MADSIM_TEST_SEED=1 MADSIM_TEST_NUM=32 cargo test -p sim --test system`
#![cfg(madsim)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use sim::system::{SystemMutant, SystemScenario, SystemTrace, run_system};

fn reproduce(test: &str) -> String {
    let seed = madsim::runtime::Handle::current().seed();
    format!(
        "reproduce with: MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo test -p sim --test system {test}"
    )
}

fn judged(t: &SystemTrace) -> Result<(), Vec<String>> {
    let mut v = t.violations.clone();
    if let Err(more) = invariants::system::check_system(&t.clients, &t.server) {
        v.extend(more);
    }
    if let Err(more) = invariants::pull::check_floor(&t.floor) {
        v.extend(more);
    }
    if let Err(more) = invariants::pull::check_cursor_steps(&t.cursor_steps) {
        v.extend(more);
    }
    if let Err(more) = invariants::tokens::check_token_uses(&t.token_uses) {
        v.extend(more);
    }
    if v.is_empty() { Ok(()) } else { Err(v) }
}

async fn run(scenario: SystemScenario, reproduce: &str) -> SystemTrace {
    match run_system(scenario).await {
        Ok(t) => t,
        Err(e) => panic!("{e}\n{reproduce}"),
    }
}

#[madsim::test]
async fn the_whole_system_converges_under_faults() {
    let reproduce = reproduce("the_whole_system_converges_under_faults");
    let t = run(SystemScenario::default(), &reproduce).await;
    eprintln!(
        "stats: writes {} pages {} rebuilt {} floor judged {} (stale {}) rotations {} rotated keys presented {} lost {} duplicated {} restarts {} offline {} crashes {} aimed {} elapsed {:?} ({:?})",
        t.writes,
        t.pages,
        t.rebuilt,
        t.floor.len(),
        t.floor.iter().filter(|f| f.rebuilt).count(),
        t.rotations,
        t.token_uses
            .iter()
            .filter(|u| u.presents_rotated_key())
            .count(),
        t.lost,
        t.duplicated,
        t.restarts,
        t.offline,
        t.crashes,
        t.tripped.len(),
        madsim::time::TimeHandle::current().elapsed(),
        t.tripped,
    );
    if let Err(v) = judged(&t) {
        panic!("{} violation(s): {v:#?}\n{reproduce}", v.len());
    }
    assert!(
        t.writes > 0 && t.pages > 0,
        "the run did something\n{reproduce}"
    );
    assert!(t.crashes >= 1, "the server crashed\n{reproduce}");
    assert!(t.rotations >= 1, "the keys were rotated\n{reproduce}");
}

/// A planted server bug: one pull page loses a change. The client's
/// terminal checksum catches it (and rebuilds), and the judge reports it.
#[madsim::test]
async fn a_dropped_change_is_caught() {
    let reproduce = reproduce("a_dropped_change_is_caught");
    let scenario = SystemScenario {
        mutant: Some(SystemMutant::DropChange),
        ..SystemScenario::default()
    };
    let t = run(scenario, &reproduce).await;
    assert!(t.mutated, "the bug fired\n{reproduce}");
    assert!(
        judged(&t).is_err(),
        "the dropped change went unnoticed\n{reproduce}"
    );
}

/// A planted server bug: a push sent again after its answer was lost is
/// executed again. Its inserts answer `row_already_exists`, and the judge
/// reports each as a write applied twice.
#[madsim::test]
async fn a_replay_that_executes_again_is_caught() {
    let reproduce = reproduce("a_replay_that_executes_again_is_caught");
    let scenario = SystemScenario {
        mutant: Some(SystemMutant::ReExecute),
        ..SystemScenario::default()
    };
    let t = run(scenario, &reproduce).await;
    assert!(t.mutated, "the bug fired\n{reproduce}");
    assert!(
        judged(&t).is_err_and(|v| v.iter().any(|m| m.contains("executed twice"))),
        "the second execution went unnoticed\n{reproduce}"
    );
}

/// A planted server bug: a rebuild continuation gets the page before it
/// again. The device refuses the page (its records are not after the ones
/// it holds), and the run reports it.
#[madsim::test]
async fn a_stale_rebuild_page_is_caught() {
    let reproduce = reproduce("a_stale_rebuild_page_is_caught");
    let scenario = SystemScenario {
        mutant: Some(SystemMutant::StaleRebuildPage),
        ..SystemScenario::default()
    };
    let t = run(scenario, &reproduce).await;
    assert!(t.mutated, "the bug fired\n{reproduce}");
    assert!(
        judged(&t).is_err_and(|v| v.iter().any(|m| m.contains("row-identity order"))),
        "the stale page went unnoticed\n{reproduce}"
    );
}

/// A planted client bug: the device trusts row checksums as sent, and a
/// page carries a row whose content is not its checksum's. Every digest
/// then agrees with the server's, so only the judge's own recomputation of
/// each held row catches it.
#[madsim::test]
async fn a_client_that_trusts_row_checksums_is_caught() {
    let reproduce = reproduce("a_client_that_trusts_row_checksums_is_caught");
    let scenario = SystemScenario {
        mutant: Some(SystemMutant::TrustedChecksum),
        ..SystemScenario::default()
    };
    let t = run(scenario, &reproduce).await;
    assert!(t.mutated, "the bug fired\n{reproduce}");
    assert!(
        judged(&t).is_err_and(|v| v.iter().any(|m| m.contains("is not its digest"))),
        "the forged row went unnoticed\n{reproduce}"
    );
}

/// A planted server bug: one pull page's cursor stands one effect too far,
/// past an upsert the device then never gets. The check of each page's
/// cursors against the scope's effects reports it (the scope's next
/// terminal checksum may too, unless a later write covered the loss).
#[madsim::test]
async fn a_cursor_one_effect_too_far_is_caught() {
    let reproduce = reproduce("a_cursor_one_effect_too_far_is_caught");
    let scenario = SystemScenario {
        mutant: Some(SystemMutant::CursorTooFar),
        ..SystemScenario::default()
    };
    let t = run(scenario, &reproduce).await;
    assert!(t.mutated, "the bug fired\n{reproduce}");
    assert!(
        judged(&t).is_err_and(|v| v.iter().any(|m| m.contains("its page did not carry"))),
        "the skipped effect went unnoticed\n{reproduce}"
    );
}

/// A planted client bug: a scope the server removes leaves the device's
/// active set, but its rows stay. The check of every applied page (rows
/// only of scopes assigned while the page was made, by the operator's own
/// log) catches it at the page.
#[madsim::test]
async fn a_client_that_keeps_a_removed_scopes_rows_is_caught() {
    let reproduce = reproduce("a_client_that_keeps_a_removed_scopes_rows_is_caught");
    let scenario = SystemScenario {
        mutant: Some(SystemMutant::KeepRemovedRows),
        ..SystemScenario::default()
    };
    let t = run(scenario, &reproduce).await;
    assert!(t.mutated, "the bug fired\n{reproduce}");
    assert!(
        judged(&t).is_err_and(|v| v.iter().any(|m| m.contains("while the page was made"))),
        "the removed scope's rows went unnoticed\n{reproduce}"
    );
}

/// A planted server bug: compaction deletes effects above the floor that
/// no later effect supersedes. A device that had not pulled one never
/// gets it: its terminal checksum differs, and the judge reports it.
#[madsim::test]
async fn compaction_above_the_floor_is_caught() {
    let reproduce = reproduce("compaction_above_the_floor_is_caught");
    let scenario = SystemScenario {
        mutant: Some(SystemMutant::CompactAboveFloor),
        ..SystemScenario::default()
    };
    let t = run(scenario, &reproduce).await;
    assert!(
        judged(&t).is_err(),
        "the compacted change went unnoticed\n{reproduce}"
    );
}

/// A planted server bug: a key rotation deletes the old keys. Devices that
/// hold cursors or continuations issued before it are refused as forged;
/// the token judge reports it.
#[madsim::test]
async fn a_rotation_that_forgets_old_keys_is_caught() {
    let reproduce = reproduce("a_rotation_that_forgets_old_keys_is_caught");
    let scenario = SystemScenario {
        mutant: Some(SystemMutant::RotationForgetsKeys),
        ..SystemScenario::default()
    };
    let t = run(scenario, &reproduce).await;
    assert!(t.mutated, "the bug fired\n{reproduce}");
    let refused = invariants::tokens::check_token_uses(&t.token_uses);
    assert!(
        refused.is_err(),
        "the forgotten keys went unnoticed\n{reproduce}"
    );
}
