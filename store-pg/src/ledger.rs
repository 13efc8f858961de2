//! The push ledger on PostgreSQL: `synchro.push_batches` and
//! `synchro.push_mutations`, read and written in one statement each, and
//! each together with the client's row (ADR 0031).

use actors::ledger::contract::{LedgerEntries, PushRecord, StoredBatch, StoredMutation};
use actors::store::{ClientRecord, LedgerLookup, PushFrame, StoreError};
use protocol::digest::Digest;
use protocol::ids::{CanonicalUuid, ScopeId};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::{Postgres, Row};

use crate::sql::to_i64;
use crate::{CLIENT_COLUMNS, CLIENT_WIDTH, PgTx, client_at, db_error};

/// A request's ledger rows over `$1` (user), `$2` (client), `$3` (batch)
/// and `$4` (mutations): the batch row (kind `b`) and the mutation rows
/// (kind `m`), in the columns [`ledger_row_at`] reads (migration 0025).
const LEDGER_ROWS: &str =
    "SELECT * FROM synchro.push_ledger_rows($1, $2, $3::uuid, $4::text[]::uuid[])";

impl PgTx {
    /// Both lookups in one round trip.
    pub(crate) async fn read_push_ledger(
        &mut self,
        user_id: &str,
        client_id: &str,
        batch_id: CanonicalUuid,
        mutation_ids: &[CanonicalUuid],
    ) -> Result<LedgerEntries, StoreError> {
        let ids: Vec<String> = mutation_ids.iter().map(|u| u.to_string()).collect();
        let rows = sqlx::query(LEDGER_ROWS)
            .bind(user_id)
            .bind(client_id)
            .bind(batch_id.to_string())
            .bind(&ids)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)?;
        let mut entries = LedgerEntries::default();
        for r in &rows {
            ledger_row_at(r, 0, batch_id, &mut entries)?;
        }
        Ok(entries)
    }

    /// The client locked and, when it is bound to the user and not
    /// retired, the request's ledger rows, in one statement (ADR 0031): one
    /// row per ledger row, each with the client's columns, or one row
    /// with the ledger's columns null.
    pub(crate) async fn read_push_frame(
        &mut self,
        user_id: &str,
        client_id: &str,
        lookup: Option<LedgerLookup<'_>>,
    ) -> Result<PushFrame, StoreError> {
        // The ledger rows are read by a function of the locked row, with
        // a snapshot taken after the lock: the statement's own is older
        // than a wait for the lock, and would miss the batch its previous
        // holder committed (migration 0025).
        let sql = format!(
            "SELECT {CLIENT_COLUMNS}, l.* FROM (SELECT) one \
             LEFT JOIN LATERAL (SELECT * FROM synchro.clients WHERE client_id = $2 FOR UPDATE) c \
               ON true \
             LEFT JOIN LATERAL synchro.push_ledger_rows( \
                 c.user_id, c.client_id, $3::uuid, $4::text[]::uuid[]) l \
               ON c.user_id = $1 AND NOT c.retired"
        );
        let ids: Vec<String> = lookup
            .iter()
            .flat_map(|l| l.mutation_ids.iter().map(|u| u.to_string()))
            .collect();
        let rows = sqlx::query(&sql)
            .bind(user_id)
            .bind(client_id)
            .bind(lookup.map(|l| l.batch_id.to_string()))
            .bind(&ids)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)?;
        let first = rows
            .first()
            .ok_or_else(|| StoreError::Integrity("the push frame read no row".into()))?;
        let client = client_at(first, 0, client_id)?;
        let mut ledger = LedgerEntries::default();
        if let Some(l) = lookup {
            for r in &rows {
                ledger_row_at(r, CLIENT_WIDTH, l.batch_id, &mut ledger)?;
            }
        }
        assert!(
            ledger == LedgerEntries::default()
                || client
                    .as_ref()
                    .is_some_and(|c| c.user_id == user_id && !c.retired),
            "ledger entries only for a bound client"
        );
        Ok(PushFrame { client, ledger })
    }

    /// The batch and its mutations in one statement.
    pub(crate) async fn write_push_record(&mut self, r: &PushRecord) -> Result<(), StoreError> {
        let sql = format!("WITH batch AS ({INSERT_BATCH}) {INSERT_MUTATIONS}");
        bind_record(sqlx::query(&sql), r)
            .execute(&mut *self.tx)
            .await
            .map_err(taken)?;
        Ok(())
    }

    /// The batch, its mutations and the client's record in one statement
    /// (ADR 0031); a client not bound to the record's user is an integrity
    /// failure, as for `put_client`.
    pub(crate) async fn write_push_record_and_client(
        &mut self,
        r: &PushRecord,
        c: &ClientRecord,
    ) -> Result<(), StoreError> {
        if (&c.user_id, &c.client_id) != (&r.user_id, &r.client_id) {
            return Err(StoreError::Integrity(
                "a push completed for another client".into(),
            ));
        }
        let sql = format!(
            "WITH batch AS ({INSERT_BATCH}), mutations AS ({INSERT_MUTATIONS}), \
               client AS (UPDATE synchro.clients SET generation = $13, retired = $14, \
                 installed_version = $15, installed_hash = $16, scope_set_version = $17, \
                 assigned = $18, accepted_write_epoch = $19, continued = $20, \
                 ever_assigned = $21 \
               WHERE client_id = $2 AND user_id = $1 RETURNING 1) \
             SELECT count(*) FROM client"
        );
        let assigned: Vec<&str> = c.assigned.iter().map(ScopeId::as_str).collect();
        let ever: Vec<&str> = c.ever_assigned.iter().map(ScopeId::as_str).collect();
        let replaced: i64 = bind_record(sqlx::query(&sql), r)
            .bind(to_i64(c.generation)?)
            .bind(c.retired)
            .bind(c.installed_schema.map(|s| s.version as i64))
            .bind(c.installed_schema.map(|s| s.hash.to_hex()))
            .bind(to_i64(c.scope_set_version)?)
            .bind(assigned)
            .bind(to_i64(c.accepted_write_epoch)?)
            .bind(c.continued)
            .bind(ever)
            .fetch_one(&mut *self.tx)
            .await
            .map_err(taken)?
            .try_get(0)
            .map_err(db_error)?;
        if replaced != 1 {
            return Err(StoreError::Integrity(
                "a client record replaced without its binding".into(),
            ));
        }
        Ok(())
    }
}

