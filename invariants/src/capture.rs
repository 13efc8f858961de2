//! Capture invariants (issue 4), judged against an independent model of the
//! notes example computed from the committed source history:
//!
//! - every effect belongs to a committed transaction, and its scope sees at
//!   most one effect per row per transaction (exactly once, no phantom);
//! - a client that applies a scope's effects in position order holds, after
//!   each commit, exactly the model's content of that scope at that commit
//!   (nothing skipped, nothing stale, commit order kept);
//! - every row a transaction wrote reaches every scope it was or is in;
//! - positions strictly increase within a scope;
//! - every effect, a delete without a row included, carries the version its
//!   row had after that commit (a hard delete: its deletion fence's);
//! - the final projections equal the model replayed to the end;
//! - each scope's membership index (its rows in row-identity order, with
//!   their digests) equals what a client holds after applying the scope's
//!   effects.
//!
//! The model knows the example's rules by hand: a note is in `user:{owner_id}`
//! and in `team:{team_id}` for each of its `note_shares` rows; a template is
//! in `templates_public`. It shares no code with the materializer.

use std::collections::{BTreeMap, BTreeSet};

use protocol::json::Value;

/// One committed source write, as the application made it (text forms).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceWrite {
    /// The complete row after an insert or update.
    Put {
        relation: String,
        image: BTreeMap<String, Option<String>>,
    },
    /// A delete of the row with this key (`id`, or `note_id`+`team_id` for shares).
    Delete { relation: String, key: Vec<String> },
}

/// One committed source transaction, in commit order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceCommit {
    pub commit_lsn: u64,
    pub writes: Vec<SourceWrite>,
    /// The version each registered row it wrote has after it, by key.
    pub versions: BTreeMap<String, String>,
}

/// What an effect told a scope's clients.
#[derive(Clone, Debug, PartialEq)]
pub enum EffectKind {
    Upsert(Value),
    Tombstone(Value),
    Delete,
}

/// One materialized effect.
#[derive(Clone, Debug, PartialEq)]
pub struct ObservedEffect {
    pub scope: String,
    /// (commit_lsn, event_ordinal, effect_ordinal).
    pub position: (u64, u64, u64),
    /// The primary key's wire text (a string key, unquoted).
    pub key: String,
    pub kind: EffectKind,
    /// The `server_version` the effect carries.
    pub version: String,
    /// The row identity bytes, and the carried row's digest (none for a removal).
    pub identity: Vec<u8>,
    pub digest: Option<[u8; 32]>,
}

/// A scope's membership index as the store answers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObservedMembers {
    pub scope: String,
    /// (row identity, row digest), in the order the store gave them.
    pub rows: Vec<(Vec<u8>, [u8; 32])>,
}

