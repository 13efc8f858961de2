//! Pull, judged from the client's side (wire spec "Pull", ADR 003).
//!
//! [`Replica`] is a client's local copy, applying each page exactly as the
//! spec tells a client to: the whole response is checked before anything is
//! applied (member presence, the checksum presence rule and key set, every
//! `row_checksum` recomputed), then assignment updates, changes, rebuild
//! dispatch and cursors are applied as one transition, and each terminal
//! scope checksum is recomputed locally before its cursor is installed.
//!
//! The invariants over a run:
//! - [`check_cursor`]: no cursor passes an undelivered effect: when a
//!   cursor at P is installed, the client holds, for every row of the scope,
//!   the state of its last effect at or before P, unless a later effect of
//!   that row (still to come) covers it;
//! - [`check_checkpoints`]: acknowledged checkpoints never move backward;
//! - [`check_own_writes`]: a terminal page never claims state older than
//!   the client's accepted push: once it installs the cursor of a scope,
//!   the client holds every row it pushed into that scope before it asked;
//! - [`check_converged`]: after quiescence each assigned scope's local
//!   rows equal the server's members, digest for digest.

use std::collections::{BTreeMap, BTreeSet};

use protocol::digest::{Digest, RowIdentity, ScopeDigest, row_digest};
use protocol::ids::ServerVersion;
use protocol::json::{self, Object, Value};
use protocol::manifest::Manifest;
use protocol::position::StreamPosition;
use protocol::value;

/// One row a client holds in one scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalRow {
    pub table: String,
    pub version: String,
    /// The row digest, recomputed by the client.
    pub digest: Digest,
    /// A source tombstone (a delete that carried its row).
    pub tombstone: bool,
}

/// One scope as a client holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalScope {
    /// `None`: no usable incremental state (the scope needs a rebuild).
    pub cursor: Option<String>,
    /// By row-identity bytes: the scope digest's order.
    pub rows: BTreeMap<Vec<u8>, LocalRow>,
}

/// A client's local copy of the scopes it was assigned.
#[derive(Clone, Debug)]
pub struct Replica {
    manifest: Manifest,
    pub scope_set_version: u64,
    pub scopes: BTreeMap<String, LocalScope>,
}

/// What one applied page said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    pub has_more: bool,
    pub changes: usize,
    /// Scopes the page sent to rebuild (new ones included).
    pub rebuild: Vec<String>,
    /// Scopes whose terminal checksum differed from the local copy.
    pub mismatched: Vec<String>,
    /// Scopes that received a new cursor.
    pub cursors: Vec<String>,
}

fn members<'a>(v: &'a Value, what: &str) -> Result<&'a Object, String> {
    v.as_object()
        .ok_or_else(|| format!("{what} is not an object"))
}

fn member<'a>(o: &'a Object, name: &str) -> Result<&'a Value, String> {
    o.get(name)
        .ok_or_else(|| format!("member {name} is missing"))
}

fn string<'a>(o: &'a Object, name: &str) -> Result<&'a str, String> {
    member(o, name)?
        .as_str()
        .ok_or_else(|| format!("member {name} is not a string"))
}

fn array<'a>(o: &'a Object, name: &str) -> Result<&'a [Value], String> {
    match member(o, name)? {
        Value::Array(a) => Ok(a),
        _ => Err(format!("member {name} is not an array")),
    }
}

impl Replica {
    /// A client with nothing yet, under `manifest`.
    pub fn new(manifest: Manifest) -> Replica {
        Replica {
            manifest,
            scope_set_version: 0,
            scopes: BTreeMap::new(),
        }
    }

    /// The scope digest of the local copy of `scope`.
    pub fn scope_digest(&self, scope: &str) -> Option<Digest> {
        let s = self.scopes.get(scope)?;
        let mut d = ScopeDigest::new(&self.manifest.hash(), scope, s.rows.len() as u64);
        for (identity, row) in &s.rows {
            d.push(&RowIdentity::from_bytes(identity.clone()), &row.digest);
        }
        d.finish().ok()
    }

