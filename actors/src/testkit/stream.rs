//! The stream's lifecycle (ADR 0010): a lost replication slot blocks
//! capture and is never repaired silently, not even by a restart.

use std::time::Duration;

use protocol::json::{self, Value};
use protocol::position::Boundary;

use super::capture::ready_becomes;
use super::pull::{PullClient, note_row, pull_note};
use super::push::push_config;
use super::transport::{Node, Route};
use super::{CaptureWorld, Write};
use crate::Engine;
use crate::capture::{CaptureProblem, Lsn};
use crate::materializer::CaptureStatus;
use crate::store::{Store, StoreError, StoreTx};

/// The slot is dropped behind the server's back: capture blocks with
/// `slot_lost`, readiness goes false, pull and rebuild answer `503
/// capture_blocked`, no commit after the loss is materialized, and a
/// restart does not create the slot again. The world must be fresh.
pub async fn slot_loss_blocks<W: CaptureWorld>(world: &W) {
    let store = world.store().clone();
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    let node = Node::from(&engine);
    let before = note(world, 900).await;
    progress_reaches(&store, before).await;
    let mut c = PullClient::connect(&store, &node, "sl-u", "sl-c").await;
    c.sync(10).await;
    assert_eq!(c.replica.scopes["user:sl-u"].rows.len(), 1);
    ready_becomes(&engine, true, "capture runs").await;

    world.lose_slot().await;
    let after = note(world, 901).await;
    ready_becomes(&engine, false, "the slot is lost").await;
    blocked(&engine).await;
    let unavailable = |status: u16, body: &[u8], retry_after: Option<u32>| {
        let v = json::parse(body).unwrap();
        let e = v.as_object().unwrap()["error"].as_object().unwrap().clone();
        assert_eq!(
            (status, e["code"].clone(), e["reason"].clone(), retry_after),
            (
                503,
                Value::string("temporary_unavailable"),
                Value::string("capture_blocked"),
                Some(5)
            )
        );
    };
    let r = c.send_raw(c.body(10)).await;
    unavailable(r.status, &r.body, r.retry_after);
    let attempt = c.new_attempt("user:sl-u");
    let r = node
        .send(Route::Rebuild, "sl-u", c.rebuild_body(&attempt, 10))
        .await;
    unavailable(r.status, &r.body, r.retry_after);
    not_materialized(&store, after).await;

    // A restart neither creates the slot again nor skips what it lost.
    drop(engine);
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    blocked(&engine).await;
    assert!(!engine.ready().await, "still not ready");
    not_materialized(&store, after).await;
}

/// A new note of user `sl-u`, committed by the application.
async fn note<W: CaptureWorld>(world: &W, n: u64) -> Lsn {
    let id = pull_note(n);
    world
        .write(&[Write::Insert("public.notes", &note_row(&id, "sl-u", "t"))])
        .await
}

/// `scope`'s retained effects through capture's progress now.
async fn effects_through_progress<S: Store>(store: &S, scope: &str) -> Vec<crate::capture::Effect> {
    let mut tx = store.begin().await.unwrap();
    let through = tx.capture_progress().await.unwrap().boundary;
    tx.scope_effects(
        &protocol::ids::ScopeId::parse(scope).unwrap(),
        protocol::position::StreamPosition::GenerationStart,
        through,
    )
    .await
    .unwrap()
}

/// Waits until capture has materialized everything through `lsn`.
async fn progress_reaches<S: Store>(store: &S, lsn: Lsn) {
    for _ in 0..1000 {
        let mut tx = store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        drop(tx);
        if matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn >= lsn) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("capture did not reach {lsn}");
}

/// Waits until the engine's capture is blocked by the lost slot, which the
/// store's progress records as its quarantine.
async fn blocked(engine: &Engine) {
    for _ in 0..1000 {
        if engine.capture_status() == CaptureStatus::Blocked(CaptureProblem::SlotLost) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("capture is not blocked: {:?}", engine.capture_status());
}

/// Nothing at or after `lsn` was materialized, and the quarantine names the lost slot.
async fn not_materialized<S: Store>(store: &S, lsn: Lsn) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut tx = store.begin().await.unwrap();
    let p = tx.capture_progress().await.unwrap();
    drop(tx);
    assert!(
        matches!(p.boundary, Boundary::TransactionEnd { commit_lsn } if commit_lsn < lsn),
        "{:?}",
        p.boundary
    );
    assert_eq!(
        p.quarantine.map(|q| q.problem),
        Some(CaptureProblem::SlotLost)
    );
}

/// Notes of user `bl-u` that exist before capture is installed.
const EXISTING: u64 = 2_500;

