//! Capture on PostgreSQL: installing the version triggers, key guards,
//! publication and slot, and the change feed that streams pgoutput
//! (`START_REPLICATION`, ADR 0004) and assembles whole source transactions.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use actors::capture::{
    Baseline, CapturePlan, CaptureProblem, ChangeFeed, ChangeKind, Lsn, RereadChunk, RereadRequest,
    SourceEvent, SourceImage, SourceTransaction, VersionNote,
};
use actors::store::StoreError;
use pgwire_replication::{ReplicationClient, ReplicationConfig, ReplicationEvent};
use protocol::value::FieldType;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use sqlx::{Connection, Executor, Row};
use tokio::sync::mpsc;

use crate::baseline;
use crate::catalog;
use crate::pgoutput::{self, Message, TupleValue};
use crate::reread;
use crate::sql::{literal, quote_relation, to_i64};
use crate::{PgStore, db_error};

/// The publication of exactly the captured relations (publications are per database).
pub const PUBLICATION: &str = "synchro_capture";
/// The advisory-lock key of capture leadership (per database).
const LEADER_LOCK: i64 = 0x73796e6368726f; // "synchro"
/// Session settings that fix the text forms pgoutput sends.
const SESSION_OPTIONS: &str =
    "-c DateStyle=ISO,YMD -c TimeZone=UTC -c extra_float_digits=1 -c bytea_output=hex";

/// How the replication connection reaches the server.
#[derive(Clone, Debug)]
pub struct FeedTarget {
    host: String,
    port: u16,
    user: String,
    password: String,
    database: String,
}

impl FeedTarget {
    /// The server `options` points at; `password` when it needs one.
    pub fn new(options: &PgConnectOptions, password: Option<&str>) -> FeedTarget {
        let host = match options.get_socket() {
            Some(dir) => dir.display().to_string(),
            None => options.get_host().to_owned(),
        };
        FeedTarget {
            host,
            port: options.get_port(),
            user: options.get_username().to_owned(),
            password: password.unwrap_or_default().to_owned(),
            database: options.get_database().unwrap_or("postgres").to_owned(),
        }
    }

    /// The slot's name: slots are cluster-wide, so it names the database.
    pub fn slot(&self) -> String {
        format!("synchro_{}", identifier(&self.database, 48))
    }
}

/// `name` as a bare identifier: lowercase ASCII letters, digits and `_`,
/// at most `max` characters.
fn identifier(name: &str, max: usize) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(max)
        .collect()
}

