//! The materializer actor: the only path from committed source writes to
//! pull-visible state. It reads whole source transactions in commit order
//! from the store's [`ChangeFeed`](crate::capture::ChangeFeed) and commits,
//! atomically for a group of whole transactions (ADR 0005), projections,
//! dependency rows, per-scope effects, satisfied fences, transaction
//! records and the progress row. Only then does it acknowledge the feed,
//! so a crash anywhere replays from durable progress, and a replayed
//! transaction (at or below progress) is skipped.
//!
//! A transaction that cannot be materialized is quarantined: capture stops
//! (no log-and-skip) and is retried from the same transaction every
//! `retry`, so a repair lets it resume.

mod baseline;
mod model;
mod reread;
mod step;

use crate::visibility::{CaptureReports, CatchUpMeter, GroupTimes};
use std::time::Duration;

use protocol::position::Boundary;
use tokio::sync::watch;
use tokio::time::{Instant, sleep};

use crate::capture::{CaptureProblem, ChangeFeed, Heartbeat, Lsn, Quarantine, Rematerialization};
use crate::config::SyncConfig;
use crate::store::{Store, StoreError, StoreTx};
pub use baseline::BaselineProgress;
pub(crate) use model::{Model, Table};

/// What the materializer is doing, for readiness.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaptureStatus {
    /// Not yet reading.
    Starting,
    /// Another process holds leadership.
    Standby,
    /// Reading and materializing.
    Running {
        /// The last time it made progress or found the feed idle.
        heartbeat: Instant,
        boundary: Boundary,
        /// The last time nothing was waiting in the feed.
        caught_up: Instant,
        /// Source WAL known to the feed and not yet durable here.
        lag_bytes: u64,
    },
    /// Materializing the baseline of the rows that existed before the stream.
    Baseline(BaselineProgress),
    /// A quarantined transaction blocks capture.
    Blocked(CaptureProblem),
    /// The store or the feed failed; retrying.
    Unavailable,
    /// A process with another config recorded its capture model: this one
    /// no longer captures (ADR 0020).
    Superseded,
}

/// Records a heartbeat in its own transaction (the leader is idle or
/// starting), and reconciles fences left behind (ADR 0014).
async fn beat<S: Store>(store: &S, caught_up: bool, lag_bytes: u64) -> Result<(), StoreError> {
    let mut tx = store.begin().await?;
    tx.record_heartbeat(&Heartbeat {
        caught_up,
        lag_bytes,
    })
    .await?;
    tx.reconcile_fences().await?;
    tx.commit().await
}

/// Finite limits of the materializer loop.
#[derive(Clone, Copy, Debug)]
pub struct MaterializerLimits {
    /// How long an idle feed waits before the loop records a heartbeat.
    pub heartbeat: Duration,
    /// The pause before reopening a failed or blocked feed.
    pub retry: Duration,
    /// At most this many waiting source transactions share one database transaction.
    pub group_transactions: usize,
    /// A group stops growing once it holds this many row events.
    pub group_events: usize,
    /// Rows in one chunk of a rematerialization.
    pub rematerialize_chunk_rows: usize,
    /// The share of wall time (percent) a rematerialization keeps re-reading.
    pub rematerialize_share: u32,
    /// The longest a baseline reads under its snapshot before it hands the
    /// rest over to re-reads.
    pub baseline_snapshot: Duration,
}

