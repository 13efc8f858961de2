//! The pull suite: every request error and its precedence, stale versus
//! forged cursors, delayed acknowledgement, deduplication and the merge,
//! scope movement, capture gates and the terminal checksum rules, on any
//! store. Every page is applied by `invariants::pull::Replica`, which
//! checks it completely as a client must (row checksums, the checksum key
//! set, each terminal scope checksum).
//!
//! Rebuild does not exist yet (issue 12). Where a scope needs one, the
//! client installs [`origin_cursor`]: the final cursor a rebuild at
//! `generation_start` returns. Nothing here moves the retention floor, so
//! a pull from there delivers every row's last effect in the scope, which
//! is what a rebuild followed by pulls would leave.

use std::collections::BTreeMap;
use std::sync::Arc;

use invariants::pull::{Applied, RebuildStep, Rebuilding, Replica};
use protocol::digest::Digest;
use protocol::json::{self, Value};
use protocol::position::StreamPosition;
use protocol::token::{CursorBindings, KeyRing, KeyState, ScopeBindings, TokenKey, TokenKind};
use protocol::token::{client_binding, user_binding};

use super::capture::settle;
use super::push::{PushClient, note_mutation, push_config};
use super::transport::{Node, Route, Serve, Transport};
use super::{CaptureWorld, ConnectBody, Write};
use crate::Engine;
use crate::capture::Lsn;
use crate::reply::Reply;
use crate::store::{Store, StoreTx};
use crate::stream::{Checkpoint, MembershipLineage, load_key_ring};

const NOW: i64 = super::NOW;
const T: &str = "2026-07-18 14:00:01.5+00";

/// A note of `owner` with this title, in the example app's text forms.
pub fn note_row<'a>(
    id: &'a str,
    owner: &'a str,
    title: &'a str,
) -> [(&'a str, Option<&'a str>); 7] {
    [
        ("id", Some(id)),
        ("owner_id", Some(owner)),
        ("title", Some(title)),
        ("body", None),
        ("pinned", Some("f")),
        ("updated_at", Some(T)),
        ("deleted_at", None),
    ]
}

/// Note `n` of the suite (a UUID, as `notes.id` is).
pub fn pull_note(n: u64) -> String {
    format!("00000000-0000-4000-8000-{:012x}", 0x7000 + n)
}

/// The bindings an authentic cursor of this client and scope has now.
pub async fn cursor_bindings<S: Store>(
    store: &S,
    user: &str,
    client_id: &str,
    generation: u64,
    scope: &str,
    position: StreamPosition,
) -> CursorBindings {
    let mut tx = store.begin().await.unwrap();
    let manifest = tx.manifests().await.unwrap().pop().unwrap();
    let stream = tx.stream_state().await.unwrap();
    let rules = tx.membership_rules().await.unwrap();
    drop(tx);
    let scope_id = protocol::ids::ScopeId::parse(scope).unwrap();
    CursorBindings {
        scope: ScopeBindings {
            stream_generation: stream.generation,
            user_binding: user_binding(user),
            client_binding: client_binding(user, client_id),
            client_generation: generation,
            scope_id: scope.to_owned(),
            schema_hash: manifest.hash(),
            membership_generation: MembershipLineage::new(&rules).generation_of(&scope_id),
            retention_generation: stream.retention_generation,
            issued_at: NOW,
        },
        position,
    }
}

/// A cursor under the server's own keys with these bindings.
pub async fn mint_cursor<S: Store>(store: &S, b: &CursorBindings) -> String {
    load_key_ring(store).await.unwrap().issue_cursor(b)
}

/// The final cursor a rebuild of `scope` at `generation_start` returns.
pub async fn origin_cursor<S: Store>(
    store: &S,
    user: &str,
    client_id: &str,
    generation: u64,
    scope: &str,
) -> String {
    let b = cursor_bindings(
        store,
        user,
        client_id,
        generation,
        scope,
        StreamPosition::GenerationStart,
    )
    .await;
    mint_cursor(store, &b).await
}

/// The position a server cursor stands for (for checks of the store).
pub async fn cursor_position<S: Store>(store: &S, token: &str) -> StreamPosition {
    load_key_ring(store)
        .await
        .unwrap()
        .verify_cursor(token)
        .unwrap()
        .position
}

/// The stream generation a server cursor is bound to.
pub async fn cursor_generation<S: Store>(store: &S, token: &str) -> u64 {
    load_key_ring(store)
        .await
        .unwrap()
        .verify_cursor(token)
        .unwrap()
        .scope
        .stream_generation
}

/// A connected client that pulls into a [`Replica`].
pub struct PullClient<S: Store> {
    pub store: S,
    pub node: Node,
    pub user: String,
    pub client_id: String,
    pub generation: u64,
    pub replica: Replica,
    /// Rebuild attempts made, for their `rebuild_id`s.
    pub attempts: u64,
}

impl<S: Store> PullClient<S> {
    /// Connects a fresh client of `user`.
    pub async fn connect(store: &S, node: impl Into<Node>, user: &str, client_id: &str) -> Self {
        let node = node.into();
        let r = node
            .send(
                Route::Connect,
                user,
                json::to_canonical(&ConnectBody::fresh(client_id).to_json()),
            )
            .await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let mut tx = store.begin().await.unwrap();
        let manifest = tx.manifests().await.unwrap().pop().unwrap();
        drop(tx);
        let mut replica = Replica::new(manifest);
        replica.connected(&r.body).unwrap();
        let v = json::parse(&r.body).unwrap();
        PullClient {
            store: store.clone(),
            node,
            user: user.into(),
            client_id: client_id.into(),
            generation: super::int(&v.as_object().unwrap()["client_generation"]),
            replica,
            attempts: 0,
        }
    }

    /// The request body for `limit` from the replica's state.
    pub fn body(&self, limit: u16) -> Vec<u8> {
        self.replica
            .request(&self.client_id, self.generation, limit)
    }

    /// Sends `body` as this client's user: status and parsed body.
    pub async fn send(&self, body: Vec<u8>) -> (u16, Value, Option<u32>) {
        let r = self.send_raw(body).await;
        (r.status, json::parse(&r.body).unwrap(), r.retry_after)
    }

    /// Sends `body` as this client's user: the answer as it came.
    pub async fn send_raw(&self, body: Vec<u8>) -> Reply {
        self.node.send(Route::Pull, &self.user, body).await
    }

    /// One pull, which must answer 200, applied to the replica.
    pub async fn pull(&mut self, limit: u16) -> Applied {
        let r = self.send_raw(self.body(limit)).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let applied = self.replica.apply(&r.body).unwrap();
        assert!(applied.mismatched.is_empty(), "{applied:?}");
        applied
    }

    /// Rebuilds every scope that needs it through `/sync/rebuild`.
    pub async fn rebuild(&mut self) {
        let stale = self.replica.needs_rebuild();
        for scope in stale {
            self.rebuild_scope(&scope, 1000).await;
        }
    }

    /// Rebuilds `scope` in pages of `limit` in a new attempt; every page,
    /// which must answer 200, applied to the replica. The pages' bodies.
    pub async fn rebuild_scope(&mut self, scope: &str, limit: u16) -> Vec<Vec<u8>> {
        let mut attempt = self.new_attempt(scope);
        let mut pages = Vec::new();
        loop {
            let r = self
                .node
                .send(
                    Route::Rebuild,
                    &self.user,
                    self.rebuild_body(&attempt, limit),
                )
                .await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            let step = self.replica.apply_rebuild(&mut attempt, &r.body).unwrap();
            pages.push(r.body);
            match step {
                RebuildStep::More(_) => {}
                RebuildStep::Done => return pages,
                RebuildStep::Mismatch => panic!("a rebuilt scope's checksum did not verify"),
            }
        }
    }

    /// A new rebuild attempt of `scope`, with a new `rebuild_id`.
    pub fn new_attempt(&mut self, scope: &str) -> Rebuilding {
        self.attempts += 1;
        let id = format!("00000000-0000-4000-8000-{:012x}", self.attempts);
        Rebuilding::new(scope, &id)
    }

    /// The rebuild request of `attempt`'s next page.
    pub fn rebuild_body(&self, attempt: &Rebuilding, limit: u16) -> Vec<u8> {
        self.replica
            .rebuild_request(attempt, &self.client_id, self.generation, limit)
    }