/// Rows that exist before capture is installed (no version, no
/// projection) are the baseline (ADR 0011): a client that connects and
/// rebuilds receives each exactly once with verified checksums, every row
/// has exactly one effect (a write racing the baseline lands in it or in
/// the stream, never both), later writes arrive by pull, and a push to a
/// baseline row is judged against the version the baseline gave it. The
/// world must be fresh and no engine may have started on it.
pub async fn baseline_adopts_existing_rows<W: CaptureWorld>(world: &W) {
    let store = world.store().clone();
    let ids: Vec<String> = (0..EXISTING).map(|n| pull_note(10_000 + n)).collect();
    let rows: Vec<_> = ids.iter().map(|id| note_row(id, "bl-u", "old")).collect();
    let other = pull_note(20_000);
    let other_row = note_row(&other, "bl-other", "old");
    let mut writes: Vec<Write<'_>> = rows
        .iter()
        .map(|r| Write::Insert("public.notes", r))
        .collect();
    writes.push(Write::Insert("public.notes", &other_row));
    world.write(&writes).await;

    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    // Racing the baseline: in it, or in the stream after it.
    let racing_id = pull_note(30_000);
    let racing = world
        .write(&[Write::Insert(
            "public.notes",
            &note_row(&racing_id, "bl-u", "racing"),
        )])
        .await;
    progress_reaches(&store, racing).await;
    ready_becomes(&engine, true, "capture runs after the baseline").await;
    let node = Node::from(&engine);
    let mut c = PullClient::connect(&store, &node, "bl-u", "bl-c").await;
    c.sync(1000).await;
    let scope = "user:bl-u";
    assert_eq!(
        c.replica.scopes[scope].rows.len() as u64,
        EXISTING + 1,
        "every existing row and the racing one, verified by checksum"
    );
    // The baseline's rows reach clients by rebuild and store no effect
    // (ADR 0033): the racing row has one only if the stream carried it.
    let effects = effects_through_progress(&store, scope).await;
    assert!(
        effects.len() <= 1
            && (effects.iter()).all(|e| e.key == protocol::json::Value::string(&racing_id)),
        "a baseline row has an effect: {} effects",
        effects.len()
    );
    let mut tx = store.begin().await.unwrap();
    let members = tx
        .scope_members(&protocol::ids::ScopeId::parse(scope).unwrap())
        .await
        .unwrap();
    drop(tx);
    assert_eq!(
        members.len() as u64,
        EXISTING + 1,
        "every row a member once"
    );

    // A later write to a baseline row arrives by pull.
    let key = [("id", ids[0].as_str())];
    let after = world
        .write(&[Write::Update(
            "public.notes",
            &key,
            &[("title", Some("new"))],
        )])
        .await;
    progress_reaches(&store, after).await;
    let applied = c.pull(1000).await;
    assert_eq!(applied.changes, 1);

    // A push to a baseline row is judged by the version the baseline gave it.
    let pusher = super::push::PushClient {
        engine: engine.clone(),
        user: c.user.clone(),
        client_id: c.client_id.clone(),
        generation: c.generation,
        schema: c.replica_schema(),
    };
    let held = |c: &PullClient<W::S>, id: &str| {
        let identity = protocol::digest::RowIdentity::new(
            "tbl_notes",
            "fld_notes_id",
            &protocol::value::TypedValue::String(id.to_owned()),
        );
        c.replica.scopes[scope].rows[identity.as_bytes()]
            .version
            .clone()
    };
    let base = held(&c, &ids[1]);
    let update = super::push::note_mutation(
        1,
        &ids[1],
        &pusher.schema,
        "update",
        Some(&base),
        Some(super::push::note_columns("pushed")),
    );
    let (status, body, _) = pusher.push(&pusher.batch(1, vec![update], false)).await;
    assert_eq!(status, 200, "{body:?}");
    assert!(super::push::outcome(&body, 1).0, "{body:?}");
}

/// Notes of user `cs-u` that exist before capture is installed: with the
/// shares, three baseline chunks.
const CUT_SHORT: u64 = 2_500;

/// What ends a baseline before its last chunk (ADR 0030).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandOver {
    /// The transaction of chunk 1 fails at its commit, as a crash would.
    Crash,
    /// `[capture] baseline_snapshot_ms` is 1: past it after chunk 0.
    SnapshotLimit,
}

