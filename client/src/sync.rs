//! The client: its rules for each endpoint, in the spec's words.
//!
//! - **Connect** registers or resumes the client, applies the schema action
//!   (`replace` and `rebuild_local` install the inline manifest; exactly
//!   `affected_scopes` are rebuilt; `unsupported` stops all normal
//!   requests) and the assignment transition.
//! - **Push** sends the outbox's sealed batches, oldest first, each resent
//!   byte for byte until a terminal answer. A batch the generation or
//!   schema gate refused was never executed: its writes are sealed again in
//!   a new batch after a reconnect.
//! - **Pull** rebuilds every scope without a cursor, then reads pages until
//!   a terminal one that sends nothing to rebuild; each page is one local
//!   transition ([`crate::page`]).
//! - **Rebuild** reads one attempt's pages, verified, and installs the scope
//!   only when the recomputed checksum matches; `rebuild_restart_required`
//!   and a mismatch start a new attempt.
//! - **Retry**: only an answer marked `retryable` (429, 503) or no answer at
//!   all is retried, with the identical bytes, after `Retry-After` or a
//!   jittered backoff; `client_generation_expired` and `schema_mismatch`
//!   reconnect.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use protocol::digest::{Digest, RowIdentity, row_digest};
use protocol::ids::CanonicalUuid;
use protocol::ids::ServerVersion;
use protocol::json::{self, Object, Value};
use protocol::manifest::{Manifest, SchemaRef};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

use crate::local::{
    Holding, LocalError, LocalStore, OutboxChange, QueuedWrite, Session, SettledOutcome, Transition,
};
use crate::outbox::{self, InvalidWrite, Write};
use crate::page::{
    self, PageError, PullApplied, RebuildAttempt, RebuildStep, array, counter, member, object,
    string,
};
use crate::retry::{Backoff, parse_retry_after};
use crate::transport::{Answer, Endpoint, Transport};

/// How a client behaves.
#[derive(Clone, Debug)]
pub struct Config {
    pub platform: String,
    /// The application's SemVer version.
    pub app_version: String,
    /// Changes per pull page (1..=1000).
    pub pull_limit: u16,
    /// Records per rebuild page (1..=1000).
    pub rebuild_limit: u16,
    /// Tries of one request that gets a retryable answer or none.
    pub max_tries: u32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Pages one `pull` reads at most before it returns (and rounds of
    /// rebuild and reconnect it goes through).
    pub max_pages: u32,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            platform: "rust".into(),
            app_version: "1.0.0".into(),
            pull_limit: 500,
            rebuild_limit: 1000,
            max_tries: 8,
            backoff_base: Duration::from_millis(200),
            backoff_cap: Duration::from_secs(30),
            max_pages: 10_000,
        }
    }
}

/// Why a sync step stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum SyncError {
    Local(LocalError),
    /// No answer after every try.
    Unreachable(String),
    /// Retryable answers after every try (the last one's code).
    Unavailable(String),
    /// A terminal error answer (a sealed batch it refused stays sealed).
    Refused {
        status: u16,
        code: String,
        /// The server's bounded message (it carries no value or identity).
        message: String,
    },
    /// Connect answered `unsupported` (its reason): no push, pull or rebuild.
    Unsupported(String),
    /// An answer no conforming server sends; nothing of it was applied.
    Integrity(String),
    /// A scope's assignment kept changing while the pull ran: its rebuild
    /// was refused as not assigned round after round, while each pull page
    /// kept it assigned. Transient: sync again later.
    AssignmentChanging(String),
    /// A scope's rebuild had to start over on every attempt (each ended in
    /// `rebuild_restart_required` or a reconnect: its assignment, its
    /// membership or the client's session kept moving). Transient: sync
    /// again later.
    RebuildRestarting(String),
    /// The client has no generation or manifest yet: connect first.
    NotConnected,
}

