//! Rebuild sessions on PostgreSQL: a session row, and its stage written by
//! one `INSERT ... SELECT` from the membership index and the projections in
//! the caller's snapshot (never through the server's memory), in blocks of
//! consecutive ordinals whose arrays PostgreSQL compresses (migration 0019).

use actors::staging::{RebuildSession, RebuildUsage, StagedRow};
use actors::store::StoreError;
use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{CanonicalUuid, ScopeId};
use protocol::position::Boundary;
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::materialized::{digest, identity_digest, integrity, version};
use crate::sql::{to_i64, to_u64};
use crate::{PgTx, db_error};

const SESSION_COLUMNS: &str = "session_id::text, client_id, rebuild_id::text, scope_id, \
     client_generation, schema_hash, stream_generation, membership_generation, \
     retention_generation, accepted_write_epoch, boundary_lsn, page_limit, expires_at, digest, \
     cursor_key_id, continuation_key_id";

/// Staged rows per block: a page of the largest limit (1000) reads five
/// blocks, one of limit 1 decompresses one.
const BLOCK_ROWS: i64 = 256;

/// The blocks of session `$1` that hold ordinals `$2` to `$2 + $3 - 1` (a
/// query unnests them and keeps the rows it needs).
const PAGE_BLOCKS: &str = "b.session_id = $1::uuid AND b.first_ordinal <= $2 + $3 - 1 \
     AND b.first_ordinal >= coalesce((SELECT max(first_ordinal) FROM synchro.rebuild_stage \
     WHERE session_id = $1::uuid AND first_ordinal <= $2), 0)";

/// Inserts conflict only with a concurrent request of the same attempt
/// (`ON CONFLICT DO NOTHING` in a repeatable-read snapshot raises a
/// serialization failure, retryable, and the retry replays what it
/// stored); nothing inserted means a conflict this snapshot sees.
fn inserted_once(done: sqlx::postgres::PgQueryResult, what: &str) -> Result<(), StoreError> {
    if done.rows_affected() == 1 {
        Ok(())
    } else {
        Err(integrity(what))
    }
}

fn session(r: &PgRow) -> Result<RebuildSession, StoreError> {
    let get = |e: sqlx::Error| db_error(e);
    let uuid = |i: usize| -> Result<CanonicalUuid, StoreError> {
        let s: &str = r.try_get(i).map_err(get)?;
        CanonicalUuid::parse(s).ok_or_else(|| integrity("rebuild session uuid"))
    };
    let count = |i: usize| -> Result<u64, StoreError> { to_u64(r.try_get(i).map_err(get)?) };
    let scope: &str = r.try_get(3).map_err(get)?;
    let boundary: Option<i64> = r.try_get(10).map_err(get)?;
    let limit: i16 = r.try_get(11).map_err(get)?;
    let sealed: Option<&[u8]> = r.try_get(13).map_err(get)?;
    Ok(RebuildSession {
        session_id: uuid(0)?,
        client_id: r.try_get(1).map_err(get)?,
        rebuild_id: uuid(2)?,
        scope: ScopeId::parse(scope).ok_or_else(|| integrity("rebuild scope"))?,
        client_generation: count(4)?,
        schema_hash: digest(r.try_get(5).map_err(get)?)?,
        stream_generation: count(6)?,
        membership_generation: count(7)?,
        retention_generation: count(8)?,
        accepted_write_epoch: count(9)?,
        boundary: match boundary {
            None => Boundary::GenerationStart,
            Some(lsn) => Boundary::TransactionEnd {
                commit_lsn: to_u64(lsn)?,
            },
        },
        page_limit: u16::try_from(limit).map_err(|_| integrity("page limit"))?,
        expires_at: r.try_get(12).map_err(get)?,
        digest: sealed.map(digest).transpose()?,
        cursor_key_id: r.try_get(14).map_err(get)?,
        continuation_key_id: r.try_get(15).map_err(get)?,
    })
}

impl PgTx {
    pub(crate) async fn read_rebuild_session(
        &mut self,
        client_id: &str,
        rebuild_id: &CanonicalUuid,
    ) -> Result<Option<RebuildSession>, StoreError> {
        sqlx::query(&format!(
            "SELECT {SESSION_COLUMNS} FROM synchro.rebuild_sessions \
             WHERE client_id = $1 AND rebuild_id = $2::uuid"
        ))
        .bind(client_id)
        .bind(rebuild_id.to_string())
        .fetch_optional(&mut *self.tx)
        .await
        .map_err(db_error)?
        .as_ref()
        .map(session)
        .transpose()
    }

