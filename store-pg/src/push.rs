//! Push's source writes on PostgreSQL, as the role
//! `synchro_writer` (no BYPASSRLS) with the user in `synchro.user_id`, so
//! the application's row security, constraints and triggers apply.
//!
//! Values travel as text and are cast to each column's base type (without
//! its modifier: an explicit cast to `varchar(3)` would truncate silently;
//! the assignment checks the modifier instead). Every write runs under a
//! savepoint, so a refused write, or one that changes no row, leaves nothing.
//!
//! Deferrable constraints are deferred while a push writes and checked at
//! the end of each push unit (ADR 0016): after each write of a non-atomic
//! batch, and when an atomic group ends. So a trigger may write a child
//! before its parent, and rows of a group may reference each other.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use actors::ledger::contract::{
    FoundRow, Refusal, RowWrite, VersionRecord, WriteResult, WriteTarget, Writer,
};
use actors::ledger::intake::{check_keys, keeps_as_given};
use actors::store::StoreError;
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::sql::{literal, quote_relation};
use crate::sqlstate::refusal;
use crate::{PgStore, PgTx, db_error};

/// What writing a relation needs from the catalog.
#[derive(Debug)]
pub(crate) struct RelationTypes {
    /// Column -> base type name (`format_type` without modifier), for casts.
    types: HashMap<String, String>,
    /// Column -> declared type (`format_type` with its modifier), for
    /// [`keeps_as_given`].
    declared: HashMap<String, String>,
    /// The primary key constraint: a violation of it is a taken key.
    pk_constraint: String,
    /// A foreign key of the relation references the relation itself: its
    /// rows may depend on each other, so a set of them is not a set of units.
    self_referencing: bool,
}

/// Per relation, loaded by `install`.
pub(crate) type WriteCatalog = Arc<RwLock<HashMap<String, Arc<RelationTypes>>>>;

fn install_error(what: &str, e: sqlx::Error) -> StoreError {
    StoreError::Unavailable(format!("push setup: {what}: {}", db_error(e)))
}

/// `grant` in a block that runs it only when `held` (an SQL condition) is false.
fn grant_once(held: &str, grant: &str) -> String {
    format!("DO $$ BEGIN IF NOT ({held}) THEN {grant}; END IF; END $$")
}

