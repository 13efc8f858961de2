//! Arbitrary bytes into every request parser, the JSON intake and the token
//! verifier. None may panic; whatever JSON intake accepts must be a fixed
//! point of canonical serialization.
#![no_main]

use libfuzzer_sys::fuzz_target;
use protocol::json;
use protocol::token::{KeyRing, KeyState, TokenKey, TokenKind};
use protocol::wire::{connect::ConnectRequest, pull::PullRequest, push::PushRequest, rebuild::RebuildRequest};

fuzz_target!(|data: &[u8]| {
    let minimum = semver::Version::new(3, 0, 0);
    let _ = ConnectRequest::parse(data, Some(&minimum));
    let _ = PushRequest::parse(data);
    let _ = PullRequest::parse(data);
    let _ = RebuildRequest::parse(data);
    if let Ok(v) = json::parse(data) {
        let once = json::to_canonical(&v);
        let again = json::to_canonical(&json::parse(&once).expect("canonical output parses"));
        assert_eq!(once, again, "canonical form is a fixed point");
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let key = |id: &str, kind| TokenKey { key_id: id.into(), kind, state: KeyState::Active, secret: [7; 32] };
        let ring = KeyRing::new(vec![
            key("c1", TokenKind::IncrementalCursor),
            key("r1", TokenKind::RebuildContinuation),
        ])
        .expect("valid ring");
        let _ = ring.verify_cursor(text);
        let _ = ring.verify_continuation(text);
    }
});
