//! Pull and rebuild under faults: lossy links, server crashes, application writes that
//! move and share rows, scope grants and revocations; and the planted bugs
//! the invariants must catch. Run with:
//! `RUSTFLAGS="--cfg madsim" CARGO_TARGET_DIR=target/sim MADSIM_TEST_SEED=1 MADSIM_TEST_NUM=32 cargo test -p sim --test pull`
#![cfg(madsim)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use sim::pull::{Mutant, PullScenario, run_pull};
use sim::tripwire::CrashPoint;

fn reproduce(test: &str) -> String {
    let seed = madsim::runtime::Handle::current().seed();
    format!(
        "reproduce with: MADSIM_TEST_SEED={seed} RUSTFLAGS=\"--cfg madsim\" CARGO_TARGET_DIR=target/sim cargo test -p sim --test pull {test}"
    )
}

/// Runs `scenario`, which must finish with no violation.
async fn run_clean(scenario: PullScenario, reproduce: &str) -> sim::pull::PullTrace {
    let trace = match run_pull(scenario).await {
        Ok(t) => t,
        Err(e) => panic!("{e}\n{reproduce}"),
    };
    assert!(
        trace.violations.is_empty(),
        "{} violation(s), first: {}\n{reproduce}",
        trace.violations.len(),
        trace.violations[0]
    );
    trace
}

#[madsim::test]
async fn pull_under_faults() {
    let reproduce = reproduce("pull_under_faults");
    let trace = run_clean(PullScenario::default(), &reproduce).await;
    eprintln!(
        "pages {} changes {} rebuild pages {} restarts {} replays {} reconnects {} damages {} caught {} retries {} capture_pending {} unavailable {} crashes {} (at {:?}) longest capture stall {:?} elapsed {:?}",
        trace.pages,
        trace.changes,
        trace.rebuild_pages,
        trace.restarts,
        trace.replays,
        trace.reconnects,
        trace.damages,
        trace.mismatches,
        trace.retries,
        trace.capture_pending,
        trace.unavailable,
        trace.crashes,
        trace.tripped,
        trace.longest_capture_stall,
        madsim::time::TimeHandle::current().elapsed()
    );
    assert!(trace.crashes >= 1, "the server crashed\n{reproduce}");
    for point in CrashPoint::REBUILD {
        assert!(
            trace.tripped.contains(&point),
            "the server died at {point:?}\n{reproduce}"
        );
    }
    assert!(trace.changes > 0, "changes were pulled\n{reproduce}");
    assert!(trace.rebuild_pages > 0, "scopes were rebuilt\n{reproduce}");
}

/// A second server process serves half the clients (ADR 0028): it stands
/// by while the first leads capture and hears its fence reports, and it
/// leads while the first is down. Every pull invariant holds for both,
/// own writes included, under the same crashes and lossy links.
#[madsim::test]
async fn pull_beside_a_standby_under_faults() {
    let reproduce = reproduce("pull_beside_a_standby_under_faults");
    let scenario = PullScenario {
        standby: true,
        pulls_per_client: 24, // enough pushes that each server accepts one
        ..PullScenario::default()
    };
    let trace = run_clean(scenario, &reproduce).await;
    eprintln!(
        "pages {} changes {} accepted pushes {} capture_pending {} unavailable {} crashes {} retries {}",
        trace.pages,
        trace.changes,
        trace.accepted.len(),
        trace.capture_pending,
        trace.unavailable,
        trace.crashes,
        trace.retries
    );
    assert!(trace.crashes >= 1, "the first server crashed\n{reproduce}");
    for client in ["pull-client-0", "pull-client-1"] {
        assert!(
            trace.pulled.contains(client),
            "{client} pulled (one per server)\n{reproduce}"
        );
    }
    assert!(
        (trace.accepted.iter()).any(|(c, _)| c == "pull-client-1" || c == "pull-client-3"),
        "the standby accepted a push\n{reproduce}"
    );
}

