//! A group of consecutive source transactions -> one combined
//! [`Materialization`]. For each transaction, in order: apply the images to
//! the projections, evaluate membership against the state after the whole
//! transaction, diff each affected row's scopes, and emit per-scope effects.
//!
//! The prior state the group needs is read up front in a few set-based
//! reads (the group's rows, the dependency rows they touch or are joined
//! with); each transaction then works on the state its predecessors left.
//! A row touched several times in one transaction gets its effects once, at
//! the ordinal of its last event, with its final image: a transaction's
//! intermediate states were never visible to anyone, and the final image's
//! version is the one the version table holds.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use protocol::digest::{RowDigester, RowIdentity};
use protocol::ids::{ScopeId, ServerVersion};
use protocol::json::{self, Value};
use protocol::manifest::Row;

use super::model::{Model, Rule, Table};
use crate::capture::{
    CaptureProblem, CapturedRow, ChangeKind, DependencyRow, Effect, EffectOp, Lsn, Materialization,
    MaterializedTransaction, Membership, Projection, SourceImage, SourceTransaction,
};
use crate::config::EmptyValue;
use crate::store::{StoreError, StoreTx};

/// What a group produced: the combined writes of the transactions that
/// materialized, and the first one that could not (which blocks capture).
pub(crate) struct GroupOutcome {
    pub combined: Option<Materialization>,
    pub problem: Option<(Lsn, CaptureProblem)>,
}

/// The state the group works on: projections and dependency rows as the
/// last transaction left them (`None` = absent), and which of them the
/// group changed (what its combined materialization writes).
#[derive(Default)]
struct State {
    projections: BTreeMap<(String, RowIdentity), Option<Projection>>,
    dependencies: BTreeMap<(String, String), Option<SourceImage>>,
    changed_rows: BTreeSet<(String, RowIdentity)>,
    changed_dependencies: BTreeSet<(String, String)>,
    /// Rows that had a projection before the group, with their scopes then.
    existed: BTreeMap<(String, RowIdentity), BTreeSet<ScopeId>>,
    /// How to undo the current transaction's changes if it cannot materialize.
    undo: Vec<Undo>,
}

/// One change to [`State`], with what it replaced.
enum Undo {
    Projection((String, RowIdentity), Option<Option<Projection>>, bool),
    Dependency((String, String), Option<Option<SourceImage>>, bool),
}

impl State {
    /// Sets a row's projection (`None`: absent) for the current transaction.
    fn set_projection(&mut self, slot: (String, RowIdentity), p: Option<Projection>) {
        let newly = self.changed_rows.insert(slot.clone());
        let old = self.projections.insert(slot.clone(), p);
        self.undo.push(Undo::Projection(slot, old, newly));
    }

    /// Sets a dependency row (`None`: absent); returns the image it replaced.
    fn set_dependency(
        &mut self,
        slot: (String, String),
        image: Option<SourceImage>,
    ) -> Option<SourceImage> {
        let newly = self.changed_dependencies.insert(slot.clone());
        let old = self.dependencies.insert(slot.clone(), image);
        self.undo.push(Undo::Dependency(slot, old.clone(), newly));
        old.flatten()
    }

    /// Reverts the current transaction's changes, newest first.
    fn roll_back(&mut self) {
        while let Some(u) = self.undo.pop() {
            match u {
                Undo::Projection(slot, old, newly) => {
                    if newly {
                        self.changed_rows.remove(&slot);
                    }
                    match old {
                        Some(v) => self.projections.insert(slot, v),
                        None => self.projections.remove(&slot),
                    };
                }
                Undo::Dependency(slot, old, newly) => {
                    if newly {
                        self.changed_dependencies.remove(&slot);
                    }
                    match old {
                        Some(v) => self.dependencies.insert(slot, v),
                        None => self.dependencies.remove(&slot),
                    };
                }
            }
        }
    }
}