    /// Applies a 200 connect body's assignment: the scope-set version, added
    /// scopes (to rebuild) and removed ones.
    pub fn connected(&mut self, body: &[u8]) -> Result<(), String> {
        let v = json::parse(body).map_err(|_| "the connect body is not JSON".to_owned())?;
        let o = members(&v, "the connect body")?;
        self.scope_set_version = match member(o, "scope_set_version")? {
            Value::Number(n) => n
                .as_exact_i64()
                .and_then(|i| u64::try_from(i).ok())
                .ok_or("scope_set_version is not a counter")?,
            _ => return Err("scope_set_version is not a number".into()),
        };
        let scopes = members(member(o, "scopes")?, "scopes")?;
        for r in array(scopes, "remove")? {
            self.scopes.remove(r.as_str().ok_or("a removed scope")?);
        }
        for a in array(scopes, "add")? {
            let id = string(members(a, "an added scope")?, "id")?;
            self.scopes.insert(id.to_owned(), LocalScope::default());
        }
        Ok(())
    }

    /// The row identity bytes of a change (its table and typed key), if it names one.
    pub fn identity_of(&self, change: &Value) -> Option<Vec<u8>> {
        identity_of(&self.manifest, change)
    }

    /// The pull request body for `limit`.
    pub fn request(&self, client_id: &str, generation: u64, limit: u16) -> Vec<u8> {
        let scopes = self.scopes.iter().map(|(s, l)| {
            let cursor = l.cursor.as_ref().map_or(Value::Null, Value::string);
            (s.clone(), json::object([("cursor", cursor)]))
        });
        let mut o = Object::new();
        o.insert("client_id".into(), Value::string(client_id));
        o.insert("client_generation".into(), Value::int(generation as i64));
        o.insert("schema".into(), self.manifest.reference().to_json());
        o.insert(
            "scope_set_version".into(),
            Value::int(self.scope_set_version as i64),
        );
        o.insert("scopes".into(), Value::Object(scopes.collect()));
        o.insert("limit".into(), Value::int(i64::from(limit)));
        json::to_canonical(&Value::Object(o))
    }

    /// The schema reference this client presents.
    pub fn schema_reference(&self) -> Value {
        self.manifest.reference().to_json()
    }

    /// The scopes with no usable incremental state: each needs a rebuild.
    pub fn needs_rebuild(&self) -> Vec<String> {
        self.scopes
            .iter()
            .filter(|(_, l)| l.cursor.is_none())
            .map(|(s, _)| s.clone())
            .collect()
    }

    /// The request of `attempt`'s next rebuild page at `limit`.
    pub fn rebuild_request(
        &self,
        attempt: &Rebuilding,
        client_id: &str,
        generation: u64,
        limit: u16,
    ) -> Vec<u8> {
        let cursor = attempt
            .continuation
            .clone()
            .map_or(Value::Null, Value::string);
        json::to_canonical(&json::object([
            ("client_id", Value::string(client_id)),
            ("client_generation", Value::int(generation as i64)),
            ("schema", self.manifest.reference().to_json()),
            ("scope", Value::string(attempt.scope.clone())),
            ("rebuild_id", Value::string(attempt.rebuild_id.clone())),
            ("cursor", cursor),
            ("limit", Value::int(i64::from(limit))),
        ]))
    }