    /// Rebuilds what needs it, then pulls to a terminal page; the changes seen.
    pub async fn sync(&mut self, limit: u16) -> usize {
        let mut n = 0;
        for _ in 0..10_000 {
            self.rebuild().await;
            let a = self.pull(limit).await;
            n += a.changes;
            if !a.has_more && a.rebuild.is_empty() {
                return n;
            }
        }
        panic!("no terminal page");
    }

    /// The acknowledged checkpoints of this client.
    pub async fn checkpoints(&self) -> BTreeMap<String, Checkpoint> {
        let mut tx = self.store.begin().await.unwrap();
        let c = tx.checkpoints(&self.client_id).await.unwrap();
        c.into_iter()
            .map(|(s, c)| (s.as_str().to_owned(), c))
            .collect()
    }

    /// The cursor the replica holds for `scope`.
    pub fn cursor(&self, scope: &str) -> String {
        self.replica.scopes[scope].cursor.clone().unwrap()
    }

    /// The request body with `scope`'s cursor replaced by `cursor`.
    pub fn body_with(&self, scope: &str, cursor: Value, limit: u16) -> Vec<u8> {
        let mut v = json::parse(&self.body(limit)).unwrap();
        if let Value::Object(o) = &mut v
            && let Some(Value::Object(scopes)) = o.get_mut("scopes")
        {
            scopes.insert(scope.into(), json::object([("cursor", cursor)]));
        }
        json::to_canonical(&v)
    }
}

fn code(v: &Value) -> &str {
    v.as_object().unwrap()["error"].as_object().unwrap()["code"]
        .as_str()
        .unwrap()
}

/// A request body edited by `f`.
pub(super) fn edit(body: &[u8], f: impl FnOnce(&mut json::Object)) -> Vec<u8> {
    let mut v = json::parse(body).unwrap();
    if let Value::Object(o) = &mut v {
        f(o);
    }
    json::to_canonical(&v)
}

async fn write_settled<W: CaptureWorld>(world: &W, writes: &[Write<'_>]) -> Lsn {
    let lsn = world.write(writes).await;
    settle(world.store(), lsn).await;
    lsn
}

/// The whole pull suite on one world, its clients calling the engine.
pub async fn pull_suite<W: CaptureWorld>(world: &W) {
    pull_suite_via(world, Arc::new(Transport::direct)).await;
}

/// The whole pull suite on one world, its clients reaching each engine it
/// starts through `serve`'s transport.
pub async fn pull_suite_via<W: CaptureWorld>(world: &W, serve: Serve) {
    let store = world.store().clone();
    // Capture's leadership, held so that nothing materializes until
    // `capture_gates` lets go.
    let config = push_config();
    store
        .install_capture(&crate::capture::CapturePlan::new(&config))
        .await
        .unwrap();
    let feed = store.change_feed().await.unwrap().unwrap();
    // The fresh database's baseline is empty: the stream begins at once.
    let feed = super::capture::complete_empty_baseline(&store, feed).await;
    let node = Node::new(
        Engine::start(store.clone(), config).await.unwrap(),
        serve.clone(),
    );
    capture_gates(world, &node, feed).await;
    request_errors(world, &node).await;
    known_by_pull_and_rebuild(world, &node).await;
    stale_and_forged(world, &node).await;
    delayed_acknowledgement(world, &node).await;
    dedup_merge_and_siblings(world, &node).await;
    scope_movement(world, &node).await;
    admission(world, &node).await;
    let mut limited = push_config();
    limited.limits.requests_per_user_per_second = 1;
    limited.limits.request_burst_per_user = 3;
    let fair = Node::new(
        Engine::start(store.clone(), limited).await.unwrap(),
        serve.clone(),
    );
    fair_admission(world, &fair).await;
    let mut gated = push_config();
    gated.limits.requests_per_user_per_second = 1;
    gated.limits.request_burst_per_user = 3;
    gated.limits.flood_requests_per_user_per_second = 1;
    gated.limits.flood_burst_per_user = 4;
    let gate = Node::new(
        Engine::start(store.clone(), gated).await.unwrap(),
        serve.clone(),
    );
    flood_gate(world, &gate).await;
    let mut bounded = push_config();
    bounded.limits.pages_per_user = 2;
    bounded.limits.requests_in_flight_per_user = 2;
    let crowd = Node::new(
        Engine::start(store.clone(), bounded).await.unwrap(),
        serve.clone(),
    );
    requests_in_flight(world, &crowd).await;
    fails_at_commit(world, &node).await;
    // Last: it appends manifests, and then blocks capture.
    let latest = schema_bridge(world, &node).await;
    capture_blocked(world, &latest).await;
}

/// A pull or rebuild presents the client's generation: afterwards a
/// fresh-sentinel connect for that identity is `400
/// invalid_schema_reference` (spec: Connect; ADR 0003 §2). Before it,
/// the identical fresh connect is still the retry of a lost first connect.
async fn known_by_pull_and_rebuild<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let fresh = |id: &str| json::to_canonical(&ConnectBody::fresh(id).to_json());
    let sentinel = |id: &'static str| async move {
        let r = node.send(Route::Connect, "kn-u", fresh(id)).await;
        let v = json::parse(&r.body).unwrap();
        let code = (r.status != 200).then(|| super::push::error_code(&v));
        (r.status, code)
    };
    let mut pulled = PullClient::connect(store, node, "kn-u", "kn-pull").await;
    assert_eq!(
        sentinel("kn-pull").await,
        (200, None),
        "a retry before any use"
    );
    pulled.pull(10).await;
    assert_eq!(
        sentinel("kn-pull").await,
        (400, Some("invalid_schema_reference".to_owned()))
    );
    let mut rebuilt = PullClient::connect(store, node, "kn-u", "kn-rebuild").await;
    rebuilt.rebuild_scope("user:kn-u", 10).await;
    assert_eq!(
        sentinel("kn-rebuild").await,
        (400, Some("invalid_schema_reference".to_owned()))
    );
}

/// While capture is quarantined, a pull answers `503 temporary_unavailable`
/// with reason `capture_blocked`, even with a fence pending.
async fn capture_blocked<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let mut c = PullClient::connect(store, node, "cb-u", "cb-c").await;
    c.sync(10).await;
    let lsn = world.write(&[Write::Truncate("public.templates")]).await;
    let p = settle(store, lsn).await;
    assert!(p.quarantine.is_some(), "a TRUNCATE blocks capture");
    let (s, v, after) = c.send(c.body(10)).await;
    assert_eq!(
        (s, code(&v), after),
        (503, "temporary_unavailable", Some(5))
    );
    assert_eq!(
        v.as_object().unwrap()["error"].as_object().unwrap()["reason"],
        Value::string("capture_blocked")
    );
}