/// Materializes `group` (consecutive transactions, none yet durable) on the
/// state `tx` holds.
pub(crate) async fn materialize_group<T: StoreTx>(
    tx: &mut T,
    model: &Model,
    group: &[SourceTransaction],
) -> Result<GroupOutcome, StoreError> {
    let state = prefetch(tx, model, group, Prior::Stored).await?;
    Ok(off_the_workers(|| {
        run(state, model, group, Effects::Emitted)
    }))
}

/// Materializes one chunk of the baseline (ADR 0033): none of its rows was
/// ever materialized (a baseline reads each row once, into a stream whose
/// materialized state a reset or an empty start cleared), so no prior state
/// of them is read; and it emits no effects: no cursor stands before the
/// baseline (every scope answers `503` until its relations are read in
/// full), so its rows reach clients by rebuild, from the membership index.
pub(crate) async fn materialize_baseline_chunk<T: StoreTx>(
    tx: &mut T,
    model: &Model,
    chunk: &SourceTransaction,
) -> Result<GroupOutcome, StoreError> {
    let group = std::slice::from_ref(chunk);
    let state = prefetch(tx, model, group, Prior::None).await?;
    let mut outcome = off_the_workers(|| run(state, model, group, Effects::None));
    if let Some(m) = outcome.combined.as_mut() {
        assert!(m.effects.is_empty(), "a baseline chunk emits no effects");
        assert!(
            m.put_projections.is_empty() && m.removed_projections.is_empty() && m.left.is_empty(),
            "a baseline chunk only adds rows"
        );
        m.baseline = true;
    }
    Ok(outcome)
}

/// Whether the group's rows may have been materialized before it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Prior {
    /// Read what the store holds of them.
    Stored,
    /// None can exist: every slot starts absent, unread.
    None,
}

/// Whether a transaction's scope changes become effects.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Effects {
    Emitted,
    None,
}

/// Works through `group` on `state`, transaction by transaction.
fn run(
    mut state: State,
    model: &Model,
    group: &[SourceTransaction],
    effects: Effects,
) -> GroupOutcome {
    let mut combined: Option<Materialization> = None;
    let mut digester = RowDigester::default();
    for source in group {
        state.undo.clear();
        match materialize(&mut state, model, source, &mut digester, effects) {
            Ok(m) => match combined.as_mut() {
                None => combined = Some(m),
                Some(c) => absorb(c, m),
            },
            Err(problem) => {
                // The blocked transaction leaves nothing behind.
                state.roll_back();
                return GroupOutcome {
                    combined: combined.map(|c| finish(c, state)),
                    problem: Some((source.commit_lsn, problem)),
                };
            }
        }
    }
    GroupOutcome {
        combined: combined.map(|c| finish(c, state)),
        problem: None,
    }
}

/// Runs CPU-bound work (a group's projections and digests: tens of
/// milliseconds for a re-read chunk) without holding a worker of a
/// multi-threaded runtime, whose other tasks (requests) would otherwise
/// wait behind it. The simulator's runtime has one thread: there it runs
/// in place.
fn off_the_workers<R>(work: impl FnOnce() -> R) -> R {
    #[cfg(not(madsim))]
    if tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
    {
        return tokio::task::block_in_place(work);
    }
    work()
}

