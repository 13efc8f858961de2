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
mod execute;
pub mod intake;

use std::collections::BTreeMap;
use std::sync::Arc;

use protocol::error::{ErrorKind, ProtocolError};
use protocol::fingerprint::{batch_fingerprint, mutation_fingerprint};
use protocol::ids::CanonicalUuid;
use protocol::json;
use protocol::manifest::Manifest;
use protocol::wire::format_server_time;
use protocol::wire::push::{
    Mutation, Outcome, OutcomeEntry, OutcomeHead, PushRequest, PushResponse, TerminalCode,
};

use self::contract::{LedgerEntries, PushRecord, StoredBatch, StoredMutation, WriteTarget, Writer};
use self::evaluate::{Early, Planned, TableRules};
use crate::admission::Admission;
use crate::config::SyncConfig;
use crate::materializer::{Model, Table};
use crate::registry::{SchemaHistory, next_counter, store_error};
use crate::reply::Reply;
use crate::store::{LedgerLookup, PushFrame, Store, StoreTx};

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
    admission: Arc<Admission>,
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
    pub fn new(
        store: S,
        config: &SyncConfig,
        history: SchemaHistory,
        admission: Arc<Admission>,
    ) -> Result<Ledger<S>, String> {
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
            admission,
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
        // 3. Structure, with every limit: read now so that the ledger is
        // asked in the same step as the binding (ADR 0031); judged after it.
        let request = parsed.and_then(PushRequest::from_value);
        let ids: Vec<_> = match &request {
            Ok(r) => r.mutations.iter().map(|m| m.mutation_id).collect(),
            Err(_) => Vec::new(),
        };
        let lookup = request.as_ref().ok().map(|r| LedgerLookup {
            batch_id: r.batch_id,
            mutation_ids: &ids,
        });
        let mut tx = self.store.begin().await.map_err(store_error)?;
        let frame = match &named {
            Some(client_id) => {
                (tx.push_frame(user_id, client_id, lookup).await).map_err(store_error)?
            }
            None => PushFrame {
                client: None,
                ledger: LedgerEntries::default(),
            },
        };
        let client = frame.client;
        if named.is_some() && client.as_ref().is_none_or(|c| c.user_id != user_id) {
            // A client that never connected, or one bound to another user.
            return Err(ProtocolError::new(ErrorKind::AuthRequired));
        }
        let req = request?;
        let Some(mut client) = client else {
            return Err(ProtocolError::new(ErrorKind::AuthRequired));
        };
        // 4. Retirement.
        if client.retired {
            return Err(ProtocolError::new(ErrorKind::ClientRetired));
        }
        // 5. Completed batch and mutation replay.
        let fingerprint = batch_fingerprint(user_id, &req.client_id, &req);
        let entries = frame.ledger;
        if let Some(batch) = entries.batch {
            if batch.fingerprint != fingerprint {
                return Err(ProtocolError::new(ErrorKind::IdempotencyConflict));
            }
            return Ok(Reply {
                status: batch.status,
                body: batch.body,
                retry_after: None,
                // A stored answer, replayed: counted by its status only.
                code: None,
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
        // 3, against the schema just gated.
        self.check_typed_keys(&req, &reused)?;
        // 8. Admission control: the user's mutation rate.
        self.admission
            .admit_push(user_id, req.mutations.len(), now_micros)?;
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
            check_each_write: !req.atomic,
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
        // A push closes the replay of the client's first connect.
        let first_use = !client.continued;
        client.continued = true;
        if applied {
            client.accepted_write_epoch = next_counter(client.accepted_write_epoch)?;
        }
        (tx.complete_push(&record, (applied || first_use).then_some(&client)))
            .await
            .map_err(store_error)?;
        tx.commit().await.map_err(store_error)?;
        Ok(Reply::ok(body))
    }

    /// Structure that needs the schema: every first-execution key of a known
    /// table is a canonical value of its key's type, else the request is 400.
    fn check_typed_keys<E>(
        &self,
        req: &PushRequest,
        reused: &BTreeMap<CanonicalUuid, E>,
    ) -> Result<(), ProtocolError> {
        let invalid = req.mutations.iter().any(|m| {
            !reused.contains_key(&m.mutation_id)
                && !evaluate::typed_key_is_valid(
                    m,
                    &self.history,
                    self.tables.get(&m.table).map(|t| &t.rules),
                )
        });
        if invalid {
            return Err(ProtocolError::invalid_request(
                "a primary key is not a canonical value of its field's type",
            ));
        }
        Ok(())
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

    fn table(&self, table_id: &str) -> Result<&PushTable, ProtocolError> {
        self.tables
            .get(table_id)
            .ok_or_else(|| integrity("a planned mutation names an unknown table"))
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

fn integrity(message: &'static str) -> ProtocolError {
    tracing::error!(reason = message, "push integrity failure");
    ProtocolError::new(ErrorKind::SyncIntegrityFailure)
}
