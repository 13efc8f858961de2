//! Why a bearer credential was refused. Every refusal answers the same `401
//! auth_required`; the reason is for the operator's debug log and for tests,
//! and never carries the credential or any claim's value.

use std::fmt;

/// Why a request has no user.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No credential of the configured kind was presented.
    Missing,
    /// Not a compact JWS, or a header or claim of the wrong shape.
    Malformed,
    /// The header names extensions (`crit`) this server does not implement.
    CriticalExtension,
    /// `alg` is not in the allow-list (`none` never is).
    AlgorithmNotAllowed,
    /// No key answers the token's `kid` and `alg`.
    UnknownKey,
    /// No key that answers verifies the signature.
    BadSignature,
    /// `exp` is missing.
    NoExpiry,
    /// `exp` is past, beyond the leeway.
    Expired,
    /// `nbf` is ahead, beyond the leeway.
    NotYetValid,
    /// `iat` is ahead, beyond the leeway.
    IssuedInFuture,
    /// The token lives longer than `max_lifetime_seconds`.
    LifetimeTooLong,
    /// `iss` is missing or not the configured issuer.
    WrongIssuer,
    /// `aud` is missing or names none of the configured audiences.
    WrongAudience,
    /// The user claim is missing, not a string, empty or too long.
    NoUser,
    /// A static token or upstream header that names no user.
    UnknownCredential,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refusal::Missing => "no credential",
            Refusal::Malformed => "malformed token",
            Refusal::CriticalExtension => "unsupported critical header extension",
            Refusal::AlgorithmNotAllowed => "algorithm not allowed",
            Refusal::UnknownKey => "no key for the token's kid and alg",
            Refusal::BadSignature => "signature does not verify",
            Refusal::NoExpiry => "no exp claim",
            Refusal::Expired => "expired",
            Refusal::NotYetValid => "not valid yet (nbf)",
            Refusal::IssuedInFuture => "issued in the future (iat)",
            Refusal::LifetimeTooLong => "lifetime beyond max_lifetime_seconds",
            Refusal::WrongIssuer => "wrong or missing iss",
            Refusal::WrongAudience => "wrong or missing aud",
            Refusal::NoUser => "no usable user claim",
            Refusal::UnknownCredential => "unknown credential",
        })
    }
}
