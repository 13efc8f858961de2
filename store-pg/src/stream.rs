//! The pull stream's lineage on PostgreSQL: the stream row, token keys,
//! membership rule history, client checkpoints, pending fences, and the
//! reads of scope effects that pull makes (retained candidates, the last
//! effect before a position). One statement per operation.

use std::collections::BTreeMap;

use actors::capture::Effect;
use actors::store::StoreError;
use actors::stream::{Checkpoint, MembershipRules, StreamState};
use protocol::ids::ScopeId;
use protocol::position::{Boundary, StreamPosition};
use protocol::token::{KeyState, TokenKey, TokenKind};
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::materialized::{
    EFFECT_COLUMNS, EFFECTS_WITH_ROWS, assert_effect_window, bounds, effect,
};
use crate::sql::{to_i64, to_u64};
use crate::{PgTx, db_error};

fn integrity(what: &str) -> StoreError {
    StoreError::Integrity(format!("stored stream state is invalid: {what}"))
}

/// The inverse of `bounds`: a position from its three stored columns.
pub(crate) fn position(lsn: i64, event: i64, effect: i64) -> Result<StreamPosition, StoreError> {
    Ok(match (lsn, event, effect) {
        (-1, 0, 0) => StreamPosition::GenerationStart,
        (l, i64::MAX, i64::MAX) => StreamPosition::TransactionEnd {
            commit_lsn: to_u64(l)?,
        },
        (l, v, f) => StreamPosition::Effect {
            commit_lsn: to_u64(l)?,
            event_ordinal: to_u64(v)?,
            effect_ordinal: to_u64(f)?,
        },
    })
}

fn state_text(state: KeyState) -> &'static str {
    match state {
        KeyState::Active => "active",
        KeyState::VerifyOnly => "verify_only",
    }
}

fn kind_text(k: TokenKind) -> &'static str {
    match k {
        TokenKind::IncrementalCursor => "incremental",
        TokenKind::RebuildContinuation => "rebuild",
    }
}

/// The columns [`stream_at`] decodes, over `synchro.stream s`.
pub(crate) const STREAM_COLUMNS: &str =
    "s.generation, s.retention_generation, s.floor_lsn, s.floor_event, s.floor_effect";

/// The stream state in `r`'s columns from `at` ([`STREAM_COLUMNS`]).
pub(crate) fn stream_at(r: &PgRow, at: usize) -> Result<StreamState, StoreError> {
    let get = |i: usize| r.try_get::<i64, _>(at + i).map_err(db_error);
    Ok(StreamState {
        generation: to_u64(get(0)?)?,
        retention_generation: to_u64(get(1)?)?,
        floor: position(get(2)?, get(3)?, get(4)?)?,
    })
}

/// A client's checkpoints as five aligned arrays, over the rows of
/// `synchro.client_checkpoints k` it aggregates ([`checkpoints_at`]).
pub(crate) const CHECKPOINT_ARRAYS: &str = "coalesce(array_agg(k.scope_id), '{}'), \
    coalesce(array_agg(k.stream_generation), '{}'), coalesce(array_agg(k.commit_lsn), '{}'), \
    coalesce(array_agg(k.event_ordinal), '{}'), coalesce(array_agg(k.effect_ordinal), '{}')";

/// The checkpoints in `r`'s columns from `at` ([`CHECKPOINT_ARRAYS`]).
pub(crate) fn checkpoints_at(
    r: &PgRow,
    at: usize,
) -> Result<BTreeMap<ScopeId, Checkpoint>, StoreError> {
    let scopes: Vec<String> = r.try_get(at).map_err(db_error)?;
    let get = |i: usize| r.try_get::<Vec<i64>, _>(at + i).map_err(db_error);
    let (generations, lsns, events, effects) = (get(1)?, get(2)?, get(3)?, get(4)?);
    assert!(
        [&generations, &lsns, &events, &effects]
            .iter()
            .all(|a| a.len() == scopes.len()),
        "one aggregate's arrays are aligned"
    );
    scopes
        .iter()
        .enumerate()
        .map(|(i, scope)| {
            Ok((
                ScopeId::parse(scope).ok_or_else(|| integrity("checkpoint scope"))?,
                Checkpoint {
                    stream_generation: to_u64(generations[i])?,
                    position: position(lsns[i], events[i], effects[i])?,
                },
            ))
        })
        .collect()
}