    pub(crate) async fn write_stage(
        &mut self,
        s: &RebuildSession,
        digests: &[(RowIdentity, Digest)],
    ) -> Result<u64, StoreError> {
        // A new session of the same attempt replaces the old one and its
        // stage (cascade).
        sqlx::query(
            "DELETE FROM synchro.rebuild_sessions WHERE client_id = $1 AND rebuild_id = $2::uuid",
        )
        .bind(&s.client_id)
        .bind(s.rebuild_id.to_string())
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        let boundary = match s.boundary {
            Boundary::GenerationStart => None,
            Boundary::TransactionEnd { commit_lsn } => Some(to_i64(commit_lsn)?),
        };
        let done_session = sqlx::query(
            "INSERT INTO synchro.rebuild_sessions (session_id, client_id, rebuild_id, scope_id, \
             client_generation, schema_hash, stream_generation, membership_generation, \
             retention_generation, accepted_write_epoch, boundary_lsn, page_limit, expires_at, \
             cursor_key_id, continuation_key_id) \
             VALUES ($1::uuid, $2, $3::uuid, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15) \
             ON CONFLICT DO NOTHING",
        )
        .bind(s.session_id.to_string())
        .bind(&s.client_id)
        .bind(s.rebuild_id.to_string())
        .bind(s.scope.as_str())
        .bind(to_i64(s.client_generation)?)
        .bind(s.schema_hash.0.to_vec())
        .bind(to_i64(s.stream_generation)?)
        .bind(to_i64(s.membership_generation)?)
        .bind(to_i64(s.retention_generation)?)
        .bind(to_i64(s.accepted_write_epoch)?)
        .bind(boundary)
        .bind(i16::try_from(s.page_limit).map_err(|_| integrity("page limit"))?)
        .bind(s.expires_at)
        .bind(&s.cursor_key_id)
        .bind(&s.continuation_key_id)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        inserted_once(done_session, "a rebuild session created twice")?;
        // The stage, inside the database: every member in identity order,
        // with its projection (a member without one fails the join's count
        // below) and its digest, or the one the caller recomputed; in
        // blocks of consecutive ordinals.
        let blocks: Vec<i32> = sqlx::query_scalar(
            "INSERT INTO synchro.rebuild_stage \
             (session_id, first_ordinal, rows, table_ids, identities, row_texts, versions, digests) \
             SELECT $1::uuid, min(s.ordinal), count(*)::int4, \
             array_agg(s.table_id ORDER BY s.ordinal), array_agg(s.identity ORDER BY s.ordinal), \
             array_agg(s.row_json ORDER BY s.ordinal), array_agg(s.version ORDER BY s.ordinal), \
             array_agg(s.digest ORDER BY s.ordinal) \
             FROM (SELECT row_number() OVER (ORDER BY m.identity) - 1 AS ordinal, p.table_id, \
                   p.identity, p.row_json, p.version, COALESCE(r.d, p.digest) AS digest \
                   FROM synchro.scope_members m \
                   JOIN synchro.projections p ON p.table_id = m.table_id AND p.identity = m.identity \
                   LEFT JOIN UNNEST($3::bytea[], $4::bytea[]) AS r(i, d) ON r.i = m.identity \
                   WHERE m.scope_id = $2) s \
             GROUP BY s.ordinal / $5 RETURNING rows",
        )
        .bind(s.session_id.to_string())
        .bind(s.scope.as_str())
        .bind(
            digests
                .iter()
                .map(|(i, _)| i.as_bytes())
                .collect::<Vec<_>>(),
        )
        .bind(
            digests
                .iter()
                .map(|(_, d)| d.0.to_vec())
                .collect::<Vec<_>>(),
        )
        .bind(BLOCK_ROWS)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?;
        assert!(
            blocks.iter().all(|&n| n > 0 && i64::from(n) <= BLOCK_ROWS),
            "a block holds 1 to BLOCK_ROWS rows"
        );
        let staged = blocks.iter().map(|&n| n as u64).sum::<u64>();
        if staged != self.read_scope_size(&s.scope).await? {
            return Err(integrity("a member has no projection"));
        }
        sqlx::query(
            "UPDATE synchro.rebuild_sessions SET staged_rows = $2 WHERE session_id = $1::uuid",
        )
        .bind(s.session_id.to_string())
        .bind(to_i64(staged)?)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(staged)
    }

    pub(crate) async fn read_scope_size(&mut self, scope: &ScopeId) -> Result<u64, StoreError> {
        let members: i64 =
            sqlx::query_scalar("SELECT count(*) FROM synchro.scope_members WHERE scope_id = $1")
                .bind(scope.as_str())
                .fetch_one(&mut *self.tx)
                .await
                .map_err(db_error)?;
        to_u64(members)
    }