impl std::fmt::Display for SyncError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SyncError::Local(e) => write!(f, "{e}"),
            SyncError::Unreachable(e) => write!(f, "the server is unreachable: {e}"),
            SyncError::Unavailable(c) => write!(f, "the server is unavailable ({c})"),
            SyncError::Refused {
                status,
                code,
                message,
            } => write!(f, "refused: {status} {code}: {message}"),
            SyncError::Unsupported(r) => write!(f, "the installed schema is unsupported ({r})"),
            SyncError::Integrity(e) => write!(f, "integrity: {e}"),
            SyncError::AssignmentChanging(s) => {
                write!(f, "the assignment of {s} kept changing; sync again later")
            }
            SyncError::RebuildRestarting(s) => {
                write!(f, "the rebuild of {s} kept restarting; sync again later")
            }
            SyncError::NotConnected => write!(f, "not connected"),
        }
    }
}

impl std::error::Error for SyncError {}

impl From<LocalError> for SyncError {
    fn from(e: LocalError) -> Self {
        SyncError::Local(e)
    }
}

impl From<PageError> for SyncError {
    fn from(e: PageError) -> Self {
        match e {
            PageError::Invalid(m) => SyncError::Integrity(m),
            PageError::Local(e) => SyncError::Local(e),
        }
    }
}

/// What one `pull` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PullReport {
    pub pages: u32,
    pub changes: usize,
    /// Scopes rebuilt (a scope rebuilt twice counts twice).
    pub rebuilt: Vec<String>,
    /// Scopes whose terminal checksum did not match the local copy.
    pub mismatched: Vec<String>,
}

/// What one `push` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PushReport {
    pub batches: u32,
    pub outcomes: Vec<SettledOutcome>,
}

/// A row as the application sees it: the latest holding of any scope.
#[derive(Clone, Debug, PartialEq)]
pub struct RowView {
    pub table: String,
    pub pk: Value,
    pub row: Value,
    pub version: String,
    pub tombstone: bool,
}

/// An error body's members a client branches on.
struct ErrorBody {
    code: String,
    message: String,
    retryable: bool,
}

fn error_body(body: &[u8]) -> Option<ErrorBody> {
    let v = json::parse(body).ok()?;
    let e = v.as_object()?.get("error")?.as_object()?;
    Some(ErrorBody {
        code: e.get("code")?.as_str()?.to_owned(),
        message: e.get("message")?.as_str()?.to_owned(),
        retryable: matches!(e.get("retryable")?, Value::Bool(true)),
    })
}

fn code_of(a: &Answer) -> String {
    error_body(&a.body).map_or_else(|| "unreadable".into(), |e| e.code)
}

/// The terminal error an answer is.
fn refused(a: &Answer) -> SyncError {
    let e = error_body(&a.body);
    SyncError::Refused {
        status: a.status,
        code: e
            .as_ref()
            .map_or_else(|| "unreadable".into(), |e| e.code.clone()),
        message: e.map(|e| e.message).unwrap_or_default(),
    }
}

/// A Synchro client over a local store and a transport.
pub struct Client<S: LocalStore, T: Transport> {
    store: S,
    transport: T,
    config: Config,
    rng: ChaCha8Rng,
    session: Session,
    manifest: Option<Manifest>,
    /// Scopes whose terminal checksum differed, since last taken (kept
    /// apart from the report, which a later error in the same pull loses).
    mismatched: Vec<String>,
    checks: page::Checks,
}

fn parse_manifest(text: &str) -> Result<Manifest, SyncError> {
    let v = json::parse(text.as_bytes())
        .map_err(|_| SyncError::Integrity("the installed manifest is damaged".into()))?;
    Manifest::from_json(v)
        .map_err(|_| SyncError::Integrity("the installed manifest is damaged".into()))
}

