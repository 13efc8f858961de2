//! Immutable schema manifests, their SHA-256 hash, schema references, and
//! decoding of complete rows against a table (INTEGRITY.md "Schema manifest hash").

use crate::json::{self, Object, Value, object};
use crate::limits::{MAX_SAFE_INTEGER, MAX_SCOPE_ID_OCTETS};
use crate::members::{self, Members, ShapeError};
use crate::sha256::Digest;
use crate::value::{self, DecimalBounds, FieldType, PortableType, TypedValue, ValueError};

/// A reference to one immutable manifest: positive version and its hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SchemaRef {
    pub version: u64,
    pub hash: Digest,
}

impl SchemaRef {
    /// `{"version":…,"hash":…}`.
    pub fn to_json(&self) -> Value {
        object([
            ("version", Value::int(self.version as i64)),
            ("hash", Value::string(self.hash.to_hex())),
        ])
    }

    /// Reads a normal reference: exactly `version` (1..=2^53-1) and a 64-hex `hash`.
    pub fn from_json(v: &Value) -> Option<SchemaRef> {
        let o = v.as_object()?;
        if o.len() != 2 {
            return None;
        }
        let version = members::integer(o.get("version")?, "version", 1).ok()?;
        let hash = Digest::from_hex(o.get("hash")?.as_str()?)?;
        Some(SchemaRef { version, hash })
    }
}

/// How a manifest relates to its parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum TransitionClass {
    Initial,
    Class2,
    Class3,
    Class4,
}

impl TransitionClass {
    /// The manifest spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TransitionClass::Initial => "initial",
            TransitionClass::Class2 => "class_2",
            TransitionClass::Class3 => "class_3",
            TransitionClass::Class4 => "class_4",
        }
    }

    fn from_str(s: &str) -> Option<TransitionClass> {
        [
            TransitionClass::Initial,
            TransitionClass::Class2,
            TransitionClass::Class3,
            TransitionClass::Class4,
        ]
        .into_iter()
        .find(|c| c.as_str() == s)
    }
}

/// Whether a table's rows belong to one scope or may belong to many.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Composition {
    SingleScope,
    MultiScope,
}

impl Composition {
    /// The manifest spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Composition::SingleScope => "single_scope",
            Composition::MultiScope => "multi_scope",
        }
    }
}

/// Field IDs of a table's lifecycle columns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lifecycle {
    pub created_at_field_id: Option<String>,
    pub updated_at_field_id: Option<String>,
    pub deleted_at_field_id: Option<String>,
}

/// One synced field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldManifest {
    field_id: String,
    name: String,
    field_type: FieldType,
    writable: bool,
}

impl FieldManifest {
    /// A field; decimals must carry bounds and no other type may.
    pub fn new(
        field_id: impl Into<String>,
        name: impl Into<String>,
        field_type: FieldType,
        writable: bool,
    ) -> Result<FieldManifest, ManifestError> {
        let f = FieldManifest {
            field_id: field_id.into(),
            name: name.into(),
            field_type,
            writable,
        };
        check_id(&f.field_id)?;
        if (field_type.ty == PortableType::Decimal) != field_type.decimal.is_some() {
            return Err(ManifestError(
                "decimal fields, and only they, carry precision and scale",
            ));
        }
        if let Some(b) = field_type.decimal
            && (b.precision == 0 || b.scale > b.precision)
        {
            return Err(ManifestError(
                "decimal precision must be positive and at least the scale",
            ));
        }
        Ok(f)
    }

    /// The immutable logical field ID.
    pub fn field_id(&self) -> &str {
        &self.field_id
    }

    /// The human-readable name (an attribute, not an identity).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Type, nullability and decimal bounds.
    pub fn field_type(&self) -> &FieldType {
        &self.field_type
    }

    /// Whether clients may author this field.
    pub fn writable(&self) -> bool {
        self.writable
    }

