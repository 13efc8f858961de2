//! The materialized state on PostgreSQL: progress, projections, dependency
//! rows and scope effects. One statement per operation; a materialization
//! writes each kind of row with one `UNNEST` insert.

use std::collections::{BTreeSet, HashMap, HashSet};

use actors::capture::{
    CaptureHealth, CaptureProblem, CaptureProgress, CapturedRow, DependencyRow, Effect, EffectOp,
    Heartbeat, Materialization, Projection, Quarantine, Rematerialization, image_from_json,
    image_json,
};
use actors::store::StoreError;
use protocol::digest::{Digest, RowIdentity};
use protocol::ids::{ScopeId, ServerVersion};
use protocol::json::{self, Value};
use protocol::position::{Boundary, StreamPosition};
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::sql::{to_i64, to_u64};
use crate::{PgTx, db_error};

pub(crate) fn integrity(what: &str) -> StoreError {
    StoreError::Integrity(format!("stored capture state is invalid: {what}"))
}

/// Maps a driver error, where a unique violation means the materializer's
/// view of prior state was wrong (an integrity failure, never retryable).
pub(crate) fn unique_is_integrity(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    move |e| match &e {
        sqlx::Error::Database(d) if d.code().as_deref() == Some("23505") => integrity(what),
        _ => db_error(e),
    }
}

pub(crate) fn digest(bytes: &[u8]) -> Result<Digest, StoreError> {
    Ok(Digest(
        bytes.try_into().map_err(|_| integrity("digest length"))?,
    ))
}

pub(crate) fn version(s: &str) -> Result<ServerVersion, StoreError> {
    ServerVersion::parse(s).ok_or_else(|| integrity("server version"))
}

fn projection(r: &PgRow) -> Result<Projection, StoreError> {
    let get = |e: sqlx::Error| db_error(e);
    let row_json: String = r.try_get("row_json").map_err(get)?;
    let scopes: String = r.try_get("scopes").map_err(get)?;
    let scopes = match json::parse(scopes.as_bytes()) {
        Ok(Value::Array(list)) => list
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| integrity("scope id"))
            })
            .collect::<Result<Vec<String>, _>>()?,
        _ => return Err(integrity("projection scopes")),
    };
    Ok(Projection {
        table_id: r.try_get("table_id").map_err(get)?,
        identity: RowIdentity::from_bytes(r.try_get("identity").map_err(get)?),
        key: r.try_get("key").map_err(get)?,
        row: json::parse(row_json.as_bytes()).map_err(|_| integrity("projection row"))?,
        version: version(r.try_get::<&str, _>("version").map_err(get)?)?,
        digest: digest(r.try_get::<&[u8], _>("digest").map_err(get)?)?,
        schema_version: to_u64(r.try_get("schema_version").map_err(get)?)?,
        tombstone: r.try_get("tombstone").map_err(get)?,
        scopes: scopes
            .iter()
            .map(|s| ScopeId::parse(s).ok_or_else(|| integrity("scope id")))
            .collect::<Result<BTreeSet<_>, _>>()?,
    })
}

fn dependency(r: &PgRow) -> Result<DependencyRow, StoreError> {
    let image: String = r.try_get("image").map_err(db_error)?;
    let image = image_from_json(&image).ok_or_else(|| integrity("dependency image"))?;
    Ok(DependencyRow {
        relation: r.try_get("relation").map_err(db_error)?,
        identity: r.try_get("identity").map_err(db_error)?,
        image,
    })
}

/// A row of (identity, digest), as the membership index and the rebuild
/// stage keep them.
pub(crate) fn identity_digest(r: &PgRow) -> Result<(RowIdentity, Digest), StoreError> {
    let identity: Vec<u8> = r.try_get(0).map_err(db_error)?;
    let d: &[u8] = r.try_get(1).map_err(db_error)?;
    Ok((RowIdentity::from_bytes(identity), digest(d)?))
}

/// The columns [`effect`] reads, in its order, from [`EFFECTS_WITH_ROWS`]:
/// an upsert's or tombstone's row, version and digest are its projection's
/// (ADR 0037), a removal's version its own.
pub(crate) const EFFECT_COLUMNS: &str = "e.scope_id, e.commit_lsn, e.event_ordinal, \
     e.effect_ordinal, e.table_id, e.identity, e.key_json, e.op, p.row_json, \
     CASE WHEN e.op = 1 THEN e.version ELSE p.version END, p.digest, p.schema_version, p.tombstone";

/// The scope effects `e`, each beside its row's projection `p` when it
/// carries a row.
pub(crate) const EFFECTS_WITH_ROWS: &str = "synchro.scope_effects e \
     LEFT JOIN synchro.projections p \
     ON e.op <> 1 AND p.table_id = e.table_id AND p.identity = e.identity";

/// A stored effect's `op`: what a scope's client must do for the row.
const OP_UPSERT: i16 = 0;
const OP_REMOVE: i16 = 1;
const OP_TOMBSTONE: i16 = 2;

