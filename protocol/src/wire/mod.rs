//! Request parsing with exact validation, and the response shapes, for the
//! four protocol endpoints. Parsing follows the spec's dispatch precedence
//! for what can be decided without server state; everything else (retirement,
//! replay, generation, schema currency, cursor bindings) is the engine's.

pub mod connect;
pub mod pull;
pub mod push;
pub mod rebuild;

use std::collections::BTreeMap;

use crate::digest::Digest;
use crate::error::ProtocolError;
use crate::ids::ScopeId;
use crate::json::{self, Value};
use crate::limits::{MAX_BODY_OCTETS, MAX_PAGE_LIMIT, MAX_SCOPES_PER_REQUEST, MAX_TOKEN_OCTETS};
use crate::manifest::SchemaRef;
use crate::members::{self, Members, ShapeError};

impl From<ShapeError> for ProtocolError {
    fn from(e: ShapeError) -> ProtocolError {
        ProtocolError::invalid_request(e.0)
    }
}

/// Parses a request body: within the body limit, one strict JSON value.
pub fn parse_body(body: &[u8]) -> Result<Value, ProtocolError> {
    if body.len() > MAX_BODY_OCTETS {
        return Err(ProtocolError::invalid_request(
            "request body exceeds 1048576 octets",
        ));
    }
    json::parse(body).map_err(|e| ProtocolError::invalid_request(format!("malformed JSON: {e}")))
}

/// The `client_id` string member of a parsed body, without further
/// validation: dispatch binds the client to the user before structural
/// validation (step 1).
pub fn client_id_member(body: &Value) -> Option<&str> {
    body.as_object()?.get("client_id")?.as_str()
}

/// A page limit in the fixed inclusive range 1..=1000.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageLimit(u16);

impl PageLimit {
    /// The limit when `n` is within 1..=1000.
    pub fn new(n: u16) -> Option<PageLimit> {
        (1..=MAX_PAGE_LIMIT).contains(&n).then_some(PageLimit(n))
    }

    /// The number of candidates or records a page may hold.
    pub fn get(self) -> u16 {
        self.0
    }

    fn from_json(v: &Value) -> Result<PageLimit, ShapeError> {
        let n = members::integer(v, "limit", 1)?;
        u16::try_from(n)
            .ok()
            .and_then(PageLimit::new)
            .ok_or(ShapeError::member("limit", "must be within 1..=1000"))
    }
}

/// The one-field typed primary key as received.
#[derive(Clone, Debug, PartialEq)]
pub struct PrimaryKey {
    pub field_id: String,
    /// A JSON string, or an integer within the `int` range.
    pub value: Value,
}

impl PrimaryKey {
    /// Appends `{field_id: value}` to `out`.
    fn write(&self, out: &mut String) {
        out.push('{');
        json::write_string(&self.field_id, out);
        out.push(':');
        json::write_value(&self.value, out);
        out.push('}');
    }

    /// `{field_id: value}`.
    pub fn to_json(&self) -> Value {
        Value::Object(
            [(self.field_id.clone(), self.value.clone())]
                .into_iter()
                .collect(),
        )
    }
}

/// A full authoritative row with its checksum, as echoed in an outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct RowImage {
    /// The row object keyed by field ID.
    pub row: Value,
    pub checksum: Digest,
}

/// A row as a pull or rebuild page carries it: the stored canonical object
/// text, spliced into the body, and its checksum.
#[derive(Clone, Debug, PartialEq)]
pub struct PageRow {
    /// The row object keyed by field ID.
    pub row: json::Canonical,
    pub checksum: Digest,
}

impl PageRow {
    /// Writes the `row` and `row_checksum` members.
    fn write(&self, o: &mut json::ObjectWriter<'_>) {
        o.member("row").push_str(self.row.as_str());
        self.checksum.write_checksum(o.member("row_checksum"));
    }
}

/// An opaque server-issued token as presented by a client; `None` is JSON null.
pub type PresentedCursor = Option<String>;

/// Reads an opaque token member: a string of 1..=4096 octets, or null when allowed.
fn token(v: Value, member: &'static str) -> Result<PresentedCursor, ShapeError> {
    match v {
        Value::Null => Ok(None),
        v => members::string(v, member, 1, MAX_TOKEN_OCTETS).map(Some),
    }
}

/// Reads a scope ID used as a map key or member.
fn scope_id(s: &str, member: &'static str) -> Result<ScopeId, ShapeError> {
    ScopeId::parse(s).ok_or(ShapeError::member(member, "contains an invalid scope ID"))
}