    fn to_json(&self) -> Value {
        let mut o = Object::new();
        o.insert("field_id".into(), Value::string(&self.field_id));
        o.insert("name".into(), Value::string(&self.name));
        o.insert("type".into(), Value::string(self.field_type.ty.name()));
        o.insert("nullable".into(), Value::Bool(self.field_type.nullable));
        o.insert("writable".into(), Value::Bool(self.writable));
        if let Some(b) = self.field_type.decimal {
            o.insert("precision".into(), Value::int(b.precision as i64));
            o.insert("scale".into(), Value::int(b.scale as i64));
        }
        Value::Object(o)
    }
}

/// One synced table; fields are kept sorted by the bytes of their IDs.
#[derive(Clone, Debug, PartialEq)]
pub struct TableManifest {
    table_id: String,
    relation_id: String,
    name: String,
    composition: Composition,
    primary_key_field_id: String,
    primary_key_index: usize,
    lifecycle: Lifecycle,
    fields: Vec<FieldManifest>,
    indexes: Vec<Value>,
}

/// A manifest that breaks a structural rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManifestError(pub &'static str);

impl std::fmt::Display for ManifestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for ManifestError {}

fn check_id(id: &str) -> Result<(), ManifestError> {
    if (1..=MAX_SCOPE_ID_OCTETS).contains(&id.len()) {
        Ok(())
    } else {
        Err(ManifestError("identifiers must be 1..=512 octets"))
    }
}

impl TableManifest {
    /// A table; checks the key field, lifecycle references and ID uniqueness.
    pub fn new(
        table_id: impl Into<String>,
        relation_id: impl Into<String>,
        name: impl Into<String>,
        composition: Composition,
        primary_key_field_id: impl Into<String>,
        lifecycle: Lifecycle,
        mut fields: Vec<FieldManifest>,
    ) -> Result<TableManifest, ManifestError> {
        let table_id = table_id.into();
        let relation_id = relation_id.into();
        check_id(&table_id)?;
        check_id(&relation_id)?;
        fields.sort_by(|a, b| a.field_id.as_bytes().cmp(b.field_id.as_bytes()));
        if fields.windows(2).any(|w| w[0].field_id == w[1].field_id) {
            return Err(ManifestError("field IDs must be unique within a table"));
        }
        let primary_key_field_id = primary_key_field_id.into();
        let primary_key_index = fields
            .iter()
            .position(|f| f.field_id == primary_key_field_id)
            .ok_or(ManifestError(
                "the primary key must be one of the table's fields",
            ))?;
        let key = &fields[primary_key_index].field_type;
        if key.nullable || !key.ty.is_key_type() {
            return Err(ManifestError(
                "the primary key must be a non-null string, int or int64",
            ));
        }
        // A row's identity never changes, so no client may author its key field.
        if fields[primary_key_index].writable {
            return Err(ManifestError("the primary key field must not be writable"));
        }
        for id in [
            &lifecycle.created_at_field_id,
            &lifecycle.updated_at_field_id,
            &lifecycle.deleted_at_field_id,
        ]
        .into_iter()
        .flatten()
        {
            if !fields.iter().any(|f| &f.field_id == id) {
                return Err(ManifestError(
                    "lifecycle fields must be fields of the table",
                ));
            }
        }
        Ok(TableManifest {
            table_id,
            relation_id,
            name: name.into(),
            composition,
            primary_key_field_id,
            primary_key_index,
            lifecycle,
            fields,
            indexes: Vec::new(),
        })
    }

    /// The immutable logical table ID (the wire `table`).
    pub fn table_id(&self) -> &str {
        &self.table_id
    }

    /// The immutable logical relation ID.
    pub fn relation_id(&self) -> &str {
        &self.relation_id
    }

    /// The human-readable name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Single- or multi-scope rows.
    pub fn composition(&self) -> Composition {
        self.composition
    }

    /// The primary-key field ID.
    pub fn primary_key_field_id(&self) -> &str {
        &self.primary_key_field_id
    }

    /// The primary-key field.
    pub fn primary_key(&self) -> &FieldManifest {
        &self.fields[self.primary_key_index]
    }

    /// Lifecycle field IDs.
    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    /// Fields sorted by the bytes of their IDs.
    pub fn fields(&self) -> &[FieldManifest] {
        &self.fields
    }