/// Creates the writer role if needed, grants it the registered tables, and
/// loads their column types.
pub(crate) async fn install(store: &PgStore, targets: &[WriteTarget]) -> Result<(), StoreError> {
    let pool = store.pool();
    // Roles are cluster-wide: another database may create it at the same
    // moment. An operator may have created it (and granted everything
    // below), so that the server needs no CREATEROLE: each step runs only
    // when what it gives is missing.
    sqlx::raw_sql(
        "DO $$ BEGIN \
           IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'synchro_writer') THEN \
             CREATE ROLE synchro_writer NOLOGIN NOSUPERUSER NOBYPASSRLS NOINHERIT; \
           END IF; \
         EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$",
    )
    .execute(pool)
    .await
    .map_err(|e| install_error("creating role synchro_writer needs CREATEROLE", e))?;
    let mut grants = vec![
        "DO $$ BEGIN \
           IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) \
              AND NOT pg_has_role(current_user, 'synchro_writer', 'MEMBER') THEN \
             EXECUTE format('GRANT synchro_writer TO %I', current_user); \
           END IF; \
         EXCEPTION WHEN unique_violation THEN NULL; END $$"
            .to_owned(),
        grant_once(
            "has_schema_privilege('synchro_writer', 'synchro', 'USAGE')",
            "GRANT USAGE ON SCHEMA synchro TO synchro_writer",
        ),
        grant_once(
            "has_table_privilege('synchro_writer', 'synchro.row_versions', 'SELECT')",
            "GRANT SELECT ON synchro.row_versions TO synchro_writer",
        ),
    ];
    for t in targets {
        if let Some((schema, _)) = t.relation.split_once('.') {
            grants.push(grant_once(
                &format!("has_schema_privilege('synchro_writer', '{schema}', 'USAGE')"),
                &format!("GRANT USAGE ON SCHEMA \"{schema}\" TO synchro_writer"),
            ));
        }
        let relation = quote_relation(&t.relation);
        let held = ["SELECT", "INSERT", "UPDATE", "DELETE"]
            .map(|p| format!("has_table_privilege('synchro_writer', '{relation}', '{p}')"))
            .join(" AND ");
        grants.push(grant_once(
            &held,
            &format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {relation} TO synchro_writer"),
        ));
    }
    let script = grants.join(";\n");
    // Concurrent GRANTs on one object can fail with "tuple concurrently updated".
    let mut attempt = 0;
    loop {
        match sqlx::raw_sql(&script).execute(pool).await {
            Ok(_) => break,
            Err(_) if attempt < 5 => {
                attempt += 1;
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => return Err(install_error("granting synchro_writer the tables", e)),
        }
    }
    let mut catalog = HashMap::new();
    for t in targets {
        let columns = sqlx::query(
            "SELECT a.attname::text, format_type(a.atttypid, NULL), \
                    format_type(a.atttypid, a.atttypmod) FROM pg_attribute a \
             WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped",
        )
        .bind(&t.relation)
        .fetch_all(pool)
        .await
        .map_err(|e| install_error("reading column types", e))?;
        let mut types = HashMap::new();
        let mut declared = HashMap::new();
        for r in columns {
            let column: String = r.try_get(0).map_err(db_error)?;
            types.insert(column.clone(), base_type(r.try_get(1).map_err(db_error)?));
            declared.insert(column, r.try_get(2).map_err(db_error)?);
        }
        let pk_constraint: String = sqlx::query_scalar(
            "SELECT conname::text FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'p'",
        )
        .bind(&t.relation)
        .fetch_one(pool)
        .await
        .map_err(|e| install_error("reading the primary key constraint", e))?;
        let self_referencing: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_constraint \
             WHERE conrelid = $1::regclass AND confrelid = conrelid AND contype = 'f')",
        )
        .bind(&t.relation)
        .fetch_one(pool)
        .await
        .map_err(|e| install_error("reading the foreign keys", e))?;
        for c in &t.columns {
            if !types.contains_key(c) {
                return Err(StoreError::Unavailable(format!(
                    "push setup: {} has no column {c}",
                    t.relation
                )));
            }
        }
        catalog.insert(
            t.relation.clone(),
            Arc::new(RelationTypes {
                types,
                declared,
                pk_constraint,
                self_referencing,
            }),
        );
    }
    *store
        .writes
        .write()
        .map_err(|_| StoreError::Integrity("write catalog lock poisoned".into()))? = catalog;
    Ok(())
}

/// The name a cast uses for a column's type without its modifier.
/// `character` alone means `character(1)` in a cast, which would truncate;
/// `bpchar` is the same type without a length.
fn base_type(format_type: String) -> String {
    if format_type == "character" {
        "bpchar".into()
    } else {
        format_type
    }
}

/// The savepoint around one write, and the one around an atomic group.
const WRITE_SAVEPOINT: &str = "synchro_write";
const GROUP_SAVEPOINT: &str = "synchro_group";

/// A column of `alias` in its type's output form, which is what pgoutput
/// sends to capture. A text cast is not always that: a boolean casts to
/// `true` but prints `t`, and a `char(n)` cast drops its padding.
fn select_text(alias: &str, column: &str) -> String {
    format!(
        "CASE WHEN {alias}.\"{column}\" IS NOT NULL THEN format('%s', {alias}.\"{column}\") END"
    )
}

impl PgTx {
    fn relation(&self, target: &WriteTarget) -> Result<Arc<RelationTypes>, StoreError> {
        self.writes
            .read()
            .map_err(|_| StoreError::Integrity("write catalog lock poisoned".into()))?
            .get(&target.relation)
            .cloned()
            .ok_or_else(|| StoreError::Integrity("push is not installed for a table".into()))
    }