/// An effect read with [`EFFECT_COLUMNS`] (by position: a page reads a
/// thousand of them).
pub(crate) fn effect(r: &PgRow) -> Result<Effect, StoreError> {
    let get = |e: sqlx::Error| db_error(e);
    let version_text: Option<&str> = r.try_get(9).map_err(get)?;
    let version = version(version_text.ok_or_else(|| integrity("an effect without its version"))?)?;
    let op: i16 = r.try_get(7).map_err(get)?;
    let captured = |tombstone: bool| -> Result<CapturedRow, StoreError> {
        let row: Option<String> = r.try_get(8).map_err(get)?;
        let row = row.ok_or_else(|| integrity("an effect without its row's projection"))?;
        if r.try_get::<bool, _>(12).map_err(get)? != tombstone {
            return Err(integrity(
                "a tombstone effect of a row that is none, or the reverse",
            ));
        }
        Ok(CapturedRow {
            row,
            version: version.clone(),
            digest: digest(r.try_get(10).map_err(get)?)?,
            schema_version: Some(to_u64(r.try_get(11).map_err(get)?)?),
        })
    };
    let op = match op {
        OP_UPSERT => EffectOp::Upsert(captured(false)?),
        OP_TOMBSTONE => EffectOp::Tombstone(captured(true)?),
        OP_REMOVE => EffectOp::Remove(version.clone()),
        _ => return Err(integrity("effect op")),
    };
    let scope: &str = r.try_get(0).map_err(get)?;
    let key: &str = r.try_get(6).map_err(get)?;
    Ok(Effect {
        scope: ScopeId::parse(scope).ok_or_else(|| integrity("scope id"))?,
        commit_lsn: to_u64(r.try_get(1).map_err(get)?)?,
        event_ordinal: to_u64(r.try_get(2).map_err(get)?)?,
        effect_ordinal: to_u64(r.try_get(3).map_err(get)?)?,
        table_id: r.try_get(4).map_err(get)?,
        identity: RowIdentity::from_bytes(r.try_get(5).map_err(get)?),
        key: json::parse(key.as_bytes()).map_err(|_| integrity("effect key"))?,
        op,
    })
}

/// Asserts what a read of `scope`'s effects in (`after`, `through`] returned:
/// only that scope's, inside the window, in strictly increasing positions,
/// and at most `max` of them. SQL's `ORDER BY` and `LIMIT` promise it; a
/// cursor built on a page that broke it would skip or repeat a change.
pub(crate) fn assert_effect_window(
    effects: &[Effect],
    scope: &ScopeId,
    after: StreamPosition,
    through: Boundary,
    max: Option<usize>,
) {
    let through = StreamPosition::from(through);
    assert!(
        max.is_none_or(|m| effects.len() <= m),
        "a page never exceeds its limit"
    );
    let mut last = after;
    for e in effects {
        assert!(&e.scope == scope, "an effect read for its own scope");
        let at = e.position();
        assert!(
            at > last,
            "effect positions strictly increase past the cursor"
        );
        assert!(at <= through, "an effect read never passes the boundary");
        last = at;
    }
}

/// (commit_lsn, event_ordinal, effect_ordinal) bounds of a position: a
/// transaction end sorts after every effect of its LSN.
pub(crate) fn bounds(p: StreamPosition) -> Result<(i64, i64, i64), StoreError> {
    Ok(match p {
        StreamPosition::GenerationStart => (-1, 0, 0),
        StreamPosition::Effect {
            commit_lsn,
            event_ordinal,
            effect_ordinal,
        } => (
            to_i64(commit_lsn)?,
            to_i64(event_ordinal)?,
            to_i64(effect_ordinal)?,
        ),
        StreamPosition::TransactionEnd { commit_lsn } => (to_i64(commit_lsn)?, i64::MAX, i64::MAX),
    })
}

/// Binds the nine projection columns, in table order, as arrays.
fn bind_projections<'q>(
    q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    p: &'q [Projection],
) -> Result<sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>, StoreError> {
    let scopes: Vec<String> = p
        .iter()
        .map(|p| {
            let list: Vec<Value> = p.scopes.iter().map(|s| Value::string(s.as_str())).collect();
            json::to_canonical_string(&Value::Array(list))
        })
        .collect();
    Ok(
        q.bind(p.iter().map(|p| p.table_id.as_str()).collect::<Vec<_>>())
            .bind(p.iter().map(|p| p.identity.as_bytes()).collect::<Vec<_>>())
            .bind(p.iter().map(|p| p.key.as_str()).collect::<Vec<_>>())
            .bind(
                p.iter()
                    .map(|p| json::to_canonical_string(&p.row))
                    .collect::<Vec<_>>(),
            )
            .bind(p.iter().map(|p| p.version.as_str()).collect::<Vec<_>>())
            .bind(p.iter().map(|p| p.digest.0.to_vec()).collect::<Vec<_>>())
            .bind(
                p.iter()
                    .map(|p| to_i64(p.schema_version))
                    .collect::<Result<Vec<_>, _>>()?,
            )
            .bind(p.iter().map(|p| p.tombstone).collect::<Vec<_>>())
            .bind(scopes),
    )
}

