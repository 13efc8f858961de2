//! Adopting an existing database (ADR 0011): 100,000 notes and their
//! shares exist before the server starts, and the application keeps
//! writing while the baseline is taken. Every client that connects and
//! rebuilds receives exactly the rows the database holds, with verified
//! checksums; the baseline stores no effect (its rows reach clients by
//! rebuild, ADR 0033), and each write committed after the slot's snapshot
//! has its own effect in the stream: none lost, none doubled.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use actors::Engine;
use actors::store::{Store, StoreTx};
use actors::testkit::{Node, PullClient, push_config};
use protocol::ids::ScopeId;
use protocol::json::Value;
use protocol::position::StreamPosition;
use sqlx::PgPool;
use store_pg::cluster::PgCluster;
use store_pg::example_store;

const NOTES: i64 = 100_000;
const USERS: i64 = 10;

fn note_id(n: i64) -> String {
    format!("00000000-0000-4000-8000-{n:012x}")
}

/// One application transaction: the note it wrote, and WAL positions just
/// before its commit and just after (its commit record lies between).
struct Written {
    note: String,
    before: i64,
    after: i64,
}

/// The application's writer: one note per transaction (a new note, a new
/// title, or a hard delete), until `stop`.
async fn application(pool: PgPool, stop: Arc<AtomicBool>) -> Vec<Written> {
    let mut out = Vec::new();
    let mut n: i64 = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let mut tx = pool.begin().await.unwrap();
        let (note, done) = match n % 3 {
            0 => {
                let id = note_id(NOTES + n);
                let done = sqlx::query(
                    "INSERT INTO public.notes (id, owner_id, title) VALUES ($1::uuid, $2, 'new')",
                )
                .bind(&id)
                .bind(format!("user-{}", n % USERS))
                .execute(&mut *tx)
                .await
                .unwrap();
                (id, done)
            }
            1 => {
                let id = note_id(1 + (n * 7919) % NOTES);
                let done = sqlx::query("UPDATE public.notes SET title = $2 WHERE id = $1::uuid")
                    .bind(&id)
                    .bind(format!("edit {n}"))
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                (id, done)
            }
            _ => {
                let id = note_id(1 + (n * 104_729) % NOTES);
                let done = sqlx::query("DELETE FROM public.notes WHERE id = $1::uuid")
                    .bind(&id)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                (id, done)
            }
        };
        let before: i64 =
            sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
        tx.commit().await.unwrap();
        let after: i64 =
            sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
                .fetch_one(&pool)
                .await
                .unwrap();
        // A write that found no row changed nothing: no effect is owed.
        if done.rows_affected() == 1 {
            out.push(Written {
                note,
                before,
                after,
            });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    out
}

/// The note key an effect carries.
fn key_text(v: &Value) -> String {
    v.as_str().unwrap().to_owned()
}

#[tokio::test]
async fn an_existing_database_is_adopted_while_the_application_writes() {
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "adopt").await;
    let pool = store.pool().clone();
    // The application's data, from before synchro: no trigger versions it.
    sqlx::raw_sql(&format!(
        "INSERT INTO public.notes (id, owner_id, title, updated_at) \
         SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(g), 12, '0'))::uuid, \
                'user-' || (g % {USERS}), 'note ' || g, '2026-07-18 14:00:00+00' \
         FROM generate_series(1, {NOTES}) g; \
         INSERT INTO public.note_shares (note_id, team_id) \
         SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(g), 12, '0'))::uuid, 'team-' || (g % 3) \
         FROM generate_series(4, {NOTES}, 4) g; \
         INSERT INTO public.team_members (user_id, team_id) VALUES ('user-0', 'team-0');"
    ))
    .execute(&pool)
    .await
    .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn(application(pool.clone(), stop.clone()));
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    // Until the baseline is materialized, and a little after it.
    baseline_done(&pool).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let written = writer.await.unwrap();
    let consistent: i64 = sqlx::query_scalar("SELECT consistent_lsn FROM synchro.capture_slot")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        written.iter().any(|w| w.before >= consistent),
        "the application wrote after the slot's snapshot"
    );
    caught_up(&store, written.last().unwrap().before as u64).await;

    // Every row, exactly once, by checksum: each user's scope, and a team's.
    let node = Node::from(&engine);
    for u in 0..USERS {
        let user = format!("user-{u}");
        let mut c = PullClient::connect(&store, &node, &user, &format!("client-{u}")).await;
        c.sync(1000).await;
        let held = c.replica.scopes[&format!("user:{user}")].rows.len() as i64;
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM public.notes WHERE owner_id = $1")
            .bind(&user)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(held, rows, "{user}");
        if u == 0 {
            let shared: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM public.note_shares WHERE team_id = 'team-0'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            assert_eq!(c.replica.scopes["team:team-0"].rows.len() as i64, shared);
        }
    }

    // The effects: the baseline stores none (ADR 0033), and a scope keeps
    // only each row's last one (docs/adr/0024): the stream's, for a note
    // the application wrote after the snapshot.
    let mut tx = store.begin().await.unwrap();
    let through = tx.capture_progress().await.unwrap().boundary;
    let mut stream: BTreeMap<String, usize> = BTreeMap::new();
    for u in 0..USERS {
        let scope = ScopeId::parse(&format!("user:user-{u}")).unwrap();
        for e in tx
            .scope_effects(&scope, StreamPosition::GenerationStart, through)
            .await
            .unwrap()
        {
            assert!(
                e.commit_lsn as i64 >= consistent,
                "an effect below the stream: the baseline stores none"
            );
            *stream.entry(key_text(&e.key)).or_default() += 1;
        }
    }
    drop(tx);
    for (note, n) in &stream {
        assert_eq!(*n, 1, "note {note}: {n} effects kept");
    }
    let mut after: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for w in &written {
        let entry = after.entry(w.note.as_str()).or_default();
        if w.before >= consistent {
            entry.0 += 1; // certainly after the snapshot
        } else if w.after > consistent {
            entry.1 += 1; // its commit may be on either side
        }
    }
    for (note, (certain, maybe)) in &after {
        if *certain > 0 {
            assert!(stream.contains_key(*note), "note {note}: no stream effect");
        } else if *maybe == 0 {
            assert!(
                !stream.contains_key(*note),
                "note {note}: a stream effect, no later write"
            );
        }
    }
    for note in stream.keys() {
        assert!(
            after.contains_key(note.as_str()),
            "note {note}: a stream effect, no write"
        );
    }
}

