//! MemStore's push ledger and source writes. MemStore has no row security,
//! no triggers of the application and no deferred constraints: its writer
//! sees every row, and its only constraint is the declared non-null columns.

use std::collections::BTreeMap;

use protocol::ids::CanonicalUuid;

use super::MemTx;
use crate::capture::SourceImage;
use crate::ledger::contract::{
    FoundRow, LedgerEntries, PushRecord, Refusal, RowWrite, StoredBatch, StoredMutation,
    VersionRecord, WriteResult, WriteTarget, Writer,
};
use crate::ledger::intake::{check_keys, keeps_as_given};
use crate::store::StoreError;

/// (user, client, id): ledger identities are scoped to the authenticated client.
pub(super) type LedgerKey = (String, String, CanonicalUuid);

/// The push ledger: completed batches and mutations, kept until the
/// client is retired.
#[derive(Clone, Debug, Default)]
pub(super) struct Ledger {
    batches: BTreeMap<LedgerKey, StoredBatch>,
    mutations: BTreeMap<LedgerKey, StoredMutation>,
}

impl Ledger {
    /// Drops a retired client's outcomes.
    pub(super) fn forget_client(&mut self, user_id: &str, client_id: &str) {
        let other = |(u, c, _): &LedgerKey| u != user_id || c != client_id;
        self.batches.retain(|k, _| other(k));
        self.mutations.retain(|k, _| other(k));
    }
}

impl MemTx {
    pub(super) fn push_ledger(
        &self,
        user_id: &str,
        client_id: &str,
        batch_id: CanonicalUuid,
        mutation_ids: &[CanonicalUuid],
    ) -> LedgerEntries {
        let key = |id| (user_id.to_owned(), client_id.to_owned(), id);
        let ledger = &self.work.ledger;
        LedgerEntries {
            batch: ledger.batches.get(&key(batch_id)).cloned(),
            mutations: mutation_ids
                .iter()
                .filter_map(|id| ledger.mutations.get(&key(*id)).cloned())
                .collect(),
        }
    }

    pub(super) fn record_push(&mut self, r: &PushRecord) -> Result<(), StoreError> {
        let key = |id| (r.user_id.clone(), r.client_id.clone(), id);
        let ledger = &mut self.work.ledger;
        if ledger
            .batches
            .insert(key(r.batch.batch_id), r.batch.clone())
            .is_some()
        {
            return Err(StoreError::Integrity("a batch completed twice".into()));
        }
        for m in &r.mutations {
            if ledger
                .mutations
                .insert(key(m.mutation_id), m.clone())
                .is_some()
            {
                return Err(StoreError::Integrity("a mutation completed twice".into()));
            }
        }
        Ok(())
    }

    pub(super) fn begin_writes(&mut self, w: &Writer) {
        self.work.capture.writer = Some(w.client_id.clone());
    }

    pub(super) fn end_writes(&mut self) {
        self.work.capture.writer = None;
    }

    pub(super) fn find_rows(
        &self,
        target: &WriteTarget,
        keys: &[String],
    ) -> Result<Vec<FoundRow>, StoreError> {
        check_keys(
            self.column_type(&target.relation, &target.primary_key),
            keys,
        )?;
        Ok(keys
            .iter()
            .map(|key| FoundRow {
                key: key.clone(),
                visible: self.synced_row(target, key),
                version: self.version_record(target, key),
            })
            .collect())
    }

    /// The declared type of a source column (`text` unless declared).
    fn column_type(&self, relation: &str, column: &str) -> &str {
        self.work
            .capture
            .column_types
            .get(&(relation.to_owned(), column.to_owned()))
            .map_or("text", String::as_str)
    }

    /// Whether every value is one its column keeps as given.
    fn values_kept(&self, target: &WriteTarget, values: &[(String, Option<String>)]) -> bool {
        values.iter().all(|(c, v)| {
            v.as_deref()
                .is_none_or(|v| keeps_as_given(self.column_type(&target.relation, c), v))
        })
    }

    fn key_image(target: &WriteTarget, key: &str) -> SourceImage {
        [(target.primary_key.clone(), Some(key.to_owned()))].into()
    }

    /// The row's synced columns, if it exists.
    fn synced_row(&self, target: &WriteTarget, key: &str) -> Option<SourceImage> {
        let row = self.source_row(&target.relation, &MemTx::key_image(target, key))?;
        Some(
            target
                .columns
                .iter()
                .map(|c| (c.clone(), row.get(c).cloned().flatten()))
                .collect(),
        )
    }

    fn version_record(&self, target: &WriteTarget, key: &str) -> Option<VersionRecord> {
        let v = self
            .work
            .capture
            .versions
            .get(&(target.table_id.clone(), key.to_owned()))?;
        Some(VersionRecord {
            version: v.version.clone(),
            deleted: v.deleted,
        })
    }

    pub(super) fn write_row(
        &mut self,
        target: &WriteTarget,
        key: &str,
        write: &RowWrite,
    ) -> Result<WriteResult, StoreError> {
        if self.relation_key(&target.relation) != Some(std::slice::from_ref(&target.primary_key)) {
            return Err(StoreError::Integrity(
                "a push target is not a registered relation".into(),
            ));
        }
        let key_image = MemTx::key_image(target, key);
        let violates = |row: &SourceImage| {
            target
                .not_null
                .iter()
                .any(|c| row.get(c).is_none_or(Option::is_none))
        };
        // Every check happens before the write, so a refused write changes nothing.
        if let RowWrite::Insert { values } | RowWrite::Update { values } = write
            && !self.values_kept(target, values)
        {
            return Ok(WriteResult::Refused(Refusal::Constraint));
        }
        let result = match write {
            RowWrite::Insert { values } => {
                let mut row: SourceImage =
                    target.columns.iter().map(|c| (c.clone(), None)).collect();
                row.extend(values.iter().cloned());
                row.insert(target.primary_key.clone(), Some(key.to_owned()));
                if self.source_row(&target.relation, &key_image).is_some() {
                    return Ok(WriteResult::Refused(Refusal::DuplicateKey));
                }
                if violates(&row) {
                    return Ok(WriteResult::Refused(Refusal::Constraint));
                }
                self.source_insert(&target.relation, row)
            }
            RowWrite::Update { values } => {
                let Some(mut row) = self.source_row(&target.relation, &key_image) else {
                    return Ok(WriteResult::Unchanged);
                };
                row.extend(values.iter().cloned());
                if violates(&row) {
                    return Ok(WriteResult::Refused(Refusal::Constraint));
                }
                self.source_update(
                    &target.relation,
                    &key_image,
                    values.iter().cloned().collect(),
                )
            }
            RowWrite::Delete => {
                if self.source_row(&target.relation, &key_image).is_none() {
                    return Ok(WriteResult::Unchanged);
                }
                self.source_delete(&target.relation, &key_image)
            }
        };
        match result {
            Ok(Some(_fence)) => {}
            Ok(None) => {
                return Err(StoreError::Integrity(
                    "a registered row changed without a version".into(),
                ));
            }
            Err(e) => {
                return Err(StoreError::Integrity(format!(
                    "a checked source write failed: {e:?}"
                )));
            }
        }
        let version = self
            .version_record(target, key)
            .ok_or(StoreError::Integrity("a written row has no version".into()))?;
        Ok(WriteResult::Written {
            row: self.synced_row(target, key),
            version: version.version,
        })
    }
}
