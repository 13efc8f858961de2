//! The token key ring a running process holds, and its rotation (ADR 0025).
//!
//! `synchro keys rotate` stores a new active key per kind and keeps the
//! old ones verify-only, in one store transaction. A running process
//! learns of it two ways: it reloads its ring once it is `RELOAD_AGE` old,
//! so that it issues under the new keys soon; and a refused request that
//! presented a token under a key the ring lacks makes it reload at once,
//! so that a token another process already issued under a new key is
//! never judged forged here. Such requests are bounded per user by the
//! flood gate (ADR 0018), and requests refused at the same moment share
//! one reload.

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use protocol::json::{self, Value};
use protocol::token::{KeyRing, KeyState, TokenKey, TokenKind};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::store::{Store, StoreError, StoreTx};
use crate::stream::load_key_ring;

/// A ring this old is reloaded before the next request uses it.
pub const RELOAD_AGE: Duration = Duration::from_secs(10);

/// Why the ring is refreshed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refresh {
    /// Before a request: only when older than `RELOAD_AGE`.
    Due,
    /// A refused request presented a token under a key the ring lacks.
    Unverified,
}

/// The ring this process verifies and issues with, reloadable.
pub struct SharedKeyRing {
    ring: RwLock<Loaded>,
    /// One reload at a time; a request that waited for another's reload
    /// takes its result.
    reload: Mutex<()>,
}

/// A ring and when it was read.
#[derive(Clone)]
struct Loaded {
    ring: Arc<KeyRing>,
    at: Instant,
}

impl SharedKeyRing {
    /// The ring of `store`, created on the first start of all.
    pub async fn load<S: Store>(store: &S) -> Result<SharedKeyRing, StoreError> {
        let ring = load_key_ring(store).await?;
        Ok(SharedKeyRing {
            ring: RwLock::new(Loaded {
                ring: Arc::new(ring),
                at: Instant::now(),
            }),
            reload: Mutex::new(()),
        })
    }

