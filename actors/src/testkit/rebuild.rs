//! The rebuild suites: the store's sessions and stages
//! (`rebuild_store_suite`), and `/sync/rebuild` itself on any world and
//! transport (`rebuild_suite_via`): every error and its precedence, pages
//! replayed byte for byte, the handoff to pull while the application
//! writes, and every way a session goes stale.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test support fails loudly

use std::sync::Arc;

use invariants::pull::{RebuildStep, Rebuilding};
use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{CanonicalUuid, ScopeId, ServerVersion};
use protocol::json::{self, Value};
use protocol::position::Boundary;
use protocol::value::TypedValue;

use super::capture::settle;
use super::pull::{PullClient, edit, note_row, pull_note};
use super::push::push_config;
use super::transport::{Node, Route, Serve, Transport};
use super::{CaptureWorld, Write};
use crate::Engine;
use crate::capture::{Materialization, MaterializedTransaction, Membership, Projection};
use crate::staging::{FORGET_AFTER_MICROS, RebuildSession, SESSION_LIFETIME_MICROS};
use crate::store::{Store, StoreTx};

const NOW: i64 = super::NOW;

fn uuid(n: u8) -> CanonicalUuid {
    CanonicalUuid::parse(&format!("00000000-0000-4000-8000-0000000000{n:02x}")).unwrap()
}