/// Every request error, and the precedence between them.
async fn request_errors<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let mut c = PullClient::connect(store, node, "pe-u", "pe-c").await;
    c.sync(10).await;
    let good = c.body(10);
    let send = |b: Vec<u8>| c.send(b);
    // 3. Structure.
    let (s, v, _) = send(b"{".to_vec()).await;
    assert_eq!((s, code(&v)), (400, "invalid_request"));
    for limit in [0i64, 1001, -1] {
        let b = edit(&good, |o| {
            o.insert("limit".into(), Value::int(limit));
        });
        let (s, v, _) = send(b).await;
        assert_eq!((s, code(&v)), (400, "invalid_request"), "limit {limit}");
    }
    for member in ["limit", "scopes", "schema", "scope_set_version"] {
        let b = edit(&good, |o| {
            o.remove(member);
        });
        let (s, v, _) = send(b).await;
        assert_eq!((s, code(&v)), (400, "invalid_request"), "without {member}");
    }
    let b = edit(&good, |o| {
        o.insert("extra".into(), Value::Bool(true));
    });
    assert_eq!(send(b).await.0, 400);
    // 1. Binding: an unknown client, or another user's, before structure.
    let (s, v, _) = c
        .node
        .send(Route::Pull, "someone-else", good.clone())
        .await
        .into_parts();
    assert_eq!((s, code(&v)), (401, "auth_required"));
    let b = edit(&good, |o| {
        o.insert("client_id".into(), Value::string("never-connected"));
        o.insert("limit".into(), Value::int(0));
    });
    let (s, v, _) = send(b).await;
    assert_eq!(
        (s, code(&v)),
        (401, "auth_required"),
        "binding precedes structure"
    );
    // 6. Generation before schema; schema before cursors and scope rules.
    let wrong_schema = json::object([
        ("version", Value::int(1)),
        ("hash", Value::string("0".repeat(64))),
    ]);
    let b = edit(&good, |o| {
        o.insert("client_generation".into(), Value::int(7));
        o.insert("schema".into(), wrong_schema.clone());
    });
    let (s, v, _) = send(b).await;
    assert_eq!((s, code(&v)), (409, "client_generation_expired"));
    assert_eq!(
        v.as_object().unwrap()["error"].as_object().unwrap()["current_client_generation"],
        Value::int(1)
    );
    let forged = c.body_with("templates_public", Value::string("ic1.AAAA.BBBB"), 10);
    let b = edit(&forged, |o| {
        o.insert("schema".into(), wrong_schema.clone());
    });
    let (s, v, _) = send(b).await;
    assert_eq!(
        (s, code(&v)),
        (422, "schema_mismatch"),
        "schema precedes cursors"
    );
    // Request rules that need state: a future scope-set version, a scope never assigned.
    let b = edit(&good, |o| {
        o.insert("scope_set_version".into(), Value::int(99));
    });
    let (s, v, _) = send(b).await;
    assert_eq!((s, code(&v)), (400, "invalid_request"));
    let b = c.body_with("invented", Value::Null, 10);
    let (s, v, _) = send(b).await;
    assert_eq!((s, code(&v)), (400, "invalid_request"));
    // 7. A forged cursor fails the whole request.
    let (s, v, _) = send(forged).await;
    assert_eq!((s, code(&v)), (400, "invalid_request"));
    // 4. Retirement precedes the generation gate.
    world.retire("pe-c").await;
    let b = edit(&good, |o| {
        o.insert("client_generation".into(), Value::int(7));
    });
    let (s, v, _) = send(b).await;
    assert_eq!((s, code(&v)), (409, "client_retired"));
}

/// An authentic cursor whose lineage is obsolete sends its scope to
/// rebuild; one that is forged or bound to anything else fails the request.
async fn stale_and_forged<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let mut c = PullClient::connect(store, node, "sf-u", "sf-c").await;
    c.sync(10).await;
    let scope = "user:sf-u";
    let at = cursor_position(store, &c.cursor(scope)).await;
    let now = cursor_bindings(store, "sf-u", "sf-c", c.generation, scope, at).await;
    let acked = c.checkpoints().await.get(scope).copied();
    // Stale: each lineage the cursor binds.
    type Edit = fn(&mut CursorBindings);
    let stale: [(&str, Edit); 4] = [
        ("stream", |b| b.scope.stream_generation -= 1),
        ("schema", |b| b.scope.schema_hash.0[0] ^= 1),
        ("membership", |b| b.scope.membership_generation += 1),
        ("retention", |b| b.scope.retention_generation -= 1),
    ];
    for (what, f) in stale {
        let mut b = now.clone();
        f(&mut b);
        let token = mint_cursor(store, &b).await;
        let (s, v, _) = c.send(c.body_with(scope, Value::string(token), 10)).await;
        assert_eq!(s, 200, "{what}: {v:?}");
        let o = v.as_object().unwrap();
        assert_eq!(
            o["rebuild"],
            Value::Array(vec![Value::string(scope)]),
            "{what}"
        );
        assert!(
            !o["scope_cursors"].as_object().unwrap().contains_key(scope),
            "{what}: a stale scope gets no cursor"
        );
        assert_eq!(
            c.checkpoints().await.get(scope),
            acked.as_ref(),
            "{what}: not acknowledged"
        );
    }
    // A cursor past what is materialized (a restored database) is stale too.
    let mut past = now.clone();
    past.position = StreamPosition::TransactionEnd {
        commit_lsn: u64::MAX >> 2,
    };
    let token = mint_cursor(store, &past).await;
    let (s, v, _) = c.send(c.body_with(scope, Value::string(token), 10)).await;
    assert_eq!(s, 200);
    assert_eq!(
        v.as_object().unwrap()["rebuild"],
        Value::Array(vec![Value::string(scope)])
    );
    // Client generation: a renewed generation makes the old cursors stale.
    let old_cursor = c.cursor(scope);
    let mut body = ConnectBody::fresh("sf-c");
    body.generation = Some(c.generation + 5); // a stale generation: renewed
    body.schema = c.replica_schema();
    body.scope_set_version = c.replica.scope_set_version;
    body.known = c
        .replica
        .scopes
        .iter()
        .map(|(s, l)| (s.clone(), l.cursor.clone()))
        .collect();
    let r = node
        .send(Route::Connect, "sf-u", json::to_canonical(&body.to_json()))
        .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let g = super::int(&json::parse(&r.body).unwrap().as_object().unwrap()["client_generation"]);
    assert_eq!(g, c.generation + 1);
    c.generation = g;
    let (s, v, _) = c
        .send(c.body_with(scope, Value::string(old_cursor), 10))
        .await;
    assert_eq!(s, 200);
    assert_eq!(
        v.as_object().unwrap()["rebuild"],
        Value::Array(vec![
            Value::string("templates_public"),
            Value::string(scope)
        ]),
        "every cursor of an older client generation is stale"
    );
    let now = cursor_bindings(store, "sf-u", "sf-c", c.generation, scope, at).await;
    // Forged or misbound: user, client, scope, kind, key, bytes.
    let mut misbound: Vec<(&str, String)> = Vec::new();
    let mut b = now.clone();
    b.scope.user_binding = user_binding("other");
    misbound.push(("user", mint_cursor(store, &b).await));
    let mut b = now.clone();
    b.scope.client_binding = client_binding("sf-u", "other");
    misbound.push(("client", mint_cursor(store, &b).await));
    let mut b = now.clone();
    b.scope.scope_id = "templates_public".into();
    misbound.push(("scope", mint_cursor(store, &b).await));
    let mut b = now.clone();
    b.scope.client_generation += 1;
    misbound.push(("a generation never issued", mint_cursor(store, &b).await));
    let foreign = KeyRing::new(vec![
        TokenKey {
            key_id: "ic-1".into(),
            kind: TokenKind::IncrementalCursor,
            state: KeyState::Active,
            secret: [7; 32],
        },
        TokenKey {
            key_id: "rc-1".into(),
            kind: TokenKind::RebuildContinuation,
            state: KeyState::Active,
            secret: [8; 32],
        },
    ])
    .unwrap();
    misbound.push(("key", foreign.issue_cursor(&now)));
    let good = mint_cursor(store, &now).await;
    misbound.push(("kind", good.replacen("ic1.", "rc1.", 1)));
    let mut bytes = good.clone().into_bytes();
    let last = bytes.len() - 1;
    bytes[last] = if bytes[last] == b'A' { b'B' } else { b'A' };
    misbound.push(("mac", String::from_utf8(bytes).unwrap()));
    for (what, token) in misbound {
        let (s, v, _) = c.send(c.body_with(scope, Value::string(token), 10)).await;
        assert_eq!((s, code(&v)), (400, "invalid_request"), "{what}");
    }
    // The authentic current cursor still works.
    let (s, _, _) = c.send(c.body_with(scope, Value::string(good), 10)).await;
    assert_eq!(s, 200);
}

impl<S: Store> PullClient<S> {
    /// The schema reference the client presents.
    pub fn replica_schema(&self) -> Value {
        let b = json::parse(&self.body(1)).unwrap();
        b.as_object().unwrap()["schema"].clone()
    }

    /// This client pushes batch `batch` inserting note `note` (through the
    /// node's engine); the status and outcome body.
    pub async fn push_note(&self, batch: u64, note: u64) -> (u16, Value) {
        let pusher = PushClient {
            engine: self.node.engine.clone(),
            user: self.user.clone(),
            client_id: self.client_id.clone(),
            generation: self.generation,
            schema: self.replica_schema(),
        };
        let m = note_mutation(
            1,
            &pull_note(note),
            &pusher.schema,
            "insert",
            None,
            Some(super::push::note_columns("pushed")),
        );
        let (status, body, _) = pusher.push(&pusher.batch(batch, vec![m], false)).await;
        (status, body)
    }
}

trait IntoParts {
    fn into_parts(self) -> (u16, Value, Option<u32>);
}

