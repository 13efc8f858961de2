//! What a PostgreSQL column does with the text a push gives it. No value
//! may be rewritten silently: a column that would store another spelling
//! (a `uuid` in capitals), pad (`char(n)`), cut (`varchar(n)` drops
//! trailing spaces past its length) or round (`real`), or that cannot take
//! the text at all (a NUL, a number out of range, an escaped NUL in JSON),
//! refuses it before the write. Both stores apply this one model; PostgreSQL's own errors remain
//! the backstop for whatever it does not know.

use crate::error::StoreError;

/// Whether a column declared as `column_type` (PostgreSQL's `format_type`
/// with its modifier, e.g. `character(4)`) stores `text`, a value's
/// PostgreSQL text form, and prints back the same wire value.
pub fn keeps_as_given(column_type: &str, text: &str) -> bool {
    // PostgreSQL text cannot hold U+0000 in any type.
    if text.contains('\0') {
        return false;
    }
    let (base, length) = split_modifier(column_type);
    match base {
        "uuid" => is_canonical_uuid(text),
        "smallint" => text.parse::<i16>().is_ok(),
        "integer" => text.parse::<i32>().is_ok(),
        "bigint" => text.parse::<i64>().is_ok(),
        "real" => keeps_float4(text),
        // A fixed length pads a shorter value and cuts trailing spaces of a longer one.
        "character" | "bpchar" => length.is_none_or(|n| text.chars().count() == n),
        "character varying" => length.is_none_or(|n| text.chars().count() <= n),
        // jsonb cannot hold the escaped NUL that JSON text may carry, and a
        // json column's row is read as jsonb by the capture trigger.
        "json" | "jsonb" => !text.contains("\\u0000"),
        _ => true,
    }
}

/// The keys of a request for a key column of `column_type`: a key the
/// column would refuse or store in another spelling names no row a client
/// can ever hold, so the whole request is invalid (`StoreError::Data`, 400).
pub fn check_keys(column_type: &str, keys: &[String]) -> Result<(), StoreError> {
    if keys.iter().all(|k| keeps_as_given(column_type, k)) {
        Ok(())
    } else {
        Err(StoreError::Data(
            "a primary key is not a value its column keeps as given".into(),
        ))
    }
}

/// `character(4)` -> (`character`, Some(4)); `text` -> (`text`, None).
fn split_modifier(column_type: &str) -> (&str, Option<usize>) {
    match column_type
        .strip_suffix(')')
        .and_then(|t| t.split_once('('))
    {
        Some((base, n)) => (base, n.parse().ok()),
        None => (column_type, None),
    }
}

/// Lowercase hyphenated hex: the one form a `uuid` column prints.
fn is_canonical_uuid(text: &str) -> bool {
    let b = text.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(c),
        })
}

/// A `real` keeps a value when the binary32 it stores prints (shortest,
/// as PostgreSQL does) as the same binary64 value.
fn keeps_float4(text: &str) -> bool {
    let Ok(v) = text.parse::<f64>() else {
        return false;
    };
    let stored = v as f32;
    if !stored.is_finite() || (stored == 0.0 && v != 0.0) {
        return false; // out of range, or an underflow PostgreSQL refuses
    }
    format!("{stored}").parse::<f64>() == Ok(v)
}

#[cfg(test)]
mod tests {
    use super::keeps_as_given;

    #[test]
    fn uuid_only_in_its_printed_form() {
        assert!(keeps_as_given(
            "uuid",
            "018f2b5e-7c42-7a1d-9d31-8a95bd6740ab"
        ));
        assert!(keeps_as_given(
            "uuid",
            "00000000-0000-0000-0000-000000000000"
        ));
        for rewritten in [
            "018F2B5E-7C42-7A1D-9D31-8A95BD6740AB",
            "018f2b5e7c427a1d9d318a95bd6740ab",
            "{018f2b5e-7c42-7a1d-9d31-8a95bd6740ab}",
            "not-a-uuid",
        ] {
            assert!(!keeps_as_given("uuid", rewritten), "{rewritten}");
        }
    }

    #[test]
    fn lengths_pad_and_cut() {
        assert!(keeps_as_given("character(4)", "abcd"));
        assert!(!keeps_as_given("character(4)", "ab"));
        assert!(!keeps_as_given("character(4)", "abcd  "));
        assert!(keeps_as_given("character varying(5)", "abcde"));
        assert!(keeps_as_given("character varying(5)", "é"));
        assert!(!keeps_as_given("character varying(5)", "abcde "));
        assert!(keeps_as_given("character varying", "any length at all"));
        assert!(keeps_as_given("text", "any length at all"));
    }

    #[test]
    fn numbers_in_range_and_exact() {
        assert!(keeps_as_given("smallint", "-32768"));
        assert!(!keeps_as_given("smallint", "32768"));
        assert!(!keeps_as_given("integer", "2147483648"));
        assert!(keeps_as_given("bigint", "-9223372036854775808"));
        assert!(keeps_as_given("real", "0.1"));
        assert!(keeps_as_given("real", "1e+21"));
        assert!(keeps_as_given("real", "0.5"));
        assert!(!keeps_as_given("real", "0.123456789"));
        assert!(!keeps_as_given("real", "1e+39"));
        assert!(!keeps_as_given("real", "1e-50"));
        assert!(keeps_as_given("double precision", "0.123456789"));
    }

    #[test]
    fn nul_is_refused_everywhere() {
        for ty in ["text", "character varying(5)", "uuid", "json", "jsonb"] {
            assert!(!keeps_as_given(ty, "a\0b"), "{ty}");
        }
        assert!(!keeps_as_given("json", r#"{"a":"\u0000"}"#));
        assert!(!keeps_as_given("jsonb", r#"{"a":"\u0000"}"#));
        assert!(keeps_as_given("jsonb", r#"{"a":"\u0001"}"#));
    }
}