/// The store's rebuild state, the same on every store.
pub async fn rebuild_store_suite<S: Store>(store: &S) {
    let s1 = ScopeId::parse("s1").unwrap();
    let identity = |k: i32| RowIdentity::new("t", "id", &TypedValue::Int(k));
    let projection = |k: i32, scopes: &[&ScopeId]| Projection {
        table_id: "t".into(),
        identity: identity(k),
        key: k.to_string(),
        row: json::object([("id", Value::int(i64::from(k)))]),
        version: ServerVersion::parse(&format!("v{k}")).unwrap(),
        digest: Digest([k as u8; 32]),
        schema_version: 1,
        tombstone: false,
        scopes: scopes.iter().map(|s| (*s).clone()).collect(),
    };
    let materialize = |lsn: u64, rows: Vec<Projection>| {
        let joined = rows
            .iter()
            .flat_map(|p| {
                p.scopes.iter().map(|s| Membership {
                    scope: s.clone(),
                    table_id: p.table_id.clone(),
                    identity: p.identity.clone(),
                })
            })
            .collect();
        Materialization {
            commit_lsn: lsn,
            end_lsn: lsn + 8,
            transactions: vec![MaterializedTransaction {
                commit_lsn: lsn,
                end_lsn: lsn + 8,
                row_events: 1,
            }],
            new_projections: rows,
            joined,
            stream_generation: 1, // a fresh store's
            ..Materialization::default()
        }
    };
    let s2 = ScopeId::parse("s2").unwrap();
    // Rows 3, 1, 2 of s1 (and 1 also of s2), written out of key order.
    let m = materialize(
        100,
        vec![
            projection(3, &[&s1]),
            projection(1, &[&s1, &s2]),
            projection(2, &[&s1]),
        ],
    );
    let mut tx = store.begin().await.unwrap();
    tx.materialize(&m).await.unwrap();
    tx.commit().await.unwrap();

    let session = |id: u8, rebuild: u8, scope: &ScopeId| RebuildSession {
        session_id: uuid(id),
        client_id: "c1".into(),
        rebuild_id: uuid(rebuild),
        scope: scope.clone(),
        client_generation: 1,
        schema_hash: Digest([9; 32]),
        stream_generation: 1,
        membership_generation: 1,
        retention_generation: 1,
        accepted_write_epoch: 0,
        boundary: Boundary::TransactionEnd { commit_lsn: 100 },
        page_limit: 2,
        expires_at: NOW + SESSION_LIFETIME_MICROS,
        digest: None,
        cursor_key_id: "ic-7".into(),
        continuation_key_id: "rc-7".into(),
    };
    let mut tx = store.begin_snapshot().await.unwrap();
    assert_eq!(tx.rebuild_session("c1", &uuid(1)).await.unwrap(), None);
    // Staged in row-identity order, with an override digest for row 2.
    let a = session(10, 1, &s1);
    assert_eq!(tx.scope_size(&s1).await.unwrap(), 3);
    assert_eq!(tx.scope_size(&s2).await.unwrap(), 1);
    assert_eq!(
        tx.scope_size(&ScopeId::parse("nobody").unwrap())
            .await
            .unwrap(),
        0
    );
    let staged = tx
        .stage_rebuild(&a, &[(identity(2), Digest([42; 32]))])
        .await
        .unwrap();
    assert_eq!(staged, 3);
    let mut order = [identity(1), identity(2), identity(3)];
    order.sort();
    let want: Vec<(RowIdentity, Digest)> = order
        .iter()
        .map(|i| {
            let d = if *i == identity(2) {
                Digest([42; 32])
            } else if *i == identity(1) {
                Digest([1; 32])
            } else {
                Digest([3; 32])
            };
            (i.clone(), d)
        })
        .collect();
    assert_eq!(tx.staged_digests(&a.session_id, 0, 10).await.unwrap(), want);
    assert_eq!(
        tx.staged_digests(&a.session_id, 1, 1).await.unwrap(),
        want[1..2],
        "from an ordinal, at most max"
    );
    let rows = tx.staged_rows(&a.session_id, 1, 5).await.unwrap();
    assert_eq!(rows.len(), 2, "from an ordinal, at most max");
    assert_eq!(
        rows.iter().map(|r| r.ordinal).collect::<Vec<_>>(),
        [1, 2],
        "ordinals are dense"
    );
    assert_eq!(rows[0].identity, want[1].0);
    let all = tx.staged_rows(&a.session_id, 0, 10).await.unwrap();
    let one = all.iter().find(|r| r.identity == identity(1)).unwrap();
    assert_eq!(
        (
            one.table_id.as_str(),
            one.row.as_str(),
            one.version.as_str()
        ),
        ("t", r#"{"id":1}"#, "v1"),
        "the projection's row text and version"
    );
    assert_eq!(
        tx.rebuild_session("c1", &uuid(1)).await.unwrap(),
        Some(a.clone()),
        "unsealed"
    );
    tx.seal_rebuild_session(&a.session_id, &Digest([5; 32]))
        .await
        .unwrap();
    let sealed = RebuildSession {
        digest: Some(Digest([5; 32])),
        ..a.clone()
    };
    assert_eq!(
        tx.rebuild_session("c1", &uuid(1)).await.unwrap(),
        Some(sealed.clone())
    );
    assert_eq!(tx.rebuild_session("c2", &uuid(1)).await.unwrap(), None);
    drop(tx);
    // What was not committed rolled back: stage it again, and commit.
    let mut tx = store.begin_snapshot().await.unwrap();
    assert_eq!(tx.rebuild_session("c1", &uuid(1)).await.unwrap(), None);
    tx.stage_rebuild(&a, &[]).await.unwrap();
    tx.seal_rebuild_session(&a.session_id, &Digest([5; 32]))
        .await
        .unwrap();
    // An empty scope stages nothing.
    let empty = session(11, 2, &ScopeId::parse("nobody").unwrap());
    assert_eq!(tx.stage_rebuild(&empty, &[]).await.unwrap(), 0);
    assert!(
        tx.staged_digests(&empty.session_id, 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
    tx.commit().await.unwrap();

    // The stage is immutable: a later materialization changes nothing in it.
    let mut tx = store.begin().await.unwrap();
    tx.materialize(&materialize(200, vec![projection(4, &[&s1])]))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin_snapshot().await.unwrap();
    let all = tx.staged_rows(&a.session_id, 0, 10).await.unwrap();
    assert_eq!(all.len(), 3, "the stage is as it was staged");
    assert_eq!(
        tx.staged_digests(&a.session_id, 0, 10).await.unwrap(),
        order
            .iter()
            .map(|i| (
                i.clone(),
                Digest(
                    [if *i == identity(1) {
                        1
                    } else if *i == identity(2) {
                        2
                    } else {
                        3
                    }; 32]
                )
            ))
            .collect::<Vec<_>>()
    );
    // A new session of the same attempt replaces the old one and its stage.
    let b = session(12, 1, &s1);
    assert_eq!(tx.scope_size(&s1).await.unwrap(), 4, "the scope now");
    assert_eq!(tx.stage_rebuild(&b, &[]).await.unwrap(), 4);
    assert_eq!(
        tx.rebuild_session("c1", &uuid(1))
            .await
            .unwrap()
            .map(|s| s.session_id),
        Some(b.session_id)
    );
    assert!(
        tx.staged_rows(&a.session_id, 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        tx.staged_rows(&b.session_id, 4, 10)
            .await
            .unwrap()
            .is_empty()
    );
    tx.commit().await.unwrap();

    // The sweep: only what expired, at most `max` at a time, and the
    // session rows stay.
    let expiry = NOW + SESSION_LIFETIME_MICROS;
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.sweep_rebuild_sessions(expiry - 1, 10).await.unwrap(), 0);
    assert_eq!(tx.sweep_rebuild_sessions(expiry, 1).await.unwrap(), 1);
    assert_eq!(tx.sweep_rebuild_sessions(expiry, 10).await.unwrap(), 1);
    assert_eq!(tx.sweep_rebuild_sessions(expiry, 10).await.unwrap(), 0);
    assert!(
        tx.staged_rows(&b.session_id, 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        tx.staged_digests(&b.session_id, 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        tx.rebuild_session("c1", &uuid(1))
            .await
            .unwrap()
            .map(|s| s.session_id),
        Some(b.session_id),
        "a swept session still answers for its rebuild_id"
    );
    tx.commit().await.unwrap();

    // Forgetting: only swept sessions expired by then, at most `max` at a
    // time; then their rebuild_ids are unknown.
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.forget_rebuild_sessions(expiry - 1, 10).await.unwrap(), 0);
    assert_eq!(tx.forget_rebuild_sessions(expiry, 1).await.unwrap(), 1);
    assert_eq!(tx.forget_rebuild_sessions(expiry, 10).await.unwrap(), 1);
    assert_eq!(tx.forget_rebuild_sessions(expiry, 10).await.unwrap(), 0);
    assert_eq!(tx.rebuild_session("c1", &uuid(1)).await.unwrap(), None);
    tx.commit().await.unwrap();

    // Usage counts the rows of live sessions, by the owner's user; a
    // superseded session is expired now, without its stage, and
    // still answers for its rebuild_id.
    let mut tx = store.begin().await.unwrap();
    let owned = crate::store::ClientRecord::fresh("u-usage", "c1", 1, NOW);
    assert!(tx.insert_client(&owned).await.unwrap());
    let on_s1 = session(30, 30, &s1);
    let on_s2 = session(31, 31, &s2);
    let r1 = tx.stage_rebuild(&on_s1, &[]).await.unwrap();
    let r2 = tx.stage_rebuild(&on_s2, &[]).await.unwrap();
    assert!(r1 > 0 && r2 > 0);
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let usage = |user_rows, total_rows| crate::staging::RebuildUsage {
        user_rows,
        total_rows,
    };
    let both = r1 + r2;
    assert_eq!(
        tx.rebuild_usage("u-usage", NOW).await.unwrap(),
        usage(both, both)
    );
    assert_eq!(
        tx.rebuild_usage("u-other", NOW).await.unwrap(),
        usage(0, both)
    );
    assert_eq!(
        tx.rebuild_usage("u-usage", expiry).await.unwrap(),
        usage(0, 0),
        "an expired session holds nothing"
    );
    assert_eq!(
        tx.supersede_rebuild_sessions("c1", &s1, NOW).await.unwrap(),
        1
    );
    assert_eq!(
        tx.supersede_rebuild_sessions("c1", &s1, NOW).await.unwrap(),
        0
    );
    assert_eq!(
        tx.rebuild_usage("u-usage", NOW).await.unwrap(),
        usage(r2, r2)
    );
    let ended = tx.rebuild_session("c1", &uuid(30)).await.unwrap().unwrap();
    assert_eq!(ended.expires_at, NOW);
    assert!(
        tx.staged_rows(&on_s1.session_id, 0, 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        !tx.staged_rows(&on_s2.session_id, 0, 10)
            .await
            .unwrap()
            .is_empty(),
        "another scope's session lives on"
    );
    tx.commit().await.unwrap();

    // A stage larger than any block a store may keep it in reads back
    // dense and whole, from every ordinal, across every boundary.
    let s3 = ScopeId::parse("s3").unwrap();
    let many: Vec<Projection> = (1000..1600).map(|k| projection(k, &[&s3])).collect();
    let mut order: Vec<RowIdentity> = many.iter().map(|p| p.identity.clone()).collect();
    order.sort();
    let mut tx = store.begin().await.unwrap();
    tx.materialize(&materialize(300, many)).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin_snapshot().await.unwrap();
    let big = session(40, 40, &s3);
    assert_eq!(tx.stage_rebuild(&big, &[]).await.unwrap(), 600);
    for (from, max) in [
        (0, 1000),
        (0, 1),
        (255, 2),
        (256, 1),
        (511, 3),
        (100, 300),
        (599, 5),
        (600, 5),
    ] {
        let rows = tx.staged_rows(&big.session_id, from, max).await.unwrap();
        let want = &order[(from as usize).min(600)..(from as usize + max).min(600)];
        assert_eq!(
            rows.iter().map(|r| r.identity.clone()).collect::<Vec<_>>(),
            want,
            "rows from {from}, at most {max}"
        );
        assert!(
            rows.iter().zip(from..).all(|(r, o)| r.ordinal == o),
            "dense ordinals from {from}"
        );
        let digests = tx.staged_digests(&big.session_id, from, max).await.unwrap();
        assert_eq!(
            digests.iter().map(|(i, _)| i.clone()).collect::<Vec<_>>(),
            want,
            "digests from {from}, at most {max}"
        );
    }
    let row = tx.staged_rows(&big.session_id, 599, 1).await.unwrap();
    let k = order[599].key().map(|(_, v)| v.to_wire()).unwrap();
    assert_eq!(
        row[0].row,
        json::to_canonical_string(&json::object([("id", k)])),
        "each row keeps its own text"
    );
    drop(tx);
}

/// The rebuild suite on one world, its clients calling the engine.
pub async fn rebuild_suite<W: CaptureWorld>(world: &W) {
    rebuild_suite_via(world, Arc::new(Transport::direct)).await;
}

/// The rebuild suite on one world, its clients reaching the engine
/// through `serve`'s transport.
pub async fn rebuild_suite_via<W: CaptureWorld>(world: &W, serve: Serve) {
    let store = world.store().clone();
    // First, while no other session is staged: the instance's budget is
    // then this section's alone.
    let mut limited = push_config();
    limited.limits.rebuild_rows_per_user = 10;
    limited.limits.rebuild_rows_total = 15;
    let budgets = Node::new(
        Engine::start(store.clone(), limited).await.unwrap(),
        serve.clone(),
    );
    staging_limits(world, &budgets).await;
    let node = Node::new(
        Engine::start(store.clone(), push_config()).await.unwrap(),
        serve,
    );
    request_errors(world, &node).await;
    pages_and_handoff(world, &node).await;
    sizes(world, &node).await;
    // On an engine of its own, called directly: its sessions and every
    // request it answers live on the suite's clock (`NOW`, which travels
    // forward here). A request over HTTP carries the real clock, later than
    // `NOW`, and would wake the sweep to find these sessions long expired.
    // The first engine's sweep gets no request after `sizes`; its last pass
    // (at most one pause after that request) ends before the sessions here begin.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let own = Engine::start(store.clone(), push_config()).await.unwrap();
    stale_sessions(world, &Node::from(&own)).await;
    changed_rules(world, &node).await;
}

/// Writes `rows` notes of `owner` and waits until capture has them.
async fn notes<W: CaptureWorld>(world: &W, owner: &str, from: u64, rows: u64) {
    let ids: Vec<String> = (from..from + rows).map(pull_note).collect();
    let writes: Vec<[(&str, Option<&str>); 7]> =
        ids.iter().map(|id| note_row(id, owner, "t")).collect();
    let writes: Vec<Write<'_>> = writes
        .iter()
        .map(|r| Write::Insert("public.notes", r))
        .collect();
    let lsn = world.write(&writes).await;
    settle(world.store(), lsn).await;
}

fn code(r: &crate::Reply) -> String {
    let v = json::parse(&r.body).unwrap();
    v.as_object().unwrap()["error"].as_object().unwrap()["code"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// At most one live session per client and scope: a new attempt
/// supersedes the old one, whose continuation and first request then
/// answer 409. Staging budgets per user (10 rows here) and per instance
/// (15): a stage that would pass one while other stages hold it answers
/// 429 with Retry-After, and changes nothing; a stage alone may pass it.
/// On the engine's clock (called directly), so that sessions expire when
/// this section says.
async fn staging_limits<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let (t0, t1) = (NOW, NOW + SESSION_LIFETIME_MICROS);
    let rebuild = |user: &'static str, body: Vec<u8>, at: i64| {
        let engine = node.engine.clone();
        async move { engine.rebuild(user, body, at).await }
    };
    let busy = |r: &crate::Reply| {
        assert_eq!(
            (r.status, code(r), r.retry_after),
            (429, "retry_later".into(), Some(5)),
            "{}",
            String::from_utf8_lossy(&r.body)
        );
    };
    let ok = |r: &crate::Reply| assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    // A scope larger than the user's budget stages while nothing else is.
    notes(world, "bl-big", 900, 12).await;
    let mut big = PullClient::connect(store, node, "bl-big", "bl-big-c").await;
    let first_big = big.new_attempt("user:bl-big");
    ok(&rebuild("bl-big", big.rebuild_body(&first_big, 100), t0).await);
    // It holds 12 of the instance's 15 rows: another user's 8 rows wait.
    notes(world, "bl-u", 920, 8).await;
    let mut a = PullClient::connect(store, node, "bl-u", "bl-a").await;
    let scope = "user:bl-u";
    let mut first = a.new_attempt(scope);
    busy(&rebuild("bl-u", a.rebuild_body(&first, 1), t0).await);
    // A new attempt of the big scope supersedes its session: its own old
    // rows no longer count, and it stages again.
    let again_big = big.new_attempt("user:bl-big");
    ok(&rebuild("bl-big", big.rebuild_body(&again_big, 100), t0).await);
    // Once the big session expired, bl-u's first attempt stages.
    let r = rebuild("bl-u", a.rebuild_body(&first, 1), t1).await;
    ok(&r);
    assert!(matches!(
        a.replica.apply_rebuild(&mut first, &r.body).unwrap(),
        RebuildStep::More(_)
    ));
    let continuation = a.rebuild_body(&first, 1);
    // A second attempt of the same client and scope supersedes the first,
    // whose continuation and first request then answer 409.
    let second = a.new_attempt(scope);
    ok(&rebuild("bl-u", a.rebuild_body(&second, 1), t1).await);
    for body in [
        continuation,
        a.rebuild_body(&Rebuilding::new(scope, &first.rebuild_id), 1),
    ] {
        let r = rebuild("bl-u", body, t1).await;
        assert_eq!(
            (r.status, code(&r)),
            (409, "rebuild_restart_required".into()),
            "{}",
            String::from_utf8_lossy(&r.body)
        );
    }
    // The user's other client: its 8 rows beside the first client's 8
    // would pass the user's 10.
    let mut b = PullClient::connect(store, node, "bl-u", "bl-b").await;
    let other = b.new_attempt(scope);
    busy(&rebuild("bl-u", b.rebuild_body(&other, 1), t1).await);
    // The refusal staged and superseded nothing.
    let mut tx = store.begin().await.unwrap();
    let usage = tx.rebuild_usage("bl-u", t1).await.unwrap();
    assert_eq!((usage.user_rows, usage.total_rows), (8, 8));
    drop(tx);
}

/// Every request error, in the dispatch order.
async fn request_errors<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    notes(world, "re-u", 100, 3).await;
    let mut c = PullClient::connect(store, node, "re-u", "re-c").await;
    let scope = "user:re-u";
    let mut attempt = c.new_attempt(scope);
    let good = c.rebuild_body(&attempt, 2);
    let send = |body: Vec<u8>| {
        let node = node.clone();
        async move { node.send(Route::Rebuild, "re-u", body).await }
    };
    // 1. Another user's client, before structure.
    let r = node.send(Route::Rebuild, "someone", good.clone()).await;
    assert_eq!((r.status, code(&r)), (401, "auth_required".into()));
    let r = send(edit(&good, |o| {
        o.insert("client_id".into(), Value::string("unknown-c"));
        o.remove("limit");
    }))
    .await;
    assert_eq!((r.status, code(&r)), (401, "auth_required".into()));
    // 3. Structure: every member, the limit's range, the UUID, the scope.
    for member in [
        "client_id",
        "client_generation",
        "schema",
        "scope",
        "rebuild_id",
        "cursor",
        "limit",
    ] {
        let r = send(edit(&good, |o| {
            o.remove(member);
        }))
        .await;
        assert_eq!(
            (r.status, code(&r)),
            (400, "invalid_request".into()),
            "{member}"
        );
    }
    for (member, v) in [
        ("limit", Value::int(0)),
        ("limit", Value::int(1001)),
        ("rebuild_id", Value::string("not-a-uuid")),
        (
            "rebuild_id",
            Value::string("00000000-0000-4000-8000-00000000000A"),
        ),
        ("scope", Value::string("")),
        ("extra", Value::Bool(true)),
    ] {
        let r = send(edit(&good, |o| {
            o.insert(member.into(), v);
        }))
        .await;
        assert_eq!(
            (r.status, code(&r)),
            (400, "invalid_request".into()),
            "{member}"
        );
    }
    let r = send(b"{".to_vec()).await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request".into()));
    // 6. The generation gate before the schema gate, both before the continuation.
    let other_schema = json::object([
        ("version", Value::int(1)),
        ("hash", Value::string("0".repeat(64))),
    ]);
    let r = send(edit(&good, |o| {
        o.insert("client_generation".into(), Value::int(9));
        o.insert("schema".into(), other_schema.clone());
        o.insert("cursor".into(), Value::string("rc1.forged"));
    }))
    .await;
    assert_eq!(
        (r.status, code(&r)),
        (409, "client_generation_expired".into())
    );
    let r = send(edit(&good, |o| {
        o.insert("schema".into(), other_schema.clone());
        o.insert("cursor".into(), Value::string("rc1.forged"));
    }))
    .await;
    assert_eq!((r.status, code(&r)), (422, "schema_mismatch".into()));
    // 7. A forged, malformed or wrong-kind continuation; a scope not assigned.
    c.rebuild().await;
    let incremental = c.cursor(scope);
    for token in ["rc1.forged", "x", incremental.as_str()] {
        let r = send(edit(&good, |o| {
            o.insert("cursor".into(), Value::string(token));
        }))
        .await;
        assert_eq!(
            (r.status, code(&r)),
            (400, "invalid_request".into()),
            "{token}"
        );
    }
    let r = send(edit(&good, |o| {
        o.insert("scope".into(), Value::string("user:someone-else"));
    }))
    .await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request".into()));
    // A continuation of another limit, scope or attempt is misbound.
    let first = send(c.rebuild_body(&attempt, 2)).await;
    assert_eq!(first.status, 200);
    let step = c.replica.apply_rebuild(&mut attempt, &first.body).unwrap();
    assert!(matches!(step, RebuildStep::More(_)));
    let next = c.rebuild_body(&attempt, 2);
    for (member, v) in [
        ("limit", Value::int(3)),
        ("scope", Value::string("templates_public")),
        (
            "rebuild_id",
            Value::string("00000000-0000-4000-8000-0000000000ff"),
        ),
    ] {
        let r = send(edit(&next, |o| {
            o.insert(member.into(), v);
        }))
        .await;
        assert_eq!(
            (r.status, code(&r)),
            (400, "invalid_request".into()),
            "{member}"
        );
    }
    // The same attempt's ID for another scope or limit names another rebuild.
    let r = send(edit(&good, |o| {
        o.insert("limit".into(), Value::int(5));
        o.insert(
            "rebuild_id".into(),
            Value::string(attempt.rebuild_id.clone()),
        );
    }))
    .await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request".into()));
    // 8. Admission control.
    let held = node.engine.occupy_pull_pages().await;
    let r = send(next.clone()).await;
    assert_eq!(
        (r.status, code(&r), r.retry_after),
        (429, "retry_later".into(), Some(5))
    );
    drop(held);
    // 4. A retired client, before the generation gate.
    world.retire("re-c").await;
    let r = send(edit(&next, |o| {
        o.insert("client_generation".into(), Value::int(9));
    }))
    .await;
    assert_eq!((r.status, code(&r)), (409, "client_retired".into()));
}

/// A multi-page rebuild while the application writes: every page replays
/// byte for byte, nothing written after B is in any page, and all of it
/// arrives in the pull that presents `final_scope_cursor`.
async fn pages_and_handoff<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    notes(world, "ph-u", 200, 5).await;
    let mut c = PullClient::connect(store, node, "ph-u", "ph-c").await;
    let scope = "user:ph-u";
    let mut attempt = c.new_attempt(scope);
    let send = |body: Vec<u8>| {
        let node = node.clone();
        async move { node.send(Route::Rebuild, "ph-u", body).await }
    };
    let mut pages = Vec::new();
    let mut requests = Vec::new();
    loop {
        let body = c.rebuild_body(&attempt, 2);
        let r = send(body.clone()).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        if pages.is_empty() {
            // The application writes meanwhile: a new row and a change.
            world
                .write(&[
                    Write::Insert("public.notes", &note_row(&pull_note(290), "ph-u", "late")),
                    Write::Update(
                        "public.notes",
                        &[("id", pull_note(200).as_str())],
                        &[("title", Some("changed"))],
                    ),
                ])
                .await;
        }
        let step = c.replica.apply_rebuild(&mut attempt, &r.body).unwrap();
        requests.push(body);
        pages.push(r.body);
        match step {
            RebuildStep::More(_) => {}
            RebuildStep::Done => break,
            RebuildStep::Mismatch => panic!("the final checksum did not verify"),
        }
    }
    assert_eq!(pages.len(), 3, "5 rows at limit 2");
    let late = pull_note(290);
    for p in &pages {
        let text = String::from_utf8_lossy(p);
        assert!(!text.contains(&late) && !text.contains("changed"), "{text}");
    }
    // Every page again, byte for byte: first, intermediate, final.
    for (body, page) in requests.iter().zip(&pages) {
        let r = send(body.clone()).await;
        assert_eq!((r.status, &r.body), (200, page), "replayed exactly");
    }
    // The final cursor hands over to pull: both writes arrive.
    let final_cursor = c.replica.scopes[scope].cursor.clone().unwrap();
    let before = c.checkpoints().await;
    assert!(
        !before.contains_key(scope),
        "a rebuild acknowledges nothing"
    );
    let mut delivered = 0;
    for _ in 0..500 {
        let a = c.pull(10).await;
        delivered += a.changes;
        if delivered >= 2 && !a.has_more {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(delivered, 2, "the late row and the change");
    let acknowledged = c.checkpoints().await;
    assert_eq!(
        acknowledged[scope].position,
        super::pull::cursor_position(store, &final_cursor).await,
        "the pull that presented the final cursor acknowledged it"
    );
}

/// A scope of 0 rows, and one whose size is a multiple of the limit.
async fn sizes<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let mut c = PullClient::connect(store, node, "sz-u", "sz-c").await;
    let pages = c.rebuild_scope("user:sz-u", 3).await;
    assert_eq!(pages.len(), 1, "an empty scope is one final page");
    let v = json::parse(&pages[0]).unwrap();
    assert_eq!(v.as_object().unwrap()["records"], Value::Array(vec![]));
    notes(world, "sz-u", 300, 6).await;
    let pages = c.rebuild_scope("user:sz-u", 3).await;
    assert_eq!(
        pages.len(),
        2,
        "6 rows at limit 3: the final page has the last 3"
    );
    let last = json::parse(&pages[1]).unwrap();
    let Value::Array(records) = &last.as_object().unwrap()["records"] else {
        panic!()
    };
    assert_eq!(records.len(), 3);
    assert_eq!(c.replica.scopes["user:sz-u"].rows.len(), 6);
    // The recomputed checksum is the scope's terminal checksum on pull.
    let a = c.pull(10).await;
    assert!(
        a.mismatched.is_empty() && !a.rebuild.contains(&"user:sz-u".to_owned()),
        "{a:?}"
    );
}

/// A continuation goes stale after expiry, after a push by the same
/// client, and after its scope's revoke; each is 409 with `scope_id`, and
/// a new attempt works.
async fn stale_sessions<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    world.grant("st-u", "team:st", true).await;
    notes(world, "st-u", 400, 3).await;
    let mut c = PullClient::connect(store, node, "st-u", "st-c").await;
    let scope = "user:st-u";
    let restart = |r: &crate::Reply, scope: &str| {
        assert_eq!(r.status, 409, "{}", String::from_utf8_lossy(&r.body));
        let v = json::parse(&r.body).unwrap();
        let e = v.as_object().unwrap()["error"].as_object().unwrap().clone();
        assert_eq!(e["code"], Value::string("rebuild_restart_required"));
        assert_eq!(e["scope_id"], Value::string(scope));
    };
    // Expiry: exactly 24 hours after creation, on the engine's clock (so
    // called directly, whatever the transport).
    let mut a = c.new_attempt(scope);
    let first = node
        .engine
        .rebuild("st-u", c.rebuild_body(&a, 1), NOW)
        .await;
    assert_eq!(first.status, 200);
    let first = first.body;
    assert!(matches!(
        c.replica.apply_rebuild(&mut a, &first).unwrap(),
        RebuildStep::More(_)
    ));
    let next = c.rebuild_body(&a, 1);
    let just_before = node
        .engine
        .rebuild("st-u", next.clone(), NOW + SESSION_LIFETIME_MICROS - 1)
        .await;
    assert_eq!(just_before.status, 200);
    let at_expiry = node
        .engine
        .rebuild("st-u", next.clone(), NOW + SESSION_LIFETIME_MICROS)
        .await;
    restart(&at_expiry, scope);
    let first_again = node
        .engine
        .rebuild(
            "st-u",
            c.rebuild_body(&Rebuilding::new(scope, &a.rebuild_id), 1),
            NOW + SESSION_LIFETIME_MICROS,
        )
        .await;
    restart(&first_again, scope);
    // Those requests woke the background sweep: the expired stage goes,
    // its session stays and still answers 409.
    let rebuild_id = CanonicalUuid::parse(&a.rebuild_id).unwrap();
    let mut swept = false;
    for _ in 0..500 {
        let mut tx = store.begin().await.unwrap();
        let expired = tx.rebuild_session("st-c", &rebuild_id).await.unwrap();
        let expired = expired.expect("the swept session stays");
        swept = tx
            .staged_rows(&expired.session_id, 0, 10)
            .await
            .unwrap()
            .is_empty();
        drop(tx);
        if swept {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(swept, "the expired stage was swept");
    // Thirty days after its expiry, the swept session is forgotten: the
    // request that finds it answers 409 and wakes the sweep, and after
    // that its rebuild_id starts a new session.
    let forgotten_at = NOW + SESSION_LIFETIME_MICROS + FORGET_AFTER_MICROS;
    let first_of_a = c.rebuild_body(&Rebuilding::new(scope, &a.rebuild_id), 1);
    let r = node
        .engine
        .rebuild("st-u", first_of_a.clone(), forgotten_at)
        .await;
    restart(&r, scope);
    let mut renewed = None;
    for _ in 0..500 {
        let r = node
            .engine
            .rebuild("st-u", first_of_a.clone(), forgotten_at)
            .await;
        if r.status == 200 {
            renewed = Some(r);
            break;
        }
        restart(&r, scope);
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(renewed.is_some(), "a forgotten rebuild_id starts anew");
    // A push by the same client: its accepted-write epoch moved on.
    let (mut a, first) = start(&mut c, node, scope).await;
    c.replica.apply_rebuild(&mut a, &first).unwrap();
    let (status, body) = c.push_note(9101, 490).await;
    assert_eq!(status, 200, "{body:?}");
    // Stale (step 7) before capture_pending (step 9): at once.
    let r = node
        .send(Route::Rebuild, "st-u", c.rebuild_body(&a, 1))
        .await;
    restart(&r, scope);
    // A new attempt waits for capture (retryable, the same request), then
    // works.
    let fresh = c.new_attempt(scope);
    let mut r = node
        .send(Route::Rebuild, "st-u", c.rebuild_body(&fresh, 1))
        .await;
    for _ in 0..500 {
        if r.status != 503 {
            break;
        }
        assert_eq!(code(&r), "capture_pending");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        r = node
            .send(Route::Rebuild, "st-u", c.rebuild_body(&fresh, 1))
            .await;
    }
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    c.rebuild_scope(scope, 2).await;
    // A revoked scope cannot continue, nor start.
    let team = "team:st";
    let shared: Vec<String> = (480..483).map(pull_note).collect();
    let mut writes = Vec::new();
    let rows: Vec<_> = shared
        .iter()
        .map(|n| note_row(n, "st-u", "shared"))
        .collect();
    for (n, row) in shared.iter().zip(&rows) {
        writes.push(Write::Insert("public.notes", row));
        let _ = n;
    }
    let shares: Vec<[(&str, Option<&str>); 2]> = shared
        .iter()
        .map(|n| [("note_id", Some(n.as_str())), ("team_id", Some("st"))])
        .collect();
    for share in &shares {
        writes.push(Write::Insert("public.note_shares", share));
    }
    let lsn = world.write(&writes).await;
    settle(store, lsn).await;
    c.pull(10).await;
    let (mut a, first) = start(&mut c, node, team).await;
    c.replica.apply_rebuild(&mut a, &first).unwrap();
    world.grant("st-u", team, false).await;
    c.pull(10).await; // the removal reconciles
    let r = node
        .send(Route::Rebuild, "st-u", c.rebuild_body(&a, 1))
        .await;
    restart(&r, team);
    let again = c.new_attempt(team);
    let r = node
        .send(Route::Rebuild, "st-u", c.rebuild_body(&again, 1))
        .await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request".into()));
}

/// A scope rule changes under a running rebuild (a restart with a new
/// config): the membership generation of every scope the changed table's
/// rules can produce advances, so their continuations are stale; a scope
/// of another table continues.
async fn changed_rules<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    notes(world, "mr-u", 700, 3).await;
    let templates = [
        [
            ("id", Some("tpl-a")),
            ("name", Some("A")),
            ("body", Some("a")),
        ],
        [
            ("id", Some("tpl-b")),
            ("name", Some("B")),
            ("body", Some("b")),
        ],
    ];
    let writes: Vec<Write<'_>> = templates
        .iter()
        .map(|t| Write::Insert("public.templates", t))
        .collect();
    let lsn = world.write(&writes).await;
    settle(store, lsn).await;
    let mut c = PullClient::connect(store, node, "mr-u", "mr-c").await;
    let (mut notes_attempt, first) = start(&mut c, node, "user:mr-u").await;
    c.replica.apply_rebuild(&mut notes_attempt, &first).unwrap();
    let (mut shared_attempt, first) = start(&mut c, node, "templates_public").await;
    c.replica
        .apply_rebuild(&mut shared_attempt, &first)
        .unwrap();
    // Notes now also belong to one more scope.
    let changed = super::push::push_config_with(|s| {
        s.replace(
            "{ template = \"user:{owner_id}\" },",
            "{ template = \"user:{owner_id}\" },\n  { constant = \"all_notes\" },",
        )
    });
    assert_ne!(changed.tables, push_config().tables, "the rule changed");
    let restarted = node.with(Engine::start(store.clone(), changed).await.unwrap());
    super::capture::rematerialized(store).await;
    let r = restarted
        .send(Route::Rebuild, "mr-u", c.rebuild_body(&notes_attempt, 1))
        .await;
    assert_eq!(r.status, 409, "{}", String::from_utf8_lossy(&r.body));
    let v = json::parse(&r.body).unwrap();
    let e = v.as_object().unwrap()["error"].as_object().unwrap().clone();
    assert_eq!(e["code"], Value::string("rebuild_restart_required"));
    assert_eq!(e["scope_id"], Value::string("user:mr-u"));
    let r = restarted
        .send(Route::Rebuild, "mr-u", c.rebuild_body(&shared_attempt, 1))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert!(matches!(
        c.replica
            .apply_rebuild(&mut shared_attempt, &r.body)
            .unwrap(),
        RebuildStep::Done
    ));
    // A new attempt under the new rule goes through.
    let fresh = c.new_attempt("user:mr-u");
    let r = restarted
        .send(Route::Rebuild, "mr-u", c.rebuild_body(&fresh, 1))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
}

/// A new attempt of `scope` at limit 1: its first page, which must be 200.
async fn start<S: Store>(c: &mut PullClient<S>, node: &Node, scope: &str) -> (Rebuilding, Vec<u8>) {
    let attempt = c.new_attempt(scope);
    let r = node
        .send(Route::Rebuild, &c.user, c.rebuild_body(&attempt, 1))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    (attempt, r.body)
}
