//! `/sync/pull` (wire spec "Pull", ADR 003): one bounded incremental page
//! across a client's assigned scopes, in one snapshot transaction.
//!
//! `Puller::pull` is the whole dispatch, in the spec's order: bind, the
//! boundary, structure, retirement, the generation and schema gates, the
//! request rules that need state, cursors, admission, then the page. The
//! page's decisions are `page`; terminal checksums are `checksum`; cursors
//! are `crate::cursor`.

pub mod checksum;
pub mod page;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use protocol::digest::{Digest, row_digest};
use protocol::error::{ErrorKind, ProtocolError};
use protocol::ids::ScopeId;
use protocol::json;
use protocol::manifest::Manifest;
use protocol::position::StreamPosition;
use protocol::wire::pull::{Change, ChangeOp, PageEnd, PullRequest, PullResponse};
use protocol::wire::{AssignmentDelta, PageRow, PrimaryKey};

use crate::admission::Admission;
use crate::attempt::{self, Failure};
use crate::capture::{Effect, EffectOp};
use crate::cursor::{self, CursorContext, Presented};
use crate::key_ring::{self, Refresh};
use crate::registry::{Registry, reconcile_assignment};
use crate::reply::Reply;
use crate::store::{ClientRecord, Store, StoreError, StoreTx};
use crate::stream::Checkpoint;
use crate::visibility::Visibility;
use checksum::ChecksumCache;
use page::ScopeEffects;

/// The pull actor's state: the registry (schema, assignment, membership
/// generations, the shared token keys), the checksum cache, and admission.
pub struct Puller<S: Store> {
    store: S,
    registry: Arc<Registry<S>>,
    checksums: ChecksumCache,
    /// Page admission, fair per user; a pull past it answers 429.
    admission: Arc<Admission>,
    /// How a pull waits for its client's writes to be captured.
    visibility: Visibility,
}

/// One scope the page reads: its presented position.
struct Resumed<'a> {
    scope: &'a ScopeId,
    after: StreamPosition,
    membership_generation: u64,
}

impl<S: Store> Puller<S> {
    /// A puller that builds a page only when `admission` admits it.
    pub fn new(
        store: S,
        registry: Arc<Registry<S>>,
        admission: Arc<Admission>,
        visibility: Visibility,
    ) -> Self {
        Puller {
            store,
            registry,
            checksums: ChecksumCache::default(),
            admission,
            visibility,
        }
    }

    /// `/sync/pull` for the authenticated `user_id`, at server time `now_micros`.
    pub async fn pull(&self, user_id: &str, body: &[u8], now_micros: i64) -> Reply {
        let pull = || {
            attempt::retried(&self.visibility, || async {
                self.pull_once(user_id, body, now_micros)
                    .await
                    .map(|r| r.to_body())
            })
        };
        self.registry.refresh_keys(Refresh::Due).await;
        let reply = pull().await;
        // A cursor another process issued under keys rotated since this
        // one read them (ADR 0025).
        if reply.status == 400
            && key_ring::presents_unknown_key(&self.registry.keys(), body)
            && self.registry.refresh_keys(Refresh::Unverified).await
        {
            return pull().await;
        }
        reply
    }

    /// One attempt in one snapshot transaction; nothing is written unless it commits.
    async fn pull_once(
        &self,
        user_id: &str,
        body: &[u8],
        now_micros: i64,
    ) -> Result<PullResponse, Failure> {
        let parsed = protocol::wire::parse_body(body);
        let named = parsed
            .as_ref()
            .ok()
            .and_then(protocol::wire::client_id_member);
        // Most pulls only move checkpoints, and commit lazily.
        let mut tx = self.store.begin_snapshot_lazily().await?;
        let frame = attempt::frame(&mut tx, named).await?;
        let progress = frame.progress;
        let boundary = progress.boundary;
        // 1. Bind client_id to the user.
        let client = attempt::bind(user_id, named, frame.client)?;
        // 3. Structure, with every limit.
        let req = PullRequest::from_value(parsed?)?;
        let Some(mut client) = client else {
            return Err(ProtocolError::new(ErrorKind::AuthRequired).into());
        };
        // 4. Retirement; 6. the generation gate, then the schema gate.
        let current = self.registry.current().clone();
        attempt::gates(&client, req.client_generation, req.schema, &current)?;
        // The request rules judged against the client's state.
        scope_rules(&req, &client)?;
        // 7. Cursors: any misbound one fails the whole request.
        let stream = frame.stream;
        let client_id = client.client_id.clone();
        let ctx = CursorContext {
            user_id,
            client_id: &client_id,
            client_generation: client.generation,
            schema_hash: current.hash(),
            stream,
            boundary,
            now_micros,
        };
        let presented = self.judge_cursors(&ctx, &req)?;
        // 8. Admission control.
        let _permit = self.admission.admit_page(user_id, now_micros).await?;
        // 9. Execute: capture must have materialized what this client wrote.
        attempt::capture_gates(&progress, &frame.pending_fences)?;
        attempt::rematerialization_gate(&self.registry, &progress, req.scopes.keys())?;
        let authoritative = self.registry.assignment(&mut tx, user_id).await?;
        let changed = reconcile_assignment(&mut client, &authoritative)?;
        let scope_updates = scope_updates(&req, &authoritative);
        let (resumed, rebuild) = self.dispatch(&req, &authoritative, &presented);
        let (changes, cursors, has_more) = self
            .page(&mut tx, &ctx, &current, &resumed, req.limit.get().into())
            .await?;
        let end = if has_more {
            PageEnd::More
        } else {
            PageEnd::Terminal {
                checksums: self
                    .checksums(&mut tx, &ctx, &current, &authoritative)
                    .await?,
            }
        };
        self.acknowledge(&mut tx, &client, &frame.checkpoints, &stream, &resumed)
            .await?;
        let first_presented = attempt::present_generation(&mut client);
        if changed || first_presented {
            tx.put_client(&client).await?;
            tx.commit().await?;
        } else {
            // Checkpoints alone: a crash that undoes them leaves a client
            // held back further, never a floor that passed a cursor.
            tx.commit_lazily().await?;
        }
        Ok(PullResponse {
            changes,
            scope_set_version: client.scope_set_version,
            scope_cursors: cursors,
            scope_updates,
            rebuild,
            end,
        })
    }

