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

/// Every `tokio::select!` the simulator runs is `biased;`. An unbiased one
/// polls its branches in an order drawn from tokio's own thread-local
/// generator, seeded from a process-wide counter: the same seed could then
/// take another branch when two are ready at once (a run with
/// `MADSIM_TEST_CHECK_DETERMINISM=1` failed so).
#[test]
fn every_select_is_biased() {
    fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for crate_dir in ["actors/src", "client/src", "sim/src", "invariants/src"] {
        sources(&root.join(crate_dir), &mut files);
    }
    let mut selects = 0;
    let mut unbiased = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (n, line) in lines.iter().enumerate() {
            if line.contains("select! {") {
                selects += 1;
                if lines.get(n + 1).map(|l| l.trim()) != Some("biased;") {
                    unbiased.push(format!("{}:{}", file.display(), n + 1));
                }
            }
        }
    }
    assert!(selects > 0, "the scan found the simulator's selects");
    assert!(
        unbiased.is_empty(),
        "select! without `biased;`: {unbiased:?}"
    );
}