impl<S: LocalStore, T: Transport> Client<S, T> {
    /// Opens the client kept in `store` (a new one as `client_id` when the
    /// store is empty). `seed` seeds its randomness: the batch, mutation
    /// and rebuild IDs, and jitter. The IDs must never repeat, so a real
    /// device passes fresh OS entropy on every open; tests and the
    /// simulator pass their own deterministic seeds.
    pub fn open(
        mut store: S,
        transport: T,
        client_id: &str,
        config: Config,
        seed: u64,
    ) -> Result<Client<S, T>, SyncError> {
        let session = match store.session()? {
            Some(s) => s,
            None => {
                let s = Session::fresh(client_id);
                store.commit(Transition {
                    session: Some(s.clone()),
                    ..Transition::default()
                })?;
                s
            }
        };
        let manifest = session
            .manifest
            .as_deref()
            .map(parse_manifest)
            .transpose()?;
        Ok(Client {
            store,
            transport,
            config,
            rng: ChaCha8Rng::seed_from_u64(seed),
            session,
            manifest,
            mismatched: Vec::new(),
            checks: page::Checks::default(),
        })
    }

    /// Plants a client bug for the simulator to catch: row checksums are
    /// trusted as sent, never recomputed.
    #[cfg(madsim)]
    pub fn plant_trusting_row_checksums(&mut self) {
        self.checks.trust_sent_row_checksums = true;
    }

    /// Plants a client bug for the simulator to catch: a scope the server
    /// removes (by pull or by connect) leaves the active set, but its rows
    /// stay.
    #[cfg(madsim)]
    pub fn plant_keeping_removed_rows(&mut self) {
        self.checks.keep_removed_rows = true;
    }

    /// Every scope whose terminal checksum differed from the local copy
    /// (each was rebuilt) since the last call, oldest first.
    pub fn take_mismatched(&mut self) -> Vec<String> {
        std::mem::take(&mut self.mismatched)
    }

    /// The store and the transport, as a process that stops leaves them.
    pub fn into_parts(self) -> (S, T) {
        (self.store, self.transport)
    }

    /// The local store (for inspection).
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The session as last committed.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The transport (for tests that script it).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// The installed manifest, once connected.
    pub fn manifest(&self) -> Option<&Manifest> {
        self.manifest.as_ref()
    }

    fn commit(&mut self, t: Transition) -> Result<(), SyncError> {
        let session = t.session.clone();
        self.store.commit(t)?;
        if let Some(s) = session {
            self.session = s;
        }
        Ok(())
    }

    /// A new random (version 4) UUID from the client's seeded randomness.
    fn uuid(&mut self) -> CanonicalUuid {
        loop {
            let mut b = [0u8; 16];
            self.rng.fill_bytes(&mut b);
            b[6] = (b[6] & 0x0f) | 0x40;
            b[8] = (b[8] & 0x3f) | 0x80;
            if let Some(u) = CanonicalUuid::from_bytes(b) {
                return u;
            }
        }
    }

    /// Sends `body`, retrying the identical bytes while the answer is
    /// retryable (or absent), up to `max_tries`.
    async fn send(&mut self, endpoint: Endpoint, body: &[u8]) -> Result<Answer, SyncError> {
        let mut backoff = Backoff::new(self.config.backoff_base, self.config.backoff_cap);
        loop {
            let delay = match self.transport.post(endpoint, body).await {
                Ok(a) => {
                    let retryable = error_body(&a.body).is_some_and(|e| e.retryable);
                    if !(retryable && (a.status == 429 || a.status == 503)) {
                        return Ok(a);
                    }
                    if backoff.attempts() + 1 >= self.config.max_tries {
                        return Err(SyncError::Unavailable(code_of(&a)));
                    }
                    let after = a
                        .retry_after
                        .as_deref()
                        .and_then(|t| parse_retry_after(t, SystemTime::now()));
                    backoff.next(after, &mut self.rng)
                }
                Err(e) => {
                    if backoff.attempts() + 1 >= self.config.max_tries {
                        return Err(SyncError::Unreachable(e.0));
                    }
                    backoff.next(None, &mut self.rng)
                }
            };
            tokio::time::sleep(delay).await;
        }
    }

    fn connected(&self) -> Result<(u64, &Manifest), SyncError> {
        if let Some(r) = &self.session.unsupported {
            return Err(SyncError::Unsupported(r.clone()));
        }
        match (self.session.generation, &self.manifest) {
            (Some(g), Some(m)) => Ok((g, m)),
            _ => Err(SyncError::NotConnected),
        }
    }

