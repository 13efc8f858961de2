//! The sync config: what operators declare in one TOML file (tables, logical
//! IDs, portable types, membership and assignment rules, auth), its pure
//! validation, and the manifest it defines. Validation against the live
//! catalog is the store's (`store-pg`), because it needs the database.

use std::collections::BTreeSet;
use std::fmt;

use protocol::manifest::{Composition, FieldManifest, Lifecycle, ManifestError, TableManifest};
use protocol::value::{DecimalBounds, FieldType, PortableType};
use serde::Deserialize;

pub mod auth;
pub mod retention;
pub use auth::AuthConfig;
pub use retention::RetentionConfig;

/// The whole config file.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SyncConfig {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub auth: AuthConfig,
    #[serde(default)]
    pub assignment: AssignmentConfig,
    #[serde(default)]
    pub tables: Vec<TableConfig>,
    #[serde(default)]
    pub capture: CaptureConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub retention: RetentionConfig,
    /// Set by `synchro serve --roll-back`, never by the file: start with a
    /// config that a newer one replaced (ADR 0020 §8).
    #[serde(skip)]
    pub roll_back: bool,
}

/// What one user, and the whole instance, may make the server spend
/// (`docs/CONFIG.md`, "Limits"). Past a limit the answer is `429
/// retry_later`: every one frees with time.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Rows staged by one user's live rebuild sessions. A new session that
    /// would pass it (while the user has another) answers 429.
    #[serde(default = "default_rebuild_rows_per_user")]
    pub rebuild_rows_per_user: u64,
    /// Rows staged by every live rebuild session of the instance.
    #[serde(default = "default_rebuild_rows_total")]
    pub rebuild_rows_total: u64,
    /// New client IDs one user may register in any hour.
    #[serde(default = "default_registrations_per_hour")]
    pub registrations_per_user_per_hour: u64,
    /// Pull and rebuild pages one user builds at once (of `server.pull_pages`).
    #[serde(default = "default_pages_per_user")]
    pub pages_per_user: usize,
    /// Pull and rebuild requests one user may make per second, sustained...
    #[serde(default = "default_requests_per_second")]
    pub requests_per_user_per_second: u64,
    /// ... and at once, after being idle.
    #[serde(default = "default_request_burst")]
    pub request_burst_per_user: u64,
    /// Mutations one user may push per second, sustained...
    #[serde(default = "default_mutations_per_second")]
    pub mutations_per_user_per_second: u64,
    /// ... and at once (at least one full batch, 1000).
    #[serde(default = "default_mutation_burst")]
    pub mutation_burst_per_user: u64,
    /// New rebuild sessions one user may stage per minute (and at once):
    /// each writes its whole scope.
    #[serde(default = "default_stages_per_minute")]
    pub rebuild_stages_per_user_per_minute: u64,
    /// Requests of every endpoint one user may make per second, sustained,
    /// before any is looked at: past it, 429 before dispatch (the flood
    /// gate, ADR 0018)...
    #[serde(default = "default_flood_per_second")]
    pub flood_requests_per_user_per_second: u64,
    /// ... and at once.
    #[serde(default = "default_flood_burst")]
    pub flood_burst_per_user: u64,
    /// Requests of every endpoint one user has in the server at once:
    /// past it, 429 at the flood gate, so that one user on many client IDs
    /// never works the database on many requests at a time.
    #[serde(default = "default_requests_in_flight")]
    pub requests_in_flight_per_user: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            rebuild_rows_per_user: default_rebuild_rows_per_user(),
            rebuild_rows_total: default_rebuild_rows_total(),
            registrations_per_user_per_hour: default_registrations_per_hour(),
            pages_per_user: default_pages_per_user(),
            requests_per_user_per_second: default_requests_per_second(),
            request_burst_per_user: default_request_burst(),
            flood_requests_per_user_per_second: default_flood_per_second(),
            flood_burst_per_user: default_flood_burst(),
            requests_in_flight_per_user: default_requests_in_flight(),
            mutations_per_user_per_second: default_mutations_per_second(),
            mutation_burst_per_user: default_mutation_burst(),
            rebuild_stages_per_user_per_minute: default_stages_per_minute(),
        }
    }
}

/// A quarter of the default page permits: four users at their share leave room.
fn default_pages_per_user() -> usize {
    3
}

/// A device pulls every few seconds; a user has a few devices.
fn default_requests_per_second() -> u64 {
    20
}

fn default_request_burst() -> u64 {
    60
}

/// Far above what a person writes; a bulk import takes the burst, then
/// this (one user must not take all of capture on a small machine).
fn default_mutations_per_second() -> u64 {
    200
}

fn default_mutation_burst() -> u64 {
    2_000
}

/// A device rebuilds a scope when told to: a handful a minute is plenty.
fn default_stages_per_minute() -> u64 {
    20
}

fn default_flood_per_second() -> u64 {
    100
}

fn default_flood_burst() -> u64 {
    300
}

/// A device sends one request at a time; a user has a few devices.
fn default_requests_in_flight() -> usize {
    8
}

