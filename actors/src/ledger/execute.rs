//! First execution: the locked row states, the writes (as one set when
//! they can be, else one by one), the end of an atomic group, and the
//! outcomes with their rows and checksums.

use std::collections::BTreeMap;

use protocol::digest::row_digest;
use protocol::error::ProtocolError;
use protocol::ids::ServerVersion;
use protocol::json::Value;
use protocol::value::PortableType;
use protocol::wire::RowImage;
use protocol::wire::push::{
    ConflictCode, ConflictState, Mutation, Operation, Outcome, OutcomeEntry, OutcomeHead,
    PushRequest, TerminalCode,
};

use super::contract::{self, FoundRow, Refusal, RowWrite, WriteResult, Writer};
use super::evaluate::{self, Decision, Planned, RowState, StateError};
use super::{Ledger, PushTable, Slot, integrity};
use crate::capture::source_text;
use crate::registry::store_error;
use crate::store::{Store, StoreTx};

/// What the locked row state says a mutation does.
enum Verdict {
    /// The matrix allows the write.
    Write,
    /// The outcome is decided without writing.
    Done(Box<Outcome>),
}

impl<S: Store> Ledger<S> {
    /// Evaluates and writes every mutation; `(fresh, outcome)` in request order.
    pub(super) async fn execute(
        &self,
        tx: &mut S::Tx,
        req: &PushRequest,
        writer: &Writer,
        slots: Vec<Slot>,
        server_time: &str,
    ) -> Result<Vec<(bool, OutcomeEntry)>, ProtocolError> {
        let head = |m: &Mutation| self.head(m);
        let mut outcomes: Vec<Option<Outcome>> = vec![None; slots.len()];
        let mut reused: Vec<Option<OutcomeEntry>> = vec![None; slots.len()];
        let mut planned = Vec::new();
        let mut failed_early = None;
        for (i, (slot, m)) in slots.into_iter().zip(&req.mutations).enumerate() {
            match slot {
                Slot::Reused(e) => reused[i] = Some(e),
                Slot::Early(e) => {
                    failed_early.get_or_insert(i);
                    outcomes[i] = Some(self.early_outcome(head(m), m, e));
                }
                Slot::Planned(p) => planned.push((i, p)),
            }
        }
        // An atomic group stops at its first failure in request order: an
        // early one, unless a mutation before it fails on its row first.
        let atomic_early = failed_early.filter(|_| req.atomic);
        if atomic_early.is_some() {
            planned.retain(|(i, _)| Some(*i) < atomic_early);
        }
        tx.begin_writes(writer).await.map_err(store_error)?;
        if req.atomic {
            tx.mark_group().await.map_err(store_error)?;
        }
        let mut rows = self.find(tx, planned.iter().map(|(_, p)| p)).await?;
        let mut failure = None;
        let together = match atomic_early {
            Some(_) => None, // the group fails anyway: find where, one by one
            None => {
                self.write_together(tx, req, &planned, &rows, writer, server_time)
                    .await?
            }
        };
        if let Some(done) = together {
            for (i, o) in done {
                outcomes[i] = Some(o);
            }
        } else {
            for (i, p) in &planned {
                let m = &req.mutations[*i];
                let outcome = self
                    .apply(tx, &mut rows, m, p, head(m), writer, server_time)
                    .await?;
                let ok = outcome.is_accepted();
                outcomes[*i] = Some(outcome);
                if req.atomic && !ok {
                    failure = Some(*i);
                    break;
                }
            }
            failure = failure.or(atomic_early);
        }
        if req.atomic
            && let Some(rejection) = self
                .finish_group(tx, req, &planned, &mut outcomes, failure, writer)
                .await?
        {
            return Ok(rejection);
        }
        tx.end_writes().await.map_err(store_error)?;
        outcomes
            .into_iter()
            .zip(reused)
            .map(|(o, r)| match (o, r) {
                (Some(o), None) => Ok((true, OutcomeEntry::from(&o))),
                (None, Some(r)) => Ok((false, r)),
                _ => Err(integrity("a mutation has no single outcome")),
            })
            .collect()
    }