/// A baseline ended after its first chunk committed (ADR 0030), by a crash
/// or by its snapshot's time limit, is handed over, not taken again: the
/// stream begins at the slot's consistent point, and the rows the baseline
/// had not read are re-read from where its records stopped. A client then
/// receives every existing row and every write that raced the baseline,
/// with verified checksums, and no existing row was materialized twice.
/// The world must be fresh and no engine may have started on it.
pub async fn baseline_cut_short_is_handed_over<W: CaptureWorld>(world: &W, how: HandOver) {
    let store = world.store().clone();
    let ids: Vec<String> = (0..CUT_SHORT).map(|n| pull_note(50_000 + n)).collect();
    let rows: Vec<_> = ids.iter().map(|id| note_row(id, "cs-u", "old")).collect();
    let shares: Vec<_> = (ids.iter().step_by(25))
        .map(|id| [("note_id", Some(id.as_str())), ("team_id", Some("cs-t"))])
        .collect();
    let mut writes: Vec<Write<'_>> = rows
        .iter()
        .map(|r| Write::Insert("public.notes", r))
        .collect();
    writes.extend(
        shares
            .iter()
            .map(|s| Write::Insert("public.note_shares", s)),
    );
    world.write(&writes).await;
    let mut config = push_config();
    match how {
        HandOver::Crash => world.cut_baseline_at(1).await,
        HandOver::SnapshotLimit => config.capture.baseline_snapshot_ms = 1,
    }

    let engine = Engine::start(store.clone(), config).await.unwrap();
    // Racing the baseline: a row of its last chunk updated, a note added.
    let last = [("id", ids[ids.len() - 1].as_str())];
    world
        .write(&[Write::Update(
            "public.notes",
            &last,
            &[("title", Some("raced"))],
        )])
        .await;
    let added = pull_note(60_000);
    let racing = world
        .write(&[Write::Insert(
            "public.notes",
            &note_row(&added, "cs-u", "added"),
        )])
        .await;
    progress_reaches(&store, racing).await;
    super::capture::rematerialized(&store).await;
    ready_becomes(&engine, true, "capture runs after the hand-over").await;
    if how == HandOver::Crash {
        assert!(world.baseline_was_cut().await, "the cut failed chunk 1");
    }

    let node = Node::from(&engine);
    let mut c = PullClient::connect(&store, &node, "cs-u", "cs-c").await;
    c.sync(1000).await;
    let scope = "user:cs-u";
    let held = &c.replica.scopes[scope].rows;
    assert_eq!(
        held.len() as u64,
        CUT_SHORT + 1,
        "every existing row and the added one, verified by checksum"
    );
    // The baseline's rows (its first chunk) are members with no effect
    // (ADR 0033); the rows after it were re-read at watermarks in the
    // stream, each with its one effect.
    let effects = effects_through_progress(&store, scope).await;
    let mut tx = store.begin().await.unwrap();
    let records = tx.rematerializations().await.unwrap();
    let identity = |id: &str| {
        protocol::digest::RowIdentity::new(
            "tbl_notes",
            "fld_notes_id",
            &protocol::value::TypedValue::String(id.to_owned()),
        )
    };
    let stored = tx
        .projections("tbl_notes", &[identity(&ids[0])])
        .await
        .unwrap();
    drop(tx);
    let mut last = std::collections::BTreeMap::new();
    for e in &effects {
        let earlier = last.insert(e.identity.as_bytes().to_vec(), e);
        assert!(earlier.is_none(), "one kept effect per row");
    }
    let in_baseline = (ids.iter())
        .filter(|id| !last.contains_key(identity(id).as_bytes()))
        .count();
    assert!(
        (1..=crate::capture::BASELINE_CHUNK_ROWS).contains(&in_baseline),
        "the first chunk's rows are the baseline's, the rest re-read: {in_baseline} without an effect"
    );
    let title = |row: &Value| {
        row.as_object()
            .and_then(|o| o.get("fld_notes_title"))
            .cloned()
    };
    let raced = last[identity(&ids[ids.len() - 1]).as_bytes()]
        .op
        .row()
        .expect("a row");
    let raced = json::parse(raced.row.as_bytes()).unwrap();
    assert_eq!(title(&raced), Some(Value::string("raced")));
    assert_eq!(stored.len(), 1, "the first row is the baseline's");
    assert_eq!(title(&stored[0].row), Some(Value::string("old")));
    let notes = records
        .iter()
        .find(|r| r.relation == "public.notes")
        .expect("the notes' record");
    assert!(!notes.pending, "every note was read");
    assert!(
        notes.rows >= CUT_SHORT,
        "the baseline's and the re-reads' rows: {}",
        notes.rows
    );
}

/// What blocks capture before the operator resets the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Broken {
    /// The slot was dropped behind the server's back.
    SlotLost,
    /// A transaction that cannot be materialized and cannot be repaired
    /// (a TRUNCATE of a registered table).
    Poisoned,
}