/// Reads `{scope_id: {"cursor": string|null}}` (connect `known_scopes`, pull `scopes`).
fn scope_cursors(
    v: Value,
    member: &'static str,
) -> Result<BTreeMap<ScopeId, PresentedCursor>, ShapeError> {
    let map = members::object(v, member)?;
    if map.len() > MAX_SCOPES_PER_REQUEST {
        return Err(ShapeError::member(member, "has too many scopes"));
    }
    let mut out = BTreeMap::new();
    for (scope, entry) in map {
        let scope = scope_id(&scope, member)?;
        let mut entry = Members::new(entry, "scope entry")?;
        let cursor = token(entry.take("cursor")?, "cursor")?;
        entry.finish()?;
        out.insert(scope, cursor);
    }
    Ok(out)
}

/// Reads a normal schema reference for push, pull and rebuild (never the sentinel).
fn schema_ref(v: &Value, member: &'static str) -> Result<SchemaRef, ShapeError> {
    SchemaRef::from_json(v).ok_or(ShapeError::member(
        member,
        "is not a valid schema reference",
    ))
}

/// Reads the client identity members shared by push, pull and rebuild.
fn client_identity(m: &mut Members) -> Result<(String, u64), ShapeError> {
    let client_id = client_id(m.take("client_id")?)?;
    let generation = members::integer(&m.take("client_generation")?, "client_generation", 1)?;
    Ok((client_id, generation))
}

fn client_id(v: Value) -> Result<String, ShapeError> {
    members::string(v, "client_id", 1, crate::limits::MAX_IDENTIFIER_OCTETS)
}

/// Scope IDs as JSON strings, in the given order.
fn scope_list<'a>(ids: impl IntoIterator<Item = &'a ScopeId>) -> Value {
    Value::Array(ids.into_iter().map(|s| Value::string(s.as_str())).collect())
}

/// The `scopes`/`scope_updates` assignment delta: additions with their cursor, removals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AssignmentDelta {
    /// Added scopes; the cursor is null except after a valid seed receipt.
    pub add: Vec<(ScopeId, Option<String>)>,
    /// Removed scopes.
    pub remove: Vec<ScopeId>,
}

impl AssignmentDelta {
    /// Whether the assignment set is unchanged.
    pub fn is_empty(&self) -> bool {
        self.add.is_empty() && self.remove.is_empty()
    }

    fn to_json(&self) -> Value {
        let add = self.add.iter().map(|(id, cursor)| {
            json::object([
                ("id", Value::string(id.as_str())),
                (
                    "cursor",
                    cursor
                        .as_ref()
                        .map_or(Value::Null, |c| Value::string(c.clone())),
                ),
            ])
        });
        json::object([
            ("add", Value::Array(add.collect())),
            ("remove", scope_list(&self.remove)),
        ])
    }
}

/// Formats a UTC instant given in microseconds since the Unix epoch as
/// `YYYY-MM-DDTHH:MM:SS.ffffffZ` (the `server_time` form).
pub fn format_server_time(unix_micros: i64) -> String {
    let micros = unix_micros.rem_euclid(1_000_000);
    let secs = unix_micros.div_euclid(1_000_000);
    let (days, sod) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil-from-days (H. Hinnant), valid for the whole proleptic Gregorian range used here.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        sod / 3600,
        sod / 60 % 60,
        sod % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_time_format() {
        assert_eq!(format_server_time(0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(
            format_server_time(1_784_383_200_000_000),
            "2026-07-18T14:00:00.000000Z"
        );
        assert_eq!(
            format_server_time(951_782_400_000_001),
            "2000-02-29T00:00:00.000001Z"
        );
        assert_eq!(format_server_time(-1), "1969-12-31T23:59:59.999999Z");
        // Every output is a canonical datetime value.
        for t in [
            0,
            1,
            86_399_999_999,
            4_102_444_800_000_000,
            1_709_164_800_123_456,
        ] {
            let s = format_server_time(t);
            let v = Value::string(&s);
            let f = crate::value::FieldType::new(crate::value::PortableType::Datetime, false);
            assert!(crate::value::decode(&f, &v).is_ok(), "{s}");
        }
    }

    #[test]
    fn page_limits() {
        assert!(PageLimit::new(0).is_none());
        assert_eq!(PageLimit::new(1).map(PageLimit::get), Some(1));
        assert_eq!(PageLimit::new(1000).map(PageLimit::get), Some(1000));
        assert!(PageLimit::new(1001).is_none());
    }
}
