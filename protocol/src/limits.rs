//! Every numeric limit of the contract, in one place. Limits are enforced,
//! never clamped: a value outside them is `400 invalid_request`.

/// Largest integer in the portable exact range (2^53 - 1).
pub const MAX_SAFE_INTEGER: u64 = 9_007_199_254_740_991;
/// Largest decoded request body the adapter reads (wire spec, Push limits).
pub const MAX_BODY_OCTETS: usize = 1_048_576;
/// Largest RFC 8785 form of a parsed push request.
pub const MAX_CANONICAL_PUSH_OCTETS: usize = 1_048_576;
/// Mutations per push request.
pub const MAX_MUTATIONS: usize = 1000;
/// Largest RFC 8785 form of one normalized mutation.
pub const MAX_MUTATION_OCTETS: usize = 65_536;
/// Authored columns per mutation.
pub const MAX_COLUMNS: usize = 256;
/// Page limit for pull and rebuild: fixed inclusive range 1..=1000.
pub const MAX_PAGE_LIMIT: u16 = 1000;
/// Longest server_version (and therefore base_version) in octets.
pub const MAX_SERVER_VERSION_OCTETS: usize = 64;

// The limits below are this project's (the spec names no bound); see
// docs/adr/0001-protocol-crate.md. They keep every stored identifier small.

/// Longest client_id, platform and app_version, in octets.
pub const MAX_IDENTIFIER_OCTETS: usize = 256;
/// Longest scope ID, table ID or field ID, in octets.
pub const MAX_SCOPE_ID_OCTETS: usize = 512;
/// Longest opaque cursor, continuation or seed receipt, in octets.
pub const MAX_TOKEN_OCTETS: usize = 4096;
/// Scopes per connect or pull request.
pub const MAX_SCOPES_PER_REQUEST: usize = 10_000;
/// Longest error message, in octets.
pub const MAX_ERROR_MESSAGE_OCTETS: usize = 256;
/// `Retry-After` delay-seconds the adapter sends with 429 and 503.
pub const RETRY_AFTER_SECONDS: u32 = 5;
