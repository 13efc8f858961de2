//! Identifiers and opaque strings of the wire contract, each validated once
//! at intake so that holding one proves its form.

use std::fmt;

use crate::limits::{MAX_SCOPE_ID_OCTETS, MAX_SERVER_VERSION_OCTETS};

/// A non-nil UUID that arrived in canonical lowercase hyphenated form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CanonicalUuid(uuid::Uuid);

impl CanonicalUuid {
    /// Parses `s`; `None` unless it is lowercase hyphenated and not nil.
    pub fn parse(s: &str) -> Option<CanonicalUuid> {
        let u = uuid::Uuid::try_parse(s).ok()?;
        let mut buf = uuid::Uuid::encode_buffer();
        (!u.is_nil() && u.hyphenated().encode_lower(&mut buf) == s).then_some(CanonicalUuid(u))
    }

    /// The UUID from raw bytes; `None` for nil.
    pub fn from_bytes(b: [u8; 16]) -> Option<CanonicalUuid> {
        let u = uuid::Uuid::from_bytes(b);
        (!u.is_nil()).then_some(CanonicalUuid(u))
    }

    /// The 16 raw bytes.
    pub fn as_bytes(&self) -> &[u8; 16] {
        self.0.as_bytes()
    }
}

impl fmt::Display for CanonicalUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.hyphenated())
    }
}

/// An opaque row version: 1..=64 printable ASCII octets other than `"` and `\`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServerVersion(String);

impl ServerVersion {
    /// Validates the form; `None` when it could never have been issued.
    pub fn parse(s: &str) -> Option<ServerVersion> {
        let ok = (1..=MAX_SERVER_VERSION_OCTETS).contains(&s.len())
            && s.bytes()
                .all(|b| (0x20..=0x7e).contains(&b) && b != b'"' && b != b'\\');
        ok.then(|| ServerVersion(s.to_owned()))
    }

    /// The token text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A server-declared scope ID: 1..=512 octets.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopeId(String);

impl ScopeId {
    /// Validates the length; whether it names an assigned scope is the engine's question.
    pub fn parse(s: &str) -> Option<ScopeId> {
        (1..=MAX_SCOPE_ID_OCTETS)
            .contains(&s.len())
            .then(|| ScopeId(s.to_owned()))
    }

    /// The ID text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ScopeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_must_be_canonical_and_non_nil() {
        assert!(CanonicalUuid::parse("018f2b5e-7c42-7a1d-9d31-8a95bd674001").is_some());
        for bad in [
            "018F2B5E-7C42-7A1D-9D31-8A95BD674001",
            "018f2b5e7c427a1d9d318a95bd674001",
            "{018f2b5e-7c42-7a1d-9d31-8a95bd674001}",
            "urn:uuid:018f2b5e-7c42-7a1d-9d31-8a95bd674001",
            "00000000-0000-0000-0000-000000000000",
            "018f2b5e-7c42-7a1d-9d31-8a95bd67400",
            "",
        ] {
            assert!(CanonicalUuid::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn server_versions_are_bounded_printable_ascii() {
        assert!(ServerVersion::parse("opaque-row-version-101").is_some());
        assert!(ServerVersion::parse(&"v".repeat(64)).is_some());
        assert!(ServerVersion::parse(" ~").is_some());
        for bad in ["", "a\"b", "a\\b", "é", "a\tb", "\u{7f}"] {
            assert!(ServerVersion::parse(bad).is_none(), "{bad:?}");
        }
        assert!(ServerVersion::parse(&"v".repeat(65)).is_none());
    }
}
