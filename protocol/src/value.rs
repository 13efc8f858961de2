//! Portable values: the 11 types of the wire spec, their one canonical JSON
//! form each, and the typed byte encoding that digests use (INTEGRITY.md).
//!
//! A non-canonical input is rejected, never repaired: there is exactly one
//! wire spelling per value, so a digest over the wire form and a digest over
//! the stored form cannot disagree.

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use crate::json::{self, Number, Value};

/// A portable field type of the manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PortableType {
    String,
    Int,
    Int64,
    Decimal,
    Float,
    Boolean,
    Datetime,
    Date,
    Time,
    Json,
    Bytes,
}

impl PortableType {
    /// Every type, in tag order.
    pub const ALL: [PortableType; 11] = [
        PortableType::String,
        PortableType::Int,
        PortableType::Int64,
        PortableType::Decimal,
        PortableType::Float,
        PortableType::Boolean,
        PortableType::Datetime,
        PortableType::Date,
        PortableType::Time,
        PortableType::Json,
        PortableType::Bytes,
    ];

    /// The manifest and wire name of the type.
    pub fn name(self) -> &'static str {
        match self {
            PortableType::String => "string",
            PortableType::Int => "int",
            PortableType::Int64 => "int64",
            PortableType::Decimal => "decimal",
            PortableType::Float => "float",
            PortableType::Boolean => "boolean",
            PortableType::Datetime => "datetime",
            PortableType::Date => "date",
            PortableType::Time => "time",
            PortableType::Json => "json",
            PortableType::Bytes => "bytes",
        }
    }

    /// The type with the given manifest name.
    pub fn from_name(name: &str) -> Option<PortableType> {
        PortableType::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The one-byte tag of the typed encoding.
    pub fn tag(self) -> u8 {
        match self {
            PortableType::String => 0x01,
            PortableType::Int => 0x02,
            PortableType::Int64 => 0x03,
            PortableType::Decimal => 0x04,
            PortableType::Float => 0x05,
            PortableType::Boolean => 0x06,
            PortableType::Datetime => 0x07,
            PortableType::Date => 0x08,
            PortableType::Time => 0x09,
            PortableType::Json => 0x0a,
            PortableType::Bytes => 0x0b,
        }
    }

    /// Whether a primary key may have this type.
    pub fn is_key_type(self) -> bool {
        matches!(
            self,
            PortableType::String | PortableType::Int | PortableType::Int64
        )
    }
}

/// Declared precision and scale of a decimal field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecimalBounds {
    /// Total significant digits allowed.
    pub precision: u32,
    /// Digits allowed after the decimal point.
    pub scale: u32,
}

/// What a value must satisfy: type, nullability and, for decimals, bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldType {
    pub ty: PortableType,
    pub nullable: bool,
    pub decimal: Option<DecimalBounds>,
}

impl FieldType {
    /// A field type without decimal bounds.
    pub fn new(ty: PortableType, nullable: bool) -> FieldType {
        FieldType {
            ty,
            nullable,
            decimal: None,
        }
    }
}

/// A validated non-null value in its canonical form.
#[derive(Clone, Debug, PartialEq)]
pub enum TypedValue {
    String(String),
    Int(i32),
    Int64(i64),
    /// Canonical decimal text.
    Decimal(String),
    Float(f64),
    Boolean(bool),
    /// Canonical `YYYY-MM-DDTHH:MM:SS.ffffffZ` text.
    Datetime(String),
    /// Canonical `YYYY-MM-DD` text.
    Date(String),
    /// Canonical `HH:MM:SS.ffffff` text.
    Time(String),
    /// RFC 8785 text of the JSON document.
    Json(String),
    Bytes(Vec<u8>),
}

/// Why a value was rejected. Names no value content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueError {
    /// JSON null for a non-nullable field.
    NullNotAllowed,
    /// The JSON kind does not match the type (e.g. a number for a string field).
    WrongJsonKind(PortableType),
    /// The right kind but not the one canonical form or out of range.
    NotCanonical(PortableType),
    /// A decimal with more digits than the field's precision or scale allow.
    DecimalOutOfBounds,
}

impl fmt::Display for ValueError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueError::NullNotAllowed => write!(f, "null is not allowed for this field"),
            ValueError::WrongJsonKind(t) => write!(f, "wrong JSON type for a {} value", t.name()),
            ValueError::NotCanonical(t) => {
                write!(f, "value is not a canonical {} representation", t.name())
            }
            ValueError::DecimalOutOfBounds => {
                write!(f, "decimal exceeds the declared precision or scale")
            }
        }
    }
}

