//! Cursor and continuation tokens: round trip, tampering, keys and kinds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests and benches fail loudly

use protocol::digest::Digest;
use protocol::ids::CanonicalUuid;
use protocol::position::{Boundary, StreamPosition};
use protocol::token::{
    ContinuationBindings, CursorBindings, Forged, KeyRing, KeyRingError, KeyState, ScopeBindings,
    TokenKey, TokenKind, client_binding, user_binding,
};
use protocol::wire::PageLimit;

fn key(id: &str, kind: TokenKind, state: KeyState, byte: u8) -> TokenKey {
    TokenKey {
        key_id: id.into(),
        kind,
        state,
        secret: [byte; 32],
    }
}

fn ring() -> KeyRing {
    KeyRing::new(vec![
        key("c2", TokenKind::IncrementalCursor, KeyState::Active, 2),
        key("c1", TokenKind::IncrementalCursor, KeyState::VerifyOnly, 1),
        key("r1", TokenKind::RebuildContinuation, KeyState::Active, 3),
    ])
    .unwrap()
}

fn scope(scope_id: &str) -> ScopeBindings {
    ScopeBindings {
        stream_generation: 3,
        user_binding: user_binding("user-1"),
        client_binding: client_binding("user-1", "ios-device-123"),
        client_generation: 4,
        scope_id: scope_id.into(),
        schema_hash: Digest([0x21; 32]),
        membership_generation: 1,
        retention_generation: 2,
        issued_at: 1_784_383_200_000_000,
    }
}

fn cursor() -> CursorBindings {
    CursorBindings {
        scope: scope("documents_user:u_123"),
        position: StreamPosition::Effect {
            commit_lsn: u64::MAX,
            event_ordinal: 2,
            effect_ordinal: 9,
        },
    }
}

fn continuation() -> ContinuationBindings {
    ContinuationBindings {
        scope: scope("documents_shared"),
        session_id: CanonicalUuid::parse("018f2b5e-7c42-7a1d-9d31-8a95bd674999").unwrap(),
        rebuild_id: CanonicalUuid::parse("018f2b5e-7c42-7a1d-9d31-8a95bd674101").unwrap(),
        snapshot_boundary: Boundary::TransactionEnd { commit_lsn: 77 },
        next_row_ordinal: 1000,
        page_limit: PageLimit::new(1000).unwrap(),
        accepted_write_epoch: 12,
        expires_at: 1_784_469_600_000_000,
    }
}

#[test]
fn round_trips() {
    let r = ring();
    for position in [
        StreamPosition::GenerationStart,
        StreamPosition::TransactionEnd { commit_lsn: 5 },
        StreamPosition::Effect {
            commit_lsn: u64::MAX,
            event_ordinal: 2,
            effect_ordinal: 9,
        },
    ] {
        let b = CursorBindings {
            position,
            ..cursor()
        };
        let t = r.issue_cursor(&b);
        assert!(t.starts_with("ic1."));
        assert_eq!(r.verify_cursor(&t), Ok(b));
    }
    for snapshot_boundary in [
        Boundary::GenerationStart,
        Boundary::TransactionEnd { commit_lsn: 77 },
    ] {
        let b = ContinuationBindings {
            snapshot_boundary,
            ..continuation()
        };
        let t = r.issue_continuation(&b);
        assert!(t.starts_with("rc1."));
        assert_eq!(r.verify_continuation(&t), Ok(b));
    }
}