    // ---- connect ----

    /// Connects: registers or resumes the client, applies the schema action
    /// and the assignment. `Ok` also for `unsupported` (the session says so).
    pub async fn connect(&mut self) -> Result<(), SyncError> {
        self.connect_with(false).await
    }

    /// Connects with `schema_reset: true`: the explicit recovery of a client
    /// whose schema is unsupported (after an application upgrade).
    pub async fn reset_schema(&mut self) -> Result<(), SyncError> {
        self.connect_with(true).await
    }

    async fn connect_with(&mut self, reset: bool) -> Result<(), SyncError> {
        let body = self.connect_body(reset);
        let a = self.send(Endpoint::Connect, &body).await?;
        if a.status != 200 {
            return Err(refused(&a));
        }
        let t = self.connect_transition(&a.body)?;
        let manifest = t.session.as_ref().and_then(|s| s.manifest.clone());
        self.commit(t)?;
        self.manifest = manifest.as_deref().map(parse_manifest).transpose()?;
        Ok(())
    }

    fn connect_body(&self, reset: bool) -> Vec<u8> {
        let s = &self.session;
        let mut o = Object::new();
        o.insert("client_id".into(), Value::string(s.client_id.clone()));
        if let Some(g) = s.generation {
            o.insert("client_generation".into(), Value::int(g as i64));
        }
        o.insert(
            "platform".into(),
            Value::string(self.config.platform.clone()),
        );
        o.insert(
            "app_version".into(),
            Value::string(self.config.app_version.clone()),
        );
        o.insert("protocol_version".into(), Value::int(3));
        if reset {
            o.insert("schema_reset".into(), Value::Bool(true));
        }
        let schema = match &self.manifest {
            Some(m) => m.reference().to_json(),
            None => json::object([("version", Value::int(0)), ("hash", Value::string(""))]),
        };
        o.insert("schema".into(), schema);
        o.insert(
            "scope_set_version".into(),
            Value::int(s.scope_set_version as i64),
        );
        let known = s.scopes.iter().map(|(scope, c)| {
            let c = c.clone().map_or(Value::Null, Value::string);
            (scope.clone(), json::object([("cursor", c)]))
        });
        o.insert("known_scopes".into(), Value::Object(known.collect()));
        json::to_canonical(&Value::Object(o))
    }