    fn type_of<'r>(&self, r: &'r RelationTypes, column: &str) -> Result<&'r str, StoreError> {
        r.types
            .get(column)
            .map(String::as_str)
            .ok_or_else(|| StoreError::Integrity("a synced column is missing".into()))
    }

    /// Whether every value would be stored as given (see [`keeps_as_given`]).
    fn values_kept(
        &self,
        r: &RelationTypes,
        values: &[(String, Option<String>)],
    ) -> Result<bool, StoreError> {
        for (column, value) in values {
            let declared = r
                .declared
                .get(column)
                .ok_or_else(|| StoreError::Integrity("a synced column is missing".into()))?;
            if value
                .as_deref()
                .is_some_and(|v| !keeps_as_given(declared, v))
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Runs statements without parameters in one round trip and returns
    /// their rows (in text form). Boxed, as [`Self::simple`].
    fn simple_rows(
        &mut self,
        sql: String,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Vec<PgRow>, sqlx::Error>> + Send + '_>,
    > {
        Box::pin(async move {
            let conn: &mut sqlx::PgConnection = &mut self.tx;
            sqlx::Executor::fetch_all(conn, sql.as_str()).await
        })
    }

    /// Runs statements without parameters in one round trip. Boxed: the
    /// future of `raw_sql` on a borrowed connection is only `Send` at one lifetime.
    fn simple(
        &mut self,
        sql: String,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), sqlx::Error>> + Send + '_>>
    {
        Box::pin(async move {
            let conn: &mut sqlx::PgConnection = &mut self.tx;
            sqlx::Executor::execute(conn, sql.as_str())
                .await
                .map(|_| ())
        })
    }

    pub(crate) async fn start_writes(&mut self, w: &Writer) -> Result<(), StoreError> {
        // Output forms pinned as for capture, so both read the same text.
        sqlx::query(
            "SELECT set_config('role', 'synchro_writer', true), \
                    set_config('synchro.user_id', $1, true), \
                    set_config('synchro.client_id', $2, true), \
                    set_config('DateStyle', 'ISO, YMD', true), \
                    set_config('TimeZone', 'UTC', true), \
                    set_config('extra_float_digits', '1', true), \
                    set_config('bytea_output', 'hex', true)",
        )
        .bind(&w.user_id)
        .bind(&w.client_id)
        .execute(&mut *self.tx)
        .await
        .map_err(db_error)?;
        // Deferred until the end of each push unit. Sent with the first
        // savepoint (one round trip); nothing before a write fires a constraint.
        self.defer_pending = true;
        self.check_each_write = w.check_each_write;
        Ok(())
    }

    pub(crate) async fn stop_writes(&mut self) -> Result<(), StoreError> {
        self.savepoint_open = false;
        self.defer_pending = false;
        self.check_each_write = false;
        self.simple("SET LOCAL ROLE NONE".into())
            .await
            .map_err(db_error)
    }

    pub(crate) async fn lock_rows(
        &mut self,
        target: &WriteTarget,
        keys: &[String],
    ) -> Result<Vec<FoundRow>, StoreError> {
        let rel = self.relation(target)?;
        let pk_type = self.type_of(&rel, &target.primary_key)?.to_owned();
        let pk_declared = rel
            .declared
            .get(&target.primary_key)
            .ok_or_else(|| StoreError::Integrity("the key column is missing".into()))?;
        check_keys(pk_declared, keys)?;
        let mut columns = Vec::new();
        for c in &target.columns {
            columns.push(select_text("r", c));
        }
        let pk = &target.primary_key;
        let width = target.columns.len();
        // One statement (ADR 0031): the visible rows locked (kind `r`),
        // then every key's version (kind `v`), read by a function of the
        // lock's count, so after the lock, with a snapshot of its own (the
        // statement's is older than a wait for another writer).
        let sql = format!(
            "WITH locked AS MATERIALIZED ( \
               SELECT r.\"{pk}\"::text, {} FROM {} r \
               WHERE r.\"{pk}\" = ANY($1::text[]::{pk_type}[]) ORDER BY r.\"{pk}\" FOR UPDATE), \
             gate AS MATERIALIZED (SELECT count(*) AS n FROM locked) \
             SELECT 'r'::text, l.*, NULL::text, NULL::boolean FROM locked l \
             UNION ALL \
             SELECT 'v', v.key, {}v.version, v.deleted \
             FROM gate CROSS JOIN LATERAL synchro.row_versions_after_lock($2, $1, gate.n) v",
            columns.join(", "),
            quote_relation(&target.relation),
            "NULL, ".repeat(width),
        );
        let rows = sqlx::query(&sql)
            // Planned for each call: a cached generic plan would keep the
            // scan chosen while the tables were small.
            .persistent(false)
            .bind(keys)
            .bind(&target.table_id)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)?;
        let mut visible = BTreeMap::new();
        let mut versions = BTreeMap::new();
        for r in rows {
            let kind: String = r.try_get(0).map_err(db_error)?;
            let key: String = r.try_get(1).map_err(db_error)?;
            if kind == "r" {
                let mut image = BTreeMap::new();
                for (i, c) in target.columns.iter().enumerate() {
                    image.insert(
                        c.clone(),
                        r.try_get::<Option<String>, _>(i + 2).map_err(db_error)?,
                    );
                }
                assert!(visible.insert(key, image).is_none(), "a row locked once");
            } else {
                let version = VersionRecord {
                    version: r.try_get(width + 2).map_err(db_error)?,
                    deleted: r.try_get(width + 3).map_err(db_error)?,
                };
                assert!(
                    versions.insert(key, version).is_none(),
                    "a key's version read once"
                );
            }
        }
        Ok(keys
            .iter()
            .map(|key| FoundRow {
                key: key.clone(),
                visible: visible.get(key).cloned(),
                version: versions.get(key).cloned(),
            })
            .collect())
    }

    pub(crate) async fn write(
        &mut self,
        target: &WriteTarget,
        key: &str,
        write: &RowWrite,
    ) -> Result<WriteResult, StoreError> {
        let rel = self.relation(target)?;
        let pk = &target.primary_key;
        let pk_type = self.type_of(&rel, pk)?.to_owned();
        let cast = |n: usize, ty: &str| format!("${n}::text::{ty}");
        let (sql, values) = match write {
            RowWrite::Insert { values } => {
                let mut columns = vec![format!("\"{pk}\"")];
                let mut exprs = vec![cast(1, &pk_type)];
                for (i, (c, _)) in values.iter().enumerate() {
                    columns.push(format!("\"{c}\""));
                    exprs.push(cast(i + 2, self.type_of(&rel, c)?));
                }
                let sql = format!(
                    "INSERT INTO {} ({}) VALUES ({})",
                    quote_relation(&target.relation),
                    columns.join(", "),
                    exprs.join(", ")
                );
                (sql, values.as_slice())
            }
            RowWrite::Update { values } => {
                let mut sets = Vec::new();
                for (i, (c, _)) in values.iter().enumerate() {
                    sets.push(format!("\"{c}\" = {}", cast(i + 2, self.type_of(&rel, c)?)));
                }
                let sql = format!(
                    "UPDATE {} SET {} WHERE \"{pk}\" = {}",
                    quote_relation(&target.relation),
                    sets.join(", "),
                    cast(1, &pk_type)
                );
                (sql, values.as_slice())
            }
            RowWrite::Delete => (
                format!(
                    "DELETE FROM {} WHERE \"{pk}\" = {}",
                    quote_relation(&target.relation),
                    cast(1, &pk_type)
                ),
                &[][..],
            ),
        };
        if !self.values_kept(&rel, values)? {
            return Ok(WriteResult::Refused(Refusal::Constraint));
        }
        self.open_write().await?;
        let mut q = sqlx::query(&sql).bind(key);
        for (_, v) in values {
            q = q.bind(v.as_deref());
        }
        let changed = match q.execute(&mut *self.tx).await {
            Ok(done) => done.rows_affected(),
            Err(e) => {
                let refused = refusal(&e, &rel.pk_constraint);
                self.undo_write().await?;
                return match refused {
                    Some(r) => Ok(WriteResult::Refused(r)),
                    None => Err(db_error(e)),
                };
            }
        };
        if changed == 0 {
            // Triggers may have written before the row was kept: undo them too.
            self.undo_write().await?;
            return Ok(WriteResult::Unchanged);
        }
        // The end of the push unit when each write is one, then the row as
        // the writer now sees it and the version the trigger gave it: one
        // round trip, so the text form (the key is a checked literal).
        let mut columns = Vec::new();
        for c in &target.columns {
            columns.push(select_text("r", c));
        }
        let check = if self.check_each_write {
            self.defer_pending = true;
            "SET CONSTRAINTS ALL IMMEDIATE; "
        } else {
            ""
        };
        let sql = format!(
            "{check}SELECT v.version, r.\"{pk}\" IS NOT NULL, {} FROM synchro.row_versions v \
             LEFT JOIN {} r ON r.\"{pk}\" = {}::{pk_type} WHERE v.table_id = {} AND v.key = {}",
            columns.join(", "),
            quote_relation(&target.relation),
            literal(key),
            literal(&target.table_id),
            literal(key),
        );
        let row = match self.simple_rows(sql).await {
            Ok(rows) => rows.into_iter().next(),
            Err(e) => {
                // The unit's constraint check failed: the write is refused.
                let refused = refusal(&e, &rel.pk_constraint).map(unit_refusal);
                self.undo_write().await?;
                return match refused {
                    Some(r) => Ok(WriteResult::Refused(r)),
                    None => Err(db_error(e)),
                };
            }
        }
        .ok_or_else(|| StoreError::Integrity("a written row has no version".into()))?;
        let version: String = row.try_get(0).map_err(db_error)?;
        let exists: bool = row.try_get(1).map_err(db_error)?;
        let deleting = matches!(write, RowWrite::Delete);
        if !exists && !deleting {
            // The written row is not visible to its writer: row security keeps it.
            self.undo_write().await?;
            return Ok(WriteResult::Refused(Refusal::Policy));
        }
        let image = if exists && !deleting {
            let mut image = BTreeMap::new();
            for (i, c) in target.columns.iter().enumerate() {
                image.insert(
                    c.clone(),
                    row.try_get::<Option<String>, _>(i + 2).map_err(db_error)?,
                );
            }
            Some(image)
        } else {
            None
        };
        Ok(WriteResult::Written {
            row: image,
            version,
        })
    }

    /// All the writes as one set: one statement per (operation, columns)
    /// group, then one read of every row and version. Any refusal, or a
    /// group that changed fewer rows than it names, undoes them all.
    pub(crate) async fn write_set(
        &mut self,
        target: &WriteTarget,
        writes: &[(String, RowWrite)],
    ) -> Result<Option<Vec<WriteResult>>, StoreError> {
        let rel = self.relation(target)?;
        if self.check_each_write && rel.self_referencing {
            // A row may need one written after it: each unit alone decides.
            return Ok(None);
        }
        let pk = &target.primary_key;
        let pk_type = self.type_of(&rel, pk)?.to_owned();
        let relation = quote_relation(&target.relation);
        // Groups in order of first appearance: (kind, columns) -> rows.
        let mut groups: Vec<(u8, Vec<String>, Vec<usize>)> = Vec::new();
        for (i, (_, w)) in writes.iter().enumerate() {
            let (kind, columns) = match w {
                RowWrite::Insert { values } => (0, values.iter().map(|(c, _)| c.clone()).collect()),
                RowWrite::Update { values } => (1, values.iter().map(|(c, _)| c.clone()).collect()),
                RowWrite::Delete => (2, Vec::new()),
            };
            match groups
                .iter_mut()
                .find(|(k, c, _)| *k == kind && *c == columns)
            {
                Some((_, _, rows)) => rows.push(i),
                None => groups.push((kind, columns, vec![i])),
            }
        }
        for (_, w) in writes {
            if let RowWrite::Insert { values } | RowWrite::Update { values } = w
                && !self.values_kept(&rel, values)?
            {
                return Ok(None); // the per-row path refuses that one
            }
        }
        self.open_write().await?;
        for (kind, columns, rows) in &groups {
            // unnest's columns: the key, then each value column.
            let mut inputs = vec!["$1::text[]".to_owned()];
            let mut names = vec!["k".to_owned()];
            let mut types = Vec::new();
            for (j, c) in columns.iter().enumerate() {
                inputs.push(format!("${}::text[]", j + 2));
                names.push(format!("v{j}"));
                types.push(self.type_of(&rel, c)?.to_owned());
            }
            let source = format!("unnest({}) AS u({})", inputs.join(", "), names.join(", "));
            let sql = match kind {
                0 => format!(
                    "INSERT INTO {relation} (\"{pk}\"{}) SELECT u.k::{pk_type}{} FROM {source}",
                    columns
                        .iter()
                        .map(|c| format!(", \"{c}\""))
                        .collect::<String>(),
                    types
                        .iter()
                        .enumerate()
                        .map(|(j, t)| format!(", u.v{j}::{t}"))
                        .collect::<String>()
                ),
                1 => format!(
                    "UPDATE {relation} r SET {} FROM {source} WHERE r.\"{pk}\" = u.k::{pk_type}",
                    columns
                        .iter()
                        .zip(&types)
                        .enumerate()
                        .map(|(j, (c, t))| format!("\"{c}\" = u.v{j}::{t}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                _ => format!(
                    "DELETE FROM {relation} r USING {source} WHERE r.\"{pk}\" = u.k::{pk_type}"
                ),
            };
            let keys: Vec<&str> = rows.iter().map(|i| writes[*i].0.as_str()).collect();
            let mut q = sqlx::query(&sql).persistent(false).bind(keys);
            for j in 0..columns.len() {
                let values: Vec<Option<&str>> = rows
                    .iter()
                    .map(|i| match &writes[*i].1 {
                        RowWrite::Insert { values } | RowWrite::Update { values } => {
                            values[j].1.as_deref()
                        }
                        RowWrite::Delete => None,
                    })
                    .collect();
                q = q.bind(values);
            }
            let all = match q.execute(&mut *self.tx).await {
                Ok(done) => done.rows_affected() == rows.len() as u64,
                Err(e) if refusal(&e, &rel.pk_constraint).is_some() => false,
                Err(e) => {
                    self.undo_write().await?;
                    return Err(db_error(e));
                }
            };
            if !all {
                self.undo_write().await?;
                return Ok(None);
            }
        }
        if self.check_each_write {
            // The end of every unit of the set: any failure, and the per-row path says whose.
            self.defer_pending = true;
            if let Err(e) = self.simple("SET CONSTRAINTS ALL IMMEDIATE".into()).await {
                let refused = refusal(&e, &rel.pk_constraint);
                self.undo_write().await?;
                return match refused {
                    Some(_) => Ok(None),
                    None => Err(db_error(e)),
                };
            }
        }
        // Every row as the writer now sees it, with the version its write created.
        let mut columns = Vec::new();
        for c in &target.columns {
            columns.push(select_text("r", c));
        }
        let keys: Vec<&str> = writes.iter().map(|(k, _)| k.as_str()).collect();
        let sql = format!(
            "SELECT q.k, v.version, r.\"{pk}\" IS NOT NULL, {} FROM unnest($1::text[]) AS q(k) \
             JOIN synchro.row_versions v ON v.table_id = $2 AND v.key = q.k \
             LEFT JOIN {relation} r ON r.\"{pk}\" = q.k::{pk_type}",
            columns.join(", ")
        );
        let found = sqlx::query(&sql)
            .persistent(false)
            .bind(&keys)
            .bind(&target.table_id)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(db_error)?;
        let mut by_key = BTreeMap::new();
        for r in found {
            let key: String = r.try_get(0).map_err(db_error)?;
            let version: String = r.try_get(1).map_err(db_error)?;
            let exists: bool = r.try_get(2).map_err(db_error)?;
            let mut image = BTreeMap::new();
            for (i, c) in target.columns.iter().enumerate() {
                image.insert(
                    c.clone(),
                    r.try_get::<Option<String>, _>(i + 3).map_err(db_error)?,
                );
            }
            let first = by_key.insert(key, (version, exists.then_some(image)));
            assert!(first.is_none(), "a written row read back once");
        }
        let mut results = Vec::with_capacity(writes.len());
        for ((_, w), key) in writes.iter().zip(keys) {
            let Some((version, image)) = by_key.remove(key) else {
                return Err(StoreError::Integrity("a written row has no version".into()));
            };
            let deleting = matches!(w, RowWrite::Delete);
            if image.is_none() != deleting {
                // Not visible to its writer after the write (row security), or
                // a delete that left the row: the per-row path decides.
                self.undo_write().await?;
                return Ok(None);
            }
            results.push(WriteResult::Written {
                row: image,
                version,
            });
        }
        Ok(Some(results))
    }

    /// Opens the savepoint of the next write, releasing the last one's in
    /// the same round trip.
    async fn open_write(&mut self) -> Result<(), StoreError> {
        let mut open = if self.savepoint_open {
            format!("RELEASE SAVEPOINT {WRITE_SAVEPOINT}; SAVEPOINT {WRITE_SAVEPOINT}")
        } else {
            format!("SAVEPOINT {WRITE_SAVEPOINT}")
        };
        if std::mem::take(&mut self.defer_pending) {
            open.insert_str(0, "SET CONSTRAINTS ALL DEFERRED; ");
        }
        self.simple(open).await.map_err(db_error)?;
        self.savepoint_open = true;
        Ok(())
    }

    async fn undo_write(&mut self) -> Result<(), StoreError> {
        self.savepoint_open = false;
        self.simple(format!(
            "ROLLBACK TO SAVEPOINT {WRITE_SAVEPOINT}; RELEASE SAVEPOINT {WRITE_SAVEPOINT}"
        ))
        .await
        .map_err(db_error)
    }

    pub(crate) async fn open_group(&mut self) -> Result<(), StoreError> {
        let mut sql = if self.savepoint_open {
            format!("RELEASE SAVEPOINT {WRITE_SAVEPOINT}; SAVEPOINT {GROUP_SAVEPOINT}")
        } else {
            format!("SAVEPOINT {GROUP_SAVEPOINT}")
        };
        // The group is the unit: its deferrable constraints wait for its end.
        if std::mem::take(&mut self.defer_pending) {
            sql.insert_str(0, "SET CONSTRAINTS ALL DEFERRED; ");
        }
        self.savepoint_open = false;
        self.simple(sql).await.map_err(db_error)
    }

    pub(crate) async fn deferred_check(&mut self) -> Result<Option<Refusal>, StoreError> {
        match self.simple("SET CONSTRAINTS ALL IMMEDIATE".into()).await {
            Ok(()) => Ok(None),
            // The group savepoint is still there: the caller undoes the group.
            // Whatever failed, the group's last mutation owns it as
            // `validation_failed` (a deferrable key included, hence "").
            Err(e) => match refusal(&e, "") {
                None => Err(db_error(e)),
                Some(r) => Ok(Some(unit_refusal(r))),
            },
        }
    }

    pub(crate) async fn close_group(&mut self) -> Result<(), StoreError> {
        self.savepoint_open = false;
        self.simple(format!("ROLLBACK TO SAVEPOINT {GROUP_SAVEPOINT}"))
            .await
            .map_err(db_error)
    }
}

/// A refusal at the end of a push unit: a deferred constraint failed,
/// whatever raised it (`validation_failed`); a taken key stays one.
fn unit_refusal(r: Refusal) -> Refusal {
    match r {
        Refusal::DuplicateKey => Refusal::DuplicateKey,
        Refusal::Policy | Refusal::Constraint => Refusal::Constraint,
    }
}
