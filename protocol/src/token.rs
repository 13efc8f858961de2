//! Opaque server tokens: incremental cursors and rebuild continuations
//! (INTEGRITY.md "Opaque tokens", ADR 003 bindings).
//!
//! `token = PREFIX "." b64url(payload) "." b64url(HMAC-SHA-256(key, D(domain) || payload))`
//! where `payload` is the RFC 8785 JSON object of the bindings.
//!
//! Verification answers only "authentic, here are the bindings" or "forged".
//! Whether authentic bindings are still current (stale) needs server state,
//! so that judgment belongs to the engine.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::ids::CanonicalUuid;
use crate::json::{self, Object, Value};
use crate::limits::MAX_TOKEN_OCTETS;
use crate::members::Members;
use crate::position::{Boundary, StreamPosition};
use crate::sha256::{Digest, domain_hasher};
use crate::wire::PageLimit;

type HmacSha256 = Hmac<Sha256>;

/// The payload format version inside both token kinds.
const TOKEN_VERSION: i64 = 1;

/// The two token kinds; never interchangeable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenKind {
    IncrementalCursor,
    RebuildContinuation,
}

impl TokenKind {
    fn prefix(self) -> &'static str {
        match self {
            TokenKind::IncrementalCursor => "ic1",
            TokenKind::RebuildContinuation => "rc1",
        }
    }

    fn domain(self) -> &'static str {
        match self {
            TokenKind::IncrementalCursor => "synchro:v3:incremental-cursor:v1",
            TokenKind::RebuildContinuation => "synchro:v3:rebuild-continuation:v1",
        }
    }

    fn payload_kind(self) -> &'static str {
        match self {
            TokenKind::IncrementalCursor => "incremental",
            TokenKind::RebuildContinuation => "rebuild",
        }
    }
}

/// Whether a key issues new tokens or only verifies old ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyState {
    Active,
    VerifyOnly,
}

/// One MAC key.
#[derive(Clone)]
pub struct TokenKey {
    pub key_id: String,
    pub kind: TokenKind,
    pub state: KeyState,
    pub secret: [u8; 32],
}

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        write!(
            f,
            "TokenKey({:?}, {:?}, {:?})",
            self.key_id, self.kind, self.state
        )
    }
}

/// A key ring that is not usable as given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRingError {
    /// Each kind needs exactly one active key.
    ActiveKeyCount(TokenKind),
    /// Key IDs must be unique and 1..=64 octets.
    BadKeyId,
}

/// The MAC keys of both token kinds.
#[derive(Clone, Debug)]
pub struct KeyRing {
    keys: Vec<TokenKey>,
}

/// The token is malformed, of the wrong kind, under an unknown key, or its MAC fails.
/// Deliberately carries no detail: the response must not say which check failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Forged;

/// The bindings both token kinds carry (ADR 003 "Incremental cursor bindings").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopeBindings {
    pub stream_generation: u64,
    pub user_binding: String,
    pub client_binding: String,
    pub client_generation: u64,
    pub scope_id: String,
    pub schema_hash: Digest,
    pub membership_generation: u64,
    pub retention_generation: u64,
    /// Microseconds since the Unix epoch.
    pub issued_at: i64,
}

/// Bindings of an incremental cursor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CursorBindings {
    pub scope: ScopeBindings,
    pub position: StreamPosition,
}

/// Bindings of a rebuild continuation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContinuationBindings {
    pub scope: ScopeBindings,
    pub session_id: CanonicalUuid,
    pub rebuild_id: CanonicalUuid,
    pub snapshot_boundary: Boundary,
    pub next_row_ordinal: u64,
    pub page_limit: PageLimit,
    pub accepted_write_epoch: u64,
    /// Exactly 24 hours after session creation, in microseconds since the epoch.
    pub expires_at: i64,
}