    /// The transition a 200 connect body makes.
    fn connect_transition(&mut self, body: &[u8]) -> Result<Transition, SyncError> {
        let bad = |m: &str| SyncError::Integrity(m.to_owned());
        let v = json::parse(body).map_err(|_| bad("the connect answer is not JSON"))?;
        let o = object(&v, "the connect answer")?;
        let mut next = self.session.clone();
        let mut t = Transition::default();
        let generation = counter(o, "client_generation")?;
        if generation == 0 {
            return Err(bad("client_generation is not positive"));
        }
        next.generation = Some(generation);
        next.scope_set_version = counter(o, "scope_set_version")?;
        let schema = object(member(o, "schema")?, "schema")?;
        let reference = SchemaRef::from_json(&json::object([
            ("version", member(schema, "version")?.clone()),
            ("hash", member(schema, "hash")?.clone()),
        ]))
        .ok_or_else(|| bad("a malformed schema reference"))?;
        let action = string(schema, "action")?;
        let definition = o.get("schema_definition");
        let affected = o.get("affected_scopes");
        next.unsupported = None;
        let mut installed = None;
        match action {
            "none" => {
                if definition.is_some() || affected.is_some() {
                    return Err(bad("action none with a schema definition"));
                }
                if self.manifest.as_ref().map(Manifest::reference) != Some(reference) {
                    return Err(bad("action none for a schema the client does not hold"));
                }
            }
            "replace" | "rebuild_local" => {
                let Some(d) = definition else {
                    return Err(bad("a schema action without its definition"));
                };
                let m = Manifest::from_json(d.clone())
                    .map_err(|_| bad("a schema definition that does not verify"))?;
                if m.reference() != reference {
                    return Err(bad("the schema definition is not the announced schema"));
                }
                installed = Some(m);
            }
            "unsupported" => {
                if definition.is_some() || affected.is_some() {
                    return Err(bad("action unsupported with a schema definition"));
                }
                next.unsupported = Some(string(schema, "reason")?.to_owned());
            }
            _ => return Err(bad("an unknown schema action")),
        }
        // The assignment transition.
        let scopes = object(member(o, "scopes")?, "scopes")?;
        for r in page::scope_names(array(scopes, "remove")?)? {
            next.scopes.remove(&r);
            if !self.checks.keep_removed_rows {
                t.clear.push(r);
            }
        }
        for a in array(scopes, "add")? {
            let a = object(a, "an added scope")?;
            let id = string(a, "id")?.to_owned();
            let cursor = match member(a, "cursor")? {
                Value::Null => None,
                c => Some(
                    c.as_str()
                        .ok_or_else(|| bad("a cursor is not a string"))?
                        .to_owned(),
                ),
            };
            t.clear.push(id.clone());
            next.scopes.insert(id, cursor);
        }
        for (scope, c) in object(member(o, "scope_cursor_updates")?, "scope_cursor_updates")? {
            let Some(cursor) = next.scopes.get_mut(scope) else {
                return Err(bad("a cursor update for a scope not assigned"));
            };
            *cursor = match c {
                Value::Null => None,
                c => Some(
                    c.as_str()
                        .ok_or_else(|| bad("a cursor is not a string"))?
                        .to_owned(),
                ),
            };
        }
        if action == "rebuild_local" {
            let Some(Value::Array(list)) = affected else {
                return Err(bad("rebuild_local without affected_scopes"));
            };
            let list = page::scope_names(list)?;
            if list.is_empty() {
                return Err(bad("rebuild_local with no affected scope"));
            }
            for s in list {
                match next.scopes.get_mut(&s) {
                    Some(c) => *c = None,
                    None => return Err(bad("an affected scope that is not assigned")),
                }
            }
        }
        if let Some(m) = installed {
            // Held rows' digests are the new schema's from now on; a scope
            // holding a row the new schema cannot read is rebuilt.
            let cleared: Vec<String> = t.clear.clone();
            for h in self.store.all_holdings()? {
                if cleared.contains(&h.scope) || !next.scopes.contains_key(&h.scope) {
                    continue;
                }
                match redigest(&m, &h) {
                    Some(digest) if digest.0 == h.digest => {}
                    Some(digest) => t.put.push(Holding {
                        digest: digest.0,
                        ..h
                    }),
                    None => {
                        if let Some(c) = next.scopes.get_mut(&h.scope) {
                            *c = None;
                        }
                    }
                }
            }
            next.manifest = Some(json::to_canonical_string(&m.to_json()));
        }
        t.session = Some(next);
        Ok(t)
    }

    // ---- writes and push ----

    /// Queues `write` in the outbox, durably, under the installed schema;
    /// its mutation ID is fixed now. Returns the mutation ID.
    pub fn write(&mut self, write: &Write) -> Result<String, WriteError> {
        let id = self.uuid();
        let manifest = self.manifest.as_ref().ok_or(WriteError::NotConnected)?;
        let mutation = outbox::mutation(manifest, id, write).map_err(WriteError::Invalid)?;
        let mut next = self.session.clone();
        let seq = next.take_seq();
        self.commit(Transition {
            session: Some(next),
            outbox: vec![OutboxChange::Queue(QueuedWrite {
                seq,
                mutation_id: id.to_string(),
                mutation,
            })],
            ..Transition::default()
        })
        .map_err(|e| match e {
            SyncError::Local(l) => WriteError::Local(l),
            other => WriteError::Invalid(InvalidWrite(other.to_string())),
        })?;
        Ok(id.to_string())
    }