/// The batch row, over `$1` to `$6` of [`bind_record`].
const INSERT_BATCH: &str = "INSERT INTO synchro.push_batches \
       (user_id, client_id, batch_id, fingerprint, status, body) \
     VALUES ($1, $2, $3::uuid, $4, $5, $6)";

/// The mutation rows, over `$1`, `$2` and `$7` to `$12` of [`bind_record`]:
/// each outcome either as bytes or as where they lie in the batch's answer
/// (migration 0025).
const INSERT_MUTATIONS: &str = "INSERT INTO synchro.push_mutations \
       (user_id, client_id, mutation_id, batch_id, fingerprint, outcome, outcome_at, outcome_len) \
     SELECT $1, $2, m::uuid, b::uuid, f, o, a, n \
     FROM UNNEST($7::text[], $8::text[], $9::bytea[], $10::bytea[], $11::int4[], $12::int4[]) \
       AS u(m, b, f, o, a, n)";

/// Where each of `outcomes` lies in `body`, for those that lie there
/// verbatim: such a mutation row refers to the batch's answer instead of
/// holding a copy. The answer holds the outcomes mostly in their order, so
/// each search starts where the last one ended, and only a miss searches
/// the whole answer again.
fn outcomes_in<'a>(
    body: &[u8],
    outcomes: impl Iterator<Item = &'a [u8]>,
) -> Vec<Option<(i32, i32)>> {
    let mut from = 0;
    outcomes
        .map(|outcome| {
            if outcome.is_empty() {
                return None;
            }
            let at = match memchr::memmem::find(&body[from..], outcome) {
                Some(i) => from + i,
                None => memchr::memmem::find(body, outcome)?,
            };
            assert!(
                body.get(at..at + outcome.len()) == Some(outcome),
                "an outcome refers to its own bytes"
            );
            from = at + outcome.len();
            Some((i32::try_from(at).ok()?, i32::try_from(outcome.len()).ok()?))
        })
        .collect()
}

