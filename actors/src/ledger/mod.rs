//! The ledger: the whole push contract. Dispatch in the spec's precedence
//! (bind, structure, retirement, replay lookup, generation and schema
//! gates), then a first execution in one store transaction: source writes
//! under row locks as the pushing user, outcomes, the response bytes and the
//! client's `accepted_write_epoch`. Push never makes anything pull-visible;
//! the version trigger leaves the fences that capture satisfies.
//!
//! Pushes of one client serialize on the client row lock, so one batch
//! identity executes once: a concurrent duplicate waits, then replays.

pub mod contract;
pub mod evaluate;

use std::collections::BTreeMap;
use std::sync::Arc;

use protocol::digest::row_digest;
use protocol::error::{ErrorKind, ProtocolError};
use protocol::fingerprint::{batch_fingerprint, mutation_fingerprint};
use protocol::ids::ServerVersion;
use protocol::json::{self, Value};
use protocol::manifest::Manifest;
use protocol::value::PortableType;
use protocol::wire::push::{
    ConflictState, Mutation, Operation, Outcome, OutcomeEntry, OutcomeHead, PushRequest,
    PushResponse, TerminalCode,
};
use protocol::wire::{RowImage, format_server_time};

use self::contract::{
    FoundRow, PushRecord, Refusal, RowWrite, StoredBatch, StoredMutation, WriteResult, WriteTarget,
    Writer,
};
use self::evaluate::{Decision, Early, Planned, RowState, StateError, TableRules};
use crate::capture::source_text;
use crate::config::SyncConfig;
use crate::engine::Reply;
use crate::materializer::{Model, Table};
use crate::registry::{SchemaHistory, next_counter, store_error};
use crate::store::{Store, StoreTx};

/// A registered table as push sees it.
struct PushTable {
    target: WriteTarget,
    rules: TableRules,
    /// The capture model's view: wire rows and identities from source text.
    model: Table,
}

/// The ledger's state: the schema history and the registered tables.
pub struct Ledger<S: Store> {
    store: S,
    history: SchemaHistory,
    current: Arc<Manifest>,
    tables: BTreeMap<String, PushTable>,
}

/// The write targets of a config, for `Store::install_push`.
pub fn write_targets(config: &SyncConfig) -> Vec<WriteTarget> {
    config
        .tables
        .iter()
        .map(|t| WriteTarget {
            table_id: t.table_id.clone(),
            relation: t.relation.clone(),
            primary_key: t.primary_key.clone(),
            columns: t.fields.iter().map(|f| f.column.clone()).collect(),
            not_null: t
                .fields
                .iter()
                .filter(|f| !f.nullable)
                .map(|f| f.column.clone())
                .collect(),
        })
        .collect()
}

/// What the locked row state says a mutation does.
enum Verdict {
    /// The matrix allows the write.
    Write,
    /// The outcome is decided without writing.
    Done(Box<Outcome>),
}

/// One mutation's place in a first execution.
enum Slot {
    /// Completed in an earlier batch: its stored outcome, byte for byte.
    Reused(OutcomeEntry),
    /// Decided without a row.
    Early(Early),
    /// Waits for the row state.
    Planned(Planned),
}

impl<S: Store> Ledger<S> {
    /// A ledger over `store` for the config whose manifests `history` holds.
    pub fn new(store: S, config: &SyncConfig, history: SchemaHistory) -> Result<Ledger<S>, String> {
        let current = history.current().cloned().ok_or("no manifest")?;
        let model = Model::new(config, (*current).clone())?;
        let mut tables = BTreeMap::new();
        for (t, target) in config.tables.iter().zip(write_targets(config)) {
            let model = model
                .table(&t.table_id)
                .cloned()
                .ok_or_else(|| format!("table {} has no model", t.table_id))?;
            let field = |c: &Option<String>| {
                c.as_deref()
                    .and_then(|c| t.field_id_of(c))
                    .map(str::to_owned)
            };
            let rules = TableRules {
                manifest: model.manifest.clone(),
                columns: t
                    .fields
                    .iter()
                    .map(|f| (f.field_id.clone(), f.column.clone()))
                    .collect(),
                owner: field(&t.owner_column),
                created_at: field(&t.lifecycle.created_at),
                updated_at: field(&t.lifecycle.updated_at),
                deleted_at: field(&t.lifecycle.deleted_at),
            };
            tables.insert(
                t.table_id.clone(),
                PushTable {
                    target,
                    rules,
                    model,
                },
            );
        }
        Ok(Ledger {
            store,
            history,
            current,
            tables,
        })
    }