    /// Sends every sealed batch and seals and sends the queued writes,
    /// until the outbox is empty or a batch is refused.
    pub async fn push(&mut self) -> Result<PushReport, SyncError> {
        let mut report = PushReport::default();
        let mut reconnects = 0;
        loop {
            let (generation, manifest) = self.connected()?;
            let batch = match self.store.sealed()?.into_iter().next() {
                Some(b) => b,
                None => {
                    let queued = self.store.queued()?;
                    if queued.is_empty() {
                        return Ok(report);
                    }
                    let schema = manifest.reference();
                    let id = self.uuid();
                    let b =
                        outbox::seal(&self.session.client_id, generation, &schema, id, &queued)?;
                    self.commit(Transition {
                        outbox: vec![OutboxChange::Seal(b.clone())],
                        ..Transition::default()
                    })?;
                    b
                }
            };
            let a = self.send(Endpoint::Push, &batch.body).await?;
            match (a.status, code_of(&a).as_str()) {
                (200, _) => {
                    let manifest = self.connected()?.1.clone();
                    let mut next = self.session.clone();
                    let outcomes = outbox::settle(&manifest, &batch, &a.body, || next.take_seq())?;
                    report.batches += 1;
                    report.outcomes.extend(outcomes.iter().cloned());
                    self.commit(Transition {
                        session: Some(next),
                        outbox: vec![OutboxChange::Settle {
                            batch_id: batch.batch_id,
                            outcomes,
                        }],
                        ..Transition::default()
                    })?;
                }
                // Refused before execution (replay is looked up first, so
                // a batch that ever executed would have replayed): seal
                // its writes again after a reconnect.
                (409, "client_generation_expired") | (422, "schema_mismatch") if reconnects < 2 => {
                    reconnects += 1;
                    self.commit(Transition {
                        outbox: vec![OutboxChange::Unseal {
                            batch_id: batch.batch_id,
                        }],
                        ..Transition::default()
                    })?;
                    self.connect().await?;
                }
                _ => return Err(refused(&a)),
            }
        }
    }

    // ---- pull and rebuild ----

    fn pull_body(&self, generation: u64, manifest: &Manifest) -> Vec<u8> {
        let s = &self.session;
        let scopes = s.scopes.iter().map(|(scope, c)| {
            let c = c.clone().map_or(Value::Null, Value::string);
            (scope.clone(), json::object([("cursor", c)]))
        });
        json::to_canonical(&json::object([
            ("client_id", Value::string(s.client_id.clone())),
            ("client_generation", Value::int(generation as i64)),
            ("schema", manifest.reference().to_json()),
            ("scope_set_version", Value::int(s.scope_set_version as i64)),
            ("scopes", Value::Object(scopes.collect())),
            ("limit", Value::int(i64::from(self.config.pull_limit))),
        ]))
    }

    /// Rebuilds what needs it and pulls until a terminal page leaves
    /// nothing to rebuild: the local copy is then the server's at that
    /// page's boundary, scope by scope, verified by checksum.
    pub async fn pull(&mut self) -> Result<PullReport, SyncError> {
        let mut report = PullReport::default();
        let mut reconnects = 0;
        // Rebuilds refused in a row per scope.
        let mut refused_rebuilds: BTreeMap<String, u32> = BTreeMap::new();
        while report.pages < self.config.max_pages {
            let needing: Vec<String> = (self.session.scopes.iter())
                .filter(|(_, c)| c.is_none())
                .map(|(s, _)| s.clone())
                .collect();
            for scope in needing {
                match self.rebuild(&scope).await {
                    Ok(true) => {
                        refused_rebuilds.remove(&scope);
                        report.rebuilt.push(scope);
                    }
                    Ok(false) => {}
                    // Revoked since the last pull, which reconciles it away
                    // (or granted again, and the next attempt works). A scope
                    // revoked and granted again between every rebuild and
                    // pull is a race the caller waits out.
                    Err(SyncError::Refused { status: 400, .. }) => {
                        let n = refused_rebuilds.get(&scope).copied().unwrap_or(0) + 1;
                        if n > MAX_REFUSED_REBUILDS {
                            return Err(SyncError::AssignmentChanging(scope));
                        }
                        refused_rebuilds.insert(scope, n);
                    }
                    Err(e) => return Err(e),
                }
            }
            let (generation, manifest) = self.connected()?;
            let body = self.pull_body(generation, manifest);
            let a = self.send(Endpoint::Pull, &body).await?;
            match (a.status, code_of(&a).as_str()) {
                (200, _) => {
                    let manifest = self.connected()?.1.clone();
                    let (t, applied) = page::pull_transition(
                        &self.store,
                        &self.session,
                        &manifest,
                        &a.body,
                        self.checks,
                    )?;
                    self.commit(t)?;
                    report.pages += 1;
                    report.changes += applied.changes;
                    report.mismatched.extend(applied.mismatched.iter().cloned());
                    self.mismatched.extend(applied.mismatched.iter().cloned());
                    if done(&applied) {
                        return Ok(report);
                    }
                    refused_rebuilds.retain(|s, _| self.session.scopes.get(s) == Some(&None));
                }
                (409, "client_generation_expired") | (422, "schema_mismatch") if reconnects < 2 => {
                    reconnects += 1;
                    self.connect().await?;
                }
                _ => return Err(refused(&a)),
            }
        }
        Ok(report)
    }