/// Starts the materializer over `store` for the config whose current
/// manifest is the store's newest one. Returns its status.
pub async fn spawn<S: Store>(
    store: S,
    config: &SyncConfig,
    limits: MaterializerLimits,
    reports: CaptureReports,
) -> Result<watch::Receiver<CaptureStatus>, String> {
    let manifest = {
        let mut tx = store.begin().await.map_err(|e| e.to_string())?;
        let manifests = tx.manifests().await.map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        manifests
            .into_iter()
            .last()
            .ok_or("no manifest is stored")?
    };
    let model = Model::new(config, manifest)?;
    let (status, receiver) = watch::channel(CaptureStatus::Starting);
    tokio::spawn(async move {
        loop {
            match store.change_feed().await {
                Ok(Some(feed)) => {
                    if let Err(e) = lead(&store, &model, feed, limits, &status, &reports).await {
                        tracing::warn!(error = %e, "materializer: store failed; reopening the feed");
                        if !matches!(*status.borrow(), CaptureStatus::Blocked(_)) {
                            status.send_replace(CaptureStatus::Unavailable);
                        }
                    }
                }
                Ok(None) => {
                    status.send_replace(CaptureStatus::Standby);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "materializer: cannot open the change feed");
                    // A feed that cannot open because capture is broken (a
                    // lost slot) blocks capture; any other failure is retried.
                    match block_if_broken(&store, &model, &status).await {
                        Ok(true) => {}
                        _ => {
                            status.send_replace(CaptureStatus::Unavailable);
                        }
                    }
                }
            }
            if status.is_closed() || *status.borrow() == CaptureStatus::Superseded {
                return;
            }
            sleep(limits.retry).await;
        }
    });
    Ok(receiver)
}

/// Without a feed: if capture's installation is broken, blocks capture at
/// the end of durable progress. Whether it did.
async fn block_if_broken<S: Store>(
    store: &S,
    model: &Model,
    status: &watch::Sender<CaptureStatus>,
) -> Result<bool, StoreError> {
    let Some(problem) = store.check_capture().await? else {
        return Ok(false);
    };
    let (durable_end, generation) = {
        let mut tx = store.begin().await?;
        let p = tx.capture_progress().await?;
        let generation = tx.stream_state().await?.generation;
        tx.commit().await?;
        (p.end_lsn, generation)
    };
    block_installation(store, model, durable_end, generation, problem, status).await?;
    Ok(true)
}

/// Records a broken installation as the quarantine (at the end of durable
/// progress) and blocks capture; it is checked again on every reopen.
///
/// A newer config's start records its capture model before it changes
/// what is installed, so a check that saw the change was followed by the
/// record: read here, in the quarantine's own transaction, it makes this
/// process give way instead of blocking the stream the newer one leads.
async fn block_installation<S: Store>(
    store: &S,
    model: &Model,
    durable_end: Lsn,
    generation: u64,
    problem: CaptureProblem,
    status: &watch::Sender<CaptureStatus>,
) -> Result<(), StoreError> {
    let mut tx = store.begin().await?;
    if superseded(model, &tx.rematerializations().await?) {
        drop(tx);
        return give_way(status);
    }
    tx.quarantine(
        &Quarantine {
            commit_lsn: durable_end,
            problem: problem.clone(),
        },
        generation,
    )
    .await?;
    tx.commit().await?;
    let blocked = CaptureStatus::Blocked(problem.clone());
    if *status.borrow() != blocked {
        tracing::error!(
            class = problem.as_str(),
            "capture blocked: installation broken"
        );
    }
    status.send_replace(blocked);
    Ok(())
}

/// Whether a process started with another config has recorded its capture
/// model since this one's: this process must not materialize with its own.
/// Every start records each relation it captures with its model's
/// fingerprint, and an empty one for each it no longer captures; so a
/// record differs from this model's (empty where it captures nothing)
/// only once a start with another config came after it.
fn superseded(model: &Model, records: &[Rematerialization]) -> bool {
    records.iter().any(|r| {
        let own = model
            .fingerprints
            .get(&r.relation)
            .map_or("", String::as_str);
        own != r.fingerprint
    })
}

/// The rematerialization records as they are now.
async fn records_now<S: Store>(store: &S) -> Result<Vec<Rematerialization>, StoreError> {
    let mut tx = store.begin().await?;
    let records = tx.rematerializations().await?;
    tx.commit().await?;
    Ok(records)
}

/// Gives up leadership for good: a newer config is active (ADR 0020).
fn give_way(status: &watch::Sender<CaptureStatus>) -> Result<(), StoreError> {
    tracing::error!("capture: another configuration is active; this process no longer captures");
    status.send_replace(CaptureStatus::Superseded);
    Ok(())
}