    /// `/sync/push` for the authenticated `user_id`, at server time `now_micros`.
    pub async fn push(&self, user_id: &str, body: &[u8], now_micros: i64) -> Reply {
        match self.dispatch(user_id, body, now_micros).await {
            Ok(reply) => reply,
            Err(e) => Reply::error(&e),
        }
    }

    async fn dispatch(
        &self,
        user_id: &str,
        body: &[u8],
        now_micros: i64,
    ) -> Result<Reply, ProtocolError> {
        // 1. Bind client_id to the user. A body that is not JSON has no client to bind.
        let parsed = protocol::wire::parse_body(body);
        let named = parsed
            .as_ref()
            .ok()
            .and_then(protocol::wire::client_id_member)
            .map(str::to_owned);
        let mut tx = self.store.begin().await.map_err(store_error)?;
        let client = match &named {
            Some(client_id) => tx.lock_client(client_id).await.map_err(store_error)?,
            None => None,
        };
        if named.is_some() && client.as_ref().is_none_or(|c| c.user_id != user_id) {
            // A client that never connected, or one bound to another user.
            return Err(ProtocolError::new(ErrorKind::AuthRequired));
        }
        // 3. Structure, with every limit.
        let req = PushRequest::from_value(parsed?)?;
        let Some(mut client) = client else {
            return Err(ProtocolError::new(ErrorKind::AuthRequired));
        };
        // 4. Retirement.
        if client.retired {
            return Err(ProtocolError::new(ErrorKind::ClientRetired));
        }
        // 5. Completed batch and mutation replay.
        let fingerprint = batch_fingerprint(user_id, &req.client_id, &req);
        let ids: Vec<_> = req.mutations.iter().map(|m| m.mutation_id).collect();
        let entries = tx
            .push_ledger(user_id, &req.client_id, req.batch_id, &ids)
            .await
            .map_err(store_error)?;
        if let Some(batch) = entries.batch {
            if batch.fingerprint != fingerprint {
                return Err(ProtocolError::new(ErrorKind::IdempotencyConflict));
            }
            return Ok(Reply {
                status: batch.status,
                body: batch.body,
                retry_after: None,
            });
        }
        let mut reused = BTreeMap::new();
        for stored in &entries.mutations {
            let m = req
                .mutations
                .iter()
                .find(|m| m.mutation_id == stored.mutation_id)
                .ok_or_else(|| integrity("the ledger answered an identity not asked for"))?;
            if stored.fingerprint != mutation_fingerprint(user_id, &req.client_id, m) {
                return Err(ProtocolError::new(ErrorKind::IdempotencyConflict));
            }
            let entry = json::parse(&stored.outcome)
                .ok()
                .and_then(OutcomeEntry::from_stored)
                .ok_or_else(|| integrity("a stored outcome is unreadable"))?;
            reused.insert(stored.mutation_id, entry);
        }
        if !reused.is_empty() && req.atomic {
            return Err(ProtocolError::invalid_request(
                "an atomic batch reuses a mutation completed in another batch",
            ));
        }
        if reused
            .values()
            .any(|e| e.code() == Some(TerminalCode::AtomicBatchRejected.as_str()))
        {
            return Err(ProtocolError::invalid_request(
                "a mutation rejected with its atomic batch cannot be reused",
            ));
        }
        // 6. The generation gate, then the schema gate.
        if req.client_generation != client.generation {
            return Err(ProtocolError::new(ErrorKind::ClientGenerationExpired {
                current_client_generation: client.generation,
            }));
        }
        if req.schema != self.current.reference() {
            return Err(ProtocolError::new(ErrorKind::SchemaMismatch {
                current_schema: self.current.reference(),
                received_schema: req.schema,
            }));
        }
        // 9. First execution.
        let server_time = format_server_time(now_micros);
        let slots = req
            .mutations
            .iter()
            .map(|m| match reused.remove(&m.mutation_id) {
                Some(entry) => Slot::Reused(entry),
                None => match evaluate::early(
                    m,
                    user_id,
                    &self.history,
                    self.tables.get(&m.table).map(|t| &t.rules),
                ) {
                    Ok(p) => Slot::Planned(p),
                    Err(e) => Slot::Early(e),
                },
            })
            .collect::<Vec<_>>();
        let writer = Writer {
            user_id: user_id.to_owned(),
            client_id: req.client_id.clone(),
            immediate_constraints: !req.atomic,
        };
        let outcomes = self
            .execute(&mut tx, &req, &writer, slots, &server_time)
            .await?;
        let applied = outcomes.iter().any(|(fresh, e)| *fresh && e.is_accepted());
        let response = PushResponse::from_entries(
            &req,
            server_time,
            outcomes.iter().map(|(_, e)| e.clone()).collect(),
        )
        .map_err(|_| integrity("the outcomes do not partition the batch"))?;
        let body = response.to_body();
        let record = PushRecord {
            user_id: user_id.to_owned(),
            client_id: req.client_id.clone(),
            batch: StoredBatch {
                batch_id: req.batch_id,
                fingerprint,
                status: 200,
                body: body.clone(),
            },
            mutations: req
                .mutations
                .iter()
                .zip(&outcomes)
                .filter(|(_, (fresh, _))| *fresh)
                .map(|(m, (_, e))| StoredMutation {
                    mutation_id: m.mutation_id,
                    batch_id: req.batch_id,
                    fingerprint: mutation_fingerprint(user_id, &req.client_id, m),
                    outcome: json::to_canonical(e.object()),
                })
                .collect(),
        };
        tx.record_push(&record).await.map_err(store_error)?;
        if applied {
            client.accepted_write_epoch = next_counter(client.accepted_write_epoch)?;
            tx.put_client(&client).await.map_err(store_error)?;
        }
        tx.commit().await.map_err(store_error)?;
        Ok(Reply::ok(body))
    }