impl IntoParts for crate::Reply {
    fn into_parts(self) -> (u16, Value, Option<u32>) {
        (
            self.status,
            json::parse(&self.body).unwrap(),
            self.retry_after,
        )
    }
}

/// A lost response is safe: the old cursor replays the same changes, the
/// checkpoint moves only when a later pull presents the new cursor, and an
/// older cursor never moves it back.
async fn delayed_acknowledgement<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let mut c = PullClient::connect(store, node, "da-u", "da-c").await;
    c.sync(10).await;
    let scope = "user:da-u";
    let c0 = c.cursor(scope);
    let (n1, n2) = (pull_note(1), pull_note(2));
    write_settled(
        world,
        &[
            Write::Insert("public.notes", &note_row(&n1, "da-u", "one")),
            Write::Insert("public.notes", &note_row(&n2, "da-u", "two")),
        ],
    )
    .await;
    let first = c.send_raw(c.body(10)).await;
    assert_eq!(first.status, 200);
    // The response is lost: the client pulls again with c0.
    let again = c.send_raw(c.body(10)).await;
    assert_eq!(again.status, 200);
    let changes = |b: &[u8]| json::parse(b).unwrap().as_object().unwrap()["changes"].clone();
    assert_eq!(
        changes(&first.body),
        changes(&again.body),
        "the same changes again"
    );
    c.replica.apply(&again.body).unwrap();
    let p0 = cursor_position(store, &c0).await;
    assert_eq!(c.checkpoints().await[scope].position, p0, "c0 acknowledged");
    let c1 = c.cursor(scope);
    let p1 = cursor_position(store, &c1).await;
    assert!(p1 > p0);
    c.pull(10).await; // presents c1
    assert_eq!(c.checkpoints().await[scope].position, p1, "c1 acknowledged");
    // An older valid cursor replays, and the checkpoint stays.
    let (s, v, _) = c.send(c.body_with(scope, Value::string(c0), 10)).await;
    assert_eq!(s, 200);
    assert_eq!(v.as_object().unwrap()["changes"], changes(&first.body));
    assert_eq!(c.checkpoints().await[scope].position, p1, "never backward");
}

/// Dedup before the limit, effects of one event split across pages, and
/// a busy scope that cannot hide another's older change.
async fn dedup_merge_and_siblings<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    world.grant("dm-u", "team:dm", true).await;
    let mut c = PullClient::connect(store, node, "dm-u", "dm-c").await;
    c.sync(10).await;
    let (n3, n4) = (pull_note(3), pull_note(4));
    // One row changed three times: one change, its last state.
    write_settled(
        world,
        &[Write::Insert("public.notes", &note_row(&n3, "dm-u", "a"))],
    )
    .await;
    for t in ["b", "c"] {
        write_settled(
            world,
            &[Write::Update(
                "public.notes",
                &[("id", &n3)],
                &[("title", Some(t))],
            )],
        )
        .await;
    }
    let a = c.pull(10).await;
    assert_eq!(a.changes, 1, "deduplicated per (scope, table, key)");
    assert!(!a.has_more);
    // One source event with effects in two scopes (shared with the team),
    // pulled at limit 1: split across pages, nothing lost.
    write_settled(
        world,
        &[
            Write::Insert("public.notes", &note_row(&n4, "dm-u", "shared")),
            Write::Insert(
                "public.note_shares",
                &[("note_id", Some(&n4)), ("team_id", Some("dm"))],
            ),
        ],
    )
    .await;
    let a = c.pull(1).await;
    assert_eq!((a.changes, a.has_more), (1, true));
    let b = c.pull(1).await;
    assert_eq!(
        (b.changes, b.has_more),
        (1, false),
        "terminal, and every checksum verified"
    );
    for s in ["user:dm-u", "team:dm"] {
        assert!(
            c.replica.scopes[s].rows.len() == if s == "team:dm" { 1 } else { 2 },
            "{s}"
        );
    }
    // Starvation-freedom: the team's older change comes before the user's
    // five later ones, at limit 2.
    let n5 = pull_note(5);
    write_settled(
        world,
        &[Write::Update(
            "public.notes",
            &[("id", &n4)],
            &[("title", Some("old"))],
        )],
    )
    .await;
    for i in 0..5 {
        let title = format!("busy {i}");
        write_settled(
            world,
            &[Write::Insert(
                "public.notes",
                &note_row(&pull_note(10 + i), "dm-u", &title),
            )],
        )
        .await;
    }
    let r = c.send_raw(c.body(2)).await;
    let v = json::parse(&r.body).unwrap();
    let first: Vec<&str> = match &v.as_object().unwrap()["changes"] {
        Value::Array(a) => a
            .iter()
            .map(|c| c.as_object().unwrap()["scope"].as_str().unwrap())
            .collect(),
        _ => panic!(),
    };
    assert_eq!(first, ["team:dm", "user:dm-u"], "the least positions first");
    c.replica.apply(&r.body).unwrap();
    c.sync(2).await;
    let _ = n5;
}

/// A row entering, leaving and living in several scopes, and a scope
/// granted then revoked between pulls.
async fn scope_movement<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let mut c = PullClient::connect(store, node, "sm-u", "sm-c").await;
    c.sync(10).await;
    let v0 = c.replica.scope_set_version;
    world.grant("sm-u", "team:sm", true).await;
    let a = c.pull(10).await;
    assert_eq!(a.rebuild, ["team:sm"], "a new scope rebuilds");
    assert_eq!(c.replica.scope_set_version, v0 + 1);
    c.sync(10).await;
    // Unchanged set: the version stays.
    c.pull(10).await;
    assert_eq!(c.replica.scope_set_version, v0 + 1);
    let n = pull_note(20);
    write_settled(
        world,
        &[Write::Insert("public.notes", &note_row(&n, "sm-u", "x"))],
    )
    .await;
    // Enters the team scope; lives in both.
    write_settled(
        world,
        &[Write::Insert(
            "public.note_shares",
            &[("note_id", Some(&n)), ("team_id", Some("sm"))],
        )],
    )
    .await;
    c.sync(10).await;
    assert_eq!(c.replica.scopes["team:sm"].rows.len(), 1);
    assert_eq!(c.replica.scopes["user:sm-u"].rows.len(), 1);
    // Leaves the team scope; stays in the user's.
    write_settled(
        world,
        &[Write::Delete(
            "public.note_shares",
            &[("note_id", &n), ("team_id", "sm")],
        )],
    )
    .await;
    c.sync(10).await;
    assert!(c.replica.scopes["team:sm"].rows.is_empty());
    assert_eq!(c.replica.scopes["user:sm-u"].rows.len(), 1);
    // Revoked: removed, with no change or cursor for it.
    world.grant("sm-u", "team:sm", false).await;
    let before = c.body(10);
    let (s, v, _) = c.send(before.clone()).await;
    assert_eq!(s, 200);
    let o = v.as_object().unwrap();
    assert_eq!(
        o["scope_updates"].as_object().unwrap()["remove"],
        Value::Array(vec![Value::string("team:sm")])
    );
    assert!(
        !o["scope_cursors"]
            .as_object()
            .unwrap()
            .contains_key("team:sm")
    );
    assert!(!o["checksums"].as_object().unwrap().contains_key("team:sm"));
    // A removed scope may still be presented (it was assigned): removal again.
    let (s, _, _) = c.send(before).await;
    assert_eq!(s, 200);
    c.pull(10).await;
    assert!(!c.replica.scopes.contains_key("team:sm"));
    assert_eq!(c.replica.scope_set_version, v0 + 2);
}

