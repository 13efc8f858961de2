//! `POST /sync/pull`: the request, and one page of changes.

use std::collections::BTreeMap;

use crate::digest::Digest;
use crate::error::ProtocolError;
use crate::ids::{ScopeId, ServerVersion};
use crate::json::{self, ObjectWriter, Value};
use crate::manifest::SchemaRef;
use crate::members::{self, Members};
use crate::wire::{
    AssignmentDelta, PageLimit, PageRow, PresentedCursor, PrimaryKey, client_identity, parse_body,
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
    Upsert(PageRow),
    /// A local removal (`None`) or an authoritative tombstone row.
    Delete(Option<PageRow>),
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
    /// Appends the change object to `out`.
    fn write(&self, out: &mut String) {
        let (op, row) = match &self.op {
            ChangeOp::Upsert(row) => ("upsert", Some(row)),
            ChangeOp::Delete(row) => ("delete", row.as_ref()),
        };
        let mut o = ObjectWriter::new(out);
        json::write_string(op, o.member("op"));
        self.pk.write(o.member("pk"));
        if let Some(row) = row {
            row.write(&mut o);
        }
        json::write_string(self.scope.as_str(), o.member("scope"));
        json::write_string(self.server_version.as_str(), o.member("server_version"));
        json::write_string(&self.table, o.member("table"));
        o.finish();
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
    /// The canonical response body, written member by member: a page holds
    /// up to 1000 rows, each spliced as its stored text.
    pub fn to_body(&self) -> Vec<u8> {
        let rows: usize = self
            .changes
            .iter()
            .map(|c| match &c.op {
                ChangeOp::Upsert(r) | ChangeOp::Delete(Some(r)) => r.row.as_str().len(),
                ChangeOp::Delete(None) => 0,
            })
            .sum();
        let mut out = String::with_capacity(512 + rows + 320 * self.changes.len());
        let mut o = ObjectWriter::new(&mut out);
        let changes = o.member("changes");
        changes.push('[');
        for (k, c) in self.changes.iter().enumerate() {
            if k > 0 {
                changes.push(',');
            }
            c.write(changes);
        }
        changes.push(']');
        if let PageEnd::Terminal { checksums } = &self.end {
            let sums = o.member("checksums");
            sums.push('{');
            for (k, (scope, d)) in checksums.iter().enumerate() {
                if k > 0 {
                    sums.push(',');
                }
                json::write_string(scope.as_str(), sums);
                sums.push(':');
                d.write_checksum(sums);
            }
            sums.push('}');
        }
        let more = matches!(self.end, PageEnd::More);
        o.value("has_more", &Value::Bool(more));
        o.value("rebuild", &scope_list(&self.rebuild));
        let cursors = self
            .scope_cursors
            .iter()
            .map(|(s, c)| (s.as_str().to_owned(), Value::string(c.clone())));
        o.value("scope_cursors", &Value::Object(cursors.collect()));
        o.value(
            "scope_set_version",
            &Value::int(self.scope_set_version as i64),
        );
        o.value("scope_updates", &self.scope_updates.to_json());
        o.finish();
        out.into_bytes()
    }
}