/// Installs triggers, guard, publication and slot for `plan`, then verifies them.
pub(crate) async fn install(store: &PgStore, plan: &CapturePlan) -> Result<(), StoreError> {
    let mut tx = store.pool.begin().await.map_err(db_error)?;
    // One installer at a time across processes.
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(LEADER_LOCK + 1)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    // A table the config no longer registers loses its capture triggers
    // (ADR 0020): its writes would otherwise leave version notes with no
    // published change behind them.
    let triggered: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT n.nspname || '.' || c.relname FROM pg_trigger g \
         JOIN pg_class c ON c.oid = g.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE g.tgname IN ('synchro_version', 'synchro_key_guard') AND NOT g.tgisinternal",
    )
    .fetch_all(&mut *tx)
    .await
    .map_err(db_error)?;
    for relation in triggered {
        if plan.tables.iter().all(|t| t.relation != relation) {
            let rel = quote_relation(&relation);
            let sql = format!(
                "DROP TRIGGER IF EXISTS synchro_version ON {rel}; \
                 DROP TRIGGER IF EXISTS synchro_key_guard ON {rel};"
            );
            tx.execute(sqlx::raw_sql(&sql)).await.map_err(db_error)?;
        }
    }
    for t in &plan.tables {
        let rel = quote_relation(&t.relation);
        let sql = format!(
            "CREATE OR REPLACE TRIGGER synchro_version AFTER INSERT OR UPDATE OR DELETE ON {rel} \
             FOR EACH ROW EXECUTE FUNCTION synchro.capture_version({}, {});
             CREATE OR REPLACE TRIGGER synchro_key_guard BEFORE UPDATE ON {rel} \
             FOR EACH ROW EXECUTE FUNCTION synchro.capture_key_guard({});",
            literal(&t.table_id),
            literal(&t.primary_key),
            literal(&t.primary_key),
        );
        tx.execute(sqlx::raw_sql(&sql)).await.map_err(db_error)?;
    }
    for relation in plan.dependencies.keys() {
        // pgoutput can only send deletes of a relation with a replica identity.
        let row = sqlx::query(
            "SELECT c.relreplident::text, EXISTS (SELECT 1 FROM pg_index i \
             WHERE i.indrelid = c.oid AND i.indisprimary) FROM pg_class c \
             WHERE c.oid = to_regclass($1)",
        )
        .bind(relation)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error)?
        .ok_or_else(|| {
            StoreError::Integrity(format!("dependency relation {relation} is missing"))
        })?;
        let identity: String = row.try_get(0).map_err(db_error)?;
        let has_pk: bool = row.try_get(1).map_err(db_error)?;
        if identity == "n" || (identity == "d" && !has_pk) {
            return Err(StoreError::Integrity(format!(
                "dependency relation {relation} needs a primary key or REPLICA IDENTITY FULL"
            )));
        }
    }
    // The materializer finds a dependency relation's rows by the column a
    // rule joins on: one index per such column (an expression on the row's image).
    for (_, column) in &plan.dependency_keys {
        let name = identifier(column, 40);
        let sql = format!(
            "CREATE INDEX IF NOT EXISTS dependency_rows_by_{name} \
             ON synchro.dependency_rows (relation, (image ->> {}))",
            literal(column)
        );
        tx.execute(sqlx::raw_sql(&sql)).await.map_err(db_error)?;
    }
    // A relation recreated since capture was installed has a WAL history
    // that cannot be joined to what was materialized: refuse it.
    for relation in plan.relations() {
        let oid: i64 = sqlx::query_scalar("SELECT to_regclass($1)::oid::int8")
            .bind(relation)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error)?
            .flatten()
            .ok_or_else(|| {
                StoreError::Integrity(format!("captured relation {relation} is missing"))
            })?;
        let recorded: Option<i64> = sqlx::query_scalar(
            "INSERT INTO synchro.captured_relations (relation, relation_oid) VALUES ($1, $2) \
             ON CONFLICT (relation) DO UPDATE SET relation = EXCLUDED.relation \
             RETURNING relation_oid",
        )
        .bind(relation)
        .bind(oid)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error)?;
        if recorded != Some(oid) {
            return Err(StoreError::Integrity(format!(
                "captured relation {relation} was dropped and recreated since capture was \
                 installed (its OID changed); capture cannot continue over it"
            )));
        }
    }
    let tables: Vec<String> = plan.relations().map(quote_relation).collect();
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(PUBLICATION)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
    let sql = if exists {
        format!(
            "ALTER PUBLICATION {PUBLICATION} SET TABLE {}",
            tables.join(", ")
        )
    } else {
        format!(
            "CREATE PUBLICATION {PUBLICATION} FOR TABLE {} \
             WITH (publish = 'insert, update, delete, truncate')",
            tables.join(", ")
        )
    };
    tx.execute(sqlx::raw_sql(&sql)).await.map_err(db_error)?;
    tx.commit().await.map_err(db_error)?;
    // The slot is created by the first feed, with the baseline (ADR 0011).
    verify(store, plan).await
}

/// The stream's slot as recorded: whether its baseline is materialized
/// (until then it is a candidate), and how many of the baseline's chunks
/// committed.
struct SlotRecord {
    baseline_done: bool,
    baseline_chunks: i64,
}

async fn slot_record(store: &PgStore) -> Result<Option<SlotRecord>, StoreError> {
    let row: Option<(bool, i64)> =
        sqlx::query_as("SELECT baseline_done, baseline_chunks FROM synchro.capture_slot")
            .fetch_optional(&store.pool)
            .await
            .map_err(db_error)?;
    Ok(row.map(|(baseline_done, baseline_chunks)| SlotRecord {
        baseline_done,
        baseline_chunks,
    }))
}