/// Attempts of one group's transaction on one feed, at most.
const GROUP_ATTEMPTS: usize = 3;

/// A group of whole source transactions, and the re-read chunk one of
/// them carries (its commit LSN, and the record it moves its relation to).
struct Group<'g> {
    transactions: &'g [crate::capture::SourceTransaction],
    reread: Option<&'g (Lsn, Rematerialization)>,
}

/// One group's database transaction: its materialization (or quarantine)
/// and the heartbeat that reports on it. The outcome, the lag after it and
/// the time each half of the transaction took;
/// `None`, with nothing committed, if a transaction would be quarantined
/// after a start with another config superseded this process (ADR 0020
/// §6): what an older model cannot read is the newer one's to materialize.
async fn commit_group<S: Store>(
    store: &S,
    model: &Model,
    group: &Group<'_>,
    generation: u64,
    durable_end: Lsn,
    drained: bool,
    source_end: Lsn,
) -> Result<Option<(step::GroupOutcome, u64, GroupTimes)>, StoreError> {
    let began = Instant::now();
    let mut tx = store.begin().await?;
    let mut outcome = step::materialize_group(&mut tx, model, group.transactions).await?;
    let prepared = Instant::now();
    if outcome.problem.is_some() && superseded(model, &tx.rematerializations().await?) {
        return Ok(None);
    }
    if let Some(m) = &mut outcome.combined {
        m.stream_generation = generation;
        // The chunk's progress commits with the chunk, if it materialized.
        if let Some((commit_lsn, record)) = group.reread
            && m.transactions.iter().any(|t| t.commit_lsn == *commit_lsn)
        {
            m.rematerialized.push(record.clone());
        }
        tx.materialize(m).await?;
        if !m.fences.is_empty() {
            tx.reconcile_fences().await?;
        }
    }
    if let Some((commit_lsn, problem)) = &outcome.problem {
        tx.quarantine(
            &Quarantine {
                commit_lsn: *commit_lsn,
                problem: problem.clone(),
            },
            generation,
        )
        .await?;
    }
    let end = outcome.combined.as_ref().map_or(durable_end, |m| m.end_lsn);
    let lag = source_end.saturating_sub(end);
    tx.record_heartbeat(&Heartbeat {
        caught_up: drained,
        lag_bytes: lag,
    })
    .await?;
    tx.commit().await?;
    let times = GroupTimes {
        preparing: prepared - began,
        writing: prepared.elapsed(),
    };
    Ok(Some((outcome, lag, times)))
}