/// Whether the stream owes its baseline (ADR 0011): no slot of it is
/// recorded done. One condition for progress and health.
const BASELINE_OWED: &str = "NOT EXISTS (SELECT 1 FROM synchro.capture_slot WHERE baseline_done)";

/// The columns [`progress_at`] decodes, over `synchro.capture_progress p`.
pub(crate) fn progress_columns() -> String {
    format!(
        "p.commit_lsn, p.end_lsn, p.quarantine_lsn, p.quarantine_class, {BASELINE_OWED}, \
         ARRAY(SELECT relation FROM synchro.rematerializations WHERE pending), \
         (SELECT coalesce(max(version), 0) FROM synchro.schema_manifests)"
    )
}

/// The capture progress in `r`'s columns from `at` ([`progress_columns`]).
pub(crate) fn progress_at(r: &PgRow, at: usize) -> Result<CaptureProgress, StoreError> {
    let commit: Option<i64> = r.try_get(at).map_err(db_error)?;
    let q_lsn: Option<i64> = r.try_get(at + 2).map_err(db_error)?;
    let q_class: Option<String> = r.try_get(at + 3).map_err(db_error)?;
    Ok(CaptureProgress {
        boundary: match commit {
            None => Boundary::GenerationStart,
            Some(c) => Boundary::TransactionEnd {
                commit_lsn: to_u64(c)?,
            },
        },
        end_lsn: to_u64(r.try_get(at + 1).map_err(db_error)?)?,
        quarantine: match (q_lsn, q_class) {
            (Some(l), Some(c)) => Some(Quarantine {
                commit_lsn: to_u64(l)?,
                problem: CaptureProblem::parse(&c).ok_or_else(|| integrity("quarantine class"))?,
            }),
            _ => None,
        },
        baseline_owed: r.try_get(at + 4).map_err(db_error)?,
        rematerializing: r
            .try_get::<Vec<String>, _>(at + 5)
            .map_err(db_error)?
            .into_iter()
            .collect(),
        newest_schema_version: to_u64(r.try_get(at + 6).map_err(db_error)?)?,
    })
}

