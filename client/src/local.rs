//! The client's durable local state, and the [`LocalStore`] trait that
//! keeps it: what the client knows of itself ([`Session`]), the rows each
//! scope holds ([`Holding`], one per scope and row: a row held by two
//! scopes stays until both remove it), and the outbox (writes queued,
//! batches sealed, outcomes settled).
//!
//! Every change is one [`Transition`], applied atomically: the spec's "one
//! local metadata transition" for a page, and the sealing or settling of a
//! batch. A store is thin: the client decides, the store keeps.

use std::collections::BTreeMap;
use std::fmt;

use protocol::json::{self, Object, Value};

/// What the client knows of itself and its assignment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Session {
    pub client_id: String,
    /// The server-issued generation; `None` while the client is fresh.
    pub generation: Option<u64>,
    /// The installed manifest's `schema_definition` (canonical JSON text).
    pub manifest: Option<String>,
    pub scope_set_version: u64,
    /// Every assigned scope with its incremental cursor (`None`: needs a rebuild).
    pub scopes: BTreeMap<String, Option<String>>,
    /// Set when connect answered `unsupported` (its reason): no push, pull or rebuild.
    pub unsupported: Option<String>,
    /// The next local sequence number (orders writes, holdings and outcomes).
    pub next_seq: u64,
}

impl Session {
    /// A fresh client.
    pub fn fresh(client_id: &str) -> Session {
        Session {
            client_id: client_id.to_owned(),
            next_seq: 1,
            ..Session::default()
        }
    }

    /// Takes the next sequence number.
    pub fn take_seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    /// The session as canonical JSON text (how a store that keeps text keeps it).
    pub fn to_text(&self) -> String {
        let mut o = Object::new();
        o.insert("client_id".into(), Value::string(self.client_id.clone()));
        if let Some(g) = self.generation {
            o.insert("generation".into(), Value::string(g.to_string()));
        }
        if let Some(m) = &self.manifest {
            o.insert("manifest".into(), Value::string(m.clone()));
        }
        o.insert(
            "scope_set_version".into(),
            Value::string(self.scope_set_version.to_string()),
        );
        let scopes = self.scopes.iter().map(|(s, c)| {
            let c = c.clone().map_or(Value::Null, Value::string);
            (s.clone(), c)
        });
        o.insert("scopes".into(), Value::Object(scopes.collect()));
        if let Some(r) = &self.unsupported {
            o.insert("unsupported".into(), Value::string(r.clone()));
        }
        o.insert("next_seq".into(), Value::string(self.next_seq.to_string()));
        json::to_canonical_string(&Value::Object(o))
    }

    /// Reads [`Session::to_text`]'s output.
    pub fn from_text(text: &str) -> Result<Session, LocalError> {
        let bad = || LocalError("the stored session is damaged".into());
        let v = json::parse(text.as_bytes()).map_err(|_| bad())?;
        let o = v.as_object().ok_or_else(bad)?;
        let string = |k: &str| o.get(k).and_then(Value::as_str).map(str::to_owned);
        let counter = |k: &str| -> Result<u64, LocalError> {
            string(k).and_then(|s| s.parse().ok()).ok_or_else(bad)
        };
        let mut scopes = BTreeMap::new();
        for (s, c) in o.get("scopes").and_then(Value::as_object).ok_or_else(bad)? {
            let cursor = match c {
                Value::Null => None,
                c => Some(c.as_str().ok_or_else(bad)?.to_owned()),
            };
            scopes.insert(s.clone(), cursor);
        }
        Ok(Session {
            client_id: string("client_id").ok_or_else(bad)?,
            generation: string("generation")
                .map(|g| g.parse().map_err(|_| bad()))
                .transpose()?,
            manifest: string("manifest"),
            scope_set_version: counter("scope_set_version")?,
            scopes,
            unsupported: string("unsupported"),
            next_seq: counter("next_seq")?,
        })
    }
}

/// One row as one scope holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    pub scope: String,
    /// The row identity bytes (INTEGRITY.md): the scope digest's order.
    pub identity: Vec<u8>,
    pub table: String,
    /// The typed primary key object, canonical JSON.
    pub pk: String,
    /// The complete authoritative row, canonical JSON.
    pub row: String,
    pub version: String,
    /// The row digest, verified against the server's `row_checksum`.
    pub digest: [u8; 32],
    /// A source tombstone (a delete that carried its row).
    pub tombstone: bool,
    /// When it was applied (the app sees the latest holding of a row).
    pub seq: u64,
}

/// An authored write waiting in the outbox, with its mutation object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueuedWrite {
    pub seq: u64,
    pub mutation_id: String,
    /// The mutation object, canonical JSON: fixed when authored, never edited.
    pub mutation: String,
}

/// A batch sealed before its first transmission: its body is resent byte
/// for byte until a terminal answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SealedBatch {
    pub batch_id: String,
    pub body: Vec<u8>,
    pub mutation_ids: Vec<String>,
}