/// The operator stream reset (ADR 0012) is the way out of a lost slot or
/// an unrepairable quarantine: a new stream generation whose baseline holds
/// every row, the commits the old stream lost included. Every old cursor is
/// stale (the pull sends the scope to rebuild), an old rebuild continuation
/// answers `409 rebuild_restart_required`, and after a rebuild the client
/// holds exactly the database's rows; later writes and pushes arrive by
/// pull. The world must be fresh.
pub async fn stream_reset_recovers<W: CaptureWorld>(world: &W, broken: Broken) {
    let store = world.store().clone();
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    ready_becomes(&engine, true, "capture runs").await;
    let node = Node::from(&engine);
    for n in 0..3 {
        let lsn = note(world, 700 + n).await;
        progress_reaches(&store, lsn).await;
    }
    let mut c = PullClient::connect(&store, &node, "sl-u", "rs-c").await;
    c.sync(10).await;
    assert_eq!(c.replica.scopes["user:sl-u"].rows.len(), 3);
    // A rebuild attempt left half-done: its continuation from the old stream.
    let mut attempt = c.new_attempt("user:sl-u");
    let r = node
        .send(Route::Rebuild, "sl-u", c.rebuild_body(&attempt, 1))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    c.replica.apply_rebuild(&mut attempt, &r.body).unwrap();
    assert!(attempt.continuation.is_some());

    match broken {
        Broken::SlotLost => {
            world.lose_slot().await;
            note(world, 710).await; // lost with the slot
            blocked(&engine).await;
        }
        Broken::Poisoned => {
            ready_becomes(&engine, true, "capture runs").await;
            world
                .write(&[Write::Delete("public.notes", &[("id", &pull_note(700))])])
                .await;
            world.write(&[Write::Truncate("public.templates")]).await;
            note(world, 710).await; // waits behind the quarantine
            for _ in 0..1000 {
                if engine.capture_status() == CaptureStatus::Blocked(CaptureProblem::Truncate) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(
                engine.capture_status(),
                CaptureStatus::Blocked(CaptureProblem::Truncate)
            );
        }
    }
    ready_becomes(&engine, false, "capture is blocked").await;
    let generation = {
        let mut tx = store.begin().await.unwrap();
        let g = tx.stream_state().await.unwrap().generation;
        drop(tx);
        g
    };

    // The operator's reset, tried again as the operator's command does
    // when it meets a deadlock (PostgreSQL: with capture's transaction).
    let mut attempts = 0;
    let reset_to = loop {
        let mut tx = store.begin().await.unwrap();
        match tx.reset_stream().await {
            Ok(g) => {
                tx.commit().await.unwrap();
                break g;
            }
            Err(StoreError::Unavailable(e)) if attempts < 3 => {
                attempts += 1;
                tracing::warn!(error = %e, "the reset is tried again");
            }
            Err(e) => panic!("the reset failed: {e}"),
        }
    };
    assert_eq!(reset_to, generation + 1);
    ready_becomes(&engine, true, "the new stream's baseline is materialized").await;

    // The old cursor is stale: the scope goes to rebuild.
    let (status, body, _) = c.send(c.body(10)).await;
    assert_eq!(status, 200, "{body:?}");
    let Value::Array(rebuild) = &body.as_object().unwrap()["rebuild"] else {
        panic!("no rebuild: {body:?}");
    };
    assert!(rebuild.contains(&Value::string("user:sl-u")), "{body:?}");
    // The old continuation: the session is gone with its stream.
    let r = node
        .send(Route::Rebuild, "sl-u", c.rebuild_body(&attempt, 1))
        .await;
    let v = json::parse(&r.body).unwrap();
    assert_eq!(
        (
            r.status,
            v.as_object().unwrap()["error"].as_object().unwrap()["code"].clone()
        ),
        (409, Value::string("rebuild_restart_required"))
    );
    // After a rebuild, the client holds exactly the database's rows: the
    // note committed after the loss (or behind the poison) included, the
    // deleted one gone.
    c.replica.scopes.get_mut("user:sl-u").unwrap().cursor = None;
    c.sync(10).await;
    let expected = match broken {
        Broken::SlotLost => 4,
        Broken::Poisoned => 3,
    };
    assert_eq!(c.replica.scopes["user:sl-u"].rows.len(), expected);
    // The stream goes on: a push and a direct write arrive by pull.
    let (status, body) = c.push_note(9201, 720).await;
    assert_eq!(status, 200, "{body:?}");
    let lsn = note(world, 721).await;
    progress_reaches(&store, lsn).await;
    c.sync(10).await;
    assert_eq!(c.replica.scopes["user:sl-u"].rows.len(), expected + 2);
}