    /// The fast path: when every planned mutation targets one table, names
    /// a distinct row, and (atomic or not) the row states decide their
    /// outcomes up front, all the writes go to the store as one set. The
    /// store applies all of them or none; on none, the caller takes the
    /// per-mutation path, which finds the exact failure. Writes of distinct
    /// rows do not depend on each other, so grouping them changes no outcome.
    async fn write_together(
        &self,
        tx: &mut S::Tx,
        req: &PushRequest,
        planned: &[(usize, Planned)],
        rows: &BTreeMap<(String, String), FoundRow>,
        writer: &Writer,
        server_time: &str,
    ) -> Result<Option<Vec<(usize, Outcome)>>, ProtocolError> {
        let Some((_, first)) = planned.first() else {
            return Ok(None);
        };
        let mut keys = std::collections::BTreeSet::new();
        let distinct = planned
            .iter()
            .all(|(_, p)| p.table_id == first.table_id && keys.insert(p.key.as_str()));
        if !distinct || planned.len() < FAST_PATH_MIN {
            return Ok(None);
        }
        let t = self.table(&first.table_id)?;
        let head = |m: &Mutation| self.head(m);
        let mut decided = Vec::new();
        let mut writes = Vec::new();
        for (i, p) in planned {
            let m = &req.mutations[*i];
            match self.evaluate_row(m, p, lookup(rows, p)?, head(m), writer)? {
                Verdict::Write => {
                    writes.push((*i, p, self.row_write(t, m, p, writer, server_time)))
                }
                // The group fails: the per-mutation path says where.
                Verdict::Done(_) if req.atomic => return Ok(None),
                Verdict::Done(outcome) => decided.push((*i, *outcome)),
            }
        }
        if writes.is_empty() {
            return Ok(Some(decided));
        }
        let batch: Vec<(String, RowWrite)> = writes
            .iter()
            .map(|(_, p, w)| (p.key.clone(), w.clone()))
            .collect();
        let Some(results) = tx
            .write_rows(&t.target, &batch)
            .await
            .map_err(store_error)?
        else {
            return Ok(None);
        };
        if results.len() != writes.len() {
            return Err(integrity("a set write answered another number of rows"));
        }
        for ((i, p, w), result) in writes.into_iter().zip(results) {
            let WriteResult::Written { row, version } = result else {
                return Err(integrity("a set write reported a row it did not write"));
            };
            let found = FoundRow {
                key: p.key.clone(),
                visible: row,
                version: Some(contract::VersionRecord {
                    deleted: matches!(w, RowWrite::Delete),
                    version,
                }),
            };
            decided.push((i, self.applied(head(&req.mutations[i]), p, &found)?));
        }
        Ok(Some(decided))
    }

    /// The end of an atomic group: the deferred check when everything
    /// applied (then every row as it stands after it), or the rollback and
    /// the rejection form when something failed.
    async fn finish_group(
        &self,
        tx: &mut S::Tx,
        req: &PushRequest,
        planned: &[(usize, Planned)],
        outcomes: &mut [Option<Outcome>],
        mut failure: Option<usize>,
        writer: &Writer,
    ) -> Result<Option<Vec<(bool, OutcomeEntry)>>, ProtocolError> {
        let head = |m: &Mutation| self.head(m);
        let last = req.mutations.len() - 1;
        if failure.is_none() {
            if let Some(refusal) = tx.check_constraints().await.map_err(store_error)? {
                outcomes[last] = Some(Outcome::Rejected {
                    head: head(&req.mutations[last]),
                    code: terminal(refusal),
                });
                failure = Some(last);
            } else {
                // Deferred triggers may have changed the rows: report them after the check.
                let found = self.find(tx, planned.iter().map(|(_, p)| p)).await?;
                for (i, p) in planned {
                    let f = lookup(&found, p)?;
                    let Some(Outcome::Applied { .. }) = outcomes[*i] else {
                        return Err(integrity("an atomic outcome is not applied"));
                    };
                    outcomes[*i] = Some(self.applied(head(&req.mutations[*i]), p, f)?);
                }
                return Ok(None);
            }
        }
        let Some(i) = failure else {
            return Ok(None);
        };
        tx.undo_group().await.map_err(store_error)?;
        let m = &req.mutations[i];
        let mut outcome = outcomes[i].take();
        if let Some(Outcome::Conflict { code, .. }) = &outcome
            && let Some((_, p)) = planned.iter().find(|(j, _)| *j == i)
        {
            // The conflict keeps its code and carries the committed state
            // after the rollback, as the writer sees it (a row a cascade of
            // the group deleted is live again).
            let found = self.find(tx, std::iter::once(p)).await?;
            let (state, wire) = self.observe(p, lookup(&found, p)?, writer)?;
            outcome = Some(conflict(head(m), *code, &state, wire)?);
        }
        tx.end_writes().await.map_err(store_error)?;
        Ok(Some(atomic_rejection(req, i, outcome, &head)))
    }