    /// Rebuilds `scope` (a new attempt each time one must restart, at most
    /// four): `Ok(true)` once installed, `Ok(false)` when a reconnect on the
    /// way left nothing to rebuild. Four attempts that each had to start
    /// over are transient ([`SyncError::RebuildRestarting`]); an attempt
    /// whose checksum did not match makes them an integrity error.
    pub async fn rebuild(&mut self, scope: &str) -> Result<bool, SyncError> {
        let mut mismatched = false;
        for _ in 0..4 {
            if self.session.scopes.get(scope) != Some(&None) {
                return Ok(false);
            }
            let id = self.uuid().to_string();
            let mut attempt = RebuildAttempt::new(scope, id);
            loop {
                let (generation, manifest) = self.connected()?;
                let body = rebuild_body(
                    &self.session,
                    generation,
                    manifest,
                    &attempt,
                    self.config.rebuild_limit,
                );
                let a = self.send(Endpoint::Rebuild, &body).await?;
                match (a.status, code_of(&a).as_str()) {
                    (200, _) => {
                        let manifest = self.connected()?.1.clone();
                        match attempt.apply(&self.session, &manifest, &a.body, self.checks)? {
                            RebuildStep::More => continue,
                            RebuildStep::Done(t) => {
                                self.commit(*t)?;
                                return Ok(true);
                            }
                            RebuildStep::Mismatch => {
                                mismatched = true;
                                break;
                            }
                        }
                    }
                    (409, "rebuild_restart_required") => break,
                    (409, "client_generation_expired") | (422, "schema_mismatch") => {
                        self.connect().await?;
                        break;
                    }
                    _ => return Err(refused(&a)),
                }
            }
        }
        if mismatched {
            return Err(SyncError::Integrity(format!(
                "{scope} could not be rebuilt: a rebuilt checksum did not match"
            )));
        }
        Err(SyncError::RebuildRestarting(scope.to_owned()))
    }

    /// Connects if the client never did, pushes the outbox, then pulls.
    pub async fn sync(&mut self) -> Result<(PushReport, PullReport), SyncError> {
        if self.session.generation.is_none() || self.manifest.is_none() {
            self.connect().await?;
        }
        let pushed = self.push().await?;
        let pulled = self.pull().await?;
        Ok((pushed, pulled))
    }

    // ---- what the application sees ----

    /// The rows of `table` the client holds: each row once, as its latest
    /// holding in any scope has it.
    pub fn rows(&self, table: &str) -> Result<Vec<RowView>, SyncError> {
        let mut latest: BTreeMap<Vec<u8>, Holding> = BTreeMap::new();
        for h in self.store.all_holdings()? {
            if h.table != table {
                continue;
            }
            match latest.get(&h.identity) {
                Some(l) if l.seq >= h.seq => {}
                _ => {
                    latest.insert(h.identity.clone(), h);
                }
            }
        }
        latest
            .into_values()
            .map(|h| {
                let parse = |t: &str| {
                    json::parse(t.as_bytes())
                        .map_err(|_| SyncError::Local(LocalError("a held row is damaged".into())))
                };
                Ok(RowView {
                    table: h.table.clone(),
                    pk: parse(&h.pk)?,
                    row: parse(&h.row)?,
                    version: h.version.clone(),
                    tombstone: h.tombstone,
                })
            })
            .collect()
    }

