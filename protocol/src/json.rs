//! Strict JSON intake and RFC 8785 (JCS) canonical output.
//!
//! The wire contract needs more than a general JSON parser gives: duplicate
//! member names are rejected at every depth, the exact number lexeme is kept
//! (so `1` and `1.0` differ and a float's canonical form can be checked),
//! numbers must be finite binary64, and nesting is bounded so that hostile
//! input cannot exhaust the stack. serde_json offers these only through its
//! private `arbitrary_precision` map, so intake is a small recursive-descent
//! parser here; number formatting uses `ryu-js` (ECMAScript `Number.toString`).

use std::collections::BTreeMap;
use std::fmt;

/// Deepest nesting of arrays and objects accepted; protocol envelopes use at most 6.
pub const MAX_DEPTH: usize = 64;

/// A parsed JSON value with exact number lexemes and unique object members.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Number(Number),
    String(String),
    Array(Vec<Value>),
    Object(Object),
}

/// An object whose member names are unique (duplicates are rejected at intake).
pub type Object = BTreeMap<String, Value>;

/// A JSON number: a valid lexeme whose binary64 value is finite.
#[derive(Clone, Debug)]
pub struct Number {
    lexeme: Box<str>,
    value: f64,
}

impl PartialEq for Number {
    /// Numbers are equal when their binary64 values are (JCS writes them identically).
    fn eq(&self, other: &Self) -> bool {
        self.value.to_bits() == other.value.to_bits() || (self.value == 0.0 && other.value == 0.0)
    }
}

impl Number {
    /// A number from an integer; exact when `|v| <= 2^53`.
    pub fn from_i64(v: i64) -> Number {
        Number {
            lexeme: v.to_string().into(),
            value: v as f64,
        }
    }

    /// A number from a finite binary64 value; `None` for NaN and infinities.
    pub fn from_f64(v: f64) -> Option<Number> {
        if !v.is_finite() {
            return None;
        }
        Some(Number {
            lexeme: format_f64(v).into(),
            value: v,
        })
    }

    /// The lexeme exactly as received (or as formatted when constructed).
    pub fn lexeme(&self) -> &str {
        &self.lexeme
    }

    /// The binary64 value (round-to-nearest-even from the lexeme); always finite.
    pub fn as_f64(&self) -> f64 {
        self.value
    }

    /// The value when the lexeme is a plain integer: no fraction, no exponent,
    /// no negative zero, within `i64`.
    pub fn as_exact_i64(&self) -> Option<i64> {
        let s = self.lexeme();
        if s == "-0" || s.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
            return None;
        }
        s.parse().ok()
    }

    /// Whether the lexeme is already the RFC 8785 form of its value.
    pub fn is_canonical(&self) -> bool {
        *self.lexeme == *format_f64(self.value)
    }
}

/// ECMAScript `Number.prototype.toString` of a finite value (RFC 8785 §3.2.2.3).
pub fn format_f64(v: f64) -> String {
    debug_assert!(v.is_finite());
    if v == 0.0 {
        return "0".to_owned(); // covers -0
    }
    ryu_js::Buffer::new().format_finite(v).to_owned()
}

/// Why intake rejected a byte string. Carries no input content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JsonError {
    InvalidUtf8,
    UnexpectedEnd,
    UnexpectedByte { offset: usize },
    InvalidEscape { offset: usize },
    LoneSurrogate { offset: usize },
    ControlCharacter { offset: usize },
    InvalidNumber { offset: usize },
    NumberOutOfRange { offset: usize },
    DuplicateMember { offset: usize },
    TooDeep { offset: usize },
    TrailingBytes { offset: usize },
}