/// Reads, in a few set-based statements, every prior state the group can touch.
async fn prefetch<T: StoreTx>(
    tx: &mut T,
    model: &Model,
    group: &[SourceTransaction],
    prior: Prior,
) -> Result<State, StoreError> {
    let mut state = State::default();
    // Dependency rows the group changes, by identity.
    let mut changed: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for e in group.iter().flat_map(|t| &t.events) {
        if model.impacts.contains_key(&e.relation) {
            changed
                .entry(&e.relation)
                .or_default()
                .insert(identity_of(&e.identity));
        }
    }
    for (relation, ids) in &changed {
        let ids: Vec<String> = ids.iter().cloned().collect();
        if prior == Prior::Stored {
            for d in tx.dependency_rows_by_identity(relation, &ids).await? {
                state
                    .dependencies
                    .insert((d.relation, d.identity), Some(d.image));
            }
        }
        for id in ids {
            state
                .dependencies
                .entry(((*relation).to_owned(), id))
                .or_insert(None);
        }
    }
    // Registered rows: written ones, and those a dependency change impacts
    // (through the old image as stored, or any image in the group).
    let mut keys: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for e in group.iter().flat_map(|t| &t.events) {
        if let Some(table) = model.tables.get(&e.relation) {
            if let Some(Some(k)) = e.identity.get(&table.primary_key) {
                keys.entry(table.manifest.table_id().to_owned())
                    .or_default()
                    .insert(k.clone());
            }
        } else if let Some(impacts) = model.impacts.get(&e.relation) {
            let stored = state
                .dependencies
                .get(&(e.relation.clone(), identity_of(&e.identity)))
                .cloned()
                .flatten();
            for image in [stored.as_ref(), e.new.as_ref()].into_iter().flatten() {
                for i in impacts {
                    if let Some(Some(k)) = image.get(&i.key) {
                        keys.entry(i.table_id.clone())
                            .or_default()
                            .insert(k.clone());
                    }
                }
            }
        }
    }
    for (table_id, ks) in &keys {
        let Some(table) = model.table(table_id) else {
            continue;
        };
        // A key that is not a valid key value is reported when its event is materialized.
        let identities: Vec<RowIdentity> = ks
            .iter()
            .filter_map(|k| table.identity(k).ok().map(|(_, i)| i))
            .collect();
        for id in &identities {
            state
                .projections
                .insert((table_id.clone(), id.clone()), None);
        }
        let stored = match prior {
            Prior::Stored => tx.projections(table_id, &identities).await?,
            Prior::None => Vec::new(),
        };
        for p in stored {
            let slot = (p.table_id.clone(), p.identity.clone());
            state.existed.insert(slot.clone(), p.scopes.clone());
            state.projections.insert(slot, Some(p));
        }
        // The dependency rows joined to these rows, for membership.
        for rule in &table.rules {
            if let Rule::Via { via, key, .. } = rule {
                let values: Vec<String> = ks.iter().cloned().collect();
                for d in tx.dependency_rows(via, key, &values).await? {
                    state
                        .dependencies
                        .entry((d.relation, d.identity))
                        .or_insert(Some(d.image));
                }
            }
        }
    }
    Ok(state)
}

/// The state of one registered row during a transaction.
struct RowState {
    table_id: String,
    key: String,
    wire_key: Value,
    before: Option<Projection>,
    /// `Some(Err(version))` after a delete, at its deletion fence's version;
    /// `None` while untouched.
    after: Option<Result<(Value, Row, ServerVersion), ServerVersion>>,
    /// The ordinal of the last event that touched or impacted the row.
    ordinal: u64,
}

