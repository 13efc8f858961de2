//! The local store of a real device: one SQLite file (rusqlite, SQLite
//! compiled in), each transition one SQLite transaction, synced to disk
//! before `commit` returns.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension, params};

use crate::local::{
    Holding, LocalError, LocalStore, OutboxChange, QueuedWrite, SealedBatch, Session,
    SettledOutcome, Transition,
};

const SCHEMA: &str = "
PRAGMA journal_mode = WAL;
PRAGMA synchronous = FULL;
CREATE TABLE IF NOT EXISTS session (
    one   INTEGER PRIMARY KEY CHECK (one = 1),
    body  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS holdings (
    scope      TEXT NOT NULL,
    identity   BLOB NOT NULL,
    table_id   TEXT NOT NULL,
    pk         TEXT NOT NULL,
    row        TEXT NOT NULL,
    version    TEXT NOT NULL,
    digest     BLOB NOT NULL CHECK (length(digest) = 32),
    tombstone  INTEGER NOT NULL,
    seq        INTEGER NOT NULL,
    PRIMARY KEY (scope, identity)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS writes (
    seq          INTEGER PRIMARY KEY,
    mutation_id  TEXT NOT NULL UNIQUE,
    mutation     TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS sealed (
    ord       INTEGER PRIMARY KEY AUTOINCREMENT,
    batch_id  TEXT NOT NULL UNIQUE,
    body      BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS sealed_writes (
    batch_id     TEXT NOT NULL REFERENCES sealed (batch_id) ON DELETE CASCADE,
    position     INTEGER NOT NULL,
    mutation_id  TEXT NOT NULL,
    PRIMARY KEY (batch_id, position)
);
CREATE TABLE IF NOT EXISTS outcomes (
    seq          INTEGER PRIMARY KEY,
    mutation_id  TEXT NOT NULL,
    table_id     TEXT NOT NULL,
    pk           TEXT NOT NULL,
    status       TEXT NOT NULL,
    code         TEXT,
    version      TEXT,
    verified     INTEGER NOT NULL,
    object       TEXT NOT NULL
);
";

/// A local store in one SQLite file.
pub struct SqliteStore {
    conn: Connection,
}

fn local(e: rusqlite::Error) -> LocalError {
    LocalError(e.to_string())
}

impl SqliteStore {
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> Result<SqliteStore, LocalError> {
        let conn = Connection::open(path).map_err(local)?;
        conn.execute_batch(SCHEMA).map_err(local)?;
        conn.execute_batch("PRAGMA foreign_keys = ON;")
            .map_err(local)?;
        Ok(SqliteStore { conn })
    }

    fn holdings_where(&self, filter: &str, args: &[&str]) -> Result<Vec<Holding>, LocalError> {
        let sql = format!(
            "SELECT scope, identity, table_id, pk, row, version, digest, tombstone, seq \
             FROM holdings {filter} ORDER BY scope, identity"
        );
        let mut stmt = self.conn.prepare_cached(&sql).map_err(local)?;
        let rows = stmt
            .query_map(rusqlite::params_from_iter(args), |r| {
                let digest: Vec<u8> = r.get(6)?;
                Ok((
                    Holding {
                        scope: r.get(0)?,
                        identity: r.get(1)?,
                        table: r.get(2)?,
                        pk: r.get(3)?,
                        row: r.get(4)?,
                        version: r.get(5)?,
                        digest: [0; 32],
                        tombstone: r.get(7)?,
                        seq: r.get::<_, i64>(8)? as u64,
                    },
                    digest,
                ))
            })
            .map_err(local)?;
        rows.map(|r| {
            let (mut h, digest) = r.map_err(local)?;
            h.digest = digest
                .try_into()
                .map_err(|_| LocalError("a stored digest is not 32 bytes".into()))?;
            Ok(h)
        })
        .collect()
    }
}

fn seq(n: u64) -> Result<i64, LocalError> {
    i64::try_from(n).map_err(|_| LocalError("a sequence number out of range".into()))
}

impl LocalStore for SqliteStore {
    fn session(&self) -> Result<Option<Session>, LocalError> {
        let body: Option<String> = self
            .conn
            .query_row("SELECT body FROM session", [], |r| r.get(0))
            .optional()
            .map_err(local)?;
        body.map(|b| Session::from_text(&b)).transpose()
    }

    fn holdings(&self, scope: &str) -> Result<Vec<Holding>, LocalError> {
        self.holdings_where("WHERE scope = ?1", &[scope])
    }

    fn all_holdings(&self) -> Result<Vec<Holding>, LocalError> {
        self.holdings_where("", &[])
    }

    fn queued(&self) -> Result<Vec<QueuedWrite>, LocalError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT seq, mutation_id, mutation FROM writes \
                 WHERE mutation_id NOT IN (SELECT mutation_id FROM sealed_writes) ORDER BY seq",
            )
            .map_err(local)?;
        let rows = stmt
            .query_map([], |r| {
                Ok(QueuedWrite {
                    seq: r.get::<_, i64>(0)? as u64,
                    mutation_id: r.get(1)?,
                    mutation: r.get(2)?,
                })
            })
            .map_err(local)?;
        rows.map(|r| r.map_err(local)).collect()
    }

    fn sealed(&self) -> Result<Vec<SealedBatch>, LocalError> {
        let mut stmt = self
            .conn
            .prepare_cached("SELECT batch_id, body FROM sealed ORDER BY ord")
            .map_err(local)?;
        let batches: Vec<(String, Vec<u8>)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(local)?
            .collect::<Result<_, _>>()
            .map_err(local)?;
        let mut ids = self
            .conn
            .prepare_cached(
                "SELECT mutation_id FROM sealed_writes WHERE batch_id = ?1 ORDER BY position",
            )
            .map_err(local)?;
        batches
            .into_iter()
            .map(|(batch_id, body)| {
                let mutation_ids = ids
                    .query_map([&batch_id], |r| r.get(0))
                    .map_err(local)?
                    .collect::<Result<_, _>>()
                    .map_err(local)?;
                Ok(SealedBatch {
                    batch_id,
                    body,
                    mutation_ids,
                })
            })
            .collect()
    }

    fn outcomes(&self) -> Result<Vec<SettledOutcome>, LocalError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT seq, mutation_id, table_id, pk, status, code, version, verified, object \
                 FROM outcomes ORDER BY seq",
            )
            .map_err(local)?;
        let rows = stmt
            .query_map([], |r| {
                Ok(SettledOutcome {
                    seq: r.get::<_, i64>(0)? as u64,
                    mutation_id: r.get(1)?,
                    table: r.get(2)?,
                    pk: r.get(3)?,
                    status: r.get(4)?,
                    code: r.get(5)?,
                    version: r.get(6)?,
                    verified: r.get(7)?,
                    object: r.get(8)?,
                })
            })
            .map_err(local)?;
        rows.map(|r| r.map_err(local)).collect()
    }

    fn commit(&mut self, t: Transition) -> Result<(), LocalError> {
        let tx = self.conn.transaction().map_err(local)?;
        if let Some(s) = &t.session {
            tx.execute(
                "INSERT INTO session (one, body) VALUES (1, ?1) \
                 ON CONFLICT (one) DO UPDATE SET body = excluded.body",
                [s.to_text()],
            )
            .map_err(local)?;
        }
        for scope in &t.clear {
            tx.execute("DELETE FROM holdings WHERE scope = ?1", [scope])
                .map_err(local)?;
        }
        for (scope, identity) in &t.remove {
            tx.execute(
                "DELETE FROM holdings WHERE scope = ?1 AND identity = ?2",
                params![scope, identity],
            )
            .map_err(local)?;
        }
        for h in &t.put {
            tx.execute(
                "INSERT OR REPLACE INTO holdings \
                 (scope, identity, table_id, pk, row, version, digest, tombstone, seq) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                params![
                    h.scope,
                    h.identity,
                    h.table,
                    h.pk,
                    h.row,
                    h.version,
                    h.digest.as_slice(),
                    h.tombstone,
                    seq(h.seq)?
                ],
            )
            .map_err(local)?;
        }
        for c in &t.outbox {
            match c {
                OutboxChange::Queue(w) => {
                    tx.execute(
                        "INSERT INTO writes (seq, mutation_id, mutation) VALUES (?1, ?2, ?3)",
                        params![seq(w.seq)?, w.mutation_id, w.mutation],
                    )
                    .map_err(local)?;
                }
                OutboxChange::Seal(b) => {
                    tx.execute(
                        "INSERT INTO sealed (batch_id, body) VALUES (?1, ?2)",
                        params![b.batch_id, b.body],
                    )
                    .map_err(local)?;
                    for (k, id) in b.mutation_ids.iter().enumerate() {
                        tx.execute(
                            "INSERT INTO sealed_writes (batch_id, position, mutation_id) \
                             VALUES (?1, ?2, ?3)",
                            params![b.batch_id, k as i64, id],
                        )
                        .map_err(local)?;
                    }
                }
                OutboxChange::Unseal { batch_id } => {
                    let n = tx
                        .execute("DELETE FROM sealed WHERE batch_id = ?1", [batch_id])
                        .map_err(local)?;
                    if n != 1 {
                        return Err(LocalError("no such sealed batch".into()));
                    }
                }
                OutboxChange::Settle { batch_id, outcomes } => {
                    tx.execute(
                        "DELETE FROM writes WHERE mutation_id IN \
                         (SELECT mutation_id FROM sealed_writes WHERE batch_id = ?1)",
                        [batch_id],
                    )
                    .map_err(local)?;
                    let n = tx
                        .execute("DELETE FROM sealed WHERE batch_id = ?1", [batch_id])
                        .map_err(local)?;
                    if n != 1 {
                        return Err(LocalError("no such sealed batch".into()));
                    }
                    for o in outcomes {
                        tx.execute(
                            "INSERT INTO outcomes (seq, mutation_id, table_id, pk, status, code, \
                             version, verified, object) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
                            params![
                                seq(o.seq)?,
                                o.mutation_id,
                                o.table,
                                o.pk,
                                o.status,
                                o.code,
                                o.version,
                                o.verified,
                                o.object
                            ],
                        )
                        .map_err(local)?;
                    }
                }
            }
        }
        tx.commit().map_err(local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holding(scope: &str, id: u8) -> Holding {
        Holding {
            scope: scope.into(),
            identity: vec![id],
            table: "t".into(),
            pk: "{}".into(),
            row: "{}".into(),
            version: "v".into(),
            digest: [id; 32],
            tombstone: id.is_multiple_of(2),
            seq: u64::from(id),
        }
    }

    /// The same transitions leave the SQLite file and the memory store
    /// holding the same state, and the file keeps it across a reopen.
    #[test]
    fn sqlite_keeps_what_memory_keeps_across_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("local.db");
        let mut file = SqliteStore::open(&path).unwrap();
        let mut mem = crate::local::MemoryStore::new();
        let mut session = Session::fresh("device-a");
        session.generation = Some(3);
        session.scopes.insert("user:u1".into(), Some("c".into()));
        let w = |seq: u64, id: &str| QueuedWrite {
            seq,
            mutation_id: id.into(),
            mutation: format!("{{\"mutation_id\":\"{id}\"}}"),
        };
        let outcome = SettledOutcome {
            seq: 9,
            mutation_id: "m1".into(),
            table: "t".into(),
            pk: "{}".into(),
            status: "applied".into(),
            code: None,
            version: Some("v2".into()),
            verified: true,
            object: "{}".into(),
        };
        let transitions = vec![
            Transition {
                session: Some(session),
                put: vec![holding("a", 2), holding("a", 1), holding("b", 1)],
                outbox: vec![
                    OutboxChange::Queue(w(1, "m1")),
                    OutboxChange::Queue(w(2, "m2")),
                ],
                ..Transition::default()
            },
            Transition {
                remove: vec![("b".into(), vec![1])],
                outbox: vec![OutboxChange::Seal(SealedBatch {
                    batch_id: "b1".into(),
                    body: b"sealed bytes".to_vec(),
                    mutation_ids: vec!["m1".into()],
                })],
                ..Transition::default()
            },
            Transition {
                clear: vec!["b".into()],
                put: vec![holding("c", 3)],
                outbox: vec![OutboxChange::Settle {
                    batch_id: "b1".into(),
                    outcomes: vec![outcome],
                }],
                ..Transition::default()
            },
        ];
        for t in transitions {
            file.commit(t.clone()).unwrap();
            mem.commit(t).unwrap();
        }
        drop(file);
        let file = SqliteStore::open(&path).unwrap();
        assert_eq!(file.session().unwrap(), mem.session().unwrap());
        assert_eq!(file.holdings("a").unwrap(), mem.holdings("a").unwrap());
        assert_eq!(file.all_holdings().unwrap(), mem.all_holdings().unwrap());
        assert_eq!(file.queued().unwrap(), mem.queued().unwrap());
        assert_eq!(file.sealed().unwrap(), mem.sealed().unwrap());
        assert_eq!(file.outcomes().unwrap(), mem.outcomes().unwrap());
        assert_eq!(file.queued().unwrap(), vec![w(2, "m2")]);
    }

    #[test]
    fn a_refused_transition_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut file = SqliteStore::open(&dir.path().join("local.db")).unwrap();
        let refused = file.commit(Transition {
            put: vec![holding("a", 1)],
            outbox: vec![OutboxChange::Unseal {
                batch_id: "none".into(),
            }],
            ..Transition::default()
        });
        assert!(refused.is_err());
        assert!(file.all_holdings().unwrap().is_empty());
    }
}
