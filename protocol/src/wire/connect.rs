//! `POST /sync/connect`: request intake with the compatibility gates, and
//! the response with its schema action.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{ErrorKind, ProtocolError, UpgradeRequired};
use crate::ids::ScopeId;
use crate::json::{self, Object, Value};
use crate::limits::{MAX_IDENTIFIER_OCTETS, MAX_SCOPES_PER_REQUEST, MAX_TOKEN_OCTETS};
use crate::manifest::{Manifest, SchemaRef};
use crate::members::{self, Members, ShapeError};
use crate::wire::{
    AssignmentDelta, PresentedCursor, parse_body, scope_cursors, scope_id, scope_list,
};

/// The only protocol version this server speaks.
pub const PROTOCOL_VERSION: i64 = 3;

/// The connect `schema` member: a normal reference or the fresh-client sentinel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectSchema {
    /// `{"version":0,"hash":""}`.
    Fresh,
    /// An immutable reference the client has installed.
    Installed(SchemaRef),
}

/// A structurally valid connect request.
#[derive(Clone, Debug, PartialEq)]
pub struct ConnectRequest {
    pub client_id: String,
    /// `None` asserts a fresh local client.
    pub client_generation: Option<u64>,
    pub platform: String,
    pub app_version: semver::Version,
    pub schema_reset: bool,
    pub schema: ConnectSchema,
    pub scope_set_version: u64,
    pub known_scopes: BTreeMap<ScopeId, PresentedCursor>,
    /// Seed receipts by scope; empty when the member is absent.
    pub seed_receipts: BTreeMap<ScopeId, String>,
}

/// SemVer 2.0.0 precedence: like `Ord` but build metadata is ignored.
pub fn semver_precedence(a: &semver::Version, b: &semver::Version) -> Ordering {
    (a.major, a.minor, a.patch, &a.pre).cmp(&(b.major, b.minor, b.patch, &b.pre))
}

impl ConnectRequest {
    /// Parses a connect body. Applies, in order: JSON intake, the protocol
    /// gate and the runtime gate (426), then exact structure (400).
    pub fn parse(
        body: &[u8],
        minimum_client_version: Option<&semver::Version>,
    ) -> Result<ConnectRequest, ProtocolError> {
        Self::from_value(parse_body(body)?, minimum_client_version)
    }

    /// Validates an already parsed body: the compatibility gates, then structure.
    pub fn from_value(
        v: Value,
        minimum_client_version: Option<&semver::Version>,
    ) -> Result<ConnectRequest, ProtocolError> {
        compatibility_gates(&v, minimum_client_version)?;
        let mut m = Members::new(v, "connect request")?;
        let client_id = super::client_id(m.take("client_id")?)?;
        let client_generation = match m.take_opt("client_generation") {
            None => None,
            Some(g) => Some(members::integer(&g, "client_generation", 1)?),
        };
        let platform = members::string(m.take("platform")?, "platform", 1, MAX_IDENTIFIER_OCTETS)?;
        let app_version = app_version(m.take("app_version")?)?;
        // The gate above accepted only an integer equal to 3 here, or nothing.
        if members::integer(&m.take("protocol_version")?, "protocol_version", 0)?
            != PROTOCOL_VERSION as u64
        {
            return Err(ShapeError::member("protocol_version", "must be 3").into());
        }
        let schema_reset = match m.take_opt("schema_reset") {
            None => false,
            Some(v) => members::boolean(&v, "schema_reset")?,
        };
        let schema_value = m.take("schema")?;
        let scope_set_version =
            members::integer(&m.take("scope_set_version")?, "scope_set_version", 0)?;
        let known_scopes = scope_cursors(m.take("known_scopes")?, "known_scopes")?;
        let seed_receipts = match m.take_opt("seed_receipts") {
            None => BTreeMap::new(),
            Some(v) => seed_receipts(v)?,
        };
        m.finish()?;
        // The schema reference is judged last so that every other structural
        // defect keeps its `invalid_request` code.
        let schema = connect_schema(&schema_value)?;
        if schema == ConnectSchema::Fresh && (client_generation.is_some() || schema_reset) {
            return Err(
                ProtocolError::invalid_schema_reference(Some(&schema_value)).with_message(
                    "the fresh schema sentinel is only for a fresh client without schema_reset",
                ),
            );
        }
        Ok(ConnectRequest {
            client_id,
            client_generation,
            platform,
            app_version,
            schema_reset,
            schema,
            scope_set_version,
            known_scopes,
            seed_receipts,
        })
    }
}

