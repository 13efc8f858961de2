//! The pull stream's lineage (ADR 003 "Incremental cursor bindings"): what
//! a cursor binds besides its position, and what makes an authentic cursor
//! stale. The stream generation (only a stream reset changes it), the
//! retention generation and its floor, the membership generation of each
//! scope (a change of the scope rules that can place rows in it), the
//! token keys every process shares, and each client's acknowledged
//! checkpoints.

use std::collections::BTreeMap;

use protocol::ids::ScopeId;
use protocol::json::{self, Value};
use protocol::token::{KeyRing, KeyState, TokenKey, TokenKind};

use crate::capture::{Rematerialization, model_fingerprints};
use crate::config::{MembershipRule, ScopeTemplate, SyncConfig};
use crate::store::{Store, StoreError, StoreTx};

pub mod state;
pub use state::{Checkpoint, MembershipRules, StreamState};

/// The membership generation of every scope, from the rules' history.
#[derive(Clone, Debug, Default)]
pub struct MembershipLineage {
    /// (generation, templates whose scopes that change affected).
    changes: Vec<(u64, Vec<ScopeTemplate>)>,
}

/// The first membership generation: the rules the stream started with.
pub const FIRST_MEMBERSHIP_GENERATION: u64 = 1;

impl MembershipLineage {
    /// The lineage of a stored history (in any order).
    pub fn new(history: &[MembershipRules]) -> MembershipLineage {
        let mut changes = Vec::new();
        let mut rows: Vec<&MembershipRules> = history.iter().collect();
        rows.sort_by(|a, b| (&a.table_id, a.generation).cmp(&(&b.table_id, b.generation)));
        for (i, r) in rows.iter().enumerate() {
            if r.generation == FIRST_MEMBERSHIP_GENERATION {
                continue;
            }
            // A change affects the scopes of the rules before and after it.
            let before = i
                .checked_sub(1)
                .map(|j| rows[j])
                .filter(|p| p.table_id == r.table_id);
            let templates = r
                .templates
                .iter()
                .chain(before.into_iter().flat_map(|p| &p.templates))
                .filter_map(|t| ScopeTemplate::parse(t).ok())
                .collect();
            changes.push((r.generation, templates));
        }
        MembershipLineage { changes }
    }

    /// The generation of the last rule change that could move rows into or out of `scope`.
    pub fn generation_of(&self, scope: &ScopeId) -> u64 {
        self.changes
            .iter()
            .filter(|(_, ts)| ts.iter().any(|t| t.could_produce(scope.as_str())))
            .map(|(g, _)| *g)
            .max()
            .unwrap_or(FIRST_MEMBERSHIP_GENERATION)
    }
}

/// Canonical JSON of a table's rules: it changes exactly when they do.
pub fn rules_fingerprint(rules: &[MembershipRule]) -> String {
    rules_of(rules).0
}

/// The table's rules as stored: canonical JSON and the templates.
fn rules_of(rules: &[MembershipRule]) -> (String, Vec<String>) {
    let mut templates = Vec::new();
    let items = rules.iter().map(|r| match r {
        MembershipRule::Template { template } => {
            templates.push(template.clone());
            json::object([("template", Value::string(template))])
        }
        MembershipRule::Constant { constant } => {
            templates.push(constant.clone());
            json::object([("constant", Value::string(constant))])
        }
        MembershipRule::Dependency {
            via,
            key,
            column,
            template,
        } => {
            templates.push(template.clone());
            json::object([
                ("via", Value::string(via)),
                ("key", Value::string(key)),
                ("column", Value::string(column)),
                ("template", Value::string(template)),
            ])
        }
    });
    let text =
        String::from_utf8_lossy(&json::to_canonical(&Value::Array(items.collect()))).into_owned();
    (text, templates)
}

/// Brings the stored rule history up to the config: a table whose rules
/// changed (or that is new after the first start) gets the next generation.
/// Runs in the caller's transaction.
pub async fn reconcile_membership<T: StoreTx>(
    tx: &mut T,
    config: &SyncConfig,
) -> Result<MembershipLineage, StoreError> {
    let mut history = tx.membership_rules().await?;
    let next = history
        .iter()
        .map(|r| r.generation)
        .max()
        .map_or(FIRST_MEMBERSHIP_GENERATION, |g| g + 1);
    let mut added = Vec::new();
    for t in &config.tables {
        let (fingerprint, templates) = rules_of(&t.scopes);
        let current = history
            .iter()
            .filter(|r| r.table_id == t.table_id)
            .max_by_key(|r| r.generation);
        if current.is_some_and(|c| c.fingerprint == fingerprint) {
            continue;
        }
        added.push(MembershipRules {
            table_id: t.table_id.clone(),
            generation: next,
            fingerprint,
            templates,
        });
    }
    if !added.is_empty() {
        tx.insert_membership_rules(&added).await?;
        history.extend(added);
    }
    Ok(MembershipLineage::new(&history))
}

