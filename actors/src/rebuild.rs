//! `/sync/rebuild` (wire spec "Rebuild", ADR 003 "Rebuild contract"): one
//! assigned scope served from one immutable staged snapshot, page by page,
//! each page rendered from the stage and the session alone, so that a
//! replay is the same bytes (ADR 0017).
//!
//! `Rebuilder::rebuild_once` is the whole dispatch, in the spec's order:
//! bind, the boundary, structure, retirement, the generation and schema
//! gates, the continuation, admission, the capture gates, then the first
//! page (a new or reused session) or the continued one. A rebuild writes
//! only its own session and stage: never a checkpoint, an
//! assignment, or another scope's state. A background task sweeps expired
//! sessions.

use std::sync::Arc;

use protocol::digest::{RowIdentity, ScopeDigest};
use protocol::error::{ErrorKind, ProtocolError};
use protocol::ids::CanonicalUuid;
use protocol::json::Canonical;
use protocol::manifest::Manifest;
use protocol::token::{KeyRing, TokenKind};
use protocol::wire::rebuild::{RebuildEnd, RebuildPage, RebuildRequest, Record};
use protocol::wire::{PageRow, PrimaryKey};
use tokio::sync::watch;

use crate::admission::Admission;
use crate::attempt::{self, Failure};
use crate::config::LimitsConfig;
use crate::cursor::{self, ContinuationRequest, Continued, CursorContext};
use crate::key_ring::{self, Refresh};
use crate::pull::checksum::reproject;
use crate::registry::Registry;
use crate::reply::Reply;
use crate::staging::{FORGET_AFTER_MICROS, RebuildSession, SESSION_LIFETIME_MICROS, StagedRow};
use crate::store::{ClientRecord, Store, StoreError, StoreTx};
use crate::visibility::Visibility;

/// Staged digests read back at once while sealing a session.
const DIGEST_CHUNK: usize = 10_000;

/// Sessions one sweep transaction handles, at most (each of its two steps).
const SWEEP_BATCH: usize = 64;

/// The pause after a sweep pass: a busy server sweeps a few times a second,
/// not once per request.
const SWEEP_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// The rebuild actor: the registry (schema, assignment, membership
/// generations, keys), the page admission it shares with pull, and the
/// line to its background sweep.
pub struct Rebuilder<S: Store> {
    store: S,
    registry: Arc<Registry<S>>,
    admission: Arc<Admission>,
    limits: LimitsConfig,
    /// The server time of the latest request: wakes the sweep.
    clock: watch::Sender<i64>,
    /// How a rebuild waits for its client's writes to be captured.
    visibility: Visibility,
}

/// What the request asks for, once its continuation is judged current.
enum Asked {
    /// `cursor: null`: the first page of a new or reused session.
    First,
    /// The page a current continuation points to: its session's, at its ordinal.
    Page {
        session_id: CanonicalUuid,
        ordinal: u64,
    },
}

impl<S: Store> Rebuilder<S> {
    /// A rebuilder that serves a page only when `admission` admits it,
    /// and stages within `limits`' budgets.
    pub fn new(
        store: S,
        registry: Arc<Registry<S>>,
        admission: Arc<Admission>,
        limits: LimitsConfig,
        visibility: Visibility,
    ) -> Self {
        let (clock, time) = watch::channel(i64::MIN);
        tokio::spawn(sweep(store.clone(), time));
        Rebuilder {
            store,
            registry,
            admission,
            limits,
            clock,
            visibility,
        }
    }

    /// `/sync/rebuild` for the authenticated `user_id`, at server time
    /// `now_micros`. The time then wakes the sweep.
    pub async fn rebuild(&self, user_id: &str, body: &[u8], now_micros: i64) -> Reply {
        let rebuild = || {
            attempt::retried(&self.visibility, || {
                self.rebuild_once(user_id, body, now_micros)
            })
        };
        self.registry.refresh_keys(Refresh::Due).await;
        let mut reply = rebuild().await;
        // A continuation another process issued under keys rotated since
        // this one read them (ADR 0025).
        if reply.status == 400
            && key_ring::presents_unknown_key(&self.registry.keys(), body)
            && self.registry.refresh_keys(Refresh::Unverified).await
        {
            reply = rebuild().await;
        }
        self.clock.send_replace(now_micros);
        reply
    }

