//! `POST /sync/rebuild`: the request, and one page of a staged snapshot.

use crate::digest::Digest;
use crate::error::ProtocolError;
use crate::ids::{CanonicalUuid, ScopeId, ServerVersion};
use crate::json::{self, Object, Value};
use crate::manifest::SchemaRef;
use crate::members::{Members, ShapeError};
use crate::wire::{
    PageLimit, PresentedCursor, PrimaryKey, RowImage, client_identity, parse_body, schema_ref,
    scope_id, token,
};

/// A structurally valid rebuild request.
#[derive(Clone, Debug, PartialEq)]
pub struct RebuildRequest {
    pub client_id: String,
    pub client_generation: u64,
    pub schema: SchemaRef,
    pub scope: ScopeId,
    pub rebuild_id: CanonicalUuid,
    /// `None` on the first request of an attempt.
    pub cursor: PresentedCursor,
    pub limit: PageLimit,
}

impl RebuildRequest {
    /// Parses a rebuild body.
    pub fn parse(body: &[u8]) -> Result<RebuildRequest, ProtocolError> {
        let mut m = Members::new(parse_body(body)?, "rebuild request")?;
        let (client_id, client_generation) = client_identity(&mut m)?;
        let schema = schema_ref(&m.take("schema")?, "schema")?;
        let scope = m.take("scope")?;
        let scope = scope_id(
            scope
                .as_str()
                .ok_or(ShapeError::member("scope", "must be a string"))?,
            "scope",
        )?;
        let rebuild_id = m
            .take("rebuild_id")?
            .as_str()
            .and_then(CanonicalUuid::parse)
            .ok_or(ShapeError::member(
                "rebuild_id",
                "must be a canonical lowercase non-nil UUID",
            ))?;
        let cursor = token(m.take("cursor")?, "cursor")?;
        let limit = PageLimit::from_json(&m.take("limit")?)?;
        m.finish()?;
        Ok(RebuildRequest {
            client_id,
            client_generation,
            schema,
            scope,
            rebuild_id,
            cursor,
            limit,
        })
    }
}

/// One staged row.
#[derive(Clone, Debug, PartialEq)]
pub struct Record {
    pub table: String,
    pub pk: PrimaryKey,
    pub image: RowImage,
    pub server_version: ServerVersion,
}

/// How a rebuild page ends.
#[derive(Clone, Debug, PartialEq)]
pub enum RebuildEnd {
    /// `has_more: true` with the next continuation.
    More { cursor: String },
    /// `has_more: false`, `cursor: null`, the incremental cursor at the boundary and the scope digest.
    Final {
        final_scope_cursor: String,
        checksum: Digest,
    },
}

/// One rebuild page.
#[derive(Clone, Debug, PartialEq)]
pub struct RebuildPage {
    pub scope: ScopeId,
    pub records: Vec<Record>,
    pub end: RebuildEnd,
}

impl RebuildPage {
    /// The response object.
    pub fn to_json(&self) -> Value {
        let records = self.records.iter().map(|r| {
            json::object([
                ("table", Value::string(&r.table)),
                ("pk", r.pk.to_json()),
                ("row", r.image.row.clone()),
                ("row_checksum", r.image.checksum.checksum_json()),
                ("server_version", Value::string(r.server_version.as_str())),
            ])
        });
        let mut o = Object::new();
        o.insert("scope".into(), Value::string(self.scope.as_str()));
        o.insert("records".into(), Value::Array(records.collect()));
        match &self.end {
            RebuildEnd::More { cursor } => {
                o.insert("cursor".into(), Value::string(cursor.clone()));
                o.insert("has_more".into(), Value::Bool(true));
            }
            RebuildEnd::Final {
                final_scope_cursor,
                checksum,
            } => {
                o.insert("cursor".into(), Value::Null);
                o.insert("has_more".into(), Value::Bool(false));
                o.insert(
                    "final_scope_cursor".into(),
                    Value::string(final_scope_cursor.clone()),
                );
                o.insert("checksum".into(), checksum.checksum_json());
            }
        }
        Value::Object(o)
    }

    /// The canonical response body (stored and replayed byte-exactly).
    pub fn to_body(&self) -> Vec<u8> {
        json::to_canonical(&self.to_json())
    }
}
