//! Pull and rebuild pages, checked and turned into one [`Transition`] as
//! the spec tells a client to: the whole response is checked before
//! anything is applied (members, the checksum presence rule and key set,
//! every `row_checksum` recomputed from the row), assignment updates,
//! changes, rebuild dispatch and cursors form one transition, and a
//! terminal scope checksum is recomputed from the local copy before that
//! scope's cursor is installed. A scope whose checksum differs loses only
//! its own resumable state (it is rebuilt).

use std::collections::{BTreeMap, BTreeSet};

use protocol::digest::{Digest, RowIdentity, ScopeDigest, row_digest};
use protocol::ids::ServerVersion;
use protocol::json::{self, Object, Value};
use protocol::manifest::{Manifest, TableManifest};
use protocol::value;

use crate::local::{Holding, LocalError, LocalStore, Session, Transition};

/// Why a response is not one a conforming server sends (nothing of it is applied).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PageError {
    /// The response breaks the contract.
    Invalid(String),
    Local(LocalError),
}

impl From<LocalError> for PageError {
    fn from(e: LocalError) -> Self {
        PageError::Local(e)
    }
}

fn invalid<T>(what: impl Into<String>) -> Result<T, PageError> {
    Err(PageError::Invalid(what.into()))
}

pub(crate) fn object<'a>(v: &'a Value, what: &str) -> Result<&'a Object, PageError> {
    v.as_object()
        .ok_or_else(|| PageError::Invalid(format!("{what} is not an object")))
}

pub(crate) fn member<'a>(o: &'a Object, name: &str) -> Result<&'a Value, PageError> {
    o.get(name)
        .ok_or_else(|| PageError::Invalid(format!("member {name} is missing")))
}

pub(crate) fn string<'a>(o: &'a Object, name: &str) -> Result<&'a str, PageError> {
    member(o, name)?
        .as_str()
        .ok_or_else(|| PageError::Invalid(format!("member {name} is not a string")))
}

pub(crate) fn array<'a>(o: &'a Object, name: &str) -> Result<&'a [Value], PageError> {
    match member(o, name)? {
        Value::Array(a) => Ok(a),
        _ => invalid(format!("member {name} is not an array")),
    }
}

pub(crate) fn counter(o: &Object, name: &str) -> Result<u64, PageError> {
    match member(o, name)? {
        Value::Number(n) => n
            .as_exact_i64()
            .and_then(|i| u64::try_from(i).ok())
            .ok_or_else(|| PageError::Invalid(format!("{name} is not a counter"))),
        _ => invalid(format!("{name} is not a number")),
    }
}

pub(crate) fn boolean(o: &Object, name: &str) -> Result<bool, PageError> {
    match member(o, name)? {
        Value::Bool(b) => Ok(*b),
        _ => invalid(format!("{name} is not a boolean")),
    }
}

/// A row a change or record carries, verified: the fields of a holding
/// apart from its scope and sequence number.
pub(crate) struct VerifiedRow {
    pub identity: RowIdentity,
    pub table: String,
    pub pk: String,
    pub row: Option<(String, Digest, bool)>,
    pub version: String,
}

/// What the client checks and does of a page beyond its shape. Everything,
/// always; only the simulator plants the bugs these flags stand for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Checks {
    /// A planted bug: a row's `row_checksum` is taken as its digest, unverified.
    pub trust_sent_row_checksums: bool,
    /// A planted bug: a removed scope leaves the active set, its rows stay.
    pub keep_removed_rows: bool,
}

