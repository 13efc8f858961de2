//! `POST /sync/rebuild`: the request, and one page of a staged snapshot.

use crate::digest::Digest;
use crate::error::ProtocolError;
use crate::ids::{CanonicalUuid, ScopeId, ServerVersion};
use crate::json::{self, ObjectWriter, Value};
use crate::manifest::SchemaRef;
use crate::members::{Members, ShapeError};
use crate::wire::{
    PageLimit, PageRow, PresentedCursor, PrimaryKey, client_identity, parse_body, schema_ref,
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
        RebuildRequest::from_value(parse_body(body)?)
    }

    /// Validates an already parsed body.
    pub fn from_value(body: Value) -> Result<RebuildRequest, ProtocolError> {
        let mut m = Members::new(body, "rebuild request")?;
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
    pub image: PageRow,
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
    /// The canonical response body (stored and replayed byte-exactly),
    /// written member by member with each row spliced as its stored text.
    pub fn to_body(&self) -> Vec<u8> {
        let mut out = String::with_capacity(512);
        let mut o = ObjectWriter::new(&mut out);
        if let RebuildEnd::Final { checksum, .. } = &self.end {
            checksum.write_checksum(o.member("checksum"));
        }
        match &self.end {
            RebuildEnd::More { cursor } => json::write_string(cursor, o.member("cursor")),
            RebuildEnd::Final { .. } => o.value("cursor", &Value::Null),
        }
        if let RebuildEnd::Final {
            final_scope_cursor, ..
        } = &self.end
        {
            json::write_string(final_scope_cursor, o.member("final_scope_cursor"));
        }
        let more = matches!(self.end, RebuildEnd::More { .. });
        o.value("has_more", &Value::Bool(more));
        let records = o.member("records");
        records.push('[');
        for (k, r) in self.records.iter().enumerate() {
            if k > 0 {
                records.push(',');
            }
            let mut record = ObjectWriter::new(records);
            r.pk.write(record.member("pk"));
            r.image.write(&mut record);
            json::write_string(r.server_version.as_str(), record.member("server_version"));
            json::write_string(&r.table, record.member("table"));
            record.finish();
        }
        records.push(']');
        json::write_string(self.scope.as_str(), o.member("scope"));
        o.finish();
        out.into_bytes()
    }
}