impl fmt::Display for JsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsonError::InvalidUtf8 => write!(f, "request body is not valid UTF-8"),
            JsonError::UnexpectedEnd => write!(f, "request body ends inside a JSON value"),
            JsonError::UnexpectedByte { offset } => write!(f, "unexpected byte at offset {offset}"),
            JsonError::InvalidEscape { offset } => {
                write!(f, "invalid string escape at offset {offset}")
            }
            JsonError::LoneSurrogate { offset } => {
                write!(f, "lone surrogate escape at offset {offset}")
            }
            JsonError::ControlCharacter { offset } => {
                write!(f, "unescaped control character at offset {offset}")
            }
            JsonError::InvalidNumber { offset } => write!(f, "invalid number at offset {offset}"),
            JsonError::NumberOutOfRange { offset } => {
                write!(
                    f,
                    "number at offset {offset} is not a finite binary64 value"
                )
            }
            JsonError::DuplicateMember { offset } => {
                write!(f, "duplicate object member name at offset {offset}")
            }
            JsonError::TooDeep { offset } => write!(f, "nesting too deep at offset {offset}"),
            JsonError::TrailingBytes { offset } => {
                write!(f, "trailing bytes after the JSON value at offset {offset}")
            }
        }
    }
}

impl std::error::Error for JsonError {}