/// Materializes one transaction on `state`, leaving the state after it.
fn materialize(
    state: &mut State,
    model: &Model,
    source: &SourceTransaction,
    digester: &mut RowDigester,
    effects: Effects,
) -> Result<Materialization, CaptureProblem> {
    if let Some(p) = &source.problem {
        return Err(p.clone());
    }
    let mut notes: BTreeMap<(String, String), VecDeque<_>> = BTreeMap::new();
    for n in &source.notes {
        notes
            .entry((n.table_id.clone(), n.key.clone()))
            .or_default()
            .push_back(n);
    }
    let mut rows: BTreeMap<(String, RowIdentity), RowState> = BTreeMap::new();
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
                // The key guard forbids key changes: the relation drifted.
                return Err(CaptureProblem::RelationDrift);
            }
            let note = notes
                .get_mut(&(table_id.to_owned(), key.clone()))
                .and_then(VecDeque::pop_front)
                .ok_or(CaptureProblem::VersionNoteMismatch)?;
            if note.client {
                fences.push(note.fence);
            }
            let version =
                ServerVersion::parse(&note.version).ok_or(CaptureProblem::VersionNoteMismatch)?;
            let row = row_state(state, &mut rows, table, &key)?;
            row.ordinal = ordinal;
            row.after = Some(match (&event.kind, &event.new) {
                (ChangeKind::Delete, _) => Err(version),
                (_, Some(new)) => {
                    let base = match &row.after {
                        Some(after) => after.as_ref().ok().map(|(r, _, _)| r),
                        None => row.before.as_ref().map(|p| &p.row),
                    };
                    let (wire, decoded) = table.wire_row(new, base)?;
                    Ok((wire, decoded, version))
                }
                (_, None) => return Err(CaptureProblem::Undecodable),
            });
        } else if let Some(impacts) = model.impacts.get(&event.relation) {
            let old_slot = (event.relation.clone(), identity_of(&event.identity));
            let old = state.set_dependency(old_slot, None);
            if let Some(new) = &event.new {
                let id_columns: SourceImage = event
                    .identity
                    .keys()
                    .map(|c| (c.clone(), new.get(c).cloned().flatten()))
                    .collect();
                let slot = (event.relation.clone(), identity_of(&id_columns));
                state.set_dependency(slot, Some(new.clone()));
            }
            // A re-read dependency row refreshes the stored image only: the
            // tables it decides are re-read after it (ADR 0020).
            let impacts = if source.reread { &[][..] } else { &impacts[..] };
            for impact in impacts {
                let table = model
                    .table(&impact.table_id)
                    .ok_or(CaptureProblem::RelationDrift)?;
                for image in [old.as_ref(), event.new.as_ref()].into_iter().flatten() {
                    if let Some(Some(key)) = image.get(&impact.key) {
                        let row = row_state(state, &mut rows, table, key)?;
                        row.ordinal = row.ordinal.max(ordinal);
                    }
                }
            }
        }
        // Other relations are not published; nothing else arrives.
    }
    if notes.values().any(|q| !q.is_empty()) {
        return Err(CaptureProblem::VersionNoteMismatch);
    }

    let mut out = Materialization {
        commit_lsn: source.commit_lsn,
        end_lsn: source.end_lsn,
        transactions: vec![MaterializedTransaction {
            commit_lsn: source.commit_lsn,
            end_lsn: source.end_lsn,
            row_events: source.events.len() as u64,
        }],
        fences,
        ..Materialization::default()
    };
    // Every row's membership is judged against the dependency rows after
    // the whole transaction: found by their join column's value.
    let joins = Joins::of(state, model);
    for ((_, identity), mut row) in rows {
        let table = model
            .table(&row.table_id)
            .ok_or(CaptureProblem::RelationDrift)?;
        let touched = row.after.is_some();
        let touched_after = row.after.take();
        let old_scopes = row
            .before
            .as_ref()
            .map(|p| p.scopes.clone())
            .unwrap_or_default();
        let slot = (row.table_id.clone(), identity.clone());
        // The row after the transaction, or the version it was deleted at.
        let after = match touched_after {
            Some(after) => after.map(|(wire, decoded, v)| (wire, Some(decoded), v)),
            None => match row.before.as_ref() {
                Some(p) => Ok((p.row.clone(), None, p.version.clone())),
                // Impacted but never projected: it is in no scope.
                None => {
                    state.set_projection(slot, None);
                    continue;
                }
            },
        };
        let (wire, mut decoded, version) = match after {
            Ok(after) => after,
            Err(deleted_at) => {
                for scope in &old_scopes {
                    out.effects.push(effect(
                        scope,
                        &row,
                        &identity,
                        EffectOp::Remove(deleted_at.clone()),
                        source,
                    ));
                }
                state.set_projection(slot, None);
                continue;
            }
        };
        // A re-read row is a change only where it differs from what is
        // stored (its content, version, or whether it is a tombstone).
        let touched = touched
            && !(source.reread
                && row.before.as_ref().is_some_and(|p| {
                    p.row == wire
                        && p.version == version
                        && p.tombstone == table.is_tombstone(&wire)
                }));
        let current = model.manifest.schema_version();
        let stale = row
            .before
            .as_ref()
            .is_some_and(|p| p.schema_version != current);
        if decoded.is_none() && stale {
            match wire.as_object().map(|o| table.manifest.decode_row(o)) {
                Some(Ok(d)) => decoded = Some(d),
                // Projected under a model the current manifest cannot read:
                // its table's rematerialization re-reads it (ADR 0020).
                _ => continue,
            }
        }
        let scopes = membership(&joins, table, &wire)?;
        if !touched && scopes == old_scopes && !stale {
            continue;
        }
        let decoded = match decoded {
            Some(d) => d,
            None => wire
                .as_object()
                .and_then(|o| table.manifest.decode_row(o).ok())
                .ok_or(CaptureProblem::InvalidValue)?,
        };
        let digest = digester.digest(
            &model.manifest.hash(),
            &table.manifest,
            &identity,
            &decoded,
            &version,
        );
        let tombstone = table.is_tombstone(&wire);
        // A baseline's rows reach clients by rebuild: no effect, and no
        // effect's copy of the row.
        if effects == Effects::Emitted {
            let captured = CapturedRow {
                row: json::to_canonical_string(&wire),
                version: version.clone(),
                digest,
                schema_version: Some(model.manifest.schema_version()),
            };
            for scope in &scopes {
                if touched || !old_scopes.contains(scope) {
                    let op = if tombstone {
                        EffectOp::Tombstone(captured.clone())
                    } else {
                        EffectOp::Upsert(captured.clone())
                    };
                    out.effects.push(effect(scope, &row, &identity, op, source));
                }
            }
        }
        // Leaving a scope: the row's version now, whether or not this
        // transaction wrote it.
        for scope in old_scopes.difference(&scopes) {
            out.effects.push(effect(
                scope,
                &row,
                &identity,
                EffectOp::Remove(version.clone()),
                source,
            ));
        }
        let projection = Projection {
            table_id: row.table_id.clone(),
            identity,
            key: row.key.clone(),
            row: wire,
            version,
            digest,
            schema_version: model.manifest.schema_version(),
            tombstone,
            scopes,
        };
        state.set_projection(slot, Some(projection));
    }
    number_effects(&mut out.effects);
    Ok(out)
}

