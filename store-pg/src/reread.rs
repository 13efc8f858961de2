//! A re-read chunk on PostgreSQL (ADR 0020): the rows of one relation after
//! a cursor, in identity order, read `FOR SHARE` (no transaction can change
//! or delete them until this one ends), then a transactional watermark
//! message, in one transaction. A change committed before the watermark is
//! in the chunk or was waited for by the lock, and one committed after it
//! comes after the watermark in the WAL, so the chunk is exactly the rows'
//! state at the watermark's position. A registered row that has no version
//! yet (its table was registered after it was written) gets one here.

use actors::capture::{
    ChangeKind, RereadChunk, RereadRequest, SourceEvent, SourceImage, VersionNote,
};
use actors::store::StoreError;
use sqlx::postgres::PgConnection;
use sqlx::{Connection, Executor, Row};

use crate::baseline::{TEXT_FORMS, source};
use crate::db_error;
use crate::sql::{literal, quote_column, quote_relation};

/// The prefix of the watermark's logical message; the feed reads its content.
pub(crate) const WATERMARK_PREFIX: &str = "synchro.watermark";

/// Reads the chunk `req` asks for on `conn` and commits its watermark.
pub(crate) async fn read_chunk(
    conn: &mut PgConnection,
    req: &RereadRequest,
) -> Result<RereadChunk, StoreError> {
    let mut tx = conn.begin().await.map_err(db_error)?;
    tx.execute(TEXT_FORMS).await.map_err(db_error)?;
    let s = source(&mut tx, &req.relation, None).await?;
    let rel = quote_relation(&req.relation);
    // Each type's output function, as pgoutput and COPY write it (a cast to
    // text is not always that: a boolean casts to `true`, outputs `t`).
    let columns: Vec<String> = (s.columns.iter())
        .map(|c| {
            let c = quote_column(c);
            format!("CASE WHEN r.{c} IS NULL THEN NULL ELSE format('%s', r.{c}) END")
        })
        .collect();
    let identity: Vec<String> = (s.identity.iter())
        .map(|c| format!("r.{}", quote_column(c)))
        .collect();
    let after = match &req.after {
        None => String::new(),
        // The cursor's text forms, cast to the columns' types by the relation's row type.
        Some(_) => format!(
            "WHERE ({}) > (SELECT {} FROM json_populate_record(NULL::{rel}, $1::json) p)",
            identity.join(", "),
            (s.identity.iter())
                .map(|c| format!("p.{}", quote_column(c)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let (version, join) = match &req.registered {
        None => (String::new(), String::new()),
        Some((table_id, pk)) => (
            format!(", v.version, to_jsonb(r.{}) #>> '{{}}'", quote_column(pk)),
            format!(
                "LEFT JOIN synchro.row_versions v ON v.table_id = {} \
                 AND v.key = to_jsonb(r.{}) #>> '{{}}' AND NOT v.deleted",
                literal(table_id),
                quote_column(pk)
            ),
        ),
    };
    let sql = format!(
        "SELECT {}{version} FROM {rel} r {join} {after} ORDER BY {} LIMIT {} FOR SHARE OF r",
        columns.join(", "),
        identity.join(", "),
        req.limit
    );
    let cursor = req.after.as_ref().map(actors::capture::image_json);
    let mut query = sqlx::query(&sql);
    if let Some(cursor) = cursor {
        query = query.bind(cursor);
    }
    let rows = query.fetch_all(&mut *tx).await.map_err(db_error)?;
    assert!(
        rows.len() <= req.limit,
        "a re-read chunk never exceeds its limit"
    );
    let mut chunk = RereadChunk {
        estimated_rows: estimated_rows(&mut tx, &req.relation).await?,
        ..RereadChunk::default()
    };
    let mut unversioned: Vec<(String, String)> = Vec::new();
    for r in rows {
        let mut image = SourceImage::new();
        for (i, c) in s.columns.iter().enumerate() {
            image.insert(c.clone(), r.try_get(i).map_err(db_error)?);
        }
        let identity: SourceImage = (s.identity.iter())
            .map(|c| (c.clone(), image.get(c).cloned().flatten()))
            .collect();
        if let Some((table_id, _)) = &req.registered {
            let n = s.columns.len();
            let key: String = r.try_get(n + 1).map_err(db_error)?;
            let version = match r.try_get::<Option<String>, _>(n).map_err(db_error)? {
                Some(v) => v,
                None => {
                    let fresh = fresh_version()?;
                    unversioned.push((key.clone(), fresh.clone()));
                    fresh
                }
            };
            chunk.notes.push(VersionNote {
                table_id: table_id.clone(),
                key,
                version,
                fence: 0,
                client: false,
            });
        }
        assert!(
            chunk.events.last().is_none_or(|e| e.identity != identity),
            "a re-read chunk holds each row once"
        );
        chunk.events.push(SourceEvent {
            relation: req.relation.clone(),
            kind: ChangeKind::Update,
            identity,
            new: Some(image),
        });
    }
    if let Some((table_id, _)) = &req.registered
        && !unversioned.is_empty()
    {
        // The rows are locked: no trigger writes their versions meanwhile.
        sqlx::query(
            "INSERT INTO synchro.row_versions (table_id, key, version, fence, deleted) \
             SELECT $1, k, v, 0, false FROM unnest($2::text[], $3::text[]) AS n(k, v) \
             ON CONFLICT (table_id, key) DO NOTHING",
        )
        .bind(table_id)
        .bind(
            unversioned
                .iter()
                .map(|(k, _)| k.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(
            unversioned
                .iter()
                .map(|(_, v)| v.as_str())
                .collect::<Vec<_>>(),
        )
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    }
    sqlx::query("SELECT pg_logical_emit_message(true, $1, $2)")
        .bind(WATERMARK_PREFIX)
        .bind(&req.watermark)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    tx.commit().await.map_err(db_error)?;
    Ok(chunk)
}

/// The relation's size as the planner estimates it: its last statistics'
/// rows per page times its pages now. `None` before its first `ANALYZE`.
pub(crate) async fn estimated_rows(
    conn: &mut PgConnection,
    relation: &str,
) -> Result<Option<u64>, StoreError> {
    let rows: Option<f64> = sqlx::query_scalar(
        "SELECT CASE WHEN c.reltuples < 0 THEN NULL \
                     WHEN c.relpages = 0 THEN c.reltuples::float8 \
                     ELSE c.reltuples / c.relpages \
                          * (pg_relation_size(c.oid) / current_setting('block_size')::int8) END \
         FROM pg_class c WHERE c.oid = to_regclass($1)",
    )
    .bind(relation)
    .fetch_optional(&mut *conn)
    .await
    .map_err(db_error)?
    .flatten();
    Ok(rows.map(|r| r.max(0.0).round() as u64))
}

/// A new opaque version, in the trigger's form (32 hex digits).
fn fresh_version() -> Result<String, StoreError> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| StoreError::Unavailable(format!("no entropy: {e}")))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
