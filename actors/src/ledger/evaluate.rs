//! One mutation's evaluation, in the spec's order: the terminal checks that
//! need no row (schema_incompatible, table_not_synced, the declarative
//! write rule, validation), then the row-state rules and the conflict
//! matrix under lock. Pure: the ledger does the I/O.

use std::collections::BTreeSet;

use protocol::ids::ServerVersion;
use protocol::json::Value;
use protocol::manifest::TableManifest;
use protocol::value::{self, PortableType};
use protocol::wire::push::{ConflictCode, Mutation, Operation};

use super::contract::FoundRow;
use crate::capture::source_text;
use crate::registry::SchemaHistory;

/// A terminal outcome decided before any row is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Early {
    /// Sorted, deduplicated field IDs that the current schema cannot represent.
    SchemaIncompatible(Vec<String>),
    TableNotSynced,
    PolicyRejected,
    ValidationFailed,
}

/// What a mutation writes once the row state allows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub table_id: String,
    /// The primary key in PostgreSQL text form.
    pub key: String,
    /// The authored values in text form, by column.
    pub values: Vec<(String, Option<String>)>,
}

/// The writable facts of a registered table that evaluation needs.
#[derive(Clone, Debug)]
pub struct TableRules {
    pub manifest: TableManifest,
    /// field ID -> column.
    pub columns: std::collections::BTreeMap<String, String>,
    /// The declarative write rule's field: it must equal the pushing user.
    pub owner: Option<String>,
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
    pub deleted_at: Option<String>,
}

impl TableRules {
    /// Whether a client may author `field_id`: declared writable, and neither
    /// the key nor a lifecycle field, whatever the declaration says.
    fn writable(&self, field_id: &str) -> bool {
        let lifecycle = [&self.created_at, &self.updated_at, &self.deleted_at];
        self.manifest.field(field_id).is_some_and(|f| f.writable())
            && field_id != self.manifest.primary_key_field_id()
            && !lifecycle.iter().any(|l| l.as_deref() == Some(field_id))
    }

    /// The column of a lifecycle field that holds a server timestamp.
    pub fn timestamp_column(&self, field_id: &Option<String>) -> Option<&str> {
        let f = field_id.as_deref()?;
        let ty = self.manifest.field(f)?.field_type().ty;
        (ty == PortableType::Datetime)
            .then(|| self.columns.get(f).map(String::as_str))
            .flatten()
    }

    /// The column of the owner field.
    pub fn owner_column(&self) -> Option<&str> {
        self.columns.get(self.owner.as_deref()?).map(String::as_str)
    }
}

/// The checks before any row is read, in the spec's precedence.
pub fn early(
    m: &Mutation,
    user_id: &str,
    history: &SchemaHistory,
    rules: Option<&TableRules>,
) -> Result<Planned, Early> {
    let authored_fields = || {
        std::iter::once(m.pk.field_id.clone())
            .chain(m.op.columns().into_iter().flat_map(|c| c.keys().cloned()))
    };
    let Some(rules) = rules else {
        // Was the table ever synced (in any stored manifest, or the authored one)?
        return Err(if history.ever_had_table(&m.table) {
            Early::SchemaIncompatible(sorted(authored_fields()))
        } else {
            Early::TableNotSynced
        });
    };
    let table = &rules.manifest;
    let authored = history
        .find(&m.authored_schema)
        .and_then(|a| a.table(&m.table).cloned());
    let representable = |field_id: &str| {
        let Some(now) = table.field(field_id) else {
            return false;
        };
        match authored.as_ref().and_then(|a| a.field(field_id)) {
            Some(then) => then.field_type().ty == now.field_type().ty,
            None => true,
        }
    };
    let mut incompatible: Vec<String> = authored_fields().filter(|f| !representable(f)).collect();
    if m.pk.field_id != table.primary_key_field_id() && !incompatible.contains(&m.pk.field_id) {
        incompatible.push(m.pk.field_id.clone());
    }
    if !incompatible.is_empty() {
        return Err(Early::SchemaIncompatible(sorted(incompatible.into_iter())));
    }
    // The declarative write rule: an authored owner must be the pushing user.
    if let (Some(owner), Some(columns)) = (&rules.owner, m.op.columns())
        && columns
            .get(owner)
            .is_some_and(|v| v.as_str() != Some(user_id))
    {
        return Err(Early::PolicyRejected);
    }
    // Validation: writable fields, values of their types, a key of the key's type.
    let pk_type = table.primary_key().field_type().ty;
    let key = value::decode_key(pk_type, &m.pk.value)
        .ok()
        .and_then(|_| source_text::from_wire(pk_type, &m.pk.value))
        .ok_or(Early::ValidationFailed)?;
    let mut values = Vec::new();
    for (field_id, v) in m.op.columns().into_iter().flatten() {
        let field = table.field(field_id).ok_or(Early::ValidationFailed)?;
        if !rules.writable(field_id) {
            return Err(Early::ValidationFailed);
        }
        value::decode(field.field_type(), v).map_err(|_| Early::ValidationFailed)?;
        let text = match v {
            Value::Null => None,
            v => Some(
                source_text::from_wire(field.field_type().ty, v).ok_or(Early::ValidationFailed)?,
            ),
        };
        let column = rules.columns.get(field_id).ok_or(Early::ValidationFailed)?;
        values.push((column.clone(), text));
    }
    Ok(Planned {
        table_id: m.table.clone(),
        key,
        values,
    })
}