/// The row's state in this transaction, starting from what the group left.
fn row_state<'a>(
    state: &State,
    rows: &'a mut BTreeMap<(String, RowIdentity), RowState>,
    table: &Table,
    key: &str,
) -> Result<&'a mut RowState, CaptureProblem> {
    let table_id = table.manifest.table_id().to_owned();
    let (wire_key, identity) = table.identity(key)?;
    let slot = (table_id.clone(), identity);
    let before = state.projections.get(&slot).cloned().flatten();
    Ok(rows.entry(slot).or_insert_with(|| RowState {
        table_id,
        key: key.to_owned(),
        wire_key,
        before,
        after: None,
        ordinal: 0,
    }))
}

/// The dependency rows of a state, by the value of the column each `via`
/// rule joins on: a row's joined rows are looked up, not found by
/// scanning every dependency row of the relation (which, for a baseline
/// chunk of notes and their shares, was quadratic in the chunk).
#[derive(Default)]
struct Joins {
    /// via relation -> join column -> value -> the rows holding it.
    rows: BTreeMap<String, BTreeMap<String, BTreeMap<String, Vec<SourceImage>>>>,
}

impl Joins {
    fn of(state: &State, model: &Model) -> Joins {
        let mut joins = Joins::default();
        let rules = model.tables.values().flat_map(|t| &t.rules);
        for rule in rules {
            let Rule::Via { via, key, .. } = rule else {
                continue;
            };
            let by_value = joins
                .rows
                .entry(via.clone())
                .or_default()
                .entry(key.clone())
                .or_default();
            if !by_value.is_empty() {
                continue; // another table's rule joins the same way
            }
            let images = (state.dependencies.range((via.clone(), String::new())..))
                .take_while(|((r, _), _)| r == via)
                .filter_map(|(_, image)| image.as_ref());
            for image in images {
                if let Some(Some(value)) = image.get(key) {
                    by_value
                        .entry(value.clone())
                        .or_default()
                        .push(image.clone());
                }
            }
        }
        joins
    }