/// The client `$1`'s pending fences that no materialization satisfied,
/// in order, at most `$2`.
pub(crate) const UNSATISFIED_FENCES: &str = "SELECT f.fence FROM synchro.pending_fences f \
    WHERE f.client_id = $1 \
      AND NOT EXISTS (SELECT 1 FROM synchro.satisfied_fences sf WHERE sf.fence = f.fence) \
    ORDER BY f.fence LIMIT $2";

impl PgTx {
    pub(crate) async fn read_stream_state(&mut self) -> Result<StreamState, StoreError> {
        let sql = format!("SELECT {STREAM_COLUMNS} FROM synchro.stream s");
        let r = sqlx::query(&sql)
            .fetch_one(&mut *self.tx)
            .await
            .map_err(db_error)?;
        stream_at(&r, 0)
    }

    pub(crate) async fn read_membership_rules(
        &mut self,
    ) -> Result<Vec<MembershipRules>, StoreError> {
        let rows = sqlx::query(
            "SELECT table_id, generation, fingerprint, templates FROM synchro.membership_rules \
             ORDER BY table_id, generation",
        )
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?;
        rows.iter()
            .map(|r| {
                Ok(MembershipRules {
                    table_id: r.try_get(0).map_err(db_error)?,
                    generation: to_u64(r.try_get(1).map_err(db_error)?)?,
                    fingerprint: r.try_get(2).map_err(db_error)?,
                    templates: r.try_get(3).map_err(db_error)?,
                })
            })
            .collect()
    }

    pub(crate) async fn write_membership_rules(
        &mut self,
        rules: &[MembershipRules],
    ) -> Result<(), StoreError> {
        for r in rules {
            let done = sqlx::query(
                "INSERT INTO synchro.membership_rules (table_id, generation, fingerprint, templates) \
                 VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            )
            .bind(&r.table_id)
            .bind(to_i64(r.generation)?)
            .bind(&r.fingerprint)
            .bind(&r.templates)
            .execute(&mut *self.tx)
            .await
            .map_err(db_error)?;
            if done.rows_affected() != 1 {
                return Err(integrity("a rule generation stored twice"));
            }
        }
        Ok(())
    }

    pub(crate) async fn read_token_keys(&mut self) -> Result<Vec<TokenKey>, StoreError> {
        let rows = sqlx::query(
            "SELECT key_id, kind, state, secret FROM synchro.token_keys ORDER BY key_id",
        )
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?;
        rows.iter()
            .map(|r| {
                let kind: String = r.try_get(1).map_err(db_error)?;
                let state: String = r.try_get(2).map_err(db_error)?;
                let secret: Vec<u8> = r.try_get(3).map_err(db_error)?;
                Ok(TokenKey {
                    key_id: r.try_get(0).map_err(db_error)?,
                    kind: match kind.as_str() {
                        "incremental" => TokenKind::IncrementalCursor,
                        "rebuild" => TokenKind::RebuildContinuation,
                        _ => return Err(integrity("token key kind")),
                    },
                    state: match state.as_str() {
                        "active" => KeyState::Active,
                        "verify_only" => KeyState::VerifyOnly,
                        _ => return Err(integrity("token key state")),
                    },
                    secret: secret
                        .try_into()
                        .map_err(|_| integrity("token key length"))?,
                })
            })
            .collect()
    }

    pub(crate) async fn rotate_keys(&mut self, fresh: &[TokenKey]) -> Result<(), StoreError> {
        sqlx::query("UPDATE synchro.token_keys SET state = 'verify_only' WHERE state = 'active'")
            .execute(&mut *self.tx)
            .await
            .map_err(db_error)?;
        let done = sqlx::query(
            "INSERT INTO synchro.token_keys (key_id, kind, state, secret) \
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bytea[]) \
             ON CONFLICT DO NOTHING",
        )
        .bind(fresh.iter().map(|k| k.key_id.as_str()).collect::<Vec<_>>())
        .bind(fresh.iter().map(|k| kind_text(k.kind)).collect::<Vec<_>>())
        .bind(
            fresh
                .iter()
                .map(|k| state_text(k.state))
                .collect::<Vec<_>>(),
        )
        .bind(fresh.iter().map(|k| k.secret.to_vec()).collect::<Vec<_>>())
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        if done.rows_affected() != fresh.len() as u64 {
            return Err(integrity("a token key ID stored twice"));
        }
        Ok(())
    }

    pub(crate) async fn drop_key(&mut self, key_id: &str) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "DELETE FROM synchro.token_keys WHERE key_id = $1 AND state = 'verify_only'",
        )
        .bind(key_id)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    pub(crate) async fn write_token_keys(&mut self, keys: &[TokenKey]) -> Result<(), StoreError> {
        // All or none: a process that stored its keys first keeps them.
        sqlx::query(
            "INSERT INTO synchro.token_keys (key_id, kind, state, secret) \
             SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bytea[]) \
             WHERE NOT EXISTS (SELECT 1 FROM synchro.token_keys) ON CONFLICT DO NOTHING",
        )
        .bind(keys.iter().map(|k| k.key_id.as_str()).collect::<Vec<_>>())
        .bind(keys.iter().map(|k| kind_text(k.kind)).collect::<Vec<_>>())
        .bind(keys.iter().map(|k| state_text(k.state)).collect::<Vec<_>>())
        .bind(keys.iter().map(|k| k.secret.to_vec()).collect::<Vec<_>>())
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(())
    }

