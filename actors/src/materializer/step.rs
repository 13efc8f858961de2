//! One source transaction -> one [`Materialization`]: apply the images to
//! the projections, evaluate membership against the state after the whole
//! transaction, diff each affected row's scopes, and emit per-scope effects.
//!
//! A row touched several times in one transaction gets its effects once, at
//! the ordinal of its last event, with its final image: a transaction's
//! intermediate states were never visible to anyone, and the version of the
//! final image is the one the version table holds.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use protocol::digest::{RowDigester, RowIdentity};
use protocol::ids::{ScopeId, ServerVersion};
use protocol::json::{self, Value};

use super::model::{Model, Rule, Table};
use crate::capture::{
    CaptureProblem, CapturedRow, ChangeKind, DependencyRow, Effect, EffectOp, Materialization,
    Projection, SourceImage, SourceTransaction,
};
use crate::store::{StoreError, StoreTx};

/// A store failure (retry the whole transaction) or a quarantine class.
#[derive(Debug)]
pub(crate) enum StepError {
    Store(StoreError),
    Problem(CaptureProblem),
}

impl From<StoreError> for StepError {
    fn from(e: StoreError) -> StepError {
        StepError::Store(e)
    }
}

impl From<CaptureProblem> for StepError {
    fn from(p: CaptureProblem) -> StepError {
        StepError::Problem(p)
    }
}

/// The state of one registered row during the transaction.
struct RowState {
    table_id: String,
    key: String,
    wire_key: Value,
    before: Option<Projection>,
    /// `Some(None)` after a delete; `None` while untouched.
    after: Option<Option<(Value, ServerVersion)>>,
    /// The ordinal of the last event that touched or impacted the row.
    ordinal: u64,
}

/// The dependency rows this transaction changed: (relation, identity) -> image after.
type DependencyOverlay = BTreeMap<(String, String), Option<SourceImage>>;

