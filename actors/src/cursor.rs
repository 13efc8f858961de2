//! Incremental cursors (ADR 003 "Incremental cursor bindings", "Stale
//! versus forged cursor dispatch"): what each presented cursor means, the
//! bindings of a new one, and connect's same-position replacement under
//! the current schema; and rebuild continuations, judged and issued. Pure: the caller supplies the current state.

use protocol::digest::Digest;
use protocol::ids::{CanonicalUuid, ScopeId};
use protocol::position::{Boundary, StreamPosition};
use protocol::token::{
    ContinuationBindings, CursorBindings, KeyRing, ScopeBindings, client_binding, user_binding,
};
use protocol::wire::PageLimit;

use crate::staging::RebuildSession;
use crate::stream::StreamState;

/// Everything an authentic cursor must match to be current.
#[derive(Clone, Debug)]
pub struct CursorContext<'a> {
    pub user_id: &'a str,
    pub client_id: &'a str,
    pub client_generation: u64,
    pub schema_hash: Digest,
    pub stream: StreamState,
    /// The page's boundary: no current cursor is past it.
    pub boundary: Boundary,
    /// Microseconds since the epoch, for new cursors.
    pub now_micros: i64,
}

/// What one presented scope entry asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presented {
    /// `cursor: null`: no usable incremental state.
    Null,
    /// Authentic and current: the scope resumes after this position.
    Valid(StreamPosition),
    /// Authentic, but a lineage it binds is no longer current.
    Stale,
}

/// The cursor is malformed, forged, of the wrong kind, or bound to another
/// user, client or scope: the whole request is 400, with no hint which.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Misbound;

/// Judges one presented cursor of `scope`; `membership_generation` is the
/// scope's current one.
pub fn judge(
    keys: &KeyRing,
    ctx: &CursorContext<'_>,
    scope: &ScopeId,
    membership_generation: u64,
    token: Option<&str>,
) -> Result<Presented, Misbound> {
    let Some(token) = token else {
        return Ok(Presented::Null);
    };
    let b = keys.verify_cursor(token).map_err(|_| Misbound)?;
    let s = &b.scope;
    if s.user_binding != user_binding(ctx.user_id)
        || s.client_binding != client_binding(ctx.user_id, ctx.client_id)
        || s.scope_id != scope.as_str()
    {
        return Err(Misbound);
    }
    // A generation this server never issued yet cannot be authentic.
    if s.client_generation > ctx.client_generation
        || s.stream_generation > ctx.stream.generation
        || s.retention_generation > ctx.stream.retention_generation
    {
        return Err(Misbound);
    }
    let stale = s.client_generation != ctx.client_generation
        || s.stream_generation != ctx.stream.generation
        || s.schema_hash != ctx.schema_hash
        || s.membership_generation != membership_generation
        || s.retention_generation != ctx.stream.retention_generation
        || b.position < ctx.stream.floor
        // Past what this server has materialized (a restored database):
        // the client holds state the stream no longer has (docs/adr/0008).
        || b.position > StreamPosition::from(ctx.boundary);
    Ok(if stale {
        Presented::Stale
    } else {
        Presented::Valid(b.position)
    })
}

/// Connect's compatible unaffected-scope bridge (wire spec "Connect"): an
/// authentic cursor of `scope` issued under the client's installed schema
/// `installed_hash`, every other binding current and its position within
/// the retained stream, re-issued at the same position under the current
/// schema. `None` when anything else about it is stale or misbound: the
/// scope then needs a rebuild.
pub fn bridge(
    keys: &KeyRing,
    ctx: &CursorContext<'_>,
    scope: &ScopeId,
    membership_generation: u64,
    installed_hash: &Digest,
    token: &str,
) -> Option<String> {
    let b = keys.verify_cursor(token).ok()?;
    let s = &b.scope;
    let current = s.user_binding == user_binding(ctx.user_id)
        && s.client_binding == client_binding(ctx.user_id, ctx.client_id)
        && s.scope_id == scope.as_str()
        && s.client_generation == ctx.client_generation
        && s.stream_generation == ctx.stream.generation
        && s.retention_generation == ctx.stream.retention_generation
        && s.membership_generation == membership_generation
        && s.schema_hash == *installed_hash
        && b.position >= ctx.stream.floor
        && b.position <= StreamPosition::from(ctx.boundary);
    current.then(|| issue(keys, ctx, scope, membership_generation, b.position))
}