    pub(crate) async fn read_checkpoints(
        &mut self,
        client_id: &str,
    ) -> Result<BTreeMap<ScopeId, Checkpoint>, StoreError> {
        let sql = format!(
            "SELECT {CHECKPOINT_ARRAYS} FROM synchro.client_checkpoints k WHERE k.client_id = $1"
        );
        let r = sqlx::query(&sql)
            .bind(client_id)
            .fetch_one(&mut *self.tx)
            .await
            .map_err(db_error)?;
        checkpoints_at(&r, 0)
    }

    pub(crate) async fn write_checkpoints(
        &mut self,
        client_id: &str,
        checkpoints: &[(ScopeId, Checkpoint)],
    ) -> Result<(), StoreError> {
        if checkpoints.is_empty() {
            return Ok(());
        }
        let mut cols: [Vec<i64>; 4] = Default::default();
        for (_, c) in checkpoints {
            let (l, v, f) = bounds(c.position)?;
            cols[0].push(to_i64(c.stream_generation)?);
            cols[1].push(l);
            cols[2].push(v);
            cols[3].push(f);
        }
        sqlx::query(
            "INSERT INTO synchro.client_checkpoints \
               (client_id, scope_id, stream_generation, commit_lsn, event_ordinal, effect_ordinal) \
             SELECT $1, * FROM UNNEST($2::text[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[]) \
             ON CONFLICT (client_id, scope_id) DO UPDATE SET \
               stream_generation = EXCLUDED.stream_generation, commit_lsn = EXCLUDED.commit_lsn, \
               event_ordinal = EXCLUDED.event_ordinal, effect_ordinal = EXCLUDED.effect_ordinal, \
               acknowledged_at = now()",
        )
        .bind(client_id)
        .bind(
            checkpoints
                .iter()
                .map(|(s, _)| s.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(&cols[0])
        .bind(&cols[1])
        .bind(&cols[2])
        .bind(&cols[3])
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        Ok(())
    }

    pub(crate) async fn read_pending_fences(
        &mut self,
        client_id: &str,
        max: usize,
    ) -> Result<Vec<u64>, StoreError> {
        let rows: Vec<i64> = sqlx::query_scalar(UNSATISFIED_FENCES)
            .bind(client_id)
            .bind(to_i64(max as u64)?)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)?;
        rows.into_iter().map(to_u64).collect()
    }

    pub(crate) async fn read_scope_candidates(
        &mut self,
        scope: &ScopeId,
        after: StreamPosition,
        through: Boundary,
        max: usize,
    ) -> Result<Vec<Effect>, StoreError> {
        let a = bounds(after)?;
        let t = bounds(StreamPosition::from(through))?;
        // A range of the primary key: the table holds only each row's last
        // effect in a scope (a unique index; the materializer replaces what
        // it supersedes, ADR 0034), and nothing past `through`.
        sqlx::query(&format!(
            "SELECT {EFFECT_COLUMNS} FROM {EFFECTS_WITH_ROWS} WHERE e.scope_id = $1 \
             AND (e.commit_lsn, e.event_ordinal, e.effect_ordinal) > ($2, $3, $4) \
             AND (e.commit_lsn, e.event_ordinal, e.effect_ordinal) <= ($5, $6, $7) \
             ORDER BY e.commit_lsn, e.event_ordinal, e.effect_ordinal LIMIT $8"
        ))
        .bind(scope.as_str())
        .bind(a.0)
        .bind(a.1)
        .bind(a.2)
        .bind(t.0)
        .bind(t.1)
        .bind(t.2)
        .bind(i64::try_from(max).map_err(|_| integrity("candidate count"))?)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?
        .iter()
        .map(effect)
        .collect::<Result<Vec<_>, _>>()
        .inspect(|read| assert_effect_window(read, scope, after, through, Some(max)))
    }

    pub(crate) async fn read_last_effect_before(
        &mut self,
        scope: &ScopeId,
        before: StreamPosition,
    ) -> Result<Option<StreamPosition>, StoreError> {
        let mut last = self.read_last_effects_before(&[scope], before).await?;
        Ok(last.pop().flatten())
    }

    pub(crate) async fn read_last_effects_before(
        &mut self,
        scopes: &[&ScopeId],
        before: StreamPosition,
    ) -> Result<Vec<Option<StreamPosition>>, StoreError> {
        let b = bounds(before)?;
        let ids: Vec<&str> = scopes.iter().map(|s| s.as_str()).collect();
        let rows = sqlx::query(
            "SELECT e.commit_lsn, e.event_ordinal, e.effect_ordinal \
             FROM unnest($1::text[]) WITH ORDINALITY AS s(scope_id, n) \
             LEFT JOIN LATERAL (SELECT commit_lsn, event_ordinal, effect_ordinal \
               FROM synchro.scope_effects \
               WHERE scope_id = s.scope_id \
                 AND (commit_lsn, event_ordinal, effect_ordinal) < ($2, $3, $4) \
               ORDER BY commit_lsn DESC, event_ordinal DESC, effect_ordinal DESC LIMIT 1) e \
             ON true ORDER BY s.n",
        )
        .bind(ids)
        .bind(b.0)
        .bind(b.1)
        .bind(b.2)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db_error)?;
        assert_eq!(rows.len(), scopes.len(), "one answer per scope");
        let last: Vec<Option<StreamPosition>> = rows
            .iter()
            .map(
                |r| match r.try_get::<Option<i64>, _>(0).map_err(db_error)? {
                    None => Ok(None),
                    Some(_) => row_position(r).map(Some),
                },
            )
            .collect::<Result<_, StoreError>>()?;
        assert!(
            last.iter().flatten().all(|p| *p < before),
            "a scope's last effect before a position is before it"
        );
        Ok(last)
    }
}

/// The position in a row's first three columns (lsn, event, effect).
pub(crate) fn row_position(r: &sqlx::postgres::PgRow) -> Result<StreamPosition, StoreError> {
    let get = |i: usize| r.try_get::<i64, _>(i).map_err(db_error);
    position(get(0)?, get(1)?, get(2)?)
}