/// `capture_pending` while this client's push awaits capture, and its
/// clearing; a failed pull writes no assignment or checkpoint.
async fn capture_gates<W: CaptureWorld>(world: &W, node: &Node, feed: <W::S as Store>::Feed) {
    let store = world.store();
    let mut c = PullClient::connect(store, node, "cg-u", "cg-c").await;
    c.sync(10).await;
    let (s, r) = c.push_note(9001, 30).await;
    assert_eq!(s, 200, "{r:?}");
    assert!(super::push::outcome(&r, 1).0, "{r:?}");
    world.grant("cg-u", "team:cg", true).await;
    let before = c.checkpoints().await;
    let (s, v, after) = c.send(c.body(10)).await;
    assert_eq!((s, code(&v), after), (503, "capture_pending", Some(5)));
    let mut tx = store.begin().await.unwrap();
    let pending = tx.pending_fences("cg-c", 8).await.unwrap();
    assert_eq!(pending.len(), 1, "the push's one fence");
    assert!(
        tx.pending_fences("cg-u", 8).await.unwrap().is_empty(),
        "by client"
    );
    // The request frame reads what the single reads read, in one step.
    for named in [Some("cg-c"), Some("cg-u"), None] {
        let frame = tx.request_frame(named, 8).await.unwrap();
        assert_eq!(frame.progress, tx.capture_progress().await.unwrap());
        assert_eq!(frame.stream, tx.stream_state().await.unwrap());
        let Some(id) = named else {
            assert_eq!(frame.client, None);
            assert!(frame.pending_fences.is_empty() && frame.checkpoints.is_empty());
            continue;
        };
        assert_eq!(frame.client, tx.lock_client(id).await.unwrap());
        assert_eq!(
            frame.pending_fences,
            tx.pending_fences(id, 8).await.unwrap()
        );
        assert_eq!(frame.checkpoints, tx.checkpoints(id).await.unwrap());
    }
    let frame = tx.request_frame(Some("cg-c"), 8).await.unwrap();
    assert!(frame.client.is_some() && !frame.checkpoints.is_empty());
    assert_eq!(frame.pending_fences.len(), 1, "the push's one fence");
    assert!(
        tx.request_frame(Some("cg-c"), 0)
            .await
            .unwrap()
            .pending_fences
            .is_empty()
    );
    drop(tx);
    assert_eq!(c.checkpoints().await, before, "no checkpoint moved");
    let mut tx = store.begin().await.unwrap();
    let record = tx.lock_client("cg-c").await.unwrap().unwrap();
    drop(tx);
    assert_eq!(
        record.scope_set_version, c.replica.scope_set_version,
        "no assignment written"
    );
    // Capture resumes: the pull sees the pushed row.
    drop(feed);
    let mut ok = false;
    for _ in 0..500 {
        let (s, _, _) = c.send(c.body(10)).await;
        if s == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(ok, "capture_pending cleared");
    c.sync(10).await;
    assert_eq!(c.replica.scopes["user:cg-u"].rows.len(), 1);
    world.grant("cg-u", "team:cg", false).await;
}

/// The push config with `capture_wait_ms`, its capture installed, and the
/// feed (capture's leadership) held by the test, past an empty baseline.
async fn capture_held<S: Store>(
    store: &S,
    capture_wait_ms: u64,
) -> (crate::config::SyncConfig, S::Feed) {
    let mut config = push_config();
    config.server.capture_wait_ms = capture_wait_ms;
    store
        .install_capture(&crate::capture::CapturePlan::new(&config))
        .await
        .unwrap();
    let feed = store.change_feed().await.unwrap().unwrap();
    (
        config,
        super::capture::complete_empty_baseline(store, feed).await,
    )
}

/// A pull right after its client's push waits for capture instead of
/// answering `503 capture_pending` (issue 28), and holds no connection
/// while it waits: `requests` may be a store of one pooled connection,
/// which another client's connect and sync use meanwhile. `store` holds
/// capture's leadership (its own connections) until the other client is
/// done; then the waiting pull answers 200 with the pushed row.
pub async fn a_pull_waits_for_its_own_writes<S: Store>(store: &S, requests: &S) {
    // Long enough that only a broken wait could answer 503 here.
    let (config, feed) = capture_held(store, 10_000).await;
    let engine = Engine::start(requests.clone(), config).await.unwrap();
    let mut a = PullClient::connect(requests, &engine, "vw-a", "vw-a-c").await;
    a.sync(10).await;
    let (s, r) = a.push_note(9101, 9101).await;
    assert_eq!(s, 200, "{r:?}");
    assert!(super::push::outcome(&r, 1).0, "{r:?}");
    let waiting = a.send(a.body(10));
    let meanwhile = async {
        let mut b = PullClient::connect(requests, &engine, "vw-b", "vw-b-c").await;
        b.sync(10).await;
        drop(feed); // capture resumes
    };
    let ((status, page, _), ()) = tokio::join!(waiting, meanwhile);
    assert_eq!(status, 200, "{page:?}");
    let Value::Array(changes) = &page.as_object().unwrap()["changes"] else {
        panic!("{page:?}")
    };
    assert_eq!(changes.len(), 1, "the pushed row: {page:?}");
}

/// A process that does not lead capture hears what the leader's capture
/// satisfied (ADR 0028). Its pull right after its client's push waits for
/// the push's fence, and answers 200 with the pushed row once another
/// process's capture materializes it: long before its own bound, which
/// only a report can cut short.
pub async fn a_standby_hears_the_leaders_fence_reports<S: Store>(store: &S) {
    use std::time::Duration;
    let (config, feed) = capture_held(store, 600_000).await;
    // The standby tries to lead once, finds the test leading, and does not
    // try again within the test.
    let mut standby_config = config.clone();
    standby_config.capture.retry_ms = 3_600_000;
    let standby = Engine::start(store.clone(), standby_config).await.unwrap();
    for _ in 0..500 {
        if standby.capture_status() == crate::materializer::CaptureStatus::Standby {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        standby.capture_status(),
        crate::materializer::CaptureStatus::Standby
    );
    let mut a = PullClient::connect(store, &standby, "sb-a", "sb-a-c").await;
    a.sync(10).await;
    let (s, r) = a.push_note(9201, 9201).await;
    assert_eq!(s, 200, "{r:?}");
    assert!(super::push::outcome(&r, 1).0, "{r:?}");
    let waiting = tokio::time::timeout(Duration::from_secs(15), a.send(a.body(10)));
    let leading = async {
        // Let the pull find its fence pending and begin to wait.
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(feed);
        Engine::start(store.clone(), config.clone()).await.unwrap()
    };
    let (answer, leader) = tokio::join!(waiting, leading);
    let (status, page, _) =
        answer.expect("the standby's pull was woken by the leader's report, not its own bound");
    assert_eq!(status, 200, "{page:?}");
    let Value::Array(changes) = &page.as_object().unwrap()["changes"] else {
        panic!("{page:?}")
    };
    assert_eq!(changes.len(), 1, "the pushed row: {page:?}");
    assert!(
        matches!(
            leader.capture_status(),
            crate::materializer::CaptureStatus::Running { .. }
        ),
        "the other process leads"
    );
}

/// Past the page permits, a valid pull answers 429 with Retry-After; an
/// invalid one still gets its own error first.
/// A pull that fails after its writes, at commit, commits nothing: no
/// acknowledgement and no assignment change; its retries (four attempts)
/// answer 503, and the next pull does both.
async fn fails_at_commit<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let mut c = PullClient::connect(store, node, "fm-u", "fm-c").await;
    c.sync(10).await;
    write_settled(
        world,
        &[Write::Insert(
            "public.notes",
            &note_row(&pull_note(50), "fm-u", "t"),
        )],
    )
    .await;
    assert_eq!(c.pull(10).await.changes, 1, "one pull delivers it");
    world.grant("fm-u", "team:fm", true).await;
    let acknowledged = c.checkpoints().await;
    let version = || async {
        let mut tx = store.begin().await.unwrap();
        tx.lock_client("fm-c")
            .await
            .unwrap()
            .unwrap()
            .scope_set_version
    };
    let before = version().await;
    world.fail_checkpoint_commits(4).await;
    let (s, v, retry_after) = c.send(c.body(10)).await;
    assert_eq!(s, 503, "{v:?}");
    assert_eq!(
        v.as_object().unwrap()["error"].as_object().unwrap()["code"],
        Value::string("temporary_unavailable")
    );
    assert_eq!(retry_after, Some(5));
    assert_eq!(c.checkpoints().await, acknowledged, "nothing acknowledged");
    assert_eq!(version().await, before, "no assignment written");
    // The same request again: acknowledged, and the scope added.
    let a = c.pull(10).await;
    assert_eq!(a.rebuild, ["team:fm"]);
    assert_eq!(version().await, before + 1);
    assert_ne!(
        c.checkpoints().await,
        acknowledged,
        "the cursor acknowledged"
    );
}

async fn admission<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let mut c = PullClient::connect(store, node, "ad-u", "ad-c").await;
    c.sync(10).await;
    let held = node.engine.occupy_pull_pages().await;
    let (s, v, after) = c.send(c.body(10)).await;
    assert_eq!((s, code(&v), after), (429, "retry_later", Some(5)));
    let b = edit(&c.body(10), |o| {
        o.insert("limit".into(), Value::int(0));
    });
    assert_eq!(c.send(b).await.0, 400, "validation precedes admission");
    drop(held);
    assert_eq!(c.send(c.body(10)).await.0, 200);
}