/// Builds the durable outcome of `source`, reading prior state through `tx`.
pub(crate) async fn materialize<T: StoreTx>(
    tx: &mut T,
    model: &Model,
    source: &SourceTransaction,
) -> Result<Materialization, StepError> {
    if let Some(p) = &source.problem {
        return Err(p.clone().into());
    }
    let mut notes: BTreeMap<(String, String), VecDeque<_>> = BTreeMap::new();
    for n in &source.notes {
        notes
            .entry((n.table_id.clone(), n.key.clone()))
            .or_default()
            .push_back(n);
    }
    let mut rows: BTreeMap<(String, RowIdentity), RowState> = BTreeMap::new();
    let mut deps = DependencyOverlay::new();
    let mut fences = Vec::new();

    for (ordinal, event) in source.events.iter().enumerate() {
        let ordinal = ordinal as u64;
        if let Some(table) = model.tables.get(&event.relation) {
            let table_id = table.manifest.table_id();
            let key = event
                .identity
                .get(&table.primary_key)
                .cloned()
                .flatten()
                .ok_or(CaptureProblem::RelationDrift)?;
            if let Some(new) = &event.new
                && new.get(&table.primary_key) != Some(&Some(key.clone()))
            {
                // The BEFORE UPDATE guard forbids key changes: the relation drifted.
                return Err(CaptureProblem::RelationDrift.into());
            }
            let note = notes
                .get_mut(&(table_id.to_owned(), key.clone()))
                .and_then(VecDeque::pop_front)
                .ok_or(CaptureProblem::VersionNoteMismatch)?;
            fences.push(note.fence);
            let version =
                ServerVersion::parse(&note.version).ok_or(CaptureProblem::VersionNoteMismatch)?;
            let state = row_state(tx, &mut rows, table, &key).await?;
            state.ordinal = ordinal;
            state.after = Some(match (&event.kind, &event.new) {
                (ChangeKind::Delete, _) => None,
                (_, Some(new)) => {
                    let base = match &state.after {
                        Some(after) => after.as_ref().map(|(row, _)| row),
                        None => state.before.as_ref().map(|p| &p.row),
                    };
                    Some((table.wire_row(new, base)?, version))
                }
                (_, None) => return Err(CaptureProblem::Undecodable.into()),
            });
        } else if let Some(impacts) = model.impacts.get(&event.relation) {
            let old_id = identity_of(&event.identity);
            let old = match deps.get(&(event.relation.clone(), old_id.clone())) {
                Some(image) => image.clone(),
                None => tx
                    .dependency_row(&event.relation, &old_id)
                    .await?
                    .map(|d| d.image),
            };
            deps.insert((event.relation.clone(), old_id), None);
            if let Some(new) = &event.new {
                let id_columns: SourceImage = event
                    .identity
                    .keys()
                    .map(|c| (c.clone(), new.get(c).cloned().flatten()))
                    .collect();
                deps.insert(
                    (event.relation.clone(), identity_of(&id_columns)),
                    Some(new.clone()),
                );
            }
            for impact in impacts {
                let table = model
                    .table(&impact.table_id)
                    .ok_or(CaptureProblem::RelationDrift)?;
                for image in [old.as_ref(), event.new.as_ref()].into_iter().flatten() {
                    if let Some(Some(key)) = image.get(&impact.key) {
                        let state = row_state(tx, &mut rows, table, key).await?;
                        state.ordinal = state.ordinal.max(ordinal);
                    }
                }
            }
        }
        // Other relations are not in the publication; nothing to do.
    }
    if notes.values().any(|q| !q.is_empty()) {
        return Err(CaptureProblem::VersionNoteMismatch.into());
    }

    let mut out = Materialization {
        commit_lsn: source.commit_lsn,
        end_lsn: source.end_lsn,
        fences,
        ..Materialization::default()
    };
    for ((relation, identity), image) in &deps {
        match image {
            Some(image) => out.put_dependencies.push(DependencyRow {
                relation: relation.clone(),
                identity: identity.clone(),
                image: image.clone(),
            }),
            None => out
                .removed_dependencies
                .push((relation.clone(), identity.clone())),
        }
    }
    let mut digester = RowDigester::default();
    for ((_, identity), state) in rows {
        let table = model
            .table(&state.table_id)
            .ok_or(CaptureProblem::RelationDrift)?;
        let touched = state.after.is_some();
        let after = match state.after.clone() {
            Some(after) => after,
            None => state
                .before
                .as_ref()
                .map(|p| (p.row.clone(), p.version.clone())),
        };
        let old_scopes = state
            .before
            .as_ref()
            .map(|p| p.scopes.clone())
            .unwrap_or_default();
        let Some((row, version)) = after else {
            for scope in &old_scopes {
                out.effects.push(effect(
                    scope,
                    &state,
                    &identity,
                    EffectOp::Delete(None),
                    source,
                ));
            }
            if state.before.is_some() {
                out.removed_projections
                    .push((state.table_id.clone(), identity.clone()));
            }
            continue;
        };
        let scopes = membership(tx, table, &row, &deps).await?;
        if !touched && scopes == old_scopes {
            continue;
        }
        let decoded = row
            .as_object()
            .and_then(|o| table.manifest.decode_row(o).ok())
            .ok_or(CaptureProblem::InvalidValue)?;
        let digest = digester.digest(
            &model.manifest.hash(),
            &table.manifest,
            &identity,
            &decoded,
            &version,
        );
        let tombstone = table.is_tombstone(&row);
        let captured = CapturedRow {
            row: json::to_canonical_string(&row),
            version: version.clone(),
            digest,
        };
        for scope in &scopes {
            if touched || !old_scopes.contains(scope) {
                let op = if tombstone {
                    EffectOp::Delete(Some(captured.clone()))
                } else {
                    EffectOp::Upsert(captured.clone())
                };
                out.effects
                    .push(effect(scope, &state, &identity, op, source));
            }
        }
        for scope in old_scopes.difference(&scopes) {
            out.effects.push(effect(
                scope,
                &state,
                &identity,
                EffectOp::Delete(None),
                source,
            ));
        }
        out.put_projections.push(Projection {
            table_id: state.table_id.clone(),
            identity,
            key: state.key.clone(),
            row,
            version,
            digest,
            schema_version: model.manifest.schema_version(),
            tombstone,
            scopes,
        });
    }
    number_effects(&mut out.effects);
    Ok(out)
}

