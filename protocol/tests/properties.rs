//! Property tests: RFC 8785 output is a fixed point, and number formatting
//! matches ECMAScript for random binary64 values.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests and benches fail loudly

use proptest::prelude::*;
use protocol::json::{self, Number, Value, format_f64};

/// ECMA-262 Number::toString(x) for finite x, written from the spec's steps
/// over Rust std's shortest round-trip digits (an oracle independent of ryu-js).
fn ecmascript_number_to_string(x: f64) -> String {
    if x == 0.0 {
        return "0".into();
    }
    if x < 0.0 {
        return format!("-{}", ecmascript_number_to_string(-x));
    }
    let sci = format!("{x:e}"); // shortest round-trip digits: d[.ddd]e<exp>
    let (mantissa, exp) = sci.split_once('e').unwrap();
    let mut digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut n = exp.parse::<i32>().unwrap() + 1;
    // ECMA-262 Number::toString, note 2: when two shortest digit strings are
    // equally close to the exact value, choose the even one. Rust std does
    // not promise that, so detect a tie from the exact decimal expansion.
    let exact = format!("{x:.800e}");
    let exact_digits: String = exact
        .split_once('e')
        .unwrap()
        .0
        .chars()
        .filter(|c| *c != '.')
        .collect();
    let k = digits.len();
    let rest = &exact_digits[k..];
    if rest.starts_with('5') && rest[1..].bytes().all(|b| b == b'0') {
        let truncated = &exact_digits[..k];
        if truncated.as_bytes()[k - 1].is_multiple_of(2) {
            digits = truncated.to_owned();
        } else {
            // Round the truncated digits up by one unit in the last place.
            let mut bytes = truncated.as_bytes().to_vec();
            let mut i = k;
            loop {
                i -= 1;
                if bytes[i] == b'9' {
                    bytes[i] = b'0';
                    if i == 0 {
                        bytes.insert(0, b'1');
                        n += 1;
                        break;
                    }
                } else {
                    bytes[i] += 1;
                    break;
                }
            }
            digits = String::from_utf8(bytes).unwrap();
        }
        digits = digits.trim_end_matches('0').to_owned();
        assert_eq!(
            format!("{digits}e{}", n - digits.len() as i32)
                .parse::<f64>()
                .unwrap(),
            x,
            "the even tie candidate round-trips"
        );
    }
    let k = digits.len() as i32;
    if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 21 {
        format!("{}.{}", &digits[..n as usize], &digits[n as usize..])
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let e = n - 1;
        let sign = if e >= 0 { "+" } else { "-" };
        let m = if k == 1 {
            digits.clone()
        } else {
            format!("{}.{}", &digits[..1], &digits[1..])
        };
        format!("{m}e{sign}{}", e.abs())
    }
}

#[test]
fn matches_v8_on_recorded_values() {
    // Recorded from node's String(x); see fixtures/make_es_numbers.js.
    for line in include_str!("fixtures/es_numbers.txt").lines() {
        let (bits, expected) = line.split_once(' ').unwrap();
        let x = f64::from_bits(u64::from_str_radix(bits, 16).unwrap());
        assert_eq!(format_f64(x), expected, "{bits}");
        assert_eq!(ecmascript_number_to_string(x), expected, "oracle {bits}");
    }
}

fn finite() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<u64>()
            .prop_map(f64::from_bits)
            .prop_filter("finite", |x| x.is_finite()),
        (-1e6f64..1e6f64),
        (any::<i32>(), -30i32..30).prop_map(|(m, e)| m as f64 * 10f64.powi(e)),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        finite().prop_map(|x| Value::Number(Number::from_f64(x).unwrap())),
        any::<i64>().prop_map(Value::int),
        ".*".prop_map(Value::String),
        "[\\u{0}-\\u{1f}\"\\\\\\u{7f}-\\u{10ffff}]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(".{0,6}", inner, 0..6).prop_map(Value::Object),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn number_formatting_matches_ecmascript(x in finite()) {
        prop_assert_eq!(format_f64(x), ecmascript_number_to_string(x));
        // And it round-trips to the same binary64.
        prop_assert_eq!(format_f64(x).parse::<f64>().unwrap().to_bits(), if x == 0.0 { 0 } else { x.to_bits() });
    }

    #[test]
    fn canonical_output_is_a_fixed_point(v in json_value()) {
        let once = json::to_canonical(&v);
        let reparsed = json::parse(&once).unwrap();
        prop_assert_eq!(&reparsed, &v);
        prop_assert_eq!(json::to_canonical(&reparsed), once);
    }

    #[test]
    fn whitespace_and_spelling_do_not_change_the_canonical_form(v in json_value(), ws in "[ \t\r\n]{0,3}") {
        // Re-spell with whitespace between tokens and non-canonical numbers.
        fn spell(v: &Value, ws: &str, out: &mut String) {
            out.push_str(ws);
            match v {
                Value::Number(n) => out.push_str(&format!("{:e}", n.as_f64())),
                Value::Array(items) => {
                    out.push('[');
                    for (i, item) in items.iter().enumerate() {
                        if i > 0 { out.push(','); }
                        spell(item, ws, out);
                    }
                    out.push_str(ws);
                    out.push(']');
                }
                Value::Object(members) => {
                    out.push('{');
                    for (i, (k, item)) in members.iter().rev().enumerate() {
                        if i > 0 { out.push(','); }
                        out.push_str(ws);
                        let escaped: String = k.chars().map(|c| if c.is_ascii_alphanumeric() { format!("\\u{:04x}", c as u32) } else { c.to_string() }).collect();
                        let mut name = String::new();
                        json::write_value(&Value::String(k.clone()), &mut name);
                        // Escape ASCII letters as \uXXXX when that is still a valid spelling.
                        if !k.contains(['"', '\\']) && !k.chars().any(|c| (c as u32) < 0x20) {
                            name = format!("\"{escaped}\"");
                        }
                        out.push_str(&name);
                        out.push_str(ws);
                        out.push(':');
                        spell(item, ws, out);
                    }
                    out.push_str(ws);
                    out.push('}');
                }
                other => json::write_value(other, out),
            }
            out.push_str(ws);
        }
        let mut text = String::new();
        spell(&v, &ws, &mut text);
        let parsed = json::parse(text.as_bytes()).unwrap();
        prop_assert_eq!(json::to_canonical(&parsed), json::to_canonical(&v));
    }

    #[test]
    fn arbitrary_bytes_never_panic_any_parser(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = json::parse(&bytes);
        let _ = protocol::wire::connect::ConnectRequest::parse(&bytes, None);
        let _ = protocol::wire::push::PushRequest::parse(&bytes);
        let _ = protocol::wire::pull::PullRequest::parse(&bytes);
        let _ = protocol::wire::rebuild::RebuildRequest::parse(&bytes);
    }
}