    /// Checks one 200 pull body completely, then applies it as one local
    /// transition. An `Err` is a page no conforming server sends: nothing
    /// was applied.
    pub fn apply(&mut self, body: &[u8]) -> Result<Applied, String> {
        let v = json::parse(body).map_err(|_| "the page is not JSON".to_owned())?;
        let o = members(&v, "the page")?;
        let has_more = match member(o, "has_more")? {
            Value::Bool(b) => *b,
            _ => return Err("has_more is not a boolean".into()),
        };
        let allowed: BTreeSet<&str> = [
            "changes",
            "scope_set_version",
            "scope_cursors",
            "scope_updates",
            "rebuild",
            "has_more",
        ]
        .into_iter()
        .chain((!has_more).then_some("checksums"))
        .collect();
        for k in o.keys() {
            if !allowed.contains(k.as_str()) {
                return Err(format!("member {k} is not allowed here"));
            }
        }
        let version = match member(o, "scope_set_version")? {
            Value::Number(n) => n
                .as_exact_i64()
                .and_then(|i| u64::try_from(i).ok())
                .ok_or("scope_set_version is not a counter")?,
            _ => return Err("scope_set_version is not a number".into()),
        };
        let mut next = self.clone();
        next.scope_set_version = version;
        // Assignment updates first: they decide the active set.
        let updates = members(member(o, "scope_updates")?, "scope_updates")?;
        let mut removed = BTreeSet::new();
        for r in array(updates, "remove")? {
            let s = r.as_str().ok_or("a removed scope is not a string")?;
            next.scopes.remove(s);
            removed.insert(s.to_owned());
        }
        let mut added = BTreeSet::new();
        for a in array(updates, "add")? {
            let a = members(a, "an added scope")?;
            if member(a, "cursor")? != &Value::Null {
                return Err("an added scope carries a cursor".into());
            }
            let s = string(a, "id")?;
            next.scopes.insert(s.to_owned(), LocalScope::default());
            added.insert(s.to_owned());
        }
        // A lost response can hide steps (a scope removed, then granted
        // again), so a newer version may come with no update; never an older.
        if version < self.scope_set_version {
            return Err("scope_set_version moved back".into());
        }
        if version == self.scope_set_version && !(added.is_empty() && removed.is_empty()) {
            return Err("the assignment changed but scope_set_version did not".into());
        }
        let mut rebuild = Vec::new();
        for r in array(o, "rebuild")? {
            let s = r.as_str().ok_or("a rebuild scope is not a string")?;
            let local = next
                .scopes
                .get_mut(s)
                .ok_or_else(|| format!("rebuild names {s}, not active"))?;
            local.cursor = None;
            rebuild.push(s.to_owned());
        }
        for a in &added {
            if !rebuild.contains(a) {
                return Err(format!("added scope {a} is not in rebuild"));
            }
        }
        let changes = array(o, "changes")?;
        for c in changes {
            next.apply_change(c, &removed)?;
        }
        let cursors = members(member(o, "scope_cursors")?, "scope_cursors")?;
        let mut issued = Vec::new();
        for (s, token) in cursors {
            if rebuild.contains(s) || removed.contains(s) {
                return Err(format!("{s} got a cursor it must not get"));
            }
            let token = token.as_str().ok_or("a cursor is not a string")?;
            let local = next
                .scopes
                .get_mut(s)
                .ok_or_else(|| format!("a cursor for {s}, not active"))?;
            local.cursor = Some(token.to_owned());
            issued.push(s.clone());
        }
        let mut mismatched = Vec::new();
        if !has_more {
            let sums = members(member(o, "checksums")?, "checksums")?;
            let keys: BTreeSet<&String> = sums.keys().collect();
            let active: BTreeSet<&String> = next.scopes.keys().collect();
            if keys != active {
                return Err("the checksum key set is not the active set".into());
            }
            for (s, sum) in sums {
                let want = Digest::from_checksum_json(sum).ok_or("a malformed checksum")?;
                if rebuild.contains(s) {
                    continue; // rebuild takes precedence
                }
                if next.scope_digest(s) != Some(want) {
                    // Only that scope's resumable state is lost.
                    if let Some(l) = next.scopes.get_mut(s) {
                        l.cursor = None;
                    }
                    mismatched.push(s.clone());
                }
            }
        }
        *self = next;
        Ok(Applied {
            has_more,
            changes: changes.len(),
            rebuild,
            mismatched,
            cursors: issued,
        })
    }

    /// One change: its row checksum verified before it is applied.
    fn apply_change(&mut self, c: &Value, removed: &BTreeSet<String>) -> Result<(), String> {
        let c = members(c, "a change")?;
        let scope = string(c, "scope")?;
        if removed.contains(scope) {
            return Err(format!("a change for removed scope {scope}"));
        }
        let table_id = string(c, "table")?;
        let version = string(c, "server_version")?;
        let op = string(c, "op")?;
        // Every row is verified before anything is applied.
        let (identity, digest) = {
            let (identity, checked) = self.verify(c, table_id)?;
            let digest = c.get("row").map(&checked).transpose()?;
            (identity, digest)
        };
        let local = self
            .scopes
            .get_mut(scope)
            .ok_or_else(|| format!("a change for {scope}, not active"))?;
        let held = |digest, tombstone| LocalRow {
            table: table_id.to_owned(),
            version: version.to_owned(),
            digest,
            tombstone,
        };
        match (op, digest) {
            ("upsert", Some(d)) => {
                local
                    .rows
                    .insert(identity.as_bytes().to_vec(), held(d, false));
            }
            ("delete", Some(d)) => {
                local
                    .rows
                    .insert(identity.as_bytes().to_vec(), held(d, true));
            }
            ("delete", None) => {
                if c.contains_key("row_checksum") {
                    return Err("a delete without row carries a checksum".into());
                }
                local.rows.remove(identity.as_bytes());
            }
            _ => return Err(format!("op {op} with this shape is not a pull change")),
        }
        Ok(())
    }
}