/// The server's outcome of one pushed mutation, kept for the application.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SettledOutcome {
    pub seq: u64,
    pub mutation_id: String,
    pub table: String,
    /// The typed primary key object, canonical JSON.
    pub pk: String,
    /// `applied`, `conflict` or `rejected_terminal`.
    pub status: String,
    pub code: Option<String>,
    /// The row's version after the outcome, when the server gave one.
    pub version: Option<String>,
    /// Whether an echoed row's checksum was verified under the current manifest.
    pub verified: bool,
    /// The outcome object as the server sent it, canonical JSON.
    pub object: String,
}

/// One change to the outbox.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OutboxChange {
    Queue(QueuedWrite),
    Seal(SealedBatch),
    /// The batch was never executed (a generation or schema gate refused
    /// it): its writes are queued again, to be sealed in a new batch.
    Unseal {
        batch_id: String,
    },
    /// A terminal answer: the batch and its writes leave; the outcomes stay.
    Settle {
        batch_id: String,
        outcomes: Vec<SettledOutcome>,
    },
}

/// One atomic change of local state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transition {
    /// The new session, when it changed.
    pub session: Option<Session>,
    /// Scopes whose holdings all go first.
    pub clear: Vec<String>,
    /// Holdings removed: (scope, identity).
    pub remove: Vec<(String, Vec<u8>)>,
    /// Holdings put (replacing the scope's holding of the same row).
    pub put: Vec<Holding>,
    pub outbox: Vec<OutboxChange>,
}

/// A local store failure (a disk, a damaged file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalError(pub String);

impl fmt::Display for LocalError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "local store: {}", self.0)
    }
}

impl std::error::Error for LocalError {}

/// Where a client keeps its state. Reads see every committed transition;
/// `commit` applies all of a transition or none of it.
pub trait LocalStore {
    /// The session, `None` before the first commit.
    fn session(&self) -> Result<Option<Session>, LocalError>;
    /// A scope's holdings in row-identity order.
    fn holdings(&self, scope: &str) -> Result<Vec<Holding>, LocalError>;
    /// Every holding of every scope.
    fn all_holdings(&self) -> Result<Vec<Holding>, LocalError>;
    /// Writes not in a sealed batch, in authoring order.
    fn queued(&self) -> Result<Vec<QueuedWrite>, LocalError>;
    /// Sealed batches, in sealing order.
    fn sealed(&self) -> Result<Vec<SealedBatch>, LocalError>;
    /// Every settled outcome, in settling order.
    fn outcomes(&self) -> Result<Vec<SettledOutcome>, LocalError>;
    /// Applies `t` atomically.
    fn commit(&mut self, t: Transition) -> Result<(), LocalError>;
}

/// A store in memory: deterministic, for tests and the simulator. What it
/// holds is lost with it, as a device's state is lost with its disk.
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    session: Option<Session>,
    holdings: BTreeMap<(String, Vec<u8>), Holding>,
    /// Every queued write by seq, sealed or not.
    writes: BTreeMap<u64, QueuedWrite>,
    sealed: Vec<SealedBatch>,
    outcomes: Vec<SettledOutcome>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }
}

impl LocalStore for MemoryStore {
    fn session(&self) -> Result<Option<Session>, LocalError> {
        Ok(self.session.clone())
    }

    fn holdings(&self, scope: &str) -> Result<Vec<Holding>, LocalError> {
        Ok(self
            .holdings
            .range((scope.to_owned(), Vec::new())..)
            .take_while(|((s, _), _)| s == scope)
            .map(|(_, h)| h.clone())
            .collect())
    }

    fn all_holdings(&self) -> Result<Vec<Holding>, LocalError> {
        Ok(self.holdings.values().cloned().collect())
    }

    fn queued(&self) -> Result<Vec<QueuedWrite>, LocalError> {
        let sealed: std::collections::BTreeSet<&str> = self
            .sealed
            .iter()
            .flat_map(|b| b.mutation_ids.iter().map(String::as_str))
            .collect();
        Ok(self
            .writes
            .values()
            .filter(|w| !sealed.contains(w.mutation_id.as_str()))
            .cloned()
            .collect())
    }

    fn sealed(&self) -> Result<Vec<SealedBatch>, LocalError> {
        Ok(self.sealed.clone())
    }

    fn outcomes(&self) -> Result<Vec<SettledOutcome>, LocalError> {
        Ok(self.outcomes.clone())
    }