/// Whether a slot of the stream's name exists in this database.
async fn slot_exists(store: &PgStore, slot: &str) -> Result<bool, StoreError> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 \
         AND database = current_database())",
    )
    .bind(slot)
    .fetch_one(&store.pool)
    .await
    .map_err(db_error)
}

/// A slot created before slots were recorded began with the stream: it is
/// recorded as the stream's, with no baseline owed.
async fn adopt_unrecorded_slot(store: &PgStore, slot: &str) -> Result<bool, StoreError> {
    let adopted = sqlx::query(
        "INSERT INTO synchro.capture_slot (slot_name, consistent_lsn, baseline_done) \
         SELECT slot_name, (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint, true \
         FROM pg_replication_slots WHERE slot_name = $1 AND plugin = 'pgoutput' \
         AND database = current_database() ON CONFLICT DO NOTHING",
    )
    .bind(slot)
    .execute(&store.pool)
    .await
    .map_err(db_error)?;
    Ok(adopted.rows_affected() == 1)
}

/// Creates the stream's slot on `client` (a gated replication session)
/// with an exported snapshot, after recording it as a candidate: a crash
/// before its baseline commits leaves a candidate that the next feed drops
/// and creates again, never an unrecorded slot. The snapshot's name and
/// the slot's consistent point; the session must run nothing else until
/// the snapshot is imported.
async fn create_candidate_slot(
    store: &PgStore,
    plan: &CapturePlan,
    client: &mut ReplicationClient,
    slot: &str,
) -> Result<(String, Lsn), StoreError> {
    sqlx::query(
        "INSERT INTO synchro.capture_slot (slot_name, consistent_lsn, baseline_done) \
         VALUES ($1, 0, false) ON CONFLICT (singleton) DO UPDATE \
         SET slot_name = EXCLUDED.slot_name, consistent_lsn = 0, idle_confirmed_lsn = 0, \
           baseline_chunks = 0 \
         WHERE NOT synchro.capture_slot.baseline_done",
    )
    .bind(slot)
    .execute(&store.pool)
    .await
    .map_err(db_error)?;
    if slot_exists(store, slot).await? {
        // A candidate whose baseline never committed: nothing came from it.
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(slot)
            .execute(&store.pool)
            .await
            .map_err(db_error)?;
    }
    // Rows without a version get one first, committed before the slot's
    // snapshot, so the baseline reads every version it gives.
    baseline::version_unversioned(&store.pool, plan).await?;
    let unavailable = |e: pgwire_replication::PgWireError| {
        StoreError::Unavailable(format!("creating the slot: {e}"))
    };
    let rows = client
        .simple_query(&format!(
            "CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput (SNAPSHOT 'export')"
        ))
        .await
        .map_err(unavailable)?;
    let text = |i: usize| -> Result<String, StoreError> {
        rows.first()
            .and_then(|r| r.get(i).cloned().flatten())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .ok_or_else(|| StoreError::Integrity("CREATE_REPLICATION_SLOT answered no row".into()))
    };
    let consistent = pgwire_replication::Lsn::parse(&text(1)?)
        .map_err(|_| StoreError::Integrity("the slot's consistent point is not an LSN".into()))?
        .as_u64();
    let snapshot = text(2)?;
    sqlx::query("UPDATE synchro.capture_slot SET consistent_lsn = $1")
        .bind(to_i64(consistent)?)
        .execute(&store.pool)
        .await
        .map_err(db_error)?;
    Ok((snapshot, consistent))
}

/// Checks that everything capture needs is in place. A lost slot does not
/// fail installation: the server runs with capture blocked, until a reset.
async fn verify(store: &PgStore, plan: &CapturePlan) -> Result<(), StoreError> {
    if let Some(problem) = check(store, plan).await?
        && problem != CaptureProblem::SlotLost
    {
        return Err(StoreError::Integrity(format!(
            "capture is not in place: {problem}"
        )));
    }
    Ok(())
}