impl Replica {
    /// A change's or record's row identity, and the check of a row it
    /// carries: the row fits its table, its key is `pk`, and its
    /// `row_checksum` is the digest the client recomputes.
    #[allow(clippy::type_complexity)]
    fn verify<'a>(
        &'a self,
        c: &'a Object,
        table_id: &'a str,
    ) -> Result<(RowIdentity, impl Fn(&Value) -> Result<Digest, String> + 'a), String> {
        let table = self
            .manifest
            .table(table_id)
            .ok_or_else(|| format!("a row of unknown table {table_id}"))?;
        let pk = members(member(c, "pk")?, "pk")?;
        let pk_field = table.primary_key();
        if pk.len() != 1 {
            return Err("pk is not one field".into());
        }
        let pk_value = member(pk, pk_field.field_id())?;
        let key = value::decode(pk_field.field_type(), pk_value)
            .ok()
            .flatten()
            .ok_or("pk does not fit its type")?;
        let identity = RowIdentity::of(table, &key);
        let version = string(c, "server_version")?;
        let server_version = ServerVersion::parse(version).ok_or("a malformed server_version")?;
        let hash = self.manifest.hash();
        let at = identity.clone();
        let checked = move |row: &Value| -> Result<Digest, String> {
            let decoded = table
                .decode_row(members(row, "row")?)
                .map_err(|e| format!("the row does not fit its table: {e:?}"))?;
            if table.row_key(&decoded) != Some(&key) {
                return Err("the row's key is not pk".into());
            }
            let d = row_digest(&hash, table, &at, &decoded, &server_version);
            let sent = Digest::from_checksum_json(member(c, "row_checksum")?)
                .ok_or("a malformed row_checksum")?;
            if sent != d {
                return Err(format!("row_checksum of a {table_id} row does not verify"));
            }
            Ok(d)
        };
        Ok((identity, checked))
    }

    /// Applies one 200 rebuild page of `rebuilding`'s scope, as the spec
    /// tells a client to: every record verified before it is held; on the
    /// final page the complete staged scope's checksum is recomputed, and
    /// only when it matches do the rows replace the scope's and the final
    /// cursor get installed.
    pub fn apply_rebuild(
        &mut self,
        rebuilding: &mut Rebuilding,
        page: &[u8],
    ) -> Result<RebuildStep, String> {
        let v = json::parse(page).map_err(|_| "the rebuild page is not JSON".to_owned())?;
        let o = members(&v, "the rebuild page")?;
        if string(o, "scope")? != rebuilding.scope {
            return Err("a rebuild page of another scope".into());
        }
        let has_more = match member(o, "has_more")? {
            Value::Bool(b) => *b,
            _ => return Err("has_more is not a boolean".into()),
        };
        let mut rows = Vec::new();
        for r in array(o, "records")? {
            let r = members(r, "a record")?;
            let table_id = string(r, "table")?;
            let (identity, checked) = self.verify(r, table_id)?;
            let row = member(r, "row")?;
            let digest = checked(row)?;
            let table = self.manifest.table(table_id).ok_or("an unknown table")?;
            let tombstone = table
                .lifecycle()
                .deleted_at_field_id
                .as_ref()
                .and_then(|f| row.as_object()?.get(f))
                .is_some_and(|d| *d != Value::Null);
            let held = LocalRow {
                table: table_id.to_owned(),
                version: string(r, "server_version")?.to_owned(),
                digest,
                tombstone,
            };
            rows.push((identity.as_bytes().to_vec(), held));
        }
        for (identity, held) in rows {
            if let Some((last, _)) = rebuilding.rows.last_key_value()
                && *last >= identity
            {
                return Err("rebuild records are not in row-identity order".into());
            }
            rebuilding.rows.insert(identity, held);
        }
        if has_more {
            if o.contains_key("checksum") || o.contains_key("final_scope_cursor") {
                return Err("an intermediate page carries final members".into());
            }
            let next = string(o, "cursor")?.to_owned();
            rebuilding.continuation = Some(next.clone());
            return Ok(RebuildStep::More(next));
        }
        if member(o, "cursor")? != &Value::Null {
            return Err("a final page carries a continuation".into());
        }
        let want =
            Digest::from_checksum_json(member(o, "checksum")?).ok_or("a malformed checksum")?;
        let cursor = string(o, "final_scope_cursor")?.to_owned();
        let mut d = ScopeDigest::new(
            &self.manifest.hash(),
            &rebuilding.scope,
            rebuilding.rows.len() as u64,
        );
        for (identity, row) in &rebuilding.rows {
            d.push(&RowIdentity::from_bytes(identity.clone()), &row.digest);
        }
        if d.finish().ok() != Some(want) {
            return Ok(RebuildStep::Mismatch);
        }
        let local = self
            .scopes
            .get_mut(&rebuilding.scope)
            .ok_or("a rebuild of a scope that is not active")?;
        local.rows = std::mem::take(&mut rebuilding.rows);
        local.cursor = Some(cursor);
        Ok(RebuildStep::Done)
    }
}