    /// The field with `field_id`.
    pub fn field(&self, field_id: &str) -> Option<&FieldManifest> {
        self.fields
            .binary_search_by(|f| f.field_id.as_bytes().cmp(field_id.as_bytes()))
            .ok()
            .map(|i| &self.fields[i])
    }

    /// Decodes a complete authoritative row: every field exactly once, nothing else.
    pub fn decode_row(&self, row: &Object) -> Result<Row, RowError> {
        if row.len() != self.fields.len() {
            return Err(if row.len() > self.fields.len() {
                RowError::UnknownField
            } else {
                RowError::MissingField
            });
        }
        let mut values = Vec::with_capacity(self.fields.len());
        for f in &self.fields {
            let v = row.get(&f.field_id).ok_or(RowError::MissingField)?;
            values.push(value::decode(&f.field_type, v).map_err(RowError::Value)?);
        }
        Ok(Row { values })
    }

    /// The row's primary-key value.
    pub fn row_key<'r>(&self, row: &'r Row) -> Option<&'r TypedValue> {
        row.values.get(self.primary_key_index)?.as_ref()
    }

    /// The row's values as a wire object keyed by field ID.
    pub fn row_to_json(&self, row: &Row) -> Value {
        let members = self.fields.iter().zip(&row.values).map(|(f, v)| {
            (
                f.field_id.clone(),
                v.as_ref().map_or(Value::Null, TypedValue::to_wire),
            )
        });
        Value::Object(members.collect())
    }

    fn to_json(&self) -> Value {
        let id = |s: &Option<String>| s.as_ref().map_or(Value::Null, Value::string);
        let mut o = Object::new();
        o.insert("table_id".into(), Value::string(&self.table_id));
        o.insert("relation_id".into(), Value::string(&self.relation_id));
        o.insert("name".into(), Value::string(&self.name));
        o.insert(
            "composition".into(),
            Value::string(self.composition.as_str()),
        );
        o.insert(
            "primary_key_field_id".into(),
            Value::string(&self.primary_key_field_id),
        );
        o.insert(
            "lifecycle".into(),
            object([
                (
                    "created_at_field_id",
                    id(&self.lifecycle.created_at_field_id),
                ),
                (
                    "updated_at_field_id",
                    id(&self.lifecycle.updated_at_field_id),
                ),
                (
                    "deleted_at_field_id",
                    id(&self.lifecycle.deleted_at_field_id),
                ),
            ]),
        );
        o.insert(
            "fields".into(),
            Value::Array(self.fields.iter().map(FieldManifest::to_json).collect()),
        );
        o.insert("indexes".into(), Value::Array(self.indexes.clone()));
        Value::Object(o)
    }
}

/// A complete authoritative row: one value per synced field, in the table's
/// field order (sorted by field-ID bytes). Built by [`TableManifest::decode_row`].
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    pub(crate) values: Vec<Option<TypedValue>>,
}

impl Row {
    /// The values in field-ID order; `None` is SQL NULL.
    pub fn values(&self) -> &[Option<TypedValue>] {
        &self.values
    }
}

/// Why a row object is not a complete authoritative row of its table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowError {
    MissingField,
    UnknownField,
    Value(ValueError),
}

/// One immutable schema manifest with its hash.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    schema_version: u64,
    parent_schema: Option<SchemaRef>,
    transition_class: TransitionClass,
    compatibility_floor: u64,
    tables: Vec<TableManifest>,
    hash: Digest,
}