/// Brings the rematerialization records up to the config (ADR 0020): a
/// captured relation whose model changed owes a re-read of its rows from
/// the start, unless no record was ever kept (a store from before records:
/// its state is taken as made under this model). A baseline that has not
/// begun owes every relation anyway (its first chunk says so), and one a
/// crash cut short has read part of the relation under the old model
/// (ADR 0030). A relation that left the config owes nothing. Runs in the
/// caller's transaction.
pub async fn reconcile_rematerializations<T: StoreTx>(
    tx: &mut T,
    config: &SyncConfig,
) -> Result<(), StoreError> {
    let stored: BTreeMap<String, Rematerialization> = tx
        .rematerializations()
        .await?
        .into_iter()
        .map(|r| (r.relation.clone(), r))
        .collect();
    let fingerprints = model_fingerprints(config);
    let mut changed = Vec::new();
    for (relation, fingerprint) in &fingerprints {
        let pending = match stored.get(relation) {
            Some(r) if &r.fingerprint == fingerprint => continue,
            _ => !stored.is_empty(),
        };
        changed.push(Rematerialization {
            relation: relation.clone(),
            fingerprint: fingerprint.clone(),
            pending,
            after: None,
            rows: 0,
        });
    }
    // A relation no longer captured owes nothing, and its record no longer
    // matches any model: a leader still running an older config gives way.
    for r in stored.values() {
        if !fingerprints.contains_key(&r.relation) && (r.pending || !r.fingerprint.is_empty()) {
            changed.push(Rematerialization {
                fingerprint: String::new(),
                pending: false,
                after: None,
                ..r.clone()
            });
        }
    }
    tx.put_rematerializations(&changed).await
}

/// The key ring every process shares: created on first start (one active
/// key per kind, secrets from the store's entropy), then read.
pub async fn load_key_ring<S: Store>(store: &S) -> Result<KeyRing, StoreError> {
    let mut tx = store.begin().await?;
    let mut keys = tx.token_keys().await?;
    tx.commit().await?;
    if keys.is_empty() {
        let mut fresh = Vec::new();
        for (kind, key_id) in [
            (TokenKind::IncrementalCursor, "ic-1"),
            (TokenKind::RebuildContinuation, "rc-1"),
        ] {
            fresh.push(TokenKey {
                key_id: key_id.to_owned(),
                kind,
                state: KeyState::Active,
                secret: store.fresh_secret().await?,
            });
        }
        // Another process starting at once may win; its keys are then ours.
        let mut tx = store.begin().await?;
        tx.insert_token_keys(&fresh).await?;
        keys = tx.token_keys().await?;
        tx.commit().await?;
    }
    KeyRing::new(keys).map_err(|e| StoreError::Integrity(format!("stored token keys: {e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(table: &str, generation: u64, templates: &[&str]) -> MembershipRules {
        MembershipRules {
            table_id: table.into(),
            generation,
            fingerprint: format!("{templates:?}"),
            templates: templates.iter().map(|t| (*t).to_owned()).collect(),
        }
    }

    #[test]
    fn a_rule_change_moves_only_the_scopes_it_can_touch() {
        let s = |id: &str| ScopeId::parse(id).unwrap();
        let history = [
            rules("notes", 1, &["user:{owner}"]),
            rules("tags", 1, &["shared"]),
            // notes moved from user scopes to team scopes at generation 2.
            rules("notes", 2, &["team:{team}"]),
            // a new table placing rows in `shared` at generation 3.
            rules("boards", 3, &["shared"]),
        ];
        let lineage = MembershipLineage::new(&history);
        assert_eq!(
            lineage.generation_of(&s("user:u1")),
            2,
            "the old rules' scopes"
        );
        assert_eq!(
            lineage.generation_of(&s("team:t1")),
            2,
            "the new rules' scopes"
        );
        assert_eq!(lineage.generation_of(&s("shared")), 3);
        assert_eq!(lineage.generation_of(&s("other")), 1, "untouched");
    }
}
