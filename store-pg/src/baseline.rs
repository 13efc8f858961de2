//! The baseline on PostgreSQL (ADR 0011): every captured row as it stood
//! at the stream slot's exported snapshot, read on a connection that
//! imported it (`SET TRANSACTION SNAPSHOT`), with `COPY ... TO STDOUT` (the
//! text form pgoutput also sends), one relation after another in identity
//! order (ADR 0030), in chunks positioned just below the slot's consistent
//! point. A registered row without a version gets one.

use actors::capture::{
    BASELINE_CHUNK_ROWS, Baseline, CapturePlan, ChangeKind, Lsn, SourceEvent, SourceImage,
    SourceTransaction, VersionNote, baseline_chunks, baseline_position,
};
use actors::store::StoreError;
use futures_util::StreamExt;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use sqlx::{Connection, Executor, Row};
use tokio::sync::mpsc;

use crate::db_error;
use crate::sql::{literal, quote_column, quote_relation};

/// The text forms pgoutput sends (the replication session's options), for
/// the rest of a transaction.
pub(crate) const TEXT_FORMS: &str = "SET LOCAL DateStyle = 'ISO, YMD'; SET LOCAL TimeZone = 'UTC'; \
     SET LOCAL extra_float_digits = 1; SET LOCAL bytea_output = 'hex'";

/// Chunks read ahead of the materializer (memory stays flat).
const READ_AHEAD: usize = 2;

/// One captured relation as the baseline (and a re-read) reads it.
pub(crate) struct Source {
    relation: String,
    /// Every column pgoutput sends, in order.
    pub columns: Vec<String>,
    /// The replica identity's columns (a registered table's primary key).
    pub identity: Vec<String>,
    /// `(table_id, primary key)` of a registered table.
    registered: Option<(String, String)>,
}

/// The baseline being read: what it owes, and its chunks in order.
pub(crate) struct BaselineReader {
    pub baseline: Baseline,
    pub chunks: mpsc::Receiver<Result<SourceTransaction, StoreError>>,
}

fn integrity(what: &str) -> StoreError {
    StoreError::Integrity(format!("baseline: {what}"))
}

/// Imports `snapshot` on a new connection, reads what the baseline owes,
/// and starts reading its chunks in the background.
pub(crate) async fn start(
    options: &PgConnectOptions,
    pool: &PgPool,
    plan: &CapturePlan,
    snapshot: &str,
    consistent: Lsn,
) -> Result<BaselineReader, StoreError> {
    let mut conn = PgConnection::connect_with(options)
        .await
        .map_err(db_error)?;
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .await
        .map_err(db_error)?;
    conn.execute(sqlx::raw_sql(&format!(
        "SET TRANSACTION SNAPSHOT {}",
        literal(snapshot)
    )))
    .await
    .map_err(db_error)?;
    conn.execute(TEXT_FORMS).await.map_err(db_error)?;
    let mut sources = Vec::new();
    for relation in plan.dependencies.keys() {
        sources.push(source(&mut conn, relation, None).await?);
    }
    for t in &plan.tables {
        let registered = Some((t.table_id.clone(), t.primary_key.clone()));
        sources.push(source(&mut conn, &t.relation, registered).await?);
    }
    let mut rows: u64 = 0;
    for s in &sources {
        let sql = format!("SELECT count(*) FROM {}", quote_relation(&s.relation));
        let n: i64 = sqlx::query_scalar(&sql)
            .fetch_one(&mut conn)
            .await
            .map_err(db_error)?;
        rows += u64::try_from(n).map_err(|_| integrity("a negative count"))?;
    }
    // Writes of clients committed before the snapshot are in it.
    let covered: Vec<i64> = sqlx::query_scalar("SELECT fence FROM synchro.pending_fences")
        .fetch_all(&mut conn)
        .await
        .map_err(db_error)?;
    let baseline = Baseline {
        rows,
        covered_fences: covered
            .into_iter()
            .map(|f| u64::try_from(f).map_err(|_| integrity("a negative fence")))
            .collect::<Result<_, _>>()?,
    };
    let chunks = baseline_chunks(rows);
    if chunks > 0 && baseline_position(consistent, chunks, 0).is_none() {
        return Err(integrity(
            "the slot's consistent point leaves no room below it",
        ));
    }
    let (send, receive) = mpsc::channel(READ_AHEAD);
    let pool = pool.clone();
    tokio::spawn(async move {
        let mut chunker = Chunker {
            consistent,
            chunks,
            index: 0,
            open: empty_chunk(),
            fresh: Vec::new(),
            send,
            pool,
        };
        let result = read(&mut conn, &sources, &mut chunker).await;
        let result = match result {
            Ok(()) => chunker.finish().await,
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => {
                let _ = conn.execute("COMMIT").await;
            }
            // A reader stopped mid-COPY (the baseline ended early, or
            // failed) closes its connection, and the snapshot with it.
            Err(e) => {
                let _ = chunker.send.send(Err(e)).await;
                drop(conn);
            }
        }
    });
    Ok(BaselineReader {
        baseline,
        chunks: receive,
    })
}