/// One rebuild attempt of one scope on the client: its `rebuild_id`, the
/// rows applied so far (apart from the scope's until the final page), and
/// the continuation to present next.
#[derive(Clone, Debug)]
pub struct Rebuilding {
    pub scope: String,
    pub rebuild_id: String,
    pub rows: BTreeMap<Vec<u8>, LocalRow>,
    pub continuation: Option<String>,
}

impl Rebuilding {
    /// A new attempt of `scope` under `rebuild_id`.
    pub fn new(scope: &str, rebuild_id: &str) -> Rebuilding {
        Rebuilding {
            scope: scope.to_owned(),
            rebuild_id: rebuild_id.to_owned(),
            rows: BTreeMap::new(),
            continuation: None,
        }
    }
}

/// What one applied rebuild page means for the attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RebuildStep {
    /// More pages: present this continuation next.
    More(String),
    /// The scope is rebuilt: rows and final cursor installed.
    Done,
    /// The staged scope's checksum did not verify: nothing installed.
    Mismatch,
}

/// One effect of a scope as the server recorded it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EffectView {
    pub identity: Vec<u8>,
    pub position: StreamPosition,
    pub version: String,
    /// A delete without a row: the client holds nothing for the row.
    pub removes: bool,
    /// A delete with its tombstone row.
    pub tombstone: bool,
}

/// No cursor passes an undelivered effect: after installing a cursor at
/// `cursor` for a scope whose recorded effects are `effects` (in position
/// order, every one since the stream began), the client's rows hold, for
/// each row identity, its last effect at or before the cursor, unless a
/// later effect of the row comes after the cursor.
pub fn check_cursor(
    scope: &str,
    effects: &[EffectView],
    cursor: StreamPosition,
    rows: &BTreeMap<Vec<u8>, LocalRow>,
) -> Result<(), String> {
    let mut last: BTreeMap<&[u8], &EffectView> = BTreeMap::new();
    let mut later: BTreeSet<&[u8]> = BTreeSet::new();
    for e in effects {
        if e.position <= cursor {
            last.insert(&e.identity, e);
        } else {
            later.insert(&e.identity);
        }
    }
    for (identity, e) in last {
        if later.contains(identity) {
            continue; // covered by a candidate still to come
        }
        let held = rows.get(identity);
        let ok = match held {
            None => e.removes,
            Some(r) => !e.removes && r.version == e.version && r.tombstone == e.tombstone,
        };
        if !ok {
            return Err(format!(
                "{scope}: a cursor at {cursor:?} passed the effect at {:?} (version {}), the client holds {:?}",
                e.position,
                e.version,
                held.map(|r| &r.version)
            ));
        }
    }
    Ok(())
}