/// Materializes from `feed` until the store fails or a transaction is quarantined.
async fn lead<S: Store>(
    store: &S,
    model: &Model,
    mut feed: S::Feed,
    limits: MaterializerLimits,
    status: &watch::Sender<CaptureStatus>,
    reports: &CaptureReports,
) -> Result<(), StoreError> {
    let (progress, generation, mut records) = {
        let mut tx = store.begin().await?;
        let mut p = tx.capture_progress().await?;
        if p.baseline_owed && feed.baseline().is_none() {
            // The feed kept the slot of a baseline a crash cut short (ADR 0030).
            tx.hand_over_baseline().await?;
            tracing::info!("baseline: handed over; the rows not yet read are re-read");
            p = tx.capture_progress().await?;
        }
        let generation = tx.stream_state().await?.generation;
        let records = tx.rematerializations().await?;
        tx.commit().await?;
        (p, generation, records)
    };
    if superseded(model, &records) {
        return give_way(status);
    }
    // Re-advance the slot to the durable point (a crash may have come
    // between the last commit and its acknowledgement).
    feed.acknowledge(progress.end_lsn).await?;
    if let Some(problem) = store.check_capture().await? {
        return block_installation(store, model, progress.end_lsn, generation, problem, status)
            .await;
    }
    let mut boundary = progress.boundary;
    let mut durable_end: Lsn = progress.end_lsn;
    let mut blocked = progress.quarantine.map(|q| q.problem);
    if let Some(owed) = feed.baseline().cloned() {
        assert!(
            boundary == Boundary::GenerationStart,
            "a baseline is owed only before the stream's first transaction"
        );
        let outcome = baseline::materialize(
            store,
            model,
            &mut feed,
            &owed,
            generation,
            limits.baseline_snapshot,
            status,
        )
        .await?;
        match outcome {
            baseline::BaselineOutcome::Done {
                boundary: after,
                end_lsn,
                records: moved,
            } => {
                records = moved;
                reports.satisfied(&owed.covered_fences);
                boundary = after;
                durable_end = end_lsn;
                blocked = None; // completing the baseline clears its quarantine
                feed.acknowledge(durable_end).await?;
            }
            baseline::BaselineOutcome::Quarantined {
                commit_lsn,
                problem,
            } => {
                let mut tx = store.begin().await?;
                tx.quarantine(
                    &Quarantine {
                        commit_lsn,
                        problem: problem.clone(),
                    },
                    generation,
                )
                .await?;
                tx.commit().await?;
                tracing::error!(
                    class = problem.as_str(),
                    "capture blocked: baseline quarantined"
                );
                status.send_replace(CaptureStatus::Blocked(problem));
                // The next feed takes it again, or hands it over once a
                // chunk committed (ADR 0030).
                return Ok(());
            }
        }
    }
    // A baseline cut short or handed over left the rows it had not read
    // owed to re-reads (ADR 0030).
    let mut rereading = reread::Rereading::new(
        records,
        model,
        limits.rematerialize_chunk_rows,
        limits.rematerialize_share,
    );
    if rereading.owed() > 0 {
        tracing::info!(
            relations = rereading.owed(),
            "capture: re-reading relations (a changed model, or a baseline cut short)"
        );
    }
    let mut caught_up = Instant::now();
    let mut meter = CatchUpMeter::default();
    let running = |boundary: Boundary, caught_up: Instant, lag_bytes: u64| CaptureStatus::Running {
        heartbeat: Instant::now(),
        boundary,
        caught_up,
        lag_bytes,
    };
    let lag = feed.source_end().saturating_sub(durable_end);
    match &blocked {
        Some(p) => status.send_replace(CaptureStatus::Blocked(p.clone())),
        None => status.send_replace(running(boundary, caught_up, lag)),
    };
    beat(store, lag == 0, lag).await?;
    let mut checked = Instant::now();
    loop {
        // Busy or idle, a leader started with an older config gives way
        // soon after a newer one recorded its model (ADR 0020).
        if checked.elapsed() >= limits.heartbeat {
            if superseded(model, &records_now(store).await?) {
                return give_way(status);
            }
            checked = Instant::now();
        }
        if blocked.is_none() {
            rereading.request(store, &mut feed, model).await?;
        }
        // While a re-read pauses (ADR 0027), wait no longer than the pause.
        let pause = rereading
            .pause_left()
            .filter(|p| *p < limits.heartbeat)
            .filter(|_| blocked.is_none());
        let Some(first) = feed.next(pause.unwrap_or(limits.heartbeat)).await? else {
            if pause.is_some() {
                continue; // the pause is over: the next chunk is due
            }
            if status.is_closed() {
                return Ok(()); // the engine is gone: give up leadership
            }
            // A newer config may have changed what is installed: it leads now.
            if superseded(model, &records_now(store).await?) {
                return give_way(status);
            }
            // While idle, make sure nothing that feeds capture was dropped,
            // recreated or disabled (that would silently stop the WAL).
            if let Some(problem) = store.check_capture().await? {
                return block_installation(store, model, durable_end, generation, problem, status)
                    .await;
            }
            // An operator reset the stream (ADR 0012): this feed's slot is
            // no longer the stream's. The next feed takes the new baseline.
            let mut tx = store.begin().await?;
            let reset = tx.stream_state().await?.generation != generation;
            drop(tx);
            if reset {
                tracing::info!("capture: the stream was reset; reopening for its baseline");
                return Ok(());
            }
            caught_up = Instant::now();
            if blocked.is_none() {
                status.send_replace(running(boundary, caught_up, 0));
                reports.catching_up(Duration::ZERO);
                // The WAL since the last source transaction (capture's own
                // heartbeats and groups among it) holds none: the slot may
                // let it go, or an idle database keeps it all (issue 25).
                if let Some(end) = feed.idle_end()
                    && end > durable_end
                {
                    feed.acknowledge_idle(end).await?;
                }
            }
            beat(store, true, 0).await?;
            continue;
        };
        // Group commit: the transactions already waiting, up to a bound,
        // become one database transaction. Each is still whole: progress
        // moves only by complete source transactions.
        let mut group = vec![first];
        let mut events = group[0].events.len();
        let mut drained = false;
        while group.len() < limits.group_transactions && events < limits.group_events {
            match feed.next(Duration::ZERO).await? {
                Some(t) => {
                    events += t.events.len();
                    group.push(t);
                }
                None => {
                    drained = true;
                    break;
                }
            }
        }
        // A redelivery of a durable transaction produces nothing new.
        group.retain(|t| match boundary {
            Boundary::GenerationStart => true,
            Boundary::TransactionEnd { commit_lsn } => t.commit_lsn > commit_lsn,
        });
        if group.is_empty() {
            feed.acknowledge(durable_end).await?;
            continue;
        }
        assert!(
            group.windows(2).all(|w| w[0].end_lsn <= w[1].commit_lsn),
            "a group holds whole transactions in commit order"
        );
        let reread = rereading.fill(&mut group);
        // A transient failure retries the group on the same feed, once
        // durable progress shows it did not commit; anything else (or a
        // commit whose answer was lost) reopens the feed from durable progress.
        let mut attempts = 1;
        let (outcome, lag, times) = loop {
            let source_end = feed.source_end();
            let failure = match commit_group(
                store,
                model,
                &Group {
                    transactions: &group,
                    reread: reread.as_ref(),
                },
                generation,
                durable_end,
                drained,
                source_end,
            )
            .await
            {
                Ok(Some(done)) => break done,
                Ok(None) => return give_way(status),
                Err(e) => e,
            };
            if !matches!(failure, StoreError::Unavailable(_)) || attempts == GROUP_ATTEMPTS {
                return Err(failure);
            }
            attempts += 1;
            sleep(limits.retry).await;
            let mut tx = store.begin().await?;
            let p = tx.capture_progress().await?;
            drop(tx);
            if p.end_lsn != durable_end {
                return Err(failure);
            }
        };
        if let Some(m) = &outcome.combined {
            assert!(m.end_lsn > durable_end, "progress only moves forward");
            let rows = group.iter().map(|t| t.events.len()).sum();
            reports.committed(group.len(), rows, times);
            assert!(
                match boundary {
                    Boundary::GenerationStart => true,
                    Boundary::TransactionEnd { commit_lsn } => m.commit_lsn > commit_lsn,
                },
                "the boundary only moves forward"
            );
            boundary = Boundary::TransactionEnd {
                commit_lsn: m.commit_lsn,
            };
            durable_end = m.end_lsn;
            feed.acknowledge(durable_end).await?;
            // Requests waiting for these writes run again (`visibility`).
            reports.satisfied(&m.fences);
            if let Some(eta) = meter.committed(durable_end, lag, tokio::time::Instant::now()) {
                reports.catching_up(eta);
            }
            for record in &m.rematerialized {
                rereading.committed(record);
            }
            blocked = None;
            if drained {
                caught_up = Instant::now();
            }
            status.send_replace(running(boundary, caught_up, lag));
        }
        if let Some((_, problem)) = outcome.problem {
            let blocked_status = CaptureStatus::Blocked(problem.clone());
            if *status.borrow() != blocked_status {
                tracing::error!(
                    class = problem.as_str(),
                    "capture blocked: transaction quarantined"
                );
            }
            status.send_replace(blocked_status);
            // Retried from the same transaction when the feed is reopened.
            return Ok(());
        }
    }
}