/// Parses exactly one JSON value (surrounded by optional whitespace) from `bytes`.
pub fn parse(bytes: &[u8]) -> Result<Value, JsonError> {
    let text = std::str::from_utf8(bytes).map_err(|_| JsonError::InvalidUtf8)?;
    let mut p = Parser {
        s: text.as_bytes(),
        text,
        i: 0,
    };
    p.skip_ws();
    let v = p.value(0)?;
    p.skip_ws();
    if p.i != p.s.len() {
        return Err(JsonError::TrailingBytes { offset: p.i });
    }
    Ok(v)
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn expect(&mut self, b: u8) -> Result<(), JsonError> {
        match self.peek() {
            Some(c) if c == b => {
                self.i += 1;
                Ok(())
            }
            Some(_) => Err(JsonError::UnexpectedByte { offset: self.i }),
            None => Err(JsonError::UnexpectedEnd),
        }
    }

    fn literal(&mut self, word: &[u8], v: Value) -> Result<Value, JsonError> {
        for &b in word {
            self.expect(b)?;
        }
        Ok(v)
    }

    fn value(&mut self, depth: usize) -> Result<Value, JsonError> {
        match self.peek() {
            None => Err(JsonError::UnexpectedEnd),
            Some(b'n') => self.literal(b"null", Value::Null),
            Some(b't') => self.literal(b"true", Value::Bool(true)),
            Some(b'f') => self.literal(b"false", Value::Bool(false)),
            Some(b'"') => Ok(Value::String(self.string()?)),
            Some(b'-' | b'0'..=b'9') => Ok(Value::Number(self.number()?)),
            Some(b'[') => self.array(depth + 1),
            Some(b'{') => self.object(depth + 1),
            Some(_) => Err(JsonError::UnexpectedByte { offset: self.i }),
        }
    }

    fn array(&mut self, depth: usize) -> Result<Value, JsonError> {
        if depth > MAX_DEPTH {
            return Err(JsonError::TooDeep { offset: self.i });
        }
        self.i += 1; // '['
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(Value::Array(items));
        }
        loop {
            self.skip_ws();
            items.push(self.value(depth)?);
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(Value::Array(items));
                }
                Some(_) => return Err(JsonError::UnexpectedByte { offset: self.i }),
                None => return Err(JsonError::UnexpectedEnd),
            }
        }
    }

    fn object(&mut self, depth: usize) -> Result<Value, JsonError> {
        if depth > MAX_DEPTH {
            return Err(JsonError::TooDeep { offset: self.i });
        }
        self.i += 1; // '{'
        let mut members = Object::new();
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(Value::Object(members));
        }
        loop {
            self.skip_ws();
            let at = self.i;
            if self.peek() != Some(b'"') {
                return match self.peek() {
                    None => Err(JsonError::UnexpectedEnd),
                    Some(_) => Err(JsonError::UnexpectedByte { offset: at }),
                };
            }
            let name = self.string()?;
            self.skip_ws();
            self.expect(b':')?;
            self.skip_ws();
            let v = self.value(depth)?;
            if members.insert(name, v).is_some() {
                return Err(JsonError::DuplicateMember { offset: at });
            }
            self.skip_ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(Value::Object(members));
                }
                Some(_) => return Err(JsonError::UnexpectedByte { offset: self.i }),
                None => return Err(JsonError::UnexpectedEnd),
            }
        }
    }

    fn hex4(&mut self) -> Result<u16, JsonError> {
        let at = self.i;
        let digits = self
            .s
            .get(self.i..self.i + 4)
            .ok_or(JsonError::UnexpectedEnd)?;
        let mut v: u16 = 0;
        for &d in digits {
            let n = (d as char)
                .to_digit(16)
                .ok_or(JsonError::InvalidEscape { offset: at })?;
            v = (v << 4) | n as u16;
        }
        self.i += 4;
        Ok(v)
    }

    fn string(&mut self) -> Result<String, JsonError> {
        self.i += 1; // opening quote
        let mut out = String::new();
        loop {
            // Copy the longest run that needs no decoding in one step.
            let start = self.i;
            while let Some(b) = self.peek() {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.i += 1;
            }
            // The run ends at an ASCII byte or the end, so it is a char boundary.
            out.push_str(&self.text[start..self.i]);
            match self.peek() {
                None => return Err(JsonError::UnexpectedEnd),
                Some(b'"') => {
                    self.i += 1;
                    return Ok(out);
                }
                Some(b'\\') => {
                    let at = self.i;
                    self.i += 1;
                    let e = self.peek().ok_or(JsonError::UnexpectedEnd)?;
                    self.i += 1;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => out.push(self.unicode_escape(at)?),
                        _ => return Err(JsonError::InvalidEscape { offset: at }),
                    }
                }
                Some(_) => return Err(JsonError::ControlCharacter { offset: self.i }),
            }
        }
    }

    /// Decodes the code point after `\u`, joining a surrogate pair.
    fn unicode_escape(&mut self, at: usize) -> Result<char, JsonError> {
        let first = self.hex4()?;
        let code = match first {
            0xD800..=0xDBFF => {
                if self.s.get(self.i..self.i + 2) != Some(b"\\u") {
                    return Err(JsonError::LoneSurrogate { offset: at });
                }
                self.i += 2;
                let second = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&second) {
                    return Err(JsonError::LoneSurrogate { offset: at });
                }
                0x10000 + (((first as u32) - 0xD800) << 10) + ((second as u32) - 0xDC00)
            }
            0xDC00..=0xDFFF => return Err(JsonError::LoneSurrogate { offset: at }),
            other => other as u32,
        };
        char::from_u32(code).ok_or(JsonError::InvalidEscape { offset: at })
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
        self.i - start
    }

    fn number(&mut self) -> Result<Number, JsonError> {
        let start = self.i;
        let bad = JsonError::InvalidNumber { offset: start };
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek() {
            Some(b'0') => {
                self.i += 1;
                if matches!(self.peek(), Some(b'0'..=b'9')) {
                    return Err(bad); // leading zero
                }
            }
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return Err(bad),
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return Err(bad);
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                return Err(bad);
            }
        }
        let lexeme = &self.text[start..self.i];
        // std's float parsing is correctly rounded (round-to-nearest-even).
        let value: f64 = lexeme.parse().map_err(|_| bad)?;
        if !value.is_finite() {
            return Err(JsonError::NumberOutOfRange { offset: start });
        }
        Ok(Number {
            lexeme: lexeme.into(),
            value,
        })
    }
}

/// The RFC 8785 canonical serialization of `v`.
pub fn to_canonical(v: &Value) -> Vec<u8> {
    to_canonical_string(v).into_bytes()
}

/// The RFC 8785 canonical serialization as a `String`.
pub fn to_canonical_string(v: &Value) -> String {
    let mut out = String::with_capacity(128);
    write_value(v, &mut out);
    out
}

