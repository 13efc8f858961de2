//! The sync config checked against the live catalog, and the server
//! prerequisites of an external database. Every failure is one message that
//! names the table and column.

use actors::config::{MembershipRule, SyncConfig, TableConfig};
use protocol::value::{FieldType, PortableType};
use sqlx::Row;
use sqlx::postgres::PgPool;

/// One column as the catalog describes it.
struct Column {
    name: String,
    type_name: String,
    typmod: i32,
    not_null: bool,
}

/// Why a column of type `type_name` (`pg_type.typname`) with modifier
/// `typmod` cannot hold the values of a field of `declared`, if it cannot.
pub(crate) fn type_conflict(type_name: &str, typmod: i32, declared: &FieldType) -> Option<String> {
    let c = Column {
        name: String::new(),
        type_name: type_name.to_owned(),
        typmod,
        not_null: false,
    };
    let (ty, bounds) = match portable_type(&c) {
        Ok(t) => t,
        Err(e) => return Some(e),
    };
    if ty != declared.ty {
        return Some(format!(
            "the column syncs as {}, but the config declares {}",
            ty.name(),
            declared.ty.name()
        ));
    }
    let declared_bounds = declared.decimal.map(|b| (b.precision, b.scale));
    if ty == PortableType::Decimal && bounds != declared_bounds {
        return Some(format!(
            "numeric bounds {bounds:?} differ from the declared {declared_bounds:?}"
        ));
    }
    None
}

/// The portable type a column of `type_name` syncs as, with decimal bounds.
fn portable_type(c: &Column) -> Result<(PortableType, Option<(u32, u32)>), String> {
    Ok(match c.type_name.as_str() {
        "text" | "varchar" | "bpchar" | "uuid" => (PortableType::String, None),
        "int2" | "int4" => (PortableType::Int, None),
        "int8" => (PortableType::Int64, None),
        "numeric" if c.typmod >= 4 => {
            let m = (c.typmod - 4) as u32;
            (
                PortableType::Decimal,
                Some(((m >> 16) & 0xffff, m & 0xffff)),
            )
        }
        "numeric" => {
            return Err("is numeric without precision and scale; declare numeric(p,s)".into());
        }
        "float4" | "float8" => (PortableType::Float, None),
        "bool" => (PortableType::Boolean, None),
        "timestamptz" => (PortableType::Datetime, None),
        "timestamp" => return Err("is timestamp without time zone; use timestamptz".into()),
        "date" => (PortableType::Date, None),
        "time" => (PortableType::Time, None),
        "json" | "jsonb" => (PortableType::Json, None),
        "bytea" => (PortableType::Bytes, None),
        other => return Err(format!("has type {other}, which has no portable type")),
    })
}

async fn relation_oid(
    pool: &PgPool,
    relation: &str,
) -> Result<Option<(u32, String, String)>, sqlx::Error> {
    let (schema, name) = relation.split_once('.').unwrap_or(("public", relation));
    let row = sqlx::query(
        "SELECT c.oid::int8, c.relkind::text, c.relreplident::text FROM pg_class c \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2",
    )
    .bind(schema)
    .bind(name)
    .fetch_optional(pool)
    .await?;
    Ok(match row {
        Some(r) => Some((r.try_get::<i64, _>(0)? as u32, r.try_get(1)?, r.try_get(2)?)),
        None => None,
    })
}

async fn columns(pool: &PgPool, oid: u32) -> Result<Vec<Column>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT a.attname::text, t.typname::text, a.atttypmod, a.attnotnull FROM pg_attribute a \
         JOIN pg_type t ON t.oid = a.atttypid \
         WHERE a.attrelid = $1::int8::oid AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
    )
    .bind(oid as i64)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Column {
                name: r.try_get(0)?,
                type_name: r.try_get(1)?,
                typmod: r.try_get(2)?,
                not_null: r.try_get(3)?,
            })
        })
        .collect()
}