/// The columns, identity and key of one relation, from the catalog.
pub(crate) async fn source(
    conn: &mut PgConnection,
    relation: &str,
    registered: Option<(String, String)>,
) -> Result<Source, StoreError> {
    let rows = sqlx::query(
        "SELECT a.attname::text, \
           CASE c.relreplident \
             WHEN 'f' THEN true \
             WHEN 'd' THEN EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid \
                 AND i.indisprimary AND a.attnum = ANY (i.indkey)) \
             WHEN 'i' THEN EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid \
                 AND i.indisreplident AND a.attnum = ANY (i.indkey)) \
             ELSE false END \
         FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid \
         WHERE c.oid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped \
           AND a.attgenerated = '' \
         ORDER BY a.attnum",
    )
    .bind(relation)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error)?;
    let mut columns = Vec::new();
    let mut identity = Vec::new();
    for r in rows {
        let name: String = r.try_get(0).map_err(db_error)?;
        if r.try_get::<bool, _>(1).map_err(db_error)? {
            identity.push(name.clone());
        }
        columns.push(name);
    }
    if columns.is_empty() || identity.is_empty() {
        return Err(integrity("a captured relation without columns or identity"));
    }
    Ok(Source {
        relation: relation.to_owned(),
        columns,
        identity,
        registered,
    })
}

/// Streams every source's rows into `chunker`.
async fn read(
    conn: &mut PgConnection,
    sources: &[Source],
    chunker: &mut Chunker,
) -> Result<(), StoreError> {
    for s in sources {
        let list: Vec<String> = s
            .columns
            .iter()
            .map(|c| format!("r.{}", quote_column(c)))
            .collect();
        // In identity order, as a re-read goes on from a chunk's last row
        // (ADR 0030).
        let order: Vec<String> = (s.identity.iter())
            .map(|c| format!("r.{}", quote_column(c)))
            .collect();
        let sql = match &s.registered {
            None => format!(
                "COPY (SELECT {} FROM {} r ORDER BY {}) TO STDOUT",
                list.join(", "),
                quote_relation(&s.relation),
                order.join(", ")
            ),
            // The version the trigger would have written; a row without one
            // gets a new one, recorded below.
            Some((table_id, pk)) => format!(
                "COPY (SELECT {}, v.version, v.fence, \
                   replace(gen_random_uuid()::text, '-', ''), \
                   to_jsonb(r.{}) #>> '{{}}' \
                 FROM {} r LEFT JOIN synchro.row_versions v \
                   ON v.table_id = {} AND v.key = to_jsonb(r.{}) #>> '{{}}' AND NOT v.deleted \
                 ORDER BY {}) TO STDOUT",
                list.join(", "),
                quote_column(pk),
                quote_relation(&s.relation),
                literal(table_id),
                quote_column(pk),
                order.join(", "),
            ),
        };
        let mut stream = conn.copy_out_raw(&sql).await.map_err(db_error)?;
        let mut carry: Vec<u8> = Vec::new();
        while let Some(bytes) = stream.next().await {
            let bytes = bytes.map_err(db_error)?;
            carry.extend_from_slice(&bytes);
            let mut start = 0;
            while let Some(n) = carry[start..].iter().position(|b| *b == b'\n') {
                let line = &carry[start..start + n];
                let row = parse_row(s, line)?;
                chunker.push(s, row).await?;
                start += n + 1;
            }
            carry.drain(..start);
        }
        if !carry.is_empty() {
            return Err(integrity("a COPY row without its end"));
        }
    }
    Ok(())
}

/// One row: its image, and for a registered row its version note and
/// whether that version is new (no version row held it at the snapshot).
struct BaselineRow {
    image: SourceImage,
    note: Option<(VersionNote, bool)>,
}

fn parse_row(s: &Source, line: &[u8]) -> Result<BaselineRow, StoreError> {
    let mut fields = line.split(|b| *b == b'\t').map(copy_field);
    let mut image = SourceImage::new();
    for c in &s.columns {
        let v = fields
            .next()
            .ok_or_else(|| integrity("a short COPY row"))??;
        image.insert(c.clone(), v);
    }
    let note = match &s.registered {
        None => None,
        Some((table_id, _)) => {
            let mut next = || -> Result<Option<String>, StoreError> {
                fields.next().ok_or_else(|| integrity("a short COPY row"))?
            };
            let (version, fence, fresh, key) = (next()?, next()?, next()?, next()?);
            let key = key.ok_or_else(|| integrity("a registered row without its key"))?;
            let new_version = version.is_none();
            let version = match version {
                Some(v) => v,
                None => fresh.ok_or_else(|| integrity("no new version"))?,
            };
            let fence = match fence {
                Some(f) => f.parse().map_err(|_| integrity("an invalid fence"))?,
                None => 0,
            };
            Some((
                VersionNote {
                    table_id: table_id.clone(),
                    key,
                    version,
                    fence,
                    // The baseline satisfies the fences its snapshot holds apart.
                    client: false,
                },
                new_version,
            ))
        }
    };
    if fields.next().is_some() {
        return Err(integrity("a long COPY row"));
    }
    Ok(BaselineRow { image, note })
}