/// Logs which column of a registered relation is gone (config names, no data).
fn column_missing(relation: &str, column: &str) {
    tracing::error!(
        relation,
        column,
        "capture blocked: a column a field maps to is missing; restore it, or remove the field from the config and restart"
    );
}

/// Logs which column of a registered relation was retyped, and why its
/// field cannot follow (config and catalog names, no data).
fn column_retyped(relation: &str, column: &str, why: &str) {
    tracing::error!(
        relation,
        column,
        why,
        "capture blocked: a column a field maps to was retyped; change the field's type in the config to follow it, and restart"
    );
}

/// What broke since `install`, if anything: the slot lost, a captured
/// relation dropped, recreated (another OID) or unpublished, or a capture
/// trigger gone or disabled.
pub(crate) async fn check(
    store: &PgStore,
    plan: &CapturePlan,
) -> Result<Option<CaptureProblem>, StoreError> {
    if slot_lost(store).await? {
        return Ok(Some(CaptureProblem::SlotLost));
    }
    let intact = sqlx::query_scalar::<_, Option<bool>>(
        "SELECT bool_and(to_regclass(r.relation)::oid::int8 IS NOT DISTINCT FROM r.relation_oid) \
         FROM synchro.captured_relations r WHERE r.relation = ANY($1)",
    )
    .bind(plan.relations().collect::<Vec<_>>())
    .fetch_one(&store.pool)
    .await
    .map_err(db_error)?
    .unwrap_or(false);
    if !intact {
        return Ok(Some(CaptureProblem::RelationDrift));
    }
    let published: BTreeSet<String> = sqlx::query_scalar(
        "SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = $1",
    )
    .bind(PUBLICATION)
    .fetch_all(&store.pool)
    .await
    .map_err(db_error)?
    .into_iter()
    .collect();
    let wanted: BTreeSet<String> = plan.relations().map(str::to_owned).collect();
    if published != wanted {
        return Ok(Some(CaptureProblem::RelationDrift));
    }
    for t in &plan.tables {
        let present: Vec<(String, String, i32)> = sqlx::query_as(
            "SELECT a.attname::text, ty.typname::text, a.atttypmod FROM pg_attribute a \
             JOIN pg_type ty ON ty.oid = a.atttypid \
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
        )
        .bind(&t.relation)
        .fetch_all(&store.pool)
        .await
        .map_err(db_error)?;
        if let Some(missing) = t
            .columns
            .iter()
            .find(|c| !present.iter().any(|(name, _, _)| name == *c))
        {
            column_missing(&t.relation, missing);
            return Ok(Some(CaptureProblem::ColumnMissing));
        }
        for (column, type_name, typmod) in &present {
            if let Some(declared) = t.types.get(column)
                && let Some(why) = catalog::type_conflict(type_name, *typmod, declared)
            {
                column_retyped(&t.relation, column, &why);
                return Ok(Some(CaptureProblem::ColumnRetyped));
            }
        }
        let triggers: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_trigger WHERE tgrelid = to_regclass($1) \
             AND tgname IN ('synchro_version', 'synchro_key_guard') AND tgenabled <> 'D'",
        )
        .bind(&t.relation)
        .fetch_one(&store.pool)
        .await
        .map_err(db_error)?;
        if triggers != 2 {
            return Ok(Some(CaptureProblem::CaptureDisabled));
        }
    }
    Ok(None)
}

/// Whether the recorded slot is gone: missing, invalidated (its WAL
/// removed), or another slot under its name, whose confirmed position
/// passed where the recorded one began, everything materialized, and
/// what capture recorded before confirming while idle (capture confirms
/// nothing else).
async fn slot_lost(store: &PgStore) -> Result<bool, StoreError> {
    let row: Option<(Option<i64>, Option<String>, i64, i64)> = sqlx::query_as(
        "SELECT (s.confirmed_flush_lsn - '0/0'::pg_lsn)::bigint, s.wal_status, \
         r.consistent_lsn, greatest(p.end_lsn, r.idle_confirmed_lsn) \
         FROM synchro.capture_slot r CROSS JOIN synchro.capture_progress p \
         LEFT JOIN pg_replication_slots s ON s.slot_name = r.slot_name \
         AND s.plugin = 'pgoutput' AND s.database = current_database() \
         WHERE r.baseline_done",
    )
    .fetch_optional(&store.pool)
    .await
    .map_err(db_error)?;
    let Some((confirmed, wal_status, consistent, materialized)) = row else {
        return Ok(false); // none yet, or a candidate: the next feed creates it
    };
    Ok(match confirmed {
        None => true,
        Some(_) if wal_status.as_deref() == Some("lost") => true,
        Some(confirmed) => confirmed > consistent.max(materialized),
    })
}