/// Checks a change's or record's row: its table is known, `pk` is one
/// field of the key type, and a carried row fits its table, has that key,
/// and digests to its `row_checksum` under `manifest` at its version.
pub(crate) fn verify_row(
    manifest: &Manifest,
    c: &Object,
    row_required: bool,
    checks: Checks,
) -> Result<VerifiedRow, PageError> {
    let table_id = string(c, "table")?;
    let Some(table) = manifest.table(table_id) else {
        return invalid(format!("a row of unknown table {table_id}"));
    };
    let pk = object(member(c, "pk")?, "pk")?;
    let key_field = table.primary_key();
    if pk.len() != 1 {
        return invalid("pk is not one field");
    }
    let key = value::decode(key_field.field_type(), member(pk, key_field.field_id())?)
        .ok()
        .flatten()
        .ok_or_else(|| PageError::Invalid("pk does not fit its type".into()))?;
    let identity = RowIdentity::of(table, &key);
    let version = string(c, "server_version")?;
    let server_version = ServerVersion::parse(version)
        .ok_or_else(|| PageError::Invalid("a malformed server_version".into()))?;
    let row = match c.get("row") {
        None if row_required => return invalid("a record without its row"),
        None => {
            if c.contains_key("row_checksum") {
                return invalid("a checksum without a row");
            }
            None
        }
        Some(row) => {
            let decoded = table.decode_row(object(row, "row")?).map_err(|e| {
                PageError::Invalid(format!("the row does not fit its table: {e:?}"))
            })?;
            if table.row_key(&decoded) != Some(&key) {
                return invalid("the row's key is not pk");
            }
            let digest = row_digest(
                &manifest.hash(),
                table,
                &identity,
                &decoded,
                &server_version,
            );
            let sent = Digest::from_checksum_json(member(c, "row_checksum")?)
                .ok_or_else(|| PageError::Invalid("a malformed row_checksum".into()))?;
            if checks.trust_sent_row_checksums {
                Some((json::to_canonical_string(row), sent, tombstone(table, row)))
            } else if sent != digest {
                return invalid(format!(
                    "the row_checksum of a {table_id} row does not verify"
                ));
            } else {
                Some((
                    json::to_canonical_string(row),
                    digest,
                    tombstone(table, row),
                ))
            }
        }
    };
    Ok(VerifiedRow {
        identity,
        table: table_id.to_owned(),
        pk: json::to_canonical_string(&Value::Object(pk.clone())),
        row,
        version: version.to_owned(),
    })
}

/// Whether `row` is a source tombstone: its deletion-time field is set.
fn tombstone(table: &TableManifest, row: &Value) -> bool {
    table
        .lifecycle()
        .deleted_at_field_id
        .as_ref()
        .and_then(|f| row.as_object()?.get(f))
        .is_some_and(|d| *d != Value::Null)
}

/// The scope digest of `rows` (identity order) under `manifest`.
pub(crate) fn digest_of<'a>(
    manifest: &Manifest,
    scope: &str,
    rows: impl ExactSizeIterator<Item = (&'a Vec<u8>, &'a [u8; 32])>,
) -> Option<Digest> {
    let mut d = ScopeDigest::new(&manifest.hash(), scope, rows.len() as u64);
    for (identity, digest) in rows {
        d.push(&RowIdentity::from_bytes(identity.clone()), &Digest(*digest));
    }
    d.finish().ok()
}

/// What one applied pull page said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PullApplied {
    pub has_more: bool,
    pub changes: usize,
    /// Scopes the page sent to rebuild (new ones included).
    pub rebuild: Vec<String>,
    /// Scopes whose terminal checksum differed from the local copy: rebuilt.
    pub mismatched: Vec<String>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
}