    /// One attempt in one snapshot transaction; nothing is written unless it commits.
    async fn rebuild_once(
        &self,
        user_id: &str,
        body: &[u8],
        now_micros: i64,
    ) -> Result<Vec<u8>, Failure> {
        let parsed = protocol::wire::parse_body(body);
        // A new session's id, drawn before the snapshot (entropy is not state).
        let session_id = fresh_session_id(&self.store).await?;
        let named = parsed
            .as_ref()
            .ok()
            .and_then(protocol::wire::client_id_member);
        let mut tx = self.store.begin_snapshot().await?;
        // The frame fixes the boundary B a new session stages at.
        let frame = attempt::frame(&mut tx, named).await?;
        let progress = frame.progress;
        // 1. Bind client_id to the user.
        let client = attempt::bind(user_id, named, frame.client)?;
        // 3. Structure, with every limit.
        let req = RebuildRequest::from_value(parsed?)?;
        let Some(mut client) = client else {
            return Err(ProtocolError::new(ErrorKind::AuthRequired).into());
        };
        // 4. Retirement; 6. the generation gate, then the schema gate.
        let current = self.registry.current().clone();
        attempt::gates(&client, req.client_generation, req.schema, &current)?;
        // 7. The continuation, and the scope's assignment.
        let ctx = CursorContext {
            user_id,
            client_id: &client.client_id,
            client_generation: client.generation,
            schema_hash: current.hash(),
            stream: frame.stream,
            boundary: progress.boundary,
            now_micros,
        };
        let membership_generation = self.registry.membership().generation_of(&req.scope);
        let assigned = client.assigned.contains(&req.scope)
            && self
                .registry
                .assignment(&mut tx, user_id)
                .await?
                .contains(&req.scope);
        let asked = self.judge(&ctx, &req, &client, membership_generation, assigned)?;
        // 8. Admission control.
        let _permit = self.admission.admit_page(user_id, now_micros).await?;
        // 9. Execute: capture must have materialized what this client wrote.
        attempt::capture_gates(&progress, &frame.pending_fences)?;
        attempt::rematerialization_gate(&self.registry, &progress, std::iter::once(&req.scope))?;
        let (session, ordinal) = match asked {
            Asked::First => {
                let keys = self.registry.keys();
                let context = SessionContext {
                    ctx: &ctx,
                    keys: &keys,
                    client: &client,
                    req: &req,
                    membership_generation,
                };
                let session = match tx
                    .rebuild_session(&client.client_id, &req.rebuild_id)
                    .await?
                {
                    Some(s) => context.reuse(s)?,
                    None => {
                        self.new_session(&mut tx, &current, &context, session_id)
                            .await?
                    }
                };
                (session, 0)
            }
            Asked::Page {
                session_id,
                ordinal,
            } => {
                match tx
                    .rebuild_session(&client.client_id, &req.rebuild_id)
                    .await?
                {
                    Some(s)
                        if s.session_id == session_id
                            && s.digest.is_some()
                            && now_micros < s.expires_at =>
                    {
                        (s, ordinal)
                    }
                    // Replaced, superseded or expired: the session it continues is gone.
                    _ => return Err(restart(&req).into()),
                }
            }
        };
        let body = self
            .page(&mut tx, &ctx, &current, &session, &req, ordinal)
            .await?;
        if attempt::present_generation(&mut client) {
            tx.put_client(&client).await?;
        }
        tx.commit().await?;
        Ok(body)
    }

    /// Step 7: a continuation is current, stale (409) or misbound (400); a
    /// scope no longer assigned cannot continue (409) or start (400).
    fn judge(
        &self,
        ctx: &CursorContext<'_>,
        req: &RebuildRequest,
        client: &ClientRecord,
        membership_generation: u64,
        assigned: bool,
    ) -> Result<Asked, ProtocolError> {
        let Some(token) = &req.cursor else {
            if !assigned {
                return Err(ProtocolError::invalid_request(
                    "the scope is not assigned to this client",
                ));
            }
            return Ok(Asked::First);
        };
        let presented = ContinuationRequest {
            scope: &req.scope,
            rebuild_id: &req.rebuild_id,
            limit: req.limit,
            membership_generation,
            accepted_write_epoch: client.accepted_write_epoch,
        };
        match cursor::judge_continuation(&self.registry.keys(), ctx, &presented, token) {
            Err(_) => Err(ProtocolError::invalid_request(
                "the continuation is not valid",
            )),
            Ok(Continued::Stale) => Err(restart(req)),
            Ok(Continued::Valid(_)) if !assigned => Err(restart(req)),
            Ok(Continued::Valid(b)) if b.snapshot_boundary > ctx.boundary => Err(restart(req)),
            Ok(Continued::Valid(b)) => Ok(Asked::Page {
                session_id: b.session_id,
                ordinal: b.next_row_ordinal,
            }),
        }
    }