/// A captured relation as its latest `Relation` message describes it.
struct RelationInfo {
    name: String,
    columns: Vec<(String, bool)>,
    replica_identity: u8,
}

/// The feed: a replication stream plus the connection holding leadership.
pub struct PgFeed {
    client: ReplicationClient,
    /// Whether START_REPLICATION was sent (after the baseline, if one is owed).
    started: bool,
    baseline: Option<Baseline>,
    /// The baseline's chunks, read in the background under its snapshot.
    chunks: Option<mpsc::Receiver<Result<SourceTransaction, StoreError>>>,
    /// Holds the session advisory lock; capture leadership ends with it.
    leader: PgConnection,
    relations: BTreeMap<u32, RelationInfo>,
    /// The transaction being assembled: kept across `next` calls, so a
    /// call that ends in the middle of a transaction loses nothing.
    open: Option<SourceTransaction>,
    /// The server's WAL end as its last message reported it.
    server_wal_end: Lsn,
    /// Set when `next` found nothing and no transaction was open: the
    /// server's WAL end then (a keepalive's is the walsender's decoded
    /// position, so every transaction committed before it was sent).
    idle_end: Option<Lsn>,
    /// The highest position acknowledged: the slot never moves back.
    acknowledged: Lsn,
    /// The last commit this feed handed over: the stream's order.
    last_commit: Lsn,
    plan_relations: BTreeSet<String>,
    registered: BTreeMap<String, String>,
    /// Each registered relation's synced columns.
    synced: BTreeMap<String, Vec<String>>,
    /// Each registered relation's synced columns' field types.
    types: BTreeMap<String, BTreeMap<String, FieldType>>,
    /// `pg_type` names by OID, to judge a column's type in a `Relation`
    /// message.
    type_names: BTreeMap<u32, String>,
}

/// Opens the feed if this process can lead capture.
pub(crate) async fn open(store: &PgStore) -> Result<Option<PgFeed>, StoreError> {
    let mut leader = PgConnection::connect_with(&store.options)
        .await
        .map_err(db_error)?;
    let led: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(LEADER_LOCK)
        .fetch_one(&mut leader)
        .await
        .map_err(db_error)?;
    if !led {
        return Ok(None);
    }
    let plan = store
        .plan
        .lock()
        .map_err(|_| StoreError::Integrity("capture plan lock poisoned".into()))?
        .clone()
        .ok_or_else(|| StoreError::Integrity("capture is not installed".into()))?;
    let t = &store.feed_target;
    let config = if t.host.starts_with('/') {
        ReplicationConfig::unix(
            &t.host,
            t.port,
            &t.user,
            &t.password,
            &t.database,
            t.slot(),
            PUBLICATION,
        )
    } else {
        ReplicationConfig::new(
            &t.host,
            &t.user,
            &t.password,
            &t.database,
            t.slot(),
            PUBLICATION,
        )
        .with_port(t.port)
    }
    .with_options(SESSION_OPTIONS)
    .with_status_interval(Duration::from_millis(200))
    .with_application_name("synchro-capture");
    let connect_failed = |e: pgwire_replication::PgWireError| {
        StoreError::Unavailable(format!("replication connection failed: {e}"))
    };
    let slot = t.slot();
    let owed = match slot_record(store).await? {
        // A chunk committed: the slot is kept, and the materializer hands
        // the baseline over to re-reads (ADR 0030).
        Some(r) => !r.baseline_done && r.baseline_chunks == 0,
        None => !adopt_unrecorded_slot(store, &slot).await?,
    };
    let (client, reader) = if owed {
        let mut client = ReplicationClient::connect_gated(config)
            .await
            .map_err(connect_failed)?;
        let (snapshot, consistent) =
            create_candidate_slot(store, &plan, &mut client, &slot).await?;
        let reader =
            baseline::start(&store.options, &store.pool, &plan, &snapshot, consistent).await?;
        (client, Some(reader))
    } else {
        let client = ReplicationClient::connect(config)
            .await
            .map_err(connect_failed)?;
        (client, None)
    };
    let (baseline, chunks) = match reader {
        Some(r) => (Some(r.baseline), Some(r.chunks)),
        None => (None, None),
    };
    Ok(Some(PgFeed {
        client,
        started: baseline.is_none(),
        baseline,
        chunks,
        leader,
        relations: BTreeMap::new(),
        open: None,
        server_wal_end: 0,
        idle_end: None,
        acknowledged: 0,
        last_commit: 0,
        plan_relations: plan.relations().map(str::to_owned).collect(),
        registered: plan
            .tables
            .iter()
            .map(|t| (t.relation.clone(), t.primary_key.clone()))
            .collect(),
        synced: plan
            .tables
            .iter()
            .map(|t| (t.relation.clone(), t.columns.clone()))
            .collect(),
        types: plan
            .tables
            .iter()
            .map(|t| (t.relation.clone(), t.types.clone()))
            .collect(),
        type_names: type_names(store).await?,
    }))
}