/// Whether the mutation's key is a canonical value of its key field's type:
/// the type in the authored manifest when it has the field (a type that
/// changed since is `schema_incompatible`, decided later), else the
/// current one. A key of another JSON kind or spelling names no row under
/// any schema the client was given, so the whole request is invalid (the
/// spec's 400 for an invalid typed primary key). A key of an unknown table
/// or field is left to the per-mutation outcomes.
pub fn typed_key_is_valid(
    m: &Mutation,
    history: &SchemaHistory,
    rules: Option<&TableRules>,
) -> bool {
    let Some(current) = rules.map(|r| &r.manifest) else {
        return true;
    };
    if m.pk.field_id != current.primary_key_field_id() {
        return true;
    }
    let authored = history
        .find(&m.authored_schema)
        .and_then(|a| a.table(&m.table))
        .and_then(|t| t.field(&m.pk.field_id));
    let field = authored.unwrap_or(current.primary_key());
    value::decode_key(field.field_type().ty, &m.pk.value).is_ok()
}

fn sorted(ids: impl Iterator<Item = String>) -> Vec<String> {
    let set: BTreeSet<String> = ids.collect();
    set.into_iter().collect() // BTreeSet<String> orders by bytes
}

/// The state of the target row, as the conflict matrix sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowState {
    /// No row and no version: true absence.
    Absent,
    /// A hard delete left only its fence.
    FenceOnly(ServerVersion),
    /// A live row the writer may not see (row security, or the declarative rule).
    Hidden,
    /// A row the writer sees; `tombstone` when its `deleted_at` is set.
    Visible {
        version: ServerVersion,
        tombstone: bool,
    },
}

/// What the row state decides for a mutation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Write,
    Conflict(ConflictCode),
    PolicyRejected,
}

/// The row-state rules and the conflict matrix.
pub fn decide(op: &Operation, state: &RowState) -> Decision {
    match (state, op) {
        (RowState::Hidden, _) => Decision::PolicyRejected,
        (RowState::FenceOnly(_), _)
        | (
            RowState::Visible {
                tombstone: true, ..
            },
            _,
        ) => Decision::Conflict(ConflictCode::RowDeleted),
        (RowState::Absent, Operation::Insert { .. }) => Decision::Write,
        (RowState::Absent, _) => Decision::Conflict(ConflictCode::RowNotFound),
        (RowState::Visible { .. }, Operation::Insert { .. }) => {
            Decision::Conflict(ConflictCode::RowAlreadyExists)
        }
        (RowState::Visible { version, .. }, Operation::Update { base_version, .. })
        | (RowState::Visible { version, .. }, Operation::Delete { base_version }) => {
            // Byte-for-byte equality, under the row lock the store holds.
            if base_version.as_str().as_bytes() == version.as_str().as_bytes() {
                Decision::Write
            } else {
                Decision::Conflict(ConflictCode::VersionConflict)
            }
        }
    }
}