/// The row's state, loading its projection the first time it is seen.
async fn row_state<'a, T: StoreTx>(
    tx: &mut T,
    rows: &'a mut BTreeMap<(String, RowIdentity), RowState>,
    table: &Table,
    key: &str,
) -> Result<&'a mut RowState, StepError> {
    let table_id = table.manifest.table_id().to_owned();
    let (wire_key, identity) = table.identity(key)?;
    let slot = (table_id.clone(), identity.clone());
    if !rows.contains_key(&slot) {
        let before = tx
            .projections(&table_id, std::slice::from_ref(&identity))
            .await?
            .pop();
        rows.insert(
            slot.clone(),
            RowState {
                table_id,
                key: key.to_owned(),
                wire_key,
                before,
                after: None,
                ordinal: 0,
            },
        );
    }
    rows.get_mut(&slot)
        .ok_or(StepError::Problem(CaptureProblem::MissingProjection))
}

/// The scopes of a row whose state after the transaction is `row`.
async fn membership<T: StoreTx>(
    tx: &mut T,
    table: &Table,
    row: &Value,
    deps: &DependencyOverlay,
) -> Result<BTreeSet<ScopeId>, StepError> {
    let mut scopes = BTreeSet::new();
    let mut add = |rendered: Option<String>| -> Result<(), CaptureProblem> {
        if let Some(s) = rendered {
            scopes.insert(ScopeId::parse(&s).ok_or(CaptureProblem::InvalidScopeId)?);
        }
        Ok(())
    };
    for rule in &table.rules {
        match rule {
            Rule::Own(t) => add(t.render(|c| table.render_value(row, c)))?,
            Rule::Constant(c) => add(Some(c.clone()))?,
            Rule::Via { via, key, template } => {
                let Some(own) = table.render_value(row, &table.primary_key) else {
                    continue;
                };
                let mut images: BTreeMap<String, SourceImage> = tx
                    .dependency_rows(via, key, std::slice::from_ref(&own))
                    .await?
                    .into_iter()
                    .map(|d| (d.identity, d.image))
                    .collect();
                for ((relation, identity), image) in deps {
                    if relation != via {
                        continue;
                    }
                    match image {
                        Some(image) if image.get(key) == Some(&Some(own.clone())) => {
                            images.insert(identity.clone(), image.clone());
                        }
                        _ => {
                            images.remove(identity);
                        }
                    }
                }
                for image in images.values() {
                    add(template.render(|c| image.get(c).cloned().flatten()))?;
                }
            }
        }
    }
    Ok(scopes)
}

fn effect(
    scope: &ScopeId,
    state: &RowState,
    identity: &RowIdentity,
    op: EffectOp,
    source: &SourceTransaction,
) -> Effect {
    Effect {
        scope: scope.clone(),
        commit_lsn: source.commit_lsn,
        event_ordinal: state.ordinal,
        effect_ordinal: 0,
        table_id: state.table_id.clone(),
        identity: identity.clone(),
        key: state.wire_key.clone(),
        op,
    }
}

/// Numbers the effects of each (event, scope) by row identity bytes: the
/// canonical order, so both stores and every replay agree.
fn number_effects(effects: &mut [Effect]) {
    effects.sort_by(|a, b| {
        (
            a.event_ordinal,
            a.scope.as_str().as_bytes(),
            a.identity.as_bytes(),
        )
            .cmp(&(
                b.event_ordinal,
                b.scope.as_str().as_bytes(),
                b.identity.as_bytes(),
            ))
    });
    let mut previous: Option<(u64, ScopeId)> = None;
    let mut next = 0;
    for e in effects.iter_mut() {
        let group = (e.event_ordinal, e.scope.clone());
        if previous.as_ref() != Some(&group) {
            next = 0;
            previous = Some(group);
        }
        e.effect_ordinal = next;
        next += 1;
    }
}

/// Canonical JSON of identity columns: the dependency row's key.
pub(crate) fn identity_of(identity: &SourceImage) -> String {
    let members = identity.iter().map(|(c, v)| {
        (
            c.clone(),
            v.as_ref().map_or(Value::Null, |s| Value::string(s.clone())),
        )
    });
    json::to_canonical_string(&Value::Object(members.collect()))
}