/// Every `pg_type` name by OID. A type created after this is read has no
/// portable type anyway.
async fn type_names(store: &PgStore) -> Result<BTreeMap<u32, String>, StoreError> {
    let rows: Vec<(i64, String)> = sqlx::query_as("SELECT oid::int8, typname::text FROM pg_type")
        .fetch_all(&store.pool)
        .await
        .map_err(db_error)?;
    Ok(rows
        .into_iter()
        .filter_map(|(oid, name)| Some((u32::try_from(oid).ok()?, name)))
        .collect())
}

fn text(v: &TupleValue) -> Result<Option<Option<String>>, CaptureProblem> {
    match v {
        TupleValue::Null => Ok(Some(None)),
        TupleValue::UnchangedToast => Ok(None),
        TupleValue::Text(b) => String::from_utf8(b.clone())
            .map(|s| Some(Some(s)))
            .map_err(|_| CaptureProblem::Undecodable),
        TupleValue::Binary(_) => Err(CaptureProblem::Undecodable),
    }
}

impl PgFeed {
    fn image(
        &self,
        rel: &RelationInfo,
        tuple: &[TupleValue],
    ) -> Result<SourceImage, CaptureProblem> {
        if tuple.len() != rel.columns.len() {
            return Err(CaptureProblem::Undecodable);
        }
        let mut image = SourceImage::new();
        for ((name, _), v) in rel.columns.iter().zip(tuple) {
            if let Some(v) = text(v)? {
                image.insert(name.clone(), v);
            }
        }
        Ok(image)
    }

    fn key_of(rel: &RelationInfo, image: &SourceImage) -> SourceImage {
        rel.columns
            .iter()
            .filter(|(_, key)| *key)
            .filter_map(|(c, _)| image.get(c).map(|v| (c.clone(), v.clone())))
            .collect()
    }