/// Checks every table, column and relation the config names. Returns all problems.
pub async fn validate(pool: &PgPool, config: &SyncConfig) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    for t in &config.tables {
        if let Err(mut p) = validate_table(pool, t).await {
            problems.append(&mut p);
        }
        for rule in &t.scopes {
            if let MembershipRule::Dependency { via, key, .. } = rule {
                check_columns(
                    pool,
                    &format!("table {}: dependency", t.table_id),
                    via,
                    &[key],
                    &mut problems,
                )
                .await;
            }
        }
    }
    for d in &config.assignment.dependency {
        let cols = [&d.user_column, &d.value_column];
        check_columns(
            pool,
            "assignment.dependency",
            &d.relation,
            &cols,
            &mut problems,
        )
        .await;
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

async fn check_columns(
    pool: &PgPool,
    what: &str,
    relation: &str,
    wanted: &[&String],
    problems: &mut Vec<String>,
) {
    match relation_oid(pool, relation).await {
        Ok(Some((oid, _, _))) => match columns(pool, oid).await {
            Ok(cols) => {
                for w in wanted {
                    if !cols.iter().any(|c| &c.name == *w) {
                        problems.push(format!("{what} relation {relation} has no column {w}"));
                    }
                }
            }
            Err(e) => problems.push(format!(
                "{what} relation {relation}: catalog query failed: {e}"
            )),
        },
        Ok(None) => problems.push(format!("{what} relation {relation} does not exist")),
        Err(e) => problems.push(format!(
            "{what} relation {relation}: catalog query failed: {e}"
        )),
    }
}

async fn validate_table(pool: &PgPool, t: &TableConfig) -> Result<(), Vec<String>> {
    let id = &t.table_id;
    let query_failed = |e: sqlx::Error| vec![format!("table {id}: catalog query failed: {e}")];
    let Some((oid, kind, replident)) = relation_oid(pool, &t.relation)
        .await
        .map_err(query_failed)?
    else {
        return Err(vec![format!(
            "table {id}: relation {} does not exist",
            t.relation
        )]);
    };
    let mut problems = Vec::new();
    if kind != "r" && kind != "p" {
        problems.push(format!(
            "table {id}: relation {} is not an ordinary table",
            t.relation
        ));
    }
    if replident != "d" {
        problems.push(format!(
            "table {id}: relation {} must have REPLICA IDENTITY DEFAULT",
            t.relation
        ));
    }
    let pk = sqlx::query(
        "SELECT array_agg(a.attname::text ORDER BY a.attnum), bool_or(con.condeferrable) FROM pg_constraint con \
         JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = ANY (con.conkey) \
         WHERE con.conrelid = $1::int8::oid AND con.contype = 'p' GROUP BY con.oid",
    )
    .bind(oid as i64)
    .fetch_optional(pool)
    .await
    .map_err(query_failed)?;
    match pk {
        None => problems.push(format!(
            "table {id}: relation {} has no primary key",
            t.relation
        )),
        Some(r) => {
            let cols: Vec<String> = r.try_get(0).map_err(query_failed)?;
            let deferrable: bool = r.try_get(1).map_err(query_failed)?;
            if cols.len() != 1 {
                problems.push(format!(
                    "table {id}: the primary key must be one column, not {}",
                    cols.join(", ")
                ));
            } else if cols[0] != t.primary_key {
                problems.push(format!(
                    "table {id}: the primary key is column {}, not {}",
                    cols[0], t.primary_key
                ));
            }
            if deferrable {
                problems.push(format!(
                    "table {id}: the primary key must not be deferrable"
                ));
            }
        }
    }
    let cols = columns(pool, oid).await.map_err(query_failed)?;
    for f in &t.fields {
        let Some(c) = cols.iter().find(|c| c.name == f.column) else {
            problems.push(format!(
                "table {id}, column {}: no such column in {}",
                f.column, t.relation
            ));
            continue;
        };
        let declared = match f.field_type() {
            Ok(d) => d,
            Err(e) => {
                problems.push(format!("table {id}, column {}: {e}", f.column));
                continue;
            }
        };
        if let Some(e) = type_conflict(&c.type_name, c.typmod, &declared) {
            problems.push(format!("table {id}, column {}: {e}", f.column));
        }
        if f.column == t.primary_key
            && portable_type(c).is_ok()
            && !matches!(
                c.type_name.as_str(),
                "int2" | "int4" | "int8" | "text" | "varchar" | "uuid"
            )
        {
            problems.push(format!("table {id}, column {}: a primary key must be smallint, integer, bigint, text, varchar or uuid", f.column));
        }
        if !declared.nullable && !c.not_null {
            problems.push(format!(
                "table {id}, column {}: declared not nullable, but the column allows NULL",
                f.column
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

/// Checks what an external database must offer: logical WAL and the right to create schema `synchro`.
pub async fn check_server(pool: &PgPool) -> Result<(), Vec<String>> {
    let mut problems = Vec::new();
    let wal_level: String = sqlx::query_scalar("SELECT current_setting('wal_level')")
        .fetch_one(pool)
        .await
        .map_err(|e| vec![format!("cannot read wal_level: {e}")])?;
    if wal_level != "logical" {
        problems.push(format!(
            "wal_level is {wal_level}; set wal_level = logical and restart PostgreSQL"
        ));
    }
    let (can_create, can_replicate): (bool, bool) = sqlx::query_as(
        "SELECT has_database_privilege(current_database(), 'CREATE'), \
                (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user)",
    )
    .fetch_one(pool)
    .await
    .map_err(|e| vec![format!("cannot read privileges: {e}")])?;
    if !can_create {
        problems
            .push("the role lacks CREATE on the database (needed for schema synchro)".to_owned());
    }
    if !can_replicate {
        problems.push(
            "the role lacks the REPLICATION attribute (needed for logical decoding)".to_owned(),
        );
    }
    // Push writes as synchro_writer: the server creates it (CREATEROLE), or
    // an operator created it and made this role a member.
    let can_write: bool = sqlx::query_scalar(
        "SELECT (SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user) \
             OR CASE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'synchro_writer') \
                THEN pg_has_role(current_user, 'synchro_writer', 'MEMBER') ELSE false END",
    )
    .fetch_one(pool)
    .await
    .map_err(|e| vec![format!("cannot read role memberships: {e}")])?;
    if !can_write {
        problems.push(
            "the role lacks CREATEROLE and is not a member of synchro_writer (needed for push)"
                .to_owned(),
        );
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}
