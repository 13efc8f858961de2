//! The push ledger on PostgreSQL: `synchro.push_batches` and
//! `synchro.push_mutations`, read and written in one statement each.

use actors::ledger::contract::{LedgerEntries, PushRecord, StoredBatch, StoredMutation};
use actors::store::StoreError;
use protocol::digest::Digest;
use protocol::ids::CanonicalUuid;
use sqlx::Row;

use crate::{PgTx, db_error};

impl PgTx {
    /// Both lookups in one round trip: the batch row (kind `b`) and the
    /// mutation rows (kind `m`).
    pub(crate) async fn read_push_ledger(
        &mut self,
        user_id: &str,
        client_id: &str,
        batch_id: CanonicalUuid,
        mutation_ids: &[CanonicalUuid],
    ) -> Result<LedgerEntries, StoreError> {
        let ids: Vec<String> = mutation_ids.iter().map(|u| u.to_string()).collect();
        let rows = sqlx::query(
            "SELECT 'b', NULL, NULL, fingerprint, status, body FROM synchro.push_batches \
               WHERE user_id = $1 AND client_id = $2 AND batch_id = $3::uuid \
             UNION ALL \
             SELECT 'm', mutation_id::text, batch_id::text, fingerprint, NULL, outcome \
               FROM synchro.push_mutations \
               WHERE user_id = $1 AND client_id = $2 AND mutation_id = ANY($4::text[]::uuid[])",
        )
        // Planned for each call: a cached generic plan would keep the scan
        // chosen while the tables were small.
        .persistent(false)
        .bind(user_id)
        .bind(client_id)
        .bind(batch_id.to_string())
        .bind(&ids)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?;
        let canonical = |u: Option<String>| {
            u.as_deref()
                .and_then(CanonicalUuid::parse)
                .ok_or(StoreError::Integrity("stored UUID".into()))
        };
        let mut entries = LedgerEntries::default();
        for r in rows {
            let kind: String = r.try_get(0).map_err(db_error)?;
            let fingerprint = digest(r.try_get(3).map_err(db_error)?)?;
            let bytes: Vec<u8> = r.try_get(5).map_err(db_error)?;
            if kind == "b" {
                let status: i16 = r.try_get(4).map_err(db_error)?;
                entries.batch = Some(StoredBatch {
                    batch_id,
                    fingerprint,
                    status: u16::try_from(status)
                        .map_err(|_| StoreError::Integrity("stored push status".into()))?,
                    body: bytes,
                });
            } else {
                entries.mutations.push(StoredMutation {
                    mutation_id: canonical(r.try_get(1).map_err(db_error)?)?,
                    batch_id: canonical(r.try_get(2).map_err(db_error)?)?,
                    fingerprint,
                    outcome: bytes,
                });
            }
        }
        Ok(entries)
    }

    /// The batch and its mutations in one statement.
    pub(crate) async fn write_push_record(&mut self, r: &PushRecord) -> Result<(), StoreError> {
        let taken = |e: sqlx::Error| match &e {
            sqlx::Error::Database(d) if d.code().as_deref() == Some("23505") => {
                StoreError::Integrity("a ledger identity completed twice".into())
            }
            _ => db_error(e),
        };
        let ids: Vec<String> = r
            .mutations
            .iter()
            .map(|m| m.mutation_id.to_string())
            .collect();
        let batches: Vec<String> = r.mutations.iter().map(|m| m.batch_id.to_string()).collect();
        let fingerprints: Vec<Vec<u8>> = r
            .mutations
            .iter()
            .map(|m| m.fingerprint.0.to_vec())
            .collect();
        let outcomes: Vec<Vec<u8>> = r.mutations.iter().map(|m| m.outcome.clone()).collect();
        sqlx::query(
            "WITH batch AS ( \
               INSERT INTO synchro.push_batches \
                 (user_id, client_id, batch_id, fingerprint, status, body) \
               VALUES ($1, $2, $3::uuid, $4, $5, $6)) \
             INSERT INTO synchro.push_mutations \
               (user_id, client_id, mutation_id, batch_id, fingerprint, outcome) \
             SELECT $1, $2, m::uuid, b::uuid, f, o \
             FROM UNNEST($7::text[], $8::text[], $9::bytea[], $10::bytea[]) AS u(m, b, f, o)",
        )
        .bind(&r.user_id)
        .bind(&r.client_id)
        .bind(r.batch.batch_id.to_string())
        .bind(&r.batch.fingerprint.0[..])
        .bind(r.batch.status as i16)
        .bind(&r.batch.body)
        .bind(&ids)
        .bind(&batches)
        .bind(&fingerprints)
        .bind(&outcomes)
        .execute(&mut *self.tx)
        .await
        .map_err(taken)?;
        Ok(())
    }
}

fn digest(bytes: Vec<u8>) -> Result<Digest, StoreError> {
    <[u8; 32]>::try_from(bytes)
        .map(Digest)
        .map_err(|_| StoreError::Integrity("stored fingerprint".into()))
}