    /// Folds one pgoutput message into the transaction being assembled.
    fn apply(&mut self, msg: Message, t: &mut SourceTransaction) -> Result<(), CaptureProblem> {
        match msg {
            Message::Relation {
                oid,
                namespace,
                name,
                replica_identity,
                columns,
            } => {
                let qualified = format!("{namespace}.{name}");
                if !self.plan_relations.contains(&qualified) {
                    return Err(CaptureProblem::RelationDrift); // renamed or moved
                }
                for c in &columns {
                    let declared = self.types.get(&qualified).and_then(|t| t.get(&c.name));
                    let type_name = self.type_names.get(&c.type_oid).map_or("", String::as_str);
                    if let Some(declared) = declared
                        && let Some(why) =
                            catalog::type_conflict(type_name, c.type_modifier, declared)
                    {
                        column_retyped(&qualified, &c.name, &why);
                        return Err(CaptureProblem::ColumnRetyped);
                    }
                }
                let columns: Vec<(String, bool)> =
                    columns.into_iter().map(|c| (c.name, c.key)).collect();
                if let Some(pk) = self.registered.get(&qualified) {
                    let keys: Vec<&String> =
                        columns.iter().filter(|(_, k)| *k).map(|(c, _)| c).collect();
                    if replica_identity != b'd' || keys != [pk] {
                        return Err(CaptureProblem::RelationDrift);
                    }
                }
                let synced = self.synced.get(&qualified).into_iter().flatten();
                if let Some(missing) = synced
                    .into_iter()
                    .find(|s| !columns.iter().any(|(c, _)| c == *s))
                {
                    column_missing(&qualified, missing);
                    return Err(CaptureProblem::ColumnMissing);
                }
                if let Some(previous) = self.relations.get(&oid)
                    && previous.replica_identity != replica_identity
                {
                    return Err(CaptureProblem::RelationDrift);
                }
                self.relations.insert(
                    oid,
                    RelationInfo {
                        name: qualified,
                        columns,
                        replica_identity,
                    },
                );
            }
            Message::Insert { oid, new } => {
                let rel = self
                    .relations
                    .get(&oid)
                    .ok_or(CaptureProblem::Undecodable)?;
                let new = self.image(rel, &new)?;
                t.events.push(SourceEvent {
                    relation: rel.name.clone(),
                    kind: ChangeKind::Insert,
                    identity: Self::key_of(rel, &new),
                    new: Some(new),
                });
            }
            Message::Update { oid, old, new } => {
                let rel = self
                    .relations
                    .get(&oid)
                    .ok_or(CaptureProblem::Undecodable)?;
                let new = self.image(rel, &new)?;
                let identity = match old {
                    Some(old) => Self::key_of(rel, &self.image(rel, &old)?),
                    None => Self::key_of(rel, &new),
                };
                t.events.push(SourceEvent {
                    relation: rel.name.clone(),
                    kind: ChangeKind::Update,
                    identity,
                    new: Some(new),
                });
            }
            Message::Delete { oid, old } => {
                let rel = self
                    .relations
                    .get(&oid)
                    .ok_or(CaptureProblem::Undecodable)?;
                let old = self.image(rel, &old)?;
                t.events.push(SourceEvent {
                    relation: rel.name.clone(),
                    kind: ChangeKind::Delete,
                    identity: Self::key_of(rel, &old),
                    new: None,
                });
            }
            Message::Truncate { .. } => return Err(CaptureProblem::Truncate),
            // Begin, Commit and logical messages arrive as their own
            // replication events; types and origins carry nothing capture needs.
            _ => {}
        }
        Ok(())
    }
}

impl ChangeFeed for PgFeed {
    fn baseline(&self) -> Option<&Baseline> {
        self.baseline.as_ref()
    }

    async fn end_baseline(&mut self) {
        // The reader stops at its next chunk and its snapshot ends with it.
        self.chunks = None;
        self.baseline = None;
    }

    async fn baseline_chunk(&mut self) -> Result<Option<SourceTransaction>, StoreError> {
        let Some(chunks) = self.chunks.as_mut() else {
            return Ok(None);
        };
        match chunks.recv().await {
            Some(chunk) => chunk.map(Some),
            None => {
                self.chunks = None;
                Ok(None)
            }
        }
    }