/// Enough for a few devices rebuilding a large scope at once.
fn default_rebuild_rows_per_user() -> u64 {
    100_000
}

fn default_rebuild_rows_total() -> u64 {
    2_000_000
}

/// A reinstall or a new device is a registration; 60 an hour is far past
/// any person's, and bounds a script's.
fn default_registrations_per_hour() -> u64 {
    60
}

/// Limits of WAL capture; every one finite.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CaptureConfig {
    /// How often an idle materializer records a heartbeat (milliseconds).
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// Readiness turns false when the last heartbeat is older than this (milliseconds).
    #[serde(default = "default_max_heartbeat_age_ms")]
    pub max_heartbeat_age_ms: u64,
    /// The pause before a failed or blocked feed is reopened (milliseconds).
    #[serde(default = "default_retry_ms")]
    pub retry_ms: u64,
    /// At most this many waiting source transactions share one database transaction.
    #[serde(default = "default_group_transactions")]
    pub group_transactions: usize,
    /// A group stops growing at this many row events.
    #[serde(default = "default_group_events")]
    pub group_events: usize,
    /// Readiness turns false when capture has not been caught up for this long (milliseconds).
    #[serde(default = "default_max_lag_ms")]
    pub max_lag_ms: u64,
    /// Readiness turns false when this much source WAL is not yet materialized.
    #[serde(default = "default_max_lag_bytes")]
    pub max_lag_bytes: u64,
    /// Rows in one chunk of a rematerialization (ADR 0020).
    #[serde(default = "default_rematerialize_chunk_rows")]
    pub rematerialize_chunk_rows: usize,
    /// The share of wall time (percent) a rematerialization may keep
    /// re-reading; it pauses for the rest, so that pulls beside it keep
    /// their latency (ADR 0027).
    #[serde(default = "default_rematerialize_share")]
    pub rematerialize_share: u32,
    /// The longest a baseline reads under its snapshot (milliseconds). Past
    /// it, the rows not yet read are handed over to re-reads, so the
    /// snapshot holds the database's xmin no longer (ADR 0030).
    #[serde(default = "default_baseline_snapshot_ms")]
    pub baseline_snapshot_ms: u64,
}

impl Default for CaptureConfig {
    fn default() -> Self {
        CaptureConfig {
            heartbeat_ms: default_heartbeat_ms(),
            max_heartbeat_age_ms: default_max_heartbeat_age_ms(),
            retry_ms: default_retry_ms(),
            group_transactions: default_group_transactions(),
            group_events: default_group_events(),
            max_lag_ms: default_max_lag_ms(),
            max_lag_bytes: default_max_lag_bytes(),
            rematerialize_chunk_rows: default_rematerialize_chunk_rows(),
            rematerialize_share: default_rematerialize_share(),
            baseline_snapshot_ms: default_baseline_snapshot_ms(),
        }
    }
}

/// Rows re-read under one watermark: their locks are held that long.
fn default_rematerialize_chunk_rows() -> usize {
    512
}

/// Full speed: the scopes a rematerialization gates answer 503 until it
/// ends (ADR 0027 weighs this against the latency of the others).
fn default_rematerialize_share() -> u32 {
    100
}

/// An hour: a baseline of about 40 million rows at this machine's rate;
/// a larger one finishes by the slower re-reads (ADR 0030).
fn default_baseline_snapshot_ms() -> u64 {
    3_600_000
}

fn default_max_lag_ms() -> u64 {
    60_000
}

fn default_max_lag_bytes() -> u64 {
    1 << 30
}

/// Source transactions per database transaction of the materializer.
fn default_group_transactions() -> usize {
    500
}

/// Row events per database transaction (a larger single source
/// transaction is still materialized whole).
fn default_group_events() -> usize {
    5_000
}

fn default_heartbeat_ms() -> u64 {
    1_000
}

fn default_max_heartbeat_age_ms() -> u64 {
    10_000
}

fn default_retry_ms() -> u64 {
    1_000
}

/// Server-wide protocol settings.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Connect answers 426 to an `app_version` that precedes this.
    pub minimum_client_version: Option<String>,
    /// SQL run at every start before validation, for development schemas
    /// (must be idempotent). A path relative to the config file.
    pub bootstrap_sql: Option<String>,
    /// Pull and rebuild pages built at once; a request past them answers `429 retry_later`.
    #[serde(default = "default_pull_pages")]
    pub pull_pages: usize,
    /// Open HTTP connections at once; one past them is answered 503 and closed.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// A request's head must arrive within this (milliseconds); a kept-alive
    /// connection waiting for its next request is closed after it too.
    #[serde(default = "default_header_timeout_ms")]
    pub header_timeout_ms: u64,
    /// A request's body must arrive within this once its head did (milliseconds).
    #[serde(default = "default_body_timeout_ms")]
    pub body_timeout_ms: u64,
    /// A pull or rebuild whose client's own writes await capture waits for
    /// them up to this (milliseconds) before it answers `503
    /// capture_pending`; zero answers at once.
    #[serde(default = "default_capture_wait_ms")]
    pub capture_wait_ms: u64,
    /// Connections of the pool that pushes, pulls, rebuilds and connects
    /// share (capture and the fence listener have their own).
    #[serde(default = "default_database_connections")]
    pub database_connections: u32,
}

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            minimum_client_version: None,
            bootstrap_sql: None,
            pull_pages: default_pull_pages(),
            max_connections: default_max_connections(),
            header_timeout_ms: default_header_timeout_ms(),
            body_timeout_ms: default_body_timeout_ms(),
            capture_wait_ms: default_capture_wait_ms(),
            database_connections: default_database_connections(),
        }
    }
}