/// Binds `r` as `$1` to `$12`.
fn bind_record<'q>(
    q: sqlx::query::Query<'q, Postgres, PgArguments>,
    r: &'q PushRecord,
) -> sqlx::query::Query<'q, Postgres, PgArguments> {
    let m = &r.mutations;
    let ids: Vec<String> = m.iter().map(|m| m.mutation_id.to_string()).collect();
    let batches: Vec<String> = m.iter().map(|m| m.batch_id.to_string()).collect();
    let fingerprints: Vec<Vec<u8>> = m.iter().map(|m| m.fingerprint.0.to_vec()).collect();
    // A fresh mutation's outcome is in its own batch's answer (an empty
    // one is never looked for).
    let found = outcomes_in(
        &r.batch.body,
        m.iter().map(|m| match m.batch_id == r.batch.batch_id {
            true => &m.outcome[..],
            false => &[],
        }),
    );
    let outcomes: Vec<Option<&[u8]>> = m
        .iter()
        .zip(&found)
        .map(|(m, f)| f.is_none().then_some(m.outcome.as_slice()))
        .collect();
    let at: Vec<Option<i32>> = found.iter().map(|f| f.map(|(a, _)| a)).collect();
    let len: Vec<Option<i32>> = found.iter().map(|f| f.map(|(_, n)| n)).collect();
    q.bind(&r.user_id)
        .bind(&r.client_id)
        .bind(r.batch.batch_id.to_string())
        .bind(&r.batch.fingerprint.0[..])
        .bind(r.batch.status as i16)
        .bind(&r.batch.body)
        .bind(ids)
        .bind(batches)
        .bind(fingerprints)
        .bind(outcomes)
        .bind(at)
        .bind(len)
}

/// A ledger identity stored twice is an integrity failure.
fn taken(e: sqlx::Error) -> StoreError {
    match &e {
        sqlx::Error::Database(d) if d.code().as_deref() == Some("23505") => {
            StoreError::Integrity("a ledger identity completed twice".into())
        }
        _ => db_error(e),
    }
}

/// Adds the ledger row in `r`'s columns from `at` ([`LEDGER_ROWS`]) to
/// `entries`; nothing where they are null (an outer join found none).
fn ledger_row_at(
    r: &PgRow,
    at: usize,
    batch_id: CanonicalUuid,
    entries: &mut LedgerEntries,
) -> Result<(), StoreError> {
    let Some(kind) = r.try_get::<Option<String>, _>(at).map_err(db_error)? else {
        return Ok(());
    };
    let canonical = |u: Option<String>| {
        u.as_deref()
            .and_then(CanonicalUuid::parse)
            .ok_or(StoreError::Integrity("stored UUID".into()))
    };
    let fingerprint = digest(r.try_get(at + 3).map_err(db_error)?)?;
    let bytes: Vec<u8> = r.try_get(at + 5).map_err(db_error)?;
    if kind == "b" {
        let status: i16 = r.try_get(at + 4).map_err(db_error)?;
        entries.batch = Some(StoredBatch {
            batch_id,
            fingerprint,
            status: u16::try_from(status)
                .map_err(|_| StoreError::Integrity("stored push status".into()))?,
            body: bytes,
        });
    } else {
        entries.mutations.push(StoredMutation {
            mutation_id: canonical(r.try_get(at + 1).map_err(db_error)?)?,
            batch_id: canonical(r.try_get(at + 2).map_err(db_error)?)?,
            fingerprint,
            outcome: bytes,
        });
    }
    Ok(())
}

fn digest(bytes: Vec<u8>) -> Result<Digest, StoreError> {
    <[u8; 32]>::try_from(bytes)
        .map(Digest)
        .map_err(|_| StoreError::Integrity("stored fingerprint".into()))
}

#[cfg(test)]
mod tests {
    use super::outcomes_in;

    #[test]
    fn outcomes_are_found_in_order_out_of_order_or_not_at_all() {
        let body = br#"{"accepted":[{"a":1},{"b":2}],"rejected":[{"c":3}]}"#;
        let found = outcomes_in(
            body,
            [
                &br#"{"c":3}"#[..],
                br#"{"a":1}"#,
                br#"{"b":2}"#,
                br#"{"d":4}"#,
                b"",
            ]
            .into_iter(),
        );
        assert_eq!(
            found,
            [Some((42, 7)), Some((13, 7)), Some((21, 7)), None, None]
        );
        for (f, o) in found.iter().zip([&br#"{"c":3}"#[..], br#"{"a":1}"#]) {
            let (at, len) = f.unwrap();
            assert_eq!(&body[at as usize..][..len as usize], o);
        }
    }
}