/// Waits (up to two minutes) until the baseline is materialized.
async fn baseline_done(pool: &PgPool) {
    for _ in 0..12_000 {
        let done: Option<bool> =
            sqlx::query_scalar("SELECT baseline_done FROM synchro.capture_slot")
                .fetch_optional(pool)
                .await
                .unwrap();
        if done == Some(true) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the baseline was not materialized in two minutes");
}

async fn caught_up<S: Store>(store: &S, lsn: u64) {
    for _ in 0..6000 {
        let mut tx = store.begin().await.unwrap();
        let p = tx.capture_progress().await.unwrap();
        drop(tx);
        if let protocol::position::Boundary::TransactionEnd { commit_lsn } = p.boundary
            && commit_lsn >= lsn
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("capture did not reach {lsn}");
}

/// A chunk is computed while the one before it writes (ADR 0036), but not
/// after a chunk that writes dependency rows: those decide its rows'
/// membership, and it could not read them before they commit. Here every
/// share is in the baseline's first chunk (dependency relations are read
/// first), and the notes they share follow in the later chunks.
#[tokio::test]
async fn chunks_after_dependency_rows_see_them() {
    const SHARED_NOTES: i64 = 8_000;
    let cluster = PgCluster::temp().unwrap();
    let store = example_store(&cluster, "after_shares").await;
    let pool = store.pool().clone();
    sqlx::raw_sql(&format!(
        "INSERT INTO public.notes (id, owner_id, title) \
         SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(g), 12, '0'))::uuid, \
                'user-' || (g % {USERS}), 'note ' || g \
         FROM generate_series(1, {SHARED_NOTES}) g; \
         INSERT INTO public.note_shares (note_id, team_id) \
         SELECT ('00000000-0000-4000-8000-' || lpad(to_hex(g), 12, '0'))::uuid, 'team-0' \
         FROM generate_series(20, {SHARED_NOTES}, 20) g; \
         INSERT INTO public.team_members (user_id, team_id) VALUES ('user-0', 'team-0');"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let engine = Engine::start(store.clone(), push_config()).await.unwrap();
    baseline_done(&pool).await;
    let node = Node::from(&engine);
    let mut c = PullClient::connect(&store, &node, "user-0", "client-0").await;
    c.sync(1000).await;
    assert_eq!(
        c.replica.scopes["team:team-0"].rows.len() as i64,
        SHARED_NOTES / 20,
        "every shared note is in the team's scope"
    );
}