/// The canonical serialization of one value, kept as text so that a body
/// can splice it as it is instead of parsing and rendering it again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Canonical(String);

impl Canonical {
    /// Renders `v`.
    pub fn of(v: &Value) -> Canonical {
        Canonical(to_canonical_string(v))
    }

    /// Text this system rendered with [`to_canonical_string`] and stored
    /// (a captured row), if it is still one complete JSON object: a body
    /// that splices it stays JSON even when the stored text was damaged
    /// (`None`; the caller fails the whole response). Validating without
    /// building a tree costs a fraction of parsing. Debug builds (every test
    /// and the simulator) check that intact text is also canonical.
    pub fn stored(text: String) -> Option<Canonical> {
        let object =
            text.starts_with('{') && serde_json::from_str::<serde::de::IgnoredAny>(&text).is_ok();
        if !object {
            return None;
        }
        debug_assert!(
            parse(text.as_bytes()).is_ok_and(|v| to_canonical_string(&v) == text),
            "stored text is canonical JSON"
        );
        Some(Canonical(text))
    }

    /// The canonical text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The value again.
    pub fn to_value(&self) -> Result<Value, JsonError> {
        parse(self.0.as_bytes())
    }
}

/// Writes one object member by member, for bodies too large to build as a
/// [`Value`] first. The caller gives the members in RFC 8785 order; names
/// are ASCII, so that order is byte order, and it is asserted.
pub struct ObjectWriter<'a> {
    out: &'a mut String,
    last: Option<&'static str>,
}

impl<'a> ObjectWriter<'a> {
    /// Opens an object at the end of `out`.
    pub fn new(out: &'a mut String) -> ObjectWriter<'a> {
        out.push('{');
        ObjectWriter { out, last: None }
    }

    /// Writes member `name`'s name; the caller appends its canonical value.
    pub fn member(&mut self, name: &'static str) -> &mut String {
        assert!(
            name.is_ascii() && self.last.is_none_or(|l| l < name),
            "object members are written in canonical order"
        );
        if self.last.is_some() {
            self.out.push(',');
        }
        write_string(name, self.out);
        self.out.push(':');
        self.last = Some(name);
        self.out
    }

    /// Writes member `name` with value `v`.
    pub fn value(&mut self, name: &'static str, v: &Value) {
        write_value(v, self.member(name));
    }

    /// Closes the object.
    pub fn finish(self) {
        self.out.push('}');
    }
}

/// Appends the RFC 8785 canonical serialization of `v` to `out`.
pub fn write_value(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => out.push_str(&format_f64(n.as_f64())),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (k, item) in items.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                write_value(item, out);
            }
            out.push(']');
        }
        Value::Object(members) => {
            let mut member = |k: usize, name: &str, item: &Value| {
                out.push(if k == 0 { '{' } else { ',' });
                write_string(name, out);
                out.push(':');
                write_value(item, out);
            };
            if needs_utf16_order(members) {
                for (k, (name, item)) in sorted_members(members).into_iter().enumerate() {
                    member(k, name, item);
                }
            } else {
                for (k, (name, item)) in members.iter().enumerate() {
                    member(k, name, item);
                }
            }
            if members.is_empty() {
                out.push('{');
            }
            out.push('}');
        }
    }
}

/// BTreeMap order is UTF-8 byte order; it differs from RFC 8785's UTF-16
/// order only between supplementary characters and U+E000..U+FFFF.
fn needs_utf16_order(members: &Object) -> bool {
    members.keys().any(|k| k.chars().any(|c| c > '\u{D7FF}'))
}

/// Members in RFC 8785 order: by UTF-16 code units of the name.
fn sorted_members(members: &Object) -> Vec<(&String, &Value)> {
    let mut list: Vec<_> = members.iter().collect();
    list.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
    list
}