/// The kind and the `key_id` a token's payload names, by its prefix and
/// unauthenticated: what a ring would verify it with. `None` for anything
/// that is not shaped like a token.
pub fn named_key(token: &str) -> Option<(TokenKind, String)> {
    if token.len() > MAX_TOKEN_OCTETS {
        return None;
    }
    let mut parts = token.split('.');
    let kind = match parts.next()? {
        "ic1" => TokenKind::IncrementalCursor,
        "rc1" => TokenKind::RebuildContinuation,
        _ => return None,
    };
    let payload = decode_b64(parts.next()?).ok()?;
    match json::parse(&payload).ok()? {
        Value::Object(mut o) => match o.remove("key_id") {
            Some(Value::String(id)) => Some((kind, id)),
            _ => None,
        },
        _ => None,
    }
}

/// The binding that stands for a user inside tokens (no identity in clear).
pub fn user_binding(user_id: &str) -> String {
    binding("synchro:v3:user-binding:v1", &[user_id])
}

/// The binding that stands for a user's client inside tokens.
pub fn client_binding(user_id: &str, client_id: &str) -> String {
    binding("synchro:v3:client-binding:v1", &[user_id, client_id])
}

fn binding(domain: &str, parts: &[&str]) -> String {
    use sha2::Digest as _;
    let mut h = domain_hasher(domain);
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p.as_bytes());
    }
    Digest(h.finalize().into()).to_hex()[..32].to_owned()
}

impl KeyRing {
    /// A ring with unique key IDs and exactly one active key per kind.
    pub fn new(keys: Vec<TokenKey>) -> Result<KeyRing, KeyRingError> {
        for (i, k) in keys.iter().enumerate() {
            let id_ok = (1..=64).contains(&k.key_id.len())
                && k.key_id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !id_ok || keys[..i].iter().any(|o| o.key_id == k.key_id) {
                return Err(KeyRingError::BadKeyId);
            }
        }
        for kind in [TokenKind::IncrementalCursor, TokenKind::RebuildContinuation] {
            let active = keys
                .iter()
                .filter(|k| k.kind == kind && k.state == KeyState::Active)
                .count();
            if active != 1 {
                return Err(KeyRingError::ActiveKeyCount(kind));
            }
        }
        Ok(KeyRing { keys })
    }

    #[allow(clippy::expect_used)]
    fn active(&self, kind: TokenKind) -> &TokenKey {
        self.keys
            .iter()
            .find(|k| k.kind == kind && k.state == KeyState::Active)
            .expect("KeyRing::new proved exactly one active key per kind")
    }

    /// Each key's ID, kind and state, never its secret: what tells two
    /// rings apart.
    pub fn shape(&self) -> Vec<(&str, TokenKind, KeyState)> {
        self.keys
            .iter()
            .map(|k| (k.key_id.as_str(), k.kind, k.state))
            .collect()
    }

    /// The ID of the key that issues new tokens of `kind`.
    pub fn active_key_id(&self, kind: TokenKind) -> &str {
        &self.active(kind).key_id
    }

    /// The ring's key of `kind` named `key_id`, active or verify-only.
    fn named(&self, kind: TokenKind, key_id: &str) -> Option<&TokenKey> {
        self.keys
            .iter()
            .find(|k| k.kind == kind && k.key_id == key_id)
    }

    /// Whether `token` looks like a cursor or continuation (by its prefix)
    /// whose payload names a key this ring lacks: a key rotated in since
    /// the ring was read, or a retired or made-up one. Authenticates nothing.
    pub fn lacks_key_of(&self, token: &str) -> bool {
        named_key(token).is_some_and(|(kind, id)| self.named(kind, &id).is_none())
    }

    /// Issues an incremental cursor under the active cursor key.
    pub fn issue_cursor(&self, b: &CursorBindings) -> String {
        cursor_token(self.active(TokenKind::IncrementalCursor), b)
    }