/// Step 2 of dispatch: protocol version, then the minimum client runtime.
/// A member of the wrong type is left to structural validation.
fn compatibility_gates(v: &Value, minimum: Option<&semver::Version>) -> Result<(), ProtocolError> {
    let Some(o) = v.as_object() else {
        return Ok(());
    };
    if let Some(Value::Number(n)) = o.get("protocol_version")
        && let Some(received) = n.as_exact_i64()
        && received != PROTOCOL_VERSION
    {
        return Err(ErrorKind::UpgradeRequired(UpgradeRequired::Protocol {
            required: PROTOCOL_VERSION,
            received,
        })
        .into());
    }
    if let (Some(minimum), Some(Value::String(s))) = (minimum, o.get("app_version"))
        && let Ok(received) = semver::Version::parse(s)
        && semver_precedence(&received, minimum) == Ordering::Less
    {
        return Err(ErrorKind::UpgradeRequired(UpgradeRequired::Runtime {
            minimum: minimum.clone(),
            received,
        })
        .into());
    }
    Ok(())
}

fn app_version(v: Value) -> Result<semver::Version, ShapeError> {
    let s = members::string(v, "app_version", 1, MAX_IDENTIFIER_OCTETS)?;
    semver::Version::parse(&s)
        .map_err(|_| ShapeError::member("app_version", "must be a SemVer 2.0.0 version"))
}

fn connect_schema(v: &Value) -> Result<ConnectSchema, ProtocolError> {
    if let Some(r) = SchemaRef::from_json(v) {
        return Ok(ConnectSchema::Installed(r));
    }
    let is_sentinel = v.as_object().is_some_and(|o| {
        o.len() == 2
            && matches!(o.get("version"), Some(Value::Number(n)) if n.lexeme() == "0")
            && o.get("hash").and_then(Value::as_str) == Some("")
    });
    if is_sentinel {
        Ok(ConnectSchema::Fresh)
    } else {
        Err(ProtocolError::invalid_schema_reference(Some(v)))
    }
}

fn seed_receipts(v: Value) -> Result<BTreeMap<ScopeId, String>, ShapeError> {
    let map = members::object(v, "seed_receipts")?;
    if map.is_empty() || map.len() > MAX_SCOPES_PER_REQUEST {
        return Err(ShapeError::member(
            "seed_receipts",
            "must be a nonempty map within the scope limit",
        ));
    }
    let mut out = BTreeMap::new();
    for (scope, receipt) in map {
        let receipt = members::string(receipt, "seed_receipts", 1, MAX_TOKEN_OCTETS)?;
        out.insert(scope_id(&scope, "seed_receipts")?, receipt);
    }
    Ok(out)
}

/// Why connect answered `unsupported`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnsupportedReason {
    UnknownSchemaLineage,
    IncompatibleSchemaTransition,
}

impl UnsupportedReason {
    fn as_str(self) -> &'static str {
        match self {
            UnsupportedReason::UnknownSchemaLineage => "unknown_schema_lineage",
            UnsupportedReason::IncompatibleSchemaTransition => "incompatible_schema_transition",
        }
    }
}

/// A nonempty, deduplicated list of scope IDs in unsigned byte order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AffectedScopes(Vec<ScopeId>);

impl AffectedScopes {
    /// Sorts and deduplicates; `None` when empty.
    pub fn new(mut scopes: Vec<ScopeId>) -> Option<AffectedScopes> {
        scopes.sort_by(|a, b| a.as_str().as_bytes().cmp(b.as_str().as_bytes()));
        scopes.dedup();
        (!scopes.is_empty()).then_some(AffectedScopes(scopes))
    }