impl Manifest {
    /// A manifest; tables are sorted by ID and the hash is computed once.
    pub fn new(
        schema_version: u64,
        parent_schema: Option<SchemaRef>,
        transition_class: TransitionClass,
        compatibility_floor: u64,
        mut tables: Vec<TableManifest>,
    ) -> Result<Manifest, ManifestError> {
        if !(1..=MAX_SAFE_INTEGER).contains(&schema_version) {
            return Err(ManifestError(
                "schema_version must be a positive portable integer",
            ));
        }
        if !(1..=schema_version).contains(&compatibility_floor) {
            return Err(ManifestError(
                "compatibility_floor must be within 1..=schema_version",
            ));
        }
        match (&parent_schema, transition_class) {
            (None, TransitionClass::Initial) => {}
            (Some(p), c) if c != TransitionClass::Initial && p.version < schema_version => {}
            _ => {
                return Err(ManifestError(
                    "only an initial manifest has no parent; a parent is older",
                ));
            }
        }
        tables.sort_by(|a, b| a.table_id.as_bytes().cmp(b.table_id.as_bytes()));
        if tables.windows(2).any(|w| w[0].table_id == w[1].table_id) {
            return Err(ManifestError("table IDs must be unique"));
        }
        let mut m = Manifest {
            schema_version,
            parent_schema,
            transition_class,
            compatibility_floor,
            tables,
            hash: Digest([0; 32]),
        };
        let preimage = json::to_canonical(&m.body_json());
        m.hash = Digest::of("synchro:v3:schema-manifest:v1", &preimage);
        Ok(m)
    }

    /// The positive schema version.
    pub fn schema_version(&self) -> u64 {
        self.schema_version
    }

    /// The SHA-256 manifest hash.
    pub fn hash(&self) -> Digest {
        self.hash
    }

    /// The reference `{version, hash}` to this manifest.
    pub fn reference(&self) -> SchemaRef {
        SchemaRef {
            version: self.schema_version,
            hash: self.hash,
        }
    }

    /// The parent reference; `None` for the initial manifest.
    pub fn parent_schema(&self) -> Option<SchemaRef> {
        self.parent_schema
    }

    /// The transition class from the parent.
    pub fn transition_class(&self) -> TransitionClass {
        self.transition_class
    }

    /// The oldest schema version still compatible with this one.
    pub fn compatibility_floor(&self) -> u64 {
        self.compatibility_floor
    }

    /// Tables sorted by the bytes of their IDs.
    pub fn tables(&self) -> &[TableManifest] {
        &self.tables
    }

    /// The table with `table_id`.
    pub fn table(&self, table_id: &str) -> Option<&TableManifest> {
        self.tables
            .binary_search_by(|t| t.table_id.as_bytes().cmp(table_id.as_bytes()))
            .ok()
            .map(|i| &self.tables[i])
    }

    /// The manifest without `schema_hash`: the hash preimage before JCS.
    fn body_json(&self) -> Value {
        let mut o = Object::new();
        o.insert(
            "schema_version".into(),
            Value::int(self.schema_version as i64),
        );
        o.insert(
            "parent_schema".into(),
            self.parent_schema.map_or(Value::Null, |p| p.to_json()),
        );
        o.insert(
            "transition_class".into(),
            Value::string(self.transition_class.as_str()),
        );
        o.insert(
            "compatibility_floor".into(),
            Value::int(self.compatibility_floor as i64),
        );
        o.insert(
            "tables".into(),
            Value::Array(self.tables.iter().map(TableManifest::to_json).collect()),
        );
        Value::Object(o)
    }

    /// The connect `schema_definition` object (the manifest plus `schema_hash`).
    pub fn to_json(&self) -> Value {
        let mut v = self.body_json();
        if let Value::Object(o) = &mut v {
            o.insert("schema_hash".into(), Value::string(self.hash.to_hex()));
        }
        v
    }

    /// Reads a `schema_definition`; the stated hash must equal the computed one.
    pub fn from_json(v: Value) -> Result<Manifest, ShapeError> {
        let mut m = Members::new(v, "schema_definition")?;
        let version = members::integer(&m.take("schema_version")?, "schema_version", 1)?;
        let hash = members::string(m.take("schema_hash")?, "schema_hash", 64, 64)?;
        let parent = match m.take("parent_schema")? {
            Value::Null => None,
            p => Some(
                SchemaRef::from_json(&p)
                    .ok_or(ShapeError::member("parent_schema", "is invalid"))?,
            ),
        };
        let class = m.take("transition_class")?;
        let class = class
            .as_str()
            .and_then(TransitionClass::from_str)
            .ok_or(ShapeError::member("transition_class", "is invalid"))?;
        let floor = members::integer(&m.take("compatibility_floor")?, "compatibility_floor", 1)?;
        let Value::Array(tables) = m.take("tables")? else {
            return Err(ShapeError::member("tables", "must be an array"));
        };
        m.finish()?;
        let tables = tables
            .into_iter()
            .map(table_from_json)
            .collect::<Result<Vec<_>, _>>()?;
        let manifest = Manifest::new(version, parent, class, floor, tables)
            .map_err(|e| ShapeError(e.0.into()))?;
        if Digest::from_hex(&hash) != Some(manifest.hash) {
            return Err(ShapeError::member(
                "schema_hash",
                "does not match the manifest",
            ));
        }
        Ok(manifest)
    }
}