/// Why a found row cannot be given a row state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateError {
    /// A visible registered row without a version (it predates capture).
    Unversioned,
    /// A stored version that is not a server version.
    BadVersion,
}

/// The row state of a found row; `owned` says whether the declarative rule lets the user write it.
pub fn row_state(found: &FoundRow, tombstone: bool, owned: bool) -> Result<RowState, StateError> {
    let version = |v: &str| ServerVersion::parse(v).ok_or(StateError::BadVersion);
    Ok(match (&found.visible, &found.version) {
        (Some(_), None) => return Err(StateError::Unversioned),
        (Some(_), Some(_)) if !owned => RowState::Hidden,
        (Some(_), Some(v)) => RowState::Visible {
            version: version(&v.version)?,
            tombstone,
        },
        (None, Some(v)) if v.deleted => RowState::FenceOnly(version(&v.version)?),
        (None, Some(_)) => RowState::Hidden,
        (None, None) => RowState::Absent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::wire::push::Columns;

    fn v(s: &str) -> ServerVersion {
        ServerVersion::parse(s).unwrap()
    }

    #[test]
    fn the_conflict_matrix_has_every_cell() {
        let insert = Operation::Insert {
            columns: Columns::new(),
        };
        let update = |b: &str| Operation::Update {
            base_version: v(b),
            columns: Columns::new(),
        };
        let delete = |b: &str| Operation::Delete { base_version: v(b) };
        let live = RowState::Visible {
            version: v("cur"),
            tombstone: false,
        };
        let tomb = RowState::Visible {
            version: v("cur"),
            tombstone: true,
        };
        let fence = RowState::FenceOnly(v("cur"));
        let write = Decision::Write;
        let c = Decision::Conflict;
        use ConflictCode::*;
        let cases = [
            (RowState::Absent, insert.clone(), write.clone()),
            (RowState::Absent, update("cur"), c(RowNotFound)),
            (RowState::Absent, delete("cur"), c(RowNotFound)),
            (live.clone(), insert.clone(), c(RowAlreadyExists)),
            (live.clone(), update("cur"), write.clone()),
            (live.clone(), delete("cur"), write.clone()),
            (live.clone(), update("old"), c(VersionConflict)),
            (live.clone(), delete("old"), c(VersionConflict)),
            (tomb.clone(), insert.clone(), c(RowDeleted)),
            (tomb.clone(), update("cur"), c(RowDeleted)),
            (tomb.clone(), delete("old"), c(RowDeleted)),
            (fence.clone(), insert.clone(), c(RowDeleted)),
            (fence.clone(), update("cur"), c(RowDeleted)),
            (fence.clone(), delete("old"), c(RowDeleted)),
            (RowState::Hidden, insert.clone(), Decision::PolicyRejected),
            (RowState::Hidden, update("cur"), Decision::PolicyRejected),
            (RowState::Hidden, delete("cur"), Decision::PolicyRejected),
        ];
        for (state, op, want) in cases {
            assert_eq!(decide(&op, &state), want, "{state:?} {}", op.name());
        }
    }

    #[test]
    fn row_states_come_from_visibility_and_the_version_record() {
        use super::super::contract::VersionRecord;
        let found = |visible: bool, version: Option<(&str, bool)>| FoundRow {
            key: "k".into(),
            visible: visible.then(Default::default),
            version: version.map(|(v, deleted)| VersionRecord {
                version: v.into(),
                deleted,
            }),
        };
        assert_eq!(
            row_state(&found(false, None), false, true),
            Ok(RowState::Absent)
        );
        assert_eq!(
            row_state(&found(false, Some(("v", true))), false, true),
            Ok(RowState::FenceOnly(v("v")))
        );
        // Live by its version record, yet not visible: hidden, never absent.
        assert_eq!(
            row_state(&found(false, Some(("v", false))), false, true),
            Ok(RowState::Hidden)
        );
        assert_eq!(
            row_state(&found(true, Some(("v", false))), false, false),
            Ok(RowState::Hidden)
        );
        assert_eq!(
            row_state(&found(true, Some(("v", false))), true, true),
            Ok(RowState::Visible {
                version: v("v"),
                tombstone: true
            })
        );
        assert_eq!(
            row_state(&found(true, None), false, true),
            Err(StateError::Unversioned)
        );
    }
}