/// Judges each scope's membership index against its effects replayed in
/// position order: the same rows, the same digests, strictly in row-identity order.
pub fn check_members(
    effects: &[ObservedEffect],
    members: &[ObservedMembers],
) -> Result<(), Vec<String>> {
    let mut by_scope: BTreeMap<&str, Vec<&ObservedEffect>> = BTreeMap::new();
    for e in effects {
        by_scope.entry(&e.scope).or_default().push(e);
    }
    let mut violations = Vec::new();
    for m in members {
        if m.rows.windows(2).any(|w| w[0].0 >= w[1].0) {
            violations.push(format!(
                "{}: members are not in row-identity order",
                m.scope
            ));
        }
        let mut held: BTreeMap<&[u8], [u8; 32]> = BTreeMap::new();
        let mut list = by_scope.get(m.scope.as_str()).cloned().unwrap_or_default();
        list.sort_by_key(|e| e.position);
        for e in list {
            match e.digest {
                Some(d) => held.insert(&e.identity, d),
                None => held.remove(e.identity.as_slice()),
            };
        }
        let want: Vec<(Vec<u8>, [u8; 32])> =
            held.into_iter().map(|(i, d)| (i.to_vec(), d)).collect();
        if want != m.rows {
            violations.push(format!(
                "{}: the membership index holds {} rows, its effects leave {}",
                m.scope,
                m.rows.len(),
                want.len()
            ));
        }
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

/// One final projection.
#[derive(Clone, Debug, PartialEq)]
pub struct ObservedProjection {
    pub table_id: String,
    pub key: String,
    pub row: Value,
    pub tombstone: bool,
    pub scopes: BTreeSet<String>,
}

/// What a scope's client holds for one row: title/name, owner, tombstone.
type Content = (String, Option<String>, bool);

#[derive(Clone, Default)]
struct Model {
    notes: BTreeMap<String, BTreeMap<String, Option<String>>>,
    templates: BTreeMap<String, BTreeMap<String, Option<String>>>,
    shares: BTreeSet<(String, String)>,
}

fn text(image: &BTreeMap<String, Option<String>>, column: &str) -> Option<String> {
    image.get(column).cloned().flatten()
}

impl Model {
    fn apply(&mut self, w: &SourceWrite) {
        match w {
            SourceWrite::Put { relation, image } => match relation.as_str() {
                "public.notes" => {
                    let id = text(image, "id").unwrap_or_default();
                    self.notes.insert(id, image.clone());
                }
                "public.templates" => {
                    let id = text(image, "id").unwrap_or_default();
                    self.templates.insert(id, image.clone());
                }
                "public.note_shares" => {
                    let share = (
                        text(image, "note_id").unwrap_or_default(),
                        text(image, "team_id").unwrap_or_default(),
                    );
                    self.shares.insert(share);
                }
                _ => {}
            },
            SourceWrite::Delete { relation, key } => match relation.as_str() {
                "public.notes" => {
                    self.notes.remove(&key[0]);
                }
                "public.templates" => {
                    self.templates.remove(&key[0]);
                }
                "public.note_shares" => {
                    self.shares.remove(&(key[0].clone(), key[1].clone()));
                }
                _ => {}
            },
        }
    }

    /// Every row's scopes.
    fn memberships(&self) -> BTreeMap<(String, String), BTreeSet<String>> {
        let mut out = BTreeMap::new();
        for (id, image) in &self.notes {
            let mut scopes = BTreeSet::new();
            if let Some(owner) = text(image, "owner_id") {
                scopes.insert(format!("user:{owner}"));
            }
            for (note, team) in &self.shares {
                if note == id {
                    scopes.insert(format!("team:{team}"));
                }
            }
            out.insert(("tbl_notes".to_owned(), id.clone()), scopes);
        }
        for id in self.templates.keys() {
            out.insert(
                ("tbl_templates".to_owned(), id.clone()),
                BTreeSet::from(["templates_public".to_owned()]),
            );
        }
        out
    }

    /// Scope -> key -> content.
    fn scopes(&self) -> BTreeMap<String, BTreeMap<String, Content>> {
        let mut out: BTreeMap<String, BTreeMap<String, Content>> = BTreeMap::new();
        for ((table, key), scopes) in self.memberships() {
            let content = self.content(&table, &key);
            for s in scopes {
                out.entry(s)
                    .or_default()
                    .insert(key.clone(), content.clone());
            }
        }
        out
    }

    fn content(&self, table: &str, key: &str) -> Content {
        if table == "tbl_notes" {
            let image = &self.notes[key];
            (
                text(image, "title").unwrap_or_default(),
                text(image, "owner_id"),
                text(image, "deleted_at").is_some(),
            )
        } else {
            let image = &self.templates[key];
            (text(image, "name").unwrap_or_default(), None, false)
        }
    }

    fn written(w: &SourceWrite) -> Option<String> {
        match w {
            SourceWrite::Put { relation, image } if relation != "public.note_shares" => {
                text(image, "id")
            }
            SourceWrite::Delete { relation, key } if relation != "public.note_shares" => {
                Some(key[0].clone())
            }
            _ => None,
        }
    }
}

fn field(row: &Value, id: &str) -> Option<String> {
    match row.as_object()?.get(id)? {
        Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

/// What a client holds after an upsert or tombstone of `row`.
fn content_of(row: &Value, tombstone: bool) -> Content {
    if let Some(title) = field(row, "fld_notes_title") {
        (title, field(row, "fld_notes_owner"), tombstone)
    } else {
        (
            field(row, "fld_templates_name").unwrap_or_default(),
            None,
            tombstone,
        )
    }
}

/// Judges the effects and final projections against the history.
/// Every effect carries the version its row had after the effect's commit:
/// the version of the row's latest write at or before that commit.
fn check_versions(history: &[SourceCommit], effects: &[ObservedEffect], out: &mut Vec<String>) {
    let mut written: BTreeMap<&str, Vec<(u64, &str)>> = BTreeMap::new();
    for c in history {
        for (key, version) in &c.versions {
            written
                .entry(key)
                .or_default()
                .push((c.commit_lsn, version));
        }
    }
    for e in effects {
        let had = written
            .get(e.key.as_str())
            .and_then(|w| w.iter().rev().find(|(lsn, _)| *lsn <= e.position.0))
            .map(|(_, v)| *v);
        if had != Some(e.version.as_str()) {
            out.push(format!(
                "the effect of {} at commit {} in {} carries another version than the row had",
                e.key, e.position.0, e.scope
            ));
        }
    }
}

/// The baseline (ADR 0011) as the judge sees it. `span` is where its
/// chunks are: the first chunk's commit LSN and the stream's first
/// position. Every commit below the first chunk is in the baseline, so they
/// become one commit at the first chunk's position, and each chunk's
/// effects become that commit's effects (the chunk's index before the event
/// ordinal keeps their positions distinct and in order).
pub fn fold_baseline(
    history: &mut Vec<SourceCommit>,
    effects: &mut [ObservedEffect],
    span: (u64, u64),
) {
    let (first, consistent) = span;
    let cut = history.partition_point(|c| c.commit_lsn < first);
    assert!(
        history[cut..].iter().all(|c| c.commit_lsn >= consistent),
        "no commit between the baseline's chunks"
    );
    let mut merged = SourceCommit {
        commit_lsn: first,
        writes: Vec::new(),
        versions: BTreeMap::new(),
    };
    for c in history.drain(..cut) {
        merged.writes.extend(c.writes);
        merged.versions.extend(c.versions); // the later version wins
    }
    history.insert(0, merged);
    for e in effects.iter_mut() {
        let (lsn, event, effect) = e.position;
        if (first..consistent).contains(&lsn) {
            let chunk = (lsn - first) / 2; // chunks are two positions apart
            e.position = (first, (chunk << 32) | event, effect);
        }
    }
}

pub fn check_capture(
    history: &[SourceCommit],
    effects: &[ObservedEffect],
    projections: &[ObservedProjection],
) -> Result<(), Vec<String>> {
    let mut violations = Vec::new();
    let commits: BTreeSet<u64> = history.iter().map(|c| c.commit_lsn).collect();
    let mut by_scope: BTreeMap<&str, Vec<&ObservedEffect>> = BTreeMap::new();
    for e in effects {
        if !commits.contains(&e.position.0) {
            violations.push(format!(
                "phantom effect at commit {} in {}",
                e.position.0, e.scope
            ));
        }
        by_scope.entry(&e.scope).or_default().push(e);
    }
    for list in by_scope.values_mut() {
        list.sort_by_key(|e| e.position);
        for w in list.windows(2) {
            if w[0].position == w[1].position {
                violations.push(format!("two effects at one position in {}", w[0].scope));
            }
        }
    }

    check_versions(history, effects, &mut violations);

    let mut model = Model::default();
    let mut replicas: BTreeMap<String, BTreeMap<String, Content>> = BTreeMap::new();
    let mut cursor: BTreeMap<String, usize> = BTreeMap::new();
    for commit in history {
        let before = model.memberships();
        for w in &commit.writes {
            model.apply(w);
        }
        let after = model.memberships();
        let expected = model.scopes();
        let written: BTreeSet<String> = commit.writes.iter().filter_map(Model::written).collect();
        let universe: BTreeSet<String> = by_scope
            .keys()
            .map(|s| (*s).to_owned())
            .chain(expected.keys().cloned())
            .collect();
        for scope in &universe {
            let list = by_scope
                .get(scope.as_str())
                .map(Vec::as_slice)
                .unwrap_or_default();
            let start = *cursor.get(scope).unwrap_or(&0);
            let mut end = start;
            while end < list.len() && list[end].position.0 <= commit.commit_lsn {
                end += 1;
            }
            cursor.insert(scope.clone(), end);
            let mut seen = BTreeSet::new();
            let replica = replicas.entry(scope.clone()).or_default();
            for e in &list[start..end] {
                if e.position.0 != commit.commit_lsn {
                    continue; // phantom, reported above
                }
                if !seen.insert(e.key.clone()) {
                    violations.push(format!(
                        "commit {}: row {} has two effects in {scope}",
                        commit.commit_lsn, e.key
                    ));
                }
                match &e.kind {
                    EffectKind::Upsert(row) => {
                        replica.insert(e.key.clone(), content_of(row, false));
                    }
                    EffectKind::Tombstone(row) => {
                        replica.insert(e.key.clone(), content_of(row, true));
                    }
                    EffectKind::Delete => {
                        replica.remove(&e.key);
                    }
                }
            }
            let want = expected.get(scope).cloned().unwrap_or_default();
            if *replica != want {
                violations.push(format!(
                    "commit {}: scope {scope} holds {replica:?}, the model {want:?}",
                    commit.commit_lsn
                ));
                *replica = want; // report each divergence once
            }
            for key in &written {
                let member = |m: &BTreeMap<(String, String), BTreeSet<String>>| {
                    m.iter()
                        .any(|((_, k), scopes)| k == key && scopes.contains(scope))
                };
                if (member(&before) || member(&after)) && !seen.contains(key) {
                    violations.push(format!(
                        "commit {}: row {key} was written but {scope} got no effect",
                        commit.commit_lsn
                    ));
                }
            }
        }
    }

    let final_rows = model.memberships();
    let mut seen = BTreeSet::new();
    for p in projections {
        let slot = (p.table_id.clone(), p.key.clone());
        match final_rows.get(&slot) {
            None => violations.push(format!(
                "projection of {} {} has no source row",
                p.table_id, p.key
            )),
            Some(scopes) => {
                if *scopes != p.scopes {
                    violations.push(format!(
                        "projection of {} has scopes {:?}, the model {scopes:?}",
                        p.key, p.scopes
                    ));
                }
                let (_, _, tombstone) = model.content(&p.table_id, &p.key);
                if content_of(&p.row, tombstone) != model.content(&p.table_id, &p.key)
                    || p.tombstone != tombstone
                {
                    violations.push(format!("projection of {} differs from the model", p.key));
                }
            }
        }
        seen.insert(slot);
    }
    for slot in final_rows.keys() {
        if !seen.contains(slot) {
            violations.push(format!("row {} {} has no projection", slot.0, slot.1));
        }
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

/// An idle slot keeps little WAL (issue 25): capture's own heartbeats
/// keep writing WAL that holds no source transaction while it idles, and
/// capture confirms it, so at the end of an idle spell in which `written`
/// bytes of WAL were written the slot retains less than that.
pub fn check_idle_slot(written: u64, retained: u64) -> Result<(), String> {
    if written > 0 && retained >= written {
        return Err(format!(
            "an idle slot retains {retained} bytes of WAL, all {written} written while idle among them: capture does not confirm WAL without source transactions"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(relation: &str, cols: &[(&str, Option<&str>)]) -> SourceWrite {
        SourceWrite::Put {
            relation: relation.into(),
            image: cols
                .iter()
                .map(|(c, v)| ((*c).to_owned(), v.map(str::to_owned)))
                .collect(),
        }
    }

    fn note_row(title: &str, owner: &str) -> Value {
        let mut o = protocol::json::Object::new();
        o.insert("fld_notes_title".into(), Value::string(title));
        o.insert("fld_notes_owner".into(), Value::string(owner));
        Value::Object(o)
    }

    fn effect(scope: &str, lsn: u64, ev: u64, key: &str, kind: EffectKind) -> ObservedEffect {
        ObservedEffect {
            scope: scope.into(),
            position: (lsn, ev, 0),
            key: key.into(),
            kind,
            version: format!("v{lsn}"),
            identity: key.as_bytes().to_vec(),
            digest: None,
        }
    }

    fn history() -> Vec<SourceCommit> {
        let n = |title: &str, owner: &str| {
            put(
                "public.notes",
                &[
                    ("id", Some("n1")),
                    ("title", Some(title)),
                    ("owner_id", Some(owner)),
                    ("deleted_at", None),
                ],
            )
        };
        vec![
            SourceCommit {
                commit_lsn: 10,
                writes: vec![n("a", "u1")],
                versions: BTreeMap::from([("n1".to_owned(), "v10".to_owned())]),
            },
            SourceCommit {
                commit_lsn: 20,
                writes: vec![n("b", "u2")],
                versions: BTreeMap::from([("n1".to_owned(), "v20".to_owned())]),
            },
        ]
    }

    fn good() -> Vec<ObservedEffect> {
        vec![
            effect(
                "user:u1",
                10,
                0,
                "n1",
                EffectKind::Upsert(note_row("a", "u1")),
            ),
            effect("user:u1", 20, 0, "n1", EffectKind::Delete),
            effect(
                "user:u2",
                20,
                0,
                "n1",
                EffectKind::Upsert(note_row("b", "u2")),
            ),
        ]
    }

    fn projection() -> Vec<ObservedProjection> {
        vec![ObservedProjection {
            table_id: "tbl_notes".into(),
            key: "n1".into(),
            row: note_row("b", "u2"),
            tombstone: false,
            scopes: BTreeSet::from(["user:u2".to_owned()]),
        }]
    }

    #[test]
    fn the_membership_index_is_judged_by_the_effects() {
        let mut effects = good();
        for e in &mut effects {
            if !matches!(e.kind, EffectKind::Delete) {
                e.digest = Some([e.position.0 as u8; 32]);
            }
        }
        let members = |scope: &str, rows: Vec<(Vec<u8>, [u8; 32])>| ObservedMembers {
            scope: scope.into(),
            rows,
        };
        let good_members = vec![
            members("user:u1", vec![]),
            members("user:u2", vec![(b"n1".to_vec(), [20; 32])]),
        ];
        assert_eq!(check_members(&effects, &good_members), Ok(()));
        // A row left behind in the scope it left, a missing row, a stale digest.
        for bad in [
            vec![members("user:u1", vec![(b"n1".to_vec(), [10; 32])])],
            vec![members("user:u2", vec![])],
            vec![members("user:u2", vec![(b"n1".to_vec(), [10; 32])])],
        ] {
            assert!(check_members(&effects, &bad).is_err(), "{bad:?}");
        }
        let unordered = vec![members(
            "x",
            vec![(b"b".to_vec(), [0; 32]), (b"a".to_vec(), [0; 32])],
        )];
        let e = check_members(&[], &unordered).err().unwrap_or_default();
        assert!(e.first().is_some_and(|m| m.contains("order")), "{e:?}");
    }

    #[test]
    fn a_faithful_history_passes() {
        assert_eq!(check_capture(&history(), &good(), &projection()), Ok(()));
    }

    #[test]
    fn each_broken_history_is_caught() {
        let mut skipped = good();
        skipped.remove(1); // the row never left user:u1
        let mut doubled = good();
        doubled.push(effect(
            "user:u2",
            20,
            1,
            "n1",
            EffectKind::Upsert(note_row("b", "u2")),
        ));
        let mut stale = good();
        stale[2] = effect(
            "user:u2",
            20,
            0,
            "n1",
            EffectKind::Upsert(note_row("a", "u2")),
        );
        let mut phantom = good();
        phantom.push(effect("user:u3", 15, 0, "n1", EffectKind::Delete));
        // A delete leaving user:u1 with the row's old version, not its new one.
        let mut old_version = good();
        old_version[1].version = "v10".into();
        for (name, effects) in [
            ("skipped", skipped),
            ("doubled", doubled),
            ("stale", stale),
            ("phantom", phantom),
            ("old version", old_version),
        ] {
            assert!(
                check_capture(&history(), &effects, &projection()).is_err(),
                "{name}"
            );
        }
        let mut wrong_scopes = projection();
        wrong_scopes[0].scopes.insert("user:u1".into());
        assert!(check_capture(&history(), &good(), &wrong_scopes).is_err());
        assert!(
            check_capture(&history(), &good(), &[]).is_err(),
            "a missing projection"
        );
    }
}