    /// Evaluates and writes every mutation; `(fresh, outcome)` in request order.
    async fn execute(
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

    /// The identity a first-execution outcome echoes, under the current schema.
    fn head(&self, m: &Mutation) -> OutcomeHead {
        OutcomeHead {
            mutation_id: m.mutation_id,
            table: m.table.clone(),
            pk: m.pk.clone(),
            outcome_schema: self.current.reference(),
        }
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
        if let Some(Outcome::Conflict { .. }) = outcome
            && let Some((_, p)) = planned.iter().find(|(j, _)| *j == i)
        {
            // The committed state after the rollback, as the writer sees it.
            let found = self.find(tx, std::iter::once(p)).await?;
            let f = lookup(&found, p)?;
            if let Verdict::Done(o) = self.evaluate_row(m, p, f, head(m), writer)? {
                outcome = Some(*o);
            }
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

    fn table(&self, table_id: &str) -> Result<&PushTable, ProtocolError> {
        self.tables
            .get(table_id)
            .ok_or_else(|| integrity("a planned mutation names an unknown table"))
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
            WriteResult::Unchanged => Ok(rejected(TerminalCode::PolicyRejected)),
            WriteResult::Refused(Refusal::DuplicateKey) => {
                // Another writer committed this key meanwhile: judge it as it stands now.
                let found = self.find(tx, std::iter::once(p)).await?;
                let f = lookup(&found, p)?;
                let verdict = self.evaluate_row(m, p, f, head.clone(), writer)?;
                rows.insert(row_key, f.clone());
                Ok(match verdict {
                    Verdict::Done(outcome) => *outcome,
                    // The key is taken by a row the writer cannot see.
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
        Ok(match evaluate::decide(&m.op, &state) {
            Decision::Write => Verdict::Write,
            Decision::PolicyRejected => Verdict::Done(Box::new(Outcome::Rejected {
                head,
                code: TerminalCode::PolicyRejected,
            })),
            Decision::Conflict(code) => {
                let conflict_state = match (&state, wire) {
                    (RowState::Visible { version, .. }, Some((_, image))) => ConflictState::Row {
                        image,
                        server_version: version.clone(),
                    },
                    (RowState::FenceOnly(version), _) => ConflictState::FenceOnly {
                        server_version: version.clone(),
                    },
                    (RowState::Absent, _) => ConflictState::Absent,
                    _ => return Err(integrity("a conflict without its row state")),
                };
                Verdict::Done(Box::new(Outcome::Conflict {
                    head,
                    code,
                    state: conflict_state,
                }))
            }
        })
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

    fn early_outcome(&self, head: OutcomeHead, m: &Mutation, e: Early) -> Outcome {
        let code = match e {
            Early::SchemaIncompatible(ids) => {
                return Outcome::SchemaIncompatible {
                    head,
                    authored_schema: m.authored_schema,
                    current_schema: self.current.reference(),
                    incompatible_field_ids: ids,
                };
            }
            Early::TableNotSynced => TerminalCode::TableNotSynced,
            Early::PolicyRejected => TerminalCode::PolicyRejected,
            Early::ValidationFailed => TerminalCode::ValidationFailed,
        };
        Outcome::Rejected { head, code }
    }
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

fn integrity(message: &'static str) -> ProtocolError {
    tracing::error!(reason = message, "push integrity failure");
    ProtocolError::new(ErrorKind::SyncIntegrityFailure)
}