/// Enough for the default 12 pull pages and a few pushes beside them, and
/// well below PostgreSQL's default `max_connections` of 100 for two processes.
fn default_database_connections() -> u32 {
    16
}

/// Well below the usual open-file limit (1024 soft is common: raise it).
fn default_max_connections() -> usize {
    512
}

fn default_header_timeout_ms() -> u64 {
    10_000
}

/// 1 MiB at 35 KiB/s.
fn default_body_timeout_ms() -> u64 {
    30_000
}

/// Capture materializes a commit in milliseconds; a second covers a burst
/// and stays well below a client's patience.
fn default_capture_wait_ms() -> u64 {
    1_000
}

/// Each page holds one database connection for its transaction.
fn default_pull_pages() -> usize {
    12
}

/// The sources of a client's authoritative scope assignment.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AssignmentConfig {
    /// Every user's own scope; `{user_id}` is the only placeholder. Empty to disable.
    #[serde(default = "default_user_scope")]
    pub user_scope: String,
    /// Scopes every user is assigned.
    #[serde(default)]
    pub shared: Vec<String>,
    /// Whether rows of `synchro.scope_grants (user_id, scope_id)` assign scopes.
    #[serde(default = "yes")]
    pub grants: bool,
    /// Scopes from a dependency relation keyed by user (e.g. team memberships).
    #[serde(default)]
    pub dependency: Vec<DependencyAssignment>,
}

impl Default for AssignmentConfig {
    fn default() -> Self {
        AssignmentConfig {
            user_scope: default_user_scope(),
            shared: Vec::new(),
            grants: true,
            dependency: Vec::new(),
        }
    }
}

fn default_user_scope() -> String {
    "user:{user_id}".into()
}

fn yes() -> bool {
    true
}

/// `scope` filled from `value_column` of the rows of `relation` whose `user_column` is the user.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(deny_unknown_fields)]
pub struct DependencyAssignment {
    pub relation: String,
    pub user_column: String,
    pub value_column: String,
    /// A template with the single placeholder `{<value_column>}`.
    pub scope: String,
}

/// One synced table.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TableConfig {
    pub table_id: String,
    pub relation_id: String,
    /// Schema-qualified physical relation, e.g. `public.notes`.
    pub relation: String,
    /// Human-readable name in the manifest.
    pub name: String,
    /// Column name of the primary key.
    pub primary_key: String,
    #[serde(default)]
    pub lifecycle: LifecycleConfig,
    pub fields: Vec<FieldConfig>,
    /// Membership rules: which scopes a row belongs to.
    #[serde(default)]
    pub scopes: Vec<MembershipRule>,
    /// Optional declarative write rule: the column that must equal the pushing user.
    pub owner_column: Option<String>,
}

/// Lifecycle columns by column name.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LifecycleConfig {
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
    pub deleted_at: Option<String>,
}

/// One synced column.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FieldConfig {
    pub field_id: String,
    pub column: String,
    #[serde(rename = "type")]
    pub portable_type: String,
    #[serde(default)]
    pub nullable: bool,
    #[serde(default)]
    pub writable: bool,
    pub precision: Option<u32>,
    pub scale: Option<u32>,
}

/// A membership rule of a table.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(untagged, deny_unknown_fields)]
pub enum MembershipRule {
    /// A template over the row's own columns, e.g. `user:{owner_id}`.
    Template { template: String },
    /// Every row belongs to one shared scope.
    Constant { constant: String },
    /// A template over rows of a dependency relation joined by a column.
    Dependency {
        /// The dependency relation, e.g. `public.note_shares`.
        via: String,
        /// Its column that references this table's `column`.
        key: String,
        /// This table's column that `key` references.
        column: String,
        /// A template over the dependency row's columns, e.g. `team:{team_id}`.
        template: String,
    },
}

/// A config that breaks a rule; the message names the table and column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(msg.into()))
}

/// A scope template: literal text with `{name}` placeholders.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScopeTemplate {
    parts: Vec<TemplatePart>,
}

/// A placeholder's value was the empty string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmptyValue;

#[derive(Clone, Debug, PartialEq, Eq)]
enum TemplatePart {
    Literal(String),
    Placeholder(String),
}