#[test]
fn tokens_hold_no_identity_in_clear() {
    let t = ring().issue_cursor(&cursor());
    let payload = t.split('.').nth(1).unwrap();
    use base64::Engine as _;
    let text = String::from_utf8(
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap();
    assert!(
        !text.contains("user-1") && !text.contains("ios-device-123"),
        "{text}"
    );
    assert_ne!(user_binding("a"), user_binding("b"));
    assert_ne!(client_binding("ab", "c"), client_binding("a", "bc"));
}

#[test]
fn tampering_any_byte_is_forged() {
    let r = ring();
    let t = r.issue_cursor(&cursor());
    let bytes = t.as_bytes();
    for i in 0..bytes.len() {
        for replacement in [b'A', b'_', b'.', b'0'] {
            if bytes[i] == replacement {
                continue;
            }
            let mut changed = bytes.to_vec();
            changed[i] = replacement;
            let changed = String::from_utf8(changed).unwrap();
            assert_eq!(r.verify_cursor(&changed), Err(Forged), "byte {i}");
        }
    }
    assert_eq!(r.verify_cursor(&t[..t.len() - 1]), Err(Forged));
    assert_eq!(r.verify_cursor(&format!("{t}A")), Err(Forged));
    assert_eq!(r.verify_cursor(&format!("{t}.x")), Err(Forged));
    assert_eq!(r.verify_cursor(""), Err(Forged));
    assert_eq!(r.verify_cursor("opaque-incremental-cursor-a"), Err(Forged));
}

#[test]
fn wrong_key_kind_and_unknown_key_are_forged() {
    let r = ring();
    let t = r.issue_cursor(&cursor());
    // Same key id, different secret.
    let other = KeyRing::new(vec![
        key("c2", TokenKind::IncrementalCursor, KeyState::Active, 9),
        key("r1", TokenKind::RebuildContinuation, KeyState::Active, 3),
    ])
    .unwrap();
    assert_eq!(other.verify_cursor(&t), Err(Forged));
    // Unknown key id.
    let rotated_out = KeyRing::new(vec![
        key("c9", TokenKind::IncrementalCursor, KeyState::Active, 2),
        key("r1", TokenKind::RebuildContinuation, KeyState::Active, 3),
    ])
    .unwrap();
    assert_eq!(rotated_out.verify_cursor(&t), Err(Forged));
    // A cursor is not a continuation and vice versa, even re-prefixed.
    assert_eq!(r.verify_continuation(&t), Err(Forged));
    let c = r.issue_continuation(&continuation());
    assert_eq!(r.verify_cursor(&c), Err(Forged));
    assert_eq!(
        r.verify_continuation(&t.replacen("ic1", "rc1", 1)),
        Err(Forged)
    );
    assert_eq!(r.verify_cursor(&c.replacen("rc1", "ic1", 1)), Err(Forged));
}

#[test]
fn verify_only_keys_still_verify_after_rotation() {
    let old = KeyRing::new(vec![
        key("c1", TokenKind::IncrementalCursor, KeyState::Active, 1),
        key("r1", TokenKind::RebuildContinuation, KeyState::Active, 3),
    ])
    .unwrap();
    let t = old.issue_cursor(&cursor());
    assert_eq!(ring().verify_cursor(&t), Ok(cursor()));
    // New tokens use the active key.
    let fresh = ring().issue_cursor(&cursor());
    assert_eq!(old.verify_cursor(&fresh), Err(Forged));
}

#[test]
fn a_named_key_issues_the_same_bytes_after_rotation() {
    let old = KeyRing::new(vec![
        key("c1", TokenKind::IncrementalCursor, KeyState::Active, 1),
        key("r1", TokenKind::RebuildContinuation, KeyState::Active, 3),
    ])
    .unwrap();
    let rotated = ring(); // c1 verify-only, c2 active
    assert_eq!(old.active_key_id(TokenKind::IncrementalCursor), "c1");
    assert_eq!(rotated.active_key_id(TokenKind::IncrementalCursor), "c2");
    // Under a verify-only key: the bytes the key issued while active.
    assert_eq!(
        rotated.issue_cursor_under("c1", &cursor()),
        Some(old.issue_cursor(&cursor()))
    );
    assert_eq!(
        rotated.issue_continuation_under("r1", &continuation()),
        Some(old.issue_continuation(&continuation()))
    );
    // A key the ring no longer holds, or one of the other kind, issues nothing.
    assert_eq!(rotated.issue_cursor_under("c0", &cursor()), None);
    assert_eq!(rotated.issue_cursor_under("r1", &cursor()), None);
    assert_eq!(
        rotated.issue_continuation_under("c2", &continuation()),
        None
    );
}

#[test]
fn key_ring_rules() {
    let c = |id: &str, s| key(id, TokenKind::IncrementalCursor, s, 1);
    let r = |id: &str, s| key(id, TokenKind::RebuildContinuation, s, 1);
    assert_eq!(
        KeyRing::new(vec![r("r1", KeyState::Active)]).unwrap_err(),
        KeyRingError::ActiveKeyCount(TokenKind::IncrementalCursor)
    );
    assert_eq!(
        KeyRing::new(vec![
            c("a", KeyState::Active),
            c("b", KeyState::Active),
            r("r", KeyState::Active)
        ])
        .unwrap_err(),
        KeyRingError::ActiveKeyCount(TokenKind::IncrementalCursor)
    );
    assert_eq!(
        KeyRing::new(vec![c("a", KeyState::Active), r("a", KeyState::Active)]).unwrap_err(),
        KeyRingError::BadKeyId
    );
    assert_eq!(
        KeyRing::new(vec![c("a.b", KeyState::Active), r("r", KeyState::Active)]).unwrap_err(),
        KeyRingError::BadKeyId
    );
    // The secret never shows in debug output.
    assert!(!format!("{:?}", c("a", KeyState::Active)).contains("[1"));
}

#[test]
fn a_ring_tells_a_token_under_a_key_it_lacks() {
    let older = ring();
    let newer = KeyRing::new(vec![
        key("c2", TokenKind::IncrementalCursor, KeyState::VerifyOnly, 2),
        key("c3", TokenKind::IncrementalCursor, KeyState::Active, 4),
        key("r1", TokenKind::RebuildContinuation, KeyState::Active, 3),
    ])
    .unwrap();
    let issued = newer.issue_cursor(&cursor());
    assert!(older.lacks_key_of(&issued), "c3 came after the older ring");
    assert!(!newer.lacks_key_of(&issued));
    let old = older.issue_cursor(&cursor());
    assert!(!older.lacks_key_of(&old));
    assert!(!newer.lacks_key_of(&old), "c2 is verify-only in the newer");
    let continuation = older.issue_continuation(&continuation());
    assert!(!newer.lacks_key_of(&continuation));
    // Whatever is not a token of a known kind names no key.
    for s in ["", "ic1", "ic1.!!.x", "xx1.e30.x", "user:u1", "rc1.e30.x"] {
        assert!(!older.lacks_key_of(s), "{s}");
    }
    // The cursor prefix with the continuation key's ID: another kind's key.
    let forged = issued.replacen("ic1", "rc1", 1);
    assert!(older.lacks_key_of(&forged));
}