    /// The rows of `via` whose `key` column holds `value`.
    fn joined(&self, via: &str, key: &str, value: &str) -> &[SourceImage] {
        (self.rows.get(via))
            .and_then(|k| k.get(key))
            .and_then(|v| v.get(value))
            .map_or(&[], Vec::as_slice)
    }
}

/// The scopes of a row whose state after the transaction is `row`.
fn membership(
    joins: &Joins,
    table: &Table,
    row: &Value,
) -> Result<BTreeSet<ScopeId>, CaptureProblem> {
    let mut scopes = BTreeSet::new();
    // An empty placeholder value is as invalid as an ID too long: it blocks.
    let mut add = |rendered: Result<Option<String>, EmptyValue>| -> Result<(), CaptureProblem> {
        if let Some(s) = rendered.map_err(|_| CaptureProblem::InvalidScopeId)? {
            scopes.insert(ScopeId::parse(&s).ok_or(CaptureProblem::InvalidScopeId)?);
        }
        Ok(())
    };
    for rule in &table.rules {
        match rule {
            Rule::Own(t) => add(t.render(|c| table.render_value(row, c)))?,
            Rule::Constant(c) => add(Ok(Some(c.clone())))?,
            Rule::Via { via, key, template } => {
                let Some(own) = table.render_value(row, &table.primary_key) else {
                    continue;
                };
                for image in joins.joined(via, key, &own) {
                    add(template.render(|c| image.get(c).cloned().flatten()))?;
                }
            }
        }
    }
    Ok(scopes)
}