    /// Locks and reads the rows of these plans, table by table.
    async fn find<'p>(
        &self,
        tx: &mut S::Tx,
        plans: impl Iterator<Item = &'p Planned>,
    ) -> Result<BTreeMap<(String, String), FoundRow>, ProtocolError> {
        let mut keys: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for p in plans {
            keys.entry(p.table_id.as_str())
                .or_default()
                .push(p.key.clone());
        }
        let mut rows = BTreeMap::new();
        // Table and key order: concurrent pushes lock rows in one order.
        for (table_id, mut keys) in keys {
            keys.sort();
            keys.dedup();
            let t = self.table(table_id)?;
            for f in tx.find_rows(&t.target, &keys).await.map_err(store_error)? {
                rows.insert((table_id.to_owned(), f.key.clone()), f);
            }
        }
        Ok(rows)
    }

    /// Row-state evaluation and, when the matrix allows, the write.
    #[allow(clippy::too_many_arguments)]
    async fn apply(
        &self,
        tx: &mut S::Tx,
        rows: &mut BTreeMap<(String, String), FoundRow>,
        m: &Mutation,
        p: &Planned,
        head: OutcomeHead,
        writer: &Writer,
        server_time: &str,
    ) -> Result<Outcome, ProtocolError> {
        let t = self.table(&p.table_id)?;
        let found = lookup(rows, p)?;
        if let Verdict::Done(outcome) = self.evaluate_row(m, p, found, head.clone(), writer)? {
            return Ok(*outcome);
        }
        let row_write = self.row_write(t, m, p, writer, server_time);
        let result = tx
            .write_row(&t.target, &p.key, &row_write)
            .await
            .map_err(store_error)?;
        let rejected = |code| Outcome::Rejected {
            head: head.clone(),
            code,
        };
        let row_key = (p.table_id.clone(), p.key.clone());
        match result {
            WriteResult::Written { row, version } => {
                let f = FoundRow {
                    key: p.key.clone(),
                    visible: row,
                    version: Some(contract::VersionRecord {
                        deleted: matches!(row_write, RowWrite::Delete),
                        version,
                    }),
                };
                let outcome = self.applied(head.clone(), p, &f)?;
                rows.insert(row_key, f);
                Ok(outcome)
            }
            // Zero rows changed under the lock (row security or a BEFORE
            // trigger that returned NULL, or a row that an earlier write of
            // this push deleted by cascade), or another writer committed
            // this key meanwhile: judge the row as it stands now.
            WriteResult::Unchanged | WriteResult::Refused(Refusal::DuplicateKey) => {
                let found = self.find(tx, std::iter::once(p)).await?;
                let f = lookup(&found, p)?;
                let verdict = self.evaluate_row(m, p, f, head.clone(), writer)?;
                rows.insert(row_key, f.clone());
                Ok(match verdict {
                    Verdict::Done(outcome) => *outcome,
                    // The row stands as it was, so the source denied the
                    // write, or the key is taken by a row the writer cannot see.
                    Verdict::Write => rejected(TerminalCode::PolicyRejected),
                })
            }
            WriteResult::Refused(r) => Ok(rejected(terminal(r))),
        }
    }

    /// What the row state decides for a mutation.
    fn evaluate_row(
        &self,
        m: &Mutation,
        p: &Planned,
        found: &FoundRow,
        head: OutcomeHead,
        writer: &Writer,
    ) -> Result<Verdict, ProtocolError> {
        let (state, wire) = self.observe(p, found, writer)?;
        Ok(match evaluate::decide(&m.op, &state) {
            Decision::Write => Verdict::Write,
            Decision::PolicyRejected => Verdict::Done(Box::new(Outcome::Rejected {
                head,
                code: TerminalCode::PolicyRejected,
            })),
            Decision::Conflict(code) => {
                Verdict::Done(Box::new(conflict(head, code, &state, wire)?))
            }
        })
    }

    /// The row state of a found row as `writer` sees it, with its wire row.
    fn observe(
        &self,
        p: &Planned,
        found: &FoundRow,
        writer: &Writer,
    ) -> Result<(RowState, Option<(Value, RowImage)>), ProtocolError> {
        let t = self.table(&p.table_id)?;
        let wire = self.wire(t, found)?;
        let tombstone = wire.as_ref().is_some_and(|(w, _)| t.model.is_tombstone(w));
        let owned = match (&t.rules.owner, &wire) {
            (Some(owner), Some((w, _))) => {
                w.as_object()
                    .and_then(|o| o.get(owner))
                    .and_then(Value::as_str)
                    == Some(writer.user_id.as_str())
            }
            _ => true,
        };
        let state = evaluate::row_state(found, tombstone, owned).map_err(|e| match e {
            StateError::Unversioned => integrity("a registered row has no version"),
            StateError::BadVersion => integrity("a stored version is malformed"),
        })?;
        Ok((state, wire))
    }

    /// The applied outcome for the row as found after the write.
    fn applied(
        &self,
        head: OutcomeHead,
        p: &Planned,
        found: &FoundRow,
    ) -> Result<Outcome, ProtocolError> {
        let t = self.table(&p.table_id)?;
        let version = found
            .version
            .as_ref()
            .and_then(|v| ServerVersion::parse(&v.version))
            .ok_or_else(|| integrity("a written row has no version"))?;
        let row = match &found.visible {
            None => None,
            Some(_) => self.wire_at(t, found, &version)?.map(|(_, image)| image),
        };
        Ok(Outcome::Applied {
            head,
            server_version: version,
            row,
        })
    }

    /// The wire row and image of a visible row at its recorded version.
    fn wire(
        &self,
        t: &PushTable,
        found: &FoundRow,
    ) -> Result<Option<(Value, RowImage)>, ProtocolError> {
        let Some(v) = &found.version else {
            return Ok(None);
        };
        let version = ServerVersion::parse(&v.version)
            .ok_or_else(|| integrity("a stored version is malformed"))?;
        self.wire_at(t, found, &version)
    }

    fn wire_at(
        &self,
        t: &PushTable,
        found: &FoundRow,
        version: &ServerVersion,
    ) -> Result<Option<(Value, RowImage)>, ProtocolError> {
        let Some(image) = &found.visible else {
            return Ok(None);
        };
        let bad = || integrity("a source row cannot be represented in its manifest");
        let (wire, row) = t.model.wire_row(image, None).map_err(|_| bad())?;
        let key = image
            .get(&t.target.primary_key)
            .cloned()
            .flatten()
            .ok_or_else(bad)?;
        let (_, identity) = t.model.identity(&key).map_err(|_| bad())?;
        let checksum = row_digest(
            &self.current.hash(),
            &t.model.manifest,
            &identity,
            &row,
            version,
        );
        Ok(Some((
            wire.clone(),
            RowImage {
                row: wire,
                checksum,
            },
        )))
    }

    /// The source write of a mutation the matrix allows, with the server's lifecycle values.
    fn row_write(
        &self,
        t: &PushTable,
        m: &Mutation,
        p: &Planned,
        writer: &Writer,
        server_time: &str,
    ) -> RowWrite {
        let now = source_text::from_wire(PortableType::Datetime, &Value::string(server_time))
            .unwrap_or_default();
        let rules = &t.rules;
        let mut values = p.values.clone();
        let mut set = |column: Option<&str>, v: &str| {
            if let Some(c) = column
                && !values.iter().any(|(k, _)| k == c)
            {
                values.push((c.to_owned(), Some(v.to_owned())));
            }
        };
        match &m.op {
            Operation::Insert { .. } => {
                set(rules.timestamp_column(&rules.created_at), &now);
                set(rules.timestamp_column(&rules.updated_at), &now);
                // The declarative rule: the server fills an owner the client left out.
                set(rules.owner_column(), &writer.user_id);
                RowWrite::Insert { values }
            }
            Operation::Update { .. } => {
                set(rules.timestamp_column(&rules.updated_at), &now);
                RowWrite::Update { values }
            }
            Operation::Delete { .. } => match rules.timestamp_column(&rules.deleted_at) {
                Some(deleted_at) => {
                    set(Some(deleted_at), &now);
                    set(rules.timestamp_column(&rules.updated_at), &now);
                    RowWrite::Update { values }
                }
                None => RowWrite::Delete,
            },
        }
    }
}