fn table_from_json(v: Value) -> Result<TableManifest, ShapeError> {
    let mut m = Members::new(v, "table")?;
    let id = |v: Value, name| members::string(v, name, 1, MAX_SCOPE_ID_OCTETS);
    let table_id = id(m.take("table_id")?, "table_id")?;
    let relation_id = id(m.take("relation_id")?, "relation_id")?;
    let name = members::string(m.take("name")?, "name", 0, usize::MAX)?;
    let composition = match m.take("composition")?.as_str() {
        Some("single_scope") => Composition::SingleScope,
        Some("multi_scope") => Composition::MultiScope,
        _ => return Err(ShapeError::member("composition", "is invalid")),
    };
    let pk = id(m.take("primary_key_field_id")?, "primary_key_field_id")?;
    let mut lc = Members::new(m.take("lifecycle")?, "lifecycle")?;
    let mut lifecycle_id = |name: &'static str| -> Result<Option<String>, ShapeError> {
        match lc.take(name)? {
            Value::Null => Ok(None),
            v => id(v, name).map(Some),
        }
    };
    let lifecycle = Lifecycle {
        created_at_field_id: lifecycle_id("created_at_field_id")?,
        updated_at_field_id: lifecycle_id("updated_at_field_id")?,
        deleted_at_field_id: lifecycle_id("deleted_at_field_id")?,
    };
    lc.finish()?;
    let Value::Array(fields) = m.take("fields")? else {
        return Err(ShapeError::member("fields", "must be an array"));
    };
    let Value::Array(indexes) = m.take("indexes")? else {
        return Err(ShapeError::member("indexes", "must be an array"));
    };
    m.finish()?;
    let fields = fields
        .into_iter()
        .map(field_from_json)
        .collect::<Result<Vec<_>, _>>()?;
    let mut table = TableManifest::new(
        table_id,
        relation_id,
        name,
        composition,
        pk,
        lifecycle,
        fields,
    )
    .map_err(|e| ShapeError(e.0.into()))?;
    table.indexes = indexes;
    Ok(table)
}

fn field_from_json(v: Value) -> Result<FieldManifest, ShapeError> {
    let mut m = Members::new(v, "field")?;
    let field_id = members::string(m.take("field_id")?, "field_id", 1, MAX_SCOPE_ID_OCTETS)?;
    let name = members::string(m.take("name")?, "name", 0, usize::MAX)?;
    let ty = m
        .take("type")?
        .as_str()
        .and_then(PortableType::from_name)
        .ok_or(ShapeError::member("type", "is not a portable type"))?;
    let nullable = members::boolean(&m.take("nullable")?, "nullable")?;
    let writable = members::boolean(&m.take("writable")?, "writable")?;
    let decimal = if ty == PortableType::Decimal {
        let bound = |v: Value, name| {
            members::integer(&v, name, 0).and_then(|n| {
                u32::try_from(n).map_err(|_| ShapeError::member(name, "is out of range"))
            })
        };
        let precision = bound(m.take("precision")?, "precision")?;
        let scale = bound(m.take("scale")?, "scale")?;
        Some(DecimalBounds { precision, scale })
    } else {
        None
    };
    m.finish()?;
    FieldManifest::new(
        field_id,
        name,
        FieldType {
            ty,
            nullable,
            decimal,
        },
        writable,
    )
    .map_err(|e| ShapeError(e.0.into()))
}