/// A new cursor of `scope` at `position`, under the context's bindings.
pub fn issue(
    keys: &KeyRing,
    ctx: &CursorContext<'_>,
    scope: &ScopeId,
    membership_generation: u64,
    position: StreamPosition,
) -> String {
    assert!(
        position <= StreamPosition::from(ctx.boundary),
        "a cursor never passes the boundary"
    );
    keys.issue_cursor(&CursorBindings {
        scope: ScopeBindings {
            stream_generation: ctx.stream.generation,
            user_binding: user_binding(ctx.user_id),
            client_binding: client_binding(ctx.user_id, ctx.client_id),
            client_generation: ctx.client_generation,
            scope_id: scope.as_str().to_owned(),
            schema_hash: ctx.schema_hash,
            membership_generation,
            retention_generation: ctx.stream.retention_generation,
            issued_at: ctx.now_micros,
        },
        position,
    })
}

/// What a presented rebuild continuation means, once it is authentic and
/// bound to this request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Continued {
    /// Current: the page of its session at its ordinal.
    Valid(Box<ContinuationBindings>),
    /// Expired, or a lineage or the write epoch it binds moved on: the
    /// rebuild must restart (409 `rebuild_restart_required`).
    Stale,
}

/// The rebuild request a continuation is presented with.
#[derive(Clone, Copy, Debug)]
pub struct ContinuationRequest<'a> {
    pub scope: &'a ScopeId,
    pub rebuild_id: &'a CanonicalUuid,
    pub limit: PageLimit,
    /// The scope's current membership generation.
    pub membership_generation: u64,
    /// The client's current accepted-write epoch.
    pub accepted_write_epoch: u64,
}

/// Judges a presented rebuild continuation (ADR 003 "Rebuild token dispatch
/// and expiry"): forged, malformed, of the wrong kind, bound to another
/// user, client, scope or attempt, or of another page limit is misbound;
/// an authentic one whose session context is no longer current is stale.
pub fn judge_continuation(
    keys: &KeyRing,
    ctx: &CursorContext<'_>,
    req: &ContinuationRequest<'_>,
    token: &str,
) -> Result<Continued, Misbound> {
    let b = keys.verify_continuation(token).map_err(|_| Misbound)?;
    let s = &b.scope;
    if s.user_binding != user_binding(ctx.user_id)
        || s.client_binding != client_binding(ctx.user_id, ctx.client_id)
        || s.scope_id != req.scope.as_str()
        || b.rebuild_id != *req.rebuild_id
        || b.page_limit != req.limit
    {
        return Err(Misbound);
    }
    // A generation or epoch this server never issued yet cannot be authentic.
    if s.client_generation > ctx.client_generation
        || s.stream_generation > ctx.stream.generation
        || s.retention_generation > ctx.stream.retention_generation
        || b.accepted_write_epoch > req.accepted_write_epoch
    {
        return Err(Misbound);
    }
    let stale = s.client_generation != ctx.client_generation
        || s.stream_generation != ctx.stream.generation
        || s.schema_hash != ctx.schema_hash
        || s.membership_generation != req.membership_generation
        || s.retention_generation != ctx.stream.retention_generation
        || b.accepted_write_epoch != req.accepted_write_epoch
        || ctx.now_micros >= b.expires_at;
    Ok(if stale {
        Continued::Stale
    } else {
        Continued::Valid(Box::new(b))
    })
}

/// The continuation to `session`'s page at `next_row_ordinal`: the
/// session's bindings under its continuation key, issued at its creation.
/// `None` when the ring no longer holds that key.
pub fn continuation(
    keys: &KeyRing,
    ctx: &CursorContext<'_>,
    session: &RebuildSession,
    next_row_ordinal: u64,
) -> Option<String> {
    let page_limit = PageLimit::new(session.page_limit)?;
    keys.issue_continuation_under(
        &session.continuation_key_id,
        &ContinuationBindings {
            scope: session_scope(ctx, session),
            session_id: session.session_id,
            rebuild_id: session.rebuild_id,
            snapshot_boundary: session.boundary,
            next_row_ordinal,
            page_limit,
            accepted_write_epoch: session.accepted_write_epoch,
            expires_at: session.expires_at,
        },
    )
}

