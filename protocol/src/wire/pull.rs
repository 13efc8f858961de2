//! `POST /sync/pull`: the request, and one page of changes.

use std::collections::BTreeMap;

use crate::digest::Digest;
use crate::error::ProtocolError;
use crate::ids::{ScopeId, ServerVersion};
use crate::json::{self, Object, Value};
use crate::manifest::SchemaRef;
use crate::members::{self, Members};
use crate::wire::{
    AssignmentDelta, PageLimit, PresentedCursor, PrimaryKey, RowImage, client_identity, parse_body,
    schema_ref, scope_cursors, scope_list,
};

/// A structurally valid pull request.
#[derive(Clone, Debug, PartialEq)]
pub struct PullRequest {
    pub client_id: String,
    pub client_generation: u64,
    pub schema: SchemaRef,
    pub scope_set_version: u64,
    pub scopes: BTreeMap<ScopeId, PresentedCursor>,
    pub limit: PageLimit,
}

impl PullRequest {
    /// Parses a pull body.
    pub fn parse(body: &[u8]) -> Result<PullRequest, ProtocolError> {
        PullRequest::from_value(parse_body(body)?)
    }

    /// Validates an already parsed body.
    pub fn from_value(body: Value) -> Result<PullRequest, ProtocolError> {
        let mut m = Members::new(body, "pull request")?;
        let (client_id, client_generation) = client_identity(&mut m)?;
        let schema = schema_ref(&m.take("schema")?, "schema")?;
        let scope_set_version =
            members::integer(&m.take("scope_set_version")?, "scope_set_version", 0)?;
        let scopes = scope_cursors(m.take("scopes")?, "scopes")?;
        let limit = PageLimit::from_json(&m.take("limit")?)?;
        m.finish()?;
        Ok(PullRequest {
            client_id,
            client_generation,
            schema,
            scope_set_version,
            scopes,
            limit,
        })
    }
}

/// The pull operation of one change.
#[derive(Clone, Debug, PartialEq)]
pub enum ChangeOp {
    /// A complete row with its checksum.
    Upsert(RowImage),
    /// A local removal (`None`) or an authoritative tombstone row.
    Delete(Option<RowImage>),
}

/// One change of a page.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub scope: ScopeId,
    pub table: String,
    pub pk: PrimaryKey,
    pub op: ChangeOp,
    pub server_version: ServerVersion,
}

impl Change {
    fn to_json(&self) -> Value {
        let mut o = Object::new();
        o.insert("scope".into(), Value::string(self.scope.as_str()));
        o.insert("table".into(), Value::string(&self.table));
        o.insert("pk".into(), self.pk.to_json());
        let (op, image) = match &self.op {
            ChangeOp::Upsert(image) => ("upsert", Some(image)),
            ChangeOp::Delete(image) => ("delete", image.as_ref()),
        };
        o.insert("op".into(), Value::string(op));
        if let Some(image) = image {
            o.insert("row".into(), image.row.clone());
            o.insert("row_checksum".into(), image.checksum.checksum_json());
        }
        o.insert(
            "server_version".into(),
            Value::string(self.server_version.as_str()),
        );
        Value::Object(o)
    }
}

/// How a page ends: more candidates remain, or terminal with every active scope's digest.
#[derive(Clone, Debug, PartialEq)]
pub enum PageEnd {
    /// `has_more: true`; checksums absent.
    More,
    /// `has_more: false`; keys are exactly the active scopes after this response's updates.
    Terminal {
        checksums: BTreeMap<ScopeId, Digest>,
    },
}

/// One successful pull page.
#[derive(Clone, Debug, PartialEq)]
pub struct PullResponse {
    pub changes: Vec<Change>,
    pub scope_set_version: u64,
    /// Newly issued cursors (a delta map).
    pub scope_cursors: BTreeMap<ScopeId, String>,
    pub scope_updates: AssignmentDelta,
    pub rebuild: Vec<ScopeId>,
    pub end: PageEnd,
}

impl PullResponse {
    /// The response object.
    pub fn to_json(&self) -> Value {
        let cursors = self
            .scope_cursors
            .iter()
            .map(|(s, c)| (s.as_str().to_owned(), Value::string(c.clone())));
        let mut o = Object::new();
        o.insert(
            "changes".into(),
            Value::Array(self.changes.iter().map(Change::to_json).collect()),
        );
        o.insert(
            "scope_set_version".into(),
            Value::int(self.scope_set_version as i64),
        );
        o.insert("scope_cursors".into(), Value::Object(cursors.collect()));
        o.insert("scope_updates".into(), self.scope_updates.to_json());
        o.insert("rebuild".into(), scope_list(&self.rebuild));
        match &self.end {
            PageEnd::More => {
                o.insert("has_more".into(), Value::Bool(true));
            }
            PageEnd::Terminal { checksums } => {
                o.insert("has_more".into(), Value::Bool(false));
                let sums = checksums
                    .iter()
                    .map(|(s, d)| (s.as_str().to_owned(), d.checksum_json()));
                o.insert("checksums".into(), Value::Object(sums.collect()));
            }
        }
        Value::Object(o)
    }

    /// The canonical response body.
    pub fn to_body(&self) -> Vec<u8> {
        json::to_canonical(&self.to_json())
    }
}
