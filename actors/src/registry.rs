//! The scope-registry actor: schema manifests and their lineage, client
//! generations, authoritative scope assignment, and connect.
//!
//! Every connect runs in one store transaction that locks the client row,
//! so concurrent connects of one client serialize and a failed connect
//! writes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use protocol::error::{ErrorKind, ProtocolError};
use protocol::ids::ScopeId;
use protocol::json::{self, Value};
use protocol::limits::MAX_SAFE_INTEGER;
use protocol::manifest::{Manifest, SchemaRef, TableManifest, TransitionClass};
use protocol::wire::connect::{
    AffectedScopes, ConnectRequest, ConnectResponse, ConnectSchema, SchemaAction, UnsupportedReason,
};
use protocol::wire::{AssignmentDelta, format_server_time};

use crate::capture::CaptureHealth;
use crate::config::{MembershipRule, ScopeTemplate, SyncConfig};
use crate::cursor::{self, CursorContext};
use crate::store::{ClientRecord, Store, StoreError, StoreTx};
use crate::stream::{
    MembershipLineage, MembershipRules, reconcile_membership, reconcile_rematerializations,
};
use protocol::token::KeyRing;

use crate::key_ring::{Refresh, SharedKeyRing};

/// What one schema transition changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    pub class: TransitionClass,
    /// Tables whose rows must be rematerialized (class 3 changes).
    pub rematerialized: BTreeSet<String>,
}

/// The transition class from `old` tables to `new` tables (docs/adr/0003).
pub fn classify(old: &[TableManifest], new: &[TableManifest]) -> Transition {
    let mut class = TransitionClass::Initial;
    let mut rematerialized = BTreeSet::new();
    let mut raise = |c: TransitionClass| class = class.max(c);
    for o in old {
        if !new.iter().any(|n| n.table_id() == o.table_id()) {
            raise(TransitionClass::Class4); // a table disappeared
        }
    }
    for n in new {
        let Some(o) = old.iter().find(|o| o.table_id() == n.table_id()) else {
            raise(TransitionClass::Class2); // a new, empty table
            continue;
        };
        if o.relation_id() != n.relation_id()
            || o.primary_key_field_id() != n.primary_key_field_id()
        {
            raise(TransitionClass::Class4); // identity changed
        }
        for of in o.fields() {
            match n.field(of.field_id()) {
                None => raise(TransitionClass::Class4), // removed field
                Some(nf) if nf.field_type() != of.field_type() => raise(TransitionClass::Class4), // retyped
                Some(nf) if nf.writable() != of.writable() || nf.name() != of.name() => {
                    raise(TransitionClass::Class2)
                }
                Some(_) => {}
            }
        }
        for nf in n.fields() {
            if o.field(nf.field_id()).is_none() {
                if nf.field_type().nullable {
                    raise(TransitionClass::Class2); // rows stay valid with null
                } else {
                    raise(TransitionClass::Class3);
                    rematerialized.insert(n.table_id().to_owned());
                }
            }
        }
        if o.lifecycle() != n.lifecycle() || o.composition() != n.composition() {
            raise(TransitionClass::Class3);
            rematerialized.insert(n.table_id().to_owned());
        }
        if o.name() != n.name() {
            raise(TransitionClass::Class2);
        }
    }
    Transition {
        class,
        rematerialized,
    }
}

/// The immutable manifests in version order, with each transition.
#[derive(Clone, Debug)]
pub struct SchemaHistory {
    manifests: Vec<Arc<Manifest>>,
    /// `transitions[i]` leads from `manifests[i]` to `manifests[i + 1]`.
    transitions: Vec<Transition>,
}

/// Where a client's installed schema stands relative to the current one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lineage {
    Current,
    Unknown,
    /// The greatest class along the path and the tables to rematerialize.
    Known(Transition),
}