    /// Issues an incremental cursor under the named cursor key, active or
    /// verify-only: the same bytes every time for the same bindings.
    /// `None` when the ring no longer holds that key.
    pub fn issue_cursor_under(&self, key_id: &str, b: &CursorBindings) -> Option<String> {
        let key = self.named(TokenKind::IncrementalCursor, key_id)?;
        Some(cursor_token(key, b))
    }

    /// Issues a rebuild continuation under the active continuation key.
    pub fn issue_continuation(&self, b: &ContinuationBindings) -> String {
        continuation_token(self.active(TokenKind::RebuildContinuation), b)
    }

    /// Issues a rebuild continuation under the named continuation key,
    /// active or verify-only; `None` when the ring no longer holds it.
    pub fn issue_continuation_under(
        &self,
        key_id: &str,
        b: &ContinuationBindings,
    ) -> Option<String> {
        let key = self.named(TokenKind::RebuildContinuation, key_id)?;
        Some(continuation_token(key, b))
    }

    /// Authenticates an incremental cursor and returns its bindings.
    pub fn verify_cursor(&self, token: &str) -> Result<CursorBindings, Forged> {
        let mut m = self.open(TokenKind::IncrementalCursor, token)?;
        let position = take_position(&mut m)?;
        let scope = take_scope(&mut m)?;
        m.finish().map_err(|_| Forged)?;
        Ok(CursorBindings { scope, position })
    }

    /// Authenticates a rebuild continuation and returns its bindings.
    pub fn verify_continuation(&self, token: &str) -> Result<ContinuationBindings, Forged> {
        let mut m = self.open(TokenKind::RebuildContinuation, token)?;
        let scope = take_scope(&mut m)?;
        let uuid = |m: &mut Members, name| {
            m.take(name)
                .ok()
                .as_ref()
                .and_then(Value::as_str)
                .and_then(CanonicalUuid::parse)
                .ok_or(Forged)
        };
        let session_id = uuid(&mut m, "session_id")?;
        let rebuild_id = uuid(&mut m, "rebuild_id")?;
        let snapshot_boundary = match take_str(&mut m, "snapshot_boundary_kind")?.as_str() {
            "generation_start" => Boundary::GenerationStart,
            "transaction_end" => Boundary::TransactionEnd {
                commit_lsn: take_counter(&mut m, "snapshot_commit_lsn")?,
            },
            _ => return Err(Forged),
        };
        let next_row_ordinal = take_counter(&mut m, "next_row_ordinal")?;
        let page_limit = match m.take("page_limit").map_err(|_| Forged)? {
            Value::Number(n) => n
                .as_exact_i64()
                .and_then(|n| u16::try_from(n).ok())
                .and_then(PageLimit::new)
                .ok_or(Forged)?,
            _ => return Err(Forged),
        };
        let accepted_write_epoch = take_counter(&mut m, "accepted_write_epoch")?;
        let expires_at = take_str(&mut m, "expires_at")?
            .parse()
            .map_err(|_| Forged)?;
        m.finish().map_err(|_| Forged)?;
        Ok(ContinuationBindings {
            scope,
            session_id,
            rebuild_id,
            snapshot_boundary,
            next_row_ordinal,
            page_limit,
            accepted_write_epoch,
            expires_at,
        })
    }