/// Satisfies client-write fences: a materialized transaction's, or those a
/// baseline's snapshot holds. A fence whose pending row this transaction
/// cannot see yet (decoded before visible, ADR 0014) is recorded satisfied.
/// Upserts rematerialization records, one statement.
async fn write_rematerializations(
    tx: &mut sqlx::PgConnection,
    records: &[Rematerialization],
) -> Result<(), StoreError> {
    if records.is_empty() {
        return Ok(());
    }
    let rows = records
        .iter()
        .map(|r| to_i64(r.rows))
        .collect::<Result<Vec<_>, _>>()?;
    sqlx::query(
        "INSERT INTO synchro.rematerializations (relation, fingerprint, pending, after_key, rows) \
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::bool[], $4::text[], $5::int8[]) \
         ON CONFLICT (relation) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, \
           pending = EXCLUDED.pending, after_key = EXCLUDED.after_key, rows = EXCLUDED.rows",
    )
    .bind(
        records
            .iter()
            .map(|r| r.relation.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(
        records
            .iter()
            .map(|r| r.fingerprint.as_str())
            .collect::<Vec<_>>(),
    )
    .bind(records.iter().map(|r| r.pending).collect::<Vec<_>>())
    .bind(
        records
            .iter()
            .map(|r| r.after.as_ref().map(image_json))
            .collect::<Vec<_>>(),
    )
    .bind(rows)
    .execute(&mut *tx)
    .await
    .map_err(db_error)?;
    Ok(())
}

async fn satisfy_fences(tx: &mut sqlx::PgConnection, fences: &[u64]) -> Result<(), StoreError> {
    if fences.is_empty() {
        return Ok(());
    }
    let fences = fences
        .iter()
        .map(|f| to_i64(*f))
        .collect::<Result<Vec<_>, _>>()?;
    // Every process hears them at commit (ADR 0028), at no round trip of its own.
    let sql = format!(
        "WITH gone AS (DELETE FROM synchro.pending_fences WHERE fence = ANY($1) RETURNING fence), \
         early AS (INSERT INTO synchro.satisfied_fences (fence) \
         SELECT f FROM unnest($1::int8[]) AS f WHERE f NOT IN (SELECT fence FROM gone) \
         ON CONFLICT (fence) DO NOTHING) {}",
        crate::fences::notify_satisfied()
    );
    sqlx::query(&sql)
        .bind(fences)
        .execute(tx)
        .await
        .map_err(db_error)?;
    Ok(())
}

impl PgTx {
    pub(crate) async fn read_capture_progress(&mut self) -> Result<CaptureProgress, StoreError> {
        let sql = format!(
            "SELECT {} FROM synchro.capture_progress p",
            progress_columns()
        );
        let r = sqlx::query(&sql)
            .fetch_one(&mut *self.tx)
            .await
            .map_err(db_error)?;
        progress_at(&r, 0)
    }

    pub(crate) async fn write_forgotten_table(
        &mut self,
        table_id: &str,
    ) -> Result<u64, StoreError> {
        let mut forgotten = 0;
        for table in ["scope_effects", "scope_members", "projections"] {
            let sql = format!("DELETE FROM synchro.{table} WHERE table_id = $1");
            let done = sqlx::query(&sql)
                .bind(table_id)
                .execute(&mut *self.tx)
                .await
                .map_err(db_error)?;
            forgotten = done.rows_affected();
        }
        Ok(forgotten)
    }

    pub(crate) async fn read_rematerializations(
        &mut self,
    ) -> Result<Vec<Rematerialization>, StoreError> {
        let rows = sqlx::query(
            "SELECT relation, fingerprint, pending, after_key, rows \
             FROM synchro.rematerializations ORDER BY relation",
        )
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?;
        rows.iter()
            .map(|r| {
                let after: Option<String> = r.try_get(3).map_err(db_error)?;
                Ok(Rematerialization {
                    relation: r.try_get(0).map_err(db_error)?,
                    fingerprint: r.try_get(1).map_err(db_error)?,
                    pending: r.try_get(2).map_err(db_error)?,
                    after: match after {
                        None => None,
                        Some(a) => Some(
                            image_from_json(&a)
                                .ok_or_else(|| integrity("a rematerialization cursor"))?,
                        ),
                    },
                    rows: to_u64(r.try_get(4).map_err(db_error)?)?,
                })
            })
            .collect()
    }

    pub(crate) async fn write_rematerializations(
        &mut self,
        records: &[Rematerialization],
    ) -> Result<(), StoreError> {
        write_rematerializations(&mut self.tx, records).await
    }

    pub(crate) async fn write_stream_reset(&mut self) -> Result<u64, StoreError> {
        let generation: i64 = sqlx::query_scalar(
            "UPDATE synchro.stream SET generation = generation + 1, \
             retention_generation = retention_generation + 1, \
             floor_lsn = -1, floor_event = 0, floor_effect = 0 RETURNING generation",
        )
        .fetch_one(&mut *self.tx)
        .await
        .map_err(db_error)?;
        // Not published, so no capture of it; every row belongs to the old generation.
        for sql in [
            // The new baseline reads every row under the current model.
            "UPDATE synchro.rematerializations SET pending = false, after_key = NULL, rows = 0",
            "TRUNCATE synchro.scope_effects, synchro.projections, synchro.scope_members, \
             synchro.dependency_rows, synchro.source_transactions, synchro.client_checkpoints, \
             synchro.rebuild_stage",
            // Sessions are swept but remembered: a replay of a first request
            // is 409, never a new session under the same rebuild_id.
            "UPDATE synchro.rebuild_sessions SET swept = true WHERE NOT swept",
            "UPDATE synchro.capture_progress SET commit_lsn = NULL, end_lsn = 0, \
             quarantine_lsn = NULL, quarantine_class = NULL",
            "UPDATE synchro.capture_slot SET baseline_done = false, baseline_chunks = 0, \
             idle_confirmed_lsn = 0",
        ] {
            sqlx::query(sql)
                .execute(&mut *self.tx)
                .await
                .map_err(db_error)?;
        }
        to_u64(generation)
    }

    /// Removes each pending fence recorded satisfied, with its record.
    pub(crate) async fn reconcile_satisfied_fences(&mut self) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "WITH paired AS (DELETE FROM synchro.pending_fences p USING synchro.satisfied_fences s \
               WHERE p.fence = s.fence RETURNING p.fence) \
             DELETE FROM synchro.satisfied_fences WHERE fence IN (SELECT fence FROM paired)",
        )
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(done.rows_affected())
    }

    pub(crate) async fn write_heartbeat(&mut self, beat: &Heartbeat) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO synchro.capture_heartbeat (heartbeat_at, caught_up_at, lag_bytes) \
             VALUES (clock_timestamp(), CASE WHEN $1 THEN clock_timestamp() END, $2) \
             ON CONFLICT (singleton) DO UPDATE SET heartbeat_at = EXCLUDED.heartbeat_at, \
               caught_up_at = coalesce(EXCLUDED.caught_up_at, synchro.capture_heartbeat.caught_up_at), \
               lag_bytes = EXCLUDED.lag_bytes",
        )
        .bind(beat.caught_up)
        .bind(to_i64(beat.lag_bytes)?)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(())
    }

    pub(crate) async fn read_capture_health(&mut self) -> Result<CaptureHealth, StoreError> {
        // Ages by the database's clock: every process reads the same one.
        let sql = format!(
            "SELECT (extract(epoch FROM clock_timestamp() - h.heartbeat_at) * 1e6)::int8, \
                    (extract(epoch FROM clock_timestamp() - h.caught_up_at) * 1e6)::int8, \
                    coalesce(h.lag_bytes, 0), p.quarantine_class IS NOT NULL OR {BASELINE_OWED} \
             FROM synchro.capture_progress p LEFT JOIN synchro.capture_heartbeat h ON true"
        );
        let r = sqlx::query(&sql)
            .fetch_one(&mut *self.tx)
            .await
            .map_err(db_error)?;
        let age = |micros: Option<i64>| {
            micros.map(|m| std::time::Duration::from_micros(u64::try_from(m).unwrap_or(0)))
        };
        Ok(CaptureHealth {
            heartbeat_age: age(r.try_get(0).map_err(db_error)?),
            caught_up_age: age(r.try_get(1).map_err(db_error)?),
            lag_bytes: to_u64(r.try_get(2).map_err(db_error)?)?,
            blocked: r.try_get(3).map_err(db_error)?,
        })
    }

    pub(crate) async fn read_scope_members(
        &mut self,
        scope: &ScopeId,
    ) -> Result<Vec<(RowIdentity, Digest)>, StoreError> {
        // An index-only range scan of the primary key, in identity order.
        sqlx::query(
            "SELECT identity, digest FROM synchro.scope_members \
             WHERE scope_id = $1 ORDER BY identity",
        )
        .bind(scope.as_str())
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?
        .iter()
        .map(identity_digest)
        .collect()
    }

    pub(crate) async fn read_has_stale_projections(
        &mut self,
        schema_version: u64,
    ) -> Result<bool, StoreError> {
        // Two ranges, not `<>`: a btree index cannot search for "not
        // equal", and `<>` read the whole index (about 60 ms at a million
        // projections) on every checksum computed and every rebuild.
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM synchro.projections \
             WHERE schema_version < $1 OR schema_version > $1)",
        )
        .bind(to_i64(schema_version)?)
        .fetch_one(&mut *self.tx)
        .await
        .map_err(db_error)
    }

    pub(crate) async fn read_stale_scope_members(
        &mut self,
        scope: &ScopeId,
        schema_version: u64,
    ) -> Result<Vec<Projection>, StoreError> {
        sqlx::query(
            "SELECT p.* FROM synchro.scope_members m JOIN synchro.projections p \
               ON p.table_id = m.table_id AND p.identity = m.identity \
             WHERE m.scope_id = $1 AND p.schema_version <> $2",
        )
        .bind(scope.as_str())
        .bind(to_i64(schema_version)?)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?
        .iter()
        .map(projection)
        .collect()
    }

    pub(crate) async fn read_projections(
        &mut self,
        table_id: &str,
        rows: &[RowIdentity],
    ) -> Result<Vec<Projection>, StoreError> {
        let ids: Vec<&[u8]> = rows.iter().map(RowIdentity::as_bytes).collect();
        sqlx::query("SELECT * FROM synchro.projections WHERE table_id = $1 AND identity = ANY($2)")
            .bind(table_id)
            .bind(ids)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)?
            .iter()
            .map(projection)
            .collect()
    }

    pub(crate) async fn read_dependency_rows_by_identity(
        &mut self,
        relation: &str,
        identities: &[String],
    ) -> Result<Vec<DependencyRow>, StoreError> {
        sqlx::query(
            "SELECT relation, identity, image::text AS image FROM synchro.dependency_rows \
             WHERE relation = $1 AND identity = ANY($2)",
        )
        .bind(relation)
        .bind(identities)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?
        .iter()
        .map(dependency)
        .collect()
    }

    pub(crate) async fn read_dependency_rows(
        &mut self,
        relation: &str,
        column: &str,
        values: &[String],
    ) -> Result<Vec<DependencyRow>, StoreError> {
        // The column is a literal, so the plan uses its index (see `install`).
        let sql = format!(
            "SELECT relation, identity, image::text AS image FROM synchro.dependency_rows \
             WHERE relation = $1 AND image ->> {} = ANY($2)",
            crate::sql::literal(column)
        );
        sqlx::query(&sql)
            .bind(relation)
            .bind(values)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)?
            .iter()
            .map(dependency)
            .collect()
    }

    pub(crate) async fn write_materialization(
        &mut self,
        m: &Materialization,
    ) -> Result<(), StoreError> {
        m.check_whole()?;
        self.same_generation(m.stream_generation).await?;
        let tx = &mut *self.tx;
        let advanced = sqlx::query(
            "UPDATE synchro.capture_progress SET commit_lsn = $1, end_lsn = $2, \
             quarantine_lsn = NULL, quarantine_class = NULL \
             WHERE commit_lsn IS NULL OR commit_lsn < $1",
        )
        .bind(to_i64(m.commit_lsn)?)
        .bind(to_i64(m.end_lsn)?)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        if advanced.rows_affected() != 1 {
            return Err(StoreError::Integrity(
                "materialization must advance progress".into(),
            ));
        }
        let t = &m.transactions;
        sqlx::query(
            "INSERT INTO synchro.source_transactions (commit_lsn, end_lsn, row_events) \
             SELECT * FROM UNNEST($1::int8[], $2::int8[], $3::int8[])",
        )
        .bind(
            t.iter()
                .map(|t| to_i64(t.commit_lsn))
                .collect::<Result<Vec<_>, _>>()?,
        )
        .bind(
            t.iter()
                .map(|t| to_i64(t.end_lsn))
                .collect::<Result<Vec<_>, _>>()?,
        )
        .bind(
            t.iter()
                .map(|t| to_i64(t.row_events))
                .collect::<Result<Vec<_>, _>>()?,
        )
        .execute(&mut *tx)
        .await
        .map_err(unique_is_integrity(
            "a source transaction materialized twice",
        ))?;
        if !m.new_projections.is_empty() {
            let p = &m.new_projections;
            let inserted = sqlx::query(
                "INSERT INTO synchro.projections (table_id, identity, key, row_json, version, digest, \
                 schema_version, tombstone, scopes) \
                 SELECT * FROM UNNEST($1::text[], $2::bytea[], $3::text[], $4::text[], $5::text[], \
                 $6::bytea[], $7::int8[], $8::bool[], $9::text[])",
            );
            // A plain insert (cheaper than ON CONFLICT); a duplicate means the
            // materializer's view of prior state was wrong: an integrity failure.
            bind_projections(inserted, p)?
                .execute(&mut *tx)
                .await
                .map_err(unique_is_integrity("a new projection already existed"))?;
        }
        if !m.put_projections.is_empty() {
            let p = &m.put_projections;
            let replaced = sqlx::query(
                "UPDATE synchro.projections p SET key = u.k, row_json = u.r, version = u.v, \
                 digest = u.d, schema_version = u.s, tombstone = u.tb, scopes = u.sc \
                 FROM UNNEST($1::text[], $2::bytea[], $3::text[], $4::text[], $5::text[], \
                 $6::bytea[], $7::int8[], $8::bool[], $9::text[]) AS u(t, i, k, r, v, d, s, tb, sc) \
                 WHERE p.table_id = u.t AND p.identity = u.i",
            );
            let done = bind_projections(replaced, p)?
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            if done.rows_affected() != p.len() as u64 {
                return Err(integrity("a replaced projection was absent"));
            }
        }
        if !m.removed_projections.is_empty() {
            let r = &m.removed_projections;
            let done = sqlx::query(
                "DELETE FROM synchro.projections p USING UNNEST($1::text[], $2::bytea[]) AS u(t, i) \
                 WHERE p.table_id = u.t AND p.identity = u.i",
            )
            .bind(r.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>())
            .bind(r.iter().map(|(_, i)| i.as_bytes()).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
            if done.rows_affected() != r.len() as u64 {
                return Err(integrity("a removed projection was absent"));
            }
        }
        write_members(tx, m).await?;
        if !m.removed_dependencies.is_empty() {
            let r = &m.removed_dependencies;
            sqlx::query(
                "DELETE FROM synchro.dependency_rows d USING UNNEST($1::text[], $2::text[]) AS u(r, i) \
                 WHERE d.relation = u.r AND d.identity = u.i",
            )
            .bind(r.iter().map(|(rel, _)| rel.as_str()).collect::<Vec<_>>())
            .bind(r.iter().map(|(_, i)| i.as_str()).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        }
        if !m.put_dependencies.is_empty() {
            let d = &m.put_dependencies;
            sqlx::query(
                "INSERT INTO synchro.dependency_rows (relation, identity, image) \
                 SELECT r, i, im::jsonb FROM UNNEST($1::text[], $2::text[], $3::text[]) AS u(r, i, im) \
                 ON CONFLICT (relation, identity) DO UPDATE SET image = EXCLUDED.image",
            )
            .bind(d.iter().map(|d| d.relation.as_str()).collect::<Vec<_>>())
            .bind(d.iter().map(|d| d.identity.as_str()).collect::<Vec<_>>())
            .bind(d.iter().map(|d| image_json(&d.image)).collect::<Vec<_>>())
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        }
        if !m.effects.is_empty() {
            // Only each row's last effect in a scope is ever served, so it
            // replaces the one it supersedes: a stored one by the conflict on
            // the row's unique index (ADR 0034), an earlier one of this group
            // by not being inserted (docs/adr/0024).
            let mut last: HashMap<(&str, &str, &[u8]), &Effect> = HashMap::new();
            for e in &m.effects {
                let key = (e.scope.as_str(), e.table_id.as_str(), e.identity.as_bytes());
                match last.get(&key) {
                    Some(l) if l.position() == e.position() => {
                        return Err(StoreError::Integrity("two effects at one position".into()));
                    }
                    Some(l) if l.position() > e.position() => {}
                    _ => {
                        last.insert(key, e);
                    }
                }
            }
            let mut e: Vec<&Effect> = last.into_values().collect();
            e.sort_by_key(|e| (e.scope.as_str(), e.position()));
            let positions = e
                .iter()
                .map(|e| {
                    Ok((
                        to_i64(e.commit_lsn)?,
                        to_i64(e.event_ordinal)?,
                        to_i64(e.effect_ordinal)?,
                    ))
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            // The replaced effect must be earlier. A later one stored means
            // the materialization is out of order: the update skips the row,
            // and the count below refuses the whole. A row's content is its
            // projection's, written beside (ADR 0037); only a removal keeps
            // a version of its own.
            let written = sqlx::query(
                "INSERT INTO synchro.scope_effects AS e (scope_id, commit_lsn, event_ordinal, \
                 effect_ordinal, table_id, identity, key_json, op, version) \
                 SELECT * FROM UNNEST($1::text[], $2::int8[], $3::int8[], $4::int8[], $5::text[], \
                 $6::bytea[], $7::text[], $8::int2[], $9::text[]) \
                 ON CONFLICT (scope_id, table_id, identity) DO UPDATE SET \
                 commit_lsn = EXCLUDED.commit_lsn, event_ordinal = EXCLUDED.event_ordinal, \
                 effect_ordinal = EXCLUDED.effect_ordinal, key_json = EXCLUDED.key_json, \
                 op = EXCLUDED.op, version = EXCLUDED.version \
                 WHERE (e.commit_lsn, e.event_ordinal, e.effect_ordinal) \
                 < (EXCLUDED.commit_lsn, EXCLUDED.event_ordinal, EXCLUDED.effect_ordinal)",
            )
            .bind(e.iter().map(|e| e.scope.as_str()).collect::<Vec<_>>())
            .bind(positions.iter().map(|p| p.0).collect::<Vec<_>>())
            .bind(positions.iter().map(|p| p.1).collect::<Vec<_>>())
            .bind(positions.iter().map(|p| p.2).collect::<Vec<_>>())
            .bind(e.iter().map(|e| e.table_id.as_str()).collect::<Vec<_>>())
            .bind(e.iter().map(|e| e.identity.as_bytes()).collect::<Vec<_>>())
            .bind(
                e.iter()
                    .map(|e| json::to_canonical_string(&e.key))
                    .collect::<Vec<_>>(),
            )
            .bind(
                e.iter()
                    .map(|e| match e.op {
                        EffectOp::Upsert(_) => OP_UPSERT,
                        EffectOp::Remove(_) => OP_REMOVE,
                        EffectOp::Tombstone(_) => OP_TOMBSTONE,
                    })
                    .collect::<Vec<_>>(),
            )
            .bind(
                e.iter()
                    .map(|e| match &e.op {
                        EffectOp::Remove(v) => Some(v.as_str()),
                        EffectOp::Upsert(_) | EffectOp::Tombstone(_) => None,
                    })
                    .collect::<Vec<_>>(),
            )
            .execute(&mut *tx)
            .await
            .map_err(unique_is_integrity("two effects at one position"))?;
            if written.rows_affected() != e.len() as u64 {
                return Err(integrity("an effect replaced a later one of its row"));
            }
        }
        write_rematerializations(tx, &m.rematerialized).await?;
        satisfy_fences(tx, &m.fences).await
    }

    pub(crate) async fn write_baseline_chunk(&mut self, index: u64) -> Result<(), StoreError> {
        let index = i64::try_from(index).map_err(|_| integrity("a baseline chunk's index"))?;
        let moved = sqlx::query(
            "UPDATE synchro.capture_slot SET baseline_chunks = $1 + 1 \
             WHERE NOT baseline_done AND baseline_chunks = $1",
        )
        .bind(index)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        if moved.rows_affected() != 1 {
            return Err(StoreError::Integrity(
                "baseline chunks commit in order, while the baseline is owed".into(),
            ));
        }
        Ok(())
    }

    /// The baseline ends: handed over to re-reads (a chunk of it must
    /// have committed) or complete. The slot is the stream's from now on,
    /// and a quarantine of a chunk is lifted.
    async fn write_baseline_ended(&mut self, handed_over: bool) -> Result<(), StoreError> {
        let (sql, refusal) = match handed_over {
            true => (
                "UPDATE synchro.capture_slot SET baseline_done = true \
                 WHERE NOT baseline_done AND baseline_chunks > 0",
                "no baseline with a chunk committed to hand over",
            ),
            false => (
                "UPDATE synchro.capture_slot SET baseline_done = true WHERE NOT baseline_done",
                "no baseline is owed: the stream's slot is not a candidate",
            ),
        };
        let ended = sqlx::query(sql)
            .execute(&mut *self.tx)
            .await
            .map_err(db_error)?;
        if ended.rows_affected() != 1 {
            return Err(StoreError::Integrity(refusal.into()));
        }
        sqlx::query(
            "UPDATE synchro.capture_progress SET quarantine_lsn = NULL, quarantine_class = NULL",
        )
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(())
    }

    pub(crate) async fn write_baseline_handed_over(&mut self) -> Result<(), StoreError> {
        self.write_baseline_ended(true).await
    }

    pub(crate) async fn write_baseline_done(
        &mut self,
        covered_fences: &[u64],
    ) -> Result<(), StoreError> {
        self.write_baseline_ended(false).await?;
        satisfy_fences(&mut self.tx, covered_fences).await
    }

    /// Capture read its progress in `stream_generation`: refused once a
    /// reset began another. A reset waits for this lock.
    async fn same_generation(&mut self, stream_generation: u64) -> Result<(), StoreError> {
        let generation: i64 = sqlx::query_scalar("SELECT generation FROM synchro.stream FOR SHARE")
            .fetch_one(&mut *self.tx)
            .await
            .map_err(db_error)?;
        if to_u64(generation)? != stream_generation {
            return Err(StoreError::Unavailable(
                "the stream was reset since capture read its progress".into(),
            ));
        }
        Ok(())
    }

    pub(crate) async fn write_quarantine(
        &mut self,
        q: &Quarantine,
        stream_generation: u64,
    ) -> Result<(), StoreError> {
        self.same_generation(stream_generation).await?;
        sqlx::query(
            "UPDATE synchro.capture_progress SET quarantine_lsn = $1, quarantine_class = $2",
        )
        .bind(to_i64(q.commit_lsn)?)
        .bind(q.problem.as_str())
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(())
    }

    pub(crate) async fn read_scope_effects(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
    ) -> Result<Vec<Effect>, StoreError> {
        let a = bounds(after)?;
        let t = bounds(StreamPosition::from(through))?;
        sqlx::query(&format!(
            "SELECT {EFFECT_COLUMNS} FROM {EFFECTS_WITH_ROWS} WHERE e.scope_id = $1 \
             AND (e.commit_lsn, e.event_ordinal, e.effect_ordinal) > ($2, $3, $4) \
             AND (e.commit_lsn, e.event_ordinal, e.effect_ordinal) <= ($5, $6, $7) \
             ORDER BY e.commit_lsn, e.event_ordinal, e.effect_ordinal"
        ))
        .bind(scope.as_str())
        .bind(a.0)
        .bind(a.1)
        .bind(a.2)
        .bind(t.0)
        .bind(t.1)
        .bind(t.2)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?
        .iter()
        .map(effect)
        .collect::<Result<Vec<_>, _>>()
        .inspect(|read| assert_effect_window(read, scope, after, through, None))
    }
}

/// Applies the group's membership changes to the index, each member with
/// its row's digest: at most three statements, whatever the size. A row
/// that leaves a scope it is not in, or joins one it is in, means the
/// materializer's view of prior state was wrong: an integrity failure.
async fn write_members(tx: &mut sqlx::PgConnection, m: &Materialization) -> Result<(), StoreError> {
    if !m.left.is_empty() {
        let done = sqlx::query(
            "DELETE FROM synchro.scope_members m USING UNNEST($1::text[], $2::bytea[]) AS u(s, i) \
             WHERE m.scope_id = u.s AND m.identity = u.i",
        )
        .bind(m.left.iter().map(|l| l.scope.as_str()).collect::<Vec<_>>())
        .bind(
            m.left
                .iter()
                .map(|l| l.identity.as_bytes())
                .collect::<Vec<_>>(),
        )
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        if done.rows_affected() != m.left.len() as u64 {
            return Err(integrity("a row left a scope it was not in"));
        }
    }
    // Every row the group wrote: a member joins with its digest, and a row
    // that stayed in a scope gets its new one.
    let written: HashMap<(&str, &[u8]), &Projection> = m
        .new_projections
        .iter()
        .chain(&m.put_projections)
        .map(|p| ((p.table_id.as_str(), p.identity.as_bytes()), p))
        .collect();
    let joined: HashSet<(&str, &[u8])> = m
        .joined
        .iter()
        .map(|j| (j.scope.as_str(), j.identity.as_bytes()))
        .collect();
    if !m.joined.is_empty() {
        let digests = m
            .joined
            .iter()
            .map(|j| {
                written
                    .get(&(j.table_id.as_str(), j.identity.as_bytes()))
                    .map(|p| p.digest.0.to_vec())
                    .ok_or_else(|| integrity("a row joined a scope without its projection"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        sqlx::query(
            "INSERT INTO synchro.scope_members (scope_id, identity, table_id, digest) \
             SELECT * FROM UNNEST($1::text[], $2::bytea[], $3::text[], $4::bytea[])",
        )
        .bind(
            m.joined
                .iter()
                .map(|j| j.scope.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(
            m.joined
                .iter()
                .map(|j| j.identity.as_bytes())
                .collect::<Vec<_>>(),
        )
        .bind(
            m.joined
                .iter()
                .map(|j| j.table_id.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(digests)
        .execute(&mut *tx)
        .await
        .map_err(unique_is_integrity("a row joined a scope it was in"))?;
    }
    let stayed: Vec<(&str, &Projection)> = m
        .put_projections
        .iter()
        .flat_map(|p| p.scopes.iter().map(move |s| (s.as_str(), p)))
        .filter(|(s, p)| !joined.contains(&(*s, p.identity.as_bytes())))
        .collect();
    if !stayed.is_empty() {
        let done = sqlx::query(
            "UPDATE synchro.scope_members m SET digest = u.d \
             FROM UNNEST($1::text[], $2::bytea[], $3::bytea[]) AS u(s, i, d) \
             WHERE m.scope_id = u.s AND m.identity = u.i",
        )
        .bind(stayed.iter().map(|(s, _)| *s).collect::<Vec<_>>())
        .bind(
            stayed
                .iter()
                .map(|(_, p)| p.identity.as_bytes())
                .collect::<Vec<_>>(),
        )
        .bind(
            stayed
                .iter()
                .map(|(_, p)| p.digest.0.to_vec())
                .collect::<Vec<_>>(),
        )
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        if done.rows_affected() != stayed.len() as u64 {
            return Err(integrity("a row stayed in a scope it was not in"));
        }
    }
    Ok(())
}