impl std::error::Error for ValueError {}

/// Validates a wire value against a field; `Ok(None)` is SQL NULL.
pub fn decode(field: &FieldType, v: &Value) -> Result<Option<TypedValue>, ValueError> {
    if let Value::Null = v {
        return if field.nullable {
            Ok(None)
        } else {
            Err(ValueError::NullNotAllowed)
        };
    }
    let ty = field.ty;
    let value = decode_non_null(ty, v)?;
    if let (TypedValue::Decimal(text), Some(bounds)) = (&value, field.decimal) {
        check_decimal_bounds(text, bounds)?;
    }
    Ok(Some(value))
}

/// Validates a primary-key wire value of a key type.
pub fn decode_key(ty: PortableType, v: &Value) -> Result<TypedValue, ValueError> {
    if !ty.is_key_type() {
        return Err(ValueError::WrongJsonKind(ty));
    }
    decode_non_null(ty, v)
}

fn decode_non_null(ty: PortableType, v: &Value) -> Result<TypedValue, ValueError> {
    let wrong = ValueError::WrongJsonKind(ty);
    let bad = ValueError::NotCanonical(ty);
    match ty {
        PortableType::Int => {
            let Value::Number(n) = v else {
                return Err(wrong);
            };
            let i = n.as_exact_i64().ok_or(bad)?;
            Ok(TypedValue::Int(i32::try_from(i).map_err(|_| bad)?))
        }
        PortableType::Float => {
            let Value::Number(n) = v else {
                return Err(wrong);
            };
            if !n.is_canonical() {
                return Err(bad);
            }
            Ok(TypedValue::Float(n.as_f64()))
        }
        PortableType::Boolean => match v {
            Value::Bool(b) => Ok(TypedValue::Boolean(*b)),
            _ => Err(wrong),
        },
        _ => {
            let Value::String(s) = v else {
                return Err(wrong);
            };
            decode_text(ty, s).ok_or(bad)
        }
    }
}

/// Decodes a value whose wire form is a JSON string.
fn decode_text(ty: PortableType, s: &str) -> Option<TypedValue> {
    let ok = match ty {
        PortableType::String => return Some(TypedValue::String(s.to_owned())),
        PortableType::Int64 => return parse_int64(s).map(TypedValue::Int64),
        PortableType::Bytes => {
            let bytes = URL_SAFE_NO_PAD.decode(s).ok()?;
            // The engine rejects padding and nonzero trailing bits; re-encoding proves it.
            return (URL_SAFE_NO_PAD.encode(&bytes) == s).then_some(TypedValue::Bytes(bytes));
        }
        PortableType::Json => {
            let doc = json::parse(s.as_bytes()).ok()?;
            let ok = json::to_canonical_string(&doc) == s && integers_are_exact(&doc);
            return ok.then(|| TypedValue::Json(s.to_owned()));
        }
        PortableType::Decimal => is_canonical_decimal(s),
        PortableType::Datetime => is_canonical_datetime(s),
        PortableType::Date => is_canonical_date(s),
        PortableType::Time => is_canonical_time(s),
        PortableType::Int | PortableType::Float | PortableType::Boolean => false,
    };
    if !ok {
        return None;
    }
    let s = s.to_owned();
    Some(match ty {
        PortableType::Decimal => TypedValue::Decimal(s),
        PortableType::Datetime => TypedValue::Datetime(s),
        PortableType::Date => TypedValue::Date(s),
        _ => TypedValue::Time(s),
    })
}

/// Canonical base-10 i64: `0` or `-?[1-9][0-9]*` within range.
fn parse_int64(s: &str) -> Option<i64> {
    let digits = s.strip_prefix('-').unwrap_or(s);
    let canonical = digits == "0" && s == "0"
        || (!digits.is_empty()
            && !digits.starts_with('0')
            && digits.bytes().all(|b| b.is_ascii_digit()));
    if !canonical {
        return None;
    }
    s.parse().ok()
}