    fn commit(&mut self, t: Transition) -> Result<(), LocalError> {
        // Checked before anything changes, so a refused transition leaves all as it was.
        for c in &t.outbox {
            let known = |id: &str| self.sealed.iter().any(|b| b.batch_id == id);
            match c {
                OutboxChange::Unseal { batch_id } | OutboxChange::Settle { batch_id, .. }
                    if !known(batch_id) =>
                {
                    return Err(LocalError("no such sealed batch".into()));
                }
                _ => {}
            }
        }
        if let Some(s) = t.session {
            self.session = Some(s);
        }
        for scope in &t.clear {
            self.holdings.retain(|(s, _), _| s != scope);
        }
        for key in t.remove {
            self.holdings.remove(&key);
        }
        for h in t.put {
            self.holdings
                .insert((h.scope.clone(), h.identity.clone()), h);
        }
        for c in t.outbox {
            match c {
                OutboxChange::Queue(w) => {
                    self.writes.insert(w.seq, w);
                }
                OutboxChange::Seal(b) => self.sealed.push(b),
                OutboxChange::Unseal { batch_id } => {
                    self.sealed.retain(|b| b.batch_id != batch_id);
                }
                OutboxChange::Settle { batch_id, outcomes } => {
                    if let Some(k) = self.sealed.iter().position(|b| b.batch_id == batch_id) {
                        let batch = self.sealed.remove(k);
                        self.writes
                            .retain(|_, w| !batch.mutation_ids.contains(&w.mutation_id));
                    }
                    self.outcomes.extend(outcomes);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_survives_its_text() {
        let mut s = Session::fresh("device-a");
        s.generation = Some(4);
        s.manifest = Some("{\"m\":1}".into());
        s.scope_set_version = 7;
        s.scopes.insert("user:u1".into(), Some("c1".into()));
        s.scopes.insert("team:t1".into(), None);
        s.unsupported = Some("unknown_schema_lineage".into());
        s.next_seq = 99;
        assert_eq!(Session::from_text(&s.to_text()), Ok(s));
        assert!(
            Session::from_text("{}").is_err(),
            "a damaged session is an error"
        );
    }

    fn holding(scope: &str, id: u8) -> Holding {
        Holding {
            scope: scope.into(),
            identity: vec![id],
            table: "t".into(),
            pk: "{}".into(),
            row: "{}".into(),
            version: "v".into(),
            digest: [id; 32],
            tombstone: false,
            seq: u64::from(id),
        }
    }

    #[test]
    fn a_row_held_by_two_scopes_stays_until_both_remove_it() {
        let mut m = MemoryStore::new();
        m.commit(Transition {
            put: vec![holding("a", 1), holding("b", 1), holding("a", 2)],
            ..Transition::default()
        })
        .unwrap();
        m.commit(Transition {
            remove: vec![("a".into(), vec![1])],
            ..Transition::default()
        })
        .unwrap();
        assert_eq!(m.holdings("a").unwrap(), vec![holding("a", 2)]);
        assert_eq!(m.holdings("b").unwrap(), vec![holding("b", 1)]);
        m.commit(Transition {
            clear: vec!["b".into()],
            ..Transition::default()
        })
        .unwrap();
        assert!(m.holdings("b").unwrap().is_empty());
        assert_eq!(m.all_holdings().unwrap().len(), 1);
    }

    #[test]
    fn a_sealed_batch_takes_its_writes_out_of_the_queue_until_unsealed() {
        let mut m = MemoryStore::new();
        let w = |seq: u64, id: &str| QueuedWrite {
            seq,
            mutation_id: id.into(),
            mutation: "{}".into(),
        };
        m.commit(Transition {
            outbox: vec![
                OutboxChange::Queue(w(1, "m1")),
                OutboxChange::Queue(w(2, "m2")),
            ],
            ..Transition::default()
        })
        .unwrap();
        let batch = SealedBatch {
            batch_id: "b1".into(),
            body: b"{}".to_vec(),
            mutation_ids: vec!["m1".into()],
        };
        m.commit(Transition {
            outbox: vec![OutboxChange::Seal(batch.clone())],
            ..Transition::default()
        })
        .unwrap();
        assert_eq!(m.queued().unwrap(), vec![w(2, "m2")]);
        m.commit(Transition {
            outbox: vec![OutboxChange::Unseal {
                batch_id: "b1".into(),
            }],
            ..Transition::default()
        })
        .unwrap();
        assert_eq!(m.queued().unwrap().len(), 2);
        m.commit(Transition {
            outbox: vec![OutboxChange::Seal(batch)],
            ..Transition::default()
        })
        .unwrap();
        m.commit(Transition {
            outbox: vec![OutboxChange::Settle {
                batch_id: "b1".into(),
                outcomes: Vec::new(),
            }],
            ..Transition::default()
        })
        .unwrap();
        assert_eq!(m.queued().unwrap(), vec![w(2, "m2")]);
        assert!(m.sealed().unwrap().is_empty());
        let refused = m.commit(Transition {
            put: vec![holding("a", 9)],
            outbox: vec![OutboxChange::Settle {
                batch_id: "b1".into(),
                outcomes: Vec::new(),
            }],
            ..Transition::default()
        });
        assert!(refused.is_err(), "settling an unknown batch is refused");
        assert!(m.holdings("a").unwrap().is_empty(), "and changes nothing");
    }
}