/// One change of a pull page, as the cursor check sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivered {
    pub identity: Vec<u8>,
    pub version: String,
    /// A delete without a row.
    pub removes: bool,
    /// A delete with its tombstone row.
    pub tombstone: bool,
}

/// One scope of one answered pull: the cursor presented, the one issued,
/// the scope's effects when the page arrived, and the page's changes of
/// the scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CursorStep {
    pub client: String,
    pub scope: String,
    pub presented: StreamPosition,
    pub issued: StreamPosition,
    /// The scope's effects after `presented`, in position order.
    pub effects: Vec<EffectView>,
    pub delivered: Vec<Delivered>,
}

/// The row identity bytes of a change or record under `m` (its table and
/// typed key), if it names one.
pub fn identity_of(m: &Manifest, change: &Value) -> Option<Vec<u8>> {
    let c = change.as_object()?;
    let table = m.table(c.get("table")?.as_str()?)?;
    let pk = c.get("pk")?.as_object()?;
    let field = table.primary_key();
    let key = value::decode(field.field_type(), pk.get(field.field_id())?)
        .ok()
        .flatten()?;
    Some(RowIdentity::of(table, &key).as_bytes().to_vec())
}

impl Delivered {
    /// A pull page's change of `scope`, if `change` is one.
    pub fn of(m: &Manifest, scope: &str, change: &Value) -> Option<Delivered> {
        let c = change.as_object()?;
        if c.get("scope")?.as_str()? != scope {
            return None;
        }
        let delete = match c.get("op")?.as_str()? {
            "upsert" => false,
            "delete" => true,
            _ => return None,
        };
        let has_row = c.get("row").is_some_and(|r| *r != Value::Null);
        Some(Delivered {
            identity: identity_of(m, change)?,
            version: c.get("server_version")?.as_str()?.to_owned(),
            removes: delete && !has_row,
            tombstone: delete && has_row,
        })
    }
}

/// No page's cursor passes an effect the page did not deliver, judged on
/// the page itself (a later write can hide a skipped one from every
/// checksum): for each row whose last effect through the issued cursor
/// lies after the presented one, and that has no effect after the issued
/// cursor, the page carries that effect.
pub fn check_cursor_steps(steps: &[CursorStep]) -> Result<(), Vec<String>> {
    let mut v = Vec::new();
    for s in steps {
        let mut last: BTreeMap<&[u8], &EffectView> = BTreeMap::new();
        let mut later: BTreeSet<&[u8]> = BTreeSet::new();
        for e in s.effects.iter().filter(|e| e.position > s.presented) {
            if e.position <= s.issued {
                last.insert(&e.identity, e);
            } else {
                later.insert(&e.identity);
            }
        }
        for (identity, e) in last {
            if later.contains(identity) {
                continue; // a later page delivers the row
            }
            let carried = s.delivered.iter().any(|d| {
                d.identity == identity
                    && d.removes == e.removes
                    && d.tombstone == e.tombstone
                    && (e.removes || d.version == e.version)
            });
            if !carried {
                v.push(format!(
                    "{}: {}: a cursor issued at {:?} passed the effect at {:?} (version {}) that its page did not carry",
                    s.client, s.scope, s.issued, e.position, e.version
                ));
            }
        }
    }
    if v.is_empty() { Ok(()) } else { Err(v) }
}

/// One scope of one answered pull, beside the retention floor: the floor
/// read before the request and after the answer (it only moves forward,
/// so the floor the server judged by lies between).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FloorSeen {
    pub client: String,
    pub scope: String,
    /// The position of the cursor presented.
    pub presented: StreamPosition,
    pub floor_before: StreamPosition,
    pub floor_after: StreamPosition,
    /// The answer sent the scope to rebuild.
    pub rebuilt: bool,
}