/// Checks a 200 pull body completely and returns the one transition that applies it.
pub(crate) fn pull_transition<S: LocalStore>(
    store: &S,
    session: &Session,
    manifest: &Manifest,
    body: &[u8],
    checks: Checks,
) -> Result<(Transition, PullApplied), PageError> {
    let v = json::parse(body).map_err(|_| PageError::Invalid("the page is not JSON".into()))?;
    let o = object(&v, "the page")?;
    let has_more = boolean(o, "has_more")?;
    let allowed = [
        "changes",
        "scope_set_version",
        "scope_cursors",
        "scope_updates",
        "rebuild",
        "has_more",
    ];
    if let Some(k) = o
        .keys()
        .find(|k| !allowed.contains(&k.as_str()) && (has_more || k.as_str() != "checksums"))
    {
        return invalid(format!("member {k} is not allowed here"));
    }
    let version = counter(o, "scope_set_version")?;
    let mut next = session.clone();
    let mut t = Transition::default();
    let mut applied = PullApplied {
        has_more,
        ..PullApplied::default()
    };
    // Assignment updates first: they decide the active set.
    let updates = object(member(o, "scope_updates")?, "scope_updates")?;
    for r in array(updates, "remove")? {
        let Some(s) = r.as_str() else {
            return invalid("a removed scope is not a string");
        };
        next.scopes.remove(s);
        if !checks.keep_removed_rows {
            t.clear.push(s.to_owned());
        }
        applied.removed.push(s.to_owned());
    }
    for a in array(updates, "add")? {
        let a = object(a, "an added scope")?;
        if member(a, "cursor")? != &Value::Null {
            return invalid("an added scope carries a cursor");
        }
        let s = string(a, "id")?;
        next.scopes.insert(s.to_owned(), None);
        t.clear.push(s.to_owned()); // rows of an earlier assignment are not this one's
        applied.added.push(s.to_owned());
    }
    if version < session.scope_set_version {
        return invalid("scope_set_version moved back");
    }
    let changed = !(applied.added.is_empty() && applied.removed.is_empty());
    if version == session.scope_set_version && changed {
        return invalid("the assignment changed but scope_set_version did not");
    }
    next.scope_set_version = version;
    for r in array(o, "rebuild")? {
        let Some(s) = r.as_str() else {
            return invalid("a rebuild scope is not a string");
        };
        match next.scopes.get_mut(s) {
            Some(cursor) => *cursor = None,
            None => return invalid(format!("rebuild names {s}, not active")),
        }
        applied.rebuild.push(s.to_owned());
    }
    if let Some(a) = applied.added.iter().find(|a| !applied.rebuild.contains(a)) {
        return invalid(format!("added scope {a} is not in rebuild"));
    }
    // Each changed scope's rows as this page leaves them (None: removed).
    let mut overlay: BTreeMap<String, BTreeMap<Vec<u8>, Option<[u8; 32]>>> = BTreeMap::new();
    let changes = array(o, "changes")?;
    for c in changes {
        let c = object(c, "a change")?;
        let scope = string(c, "scope")?;
        if !next.scopes.contains_key(scope) {
            return invalid(format!("a change for {scope}, not active"));
        }
        let r = verify_row(manifest, c, false, checks)?;
        let identity = r.identity.as_bytes().to_vec();
        let slot = overlay.entry(scope.to_owned()).or_default();
        match (string(c, "op")?, r.row) {
            // A delete's row is the authoritative tombstone (ADR 003), whatever
            // its lifecycle fields say; an upsert's row is the live row.
            ("upsert" | "delete", Some((row, digest, _))) => {
                slot.insert(identity.clone(), Some(digest.0));
                t.put.push(Holding {
                    scope: scope.to_owned(),
                    identity,
                    table: r.table,
                    pk: r.pk,
                    row,
                    version: r.version,
                    digest: digest.0,
                    tombstone: string(c, "op")? == "delete",
                    seq: next.take_seq(),
                });
            }
            ("delete", None) => {
                slot.insert(identity.clone(), None);
                t.remove.push((scope.to_owned(), identity));
            }
            (op, _) => return invalid(format!("op {op} with this shape is not a pull change")),
        }
    }
    // A put after a remove of the same row (or the reverse) in one page:
    // the later one wins, as the overlay records.
    t.put.retain(|h| {
        overlay
            .get(&h.scope)
            .and_then(|m| m.get(&h.identity))
            .is_some_and(|d| *d == Some(h.digest))
    });
    for (s, token) in object(member(o, "scope_cursors")?, "scope_cursors")? {
        if applied.rebuild.contains(s) || applied.removed.contains(s) {
            return invalid(format!("{s} got a cursor it must not get"));
        }
        let Some(token) = token.as_str() else {
            return invalid("a cursor is not a string");
        };
        match next.scopes.get_mut(s) {
            Some(cursor) => *cursor = Some(token.to_owned()),
            None => return invalid(format!("a cursor for {s}, not active")),
        }
    }
    if !has_more {
        let sums = object(member(o, "checksums")?, "checksums")?;
        if !sums.keys().eq(next.scopes.keys()) {
            return invalid("the checksum key set is not the active set");
        }
        for (s, sum) in sums {
            let Some(want) = Digest::from_checksum_json(sum) else {
                return invalid("a malformed checksum");
            };
            if applied.rebuild.contains(s) {
                continue; // rebuild takes precedence
            }
            let mut rows: BTreeMap<Vec<u8>, [u8; 32]> = if t.clear.contains(s) {
                BTreeMap::new()
            } else {
                store
                    .holdings(s)?
                    .into_iter()
                    .map(|h| (h.identity, h.digest))
                    .collect()
            };
            for (identity, d) in overlay.get(s).into_iter().flatten() {
                match d {
                    Some(d) => rows.insert(identity.clone(), *d),
                    None => rows.remove(identity),
                };
            }
            if digest_of(manifest, s, rows.iter()) != Some(want) {
                if let Some(cursor) = next.scopes.get_mut(s) {
                    *cursor = None; // only this scope's resumable state is lost
                }
                applied.mismatched.push(s.clone());
            }
        }
    }
    applied.changes = changes.len();
    t.session = Some(next);
    Ok((t, applied))
}

