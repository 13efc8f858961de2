//! The contract between the ledger and the stores: the push ledger's
//! records, and the typed source writes of a push (what both stores do with
//! a registered row, with no protocol decision in them).

use std::collections::BTreeSet;

use protocol::digest::Digest;
use protocol::ids::CanonicalUuid;

use crate::capture::SourceImage;

/// A completed batch: what replay returns byte for byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredBatch {
    pub batch_id: CanonicalUuid,
    pub fingerprint: Digest,
    pub status: u16,
    /// The canonical response body.
    pub body: Vec<u8>,
}

/// A completed mutation: its terminal outcome, forever.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredMutation {
    pub mutation_id: CanonicalUuid,
    /// The batch it completed in.
    pub batch_id: CanonicalUuid,
    pub fingerprint: Digest,
    /// The canonical outcome object.
    pub outcome: Vec<u8>,
}

/// The ledger entries of one request's identities that exist.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerEntries {
    pub batch: Option<StoredBatch>,
    pub mutations: Vec<StoredMutation>,
}

/// Everything a first execution adds to the ledger, keyed by (user, client).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushRecord {
    pub user_id: String,
    pub client_id: String,
    pub batch: StoredBatch,
    /// The mutations that completed in this batch (reused ones are already stored).
    pub mutations: Vec<StoredMutation>,
}

/// Who writes: the push runs as this user, for this client's fences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Writer {
    pub user_id: String,
    pub client_id: String,
    /// Check deferrable constraints at the end of every write: each
    /// mutation is its own push unit (a non-atomic batch). Otherwise the
    /// group is the unit, checked when it ends.
    pub check_each_write: bool,
}

/// A registered table as push writes it: physical names only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteTarget {
    pub table_id: String,
    /// The schema-qualified relation.
    pub relation: String,
    /// The primary-key column.
    pub primary_key: String,
    /// Every synced column, the primary key included.
    pub columns: Vec<String>,
    /// Synced columns declared non-nullable. PostgreSQL enforces its own
    /// constraints; MemStore enforces these.
    pub not_null: BTreeSet<String>,
}

/// A row's version record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionRecord {
    /// The current opaque version.
    pub version: String,
    /// A hard delete left it: the deletion fence.
    pub deleted: bool,
}

/// One row as the writer finds it, locked when the writer can see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FoundRow {
    /// The primary key in text form.
    pub key: String,
    /// The synced columns, when the row exists and the writer may see it.
    pub visible: Option<SourceImage>,
    /// The row's version record, whether or not the writer may see the row.
    pub version: Option<VersionRecord>,
}

/// The source write of one mutation. Values are PostgreSQL text forms
/// (`None` is SQL NULL), keyed by column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowWrite {
    /// Inserts the row with this key; unnamed columns take their defaults.
    Insert {
        values: Vec<(String, Option<String>)>,
    },
    /// Sets these columns of the row with this key.
    Update {
        values: Vec<(String, Option<String>)>,
    },
    /// Deletes the row with this key.
    Delete,
}

/// What a source write did. A write that did not succeed has no effect:
/// the store undid it, triggers' writes included.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteResult {
    /// The row after the write as the writer sees it (`None` after a hard
    /// delete), and the version the write created.
    Written {
        row: Option<SourceImage>,
        version: String,
    },
    /// Zero rows changed: row security or a BEFORE trigger kept the row.
    Unchanged,
    Refused(Refusal),
}

/// Why the source refused a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Row security (a WITH CHECK, or the written row is not visible to the writer).
    Policy,
    /// A constraint, a value the column cannot take, or a trigger's exception.
    Constraint,
    /// The primary key is taken.
    DuplicateKey,
}