    /// A new attempt, within the user's staging rate: it supersedes the
    /// client's live sessions of the scope (at most one lives per client
    /// and scope), then stages within the budgets. A stage that would pass
    /// the user's or the instance's budget while other stages hold rows
    /// answers `429 retry_later` before anything is staged, and the
    /// transaction (the superseding included) rolls back; a stage alone
    /// may be of any size, so every scope can be rebuilt.
    async fn new_session(
        &self,
        tx: &mut S::Tx,
        current: &Manifest,
        context: &SessionContext<'_>,
        session_id: CanonicalUuid,
    ) -> Result<RebuildSession, Failure> {
        let (client, now) = (&context.client, context.ctx.now_micros);
        self.admission.admit_stage(&client.user_id, now)?;
        tx.supersede_rebuild_sessions(&client.client_id, &context.req.scope, now)
            .await?;
        let before = tx.rebuild_usage(&client.user_id, now).await?;
        // Judged before staging: a refused stage is never written (a
        // written one that rolls back leaves its bytes dead in the table).
        let rows = tx.scope_size(&context.req.scope).await?;
        let over = |held: u64, budget: u64| held > 0 && held.saturating_add(rows) > budget;
        if over(before.user_rows, self.limits.rebuild_rows_per_user)
            || over(before.total_rows, self.limits.rebuild_rows_total)
        {
            return Err(ProtocolError::new(ErrorKind::RetryLater)
                .with_message("rebuild staging is at its budget; retry later")
                .into());
        }
        let (session, staged) = self.stage(tx, current, context.session(session_id)).await?;
        assert_eq!(
            staged, rows,
            "a stage holds its scope's rows, in one snapshot"
        );
        Ok(session)
    }

    /// Stages `session`'s scope at the snapshot's boundary, inside the
    /// store, and seals it with the digest of what was staged. The sealed
    /// session and the rows staged.
    async fn stage(
        &self,
        tx: &mut S::Tx,
        current: &Manifest,
        mut session: RebuildSession,
    ) -> Result<(RebuildSession, u64), Failure> {
        // Members whose digest predates the current manifest are staged
        // with their digest under it; one it cannot represent fails the
        // whole staging (503, no session).
        let mut digests = Vec::new();
        if tx.has_stale_projections(current.schema_version()).await? {
            for p in tx
                .stale_scope_members(&session.scope, current.schema_version())
                .await?
            {
                let d = reproject(current, &p).map_err(|_| unrepresentable())?;
                digests.push((p.identity, d));
            }
        }
        let rows = tx.stage_rebuild(&session, &digests).await?;
        // The digest of what was staged, read back in bounded chunks so
        // that a scope of any size stays out of the server's memory.
        let mut d = ScopeDigest::new(&current.hash(), session.scope.as_str(), rows);
        let mut read = 0u64;
        let mut last: Option<RowIdentity> = None;
        loop {
            let chunk = tx
                .staged_digests(&session.session_id, read, DIGEST_CHUNK)
                .await?;
            for (identity, digest) in &chunk {
                assert!(
                    last.as_ref().is_none_or(|l| l < identity),
                    "the stage is in strictly increasing row-identity order"
                );
                d.push(identity, digest);
                last = Some(identity.clone());
            }
            read += chunk.len() as u64;
            if chunk.len() < DIGEST_CHUNK {
                break;
            }
        }
        assert_eq!(read, rows, "the stage holds what was staged");
        let digest = d
            .finish()
            .map_err(|e| StoreError::Integrity(format!("scope digest: {e:?}")))?;
        tx.seal_rebuild_session(&session.session_id, &digest)
            .await?;
        session.digest = Some(digest);
        Ok((session, rows))
    }

