//! The capture model: the sync config's tables and rules compiled against
//! the current manifest, for the materializer to evaluate.

use std::collections::BTreeMap;

use protocol::digest::RowIdentity;
use protocol::json::{Object, Value};
use protocol::manifest::Row;
use protocol::manifest::{Manifest, TableManifest};
use protocol::value::{self, TypedValue};

use crate::capture::{CaptureProblem, SourceImage, source_text};
use crate::config::{MembershipRule, ScopeTemplate, SyncConfig};

/// A membership rule ready to evaluate.
#[derive(Clone, Debug)]
pub(crate) enum Rule {
    /// A template over the row's own columns.
    Own(ScopeTemplate),
    /// One shared scope.
    Constant(String),
    /// Rows of `via` whose `key` equals this row's primary key.
    Via {
        via: String,
        key: String,
        template: ScopeTemplate,
    },
}

/// A registered table: its manifest entry, columns and rules.
#[derive(Clone, Debug)]
pub(crate) struct Table {
    pub manifest: TableManifest,
    pub primary_key: String,
    /// Column name -> field ID, for every synced column.
    pub fields: BTreeMap<String, String>,
    /// The lifecycle `deleted_at` field ID.
    pub deleted_at: Option<String>,
    pub rules: Vec<Rule>,
}

impl Table {
    /// The typed key and row identity of a primary key in text form.
    pub fn identity(&self, key: &str) -> Result<(Value, RowIdentity), CaptureProblem> {
        let pk = self.manifest.primary_key();
        let wire =
            source_text::to_wire(pk.field_type().ty, key).ok_or(CaptureProblem::InvalidValue)?;
        let typed: TypedValue = value::decode_key(pk.field_type().ty, &wire)
            .map_err(|_| CaptureProblem::InvalidValue)?;
        Ok((wire, RowIdentity::of(&self.manifest, &typed)))
    }

    /// The wire row of a new image; unsent columns come from `base`.
    pub fn wire_row(
        &self,
        image: &SourceImage,
        base: Option<&Value>,
    ) -> Result<(Value, Row), CaptureProblem> {
        let mut row = Object::new();
        for (column, field_id) in &self.fields {
            let ty = self
                .manifest
                .field(field_id)
                .map(|f| f.field_type().ty)
                .ok_or(CaptureProblem::InvalidValue)?;
            let v = match image.get(column) {
                Some(None) => Value::Null,
                Some(Some(text)) => {
                    source_text::to_wire(ty, text).ok_or(CaptureProblem::InvalidValue)?
                }
                None => base
                    .and_then(Value::as_object)
                    .and_then(|o| o.get(field_id))
                    .cloned()
                    .ok_or(CaptureProblem::MissingProjection)?,
            };
            row.insert(field_id.clone(), v);
        }
        let decoded = self
            .manifest
            .decode_row(&row)
            .map_err(|_| CaptureProblem::InvalidValue)?;
        Ok((Value::Object(row), decoded))
    }

    /// Whether a wire row is a source tombstone.
    pub fn is_tombstone(&self, row: &Value) -> bool {
        self.deleted_at.as_ref().is_some_and(|f| {
            row.as_object()
                .and_then(|o| o.get(f))
                .is_some_and(|v| !matches!(v, Value::Null))
        })
    }

    /// The text a placeholder renders for column `column` of a wire row.
    pub fn render_value(&self, row: &Value, column: &str) -> Option<String> {
        let v = row.as_object()?.get(self.fields.get(column)?)?;
        placeholder_text(v)
    }
}

/// A wire value as scope-template text: strings verbatim, other scalars as JSON.
fn placeholder_text(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Number(n) => Some(n.lexeme().to_owned()),
        Value::Array(_) | Value::Object(_) => None,
    }
}

/// A dependency rule seen from its dependency relation.
#[derive(Clone, Debug)]
pub(crate) struct Impact {
    pub table_id: String,
    pub key: String,
}

/// The whole capture model.
#[derive(Clone, Debug)]
pub(crate) struct Model {
    pub manifest: Manifest,
    /// Registered relation -> table.
    pub tables: BTreeMap<String, Table>,
    /// table_id -> registered relation.
    pub relation_of: BTreeMap<String, String>,
    /// Dependency relation -> the tables whose membership it decides.
    pub impacts: BTreeMap<String, Vec<Impact>>,
    /// Captured relation -> its capture model's fingerprint (ADR 0020).
    pub fingerprints: BTreeMap<String, String>,
}

impl Model {
    /// Compiles a validated config against the manifest that describes it.
    pub fn new(config: &SyncConfig, manifest: Manifest) -> Result<Model, String> {
        let mut tables = BTreeMap::new();
        let mut relation_of = BTreeMap::new();
        let mut impacts: BTreeMap<String, Vec<Impact>> = BTreeMap::new();
        for t in &config.tables {
            let tm = manifest
                .table(&t.table_id)
                .ok_or_else(|| format!("table {} is not in the current manifest", t.table_id))?
                .clone();
            let template = |s: &str| ScopeTemplate::parse(s).map_err(|e| e.0);
            let mut rules = Vec::new();
            for r in &t.scopes {
                rules.push(match r {
                    MembershipRule::Template { template: s } => Rule::Own(template(s)?),
                    MembershipRule::Constant { constant } => Rule::Constant(constant.clone()),
                    MembershipRule::Dependency {
                        via,
                        key,
                        template: s,
                        ..
                    } => {
                        impacts.entry(via.clone()).or_default().push(Impact {
                            table_id: t.table_id.clone(),
                            key: key.clone(),
                        });
                        Rule::Via {
                            via: via.clone(),
                            key: key.clone(),
                            template: template(s)?,
                        }
                    }
                });
            }
            relation_of.insert(t.table_id.clone(), t.relation.clone());
            tables.insert(
                t.relation.clone(),
                Table {
                    manifest: tm,
                    primary_key: t.primary_key.clone(),
                    fields: t
                        .fields
                        .iter()
                        .map(|f| (f.column.clone(), f.field_id.clone()))
                        .collect(),
                    deleted_at: t
                        .lifecycle
                        .deleted_at
                        .as_deref()
                        .and_then(|c| t.field_id_of(c))
                        .map(str::to_owned),
                    rules,
                },
            );
        }
        Ok(Model {
            manifest,
            tables,
            relation_of,
            impacts,
            fingerprints: crate::capture::model_fingerprints(config),
        })
    }

    /// The registered table with this ID.
    pub fn table(&self, table_id: &str) -> Option<&Table> {
        self.tables.get(self.relation_of.get(table_id)?)
    }
}