impl ScopeTemplate {
    /// Parses `text`; braces only delimit nonempty placeholder names.
    pub fn parse(text: &str) -> Result<ScopeTemplate, ConfigError> {
        let mut parts = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(TemplatePart::Literal(rest[..open].to_owned()));
            }
            let Some(close) = rest[open..].find('}') else {
                return err(format!("scope template `{text}` has an unclosed `{{`"));
            };
            let name = &rest[open + 1..open + close];
            if name.is_empty() || name.contains('{') {
                return err(format!(
                    "scope template `{text}` has an empty or nested placeholder"
                ));
            }
            parts.push(TemplatePart::Placeholder(name.to_owned()));
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return err(format!("scope template `{text}` has an unmatched `}}`"));
        }
        if !rest.is_empty() {
            parts.push(TemplatePart::Literal(rest.to_owned()));
        }
        if parts.is_empty() {
            return err("a scope template must not be empty");
        }
        Ok(ScopeTemplate { parts })
    }

    /// The placeholder names, in order.
    pub fn placeholders(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            TemplatePart::Placeholder(n) => Some(n.as_str()),
            TemplatePart::Literal(_) => None,
        })
    }

    /// Fills placeholders: `Ok(None)` when a value is missing (SQL NULL: no
    /// scope), `Err(EmptyValue)` when one is empty, which names no scope a
    /// user can be assigned and so is never dropped silently.
    pub fn render(
        &self,
        value: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, EmptyValue> {
        let mut out = String::new();
        for p in &self.parts {
            match p {
                TemplatePart::Literal(l) => out.push_str(l),
                TemplatePart::Placeholder(n) => {
                    let Some(v) = value(n) else {
                        return Ok(None);
                    };
                    if v.is_empty() {
                        return Err(EmptyValue);
                    }
                    out.push_str(&v);
                }
            }
        }
        Ok(Some(out))
    }

    /// Whether some values render this template to `scope_id`. Only single-placeholder
    /// templates are matched exactly; others match by their literal prefix.
    pub fn could_produce(&self, scope_id: &str) -> bool {
        match self.parts.as_slice() {
            [TemplatePart::Literal(l)] => scope_id == l,
            [TemplatePart::Literal(pre), TemplatePart::Placeholder(_)] => {
                scope_id.len() > pre.len() && scope_id.starts_with(pre.as_str())
            }
            [TemplatePart::Placeholder(_), TemplatePart::Literal(post)] => {
                scope_id.len() > post.len() && scope_id.ends_with(post.as_str())
            }
            [
                TemplatePart::Literal(pre),
                TemplatePart::Placeholder(_),
                TemplatePart::Literal(post),
            ] => {
                scope_id.len() > pre.len() + post.len()
                    && scope_id.starts_with(pre.as_str())
                    && scope_id.ends_with(post.as_str())
            }
            [TemplatePart::Placeholder(_)] => !scope_id.is_empty(),
            parts => match parts.first() {
                Some(TemplatePart::Literal(pre)) => scope_id.starts_with(pre.as_str()),
                _ => true,
            },
        }
    }
}

/// `schema.name`: both parts nonempty identifiers.
fn check_relation(what: &str, relation: &str) -> Result<(), ConfigError> {
    let ok = relation
        .split_once('.')
        .is_some_and(|(s, n)| is_identifier(s) && is_identifier(n));
    if ok {
        Ok(())
    } else {
        err(format!(
            "{what}: relation `{relation}` must be schema-qualified, like `public.notes`"
        ))
    }
}

/// A plain SQL identifier: lowercase letters, digits and `_`, not starting with a digit.
pub fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !s.as_bytes()[0].is_ascii_digit()
}