    async fn next(&mut self, wait: Duration) -> Result<Option<SourceTransaction>, StoreError> {
        if !self.started {
            // The stream begins at the slot's consistent point, after the baseline.
            let failed = |e: pgwire_replication::PgWireError| {
                StoreError::Unavailable(format!("replication failed to start: {e}"))
            };
            self.client.start().await.map_err(failed)?;
            self.client.wait_started().await.map_err(failed)?;
            self.started = true;
        }
        let deadline = tokio::time::Instant::now() + wait;
        self.idle_end = None;
        loop {
            // `recv` is cancel-safe: an event is either returned or left queued.
            let event = match tokio::time::timeout_at(deadline, self.client.recv()).await {
                Err(_) => {
                    // PostgreSQL's own subscriber confirms a keepalive's
                    // position the same way when nothing is pending.
                    self.idle_end = self.open.is_none().then_some(self.server_wal_end);
                    return Ok(None);
                }
                Ok(event) => event
                    .map_err(|e| {
                        StoreError::Unavailable(format!("replication stream failed: {e}"))
                    })?
                    .ok_or_else(|| StoreError::Unavailable("replication stream ended".into()))?,
            };
            if let ReplicationEvent::KeepAlive { wal_end, .. }
            | ReplicationEvent::XLogData { wal_end, .. } = &event
            {
                self.server_wal_end = self.server_wal_end.max(u64::from(*wal_end));
            }
            let mut open = self.open.take();
            match event {
                ReplicationEvent::Begin { .. } => {
                    open = Some(SourceTransaction::empty(0, 0));
                }
                ReplicationEvent::XLogData { data, .. } => {
                    let Some(t) = open.as_mut() else { continue };
                    let applied = pgoutput::decode(&data)
                        .map_err(|_| CaptureProblem::Undecodable)
                        .and_then(|m| self.apply(m, t));
                    if let Err(p) = applied {
                        t.problem.get_or_insert(p);
                    }
                }
                ReplicationEvent::Message {
                    transactional: true,
                    prefix,
                    content,
                    ..
                } if prefix == "synchro.version" => {
                    let Some(t) = open.as_mut() else { continue };
                    match VersionNote::decode(&content) {
                        Some(n) => t.notes.push(n),
                        None => {
                            t.problem.get_or_insert(CaptureProblem::VersionNoteMismatch);
                        }
                    }
                }
                ReplicationEvent::Message {
                    transactional: true,
                    prefix,
                    content,
                    ..
                } if prefix == reread::WATERMARK_PREFIX => {
                    let Some(t) = open.as_mut() else { continue };
                    match String::from_utf8(content.to_vec()) {
                        Ok(w) if t.watermark.is_none() => t.watermark = Some(w),
                        _ => {
                            t.problem.get_or_insert(CaptureProblem::Undecodable);
                        }
                    }
                }
                ReplicationEvent::Commit { lsn, end_lsn, .. } => {
                    if let Some(mut t) = open.take() {
                        assert!(
                            u64::from(lsn) > self.last_commit,
                            "the stream hands transactions in commit order"
                        );
                        self.last_commit = u64::from(lsn);
                        t.commit_lsn = u64::from(lsn);
                        t.end_lsn = u64::from(end_lsn);
                        return Ok(Some(t));
                    }
                }
                _ => {}
            }
            self.open = open;
        }
    }

    async fn reread(&mut self, req: &RereadRequest) -> Result<RereadChunk, StoreError> {
        reread::read_chunk(&mut self.leader, req).await
    }

    fn source_end(&self) -> Lsn {
        self.server_wal_end
    }

    fn idle_end(&self) -> Option<Lsn> {
        self.idle_end
    }

    async fn acknowledge_idle(&mut self, end_lsn: Lsn) -> Result<(), StoreError> {
        // Recorded before the slot hears it: the lost-slot check must know
        // the confirmed position is capture's own.
        sqlx::query(
            "UPDATE synchro.capture_slot \
             SET idle_confirmed_lsn = greatest(idle_confirmed_lsn, $1)",
        )
        .bind(to_i64(end_lsn)?)
        .execute(&mut self.leader)
        .await
        .map_err(db_error)?;
        self.acknowledge(end_lsn).await
    }

    async fn acknowledge(&mut self, end_lsn: Lsn) -> Result<(), StoreError> {
        // Durable progress may stand behind an idle acknowledgement.
        self.acknowledged = self.acknowledged.max(end_lsn);
        self.client.update_applied_lsn(self.acknowledged.into());
        Ok(())
    }
}