/// The retention floor (wire spec: "Ordinary retention-floor movement
/// preserves a cursor at or above the new floor and makes a cursor below
/// the floor stale"), for scopes nothing else makes stale: a cursor at or
/// above the floor is never sent to rebuild, and one below it is never
/// served.
pub fn check_floor(seen: &[FloorSeen]) -> Result<(), Vec<String>> {
    let mut v = Vec::new();
    for s in seen {
        assert!(
            s.floor_before <= s.floor_after,
            "the floor only moves forward"
        );
        if s.rebuilt && s.presented >= s.floor_after {
            v.push(format!(
                "{} {}: a cursor at {:?}, at or above the floor {:?}, was sent to rebuild",
                s.client, s.scope, s.presented, s.floor_after
            ));
        }
        if !s.rebuilt && s.presented < s.floor_before {
            v.push(format!(
                "{} {}: a cursor at {:?}, below the floor {:?}, was served",
                s.client, s.scope, s.presented, s.floor_before
            ));
        }
    }
    if v.is_empty() { Ok(()) } else { Err(v) }
}

/// Read your writes (wire spec, "A page or terminal checksum can never
/// claim state older than the client's accepted push"): after a terminal
/// page installed the cursor of `scope`, `rows` holds each of `pushed`, the
/// identities of rows the client's accepted pushes put into that scope
/// before it sent the request (and that nothing else moves or deletes).
pub fn check_own_writes(
    scope: &str,
    pushed: &[Vec<u8>],
    rows: &BTreeMap<Vec<u8>, LocalRow>,
) -> Result<(), String> {
    match pushed.iter().find(|identity| !rows.contains_key(*identity)) {
        Some(missing) => Err(format!(
            "{scope}: a terminal page installed its cursor without the client's accepted push of {}",
            String::from_utf8_lossy(missing)
        )),
        None => Ok(()),
    }
}

/// Checkpoints never move backward: `history` is every checkpoint read,
/// per (client, scope), in the order read.
/// No cursor crosses stream generations: for each scope of a pull page,
/// `(scope, generation of the cursor presented, generation of the cursor
/// returned)`. Positions of two generations are not comparable (ADR 003),
/// so a stale cursor's scope must go to rebuild, never continue.
pub fn check_generations(pairs: &[(String, u64, u64)]) -> Result<(), String> {
    match pairs.iter().find(|(_, before, after)| before != after) {
        Some((scope, before, after)) => Err(format!(
            "{scope}: a cursor of generation {before} continued as one of generation {after}"
        )),
        None => Ok(()),
    }
}

pub fn check_checkpoints(
    history: &BTreeMap<(String, String), Vec<(u64, StreamPosition)>>,
) -> Result<(), String> {
    for ((client, scope), seen) in history {
        for w in seen.windows(2) {
            let ((g0, p0), (g1, p1)) = (w[0], w[1]);
            if g1 < g0 || (g1 == g0 && p1 < p0) {
                return Err(format!(
                    "{client} {scope}: a checkpoint moved back from {p0:?} to {p1:?}"
                ));
            }
        }
    }
    Ok(())
}

