//! What a rebuild keeps (wire spec "Rebuild", ADR 003 "Durable immutable
//! staged rebuild snapshot"): a session bound to one exact rebuild
//! identity and context, and its staged rows in row-identity order. Its
//! pages are not kept: each is rendered from the stage and the session
//! alone, the same bytes every time (ADR 0017). Data only; the rebuild
//! actor decides.

use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{CanonicalUuid, ScopeId, ServerVersion};
use protocol::position::Boundary;

/// A session lives exactly this long after its creation, never extended.
pub const SESSION_LIFETIME_MICROS: i64 = 24 * 60 * 60 * 1_000_000;

/// A swept session is forgotten this long after it expired: until then its
/// `rebuild_id` is answered with 409; after, it starts a new session.
pub const FORGET_AFTER_MICROS: i64 = 30 * SESSION_LIFETIME_MICROS;

/// One rebuild session: the context it was staged in, fixed at creation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RebuildSession {
    pub session_id: CanonicalUuid,
    pub client_id: String,
    pub rebuild_id: CanonicalUuid,
    pub scope: ScopeId,
    pub client_generation: u64,
    pub schema_hash: Digest,
    pub stream_generation: u64,
    pub membership_generation: u64,
    pub retention_generation: u64,
    pub accepted_write_epoch: u64,
    /// The snapshot boundary B.
    pub boundary: Boundary,
    pub page_limit: u16,
    pub expires_at: i64,
    /// The digest of the staged scope, once staging completed.
    pub digest: Option<Digest>,
    /// The keys every page's tokens are issued under: the active ones when
    /// the session was created, so that a page renders the same bytes
    /// after the ring rotates.
    pub cursor_key_id: String,
    pub continuation_key_id: String,
}

impl RebuildSession {
    /// When the session was created: the `issued_at` of every token its
    /// pages carry, however late a page is first answered or replayed.
    pub fn issued_at(&self) -> i64 {
        self.expires_at.saturating_sub(SESSION_LIFETIME_MICROS)
    }
}

/// One staged row, at its place in the stage's row-identity order.
#[derive(Clone, Debug, PartialEq)]
pub struct StagedRow {
    pub ordinal: u64,
    pub table_id: String,
    pub identity: RowIdentity,
    /// The projection's canonical row text (tombstones included); its
    /// primary key field is the record's typed key.
    pub row: String,
    pub version: ServerVersion,
    /// The row digest under the session's manifest.
    pub digest: Digest,
}

/// Rows staged by live rebuild sessions, for the staging budgets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RebuildUsage {
    /// By the sessions of one user's clients.
    pub user_rows: u64,
    /// By every session of the instance.
    pub total_rows: u64,
}
