//! MemStore's rebuild sessions: each with its stage.

use std::collections::BTreeMap;
use std::sync::Arc;

use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{CanonicalUuid, ScopeId};

use super::MemTx;
use crate::staging::{RebuildSession, RebuildUsage, StagedRow};
use crate::store::StoreError;

/// One session and what it holds.
#[derive(Clone, Debug)]
struct Held {
    session: RebuildSession,
    /// Immutable once staged; shared by every transaction's copy of the state.
    stage: Arc<Vec<StagedRow>>,
    /// Expired, and its stage deleted.
    swept: bool,
    /// When it was created, by the store's clock.
    created: tokio::time::Instant,
}

/// Every rebuild session, by session ID.
#[derive(Clone, Debug, Default)]
pub(super) struct Rebuilds {
    sessions: BTreeMap<CanonicalUuid, Held>,
    /// Planted bugs: a new attempt supersedes nothing; usage counts nothing;
    /// a page is rendered from the live rows, not the stage.
    pub(super) no_supersede: bool,
    pub(super) blind_usage: bool,
    pub(super) live_pages: bool,
}

impl Rebuilds {
    /// A stream reset: every stage goes, and every session is swept but
    /// remembered, so a replay of its first request is `409`, never a new
    /// session with other pages under the same `rebuild_id`.
    pub(super) fn sweep_all(&mut self) {
        for h in self.sessions.values_mut() {
            h.stage = Arc::new(Vec::new());
            h.swept = true;
        }
    }

    /// Every session of `stream_generation`, with when it was created.
    pub(super) fn begun(
        &self,
        stream_generation: u64,
    ) -> impl Iterator<Item = (&RebuildSession, tokio::time::Instant)> {
        (self.sessions.values())
            .filter(move |h| h.session.stream_generation == stream_generation)
            .map(|h| (&h.session, h.created))
    }

    /// Drops every session of a retired client.
    pub(super) fn forget_client(&mut self, client_id: &str) {
        self.sessions
            .retain(|_, h| h.session.client_id != client_id);
    }

    /// Every session live at `now_micros`, with its owner's user.
    pub(super) fn live(
        &self,
        clients: &BTreeMap<String, crate::store::ClientRecord>,
        now_micros: i64,
    ) -> Vec<LiveSession> {
        (self.sessions.values())
            .filter(|h| !h.swept && h.session.expires_at > now_micros)
            .map(|h| LiveSession {
                client_id: h.session.client_id.clone(),
                user_id: (clients.get(&h.session.client_id))
                    .map_or_else(String::new, |c| c.user_id.clone()),
                scope: h.session.scope.as_str().to_owned(),
                rows: h.stage.len() as u64,
            })
            .collect()
    }
}

/// A live rebuild session as the store holds it (for simulation judges).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LiveSession {
    pub client_id: String,
    pub user_id: String,
    pub scope: String,
    pub rows: u64,
}

fn missing() -> StoreError {
    StoreError::Integrity("no such rebuild session".into())
}

impl MemTx {
    pub(super) fn rebuild_session(
        &self,
        client_id: &str,
        rebuild_id: &CanonicalUuid,
    ) -> Option<RebuildSession> {
        self.work
            .rebuilds
            .sessions
            .values()
            .find(|h| h.session.client_id == client_id && h.session.rebuild_id == *rebuild_id)
            .map(|h| h.session.clone())
    }

