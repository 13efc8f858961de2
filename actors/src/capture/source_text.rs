//! PostgreSQL's text output form of a column value, turned into the
//! portable wire value. Both stores speak this form: pgoutput sends it, and
//! MemStore keeps its source rows in it, so one conversion serves both.
//!
//! The replication session pins `DateStyle=ISO` and `TimeZone=UTC`, so
//! timestamps arrive as `2026-07-18 14:00:01.5+00`. A form this module does
//! not know (infinity, BC dates, NaN) is not converted: the caller
//! quarantines the transaction instead of inventing a value.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use protocol::json::{self, Number, Value};
use protocol::value::PortableType;

/// The wire value of `text` for a column synced as `ty`; `None` if `text` is
/// not a form this type can take. The caller still validates the result
/// against the field (canonical form, decimal bounds).
pub fn to_wire(ty: PortableType, text: &str) -> Option<Value> {
    Some(match ty {
        PortableType::String => Value::string(text),
        PortableType::Int => Value::Number(Number::from_i64(i64::from(text.parse::<i32>().ok()?))),
        PortableType::Int64 => Value::string(text.parse::<i64>().ok()?.to_string()),
        PortableType::Decimal => Value::string(decimal(text)?),
        PortableType::Float => {
            let v: f64 = text.parse().ok()?;
            if !v.is_finite() {
                return None;
            }
            // -0 has no canonical JSON form (RFC 8785 writes it as 0).
            Value::Number(Number::from_f64(if v == 0.0 { 0.0 } else { v })?)
        }
        PortableType::Boolean => Value::Bool(match text {
            "t" => true,
            "f" => false,
            _ => return None,
        }),
        PortableType::Datetime => {
            let (date, time) = text.strip_suffix("+00")?.split_once(' ')?;
            Value::string(format!("{date}T{}Z", micros(time)?))
        }
        PortableType::Date => Value::string(text),
        PortableType::Time => Value::string(micros(text)?),
        PortableType::Json => Value::string(json::to_canonical_string(
            &json::parse(text.as_bytes()).ok()?,
        )),
        PortableType::Bytes => {
            let hex = text.strip_prefix("\\x")?;
            if hex.len() % 2 != 0 {
                return None;
            }
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
                .collect::<Option<Vec<u8>>>()?;
            Value::string(URL_SAFE_NO_PAD.encode(bytes))
        }
    })
}

/// The PostgreSQL text form of a wire value already valid for `ty`: what
/// PostgreSQL prints for the value it stores, and accepts back as input.
/// `to_wire(ty, from_wire(ty, v))` is `v`. `None` for JSON null or a value
/// of another shape.
pub fn from_wire(ty: PortableType, v: &Value) -> Option<String> {
    Some(match (ty, v) {
        (PortableType::Int | PortableType::Float, Value::Number(n)) => n.lexeme().to_owned(),
        (PortableType::Boolean, Value::Bool(b)) => (if *b { "t" } else { "f" }).to_owned(),
        (PortableType::Datetime, Value::String(s)) => {
            let (date, time) = s.strip_suffix('Z')?.split_once('T')?;
            format!("{date} {}+00", trimmed_time(time))
        }
        (PortableType::Time, Value::String(s)) => trimmed_time(s),
        (PortableType::Bytes, Value::String(s)) => {
            let bytes = URL_SAFE_NO_PAD.decode(s).ok()?;
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            format!("\\x{hex}")
        }
        (_, Value::String(s)) => s.clone(),
        _ => return None,
    })
}

/// `HH:MM:SS.ffffff` as PostgreSQL prints it: trailing fraction zeros dropped.
fn trimmed_time(time: &str) -> String {
    match time.split_once('.') {
        Some((whole, fraction)) => match fraction.trim_end_matches('0') {
            "" => whole.to_owned(),
            kept => format!("{whole}.{kept}"),
        },
        None => time.to_owned(),
    }
}

/// `HH:MM:SS[.f…]` with exactly six fraction digits.
fn micros(time: &str) -> Option<String> {
    let (whole, fraction) = time.split_once('.').unwrap_or((time, ""));
    if whole.len() != 8 || fraction.len() > 6 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(format!("{whole}.{fraction:0<6}"))
}