impl SchemaHistory {
    /// A history from stored manifests (ascending versions, each the parent of the next).
    pub fn new(manifests: Vec<Manifest>) -> Result<SchemaHistory, StoreError> {
        let manifests: Vec<Arc<Manifest>> = manifests.into_iter().map(Arc::new).collect();
        for w in manifests.windows(2) {
            if w[1].parent_schema() != Some(w[0].reference()) {
                return Err(StoreError::Integrity(
                    "stored manifests do not form one lineage".into(),
                ));
            }
        }
        let transitions = manifests
            .windows(2)
            .map(|w| classify(w[0].tables(), w[1].tables()))
            .collect();
        Ok(SchemaHistory {
            manifests,
            transitions,
        })
    }

    /// The current manifest.
    pub fn current(&self) -> Option<&Arc<Manifest>> {
        self.manifests.last()
    }

    /// The stored manifest with this reference.
    pub fn find(&self, r: &SchemaRef) -> Option<&Arc<Manifest>> {
        self.manifests.iter().find(|m| m.reference() == *r)
    }

    /// Whether any stored manifest has (or had) this table.
    pub fn ever_had_table(&self, table_id: &str) -> bool {
        self.manifests.iter().any(|m| m.table(table_id).is_some())
    }

    /// The lineage of `r` to the current manifest.
    pub fn lineage(&self, r: &SchemaRef) -> Lineage {
        let Some(i) = self.manifests.iter().position(|m| m.reference() == *r) else {
            return Lineage::Unknown;
        };
        if i + 1 == self.manifests.len() {
            return Lineage::Current;
        }
        let mut path = Transition {
            class: TransitionClass::Initial,
            rematerialized: BTreeSet::new(),
        };
        for t in &self.transitions[i..] {
            path.class = path.class.max(t.class);
            path.rematerialized.extend(t.rematerialized.iter().cloned());
        }
        Lineage::Known(path)
    }
}

/// What a config makes of the data, as one digest: its tables' manifest,
/// each captured relation's model (fields, types, rules) and its
/// assignment. Built from the config's own values in canonical JSON, so
/// that one config has one fingerprint under every version of the server.
pub fn config_fingerprint(config: &SyncConfig) -> Result<String, RegistryError> {
    let tables = config
        .table_manifests()
        .map_err(|e| RegistryError::Config(e.0))?;
    let manifest = Manifest::new(1, None, TransitionClass::Initial, 1, tables)
        .map_err(|e| RegistryError::Config(e.0.into()))?;
    let capture = crate::capture::model_fingerprints(config)
        .into_iter()
        .map(|(relation, model)| (relation, Value::string(model)));
    let a = &config.assignment;
    let text = |s: &str| Value::string(s);
    // Order in the file is not meaning: both lists are compared as sets.
    let dependencies: BTreeSet<[&str; 4]> = (a.dependency.iter())
        .map(|d| [&*d.relation, &*d.user_column, &*d.value_column, &*d.scope])
        .collect();
    let dependencies = dependencies
        .into_iter()
        .map(|d| Value::Array(d.into_iter().map(text).collect()));
    let shared: BTreeSet<&String> = a.shared.iter().collect();
    let assignment = json::object([
        ("user_scope", text(&a.user_scope)),
        (
            "shared",
            Value::Array(shared.into_iter().map(|s| text(s)).collect()),
        ),
        ("grants", Value::Bool(a.grants)),
        ("dependency", Value::Array(dependencies.collect())),
    ]);
    let v = json::object([
        ("tables", Value::string(manifest.hash().to_hex())),
        ("capture", Value::Object(capture.collect())),
        ("assignment", assignment),
    ]);
    let digest =
        protocol::sha256::Digest::of("synchro config fingerprint", &json::to_canonical(&v));
    Ok(digest.to_hex())
}

/// Refuses a config that a newer one replaced (ADR 0020 §8): a process of
/// an older deploy, restarted, would bring its schema and rules back over
/// the newer ones, and re-read and reset clients each time the two
/// alternate. `roll_back` (the operator's `--roll-back`) returns to it on
/// purpose. Records the config as the newest. Runs in the caller's transaction.
pub async fn reconcile_config<T: StoreTx>(
    tx: &mut T,
    config: &SyncConfig,
    roll_back: bool,
) -> Result<(), RegistryError> {
    let fingerprint = config_fingerprint(config)?;
    let applied = tx.applied_configs().await?;
    match applied.iter().position(|f| *f == fingerprint) {
        Some(i) if i + 1 == applied.len() => return Ok(()),
        Some(i) if !roll_back => {
            return Err(RegistryError::Replaced {
                newer: applied.len() - i - 1,
            });
        }
        _ => {}
    }
    tx.apply_config(&fingerprint).await?;
    Ok(())
}