/// The final page's cursor at the session's boundary: every binding the
/// session's, under its cursor key, issued at its creation, so that the
/// final page is the same bytes whenever it is rendered. `None` when the
/// ring no longer holds the session's key.
pub fn final_cursor(
    keys: &KeyRing,
    ctx: &CursorContext<'_>,
    session: &RebuildSession,
) -> Option<String> {
    let position = StreamPosition::from(session.boundary);
    assert!(
        position <= StreamPosition::from(ctx.boundary),
        "a cursor never passes the boundary"
    );
    keys.issue_cursor_under(
        &session.cursor_key_id,
        &CursorBindings {
            scope: session_scope(ctx, session),
            position,
        },
    )
}

/// The scope bindings of a session's tokens: the session's own, issued at
/// its creation.
fn session_scope(ctx: &CursorContext<'_>, session: &RebuildSession) -> ScopeBindings {
    ScopeBindings {
        stream_generation: session.stream_generation,
        user_binding: user_binding(ctx.user_id),
        client_binding: client_binding(ctx.user_id, ctx.client_id),
        client_generation: session.client_generation,
        scope_id: session.scope.as_str().to_owned(),
        schema_hash: session.schema_hash,
        membership_generation: session.membership_generation,
        retention_generation: session.retention_generation,
        issued_at: session.issued_at(),
    }
}

#[cfg(test)]
mod tests {
    use protocol::token::{KeyState, TokenKey, TokenKind};

    use super::*;

    fn keys() -> KeyRing {
        let key = |id: &str, kind, secret| TokenKey {
            key_id: id.into(),
            kind,
            state: KeyState::Active,
            secret: [secret; 32],
        };
        KeyRing::new(vec![
            key("ic", TokenKind::IncrementalCursor, 1),
            key("rc", TokenKind::RebuildContinuation, 2),
        ])
        .unwrap()
    }

    fn at(lsn: u64) -> StreamPosition {
        StreamPosition::Effect {
            commit_lsn: lsn,
            event_ordinal: 0,
            effect_ordinal: 0,
        }
    }

    #[test]
    fn the_retention_floor_and_the_boundary_make_cursors_stale() {
        let keys = keys();
        let scope = ScopeId::parse("s").unwrap();
        let mut ctx = CursorContext {
            user_id: "u",
            client_id: "c",
            client_generation: 3,
            schema_hash: Digest([5; 32]),
            stream: StreamState::default(),
            boundary: Boundary::TransactionEnd { commit_lsn: 50 },
            now_micros: 0,
        };
        let token = issue(&keys, &ctx, &scope, 1, at(20));
        let judge = |ctx: &CursorContext<'_>| judge(&keys, ctx, &scope, 1, Some(&token));
        assert_eq!(judge(&ctx), Ok(Presented::Valid(at(20))));
        // Ordinary floor movement keeps a cursor at or above the floor...
        ctx.stream.floor = at(20);
        assert_eq!(judge(&ctx), Ok(Presented::Valid(at(20))));
        // ...and makes one below it stale.
        ctx.stream.floor = at(21);
        assert_eq!(judge(&ctx), Ok(Presented::Stale));
        ctx.stream.floor = StreamPosition::GenerationStart;
        // Past the boundary (a restored database): stale.
        ctx.boundary = Boundary::TransactionEnd { commit_lsn: 10 };
        assert_eq!(judge(&ctx), Ok(Presented::Stale));
        ctx.boundary = Boundary::TransactionEnd { commit_lsn: 50 };
        // The membership generation moved on.
        assert_eq!(
            super::judge(&keys, &ctx, &scope, 2, Some(&token)),
            Ok(Presented::Stale)
        );
        // A generation this server never issued is not authentic state.
        ctx.client_generation = 2;
        assert_eq!(judge(&ctx), Err(Misbound));
        ctx.client_generation = 3;
        // Another client, or scope: misbound.
        ctx.client_id = "d";
        assert_eq!(judge(&ctx), Err(Misbound));
        ctx.client_id = "c";
        let other = ScopeId::parse("t").unwrap();
        assert_eq!(
            super::judge(&keys, &ctx, &other, 1, Some(&token)),
            Err(Misbound)
        );
        assert_eq!(
            super::judge(&keys, &ctx, &scope, 1, None),
            Ok(Presented::Null)
        );
    }
}