/// Admission is fair per user: a user past its request rate (a burst of
/// 3, then 1 a second here) gets 429 on every one of its client IDs, while
/// another user's pull at the same moment gets 200.
async fn fair_admission<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let flood = PullClient::connect(store, node, "fa-flood", "fa-f1").await;
    let other = PullClient::connect(store, node, "fa-flood", "fa-f2").await;
    let calm = PullClient::connect(store, node, "fa-calm", "fa-c1").await;
    let mut passed = 0;
    loop {
        let (s, v, after) = flood.send(flood.body(10)).await;
        if s == 429 {
            assert_eq!((code(&v), after), ("retry_later", Some(5)));
            break;
        }
        assert_eq!(s, 200, "{v:?}");
        passed += 1;
        assert!(passed < 20, "the flood was never refused");
    }
    assert!(passed >= 3, "the burst goes through");
    let (s, v, _) = other.send(other.body(10)).await;
    assert_eq!(
        (s, code(&v)),
        (429, "retry_later"),
        "the share is the user's"
    );
    let (s, v, _) = calm.send(calm.body(10)).await;
    assert_eq!(s, 200, "another user is not refused: {v:?}");
}

/// The flood gate (ADR 0018): past a user's burst of requests of any
/// endpoint, 429 before the request is read (a malformed body gets 429,
/// not 400), on every endpoint; another user is not refused.
async fn flood_gate<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let flood = PullClient::connect(store, node, "fg-flood", "fg-f1").await;
    let calm = PullClient::connect(store, node, "fg-calm", "fg-c1").await;
    let mut malformed = 0;
    loop {
        let (s, v, after) = flood.send(b"{".to_vec()).await;
        if s == 429 {
            assert_eq!((code(&v), after), ("retry_later", Some(5)));
            break;
        }
        assert_eq!((s, code(&v)), (400, "invalid_request"));
        malformed += 1;
        assert!(malformed < 20, "the flood was never refused");
    }
    assert!(malformed >= 2, "the burst (less the connect) is read");
    for route in [Route::Push, Route::Rebuild, Route::Connect] {
        let r = node.send(route, "fg-flood", b"{".to_vec()).await;
        assert_eq!(r.status, 429, "{route:?} is gated too");
    }
    let (s, v, _) = calm.send(b"{".to_vec()).await;
    assert_eq!(
        (s, code(&v)),
        (400, "invalid_request"),
        "another user is read"
    );
}

/// The flood gate bounds a user's requests in the server at once (2
/// here): while two of its pulls are in (waiting for a page permit), its
/// connect, which takes no page, gets 429 before it is read; another
/// user's connect is answered; once the pulls are, the user is read again.
async fn requests_in_flight<W: CaptureWorld>(world: &W, node: &Node) {
    let store = world.store();
    let a1 = PullClient::connect(store, node, "if-a", "if-a1").await;
    let a2 = PullClient::connect(store, node, "if-a", "if-a2").await;
    let fresh = |id: &str| json::to_canonical(&ConnectBody::fresh(id).to_json());
    let held = node.engine.occupy_pull_pages().await;
    // join! polls in order: both pulls pass the gate before the connects.
    let (p1, p2, third, other) = tokio::join!(
        a1.send(a1.body(10)),
        a2.send(a2.body(10)),
        node.send(Route::Connect, "if-a", fresh("if-a3")),
        node.send(Route::Connect, "if-b", fresh("if-b1")),
    );
    assert_eq!((p1.0, p2.0), (429, 429), "no page permit was free");
    assert_eq!(third.status, 429, "two requests of the user were in");
    let v = json::parse(&third.body).unwrap();
    assert_eq!((code(&v), third.retry_after), ("retry_later", Some(5)));
    assert_eq!(other.status, 200, "another user is read");
    drop(held);
    let again = node.send(Route::Connect, "if-a", fresh("if-a3")).await;
    assert_eq!(again.status, 200, "the user's requests were answered");
}