/// A conflict with `code` carrying the row state as the writer sees it; a
/// live row that row security hides is `policy_rejected` instead.
fn conflict(
    head: OutcomeHead,
    code: ConflictCode,
    state: &RowState,
    wire: Option<(Value, RowImage)>,
) -> Result<Outcome, ProtocolError> {
    let state = match (state, wire) {
        (RowState::Hidden, _) => {
            return Ok(Outcome::Rejected {
                head,
                code: TerminalCode::PolicyRejected,
            });
        }
        (RowState::Visible { version, .. }, Some((_, image))) => ConflictState::Row {
            image,
            server_version: version.clone(),
        },
        (RowState::FenceOnly(version), _) => ConflictState::FenceOnly {
            server_version: version.clone(),
        },
        (RowState::Absent, _) => ConflictState::Absent,
        (RowState::Visible { .. }, None) => {
            return Err(integrity("a conflict without its row state"));
        }
    };
    Ok(Outcome::Conflict { head, code, state })
}

/// Batches with fewer planned writes take the per-mutation path directly.
const FAST_PATH_MIN: usize = 2;

/// The terminal code of a refused write.
fn terminal(r: Refusal) -> TerminalCode {
    match r {
        Refusal::Policy => TerminalCode::PolicyRejected,
        Refusal::Constraint | Refusal::DuplicateKey => TerminalCode::ValidationFailed,
    }
}

fn lookup<'r>(
    rows: &'r BTreeMap<(String, String), FoundRow>,
    p: &Planned,
) -> Result<&'r FoundRow, ProtocolError> {
    rows.get(&(p.table_id.clone(), p.key.clone()))
        .ok_or_else(|| integrity("a planned row was not found or reported absent"))
}

/// The atomic rejection form: the failing mutation keeps its outcome, every
/// other one is `atomic_batch_rejected` under the request schema.
fn atomic_rejection(
    req: &PushRequest,
    failing: usize,
    outcome: Option<Outcome>,
    head: &impl Fn(&Mutation) -> OutcomeHead,
) -> Vec<(bool, OutcomeEntry)> {
    req.mutations
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let o = match (&outcome, i == failing) {
                (Some(o), true) => o.clone(),
                _ => Outcome::Rejected {
                    head: head(m),
                    code: TerminalCode::AtomicBatchRejected,
                },
            };
            (true, OutcomeEntry::from(&o))
        })
        .collect()
}