impl SyncConfig {
    /// Parses and validates a config file's text.
    pub fn from_toml(text: &str) -> Result<SyncConfig, ConfigError> {
        let config: SyncConfig =
            toml::from_str(text).map_err(|e| ConfigError(format!("config: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    /// The rules that need no database.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.retention.check().map_err(ConfigError)?;
        if !(1..=1024).contains(&self.server.pull_pages) {
            return err("server.pull_pages must be within 1..=1024");
        }
        if !(1..=1024).contains(&self.server.database_connections) {
            return err("server.database_connections must be within 1..=1024");
        }
        let sv = &self.server;
        if sv.max_connections == 0 || sv.header_timeout_ms == 0 || sv.body_timeout_ms == 0 {
            return err(
                "server.max_connections, header_timeout_ms and body_timeout_ms must be positive",
            );
        }
        let l = &self.limits;
        let max_batch = protocol::limits::MAX_MUTATIONS as u64;
        if [
            l.rebuild_rows_per_user,
            l.registrations_per_user_per_hour,
            l.pages_per_user as u64,
            l.requests_per_user_per_second,
            l.request_burst_per_user,
            l.mutations_per_user_per_second,
            l.rebuild_stages_per_user_per_minute,
            l.flood_requests_per_user_per_second,
            l.flood_burst_per_user,
            l.requests_in_flight_per_user as u64,
        ]
        .contains(&0)
        {
            return err("limits: every limit must be positive");
        }
        if l.rebuild_rows_total < l.rebuild_rows_per_user {
            return err("limits.rebuild_rows_total must be at least rebuild_rows_per_user");
        }
        if l.flood_requests_per_user_per_second < l.requests_per_user_per_second
            || l.flood_burst_per_user < l.request_burst_per_user
        {
            return err(
                "limits.flood_requests_per_user_per_second and flood_burst_per_user must be \
                 at least requests_per_user_per_second and request_burst_per_user",
            );
        }
        if l.requests_in_flight_per_user < l.pages_per_user {
            return err("limits.requests_in_flight_per_user must be at least pages_per_user");
        }
        if l.mutation_burst_per_user < max_batch {
            return err("limits.mutation_burst_per_user must hold one full batch (1000)");
        }
        if let Some(v) = &self.server.minimum_client_version {
            semver::Version::parse(v).map_err(|_| {
                ConfigError(format!(
                    "server.minimum_client_version `{v}` is not SemVer 2.0.0"
                ))
            })?;
        }
        let a = &self.assignment;
        if !a.user_scope.is_empty() {
            let t = ScopeTemplate::parse(&a.user_scope)?;
            if t.placeholders().any(|p| p != "user_id") {
                return err("assignment.user_scope may use only the placeholder {user_id}");
            }
        }
        for s in &a.shared {
            if ScopeTemplate::parse(s)?.placeholders().next().is_some() {
                return err(format!(
                    "assignment.shared scope `{s}` must not have placeholders"
                ));
            }
        }
        for d in &a.dependency {
            check_relation("assignment.dependency", &d.relation)?;
            for c in [&d.user_column, &d.value_column] {
                if !is_identifier(c) {
                    return err(format!(
                        "assignment.dependency {}: column `{c}` is not a plain identifier",
                        d.relation
                    ));
                }
            }
            let t = ScopeTemplate::parse(&d.scope)?;
            if t.placeholders().collect::<Vec<_>>() != [d.value_column.as_str()] {
                return err(format!(
                    "assignment.dependency {}: scope must use exactly the placeholder {{{}}}",
                    d.relation, d.value_column
                ));
            }
        }
        let c = &self.capture;
        for (name, v) in [
            ("heartbeat_ms", c.heartbeat_ms),
            ("max_heartbeat_age_ms", c.max_heartbeat_age_ms),
            ("retry_ms", c.retry_ms),
            ("max_lag_ms", c.max_lag_ms),
        ] {
            if !(1..=3_600_000).contains(&v) {
                return err(format!("capture.{name} must be 1..=3600000"));
            }
        }
        if !(1..=1 << 40).contains(&c.max_lag_bytes) {
            return err("capture.max_lag_bytes must be 1..=1099511627776");
        }
        if !(1..=100_000).contains(&c.group_transactions)
            || !(1..=1_000_000).contains(&c.group_events)
        {
            return err(
                "capture.group_transactions must be 1..=100000 and capture.group_events 1..=1000000",
            );
        }
        if !(1..=10_000).contains(&c.rematerialize_chunk_rows) {
            return err("capture.rematerialize_chunk_rows must be 1..=10000");
        }
        if !(1..=100).contains(&c.rematerialize_share) {
            return err("capture.rematerialize_share must be 1..=100");
        }
        if !(1..=604_800_000).contains(&c.baseline_snapshot_ms) {
            return err("capture.baseline_snapshot_ms must be 1..=604800000");
        }
        if c.max_heartbeat_age_ms <= c.heartbeat_ms {
            return err("capture.max_heartbeat_age_ms must exceed capture.heartbeat_ms");
        }
        let mut table_ids = BTreeSet::new();
        let mut relation_ids = BTreeSet::new();
        for t in &self.tables {
            if !table_ids.insert(&t.table_id) {
                return err(format!("table {}: table_id is used twice", t.table_id));
            }
            if !relation_ids.insert(&t.relation_id) {
                return err(format!(
                    "table {}: relation_id `{}` is used twice",
                    t.table_id, t.relation_id
                ));
            }
            t.validate()?;
        }
        // A `via` relation's rows are dependency rows, read before the
        // tables they decide (ADR 0020, ADR 0030); a registered table's
        // are its own rows. One relation cannot be both.
        let registered: BTreeSet<&String> = self.tables.iter().map(|t| &t.relation).collect();
        for t in &self.tables {
            for rule in &t.scopes {
                if let MembershipRule::Dependency { via, .. } = rule
                    && registered.contains(via)
                {
                    return err(format!(
                        "table {}: via relation `{via}` is a registered table",
                        t.table_id
                    ));
                }
            }
        }
        Ok(())
    }

    /// The current manifest's tables.
    pub fn table_manifests(&self) -> Result<Vec<TableManifest>, ConfigError> {
        self.tables.iter().map(TableConfig::manifest).collect()
    }
}

impl TableConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let t = &self.table_id;
        check_relation(&format!("table {t}"), &self.relation)?;
        let mut field_ids = BTreeSet::new();
        let mut columns = BTreeSet::new();
        for f in &self.fields {
            if !field_ids.insert(&f.field_id) {
                return err(format!(
                    "table {t}: field_id `{}` is used twice",
                    f.field_id
                ));
            }
            if !is_identifier(&f.column) {
                return err(format!(
                    "table {t}: column `{}` is not a plain identifier",
                    f.column
                ));
            }
            if !columns.insert(&f.column) {
                return err(format!("table {t}: column `{}` is synced twice", f.column));
            }
            f.field_type()
                .map_err(|e| ConfigError(format!("table {t}, column {}: {e}", f.column)))?;
        }
        let column = |c: &str| self.fields.iter().find(|f| f.column == c);
        let Some(pk) = column(&self.primary_key) else {
            return err(format!(
                "table {t}: primary key column `{}` is not a synced field",
                self.primary_key
            ));
        };
        for (what, c) in [
            ("created_at", &self.lifecycle.created_at),
            ("updated_at", &self.lifecycle.updated_at),
            ("deleted_at", &self.lifecycle.deleted_at),
        ] {
            if let Some(c) = c
                && column(c).is_none()
            {
                return err(format!(
                    "table {t}: lifecycle {what} column `{c}` is not a synced field"
                ));
            }
        }
        if let Some(c) = &self.lifecycle.deleted_at
            && column(c).is_some_and(|f| !f.nullable)
        {
            return err(format!(
                "table {t}: lifecycle deleted_at column `{c}` must be nullable"
            ));
        }
        if let Some(c) = &self.owner_column
            && column(c).is_none()
        {
            return err(format!(
                "table {t}: owner_column `{c}` is not a synced field"
            ));
        }
        if self.scopes.is_empty() {
            return err(format!(
                "table {t}: at least one membership rule (scopes) is required"
            ));
        }
        for rule in &self.scopes {
            match rule {
                MembershipRule::Template { template } => {
                    for p in ScopeTemplate::parse(template)?.placeholders() {
                        if column(p).is_none() {
                            return err(format!(
                                "table {t}: scope template `{template}` uses `{p}`, not a synced column"
                            ));
                        }
                    }
                }
                MembershipRule::Constant { constant } => {
                    if ScopeTemplate::parse(constant)?
                        .placeholders()
                        .next()
                        .is_some()
                    {
                        return err(format!(
                            "table {t}: constant scope `{constant}` must not have placeholders"
                        ));
                    }
                }
                MembershipRule::Dependency {
                    via,
                    key,
                    column: own,
                    template,
                } => {
                    check_relation(&format!("table {t}"), via)?;
                    if !is_identifier(key) {
                        return err(format!(
                            "table {t}: dependency key `{key}` is not a plain identifier"
                        ));
                    }
                    if *own != self.primary_key {
                        return err(format!(
                            "table {t}: dependency column `{own}` must be the primary key `{}`",
                            self.primary_key
                        ));
                    }
                    for p in ScopeTemplate::parse(template)?.placeholders() {
                        if !is_identifier(p) {
                            return err(format!(
                                "table {t}: dependency template uses `{p}`, not a plain identifier"
                            ));
                        }
                    }
                }
            }
        }
        let key_type = pk.field_type().map_err(|e| ConfigError(e.to_string()))?;
        if key_type.nullable || !key_type.ty.is_key_type() {
            return err(format!(
                "table {t}: primary key column `{}` must be a non-null string, int or int64",
                self.primary_key
            ));
        }
        self.manifest().map(|_| ())
    }

    /// The field ID synced from column `c`.
    pub fn field_id_of(&self, c: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|f| f.column == c)
            .map(|f| f.field_id.as_str())
    }

