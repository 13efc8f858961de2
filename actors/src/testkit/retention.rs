//! The retention suite (docs/adr/0024), on any store: compaction changes
//! no page a valid cursor asks for, the floor follows the active clients'
//! checkpoints, a client idle past the window rebuilds while an active one
//! never does, and a retired client no longer holds the floor back.

use std::time::Duration;

use protocol::json::{self, Value};
use protocol::position::StreamPosition;

use super::capture::{settle, stream_begun};
use super::pull::{PullClient, cursor_position, note_row, pull_note};
use super::push::push_config;
use super::transport::{Node, Route, Transport};
use super::{CaptureWorld, Write};
use crate::Engine;
use crate::config::RetentionConfig;
use crate::retention::compact;
use crate::store::{Store, StoreTx};

const SCOPE: &str = "user:rt-a";

/// The whole suite on a fresh world.
pub async fn retention_suite<W: CaptureWorld>(world: &W) {
    let store = world.store().clone();
    let node = Node::new(
        Engine::start(store.clone(), push_config()).await.unwrap(),
        std::sync::Arc::new(Transport::direct),
    );
    stream_begun(&store).await;
    let month = RetentionConfig {
        compact_batch: 1,
        ..RetentionConfig::default()
    };

    // The active client A pulls in pages of one while the scope changes;
    // R joins half-way. Every request A makes is kept.
    let mut a = PullClient::connect(&store, &node, "rt-a", "rt-a1").await;
    a.sync(10).await;
    let mut asked: Vec<Vec<u8>> = Vec::new();
    let notes: Vec<String> = (1..=6).map(|n| pull_note(100 + n)).collect();
    for n in &notes[..4] {
        insert(world, n, "x").await;
        pull_recorded(&mut a, &mut asked).await;
    }
    retitle(world, &notes[0], "y").await;
    write(
        world,
        &[Write::Delete("public.notes", &[("id", &notes[1])])],
    )
    .await;
    pull_recorded(&mut a, &mut asked).await;
    let mut r = PullClient::connect(&store, &node, "rt-r", "rt-r1").await;
    r.sync(10).await;
    r.pull(10).await; // acknowledges its cursor at the boundary
    let r_held = r.checkpoints().await["user:rt-r"].position;
    for n in &notes[4..] {
        insert(world, n, "z").await;
        pull_recorded(&mut a, &mut asked).await;
    }
    retitle(world, &notes[2], "w").await;
    pull_recorded(&mut a, &mut asked).await;
    pull_recorded(&mut a, &mut asked).await;
    assert!(asked.len() >= 8, "A was issued cursors along the way");

    // Every request again before compaction: the pages as they are now.
    let mut before = Vec::new();
    for body in &asked {
        before.push(node.send(Route::Pull, "rt-a", body.clone()).await.body);
    }

    // (a) The floor moves to R's checkpoint, the least an active client
    // holds; below it, the deletion of notes[1] goes.
    let first = compact(&store, &month, None, |_| {}).await.unwrap();
    assert!(!first.moved, "without a guard the floor stays");
    let c = compact(&store, &month, Some(first.seen), |_| {})
        .await
        .unwrap();
    assert!(c.moved);
    assert_eq!(c.floor, r_held, "R holds the floor");
    assert!(c.deleted >= 1, "the deletion below the floor is compacted");
    assert!(
        c.forgotten >= 1,
        "transactions below the floor are forgotten"
    );
    assert_floor(&store, c.floor).await;
    let (mut same, mut stale) = (0, 0);
    for (body, page) in asked.iter().zip(&before) {
        let again = node.send(Route::Pull, "rt-a", body.clone()).await;
        assert_eq!(again.status, 200);
        let position = presented(&store, body).await;
        if position >= c.floor {
            assert_eq!(&again.body, page, "compaction changed a page");
            same += 1;
        } else {
            let v = json::parse(&again.body).unwrap();
            let rebuild = &v.as_object().unwrap()["rebuild"];
            let Value::Array(rebuild) = rebuild else {
                panic!("no rebuild list")
            };
            assert!(
                rebuild.contains(&Value::string(SCOPE)),
                "a stale cursor rebuilds"
            );
            stale += 1;
        }
    }
    assert!(
        same >= 2 && stale >= 2,
        "both sides of the floor: {same} {stale}"
    );

    // (c) Retired, R holds nothing: the floor moves on to A's checkpoint.
    world.retire("rt-r1").await;
    assert!(
        r.checkpoints().await.is_empty(),
        "retirement releases checkpoints"
    );
    let (status, v, _) = r.send(r.body(10)).await;
    assert_eq!(status, 409);
    assert_eq!(code(&v), "client_retired");
    let c = compact(&store, &month, Some(c.seen), |_| {}).await.unwrap();
    let a_held = a.checkpoints().await[SCOPE].position;
    assert!(c.moved && c.floor == a_held && a_held > r_held, "{c:?}");
    assert_floor(&store, c.floor).await;

    // (b) I goes idle; past a short window it rebuilds, and A, which kept
    // acknowledging, does not.
    let mut i = PullClient::connect(&store, &node, "rt-a", "rt-i1").await;
    i.sync(10).await;
    a.sync(10).await;
    let window = RetentionConfig {
        window_seconds: 2,
        ..month.clone()
    };
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let n7 = pull_note(107);
    write(
        world,
        &[Write::Insert("public.notes", &note_row(&n7, "rt-a", "v"))],
    )
    .await;
    assert_eq!(a.sync(10).await, 1);
    a.pull(10).await; // acknowledges the cursor past notes 7
    let seen = compact(&store, &window, Some(c.seen), |_| {})
        .await
        .unwrap();
    let c = compact(&store, &window, Some(seen.seen), |_| {})
        .await
        .unwrap();
    assert_eq!(c.floor, a.checkpoints().await[SCOPE].position);
    assert!(c.floor > cursor_position(&store, &i.cursor(SCOPE)).await);
    let applied = i.pull(10).await;
    assert!(
        applied.rebuild.iter().any(|s| s == SCOPE),
        "the idle client rebuilds"
    );
    i.sync(10).await;
    assert_eq!(i.replica.scopes[SCOPE].rows, a.replica.scopes[SCOPE].rows);
    let applied = a.pull(10).await;
    assert!(
        applied.rebuild.is_empty(),
        "an active client never rebuilds"
    );
    for (name, held) in [("A", &a), ("I", &i)] {
        assert_eq!(held.replica.scopes[SCOPE].rows.len(), 6, "{name}");
    }
}