    /// Step 7: what each presented cursor means.
    fn judge_cursors(
        &self,
        ctx: &CursorContext<'_>,
        req: &PullRequest,
    ) -> Result<BTreeMap<ScopeId, Presented>, ProtocolError> {
        let membership = self.registry.membership();
        req.scopes
            .iter()
            .map(|(scope, token)| {
                let g = membership.generation_of(scope);
                cursor::judge(&self.registry.keys(), ctx, scope, g, token.as_deref())
                    .map(|p| (scope.clone(), p))
                    .map_err(|_| ProtocolError::invalid_request("a cursor is not valid"))
            })
            .collect()
    }

    /// Which assigned scopes resume, and which must rebuild: every added
    /// scope, and every presented one with a null or stale cursor. Both in
    /// scope-ID order (docs/adr/0008).
    fn dispatch<'r>(
        &self,
        req: &'r PullRequest,
        authoritative: &'r BTreeSet<ScopeId>,
        presented: &BTreeMap<ScopeId, Presented>,
    ) -> (Vec<Resumed<'r>>, Vec<ScopeId>) {
        let membership = self.registry.membership();
        let mut resumed = Vec::new();
        let mut rebuild = Vec::new();
        for scope in authoritative {
            match (req.scopes.contains_key(scope), presented.get(scope)) {
                (true, Some(Presented::Valid(after))) => resumed.push(Resumed {
                    scope,
                    after: *after,
                    membership_generation: membership.generation_of(scope),
                }),
                _ => rebuild.push(scope.clone()),
            }
        }
        (resumed, rebuild)
    }

    /// The page: each resumed scope's candidates through B, the merge, and
    /// the changes and cursors it decides.
    async fn page(
        &self,
        tx: &mut S::Tx,
        ctx: &CursorContext<'_>,
        current: &Manifest,
        resumed: &[Resumed<'_>],
        limit: usize,
    ) -> Result<(Vec<Change>, BTreeMap<ScopeId, String>, bool), Failure> {
        let mut lists = Vec::with_capacity(resumed.len());
        for r in resumed {
            let list = tx
                .scope_candidates(r.scope, r.after, ctx.boundary, ScopeEffects::to_read(limit))
                .await?;
            lists.push(list);
        }
        let scopes: Vec<ScopeEffects<'_>> = resumed
            .iter()
            .zip(&lists)
            .map(|(r, l)| ScopeEffects::read(r.scope, r.after, l, limit))
            .collect();
        let page = page::build(&scopes, ctx.boundary, limit);
        let positions = &page.cursors;
        let changes = page
            .changes
            .iter()
            .map(|e| change(current, e))
            .collect::<Result<Vec<_>, _>>()?;
        let mut cursors = BTreeMap::new();
        for r in resumed {
            if let Some(p) = positions.get(r.scope) {
                assert!(*p >= r.after, "progress only moves forward");
                let token = cursor::issue(
                    &self.registry.keys(),
                    ctx,
                    r.scope,
                    r.membership_generation,
                    *p,
                );
                cursors.insert(r.scope.clone(), token);
            }
        }
        Ok((changes, cursors, page.has_more))
    }

    /// The terminal map: exactly the active set after this response's
    /// updates, each scope's digest at B.
    async fn checksums(
        &self,
        tx: &mut S::Tx,
        ctx: &CursorContext<'_>,
        current: &Manifest,
        active: &BTreeSet<ScopeId>,
    ) -> Result<BTreeMap<ScopeId, Digest>, Failure> {
        let sums = self
            .checksums
            .digests(tx, ctx.stream.generation, current, active, ctx.boundary)
            .await?;
        assert_eq!(
            sums.len(),
            active.len(),
            "a checksum for every active scope"
        );
        Ok(sums)
    }

    /// Advances the checkpoint of every resumed scope to its presented
    /// position: never backward, and only in this page's transaction.
    async fn acknowledge(
        &self,
        tx: &mut S::Tx,
        client: &ClientRecord,
        stored: &BTreeMap<ScopeId, Checkpoint>,
        stream: &crate::stream::StreamState,
        resumed: &[Resumed<'_>],
    ) -> Result<(), Failure> {
        let mut advanced = Vec::new();
        for r in resumed {
            let next = Checkpoint {
                stream_generation: stream.generation,
                position: r.after,
            };
            match stored.get(r.scope) {
                Some(c) if c.stream_generation == stream.generation && c.position >= r.after => {}
                _ => advanced.push((r.scope.clone(), next)),
            }
        }
        for (scope, c) in &advanced {
            if let Some(old) = stored.get(scope) {
                assert!(
                    old.stream_generation != c.stream_generation || old.position < c.position,
                    "a checkpoint only moves forward"
                );
            }
        }
        tx.put_checkpoints(&client.client_id, &advanced).await?;
        Ok(())
    }
}

/// Request rules 3 and 6: no future scope-set version, and only scopes
/// this generation was assigned (a removed one is accepted).
fn scope_rules(req: &PullRequest, client: &ClientRecord) -> Result<(), ProtocolError> {
    if req.scope_set_version > client.scope_set_version {
        return Err(ProtocolError::invalid_request(
            "scope_set_version is ahead of the server's",
        ));
    }
    if req.scopes.keys().any(|s| !client.ever_assigned.contains(s)) {
        return Err(ProtocolError::invalid_request(
            "a scope was never assigned to this client",
        ));
    }
    Ok(())
}

/// The assignment delta against what the client presented.
fn scope_updates(req: &PullRequest, authoritative: &BTreeSet<ScopeId>) -> AssignmentDelta {
    AssignmentDelta {
        add: authoritative
            .iter()
            .filter(|s| !req.scopes.contains_key(*s))
            .map(|s| (s.clone(), None))
            .collect(),
        remove: req
            .scopes
            .keys()
            .filter(|s| !authoritative.contains(*s))
            .cloned()
            .collect(),
    }
}

/// The wire change of one selected candidate. Its row checksum is the
/// stored digest when that was computed under the current manifest, and is
/// computed under the current manifest otherwise; a row that manifest cannot
/// represent is an integrity failure, never a silent omission.
fn change(current: &Manifest, e: &Effect) -> Result<Change, Failure> {
    let bad = |what: &str| StoreError::Integrity(format!("a captured effect {what}"));
    let table = current
        .table(&e.table_id)
        .ok_or_else(|| bad("names a table the manifest lacks"))?;
    let image = |r: &crate::capture::CapturedRow| -> Result<PageRow, StoreError> {
        let recompute = || -> Result<Digest, StoreError> {
            let row = json::parse(r.row.as_bytes()).map_err(|_| bad("row is not JSON"))?;
            let object = row.as_object().ok_or_else(|| bad("row is not an object"))?;
            let decoded = table
                .decode_row(object)
                .map_err(|_| bad("row does not fit the current manifest"))?;
            Ok(row_digest(
                &current.hash(),
                table,
                &e.identity,
                &decoded,
                &r.version,
            ))
        };
        let checksum = if r.schema_version == Some(current.schema_version()) {
            // Debug builds (every test, the simulator) check the stored digest.
            #[cfg(debug_assertions)]
            assert_eq!(r.digest, recompute()?, "a stored digest is its row's");
            r.digest
        } else {
            recompute()?
        };
        // The captured text is the materializer's canonical rendering of
        // the wire row: the page splices it as it is.
        Ok(PageRow {
            row: json::Canonical::stored(r.row.clone()).ok_or_else(|| bad("row is damaged"))?,
            checksum,
        })
    };
    let op = match &e.op {
        EffectOp::Upsert(r) => ChangeOp::Upsert(image(r)?),
        EffectOp::Tombstone(r) => ChangeOp::Delete(Some(image(r)?)),
        EffectOp::Remove(_) => ChangeOp::Delete(None),
    };
    Ok(Change {
        scope: e.scope.clone(),
        table: e.table_id.clone(),
        pk: PrimaryKey {
            field_id: table.primary_key_field_id().to_owned(),
            value: e.key.clone(),
        },
        op,
        server_version: e.op.version().clone(),
    })
}