    /// The session's page at `ordinal`, rendered from its stage and its
    /// own bindings only (never the request's time or the live rows), so
    /// that every replay is the same bytes. A session whose token keys
    /// the ring no longer holds cannot render the same bytes: 409.
    async fn page(
        &self,
        tx: &mut S::Tx,
        ctx: &CursorContext<'_>,
        current: &Manifest,
        session: &RebuildSession,
        req: &RebuildRequest,
        ordinal: u64,
    ) -> Result<Vec<u8>, Failure> {
        let limit = usize::from(session.page_limit);
        let rows = tx
            .staged_rows(&session.session_id, ordinal, limit + 1)
            .await?;
        assert!(
            rows.iter()
                .zip(ordinal..)
                .all(|(r, expected)| r.ordinal == expected),
            "stage ordinals are dense from the page's first"
        );
        let more = rows.len() > limit;
        let records = rows
            .iter()
            .take(limit)
            .map(|r| record(current, r))
            .collect::<Result<Vec<_>, StoreError>>()?;
        assert!(records.len() <= limit, "a page never exceeds its limit");
        let keys = &*self.registry.keys();
        let end = if more {
            let next = ordinal + limit as u64;
            RebuildEnd::More {
                cursor: cursor::continuation(keys, ctx, session, next)
                    .ok_or_else(|| restart(req))?,
            }
        } else {
            RebuildEnd::Final {
                final_scope_cursor: cursor::final_cursor(keys, ctx, session)
                    .ok_or_else(|| restart(req))?,
                checksum: session
                    .digest
                    .ok_or_else(|| StoreError::Integrity("an unsealed session".into()))?,
            }
        };
        Ok(RebuildPage {
            scope: session.scope.clone(),
            records,
            end,
        }
        .to_body())
    }
}

/// The context a first request creates a session in, or must find a
/// reused one in.
struct SessionContext<'a> {
    ctx: &'a CursorContext<'a>,
    keys: &'a KeyRing,
    client: &'a ClientRecord,
    req: &'a RebuildRequest,
    membership_generation: u64,
}

impl SessionContext<'_> {
    /// A new session, expiring exactly 24 hours from now.
    fn session(&self, session_id: CanonicalUuid) -> RebuildSession {
        RebuildSession {
            session_id,
            client_id: self.client.client_id.clone(),
            rebuild_id: self.req.rebuild_id,
            scope: self.req.scope.clone(),
            client_generation: self.client.generation,
            schema_hash: self.ctx.schema_hash,
            stream_generation: self.ctx.stream.generation,
            membership_generation: self.membership_generation,
            retention_generation: self.ctx.stream.retention_generation,
            accepted_write_epoch: self.client.accepted_write_epoch,
            boundary: self.ctx.boundary,
            page_limit: self.req.limit.get(),
            expires_at: self.ctx.now_micros.saturating_add(SESSION_LIFETIME_MICROS),
            digest: None,
            cursor_key_id: self
                .keys
                .active_key_id(TokenKind::IncrementalCursor)
                .to_owned(),
            continuation_key_id: (self.keys)
                .active_key_id(TokenKind::RebuildContinuation)
                .to_owned(),
        }
    }

    /// The stored session of this attempt, reused when it was staged for
    /// this exact scope and limit (otherwise the attempt's ID names another
    /// rebuild: 400) and its context is still current (otherwise 409).
    fn reuse(&self, s: RebuildSession) -> Result<RebuildSession, ProtocolError> {
        if s.scope != self.req.scope || s.page_limit != self.req.limit.get() {
            return Err(ProtocolError::invalid_request(
                "rebuild_id names another rebuild",
            ));
        }
        let fresh = self.session(s.session_id);
        let current = s.client_generation == fresh.client_generation
            && s.schema_hash == fresh.schema_hash
            && s.stream_generation == fresh.stream_generation
            && s.membership_generation == fresh.membership_generation
            && s.retention_generation == fresh.retention_generation
            && s.accepted_write_epoch == fresh.accepted_write_epoch
            && s.boundary <= fresh.boundary
            && self.ctx.now_micros < s.expires_at
            && s.digest.is_some();
        if current {
            Ok(s)
        } else {
            Err(restart(self.req))
        }
    }
}