    /// The version to write `pk` of `table` against: the latest the client
    /// learned, from a pulled row or a push outcome, whichever came later.
    pub fn version_of(&self, table: &str, pk: &Value) -> Result<Option<String>, SyncError> {
        let manifest = self.manifest.as_ref().ok_or(SyncError::NotConnected)?;
        let Some(t) = manifest.table(table) else {
            return Ok(None);
        };
        let key_field = t.primary_key();
        let pk_text =
            json::to_canonical_string(&json::object([(key_field.field_id(), pk.clone())]));
        let mut best: Option<(u64, String)> = None;
        let mut offer = |seq: u64, v: &str| {
            if best.as_ref().is_none_or(|(s, _)| *s < seq) {
                best = Some((seq, v.to_owned()));
            }
        };
        for h in self.store.all_holdings()? {
            if h.table == table && h.pk == pk_text {
                offer(h.seq, &h.version);
            }
        }
        for o in self.store.outcomes()? {
            if let (true, Some(v)) = (o.table == table && o.pk == pk_text, &o.version) {
                offer(o.seq, v);
            }
        }
        Ok(best.map(|(_, v)| v))
    }

    /// Every settled push outcome, oldest first.
    pub fn outcomes(&self) -> Result<Vec<SettledOutcome>, SyncError> {
        Ok(self.store.outcomes()?)
    }

    /// Writes waiting to be pushed (queued or sealed).
    pub fn pending(&self) -> Result<usize, SyncError> {
        let sealed: usize = self
            .store
            .sealed()?
            .iter()
            .map(|b| b.mutation_ids.len())
            .sum();
        Ok(sealed + self.store.queued()?.len())
    }
}

/// Rounds in a row a pull lets one scope's rebuild be refused before it
/// reports the refusal.
const MAX_REFUSED_REBUILDS: u32 = 3;

/// Why a write was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum WriteError {
    NotConnected,
    Invalid(InvalidWrite),
    Local(LocalError),
}

/// Whether a page ends the pull: terminal, nothing to rebuild, every checksum matched.
fn done(a: &PullApplied) -> bool {
    !a.has_more && a.rebuild.is_empty() && a.mismatched.is_empty()
}

fn rebuild_body(
    session: &Session,
    generation: u64,
    manifest: &Manifest,
    attempt: &RebuildAttempt,
    limit: u16,
) -> Vec<u8> {
    let cursor = attempt
        .continuation
        .clone()
        .map_or(Value::Null, Value::string);
    json::to_canonical(&json::object([
        ("client_id", Value::string(session.client_id.clone())),
        ("client_generation", Value::int(generation as i64)),
        ("schema", manifest.reference().to_json()),
        ("scope", Value::string(attempt.scope.clone())),
        ("rebuild_id", Value::string(attempt.rebuild_id.clone())),
        ("cursor", cursor),
        ("limit", Value::int(i64::from(limit))),
    ]))
}

/// A held row's digest under `manifest`; `None` when that schema cannot read it.
fn redigest(manifest: &Manifest, h: &Holding) -> Option<Digest> {
    let table = manifest.table(&h.table)?;
    let row = json::parse(h.row.as_bytes()).ok()?;
    let decoded = table.decode_row(row.as_object()?).ok()?;
    let identity = RowIdentity::of(table, table.row_key(&decoded)?);
    if identity.as_bytes() != h.identity.as_slice() {
        return None;
    }
    let version = ServerVersion::parse(&h.version)?;
    Some(row_digest(
        &manifest.hash(),
        table,
        &identity,
        &decoded,
        &version,
    ))
}