/// Writes `s` as an RFC 8785 JSON string (ECMAScript `JSON.stringify` escaping).
pub fn write_string(s: &str, out: &mut String) {
    out.push('"');
    let mut start = 0;
    for (i, b) in s.bytes().enumerate() {
        let escape = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0x08 => "\\b",
            0x0c => "\\f",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x00..=0x1f => "",
            _ => continue,
        };
        out.push_str(&s[start..i]);
        if escape.is_empty() {
            out.push_str(&format!("\\u{b:04x}"));
        } else {
            out.push_str(escape);
        }
        start = i + 1;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

impl Value {
    /// The member map when this is an object.
    pub fn as_object(&self) -> Option<&Object> {
        match self {
            Value::Object(o) => Some(o),
            _ => None,
        }
    }

    /// The text when this is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// A string value.
    pub fn string(s: impl Into<String>) -> Value {
        Value::String(s.into())
    }

    /// An integer value.
    pub fn int(v: i64) -> Value {
        Value::Number(Number::from_i64(v))
    }

    /// The JSON type name, for bounded error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "boolean",
            Value::Number(_) => "number",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::Object(_) => "object",
        }
    }
}

/// Builds an object from `(name, value)` pairs; a later duplicate name replaces an earlier one.
pub fn object<const N: usize>(members: [(&str, Value); N]) -> Value {
    Value::Object(
        members
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        to_canonical_string(&parse(s.as_bytes()).unwrap())
    }

    #[test]
    fn rejects_duplicates_at_every_depth() {
        assert!(matches!(
            parse(br#"{"a":1,"a":2}"#),
            Err(JsonError::DuplicateMember { .. })
        ));
        assert!(matches!(
            parse(br#"{"x":[{"b":1,"b":1}]}"#),
            Err(JsonError::DuplicateMember { .. })
        ));
        // Escaped spellings of the same name are the same member.
        assert!(matches!(
            parse(br#"{"a":1,"\u0061":2}"#),
            Err(JsonError::DuplicateMember { .. })
        ));
    }

    #[test]
    fn rejects_bad_text() {
        assert_eq!(parse(b"\xff"), Err(JsonError::InvalidUtf8));
        assert!(matches!(
            parse(br#""\ud800""#),
            Err(JsonError::LoneSurrogate { .. })
        ));
        assert!(matches!(
            parse(br#""\udc00\ud800""#),
            Err(JsonError::LoneSurrogate { .. })
        ));
        assert!(matches!(
            parse(br#""\ud800\u0041""#),
            Err(JsonError::LoneSurrogate { .. })
        ));
        assert!(matches!(
            parse(b"\"a\x01\""),
            Err(JsonError::ControlCharacter { .. })
        ));
        assert!(matches!(
            parse(br#""\x""#),
            Err(JsonError::InvalidEscape { .. })
        ));
        assert!(matches!(
            parse(b"1 2"),
            Err(JsonError::TrailingBytes { .. })
        ));
        assert!(matches!(
            parse(b"{} x"),
            Err(JsonError::TrailingBytes { .. })
        ));
        assert_eq!(parse(b""), Err(JsonError::UnexpectedEnd));
        assert_eq!(parse(b"[1,"), Err(JsonError::UnexpectedEnd));
        assert!(matches!(
            parse(b"[1,]"),
            Err(JsonError::UnexpectedByte { .. })
        ));
        assert!(matches!(
            parse(b"{\"a\":1,}"),
            Err(JsonError::UnexpectedByte { .. })
        ));
        assert!(matches!(parse(b"nul"), Err(JsonError::UnexpectedEnd)));
        assert!(matches!(
            parse(b"\xef\xbb\xbf{}"),
            Err(JsonError::UnexpectedByte { .. })
        ));
    }

    #[test]
    fn rejects_bad_numbers() {
        for bad in [
            "01", "-", "1.", ".5", "1e", "1e+", "+1", "0x10", "NaN", "Infinity", "--1",
        ] {
            assert!(parse(bad.as_bytes()).is_err(), "{bad}");
        }
        assert!(matches!(
            parse(b"1e400"),
            Err(JsonError::NumberOutOfRange { .. })
        ));
        assert!(matches!(
            parse(b"-1e400"),
            Err(JsonError::NumberOutOfRange { .. })
        ));
    }

    #[test]
    fn keeps_number_lexemes() {
        let one = parse(b"1").unwrap();
        let one_f = parse(b"1.0").unwrap();
        let (Value::Number(a), Value::Number(b)) = (&one, &one_f) else {
            panic!()
        };
        assert_eq!(a.as_exact_i64(), Some(1));
        assert_eq!(b.as_exact_i64(), None);
        assert_eq!(b.lexeme(), "1.0");
        assert!(a.is_canonical() && !b.is_canonical());
        let Value::Number(nz) = parse(b"-0").unwrap() else {
            panic!()
        };
        assert_eq!(nz.as_exact_i64(), None);
        assert!(!nz.is_canonical());
        let Value::Number(big) = parse(b"9223372036854775808").unwrap() else {
            panic!()
        };
        assert_eq!(big.as_exact_i64(), None);
    }

    #[test]
    fn depth_is_bounded() {
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(parse(ok.as_bytes()).is_ok());
        let deep = "[".repeat(MAX_DEPTH + 1) + &"]".repeat(MAX_DEPTH + 1);
        assert!(matches!(
            parse(deep.as_bytes()),
            Err(JsonError::TooDeep { .. })
        ));
        let hostile = "[".repeat(1_000_000);
        assert!(matches!(
            parse(hostile.as_bytes()),
            Err(JsonError::TooDeep { .. })
        ));
    }

    #[test]
    fn canonical_numbers_follow_ecmascript() {
        assert_eq!(canon("1e21"), "1e+21");
        assert_eq!(canon("1e-7"), "1e-7");
        assert_eq!(canon("0.000001"), "0.000001");
        assert_eq!(canon("-0"), "0");
        assert_eq!(canon("-0.0"), "0");
        assert_eq!(canon("1.0"), "1");
        assert_eq!(canon("100"), "100");
        assert_eq!(canon("1E2"), "100");
        assert_eq!(canon("123456789012345680000"), "123456789012345680000");
        assert_eq!(canon("9007199254740993"), "9007199254740992");
        assert_eq!(canon("0.1"), "0.1");
        assert_eq!(canon("5e-324"), "5e-324");
        assert_eq!(canon("1.7976931348623157e308"), "1.7976931348623157e+308");
        assert_eq!(canon("-1.5e-9"), "-1.5e-9");
        assert_eq!(canon("333333333.33333329"), "333333333.3333333");
        // Exactly halfway between two 17-digit strings: ECMAScript picks the even one (V8 agrees).
        assert_eq!(canon("-1503838585508069.25"), "-1503838585508069.2");
    }

    #[test]
    fn canonical_strings_and_order() {
        assert_eq!(
            canon(r#""\u0000\b\t\n\f\r\u001f\"\\\/é€😀\u2028""#),
            "\"\\u0000\\b\\t\\n\\f\\r\\u001f\\\"\\\\/é€😀\u{2028}\""
        );
        assert_eq!(
            canon(r#"{"b":1,"a":[true,false,null],"":{}}"#),
            r#"{"":{},"a":[true,false,null],"b":1}"#
        );
        // RFC 8785 §3.2.3 example: UTF-16 order puts U+1F600 before U+FB33.
        let v = canon("{\"\u{FB33}\":1,\"\u{1F600}\":2,\"\u{80}\":3}");
        assert_eq!(v, "{\"\u{80}\":3,\"\u{1F600}\":2,\"\u{FB33}\":1}");
    }

    #[test]
    fn whitespace_is_accepted_around_tokens() {
        assert_eq!(canon(" \t\r\n{ \"a\" : [ 1 , 2 ] } \n"), r#"{"a":[1,2]}"#);
    }
}