/// One rebuild attempt of one scope: its `rebuild_id`, the continuation to
/// present next, and the verified rows of the pages so far, held apart
/// from the scope's until the final page's checksum matches.
#[derive(Clone, Debug)]
pub struct RebuildAttempt {
    pub scope: String,
    pub rebuild_id: String,
    pub continuation: Option<String>,
    rows: BTreeMap<Vec<u8>, Holding>,
}

/// Where a rebuild attempt stands after a page.
#[derive(Debug)]
pub(crate) enum RebuildStep {
    More,
    /// The staged scope verified: the transition that installs it.
    Done(Box<Transition>),
    /// The recomputed scope checksum differs: a new attempt is needed.
    Mismatch,
}

impl RebuildAttempt {
    /// A new attempt of `scope`.
    pub fn new(scope: &str, rebuild_id: String) -> RebuildAttempt {
        RebuildAttempt {
            scope: scope.to_owned(),
            rebuild_id,
            continuation: None,
            rows: BTreeMap::new(),
        }
    }

    /// Rows verified so far.
    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// Checks a 200 rebuild page and holds its rows; the final page, when
    /// the staged scope's checksum matches, gives the transition that
    /// replaces the scope's rows and installs `final_scope_cursor`.
    pub(crate) fn apply(
        &mut self,
        session: &Session,
        manifest: &Manifest,
        page: &[u8],
        checks: Checks,
    ) -> Result<RebuildStep, PageError> {
        let v = json::parse(page)
            .map_err(|_| PageError::Invalid("the rebuild page is not JSON".into()))?;
        let o = object(&v, "the rebuild page")?;
        if string(o, "scope")? != self.scope {
            return invalid("a rebuild page of another scope");
        }
        let has_more = boolean(o, "has_more")?;
        let mut rows = Vec::new();
        for r in array(o, "records")? {
            let r = object(r, "a record")?;
            let v = verify_row(manifest, r, true, checks)?;
            let Some((row, digest, tombstone)) = v.row else {
                return invalid("a record without its row");
            };
            rows.push(Holding {
                scope: self.scope.clone(),
                identity: v.identity.as_bytes().to_vec(),
                table: v.table,
                pk: v.pk,
                row,
                version: v.version,
                digest: digest.0,
                tombstone,
                seq: 0, // given when the scope is installed
            });
        }
        let mut last = self.rows.last_key_value().map(|(k, _)| k.clone());
        for h in &rows {
            if last.as_ref().is_some_and(|l| *l >= h.identity) {
                return invalid("rebuild records are not in row-identity order");
            }
            last = Some(h.identity.clone());
        }
        if has_more {
            if o.contains_key("checksum") || o.contains_key("final_scope_cursor") {
                return invalid("an intermediate page carries final members");
            }
            self.continuation = Some(string(o, "cursor")?.to_owned());
            self.rows
                .extend(rows.into_iter().map(|h| (h.identity.clone(), h)));
            return Ok(RebuildStep::More);
        }
        if member(o, "cursor")? != &Value::Null {
            return invalid("a final page carries a continuation");
        }
        let want = Digest::from_checksum_json(member(o, "checksum")?)
            .ok_or_else(|| PageError::Invalid("a malformed checksum".into()))?;
        let cursor = string(o, "final_scope_cursor")?.to_owned();
        self.rows
            .extend(rows.into_iter().map(|h| (h.identity.clone(), h)));
        let digests = self.rows.iter().map(|(i, h)| (i, &h.digest));
        if digest_of(manifest, &self.scope, digests) != Some(want) {
            return Ok(RebuildStep::Mismatch);
        }
        let mut next = session.clone();
        match next.scopes.get_mut(&self.scope) {
            Some(c) => *c = Some(cursor),
            None => return invalid("a rebuild of a scope that is not active"),
        }
        let mut put: Vec<Holding> = std::mem::take(&mut self.rows).into_values().collect();
        for h in &mut put {
            h.seq = next.take_seq();
        }
        Ok(RebuildStep::Done(Box::new(Transition {
            session: Some(next),
            clear: vec![self.scope.clone()],
            put,
            ..Transition::default()
        })))
    }
}

/// Scopes named in a list of JSON strings, deduplicated.
pub(crate) fn scope_names(list: &[Value]) -> Result<BTreeSet<String>, PageError> {
    list.iter()
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| PageError::Invalid("a scope is not a string".into()))
        })
        .collect()
}