fn effect(
    scope: &ScopeId,
    row: &RowState,
    identity: &RowIdentity,
    op: EffectOp,
    source: &SourceTransaction,
) -> Effect {
    Effect {
        scope: scope.clone(),
        commit_lsn: source.commit_lsn,
        event_ordinal: row.ordinal,
        effect_ordinal: 0,
        table_id: row.table_id.clone(),
        identity: identity.clone(),
        key: row.wire_key.clone(),
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

/// Adds a later transaction's writes to the combined ones.
fn absorb(c: &mut Materialization, m: Materialization) {
    c.commit_lsn = m.commit_lsn;
    c.end_lsn = m.end_lsn;
    c.transactions.extend(m.transactions);
    c.effects.extend(m.effects);
    c.fences.extend(m.fences);
}

/// Each projection and dependency row the group changed, as the last
/// transaction left it: written once. Takes the state, whose projections
/// move into the writes instead of being copied (the copies were about 6%
/// of the materializer's CPU samples).
fn finish(mut c: Materialization, mut state: State) -> Materialization {
    let none = BTreeSet::new();
    for slot in &state.changed_rows {
        let before = state.existed.get(slot);
        let after = state.projections.remove(slot).flatten();
        // Membership changes against the scopes before the group: a row
        // whose scopes did not change writes nothing to the index.
        let now = after.as_ref().map_or(&none, |p| &p.scopes);
        let then = before.unwrap_or(&none);
        let member = |scope: &ScopeId| Membership {
            scope: scope.clone(),
            table_id: slot.0.clone(),
            identity: slot.1.clone(),
        };
        c.joined.extend(now.difference(then).map(member));
        c.left.extend(then.difference(now).map(member));
        match after {
            Some(p) if before.is_some() => c.put_projections.push(p),
            Some(p) => c.new_projections.push(p),
            None if before.is_some() => c.removed_projections.push(slot.clone()),
            None => {} // created and deleted within the group
        }
    }
    for slot in &state.changed_dependencies {
        match state.dependencies.remove(slot).flatten() {
            Some(image) => c.put_dependencies.push(DependencyRow {
                relation: slot.0.clone(),
                identity: slot.1.clone(),
                image,
            }),
            None => c.removed_dependencies.push(slot.clone()),
        }
    }
    c
}

/// Canonical JSON of identity columns: the dependency row's key.
pub(crate) fn identity_of(identity: &SourceImage) -> String {
    crate::capture::image_json(identity)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capture::{SourceEvent, VersionNote};
    use crate::config::SyncConfig;
    use crate::store::{MemStore, Store};

    const CONFIG: &str = include_str!("../../../examples/notes/config.toml");
    const N1: &str = "00000000-0000-4000-8000-000000000001";
    const N2: &str = "00000000-0000-4000-8000-000000000002";

    fn image(cols: &[(&str, &str)]) -> SourceImage {
        cols.iter()
            .map(|(c, v)| ((*c).to_owned(), Some((*v).to_owned())))
            .collect()
    }

    fn insert_note(id: &str, owner: &str, version: &str) -> (SourceEvent, VersionNote) {
        let mut new = image(&[
            ("id", id),
            ("owner_id", owner),
            ("title", "t"),
            ("pinned", "f"),
            ("updated_at", "2026-07-18 14:00:01+00"),
        ]);
        new.insert("body".into(), None);
        new.insert("deleted_at".into(), None);
        let event = SourceEvent {
            relation: "public.notes".into(),
            kind: ChangeKind::Insert,
            identity: image(&[("id", id)]),
            new: Some(new),
        };
        let note = VersionNote {
            table_id: "tbl_notes".into(),
            key: id.into(),
            version: version.into(),
            fence: 1,
            client: false,
        };
        (event, note)
    }

    /// A transaction that cannot materialize leaves nothing in the group's
    /// writes, even what it changed before it failed.
    #[tokio::test]
    async fn a_blocked_transaction_leaves_nothing_behind() {
        let config = SyncConfig::from_toml(CONFIG).unwrap();
        let store = MemStore::new();
        let _engine = crate::Engine::start(store.clone(), config.clone())
            .await
            .unwrap();
        let mut tx = store.begin().await.unwrap();
        let manifest = tx.manifests().await.unwrap().pop().unwrap();
        let model = Model::new(&config, manifest).unwrap();

        let (e1, n1) = insert_note(N1, "alice", "v1");
        let first = SourceTransaction {
            commit_lsn: 10,
            end_lsn: 11,
            events: vec![e1],
            notes: vec![n1],
            ..SourceTransaction::empty(10, 11)
        };
        // Shares n1 with team red, then writes a note whose owner scope ID is too long.
        let share = SourceEvent {
            relation: "public.note_shares".into(),
            kind: ChangeKind::Insert,
            identity: image(&[("note_id", N1), ("team_id", "red")]),
            new: Some(image(&[("note_id", N1), ("team_id", "red")])),
        };
        let (e2, n2) = insert_note(N2, &"x".repeat(600), "v2");
        let second = SourceTransaction {
            commit_lsn: 20,
            end_lsn: 21,
            events: vec![share, e2],
            notes: vec![n2],
            ..SourceTransaction::empty(20, 21)
        };
        let outcome = materialize_group(&mut tx, &model, &[first, second])
            .await
            .unwrap();
        assert_eq!(outcome.problem, Some((20, CaptureProblem::InvalidScopeId)));
        let m = outcome.combined.unwrap();
        assert_eq!(m.commit_lsn, 10);
        assert_eq!(m.transactions.len(), 1);
        assert!(m.put_dependencies.is_empty() && m.removed_dependencies.is_empty());
        assert!(m.put_projections.is_empty() && m.removed_projections.is_empty());
        assert_eq!(m.new_projections.len(), 1);
        let scopes: Vec<&str> = m.new_projections[0]
            .scopes
            .iter()
            .map(ScopeId::as_str)
            .collect();
        assert_eq!(scopes, ["user:alice"], "the failed share did not leak");
        assert!(m.effects.iter().all(|e| e.commit_lsn == 10));
    }
}