/// Brings the stored history up to the config: appends a manifest when the
/// config's tables differ from the current one. Runs in the caller's transaction.
pub async fn reconcile_schema<T: StoreTx>(
    tx: &mut T,
    config: &SyncConfig,
) -> Result<SchemaHistory, RegistryError> {
    let tables = config
        .table_manifests()
        .map_err(|e| RegistryError::Config(e.0))?;
    let stored = tx.manifests().await?;
    check_id_reuse(&stored, &tables).map_err(RegistryError::Config)?;
    let next = match stored.last() {
        None => Some(Manifest::new(1, None, TransitionClass::Initial, 1, tables)),
        Some(last) if last.tables() == tables.as_slice() => None,
        Some(last) => {
            let t = classify(last.tables(), &tables);
            if t.class == TransitionClass::Initial {
                None // only ordering differed
            } else {
                let version = last.schema_version() + 1;
                let floor = if t.class == TransitionClass::Class4 {
                    version
                } else {
                    last.compatibility_floor()
                };
                Some(Manifest::new(
                    version,
                    Some(last.reference()),
                    t.class,
                    floor,
                    tables,
                ))
            }
        }
    };
    let mut manifests = stored;
    if let Some(m) = next {
        let m = m.map_err(|e| RegistryError::Config(e.0.into()))?;
        tx.insert_manifest(&m).await?;
        // A table the new manifest drops is forgotten with it (ADR 0020):
        // a removal is class 4, so every client rebuilds without it.
        if let Some(last) = manifests.last() {
            for t in last.tables() {
                if m.table(t.table_id()).is_none() {
                    tx.forget_table(t.table_id()).await?;
                }
            }
        }
        manifests.push(m);
    }
    Ok(SchemaHistory::new(manifests)?)
}

/// Logical IDs are immutable: a table ID keeps its relation ID, and an ID
/// that was removed never comes back. A field ID names a field within its
/// table (every wire object that holds field IDs names its table), so two
/// tables may each have an `id` (ADR 0016).
pub fn check_id_reuse(history: &[Manifest], tables: &[TableManifest]) -> Result<(), String> {
    let Some(last) = history.last() else {
        return Ok(());
    };
    for t in tables {
        for m in history {
            for old in m.tables() {
                let v = m.schema_version();
                if old.table_id() == t.table_id() && old.relation_id() != t.relation_id() {
                    return Err(format!(
                        "table {}: schema version {v} bound it to relation_id {}; IDs are never reused",
                        t.table_id(),
                        old.relation_id()
                    ));
                }
                if old.table_id() != t.table_id() && old.relation_id() == t.relation_id() {
                    return Err(format!(
                        "table {}: relation_id {} belonged to table {} in schema version {v}; IDs are never reused",
                        t.table_id(),
                        t.relation_id(),
                        old.table_id()
                    ));
                }
            }
        }
        // A removed table or field must not return.
        let was_removed = |present_now: &dyn Fn(&Manifest) -> bool| {
            let first = history.iter().position(present_now);
            first.is_some_and(|i| history[i..].iter().any(|m| !present_now(m)))
        };
        if was_removed(&|m: &Manifest| m.table(t.table_id()).is_some()) {
            return Err(format!(
                "table {}: the table ID was removed earlier; IDs are never reused",
                t.table_id()
            ));
        }
        for f in t.fields() {
            let has = |m: &Manifest| {
                m.table(t.table_id())
                    .is_some_and(|o| o.field(f.field_id()).is_some())
            };
            let had_and_lost = was_removed(&has) || (history.iter().any(has) && !has(last));
            if had_and_lost {
                return Err(format!(
                    "table {}, field {}: the field ID was removed earlier; IDs are never reused",
                    t.table_id(),
                    f.field_id()
                ));
            }
        }
    }
    Ok(())
}