/// Inserts a note of rt-a, materialized.
async fn insert<W: CaptureWorld>(world: &W, note: &str, title: &str) {
    write(
        world,
        &[Write::Insert(
            "public.notes",
            &note_row(note, "rt-a", title),
        )],
    )
    .await;
}

/// Changes a note's title, materialized.
async fn retitle<W: CaptureWorld>(world: &W, note: &str, title: &str) {
    let set = [("title", Some(title))];
    write(
        world,
        &[Write::Update("public.notes", &[("id", note)], &set)],
    )
    .await;
}

/// Writes and waits until capture materialized it.
async fn write<W: CaptureWorld>(world: &W, writes: &[Write<'_>]) {
    let lsn = world.write(writes).await;
    settle(world.store(), lsn).await;
}

/// One pull of one change, which must not send A to rebuild; its request kept.
async fn pull_recorded<S: Store>(a: &mut PullClient<S>, asked: &mut Vec<Vec<u8>>) {
    let body = a.body(1);
    let r = a.send_raw(body.clone()).await;
    assert_eq!(r.status, 200);
    let applied = a.replica.apply(&r.body).unwrap();
    assert!(
        applied.rebuild.is_empty(),
        "an active client never rebuilds"
    );
    assert!(applied.mismatched.is_empty());
    asked.push(body);
}

/// The position of the cursor `body` presents for the scope.
async fn presented<S: Store>(store: &S, body: &[u8]) -> StreamPosition {
    let v = json::parse(body).unwrap();
    let scopes = v.as_object().unwrap()["scopes"].as_object().unwrap();
    let cursor = scopes[SCOPE].as_object().unwrap()["cursor"]
        .as_str()
        .unwrap();
    cursor_position(store, cursor).await
}

async fn assert_floor<S: Store>(store: &S, floor: StreamPosition) {
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.stream_state().await.unwrap().floor, floor);
}

fn code(v: &Value) -> &str {
    v.as_object().unwrap()["error"].as_object().unwrap()["code"]
        .as_str()
        .unwrap()
}