    /// Splits, decodes and authenticates; returns the payload members after `kind`,
    /// `token_version` and `key_id` were checked and taken.
    fn open(&self, kind: TokenKind, token: &str) -> Result<Members, Forged> {
        if token.len() > MAX_TOKEN_OCTETS {
            return Err(Forged);
        }
        let mut parts = token.split('.');
        let (Some(prefix), Some(payload_b64), Some(mac_b64), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Forged);
        };
        if prefix != kind.prefix() {
            return Err(Forged);
        }
        let payload = decode_b64(payload_b64)?;
        let mac = decode_b64(mac_b64)?;
        // The payload is untrusted until the MAC verifies; it is parsed first
        // only to find `key_id`, and the strict parser never panics.
        let value = json::parse(&payload).map_err(|_| Forged)?;
        let key_id = value
            .as_object()
            .and_then(|o| o.get("key_id"))
            .and_then(Value::as_str)
            .ok_or(Forged)?;
        let key = self
            .keys
            .iter()
            .find(|k| k.kind == kind && k.key_id == key_id)
            .ok_or(Forged)?;
        let mut h = HmacSha256::new_from_slice(&key.secret).map_err(|_| Forged)?;
        h.update(kind.domain().as_bytes());
        h.update(&[0]);
        h.update(&payload);
        h.verify_slice(&mac).map_err(|_| Forged)?; // constant time
        // Authentic. Require the canonical payload bytes we would have issued.
        if json::to_canonical(&value) != payload {
            return Err(Forged);
        }
        let mut m = Members::new(value, "token").map_err(|_| Forged)?;
        let kind_ok = take_str(&mut m, "kind")? == kind.payload_kind();
        let version_ok = matches!(m.take("token_version"), Ok(Value::Number(n)) if n.as_exact_i64() == Some(TOKEN_VERSION));
        m.take("key_id").map_err(|_| Forged)?;
        if !(kind_ok && version_ok) {
            return Err(Forged);
        }
        Ok(m)
    }
}

fn decode_b64(s: &str) -> Result<Vec<u8>, Forged> {
    let bytes = URL_SAFE_NO_PAD.decode(s).map_err(|_| Forged)?;
    // Exactly one spelling per token: reject non-canonical trailing bits.
    if URL_SAFE_NO_PAD.encode(&bytes) != s {
        return Err(Forged);
    }
    Ok(bytes)
}

/// An incremental cursor under `key`.
fn cursor_token(key: &TokenKey, b: &CursorBindings) -> String {
    let mut o = common_payload(TokenKind::IncrementalCursor, key);
    put_position(&mut o, &b.position);
    put_scope(&mut o, &b.scope);
    seal(TokenKind::IncrementalCursor, key, &Value::Object(o))
}

/// A rebuild continuation under `key`.
fn continuation_token(key: &TokenKey, b: &ContinuationBindings) -> String {
    let mut o = common_payload(TokenKind::RebuildContinuation, key);
    put_scope(&mut o, &b.scope);
    o.insert("session_id".into(), Value::string(b.session_id.to_string()));
    o.insert("rebuild_id".into(), Value::string(b.rebuild_id.to_string()));
    let (kind, lsn) = match b.snapshot_boundary {
        Boundary::GenerationStart => ("generation_start", None),
        Boundary::TransactionEnd { commit_lsn } => ("transaction_end", Some(commit_lsn)),
    };
    o.insert("snapshot_boundary_kind".into(), Value::string(kind));
    if let Some(lsn) = lsn {
        o.insert("snapshot_commit_lsn".into(), counter(lsn));
    }
    o.insert("next_row_ordinal".into(), counter(b.next_row_ordinal));
    o.insert("page_limit".into(), Value::int(b.page_limit.get() as i64));
    o.insert(
        "accepted_write_epoch".into(),
        counter(b.accepted_write_epoch),
    );
    o.insert("expires_at".into(), Value::string(b.expires_at.to_string()));
    seal(TokenKind::RebuildContinuation, key, &Value::Object(o))
}

#[allow(clippy::expect_used)]
fn seal(kind: TokenKind, key: &TokenKey, payload: &Value) -> String {
    let payload = json::to_canonical(payload);
    let mut h = HmacSha256::new_from_slice(&key.secret).expect("HMAC accepts keys of any length");
    h.update(kind.domain().as_bytes());
    h.update(&[0]);
    h.update(&payload);
    let mac = h.finalize().into_bytes();
    format!(
        "{}.{}.{}",
        kind.prefix(),
        URL_SAFE_NO_PAD.encode(&payload),
        URL_SAFE_NO_PAD.encode(mac)
    )
}