/// `0`, or an optional `-`, integer digits without leading zeros, and an
/// optional fraction without trailing zeros; never negative zero.
fn is_canonical_decimal(s: &str) -> bool {
    let body = s.strip_prefix('-').unwrap_or(s);
    let (int, frac) = match body.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (body, None),
    };
    let int_ok = int == "0"
        || (!int.is_empty() && !int.starts_with('0') && int.bytes().all(|b| b.is_ascii_digit()));
    let frac_ok = match frac {
        None => true,
        Some(f) => !f.is_empty() && !f.ends_with('0') && f.bytes().all(|b| b.is_ascii_digit()),
    };
    let negative_zero = s.starts_with('-') && int == "0" && frac.is_none();
    int_ok && frac_ok && !negative_zero
}

fn check_decimal_bounds(text: &str, b: DecimalBounds) -> Result<(), ValueError> {
    let body = text.strip_prefix('-').unwrap_or(text);
    let (int, frac) = body.split_once('.').unwrap_or((body, ""));
    let int_digits = if int == "0" { 0 } else { int.len() };
    let fits = frac.len() as u64 <= b.scale as u64
        && int_digits as u64 <= (b.precision as u64).saturating_sub(b.scale as u64);
    if fits {
        Ok(())
    } else {
        Err(ValueError::DecimalOutOfBounds)
    }
}

fn two_digits(s: &[u8], at: usize) -> Option<u32> {
    let d = s.get(at..at + 2)?;
    if d.iter().all(u8::is_ascii_digit) {
        Some(((d[0] - b'0') * 10 + (d[1] - b'0')) as u32)
    } else {
        None
    }
}

/// A valid Gregorian `YYYY-MM-DD` with year 0001..9999.
fn is_canonical_date(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return false;
    }
    let (Some(hi), Some(lo), Some(month), Some(day)) = (
        two_digits(b, 0),
        two_digits(b, 2),
        two_digits(b, 5),
        two_digits(b, 8),
    ) else {
        return false;
    };
    let year = hi * 100 + lo;
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return false,
    };
    year >= 1 && (1..=days).contains(&day)
}

/// `HH:MM:SS.ffffff` with exactly six fraction digits.
fn is_canonical_time(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() != 15 || b[2] != b':' || b[5] != b':' || b[8] != b'.' {
        return false;
    }
    let fraction_ok = b[9..].iter().all(u8::is_ascii_digit);
    matches!(
        (two_digits(b, 0), two_digits(b, 3), two_digits(b, 6)),
        (Some(h), Some(m), Some(sec)) if h < 24 && m < 60 && sec < 60
    ) && fraction_ok
}

/// Whether every integer of a JSON document is in the portable exact
/// range. In canonical text an integer is a lexeme of digits only (RFC 8785
/// writes integral values below 1e21 that way), and one beyond 2^53 - 1
/// would not keep its value on every reader.
fn integers_are_exact(v: &Value) -> bool {
    match v {
        Value::Number(n) => {
            let integer = !n.lexeme().contains(['.', 'e', 'E']);
            !integer || n.as_f64().abs() <= crate::limits::MAX_SAFE_INTEGER as f64
        }
        Value::Array(items) => items.iter().all(integers_are_exact),
        Value::Object(members) => members.values().all(integers_are_exact),
        _ => true,
    }
}

/// `YYYY-MM-DDTHH:MM:SS.ffffffZ`: UTC, exactly microseconds.
pub fn is_canonical_datetime(s: &str) -> bool {
    s.len() == 27
        && s.is_char_boundary(10)
        && s.is_char_boundary(11)
        && s.is_char_boundary(26)
        && is_canonical_date(&s[..10])
        && &s[10..11] == "T"
        && is_canonical_time(&s[11..26])
        && s.ends_with('Z')
}

impl TypedValue {
    /// The portable type of this value.
    pub fn portable_type(&self) -> PortableType {
        match self {
            TypedValue::String(_) => PortableType::String,
            TypedValue::Int(_) => PortableType::Int,
            TypedValue::Int64(_) => PortableType::Int64,
            TypedValue::Decimal(_) => PortableType::Decimal,
            TypedValue::Float(_) => PortableType::Float,
            TypedValue::Boolean(_) => PortableType::Boolean,
            TypedValue::Datetime(_) => PortableType::Datetime,
            TypedValue::Date(_) => PortableType::Date,
            TypedValue::Time(_) => PortableType::Time,
            TypedValue::Json(_) => PortableType::Json,
            TypedValue::Bytes(_) => PortableType::Bytes,
        }
    }