/// Why the registry could not start.
#[derive(Debug)]
pub enum RegistryError {
    Config(String),
    /// The config is one that `newer` configs applied since replaced.
    Replaced {
        newer: usize,
    },
    Store(StoreError),
}

impl From<StoreError> for RegistryError {
    fn from(e: StoreError) -> Self {
        RegistryError::Store(e)
    }
}

impl std::fmt::Display for RegistryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistryError::Config(m) => write!(f, "config: {m}"),
            RegistryError::Replaced { newer } => write!(
                f,
                "config: this config was replaced by a newer one ({newer} applied since), \
                 and a process of an older deploy must not bring it back; \
                 start with the newest config, or pass --roll-back to return to this one on purpose"
            ),
            RegistryError::Store(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for RegistryError {}

/// Maps a store failure to the protocol error a client sees.
pub(crate) fn store_error(e: StoreError) -> ProtocolError {
    // Store messages are built from error codes and our own text, never from row values.
    tracing::warn!(error = %e, "store operation failed");
    match e {
        StoreError::Unavailable(_) => {
            ProtocolError::new(ErrorKind::TemporaryUnavailable { reason: None })
        }
        // Identities and keys are the only request values read or written
        // outside a source write (whose refusals are outcomes): a retry of
        // the same request can never succeed.
        StoreError::Data(_) => {
            ProtocolError::invalid_request("a request identity or key cannot be stored")
        }
        StoreError::Integrity(_) => ProtocolError::new(ErrorKind::SyncIntegrityFailure),
    }
}

/// Each registered relation's scope templates, over the rules' whole history.
fn rule_templates(
    config: &SyncConfig,
    history: &[MembershipRules],
) -> BTreeMap<String, Vec<ScopeTemplate>> {
    let mut out: BTreeMap<String, Vec<ScopeTemplate>> = BTreeMap::new();
    for t in &config.tables {
        let templates = history
            .iter()
            .filter(|r| r.table_id == t.table_id)
            .flat_map(|r| &r.templates)
            .filter_map(|s| ScopeTemplate::parse(s).ok());
        out.entry(t.relation.clone()).or_default().extend(templates);
    }
    out
}

/// The registry's state: config, schema history and the store.
pub struct Registry<S: Store> {
    store: S,
    config: SyncConfig,
    history: SchemaHistory,
    current: Arc<Manifest>,
    membership: MembershipLineage,
    /// Registered relation -> every scope template its rules ever had.
    templates: BTreeMap<String, Vec<ScopeTemplate>>,
    keys: SharedKeyRing,
    minimum_client_version: Option<semver::Version>,
}

impl<S: Store> Registry<S> {
    /// Loads the history, appending the config's manifest when it changed.
    pub async fn load(store: S, config: SyncConfig) -> Result<Registry<S>, RegistryError> {
        let mut tx = store.begin().await?;
        reconcile_config(&mut tx, &config, config.roll_back).await?;
        let history = reconcile_schema(&mut tx, &config).await?;
        let membership = reconcile_membership(&mut tx, &config).await?;
        reconcile_rematerializations(&mut tx, &config).await?;
        let templates = rule_templates(&config, &tx.membership_rules().await?);
        tx.commit().await?;
        let keys = SharedKeyRing::load(&store).await?;
        let current = history
            .current()
            .cloned()
            .ok_or(RegistryError::Config("no manifest".into()))?;
        let minimum_client_version = match &config.server.minimum_client_version {
            Some(v) => {
                Some(semver::Version::parse(v).map_err(|e| RegistryError::Config(e.to_string()))?)
            }
            None => None,
        };
        Ok(Registry {
            store,
            config,
            history,
            current,
            membership,
            templates,
            keys,
            minimum_client_version,
        })
    }

    /// Whether `scope` may hold rows of a relation still being
    /// rematerialized (ADR 0020): a template of the relation's rules, now or
    /// before, could produce it.
    pub fn rematerializing(&self, relations: &BTreeSet<String>, scope: &ScopeId) -> bool {
        relations.iter().any(|r| {
            self.templates
                .get(r)
                .is_some_and(|ts| ts.iter().any(|t| t.could_produce(scope.as_str())))
        })
    }

    /// The token keys every process shares, as this process last read them.
    pub fn keys(&self) -> Arc<KeyRing> {
        self.keys.get()
    }

    /// Reloads the token keys when `why` says it is due (ADR 0025); whether
    /// they changed.
    pub async fn refresh_keys(&self, why: Refresh) -> bool {
        self.keys.refresh(&self.store, why).await
    }

    /// The membership generation of each scope.
    pub fn membership(&self) -> &MembershipLineage {
        &self.membership
    }

    /// The current manifest.
    pub fn current(&self) -> &Arc<Manifest> {
        &self.current
    }

    /// The schema history this registry serves.
    pub fn history(&self) -> &SchemaHistory {
        &self.history
    }

    /// Capture as the shared heartbeat reports it; `None` when the store
    /// does not answer.
    pub async fn capture_health(&self) -> Option<CaptureHealth> {
        let mut tx = self.store.begin().await.ok()?;
        let health = tx.capture_health().await.ok()?;
        tx.commit().await.ok()?;
        Some(health)
    }

    /// `/sync/connect` for the authenticated `user_id`, at server time `now_micros`.
    pub async fn connect(
        &self,
        user_id: &str,
        body: &[u8],
        now_micros: i64,
    ) -> Result<ConnectResponse, ProtocolError> {
        self.refresh_keys(Refresh::Due).await;
        // A first connect that lost the race to bind its new client_id runs
        // once more: it then finds the winner's binding and is judged by it.
        for _ in 0..2 {
            if let Some(r) = self.connect_once(user_id, body, now_micros).await? {
                return Ok(r);
            }
        }
        // The binding that won was gone again: a retry starts over.
        Err(ProtocolError::new(ErrorKind::TemporaryUnavailable {
            reason: None,
        }))
    }

    /// One attempt in one transaction; `None` when another connect bound
    /// the new client_id first (this one then wrote nothing).
    async fn connect_once(
        &self,
        user_id: &str,
        body: &[u8],
        now_micros: i64,
    ) -> Result<Option<ConnectResponse>, ProtocolError> {
        // Step 1 of dispatch: bind client_id to the user before anything else.
        // The body is parsed once; a body that is not JSON has no client to bind.
        let parsed = protocol::wire::parse_body(body);
        let mut tx = self.store.begin().await.map_err(store_error)?;
        let existing = match parsed
            .as_ref()
            .ok()
            .and_then(protocol::wire::client_id_member)
        {
            Some(client_id) => tx.lock_client(client_id).await.map_err(store_error)?,
            None => None,
        };
        if existing.as_ref().is_some_and(|c| c.user_id != user_id) {
            return Err(ProtocolError::new(ErrorKind::AuthRequired));
        }
        // Steps 2 and 3: compatibility gates, then structure.
        let req = ConnectRequest::from_value(parsed?, self.minimum_client_version.as_ref())?;
        // Step 4: retirement.
        if existing.as_ref().is_some_and(|c| c.retired) {
            return Err(ProtocolError::new(ErrorKind::ClientRetired));
        }
        let bound = existing.is_some();
        if !bound {
            self.admit_registration(&mut tx, user_id, now_micros)
                .await?;
        }
        let (mut client, renewed) = self.resolve_generation(user_id, &req, existing, now_micros)?;
        let authoritative = self.assignment(&mut tx, user_id).await?;
        reconcile_assignment(&mut client, &authoritative)?;
        // Seed receipts name scopes the client holds from a portable seed. Their
        // format (ADR 005) is not available here, so every receipt is
        // unverifiable: an assigned seeded scope is added with a null cursor
        // (rebuild), and an unassigned one is removed (docs/adr/0003).
        let known: BTreeSet<&ScopeId> = req.known_scopes.keys().collect();
        let held: BTreeSet<&ScopeId> = known
            .iter()
            .copied()
            .chain(req.seed_receipts.keys())
            .collect();
        let scopes = AssignmentDelta {
            add: authoritative
                .iter()
                .filter(|s| !known.contains(s))
                .map(|s| (s.clone(), None))
                .collect(),
            remove: held
                .iter()
                .filter(|s| !authoritative.contains(s))
                .map(|s| (*s).clone())
                .collect(),
        };
        let schema = self.schema_action(&req, &authoritative);
        let scope_cursor_updates = self
            .cursor_updates(
                &mut tx,
                user_id,
                &req,
                &client,
                renewed,
                &schema,
                &authoritative,
                now_micros,
            )
            .await?;
        client.installed_schema = match req.schema {
            ConnectSchema::Fresh => None,
            ConnectSchema::Installed(r) => Some(r),
        };
        client.continued |= req.client_generation.is_some();
        if bound {
            tx.put_client(&client).await.map_err(store_error)?;
        } else if !tx.insert_client(&client).await.map_err(store_error)? {
            return Ok(None);
        }
        tx.commit().await.map_err(store_error)?;
        Ok(Some(ConnectResponse {
            server_time: format_server_time(now_micros),
            client_generation: client.generation,
            scope_set_version: client.scope_set_version,
            schema,
            scopes,
            scope_cursor_updates,
        }))
    }

    /// `scope_cursor_updates`: for each presented cursor of a kept
    /// assignment whose state this connect changes, its same-position
    /// current-schema replacement (Class 2 and 3 transitions, scope
    /// unaffected, every other binding current), or null (rebuild).
    #[allow(clippy::too_many_arguments)]
    async fn cursor_updates<T: StoreTx>(
        &self,
        tx: &mut T,
        user_id: &str,
        req: &ConnectRequest,
        client: &ClientRecord,
        renewed: bool,
        schema: &SchemaAction,
        authoritative: &BTreeSet<ScopeId>,
        now_micros: i64,
    ) -> Result<BTreeMap<ScopeId, Option<String>>, ProtocolError> {
        let unchanged = !renewed && matches!(schema, SchemaAction::None { .. });
        // The bridge applies to a known Class 2 or 3 lineage, without reset.
        let bridge = match (&req.schema, renewed || req.schema_reset) {
            (ConnectSchema::Installed(installed), false) => match self.history.lineage(installed) {
                Lineage::Known(t)
                    if matches!(t.class, TransitionClass::Class2 | TransitionClass::Class3) =>
                {
                    Some((installed.hash, t))
                }
                _ => None,
            },
            _ => None,
        };
        let mut lineage = None;
        if bridge.is_some() {
            let boundary = tx.capture_progress().await.map_err(store_error)?.boundary;
            lineage = Some((tx.stream_state().await.map_err(store_error)?, boundary));
        }
        let mut updates = BTreeMap::new();
        for (scope, cursor) in &req.known_scopes {
            if !authoritative.contains(scope) {
                continue; // removed: excluded from the map
            }
            let seeded = req.seed_receipts.contains_key(scope);
            let Some(token) = cursor.as_deref().filter(|_| !unchanged || seeded) else {
                if seeded {
                    updates.insert(scope.clone(), None);
                }
                continue;
            };
            let replacement = match (&bridge, &lineage) {
                (Some((installed_hash, t)), Some((stream, boundary)))
                    if !seeded && !self.produced_by(&t.rematerialized, scope) =>
                {
                    let ctx = CursorContext {
                        user_id,
                        client_id: &client.client_id,
                        client_generation: client.generation,
                        schema_hash: self.current.hash(),
                        stream: *stream,
                        boundary: *boundary,
                        now_micros,
                    };
                    let g = self.membership.generation_of(scope);
                    cursor::bridge(&self.keys(), &ctx, scope, g, installed_hash, token)
                }
                _ => None,
            };
            updates.insert(scope.clone(), replacement);
        }
        Ok(updates)
    }

    /// Admission of a new client ID: a user registers at most
    /// `limits.registrations_per_user_per_hour` in any hour (429 past it).
    async fn admit_registration<T: StoreTx>(
        &self,
        tx: &mut T,
        user_id: &str,
        now_micros: i64,
    ) -> Result<(), ProtocolError> {
        const HOUR_MICROS: i64 = 3_600_000_000;
        let recent = tx
            .count_registrations(user_id, now_micros.saturating_sub(HOUR_MICROS))
            .await
            .map_err(store_error)?;
        if recent >= self.config.limits.registrations_per_user_per_hour {
            return Err(ProtocolError::new(ErrorKind::RetryLater)
                .with_message("too many new clients for this user; retry later"));
        }
        Ok(())
    }

    /// The client record this connect continues, and whether its generation was renewed.
    fn resolve_generation(
        &self,
        user_id: &str,
        req: &ConnectRequest,
        existing: Option<ClientRecord>,
        now_micros: i64,
    ) -> Result<(ClientRecord, bool), ProtocolError> {
        let fresh_record =
            |generation| ClientRecord::fresh(user_id, &req.client_id, generation, now_micros);
        let sentinel_misuse = || {
            let received = schema_value(&req.schema);
            ProtocolError::invalid_schema_reference(Some(&received)).with_message(
                "a known client identity must present its generation and installed schema",
            )
        };
        // An identity is known once it has gone on from its first connect: a
        // continuing connect, or a push. Until then, the identical fresh
        // request is the retry of a first connect whose response was lost: it
        // answers again with the same generation (docs/adr/0003).
        let fresh_retry = req.client_generation.is_none()
            && req.schema == ConnectSchema::Fresh
            && existing
                .as_ref()
                .is_some_and(|c| c.installed_schema.is_none() && !c.continued);
        // A known identity must present its generation and a real installed schema.
        if existing.is_some()
            && !fresh_retry
            && (req.client_generation.is_none() || req.schema == ConnectSchema::Fresh)
        {
            return Err(sentinel_misuse());
        }
        // Generations are the server's own counter: what a client presents
        // only decides whether it is current, never what comes next.
        match (existing, req.client_generation) {
            // A fresh local client: first generation.
            (None, None) => Ok((fresh_record(1), false)),
            // A continuing client the server does not know (restored
            // elsewhere): the first generation, and none of its cursors is ours.
            (None, Some(_)) => Ok((fresh_record(1), true)),
            (Some(c), None) => Ok((c, false)), // the retry of a fresh first connect
            (Some(c), Some(presented)) if presented == c.generation => Ok((c, false)),
            // A stale or never issued generation: the next one of ours.
            (Some(mut c), Some(_)) => {
                let old = c.generation;
                c.generation = next_counter(old)?;
                assert!(c.generation > old, "a generation only moves forward");
                // A new generation was assigned nothing yet.
                c.ever_assigned = c.assigned.clone();
                Ok((c, true))
            }
        }
    }

    /// The exact schema action dispatch of the wire spec.
    fn schema_action(&self, req: &ConnectRequest, assigned: &BTreeSet<ScopeId>) -> SchemaAction {
        let current = self.current.clone();
        let all_assigned = || AffectedScopes::new(assigned.iter().cloned().collect());
        let installed = match req.schema {
            ConnectSchema::Fresh => return SchemaAction::Replace { current },
            ConnectSchema::Installed(r) => r,
        };
        if req.schema_reset {
            return match all_assigned() {
                Some(affected_scopes) => SchemaAction::RebuildLocal {
                    current,
                    affected_scopes,
                },
                None => SchemaAction::Replace { current },
            };
        }
        let unsupported = |reason| SchemaAction::Unsupported {
            current: self.current.reference(),
            reason,
        };
        match self.history.lineage(&installed) {
            Lineage::Current => SchemaAction::None {
                current: current.reference(),
            },
            Lineage::Unknown => unsupported(UnsupportedReason::UnknownSchemaLineage),
            Lineage::Known(t) if t.class == TransitionClass::Class4 => {
                unsupported(UnsupportedReason::IncompatibleSchemaTransition)
            }
            Lineage::Known(t) if t.class == TransitionClass::Class3 => {
                let affected = assigned
                    .iter()
                    .filter(|s| self.produced_by(&t.rematerialized, s))
                    .cloned();
                match AffectedScopes::new(affected.collect()) {
                    Some(affected_scopes) => SchemaAction::RebuildLocal {
                        current,
                        affected_scopes,
                    },
                    None => SchemaAction::Replace { current },
                }
            }
            Lineage::Known(_) => SchemaAction::Replace { current },
        }
    }

    /// Whether a membership rule of one of `tables` could place rows in `scope`.
    fn produced_by(&self, tables: &BTreeSet<String>, scope: &ScopeId) -> bool {
        let rules = self
            .config
            .tables
            .iter()
            .filter(|t| tables.contains(&t.table_id))
            .flat_map(|t| &t.scopes);
        rules.into_iter().any(|rule| {
            let template = match rule {
                MembershipRule::Template { template }
                | MembershipRule::Dependency { template, .. } => template,
                MembershipRule::Constant { constant } => constant,
            };
            ScopeTemplate::parse(template).is_ok_and(|t| t.could_produce(scope.as_str()))
        })
    }

    /// The authoritative assignment of `user_id` (connect and pull use this one rule).
    pub async fn assignment<T: StoreTx>(
        &self,
        tx: &mut T,
        user_id: &str,
    ) -> Result<BTreeSet<ScopeId>, ProtocolError> {
        let a = &self.config.assignment;
        let mut scopes: Vec<String> = Vec::new();
        if !a.user_scope.is_empty()
            && let Ok(t) = ScopeTemplate::parse(&a.user_scope)
            && let Ok(Some(s)) = t.render(|_| Some(user_id.to_owned()))
        {
            scopes.push(s);
        }
        scopes.extend(a.shared.iter().cloned());
        if a.grants {
            scopes.extend(tx.grants(user_id).await.map_err(store_error)?);
        }
        for d in &a.dependency {
            let Ok(t) = ScopeTemplate::parse(&d.scope) else {
                continue;
            };
            for v in tx
                .dependency_values(d, user_id)
                .await
                .map_err(store_error)?
            {
                // An empty value names no scope: capture blocks on its rows.
                scopes.extend(t.render(|_| Some(v.clone())).ok().flatten());
            }
        }
        // A value that cannot be a scope ID (empty or too long) assigns nothing.
        Ok(scopes.iter().filter_map(|s| ScopeId::parse(s)).collect())
    }

    /// `GET /sync/schema`: the current manifest.
    pub fn schema_json(&self) -> Value {
        self.current.to_json()
    }

    /// `GET /sync/tables`: registered table metadata.
    pub fn tables_json(&self) -> Value {
        let tables = self.config.tables.iter().map(|t| {
            json::object([
                ("table_id", Value::string(&t.table_id)),
                ("relation_id", Value::string(&t.relation_id)),
                ("name", Value::string(&t.name)),
                ("relation", Value::string(&t.relation)),
            ])
        });
        json::object([("tables", Value::Array(tables.collect()))])
    }
}

/// The received schema member as JSON, for `received_schema`.
fn schema_value(s: &ConnectSchema) -> Value {
    match s {
        ConnectSchema::Fresh => {
            json::object([("version", Value::int(0)), ("hash", Value::string(""))])
        }
        ConnectSchema::Installed(r) => r.to_json(),
    }
}

/// Installs the authoritative assignment: `scope_set_version` steps by
/// exactly one when the set changes. Connect and pull use this one rule.
pub(crate) fn reconcile_assignment(
    client: &mut ClientRecord,
    authoritative: &BTreeSet<ScopeId>,
) -> Result<bool, ProtocolError> {
    client.ever_assigned.extend(authoritative.iter().cloned());
    if *authoritative == client.assigned {
        return Ok(false);
    }
    client.scope_set_version = next_counter(client.scope_set_version)?;
    client.assigned = authoritative.clone();
    Ok(true)
}

/// `n + 1`, failing before the portable range is left.
pub(crate) fn next_counter(n: u64) -> Result<u64, ProtocolError> {
    if n >= MAX_SAFE_INTEGER {
        return Err(ProtocolError::new(ErrorKind::SyncIntegrityFailure)
            .with_message("a counter would leave the portable range"));
    }
    Ok(n + 1)
}