/// Counters that may exceed 2^53 travel as decimal strings.
fn counter(v: u64) -> Value {
    Value::string(v.to_string())
}

fn common_payload(kind: TokenKind, key: &TokenKey) -> Object {
    let mut o = Object::new();
    o.insert("kind".into(), Value::string(kind.payload_kind()));
    o.insert("token_version".into(), Value::int(TOKEN_VERSION));
    o.insert("key_id".into(), Value::string(&key.key_id));
    o
}

fn put_scope(o: &mut Object, b: &ScopeBindings) {
    o.insert("stream_generation".into(), counter(b.stream_generation));
    o.insert("user_binding".into(), Value::string(&b.user_binding));
    o.insert("client_binding".into(), Value::string(&b.client_binding));
    o.insert("client_generation".into(), counter(b.client_generation));
    o.insert("scope_id".into(), Value::string(&b.scope_id));
    o.insert("schema_hash".into(), Value::string(b.schema_hash.to_hex()));
    o.insert(
        "membership_generation".into(),
        counter(b.membership_generation),
    );
    o.insert(
        "retention_generation".into(),
        counter(b.retention_generation),
    );
    o.insert("issued_at".into(), Value::string(b.issued_at.to_string()));
}

fn put_position(o: &mut Object, p: &StreamPosition) {
    let kind = match *p {
        StreamPosition::GenerationStart => "generation_start",
        StreamPosition::Effect {
            commit_lsn,
            event_ordinal,
            effect_ordinal,
        } => {
            o.insert("commit_lsn".into(), counter(commit_lsn));
            o.insert("event_ordinal".into(), counter(event_ordinal));
            o.insert("effect_ordinal".into(), counter(effect_ordinal));
            "effect"
        }
        StreamPosition::TransactionEnd { commit_lsn } => {
            o.insert("commit_lsn".into(), counter(commit_lsn));
            "transaction_end"
        }
    };
    o.insert("position_kind".into(), Value::string(kind));
}

fn take_str(m: &mut Members, name: &'static str) -> Result<String, Forged> {
    match m.take(name) {
        Ok(Value::String(s)) => Ok(s),
        _ => Err(Forged),
    }
}

/// A canonical unsigned decimal string.
fn take_counter(m: &mut Members, name: &'static str) -> Result<u64, Forged> {
    let s = take_str(m, name)?;
    let canonical =
        s == "0" || (!s.starts_with('0') && !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()));
    if !canonical {
        return Err(Forged);
    }
    s.parse().map_err(|_| Forged)
}

fn take_position(m: &mut Members) -> Result<StreamPosition, Forged> {
    Ok(match take_str(m, "position_kind")?.as_str() {
        "generation_start" => StreamPosition::GenerationStart,
        "effect" => StreamPosition::Effect {
            commit_lsn: take_counter(m, "commit_lsn")?,
            event_ordinal: take_counter(m, "event_ordinal")?,
            effect_ordinal: take_counter(m, "effect_ordinal")?,
        },
        "transaction_end" => StreamPosition::TransactionEnd {
            commit_lsn: take_counter(m, "commit_lsn")?,
        },
        _ => return Err(Forged),
    })
}

fn take_scope(m: &mut Members) -> Result<ScopeBindings, Forged> {
    Ok(ScopeBindings {
        stream_generation: take_counter(m, "stream_generation")?,
        user_binding: take_str(m, "user_binding")?,
        client_binding: take_str(m, "client_binding")?,
        client_generation: take_counter(m, "client_generation")?,
        scope_id: take_str(m, "scope_id")?,
        schema_hash: Digest::from_hex(&take_str(m, "schema_hash")?).ok_or(Forged)?,
        membership_generation: take_counter(m, "membership_generation")?,
        retention_generation: take_counter(m, "retention_generation")?,
        issued_at: take_str(m, "issued_at")?.parse().map_err(|_| Forged)?,
    })
}