    /// The canonical wire form.
    pub fn to_wire(&self) -> Value {
        match self {
            TypedValue::String(s)
            | TypedValue::Decimal(s)
            | TypedValue::Datetime(s)
            | TypedValue::Date(s)
            | TypedValue::Time(s)
            | TypedValue::Json(s) => Value::String(s.clone()),
            TypedValue::Int(i) => Value::int(*i as i64),
            TypedValue::Int64(i) => Value::String(i.to_string()),
            // Finite by construction: decode only admits finite numbers.
            TypedValue::Float(f) => Number::from_f64(*f).map_or(Value::Null, Value::Number),
            TypedValue::Boolean(b) => Value::Bool(*b),
            TypedValue::Bytes(b) => Value::String(URL_SAFE_NO_PAD.encode(b)),
        }
    }

    /// Appends `tag || 0x01 || payload` (INTEGRITY.md "Typed values").
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.portable_type().tag());
        out.push(0x01);
        match self {
            TypedValue::String(s)
            | TypedValue::Decimal(s)
            | TypedValue::Datetime(s)
            | TypedValue::Date(s)
            | TypedValue::Time(s)
            | TypedValue::Json(s) => blob(s.as_bytes(), out),
            TypedValue::Int(i) => out.extend_from_slice(&i.to_be_bytes()),
            TypedValue::Int64(i) => out.extend_from_slice(&i.to_be_bytes()),
            TypedValue::Float(f) => out.extend_from_slice(&f.to_bits().to_be_bytes()),
            TypedValue::Boolean(b) => out.push(u8::from(*b)),
            TypedValue::Bytes(b) => blob(b, out),
        }
    }
}

/// Appends the typed encoding of a field value; `None` is SQL NULL (`tag || 0x00`).
pub fn encode_field(ty: PortableType, value: Option<&TypedValue>, out: &mut Vec<u8>) {
    match value {
        Some(v) => {
            debug_assert_eq!(v.portable_type(), ty, "value type must match its field");
            v.encode(out);
        }
        None => {
            out.push(ty.tag());
            out.push(0x00);
        }
    }
}