    /// This table's manifest entry.
    pub fn manifest(&self) -> Result<TableManifest, ConfigError> {
        let t = &self.table_id;
        let fields = self
            .fields
            .iter()
            .map(|f| {
                let ty = f
                    .field_type()
                    .map_err(|e| ConfigError(format!("table {t}, column {}: {e}", f.column)))?;
                FieldManifest::new(&f.field_id, &f.column, ty, f.writable)
                    .map_err(|e| ConfigError(format!("table {t}, column {}: {e}", f.column)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let id = |c: &Option<String>| {
            c.as_deref()
                .and_then(|c| self.field_id_of(c))
                .map(str::to_owned)
        };
        let lifecycle = Lifecycle {
            created_at_field_id: id(&self.lifecycle.created_at),
            updated_at_field_id: id(&self.lifecycle.updated_at),
            deleted_at_field_id: id(&self.lifecycle.deleted_at),
        };
        let single =
            self.scopes.len() == 1 && !matches!(self.scopes[0], MembershipRule::Dependency { .. });
        let composition = if single {
            Composition::SingleScope
        } else {
            Composition::MultiScope
        };
        let pk = self.field_id_of(&self.primary_key).unwrap_or_default();
        TableManifest::new(
            t,
            &self.relation_id,
            &self.name,
            composition,
            pk,
            lifecycle,
            fields,
        )
        .map_err(|ManifestError(e)| ConfigError(format!("table {t}: {e}")))
    }
}

impl FieldConfig {
    /// The declared portable type with nullability and decimal bounds.
    pub fn field_type(&self) -> Result<FieldType, String> {
        let ty = PortableType::from_name(&self.portable_type)
            .ok_or_else(|| format!("`{}` is not a portable type", self.portable_type))?;
        let decimal = match (ty, self.precision, self.scale) {
            (PortableType::Decimal, Some(precision), Some(scale))
                if precision > 0 && scale <= precision =>
            {
                Some(DecimalBounds { precision, scale })
            }
            (PortableType::Decimal, _, _) => {
                return Err("decimal needs precision > 0 and scale <= precision".into());
            }
            (_, None, None) => None,
            _ => return Err("only decimal fields take precision and scale".into()),
        };
        Ok(FieldType {
            ty,
            nullable: self.nullable,
            decimal,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates() {
        let t = ScopeTemplate::parse("team:{team_id}").unwrap();
        assert_eq!(t.placeholders().collect::<Vec<_>>(), ["team_id"]);
        assert_eq!(t.render(|_| Some("t9".into())), Ok(Some("team:t9".into())));
        assert_eq!(t.render(|_| None), Ok(None));
        assert_eq!(t.render(|_| Some(String::new())), Err(EmptyValue));
        assert!(t.could_produce("team:t9"));
        assert!(!t.could_produce("team:"));
        assert!(!t.could_produce("user:t9"));
        assert!(ScopeTemplate::parse("a{").is_err());
        assert!(ScopeTemplate::parse("a{}").is_err());
        assert!(ScopeTemplate::parse("a}").is_err());
        assert!(ScopeTemplate::parse("").is_err());
        assert!(
            ScopeTemplate::parse("public")
                .unwrap()
                .could_produce("public")
        );
    }
}

#[cfg(test)]
mod example_tests {
    use super::*;

    #[test]
    fn the_example_config_is_valid() {
        let c = SyncConfig::from_toml(include_str!("../../examples/notes/config.toml")).unwrap();
        let tables = c.table_manifests().unwrap();
        assert_eq!(tables.len(), 2);
        assert_eq!(
            tables[0].composition(),
            protocol::manifest::Composition::MultiScope
        );
        assert_eq!(
            tables[1].composition(),
            protocol::manifest::Composition::SingleScope
        );
    }
}

#[cfg(test)]
mod validation_tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../examples/notes/config.toml");

    fn rejects(edit: impl Fn(String) -> String, expected: &str) {
        let e = SyncConfig::from_toml(&edit(EXAMPLE.to_owned())).unwrap_err();
        assert!(e.0.contains(expected), "expected `{expected}` in `{e}`");
    }

    #[test]
    fn each_rule_gives_its_message() {
        rejects(
            |s| s.replace("table_id = \"tbl_templates\"", "table_id = \"tbl_notes\""),
            "table tbl_notes: table_id is used twice",
        );
        rejects(
            |s| {
                s.replace(
                    "relation_id = \"rel_templates\"",
                    "relation_id = \"rel_notes\"",
                )
            },
            "table tbl_templates: relation_id `rel_notes` is used twice",
        );
        rejects(
            |s| s.replace("via = \"public.note_shares\"", "via = \"public.templates\""),
            "table tbl_notes: via relation `public.templates` is a registered table",
        );
        rejects(
            |s| {
                s.replace(
                    "relation = \"public.templates\"",
                    "relation = \"templates\"",
                )
            },
            "table tbl_templates: relation `templates` must be schema-qualified",
        );
        rejects(
            |s| {
                s.replace(
                    "field_id = \"fld_templates_name\"",
                    "field_id = \"fld_templates_id\"",
                )
            },
            "table tbl_templates: field_id `fld_templates_id` is used twice",
        );
        rejects(
            |s| {
                s.replace(
                    "column = \"name\", type = \"string\"",
                    "column = \"id\", type = \"string\"",
                )
            },
            "table tbl_templates: column `id` is synced twice",
        );
        rejects(
            |s| {
                s.replace(
                    "column = \"name\", type = \"string\"",
                    "column = \"name\", type = \"text\"",
                )
            },
            "table tbl_templates, column name: `text` is not a portable type",
        );
        rejects(
            |s| {
                s.replace(
                    "column = \"name\", type = \"string\"",
                    "column = \"name\", type = \"decimal\"",
                )
            },
            "table tbl_templates, column name: decimal needs precision > 0 and scale <= precision",
        );
        rejects(
            |s| {
                s.replace(
                    "column = \"name\", type = \"string\"",
                    "column = \"name\", type = \"string\", precision = 3, scale = 1",
                )
            },
            "only decimal fields take precision and scale",
        );
        rejects(
            |s| {
                s.replace(
                    "primary_key = \"id\"\nfields = [\n  { field_id = \"fld_templates_id\"",
                    "primary_key = \"key\"\nfields = [\n  { field_id = \"fld_templates_id\"",
                )
            },
            "table tbl_templates: primary key column `key` is not a synced field",
        );
        rejects(
            |s| {
                s.replace(
                    "{ field_id = \"fld_templates_id\", column = \"id\", type = \"string\" }",
                    "{ field_id = \"fld_templates_id\", column = \"id\", type = \"float\" }",
                )
            },
            "table tbl_templates: primary key column `id` must be a non-null string, int or int64",
        );
        rejects(
            |s| {
                s.replace("{ field_id = \"fld_templates_id\", column = \"id\", type = \"string\" }", "{ field_id = \"fld_templates_id\", column = \"id\", type = \"string\", nullable = true }")
            },
            "must be a non-null string, int or int64",
        );
        rejects(
            |s| {
                s.replace(
                    "deleted_at = \"deleted_at\" }",
                    "deleted_at = \"gone_at\" }",
                )
            },
            "table tbl_notes: lifecycle deleted_at column `gone_at` is not a synced field",
        );
        rejects(
            |s| {
                s.replace(
                    "column = \"deleted_at\", type = \"datetime\", nullable = true",
                    "column = \"deleted_at\", type = \"datetime\"",
                )
            },
            "table tbl_notes: lifecycle deleted_at column `deleted_at` must be nullable",
        );
        rejects(
            |s| s.replace("owner_column = \"owner_id\"", "owner_column = \"author\""),
            "table tbl_notes: owner_column `author` is not a synced field",
        );
        rejects(
            |s| {
                s.replace(
                    "{ template = \"user:{owner_id}\" }",
                    "{ template = \"user:{author}\" }",
                )
            },
            "table tbl_notes: scope template `user:{author}` uses `author`, not a synced column",
        );
        rejects(
            |s| {
                s.replace(
                    "scopes = [{ constant = \"templates_public\" }]",
                    "scopes = []",
                )
            },
            "table tbl_templates: at least one membership rule (scopes) is required",
        );
        rejects(
            |s| {
                s.replace(
                    "{ constant = \"templates_public\" }",
                    "{ constant = \"t:{x}\" }",
                )
            },
            "table tbl_templates: constant scope `t:{x}` must not have placeholders",
        );
        rejects(
            |s| {
                s.replace(
                    "column = \"id\", template = \"team:{team_id}\"",
                    "column = \"nid\", template = \"team:{team_id}\"",
                )
            },
            "table tbl_notes: dependency column `nid` must be the primary key `id`",
        );
        rejects(
            |s| s.replace("[server]", "[capture]\nheartbeat_ms = 0\n\n[server]"),
            "capture.heartbeat_ms must be 1..=3600000",
        );
        rejects(
            |s| {
                s.replace(
                    "[server]",
                    "[capture]\nheartbeat_ms = 500\nmax_heartbeat_age_ms = 500\n\n[server]",
                )
            },
            "capture.max_heartbeat_age_ms must exceed capture.heartbeat_ms",
        );
        rejects(
            |s| s.replace("[server]", "[capture]\nmax_lag_bytes = 0\n\n[server]"),
            "capture.max_lag_bytes must be 1..=1099511627776",
        );
        rejects(
            |s| {
                s.replace(
                    "[server]",
                    "[capture]\nrematerialize_chunk_rows = 0\n\n[server]",
                )
            },
            "capture.rematerialize_chunk_rows must be 1..=10000",
        );
        for connections in [0, 1025] {
            rejects(
                |s| {
                    s.replace(
                        "[server]",
                        &format!("[server]\ndatabase_connections = {connections}"),
                    )
                },
                "server.database_connections must be within 1..=1024",
            );
        }
        for share in [0, 101] {
            rejects(
                |s| {
                    s.replace(
                        "[server]",
                        &format!("[capture]\nrematerialize_share = {share}\n\n[server]"),
                    )
                },
                "capture.rematerialize_share must be 1..=100",
            );
        }
        for ms in [0, 604_800_001] {
            rejects(
                |s| {
                    s.replace(
                        "[server]",
                        &format!("[capture]\nbaseline_snapshot_ms = {ms}\n\n[server]"),
                    )
                },
                "capture.baseline_snapshot_ms must be 1..=604800000",
            );
        }
        rejects(
            |s| s.replace("[server]", "[capture]\ngroup_events = 0\n\n[server]"),
            "capture.group_transactions must be 1..=100000 and capture.group_events 1..=1000000",
        );
        rejects(
            |s| {
                s.replace(
                    "user_scope = \"user:{user_id}\"",
                    "user_scope = \"user:{uid}\"",
                )
            },
            "assignment.user_scope may use only the placeholder {user_id}",
        );
        rejects(
            |s| s.replace("shared = [\"templates_public\"]", "shared = [\"t:{x}\"]"),
            "assignment.shared scope `t:{x}` must not have placeholders",
        );
        rejects(
            |s| s.replace("scope = \"team:{team_id}\"", "scope = \"team:{user_id}\""),
            "assignment.dependency public.team_members: scope must use exactly the placeholder {team_id}",
        );
        rejects(
            |s| {
                s.replace(
                    "minimum_client_version = \"1.0.0\"",
                    "minimum_client_version = \"1.0\"",
                )
            },
            "server.minimum_client_version `1.0` is not SemVer 2.0.0",
        );
        rejects(
            |s| s.replace("[server]", "[server]\ncolour = 1"),
            "unknown field `colour`",
        );
        rejects(
            |s| {
                s.replace(
                    "[server]",
                    "[limits]\nrequests_in_flight_per_user = 0\n\n[server]",
                )
            },
            "limits: every limit must be positive",
        );
        rejects(
            |s| {
                s.replace(
                    "[server]",
                    "[limits]\npages_per_user = 4\nrequests_in_flight_per_user = 3\n\n[server]",
                )
            },
            "limits.requests_in_flight_per_user must be at least pages_per_user",
        );
    }
}