/// After quiescence: the client's copy of `scope` is the server's members
/// (row identity and digest), exactly.
pub fn check_converged(
    client: &str,
    scope: &str,
    local: &BTreeMap<Vec<u8>, LocalRow>,
    server: &[(Vec<u8>, Digest)],
) -> Result<(), String> {
    let mine: Vec<(&[u8], &Digest)> = local
        .iter()
        .map(|(i, r)| (i.as_slice(), &r.digest))
        .collect();
    let theirs: Vec<(&[u8], &Digest)> = server.iter().map(|(i, d)| (i.as_slice(), d)).collect();
    if mine != theirs {
        return Err(format!(
            "{client} {scope}: the local copy ({} rows) is not the server's ({} rows)",
            mine.len(),
            theirs.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn at(lsn: u64) -> StreamPosition {
        StreamPosition::Effect {
            commit_lsn: lsn,
            event_ordinal: 0,
            effect_ordinal: 0,
        }
    }

    #[test]
    fn the_floor_check_catches_both_sides() {
        let seen = |presented: u64, floor: u64, rebuilt: bool| FloorSeen {
            client: "c".into(),
            scope: "user:u".into(),
            presented: at(presented),
            floor_before: at(floor),
            floor_after: at(floor),
            rebuilt,
        };
        assert!(check_floor(&[seen(5, 5, false), seen(4, 5, true)]).is_ok());
        assert!(
            check_floor(&[seen(5, 5, true)]).is_err(),
            "at the floor, rebuilt"
        );
        assert!(
            check_floor(&[seen(4, 5, false)]).is_err(),
            "below it, served"
        );
        // The floor moved while the request was in flight: either is right.
        let moving = |rebuilt| FloorSeen {
            floor_before: at(3),
            ..seen(4, 5, rebuilt)
        };
        assert!(check_floor(&[moving(true), moving(false)]).is_ok());
    }

    fn effect(row: u8, lsn: u64, version: &str, removes: bool) -> EffectView {
        EffectView {
            identity: vec![row],
            position: at(lsn),
            version: version.into(),
            removes,
            tombstone: false,
        }
    }

    #[test]
    fn the_cursor_step_check_catches_a_skipped_effect() {
        let delivered = |row: u8, version: &str| Delivered {
            identity: vec![row],
            version: version.into(),
            removes: false,
            tombstone: false,
        };
        let step = |issued: u64, delivered: Vec<Delivered>| CursorStep {
            client: "c".into(),
            scope: "user:u".into(),
            presented: at(2),
            issued: at(issued),
            // Row 1 before the presented cursor; row 2 twice after it; row
            // 3 once, then again past a cursor at 5.
            effects: vec![
                effect(1, 1, "v1", false),
                effect(2, 3, "v2", false),
                effect(3, 4, "v3", false),
                effect(2, 5, "v4", false),
                effect(3, 6, "v5", false),
            ],
            delivered,
        };
        assert!(check_cursor_steps(&[step(5, vec![delivered(2, "v4")])]).is_ok());
        assert!(
            check_cursor_steps(&[step(6, vec![delivered(2, "v4"), delivered(3, "v5")])]).is_ok()
        );
        assert!(
            check_cursor_steps(&[step(6, vec![delivered(2, "v4"), delivered(3, "v3")])]).is_err(),
            "row 3's last effect skipped, an older one carried"
        );
        assert!(
            check_cursor_steps(&[step(5, vec![delivered(2, "v2")])]).is_err(),
            "row 2's last effect before the cursor skipped"
        );
    }

    fn held(rows: &[(u8, &str)]) -> BTreeMap<Vec<u8>, LocalRow> {
        rows.iter()
            .map(|(r, v)| {
                (
                    vec![*r],
                    LocalRow {
                        table: "t".into(),
                        version: (*v).into(),
                        digest: Digest([0; 32]),
                        tombstone: false,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn a_cursor_past_an_undelivered_effect_is_caught() {
        let effects = [
            effect(1, 1, "a1", false),
            effect(2, 2, "b1", false),
            effect(1, 3, "a1", true),
        ];
        assert!(check_cursor("s", &effects, at(2), &held(&[(1, "a1"), (2, "b1")])).is_ok());
        // Row 1's effect at 1 is covered by its removal at 3, still ahead.
        assert!(check_cursor("s", &effects, at(2), &held(&[(2, "b1")])).is_ok());
        // Row 2's effect at 2 was neither delivered nor covered.
        assert!(check_cursor("s", &effects, at(2), &held(&[(1, "a1")])).is_err());
        // Through 3, row 1 must be gone.
        assert!(check_cursor("s", &effects, at(3), &held(&[(1, "a1"), (2, "b1")])).is_err());
        assert!(check_cursor("s", &effects, at(3), &held(&[(2, "b1")])).is_ok());
        // A stale version held is caught too.
        assert!(check_cursor("s", &effects, at(2), &held(&[(2, "b0")])).is_err());
    }

    #[test]
    fn a_checkpoint_moving_back_is_caught() {
        let key = ("c".to_owned(), "s".to_owned());
        let ok = [(
            key.clone(),
            vec![(1, at(1)), (1, at(1)), (1, at(4)), (2, at(0))],
        )];
        assert!(check_checkpoints(&ok.into_iter().collect()).is_ok());
        let back = [(key, vec![(1, at(4)), (1, at(3))])];
        assert!(check_checkpoints(&back.into_iter().collect()).is_err());
    }

    #[test]
    fn a_local_copy_unlike_the_server_is_caught() {
        let local = held(&[(1, "a")]);
        let same = [(vec![1], Digest([0; 32]))];
        assert!(check_converged("c", "s", &local, &same).is_ok());
        assert!(check_converged("c", "s", &local, &[(vec![1], Digest([1; 32]))]).is_err());
        assert!(check_converged("c", "s", &local, &[]).is_err());
    }
}