/// One field of COPY's text format: `\N` is NULL; backslash escapes.
pub(crate) fn copy_field(raw: &[u8]) -> Result<Option<String>, StoreError> {
    if raw == b"\\N" {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut bytes = raw.iter().copied();
    while let Some(b) = bytes.next() {
        if b != b'\\' {
            out.push(b);
            continue;
        }
        out.push(match bytes.next() {
            Some(b'b') => 0x08,
            Some(b'f') => 0x0c,
            Some(b'n') => b'\n',
            Some(b'r') => b'\r',
            Some(b't') => b'\t',
            Some(b'v') => 0x0b,
            Some(b'\\') => b'\\',
            _ => return Err(integrity("an escape COPY does not write")),
        });
    }
    String::from_utf8(out)
        .map(Some)
        .map_err(|_| integrity("a COPY field that is not UTF-8"))
}

fn empty_chunk() -> SourceTransaction {
    SourceTransaction::empty(0, 0)
}

/// Fills chunks of at most `BASELINE_CHUNK_ROWS` rows and sends each one,
/// once the versions it gave rows are recorded.
struct Chunker {
    consistent: Lsn,
    chunks: u64,
    index: u64,
    open: SourceTransaction,
    /// The open chunk's notes, each with whether its version is new.
    fresh: Vec<(VersionNote, bool)>,
    send: mpsc::Sender<Result<SourceTransaction, StoreError>>,
    pool: PgPool,
}

impl Chunker {
    async fn push(&mut self, s: &Source, row: BaselineRow) -> Result<(), StoreError> {
        let identity: SourceImage = s
            .identity
            .iter()
            .map(|c| (c.clone(), row.image.get(c).cloned().flatten()))
            .collect();
        self.open.events.push(SourceEvent {
            relation: s.relation.clone(),
            kind: ChangeKind::Insert,
            identity,
            new: Some(row.image),
        });
        if let Some((note, fresh)) = row.note {
            self.open.notes.push(note.clone());
            self.fresh.push((note, fresh));
        }
        if self.open.events.len() == BASELINE_CHUNK_ROWS {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), StoreError> {
        let mut chunk = std::mem::replace(&mut self.open, empty_chunk());
        if self.index >= self.chunks {
            return Err(integrity("more rows than the snapshot counted"));
        }
        let (commit_lsn, end_lsn) = baseline_position(self.consistent, self.chunks, self.index)
            .ok_or_else(|| integrity("no room below the consistent point"))?;
        self.index += 1;
        chunk.commit_lsn = commit_lsn;
        chunk.end_lsn = end_lsn;
        record_new_versions(&self.pool, &std::mem::take(&mut self.fresh)).await?;
        self.send
            .send(Ok(chunk))
            .await
            .map_err(|_| StoreError::Unavailable("the baseline's reader is gone".into()))
    }

    async fn finish(&mut self) -> Result<(), StoreError> {
        if !self.open.events.is_empty() {
            self.flush().await?;
        }
        if self.index != self.chunks {
            return Err(integrity("fewer rows than the snapshot counted"));
        }
        Ok(())
    }
}

/// Gives every registered row that has no version one (fence 0, which no
/// change allocates), in one statement per table. A row a concurrent
/// transaction writes keeps that transaction's version.
pub(crate) async fn version_unversioned(
    pool: &PgPool,
    plan: &CapturePlan,
) -> Result<(), StoreError> {
    for t in &plan.tables {
        let sql = format!(
            "INSERT INTO synchro.row_versions (table_id, key, version, fence, deleted) \
             SELECT {}, to_jsonb(r.{pk}) #>> '{{}}', replace(gen_random_uuid()::text, '-', ''), \
               0, false FROM {} r ON CONFLICT (table_id, key) DO NOTHING",
            literal(&t.table_id),
            quote_relation(&t.relation),
            pk = quote_column(&t.primary_key),
        );
        sqlx::query(&sql).execute(pool).await.map_err(db_error)?;
    }
    Ok(())
}

/// Records the versions the baseline gave rows that still had none at the
/// snapshot (a row whose version row is a deletion fence's). A row a later
/// transaction wrote keeps that transaction's version: the stream delivers
/// it after the baseline.
async fn record_new_versions(
    pool: &PgPool,
    notes: &[(VersionNote, bool)],
) -> Result<(), StoreError> {
    let new: Vec<&VersionNote> = notes
        .iter()
        .filter(|(_, fresh)| *fresh)
        .map(|(n, _)| n)
        .collect();
    if new.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO synchro.row_versions (table_id, key, version, fence, deleted) \
         SELECT t, k, v, 0, false FROM unnest($1::text[], $2::text[], $3::text[]) AS n(t, k, v) \
         ON CONFLICT (table_id, key) DO NOTHING",
    )
    .bind(new.iter().map(|n| n.table_id.as_str()).collect::<Vec<_>>())
    .bind(new.iter().map(|n| n.key.as_str()).collect::<Vec<_>>())
    .bind(new.iter().map(|n| n.version.as_str()).collect::<Vec<_>>())
    .execute(pool)
    .await
    .map_err(db_error)?;
    Ok(())
}