/// `blob(x) = u64be(len(x)) || x`.
pub fn blob(x: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(x.len() as u64).to_be_bytes());
    out.extend_from_slice(x);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(ty: PortableType) -> FieldType {
        FieldType::new(ty, false)
    }

    fn wire(text: &str) -> Value {
        json::parse(text.as_bytes()).unwrap()
    }

    fn accepts(ty: PortableType, text: &str) -> TypedValue {
        let v = decode(&field(ty), &wire(text))
            .unwrap_or_else(|e| panic!("{} {text}: {e}", ty.name()))
            .unwrap();
        // The canonical wire form round-trips to the same bytes.
        assert_eq!(
            json::to_canonical_string(&v.to_wire()),
            json::to_canonical_string(&wire(text))
        );
        v
    }

    fn rejects(ty: PortableType, text: &str) {
        assert!(
            decode(&field(ty), &wire(text)).is_err(),
            "{} accepted {text}",
            ty.name()
        );
    }

    #[test]
    fn null_presence_for_every_type() {
        for ty in PortableType::ALL {
            assert_eq!(decode(&FieldType::new(ty, true), &Value::Null), Ok(None));
            assert_eq!(
                decode(&FieldType::new(ty, false), &Value::Null),
                Err(ValueError::NullNotAllowed)
            );
            let mut out = Vec::new();
            encode_field(ty, None, &mut out);
            assert_eq!(out, [ty.tag(), 0x00]);
        }
    }

    #[test]
    fn string_values() {
        accepts(PortableType::String, r#""""#);
        accepts(PortableType::String, r#""e\u0301 😀""#);
        // No normalization: NFC and NFD spellings stay distinct.
        assert_ne!(
            accepts(PortableType::String, r#""é""#),
            accepts(PortableType::String, r#""e\u0301""#)
        );
        rejects(PortableType::String, "1");
        rejects(PortableType::String, "true");
    }

    #[test]
    fn int_values() {
        assert_eq!(accepts(PortableType::Int, "0"), TypedValue::Int(0));
        assert_eq!(
            accepts(PortableType::Int, "-2147483648"),
            TypedValue::Int(i32::MIN)
        );
        assert_eq!(
            accepts(PortableType::Int, "2147483647"),
            TypedValue::Int(i32::MAX)
        );
        for bad in [
            "1.0",
            "1e2",
            "-0",
            "2147483648",
            "-2147483649",
            "\"1\"",
            "0.5",
        ] {
            rejects(PortableType::Int, bad);
        }
    }

    #[test]
    fn int64_values() {
        assert_eq!(accepts(PortableType::Int64, r#""0""#), TypedValue::Int64(0));
        assert_eq!(
            accepts(PortableType::Int64, r#""-9223372036854775808""#),
            TypedValue::Int64(i64::MIN)
        );
        assert_eq!(
            accepts(PortableType::Int64, r#""9223372036854775807""#),
            TypedValue::Int64(i64::MAX)
        );
        for bad in [
            r#""01""#,
            r#""-0""#,
            r#""+1""#,
            r#""""#,
            r#""-""#,
            r#""1.0""#,
            r#""9223372036854775808""#,
            r#"" 1""#,
            "1",
        ] {
            rejects(PortableType::Int64, bad);
        }
    }

    #[test]
    fn decimal_values() {
        for ok in [
            r#""0""#,
            r#""1.23""#,
            r#""-0.5""#,
            r#""10""#,
            r#""-12.000001""#,
            r#""0.1""#,
        ] {
            accepts(PortableType::Decimal, ok);
        }
        for bad in [
            r#""1.230""#,
            r#""1e2""#,
            r#""01""#,
            r#""-0""#,
            r#""+1""#,
            r#""1.""#,
            r#"".5""#,
            r#""0.0""#,
            r#""""#,
            "1.5",
            r#""1,5""#,
        ] {
            rejects(PortableType::Decimal, bad);
        }
        let bounded = FieldType {
            ty: PortableType::Decimal,
            nullable: false,
            decimal: Some(DecimalBounds {
                precision: 5,
                scale: 2,
            }),
        };
        assert!(decode(&bounded, &wire(r#""999.99""#)).is_ok());
        assert!(decode(&bounded, &wire(r#""0.01""#)).is_ok());
        assert_eq!(
            decode(&bounded, &wire(r#""1000""#)),
            Err(ValueError::DecimalOutOfBounds)
        );
        assert_eq!(
            decode(&bounded, &wire(r#""1.001""#)),
            Err(ValueError::DecimalOutOfBounds)
        );
    }

    #[test]
    fn float_values() {
        assert_eq!(accepts(PortableType::Float, "1.5"), TypedValue::Float(1.5));
        accepts(PortableType::Float, "1");
        accepts(PortableType::Float, "1e+21");
        accepts(PortableType::Float, "1e-7");
        accepts(PortableType::Float, "-0.1");
        for bad in [
            "1.0",
            "-0",
            "1.50",
            "1E+21",
            "1e21",
            "0.0000001",
            "\"1.5\"",
            "100e0",
        ] {
            rejects(PortableType::Float, bad);
        }
    }

    #[test]
    fn boolean_values() {
        assert_eq!(
            accepts(PortableType::Boolean, "true"),
            TypedValue::Boolean(true)
        );
        accepts(PortableType::Boolean, "false");
        rejects(PortableType::Boolean, "1");
        rejects(PortableType::Boolean, r#""true""#);
    }

    #[test]
    fn temporal_values() {
        accepts(PortableType::Datetime, r#""2026-07-18T14:00:00.000000Z""#);
        accepts(PortableType::Datetime, r#""2024-02-29T23:59:59.999999Z""#);
        for bad in [
            r#""2026-07-18T14:00:00.000000+00:00""#,
            r#""2026-07-18T14:00:00Z""#,
            r#""2026-07-18T14:00:00.00000Z""#,
            r#""2026-07-18 14:00:00.000000Z""#,
            r#""2026-07-18t14:00:00.000000Z""#,
            r#""2023-02-29T00:00:00.000000Z""#,
            r#""2026-07-18T24:00:00.000000Z""#,
            r#""2026-07-18T14:60:00.000000Z""#,
            r#""2026-07-18T14:00:60.000000Z""#,
        ] {
            rejects(PortableType::Datetime, bad);
        }
        accepts(PortableType::Date, r#""2000-02-29""#);
        accepts(PortableType::Date, r#""0001-01-01""#);
        for bad in [
            r#""1900-02-29""#,
            r#""2026-13-01""#,
            r#""2026-04-31""#,
            r#""0000-01-01""#,
            r#""2026-7-18""#,
            r#""20260718""#,
        ] {
            rejects(PortableType::Date, bad);
        }
        accepts(PortableType::Time, r#""00:00:00.000000""#);
        accepts(PortableType::Time, r#""23:59:59.999999""#);
        for bad in [
            r#""14:00:00.00000""#,
            r#""14:00:00""#,
            r#""24:00:00.000000""#,
            r#""14:00:00.0000000""#,
            r#""14:00:00,000000""#,
        ] {
            rejects(PortableType::Time, bad);
        }
    }

    #[test]
    fn json_values() {
        accepts(PortableType::Json, r#""{\"a\":2,\"z\":1}""#);
        accepts(PortableType::Json, r#""null""#);
        accepts(PortableType::Json, r#""[1,\"x\"]""#);
        for bad in [
            r#""{\"z\":1,\"a\":2}""#,
            r#""{\"a\": 2}""#,
            r#""1.0""#,
            r#""{\"a\":1,\"a\":1}""#,
            r#""""#,
            r#""nul""#,
            r#"{"a":1}"#,
        ] {
            rejects(PortableType::Json, bad);
        }
    }

    #[test]
    fn bytes_values() {
        assert_eq!(
            accepts(PortableType::Bytes, r#""AQ""#),
            TypedValue::Bytes(vec![1])
        );
        accepts(PortableType::Bytes, r#""""#);
        accepts(PortableType::Bytes, r#""_-8""#);
        for bad in [
            r#""AQ==""#,
            r#""AR""#,
            r#""A""#,
            r#""+/8""#,
            r#""AQ=""#,
            r#"" AQ""#,
        ] {
            rejects(PortableType::Bytes, bad);
        }
    }

    #[test]
    fn typed_encoding_bytes() {
        let mut out = Vec::new();
        TypedValue::String("ab".into()).encode(&mut out);
        assert_eq!(out, [0x01, 0x01, 0, 0, 0, 0, 0, 0, 0, 2, b'a', b'b']);
        out.clear();
        TypedValue::Int(-2).encode(&mut out);
        assert_eq!(out, [0x02, 0x01, 0xff, 0xff, 0xff, 0xfe]);
        out.clear();
        TypedValue::Int64(1).encode(&mut out);
        assert_eq!(out, [0x03, 0x01, 0, 0, 0, 0, 0, 0, 0, 1]);
        out.clear();
        TypedValue::Float(1.0).encode(&mut out);
        assert_eq!(out, [0x05, 0x01, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0]);
        out.clear();
        TypedValue::Boolean(true).encode(&mut out);
        assert_eq!(out, [0x06, 0x01, 0x01]);
        out.clear();
        TypedValue::Bytes(vec![0xff]).encode(&mut out);
        assert_eq!(out, [0x0b, 0x01, 0, 0, 0, 0, 0, 0, 0, 1, 0xff]);
        out.clear();
        TypedValue::Decimal("1.5".into()).encode(&mut out);
        assert_eq!(out, [0x04, 0x01, 0, 0, 0, 0, 0, 0, 0, 3, b'1', b'.', b'5']);
    }

    #[test]
    fn keys_are_only_string_int_int64() {
        assert_eq!(
            decode_key(PortableType::Int, &wire("7")),
            Ok(TypedValue::Int(7))
        );
        assert!(decode_key(PortableType::Int, &Value::Null).is_err());
        assert!(decode_key(PortableType::Decimal, &wire(r#""1""#)).is_err());
        assert!(decode_key(PortableType::Float, &wire("1")).is_err());
    }

    #[test]
    fn client_versions_are_canonical_datetimes() {
        assert!(is_canonical_datetime("2026-07-18T13:59:01.000000Z"));
        assert!(!is_canonical_datetime("2026-07-18T13:59:01Z"));
        assert!(!is_canonical_datetime("2026-07-18T13:59:01.1Z"));
        assert!(!is_canonical_datetime("2026-07-18T13:59:01.000000+00:00"));
        assert!(!is_canonical_datetime("2026-07-18 13:59:01.000000Z"));
        assert!(!is_canonical_datetime("2026-02-30T13:59:01.000000Z"));
    }

    #[test]
    fn json_content_keeps_integers_exact() {
        let json = FieldType::new(PortableType::Json, false);
        assert!(decode(&json, &wire(r#""{\"n\":9007199254740991}""#)).is_ok());
        assert!(decode(&json, &wire(r#""{\"n\":-9007199254740991}""#)).is_ok());
        assert!(decode(&json, &wire(r#""[9007199254740992]""#)).is_err());
        assert!(decode(&json, &wire(r#""{\"a\":{\"n\":-9007199254740992}}""#)).is_err());
        // Not integers in canonical text: fractions and exponent forms stay.
        assert!(decode(&json, &wire(r#""[0.5,1e+21]""#)).is_ok());
    }
}