    pub(super) fn stage_rebuild(
        &mut self,
        session: &RebuildSession,
        digests: &[(RowIdentity, Digest)],
    ) -> Result<u64, StoreError> {
        let digests: BTreeMap<&RowIdentity, &Digest> =
            digests.iter().map(|(i, d)| (i, d)).collect();
        let c = &self.work.capture;
        let stage = c
            .members
            .range((session.scope.clone(), RowIdentity::from_bytes(Vec::new()))..)
            .take_while(|((s, _), _)| *s == session.scope)
            .enumerate()
            .map(|(ordinal, ((_, identity), table_id))| {
                let p = c
                    .projections
                    .get(&(table_id.clone(), identity.clone()))
                    .ok_or(StoreError::Integrity("a member has no projection".into()))?;
                Ok(StagedRow {
                    ordinal: ordinal as u64,
                    table_id: table_id.clone(),
                    identity: identity.clone(),
                    row: protocol::json::to_canonical_string(&p.row),
                    version: p.version.clone(),
                    digest: digests.get(identity).map_or(p.digest, |d| **d),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        let rows = stage.len() as u64;
        let sessions = &mut self.work.rebuilds.sessions;
        sessions.retain(|_, h| {
            h.session.client_id != session.client_id || h.session.rebuild_id != session.rebuild_id
        });
        sessions.insert(
            session.session_id,
            Held {
                session: session.clone(),
                stage: Arc::new(stage),
                swept: false,
                created: tokio::time::Instant::now(),
            },
        );
        Ok(rows)
    }

    pub(super) fn staged_digests(
        &self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<(RowIdentity, Digest)>, StoreError> {
        Ok(self
            .stage_from(session_id, from, max)
            .map(|r| (r.identity.clone(), r.digest))
            .collect())
    }

    /// At most `max` staged rows of `session_id` from ordinal `from`; none
    /// of a session that is gone (as on PostgreSQL).
    fn stage_from(
        &self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> impl Iterator<Item = &StagedRow> {
        let stage = self
            .work
            .rebuilds
            .sessions
            .get(session_id)
            .map(|h| &h.stage);
        let from = usize::try_from(from).unwrap_or(usize::MAX);
        stage
            .into_iter()
            .flat_map(|s| s.iter())
            .skip(from)
            .take(max)
    }

    pub(super) fn seal_rebuild_session(
        &mut self,
        session_id: &CanonicalUuid,
        digest: &Digest,
    ) -> Result<(), StoreError> {
        let h = self
            .work
            .rebuilds
            .sessions
            .get_mut(session_id)
            .ok_or_else(missing)?;
        h.session.digest = Some(*digest);
        Ok(())
    }

    pub(super) fn staged_rows(
        &self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<StagedRow>, StoreError> {
        let staged = self.stage_from(session_id, from, max).cloned();
        if !self.work.rebuilds.live_pages {
            return Ok(staged.collect());
        }
        // The planted bug: each row as its projection holds it now.
        let live = &self.work.capture.projections;
        Ok(staged
            .map(|mut r| {
                if let Some(p) = live.get(&(r.table_id.clone(), r.identity.clone())) {
                    r.row = protocol::json::to_canonical_string(&p.row);
                    r.version = p.version.clone();
                    r.digest = p.digest;
                }
                r
            })
            .collect())
    }

    pub(super) fn supersede_rebuild_sessions(
        &mut self,
        client_id: &str,
        scope: &ScopeId,
        now_micros: i64,
    ) -> u64 {
        let mut ended = 0;
        if self.work.rebuilds.no_supersede {
            return 0;
        }
        for h in self.work.rebuilds.sessions.values_mut() {
            let s = &mut h.session;
            if s.client_id == client_id
                && s.scope == *scope
                && !h.swept
                && s.expires_at > now_micros
            {
                s.expires_at = now_micros;
                h.stage = Arc::new(Vec::new());
                h.swept = true;
                ended += 1;
            }
        }
        ended
    }

    pub(super) fn rebuild_usage(&self, user_id: &str, now_micros: i64) -> RebuildUsage {
        let mut usage = RebuildUsage::default();
        if self.work.rebuilds.blind_usage {
            return usage;
        }
        for h in self.work.rebuilds.sessions.values() {
            if h.swept || h.session.expires_at <= now_micros {
                continue;
            }
            let rows = h.stage.len() as u64;
            usage.total_rows += rows;
            let owner = self.work.clients.get(&h.session.client_id);
            if owner.is_some_and(|c| c.user_id == user_id) {
                usage.user_rows += rows;
            }
        }
        usage
    }

    pub(super) fn sweep_rebuild_sessions(&mut self, now_micros: i64, max: usize) -> u64 {
        let mut swept = 0;
        for h in self.work.rebuilds.sessions.values_mut() {
            if swept == max {
                break;
            }
            if h.session.expires_at <= now_micros && !h.swept {
                h.stage = Arc::new(Vec::new());
                h.swept = true;
                swept += 1;
            }
        }
        swept as u64
    }

    pub(super) fn forget_rebuild_sessions(&mut self, expired_before: i64, max: usize) -> u64 {
        let sessions = &mut self.work.rebuilds.sessions;
        let forgotten: Vec<CanonicalUuid> = sessions
            .iter()
            .filter(|(_, h)| h.swept && h.session.expires_at <= expired_before)
            .map(|(id, _)| *id)
            .take(max)
            .collect();
        for id in &forgotten {
            sessions.remove(id);
        }
        forgotten.len() as u64
    }
}
