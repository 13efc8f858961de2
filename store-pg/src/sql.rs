//! The SQL text helpers every part of the store shares: quoting names and
//! literals, and the integer conversions of stored positions. A leaf: it
//! imports nothing of the store.

use actors::store::StoreError;

/// `"schema"."name"`, each part quoted with its quotes doubled.
pub(crate) fn quote_relation(relation: &str) -> String {
    relation
        .split('.')
        .map(|p| format!("\"{}\"", p.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(".")
}

/// `"column"`, quoted with its quotes doubled.
pub(crate) fn quote_column(column: &str) -> String {
    format!("\"{}\"", column.replace('"', "\"\""))
}

/// A string literal for SQL text (`standard_conforming_strings` is on).
/// Callers pass no NUL: PostgreSQL text cannot hold one.
pub(crate) fn literal(s: &str) -> String {
    debug_assert!(!s.contains('\0'), "a literal never holds NUL");
    format!("'{}'", s.replace('\'', "''"))
}

/// LSNs and ordinals are stored as bigint; PostgreSQL LSNs stay below 2^63.
pub(crate) fn to_i64(v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::Integrity("a position beyond bigint".into()))
}

/// A stored bigint position, which is never negative.
pub(crate) fn to_u64(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| StoreError::Integrity("a negative stored position".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(quote_relation("public.notes"), "\"public\".\"notes\"");
        assert_eq!(quote_relation("a\"b"), "\"a\"\"b\"");
        assert_eq!(literal("it's"), "'it''s'");
        assert!(to_i64(u64::MAX).is_err());
        assert!(to_u64(-1).is_err());
    }
}