/// PostgreSQL's numeric text without the scale's trailing zeros.
fn decimal(text: &str) -> Option<String> {
    let digits = text.strip_prefix('-').unwrap_or(text);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return None; // NaN, Infinity
    }
    let Some((_, fraction)) = text.split_once('.') else {
        return Some(text.to_owned());
    };
    let kept = fraction.trim_end_matches('0');
    let int_part = &text[..text.len() - fraction.len() - 1];
    let out = if kept.is_empty() {
        int_part.to_owned()
    } else {
        format!("{int_part}.{kept}")
    };
    Some(if out == "-0" { "0".into() } else { out })
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::value::{FieldType, decode};

    fn wire(ty: PortableType, text: &str) -> Option<String> {
        let v = to_wire(ty, text)?;
        decode(&FieldType::new(ty, false), &v).ok()?;
        Some(json::to_canonical_string(&v))
    }

    #[test]
    fn every_type_converts_from_postgres_text() {
        use PortableType::*;
        let cases: &[(PortableType, &str, Option<&str>)] = &[
            (String, "héllo", Some("\"héllo\"")),
            (Int, "-2147483648", Some("-2147483648")),
            (Int, "2147483648", None),
            (
                Int64,
                "-9223372036854775808",
                Some("\"-9223372036854775808\""),
            ),
            (Decimal, "12.3400", Some("\"12.34\"")),
            (Decimal, "100", Some("\"100\"")),
            (Decimal, "0.00", Some("\"0\"")),
            (Decimal, "-0.50", Some("\"-0.5\"")),
            (Decimal, "NaN", None),
            (Float, "1.5", Some("1.5")),
            (Float, "1e+100", Some("1e+100")),
            (Float, "-0", Some("0")),
            (Float, "Infinity", None),
            (Float, "NaN", None),
            (Boolean, "t", Some("true")),
            (Boolean, "f", Some("false")),
            (Boolean, "true", None),
            (
                Datetime,
                "2026-07-18 14:00:01+00",
                Some("\"2026-07-18T14:00:01.000000Z\""),
            ),
            (
                Datetime,
                "2026-07-18 14:00:01.5+00",
                Some("\"2026-07-18T14:00:01.500000Z\""),
            ),
            (Datetime, "2026-07-18 14:00:01+02", None),
            (Datetime, "infinity", None),
            (Datetime, "0001-01-01 00:00:00+00 BC", None),
            (Date, "2026-07-18", Some("\"2026-07-18\"")),
            (Date, "0001-01-01 BC", None),
            (Time, "14:00:01.123456", Some("\"14:00:01.123456\"")),
            (Time, "14:00:01", Some("\"14:00:01.000000\"")),
            (
                Json,
                "{\"z\": 1, \"a\": [1.0, 2]}",
                Some("\"{\\\"a\\\":[1,2],\\\"z\\\":1}\""),
            ),
            (Json, "{\"a\":1,\"a\":2}", None),
            (Bytes, "\\x00ff10", Some("\"AP8Q\"")),
            (Bytes, "\\x0", None),
            (Bytes, "00ff", None),
        ];
        for (ty, text, want) in cases {
            assert_eq!(wire(*ty, text).as_deref(), *want, "{ty:?} {text}");
            // Every accepted form prints back to itself through the wire value,
            // except the ones PostgreSQL itself normalizes.
            if let Some(v) = to_wire(*ty, text) {
                let back = from_wire(*ty, &v).unwrap();
                assert_eq!(to_wire(*ty, &back), Some(v), "{ty:?} {text}");
            }
        }
    }

    #[test]
    fn wire_values_print_as_postgres_does() {
        use PortableType::*;
        let cases: &[(PortableType, &str, &str)] = &[
            (
                Datetime,
                "\"2026-07-18T14:00:01.000000Z\"",
                "2026-07-18 14:00:01+00",
            ),
            (
                Datetime,
                "\"2026-07-18T14:00:01.500000Z\"",
                "2026-07-18 14:00:01.5+00",
            ),
            (Time, "\"14:00:01.123450\"", "14:00:01.12345"),
            (Boolean, "true", "t"),
            (Int, "-7", "-7"),
            (Int64, "\"-9223372036854775808\"", "-9223372036854775808"),
            (Bytes, "\"AP8Q\"", "\\x00ff10"),
            (Float, "1e+100", "1e+100"),
        ];
        for (ty, wire, text) in cases {
            let v = json::parse(wire.as_bytes()).unwrap();
            assert_eq!(from_wire(*ty, &v).as_deref(), Some(*text), "{ty:?}");
            assert_eq!(to_wire(*ty, text), Some(v), "{ty:?}");
        }
        assert_eq!(from_wire(String, &Value::Null), None);
    }
}