    /// The scopes in order.
    pub fn as_slice(&self) -> &[ScopeId] {
        &self.0
    }
}

/// The one schema action of a connect response, with its required members.
#[derive(Clone, Debug, PartialEq)]
pub enum SchemaAction {
    /// The client's schema is current.
    None { current: SchemaRef },
    /// Install the inline current manifest.
    Replace { current: Arc<Manifest> },
    /// Install the manifest and rebuild exactly the affected scopes.
    RebuildLocal {
        current: Arc<Manifest>,
        affected_scopes: AffectedScopes,
    },
    /// The client must not sync under its lineage.
    Unsupported {
        current: SchemaRef,
        reason: UnsupportedReason,
    },
}

impl SchemaAction {
    /// The wire name of the action.
    pub fn name(&self) -> &'static str {
        match self {
            SchemaAction::None { .. } => "none",
            SchemaAction::Replace { .. } => "replace",
            SchemaAction::RebuildLocal { .. } => "rebuild_local",
            SchemaAction::Unsupported { .. } => "unsupported",
        }
    }

    fn current(&self) -> SchemaRef {
        match self {
            SchemaAction::None { current } | SchemaAction::Unsupported { current, .. } => *current,
            SchemaAction::Replace { current } | SchemaAction::RebuildLocal { current, .. } => {
                current.reference()
            }
        }
    }
}

/// A successful connect response.
#[derive(Clone, Debug, PartialEq)]
pub struct ConnectResponse {
    /// `YYYY-MM-DDTHH:MM:SS.ffffffZ`; see [`super::format_server_time`].
    pub server_time: String,
    pub client_generation: u64,
    pub scope_set_version: u64,
    pub schema: SchemaAction,
    pub scopes: AssignmentDelta,
    /// Same-position replacements (`Some`) or invalidations (`None`) for existing scopes.
    pub scope_cursor_updates: BTreeMap<ScopeId, Option<String>>,
}

impl ConnectResponse {
    /// The response object.
    pub fn to_json(&self) -> Value {
        let current = self.schema.current();
        let mut schema = Object::new();
        schema.insert("version".into(), Value::int(current.version as i64));
        schema.insert("hash".into(), Value::string(current.hash.to_hex()));
        schema.insert("action".into(), Value::string(self.schema.name()));
        let mut o = Object::new();
        match &self.schema {
            SchemaAction::Unsupported { reason, .. } => {
                schema.insert("reason".into(), Value::string(reason.as_str()));
            }
            SchemaAction::Replace { current } => {
                o.insert("schema_definition".into(), current.to_json());
            }
            SchemaAction::RebuildLocal {
                current,
                affected_scopes,
            } => {
                o.insert("schema_definition".into(), current.to_json());
                o.insert(
                    "affected_scopes".into(),
                    scope_list(affected_scopes.as_slice()),
                );
            }
            SchemaAction::None { .. } => {}
        }
        let updates = self.scope_cursor_updates.iter().map(|(id, c)| {
            (
                id.as_str().to_owned(),
                c.as_ref().map_or(Value::Null, |c| Value::string(c.clone())),
            )
        });
        o.insert("server_time".into(), Value::string(&self.server_time));
        o.insert("protocol_version".into(), Value::int(PROTOCOL_VERSION));
        o.insert(
            "client_generation".into(),
            Value::int(self.client_generation as i64),
        );
        o.insert(
            "scope_set_version".into(),
            Value::int(self.scope_set_version as i64),
        );
        o.insert("schema".into(), Value::Object(schema));
        o.insert("scopes".into(), self.scopes.to_json());
        o.insert(
            "scope_cursor_updates".into(),
            Value::Object(updates.collect()),
        );
        Value::Object(o)
    }

    /// The canonical response body.
    pub fn to_body(&self) -> Vec<u8> {
        json::to_canonical(&self.to_json())
    }
}