/// The store-conformance suite for what pull reads and writes, on a fresh store.
pub async fn pull_store_suite<S: Store>(store: &S) {
    use protocol::digest::{Digest, RowIdentity};
    use protocol::ids::{ScopeId, ServerVersion};
    use protocol::position::Boundary;
    use protocol::value::TypedValue;

    use crate::capture::{CapturedRow, Effect, EffectOp, Materialization, Projection};
    use crate::store::StoreError;
    use crate::stream::{MembershipRules, StreamState};

    // The stream's lineage starts at generation 1, with nothing compacted.
    let mut tx = store.begin().await.unwrap();
    assert_eq!(tx.stream_state().await.unwrap(), StreamState::default());
    // Membership rules: appended, read back, never stored twice.
    assert!(tx.membership_rules().await.unwrap().is_empty());
    let rules = |table: &str, generation| MembershipRules {
        table_id: table.into(),
        generation,
        fingerprint: format!("[{table}]"),
        templates: vec![format!("{table}:{{id}}"), "shared".into()],
    };
    tx.insert_membership_rules(&[rules("a", 1), rules("b", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    tx.insert_membership_rules(&[rules("a", 2)]).await.unwrap();
    let mut got = tx.membership_rules().await.unwrap();
    got.sort_by(|x, y| (&x.table_id, x.generation).cmp(&(&y.table_id, y.generation)));
    assert_eq!(got, [rules("a", 1), rules("a", 2), rules("b", 1)]);
    assert!(matches!(
        tx.insert_membership_rules(&[rules("b", 1)]).await,
        Err(StoreError::Integrity(_))
    ));
    drop(tx);
    // Token keys: the first keys stored stay; a later set changes nothing.
    let key = |id: &str, kind, secret| TokenKey {
        key_id: id.into(),
        kind,
        state: KeyState::Active,
        secret: [secret; 32],
    };
    let first = [
        key("ic-1", TokenKind::IncrementalCursor, 1),
        key("rc-1", TokenKind::RebuildContinuation, 2),
    ];
    let shape = |keys: &[TokenKey]| {
        let mut v: Vec<_> = keys
            .iter()
            .map(|k| (k.key_id.clone(), k.kind, k.state, k.secret))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let mut tx = store.begin().await.unwrap();
    assert!(tx.token_keys().await.unwrap().is_empty());
    tx.insert_token_keys(&first).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    tx.insert_token_keys(&[
        key("ic-1", TokenKind::IncrementalCursor, 9),
        key("other", TokenKind::IncrementalCursor, 9),
    ])
    .await
    .unwrap();
    assert_eq!(shape(&tx.token_keys().await.unwrap()), shape(&first));
    tx.commit().await.unwrap();
    // Rotation: the active keys become verify-only and the new ones are
    // active, in one transaction; a verify-only key can be dropped, an
    // active one never; a reused key ID is refused.
    let mut tx = store.begin().await.unwrap();
    let fresh = [
        key("ic-2", TokenKind::IncrementalCursor, 3),
        key("rc-2", TokenKind::RebuildContinuation, 4),
    ];
    tx.rotate_token_keys(&fresh).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    let verify_only = |k: &TokenKey| TokenKey {
        state: KeyState::VerifyOnly,
        ..k.clone()
    };
    let rotated: Vec<TokenKey> = (first.iter().map(verify_only))
        .chain(fresh.iter().cloned())
        .collect();
    assert_eq!(shape(&tx.token_keys().await.unwrap()), shape(&rotated));
    assert!(KeyRing::new(tx.token_keys().await.unwrap()).is_ok());
    assert!(
        !tx.drop_token_key("ic-2").await.unwrap(),
        "an active key stays"
    );
    assert!(!tx.drop_token_key("nowhere").await.unwrap());
    assert!(tx.drop_token_key("ic-1").await.unwrap());
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        shape(&tx.token_keys().await.unwrap()),
        shape(&rotated[1..]),
        "ic-1 dropped"
    );
    assert!(matches!(
        tx.rotate_token_keys(&[
            key("rc-2", TokenKind::IncrementalCursor, 5),
            key("rc-3", TokenKind::RebuildContinuation, 6),
        ])
        .await,
        Err(StoreError::Integrity(_))
    ));
    drop(tx);
    // Checkpoints: per client and scope, replaced by a later put.
    let s1 = ScopeId::parse("s1").unwrap();
    let s2 = ScopeId::parse("s2").unwrap();
    let at = |lsn, event, effect| StreamPosition::Effect {
        commit_lsn: lsn,
        event_ordinal: event,
        effect_ordinal: effect,
    };
    let cp = |position| Checkpoint {
        stream_generation: 1,
        position,
    };
    let mut tx = store.begin().await.unwrap();
    assert!(tx.checkpoints("c1").await.unwrap().is_empty());
    tx.put_checkpoints(
        "c1",
        &[
            (s1.clone(), cp(StreamPosition::GenerationStart)),
            (s2.clone(), cp(at(5, 1, 2))),
        ],
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    tx.put_checkpoints(
        "c1",
        &[(
            s1.clone(),
            cp(StreamPosition::TransactionEnd { commit_lsn: 9 }),
        )],
    )
    .await
    .unwrap();
    let got = tx.checkpoints("c1").await.unwrap();
    assert_eq!(
        got,
        [
            (
                s1.clone(),
                cp(StreamPosition::TransactionEnd { commit_lsn: 9 })
            ),
            (s2.clone(), cp(at(5, 1, 2))),
        ]
        .into_iter()
        .collect()
    );
    assert!(tx.checkpoints("c2").await.unwrap().is_empty());
    assert!(tx.pending_fences("c1", 8).await.unwrap().is_empty());
    drop(tx);
    // A lazy commit (ADR 0026) is a commit: its writes are seen at once.
    let mut tx = store.begin().await.unwrap();
    tx.put_checkpoints("c1", &[(s2.clone(), cp(at(7, 0, 1)))])
        .await
        .unwrap();
    tx.commit_lazily().await.unwrap();
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        tx.checkpoints("c1").await.unwrap().get(&s2),
        Some(&cp(at(7, 0, 1)))
    );
    drop(tx);
    // A snapshot begun lazily commits either way, and both are seen.
    for (lsn, lazily) in [(8, true), (9, false)] {
        let mut tx = store.begin_snapshot_lazily().await.unwrap();
        tx.put_checkpoints("c1", &[(s2.clone(), cp(at(lsn, 0, 1)))])
            .await
            .unwrap();
        if lazily {
            tx.commit_lazily().await.unwrap();
        } else {
            tx.commit().await.unwrap();
        }
        let mut tx = store.begin().await.unwrap();
        assert_eq!(
            tx.checkpoints("c1").await.unwrap().get(&s2),
            Some(&cp(at(lsn, 0, 1)))
        );
    }

    // Candidates: each row's last effect through the boundary, in order.
    let identity = |k: i32| RowIdentity::new("t", "id", &TypedValue::Int(k));
    let row = CapturedRow {
        row: "{}".into(),
        version: ServerVersion::parse("v").unwrap(),
        digest: Digest([1; 32]),
        schema_version: Some(1),
    };
    let effect = |lsn: u64, k: i32| Effect {
        scope: s1.clone(),
        commit_lsn: lsn,
        event_ordinal: 0,
        effect_ordinal: 0,
        table_id: "t".into(),
        identity: identity(k),
        key: Value::int(i64::from(k)),
        op: EffectOp::Upsert(row.clone()),
    };
    // An effect's row is its row's projection (ADR 0037): each is written
    // with one.
    let projection = |k: i32| Projection {
        table_id: "t".into(),
        identity: identity(k),
        key: k.to_string(),
        row: Value::Object(BTreeMap::new()),
        version: ServerVersion::parse("v").unwrap(),
        digest: Digest([1; 32]),
        schema_version: 1,
        tombstone: false,
        scopes: Default::default(), // membership is not what this reads
    };
    let through = |lsn| Boundary::TransactionEnd { commit_lsn: lsn };
    let start = StreamPosition::GenerationStart;
    for (lsn, k) in [(100, 1), (200, 2), (300, 1)] {
        if lsn == 300 {
            // A snapshot at 200 holds row 1's effect at 100 as its last.
            let mut tx = store.begin().await.unwrap();
            let c = tx
                .scope_candidates(&s1, start, through(200), 10)
                .await
                .unwrap();
            assert_eq!(c, [effect(100, 1), effect(200, 2)], "the snapshot at 200");
            drop(tx);
        }
        // Row 1, written again at 300, already has its projection.
        let (new_projections, put_projections) = if lsn == 300 {
            (Vec::new(), vec![projection(k)])
        } else {
            (vec![projection(k)], Vec::new())
        };
        let m = Materialization {
            new_projections,
            put_projections,
            ..group(&[lsn], 1, vec![effect(lsn, k)])
        };
        materialize(store, &m).await;
    }
    let mut tx = store.begin().await.unwrap();
    let c = tx
        .scope_candidates(&s1, start, through(300), 10)
        .await
        .unwrap();
    assert_eq!(
        c,
        [effect(200, 2), effect(300, 1)],
        "row 1 at 100 is covered"
    );
    let c = tx
        .scope_candidates(&s1, start, through(300), 1)
        .await
        .unwrap();
    assert_eq!(c, [effect(200, 2)], "at most max");
    let c = tx
        .scope_candidates(&s1, at(200, 0, 0), through(300), 10)
        .await
        .unwrap();
    assert_eq!(c, [effect(300, 1)], "only after the cursor");
    assert!(
        tx.scope_candidates(&s2, start, through(300), 10)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        tx.last_effect_before(&s1, at(300, 0, 0)).await.unwrap(),
        Some(at(200, 0, 0))
    );
    assert_eq!(
        tx.last_effect_before(&s1, StreamPosition::TransactionEnd { commit_lsn: 300 })
            .await
            .unwrap(),
        Some(at(300, 0, 0))
    );
    assert_eq!(
        tx.last_effect_before(&s1, at(100, 0, 0)).await.unwrap(),
        None
    );
    assert_eq!(tx.last_effect_before(&s1, start).await.unwrap(), None);
    assert_eq!(
        tx.last_effect_before(&s2, through(300).into())
            .await
            .unwrap(),
        None
    );
    // All at once: each scope's, in the asked order, repeats and all.
    for before in [at(300, 0, 0), through(300).into(), at(100, 0, 0), start] {
        let asked = [&s2, &s1, &s2];
        let mut singles = Vec::new();
        for scope in asked {
            singles.push(tx.last_effect_before(scope, before).await.unwrap());
        }
        assert_eq!(
            tx.last_effects_before(&asked, before).await.unwrap(),
            singles
        );
    }
    assert!(tx.last_effects_before(&[], start).await.unwrap().is_empty());
    drop(tx);
    // Two effects of one row in one materialization: the later supersedes
    // the earlier, and the row's effect at 300 too.
    let m = Materialization {
        put_projections: vec![projection(1)],
        ..group(&[400, 500], 1, vec![effect(400, 1), effect(500, 1)])
    };
    materialize(store, &m).await;
    let mut tx = store.begin().await.unwrap();
    let c = tx
        .scope_candidates(&s1, start, through(500), 10)
        .await
        .unwrap();
    assert_eq!(
        c,
        [effect(200, 2), effect(500, 1)],
        "within one materialization"
    );
    drop(tx);
    // A row projected again under a newer manifest, its content and scopes
    // the same, gets no effect: its effect serves the projection's digest
    // and schema version from then on.
    let reprojected = Projection {
        digest: Digest([2; 32]),
        schema_version: 2,
        ..projection(2)
    };
    let m = Materialization {
        put_projections: vec![reprojected],
        ..group(&[600], 0, Vec::new())
    };
    materialize(store, &m).await;
    let mut tx = store.begin().await.unwrap();
    let served = EffectOp::Upsert(CapturedRow {
        digest: Digest([2; 32]),
        schema_version: Some(2),
        ..row.clone()
    });
    for c in [
        tx.scope_candidates(&s1, start, through(600), 10)
            .await
            .unwrap(),
        tx.scope_effects(&s1, start, through(600)).await.unwrap(),
    ] {
        assert_eq!(
            c,
            [
                Effect {
                    op: served.clone(),
                    ..effect(200, 2)
                },
                effect(500, 1)
            ],
            "an effect serves its row's projection"
        );
    }
    drop(tx);
    // An upsert whose row has no projection cannot be served: an integrity
    // failure, never a change without its row.
    materialize(store, &group(&[700], 1, vec![effect(700, 3)])).await;
    let mut tx = store.begin().await.unwrap();
    assert!(matches!(
        tx.scope_candidates(&s1, at(600, 0, 0), through(700), 10)
            .await,
        Err(StoreError::Integrity(_))
    ));
    assert!(matches!(
        tx.scope_effects(&s1, at(600, 0, 0), through(700)).await,
        Err(StoreError::Integrity(_))
    ));
}

/// A group of source transactions committed at `lsns`, each of
/// `row_events` events, with `effects` and no projection: a fresh store's
/// stream generation.
fn group(
    lsns: &[u64],
    row_events: u64,
    effects: Vec<crate::capture::Effect>,
) -> crate::capture::Materialization {
    use crate::capture::{Materialization, MaterializedTransaction};
    let last = lsns.last().copied().unwrap_or_default();
    Materialization {
        commit_lsn: last,
        end_lsn: last + 8,
        transactions: lsns
            .iter()
            .map(|&lsn| MaterializedTransaction {
                commit_lsn: lsn,
                end_lsn: lsn + 8,
                row_events,
            })
            .collect(),
        effects,
        stream_generation: 1,
        ..Materialization::default()
    }
}

/// Writes `m` in a transaction of its own, as the materializer does.
async fn materialize<S: Store>(store: &S, m: &crate::capture::Materialization) {
    let mut tx = store.begin().await.unwrap();
    tx.materialize(m).await.unwrap();
    tx.commit().await.unwrap();
}

/// Connect's same-position current-schema replacement: after a Class 2
/// change every kept cursor is replaced, after a Class 3 change only the
/// unaffected scopes' are; pull accepts the replacements and never the
/// historical tokens.
async fn schema_bridge<W: CaptureWorld>(world: &W, node: &Node) -> Node {
    let store = world.store();
    let n = pull_note(40);
    write_settled(
        world,
        &[Write::Insert("public.notes", &note_row(&n, "br-u", "kept"))],
    )
    .await;
    let mut c = PullClient::connect(store, node, "br-u", "br-c").await;
    c.sync(10).await;
    let old = c.body(10);
    let old_cursors: Vec<(String, Option<String>)> = c
        .replica
        .scopes
        .iter()
        .map(|(s, l)| (s.clone(), l.cursor.clone()))
        .collect();
    let reconnect = |node: &Node, schema: Value, known: Vec<(String, Option<String>)>| {
        let mut body = ConnectBody::fresh("br-c");
        body.generation = Some(c.generation);
        body.schema = schema;
        body.scope_set_version = c.replica.scope_set_version;
        body.known = known;
        let node = node.clone();
        async move {
            let r = node
                .send(Route::Connect, "br-u", json::to_canonical(&body.to_json()))
                .await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            json::parse(&r.body).unwrap()
        }
    };
    let updates = |v: &Value| -> BTreeMap<String, Option<String>> {
        v.as_object().unwrap()["scope_cursor_updates"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(s, c)| (s.clone(), c.as_str().map(str::to_owned)))
            .collect()
    };
    let schema_of = |v: &Value| {
        let s = v.as_object().unwrap()["schema"].as_object().unwrap();
        json::object([
            ("version", s["version"].clone()),
            ("hash", s["hash"].clone()),
        ])
    };
    // Class 2: a table renamed. Every kept cursor gets its replacement.
    let class2 =
        super::push::push_config_with(|s| s.replace("name = \"notes\"", "name = \"notebook\""));
    let node2 = node.with(Engine::start(store.clone(), class2).await.unwrap());
    let v = reconnect(&node2, c.replica_schema(), old_cursors.clone()).await;
    assert_eq!(
        v.as_object().unwrap()["schema"].as_object().unwrap()["action"],
        Value::string("replace")
    );
    let replaced = updates(&v);
    assert_eq!(replaced.len(), 2, "{replaced:?}");
    assert!(replaced.values().all(Option::is_some), "{replaced:?}");
    let current = schema_of(&v);
    let body = |cursors: &BTreeMap<String, Option<String>>, schema: &Value| {
        edit(&old, |o| {
            o.insert("schema".into(), schema.clone());
            let scopes = cursors
                .iter()
                .map(|(s, c)| {
                    let c = c.as_ref().map_or(Value::Null, |c| Value::string(c.clone()));
                    (s.clone(), json::object([("cursor", c)]))
                })
                .collect();
            o.insert("scopes".into(), Value::Object(scopes));
        })
    };
    let r = node2
        .send(Route::Pull, "br-u", body(&replaced, &current))
        .await;
    let page = json::parse(&r.body).unwrap();
    assert_eq!(r.status, 200, "{page:?}");
    assert_eq!(
        page.as_object().unwrap()["rebuild"],
        Value::Array(vec![]),
        "replacements resume"
    );
    // Its terminal checksum is the scope digest under the current manifest:
    // the stored digests (computed under the old one) are recomputed.
    let served = Digest::from_checksum_json(
        &page.as_object().unwrap()["checksums"].as_object().unwrap()["user:br-u"],
    )
    .unwrap();
    assert_eq!(served, digest_under_current(store, "user:br-u").await);
    // The historical tokens themselves are stale under the current schema.
    let historical: BTreeMap<String, Option<String>> = old_cursors.iter().cloned().collect();
    let r = node2
        .send(Route::Pull, "br-u", body(&historical, &current))
        .await;
    let page = json::parse(&r.body).unwrap();
    assert_eq!(
        page.as_object().unwrap()["rebuild"],
        Value::Array(vec![
            Value::string("templates_public"),
            Value::string("user:br-u")
        ]),
        "pull never accepts a historical token"
    );
    // Class 3: the notes lifecycle changes, so notes are rematerialized:
    // the user scope (notes) needs a rebuild, templates keep going.
    let class3 = super::push::push_config_with(|s| {
        s.replace("name = \"notes\"", "name = \"notebook\"")
            .replace(
                "lifecycle = { updated_at = \"updated_at\", deleted_at = \"deleted_at\" }",
                "lifecycle = { updated_at = \"updated_at\" }",
            )
    });
    let node3 = node.with(Engine::start(store.clone(), class3).await.unwrap());
    super::capture::rematerialized(store).await;
    let known: Vec<(String, Option<String>)> = replaced.clone().into_iter().collect();
    let v = reconnect(&node3, current.clone(), known).await;
    assert_eq!(
        v.as_object().unwrap()["schema"].as_object().unwrap()["action"],
        Value::string("rebuild_local")
    );
    let after = updates(&v);
    assert!(after["user:br-u"].is_none(), "an affected scope rebuilds");
    assert!(
        after["templates_public"].is_some(),
        "an unaffected scope is bridged"
    );
    drop(node2);
    node3
}

/// A scope's digest under the current manifest, computed here from its
/// members' projections (independently of the puller).
async fn digest_under_current<S: Store>(store: &S, scope: &str) -> protocol::digest::Digest {
    use protocol::digest::{ScopeDigest, row_digest};
    let scope_id = protocol::ids::ScopeId::parse(scope).unwrap();
    let mut tx = store.begin().await.unwrap();
    let manifest = tx.manifests().await.unwrap().pop().unwrap();
    let members = tx.scope_members(&scope_id).await.unwrap();
    let ids: Vec<_> = members.iter().map(|(i, _)| i.clone()).collect();
    let projections = tx.projections("tbl_notes", &ids).await.unwrap();
    assert_eq!(
        projections.len(),
        members.len(),
        "the scope holds notes only"
    );
    let mut d = ScopeDigest::new(&manifest.hash(), scope, members.len() as u64);
    for (identity, stored) in &members {
        let p = projections
            .iter()
            .find(|p| &p.identity == identity)
            .unwrap();
        assert!(
            p.schema_version < manifest.schema_version(),
            "stored under an older manifest"
        );
        let table = manifest.table(&p.table_id).unwrap();
        let row = table.decode_row(p.row.as_object().unwrap()).unwrap();
        let now = row_digest(&manifest.hash(), table, identity, &row, &p.version);
        assert_ne!(&now, stored, "the manifest is part of every row digest");
        d.push(identity, &now);
    }
    d.finish().unwrap()
}