    pub(crate) async fn read_staged_digests(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<(RowIdentity, Digest)>, StoreError> {
        // Only the identities' and digests' arrays are read: each column
        // is stored apart, so the row texts are not decompressed.
        sqlx::query(&format!(
            "SELECT u.identity, u.digest FROM synchro.rebuild_stage b, \
             unnest(b.identities, b.digests) WITH ORDINALITY AS u(identity, digest, i) \
             WHERE {PAGE_BLOCKS} AND b.first_ordinal + u.i - 1 >= $2 \
             ORDER BY b.first_ordinal, u.i LIMIT $3"
        ))
        .bind(session_id.to_string())
        .bind(to_i64(from)?)
        .bind(i64::try_from(max).map_err(|_| integrity("row count"))?)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?
        .iter()
        .map(identity_digest)
        .collect()
    }

    pub(crate) async fn write_seal(
        &mut self,
        session_id: &CanonicalUuid,
        d: &Digest,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(
            "UPDATE synchro.rebuild_sessions SET digest = $2 WHERE session_id = $1::uuid",
        )
        .bind(session_id.to_string())
        .bind(d.0.to_vec())
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        if done.rows_affected() != 1 {
            return Err(integrity("no such rebuild session"));
        }
        Ok(())
    }

    pub(crate) async fn read_staged_rows(
        &mut self,
        session_id: &CanonicalUuid,
        from: u64,
        max: usize,
    ) -> Result<Vec<StagedRow>, StoreError> {
        sqlx::query(&format!(
            "SELECT b.first_ordinal + u.i - 1, u.table_id, u.identity, u.row_text, u.version, \
             u.digest FROM synchro.rebuild_stage b, \
             unnest(b.table_ids, b.identities, b.row_texts, b.versions, b.digests) \
             WITH ORDINALITY AS u(table_id, identity, row_text, version, digest, i) \
             WHERE {PAGE_BLOCKS} AND b.first_ordinal + u.i - 1 >= $2 \
             ORDER BY b.first_ordinal, u.i LIMIT $3"
        ))
        .bind(session_id.to_string())
        .bind(to_i64(from)?)
        .bind(i64::try_from(max).map_err(|_| integrity("row count"))?)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?
        .iter()
        .map(|r| {
            let get = |e: sqlx::Error| db_error(e);
            let v: &str = r.try_get(4).map_err(get)?;
            Ok(StagedRow {
                ordinal: to_u64(r.try_get(0).map_err(get)?)?,
                table_id: r.try_get(1).map_err(get)?,
                identity: RowIdentity::from_bytes(r.try_get(2).map_err(get)?),
                row: r.try_get(3).map_err(get)?,
                version: version(v)?,
                digest: digest(r.try_get(5).map_err(get)?)?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()
        .inspect(|rows| {
            assert!(rows.len() <= max, "a rebuild page never exceeds its limit");
            assert!(
                rows.iter().zip(from..).all(|(r, want)| r.ordinal == want),
                "a rebuild page is the staged rows from its ordinal on, none skipped"
            );
        })
    }

    pub(crate) async fn write_supersede(
        &mut self,
        client_id: &str,
        scope: &ScopeId,
        now_micros: i64,
    ) -> Result<u64, StoreError> {
        let ended: Vec<String> = sqlx::query_scalar(
            "UPDATE synchro.rebuild_sessions SET swept = true, expires_at = $3 \
             WHERE client_id = $1 AND scope_id = $2 AND NOT swept AND expires_at > $3 \
             RETURNING session_id::text",
        )
        .bind(client_id)
        .bind(scope.as_str())
        .bind(now_micros)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?;
        self.delete_stages(&ended).await?;
        Ok(ended.len() as u64)
    }

    pub(crate) async fn read_rebuild_usage(
        &mut self,
        user_id: &str,
        now_micros: i64,
    ) -> Result<RebuildUsage, StoreError> {
        let (user, total): (i64, i64) = sqlx::query_as(
            "SELECT coalesce(sum(s.staged_rows) FILTER (WHERE c.user_id = $1), 0)::int8, \
                    coalesce(sum(s.staged_rows), 0)::int8 \
             FROM synchro.rebuild_sessions s LEFT JOIN synchro.clients c USING (client_id) \
             WHERE NOT s.swept AND s.expires_at > $2",
        )
        .bind(user_id)
        .bind(now_micros)
        .fetch_one(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(RebuildUsage {
            user_rows: to_u64(user)?,
            total_rows: to_u64(total)?,
        })
    }

    pub(crate) async fn write_sweep(
        &mut self,
        now_micros: i64,
        max: usize,
    ) -> Result<u64, StoreError> {
        // SKIP LOCKED, so that two sweepers never wait on each other.
        let swept: Vec<String> = sqlx::query_scalar(
            "UPDATE synchro.rebuild_sessions SET swept = true WHERE session_id IN \
             (SELECT session_id FROM synchro.rebuild_sessions WHERE NOT swept AND expires_at <= $1 \
              ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING session_id::text",
        )
        .bind(now_micros)
        .bind(i64::try_from(max).map_err(|_| integrity("sweep size"))?)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?;
        self.delete_stages(&swept).await?;
        Ok(swept.len() as u64)
    }

    /// Deletes the stages of these sessions (their rows stay).
    async fn delete_stages(&mut self, sessions: &[String]) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM synchro.rebuild_stage WHERE session_id = ANY($1::uuid[])")
            .bind(sessions)
            .execute(&mut *self.tx)
            .await
            .map_err(db_error)?;
        Ok(())
    }

    pub(crate) async fn write_forget(
        &mut self,
        expired_before: i64,
        max: usize,
    ) -> Result<u64, StoreError> {
        let forgotten = sqlx::query(
            "DELETE FROM synchro.rebuild_sessions WHERE session_id IN \
             (SELECT session_id FROM synchro.rebuild_sessions WHERE swept AND expires_at <= $1 \
              ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
        )
        .bind(expired_before)
        .bind(i64::try_from(max).map_err(|_| integrity("forget size"))?)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(forgotten.rows_affected())
    }
}