/// 409 `rebuild_restart_required` for the request's scope.
fn restart(req: &RebuildRequest) -> ProtocolError {
    ProtocolError::new(ErrorKind::RebuildRestartRequired {
        scope_id: req.scope.as_str().to_owned(),
    })
}

/// A staged scope the current manifest cannot represent: staging fails as
/// a whole, with no session (ADR 003).
fn unrepresentable() -> ProtocolError {
    ProtocolError::new(ErrorKind::TemporaryUnavailable { reason: None })
        .with_message("a row of the scope cannot be staged")
}

/// The record of one staged row: its table, its typed key (the row's
/// primary key field), the row spliced as its stored text, its digest and
/// version.
fn record(current: &Manifest, r: &StagedRow) -> Result<Record, StoreError> {
    let bad = |what: &str| StoreError::Integrity(format!("a staged row {what}"));
    let table = current
        .table(&r.table_id)
        .ok_or_else(|| bad("names a table the manifest lacks"))?;
    // The key comes from the identity's bytes: the row text is spliced as
    // stored, never parsed.
    let field_id = table.primary_key_field_id();
    let value = match r.identity.key() {
        Some((id, key)) if id == field_id => key.to_wire(),
        _ => return Err(bad("has an identity of another key")),
    };
    // Debug builds (every test, the simulator) check the staged digest and key.
    #[cfg(debug_assertions)]
    {
        let row = protocol::json::parse(r.row.as_bytes()).map_err(|_| bad("is not JSON"))?;
        let object = row.as_object().ok_or_else(|| bad("is not an object"))?;
        assert_eq!(
            object.get(field_id),
            Some(&value),
            "a staged key is its row's"
        );
        let decoded = table
            .decode_row(object)
            .map_err(|_| bad("does not fit the manifest"))?;
        assert_eq!(
            r.digest,
            protocol::digest::row_digest(&current.hash(), table, &r.identity, &decoded, &r.version),
            "a staged digest is its row's"
        );
    }
    Ok(Record {
        table: r.table_id.clone(),
        pk: PrimaryKey {
            field_id: field_id.to_owned(),
            value,
        },
        image: PageRow {
            row: Canonical::stored(r.row.clone()).ok_or_else(|| bad("is damaged"))?,
            checksum: r.digest,
        },
        server_version: r.version.clone(),
    })
}

/// The background sweep (ADR 0009): woken by each rebuild request's server
/// time (the engine reads no clock), it deletes the stages and
/// pages of expired sessions, and forgets sessions swept long ago, in
/// bounded transactions until nothing is left. A failure waits for the
/// next wake. It ends with its rebuilder.
async fn sweep<S: Store>(store: S, mut time: watch::Receiver<i64>) {
    while time.changed().await.is_ok() {
        let now_micros = *time.borrow_and_update();
        while let Ok(handled) = sweep_once(&store, now_micros).await {
            if handled < SWEEP_BATCH as u64 {
                break;
            }
            tokio::task::yield_now().await;
        }
        // The requests of this pause wake one pass, with the latest time.
        tokio::time::sleep(SWEEP_PAUSE).await;
    }
}

/// One bounded sweep transaction: the most sessions either step handled.
async fn sweep_once<S: Store>(store: &S, now_micros: i64) -> Result<u64, StoreError> {
    let mut tx = store.begin().await?;
    let swept = tx.sweep_rebuild_sessions(now_micros, SWEEP_BATCH).await?;
    let forgotten = tx
        .forget_rebuild_sessions(now_micros.saturating_sub(FORGET_AFTER_MICROS), SWEEP_BATCH)
        .await?;
    assert!(
        swept <= SWEEP_BATCH as u64 && forgotten <= SWEEP_BATCH as u64,
        "a sweep never exceeds its bound"
    );
    if swept + forgotten > 0 {
        tx.commit().await?;
    }
    Ok(swept.max(forgotten))
}

/// A version 4 UUID from the store's entropy (MemStore: its seeded RNG).
async fn fresh_session_id<S: Store>(store: &S) -> Result<CanonicalUuid, StoreError> {
    let secret = store.fresh_secret().await?;
    let mut b = [0u8; 16];
    b.copy_from_slice(&secret[..16]);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    CanonicalUuid::from_bytes(b).ok_or_else(|| StoreError::Integrity("a nil session id".into()))
}