/// A planted bug must fail the run (each in its own simulated world).
async fn caught(mutant: Mutant, test: &str) {
    let reproduce = reproduce(test);
    // More pulls than the plain run, so that each bug finds a page it can
    // break in every seed.
    let scenario = PullScenario {
        mutant: Some(mutant),
        pulls_per_client: 24,
        // The cross-generation bug needs a reset to cross.
        reset: mutant == Mutant::CrossGeneration,
        ..PullScenario::default()
    };
    let trace = match run_pull(scenario).await {
        Ok(t) => t,
        Err(e) => panic!("{e}\n{reproduce}"),
    };
    assert!(
        trace.mutated,
        "{mutant:?} never fired ({} pages, {} changes, {} rebuild pages, longest capture stall {:?})\n{reproduce}",
        trace.pages, trace.changes, trace.rebuild_pages, trace.longest_capture_stall
    );
    assert!(
        !trace.violations.is_empty(),
        "{mutant:?} was not caught\n{reproduce}"
    );
}

#[madsim::test]
async fn a_page_that_loses_a_change_is_caught() {
    caught(Mutant::DropChange, "a_page_that_loses_a_change_is_caught").await;
}

#[madsim::test]
async fn a_cursor_one_effect_too_far_is_caught() {
    caught(
        Mutant::CursorTooFar,
        "a_cursor_one_effect_too_far_is_caught",
    )
    .await;
}

#[madsim::test]
async fn a_rebuild_page_that_loses_a_record_is_caught() {
    caught(
        Mutant::DropRecord,
        "a_rebuild_page_that_loses_a_record_is_caught",
    )
    .await;
}

#[madsim::test]
async fn a_rebuild_page_rendered_from_live_rows_is_caught() {
    caught(
        Mutant::LivePages,
        "a_rebuild_page_rendered_from_live_rows_is_caught",
    )
    .await;
}

#[madsim::test]
async fn a_pull_served_before_its_own_push_is_caught() {
    caught(
        Mutant::UnseenFences,
        "a_pull_served_before_its_own_push_is_caught",
    )
    .await;
}

/// ADR 0037's premise broken: a scope keeps a row's earlier upsert while
/// the projection that pages serve moves on; a client past the kept
/// effect never receives the change.
#[madsim::test]
async fn an_effect_kept_behind_its_projection_is_caught() {
    caught(
        Mutant::KeptBackReplacements,
        "an_effect_kept_behind_its_projection_is_caught",
    )
    .await;
}

/// Mid-run the slot is lost and an operator resets the stream (ADR 0012)
/// while clients pull, push and rebuild, the server crashes and links
/// lose messages: every client converges to the server's projection,
/// no accepted push is lost, and no cursor crosses generations.
#[madsim::test]
async fn a_stream_reset_mid_run_converges() {
    let reproduce = reproduce("a_stream_reset_mid_run_converges");
    let scenario = PullScenario {
        reset: true,
        pulls_per_client: 16,
        ..PullScenario::default()
    };
    let trace = run_clean(scenario, &reproduce).await;
    eprintln!(
        "resets {} stale generations {} accepted pushes {} pages {} rebuild pages {} unavailable {} crashes {}",
        trace.resets,
        trace.stale_generations,
        trace.accepted.len(),
        trace.pages,
        trace.rebuild_pages,
        trace.unavailable,
        trace.crashes
    );
    assert_eq!(trace.resets, 1, "the stream was reset\n{reproduce}");
    assert!(
        trace.stale_generations > 0,
        "a client presented a cursor of the old generation\n{reproduce}"
    );
    assert!(
        !trace.accepted.is_empty(),
        "pushes were accepted\n{reproduce}"
    );
}

#[madsim::test]
async fn a_cursor_across_generations_is_caught() {
    caught(
        Mutant::CrossGeneration,
        "a_cursor_across_generations_is_caught",
    )
    .await;
}