    fn loaded(&self) -> Loaded {
        self.ring
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The ring as last loaded.
    pub fn get(&self) -> Arc<KeyRing> {
        self.loaded().ring
    }

    /// Reloads the ring from `store` when `why` says so; whether its keys
    /// changed from the ring the caller had. A failed read keeps the ring.
    pub async fn refresh<S: Store>(&self, store: &S, why: Refresh) -> bool {
        let seen = self.loaded();
        // A due reload never waits for another: the request goes on with
        // the ring it has.
        let _one = match why {
            Refresh::Due if seen.at.elapsed() < RELOAD_AGE => return false,
            Refresh::Due => match self.reload.try_lock() {
                Ok(one) => one,
                Err(_) => return false,
            },
            Refresh::Unverified => self.reload.lock().await,
        };
        let now = self.loaded();
        // Another request reloaded while this one waited for it: that read
        // began after this request's token was issued.
        if now.at > seen.at {
            return now.ring.shape() != seen.ring.shape();
        }
        // No timeout of its own: a store that hangs holds the request's
        // own reads as long. (A timeout that dropped the read mid-call
        // made simulated runs non-deterministic.)
        let Ok(fresh) = load_key_ring(store).await else {
            return false;
        };
        let changed = fresh.shape() != seen.ring.shape();
        *self.ring.write().unwrap_or_else(PoisonError::into_inner) = Loaded {
            ring: Arc::new(fresh),
            at: Instant::now(),
        };
        changed
    }
}

/// Whether a request `body` presents a cursor or continuation under a key
/// `ring` lacks: only then can reloading the ring change its answer. Read
/// only after the request was refused, so a valid request never pays for it.
pub fn presents_unknown_key(ring: &KeyRing, body: &[u8]) -> bool {
    fn any_string(v: &Value, f: &impl Fn(&str) -> bool) -> bool {
        match v {
            Value::String(s) => f(s),
            Value::Array(a) => a.iter().any(|v| any_string(v, f)),
            Value::Object(o) => o.values().any(|v| any_string(v, f)),
            _ => false,
        }
    }
    json::parse(body).is_ok_and(|v| any_string(&v, &|s| ring.lacks_key_of(s)))
}

/// Rotates the ring: a new active key per kind, under the next free ID of
/// its kind (`ic-N`, `rc-N`), and every older key verify-only, so that no
/// cursor or continuation issued before becomes forged. The new ring.
pub async fn rotate<S: Store>(store: &S) -> Result<KeyRing, StoreError> {
    let mut secrets = Vec::new();
    for _ in 0..2 {
        secrets.push(store.fresh_secret().await?);
    }
    let mut tx = store.begin().await?;
    let keys = tx.token_keys().await?;
    if keys.is_empty() {
        return Err(StoreError::Integrity(
            "no token keys yet: start the server once first".into(),
        ));
    }
    let fresh: Vec<TokenKey> = [
        (TokenKind::IncrementalCursor, "ic"),
        (TokenKind::RebuildContinuation, "rc"),
    ]
    .into_iter()
    .zip(secrets)
    .map(|((kind, prefix), secret)| TokenKey {
        key_id: next_key_id(&keys, prefix),
        kind,
        state: KeyState::Active,
        secret,
    })
    .collect();
    tx.rotate_token_keys(&fresh).await?;
    let ring = KeyRing::new(tx.token_keys().await?)
        .map_err(|e| StoreError::Integrity(format!("rotated token keys: {e:?}")))?;
    tx.commit().await?;
    Ok(ring)
}

/// `prefix-N` for the least N above every stored `prefix-M`.
fn next_key_id(keys: &[TokenKey], prefix: &str) -> String {
    let last = keys
        .iter()
        .filter_map(|k| k.key_id.strip_prefix(prefix)?.strip_prefix('-'))
        .filter_map(|n| n.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    format!("{prefix}-{}", last + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> TokenKey {
        TokenKey {
            key_id: id.into(),
            kind: TokenKind::IncrementalCursor,
            state: KeyState::VerifyOnly,
            secret: [0; 32],
        }
    }

    #[test]
    fn only_a_request_presenting_a_token_under_an_unknown_key_reloads() {
        let ring = |id: &str| {
            KeyRing::new(vec![
                TokenKey {
                    state: KeyState::Active,
                    ..key(id)
                },
                TokenKey {
                    kind: TokenKind::RebuildContinuation,
                    state: KeyState::Active,
                    ..key("rc-1")
                },
            ])
            .unwrap()
        };
        let (old, new) = (ring("ic-1"), ring("ic-2"));
        let bindings = protocol::token::CursorBindings {
            scope: protocol::token::ScopeBindings {
                stream_generation: 1,
                user_binding: "u".into(),
                client_binding: "c".into(),
                client_generation: 1,
                scope_id: "s".into(),
                schema_hash: protocol::sha256::Digest([0; 32]),
                membership_generation: 1,
                retention_generation: 1,
                issued_at: 0,
            },
            position: protocol::position::StreamPosition::GenerationStart,
        };
        let token = new.issue_cursor(&bindings);
        let body = format!(r#"{{"scopes":{{"s":{{"cursor":"{token}"}}}}}}"#);
        assert!(presents_unknown_key(&old, body.as_bytes()));
        assert!(!presents_unknown_key(&new, body.as_bytes()));
        assert!(!presents_unknown_key(
            &old,
            br#"{"scopes":{"s":{"cursor":null}}}"#
        ));
        assert!(!presents_unknown_key(&old, b"not json"));
    }

    #[test]
    fn the_next_id_follows_the_greatest_of_its_kind() {
        let keys = [key("ic-1"), key("ic-9"), key("rc-3"), key("icx-40")];
        assert_eq!(next_key_id(&keys, "ic"), "ic-10");
        assert_eq!(next_key_id(&keys, "rc"), "rc-4");
        assert_eq!(next_key_id(&[], "rc"), "rc-1");
    }
}
