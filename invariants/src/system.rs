//! The whole system at quiescence (issue 14): real clients that connected,
//! wrote offline, pushed from their outboxes, pulled and rebuilt through
//! every fault, judged by what each one ends holding and what the server
//! holds:
//!
//! - each client holds exactly its assigned scopes, and each scope's rows
//!   are the server's members, digest for digest;
//! - no outbox batch is lost (nothing pending, every authored mutation has
//!   exactly one outcome) or applied twice (a new row's insert is
//!   `applied`: a second execution would have found the row);
//! - every accepted insert reached its author and every other client of
//!   the author's user;
//! - no terminal checksum ever differed from a client's copy (the run
//!   damages none, so a mismatch means pages that did not add up);
//! - every row a client holds digests, recomputed here from its content
//!   and version, to the digest it holds (a client that trusted a sent
//!   checksum holds rows the server never sent).
//!
//! And on every page a client applies, apart from the server's own view
//! ([`assigned_during`]): it then holds rows only of scopes its user was
//! assigned at some instant while that page was made.

use std::collections::BTreeMap;

use protocol::digest::{Digest, RowIdentity, row_digest};
use protocol::ids::ServerVersion;
use protocol::json;
use protocol::manifest::Manifest;
use protocol::value::TypedValue;

/// One mutation a client authored: a new note, or an edit of one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Authored {
    pub mutation_id: String,
    pub note: String,
    /// An insert of a key no one else writes.
    pub fresh_insert: bool,
}

/// The settled outcome of one mutation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settled {
    pub mutation_id: String,
    pub status: String,
    pub code: Option<String>,
}

/// One row as a client holds it in one scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldRow {
    pub scope: String,
    pub table: String,
    pub identity: Vec<u8>,
    /// The complete row, JSON text.
    pub row: String,
    pub version: String,
    pub digest: Digest,
}

/// One client at the end of a run.
#[derive(Clone, Debug, Default)]
pub struct ClientEnd {
    pub client_id: String,
    pub user: String,
    /// Its holdings: scope -> (row identity, digest) in identity order.
    pub scopes: BTreeMap<String, Vec<(Vec<u8>, Digest)>>,
    pub authored: Vec<Authored>,
    pub outcomes: Vec<Settled>,
    /// Writes still queued or sealed.
    pub pending: usize,
    /// Scopes whose terminal checksum differed, every time one did.
    pub mismatched: Vec<String>,
    /// Every row it holds, with its content.
    pub held: Vec<HeldRow>,
}

/// The server at the end of a run.
#[derive(Clone, Debug, Default)]
pub struct ServerEnd {
    /// client ID -> assigned scopes.
    pub assigned: BTreeMap<String, Vec<String>>,
    /// scope -> members (row identity, digest) in identity order.
    pub members: BTreeMap<String, Vec<(Vec<u8>, Digest)>>,
    /// The current manifest, to recompute held rows' digests under.
    pub manifest: Option<Manifest>,
}

/// Whether `h`'s content and version digest to its digest under `m`.
pub fn digests_to_itself(m: &Manifest, h: &HeldRow) -> bool {
    let Some(table) = m.table(&h.table) else {
        return false;
    };
    let Some(decoded) = json::parse(h.row.as_bytes())
        .ok()
        .and_then(|v| table.decode_row(v.as_object()?).ok())
    else {
        return false;
    };
    let (Some(key), Some(version)) = (table.row_key(&decoded), ServerVersion::parse(&h.version))
    else {
        return false;
    };
    let identity = RowIdentity::of(table, key);
    identity.as_bytes() == h.identity.as_slice()
        && row_digest(&m.hash(), table, &identity, &decoded, &version) == h.digest
}

/// One operator change of a grant, as the run saw it happen: it took
/// effect at some instant of `[from, to]` (microseconds). One operator
/// makes the changes one after another, so their spans do not overlap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrantChange {
    pub user: String,
    pub scope: String,
    pub granted: bool,
    pub from: i64,
    pub to: i64,
}

/// Whether `user` may have held a grant of `scope` at some instant of
/// `[a, b]`: granted when `a` came (by the last change that had surely
/// happened, none meaning not granted), or granted by a change that may
/// have happened within the span.
pub fn granted_during(changes: &[GrantChange], user: &str, scope: &str, a: i64, b: i64) -> bool {
    debug_assert!(
        changes.windows(2).all(|w| w[0].to <= w[1].from),
        "grant changes come one after another"
    );
    let mine = || {
        changes
            .iter()
            .filter(|c| c.user == user && c.scope == scope)
    };
    let at_start = mine().rfind(|c| c.to <= a).is_some_and(|c| c.granted);
    at_start || mine().any(|c| c.granted && c.from <= b && c.to >= a)
}

/// The per-page check: each scope in `held` (the scopes a client holds
/// rows of, just after applying a page made within `[a, b]`) is one of
/// `fixed` (the user's own and shared scopes, always assigned) or was
/// granted to `user` at some instant of the span.
pub fn assigned_during<'a>(
    held: impl IntoIterator<Item = &'a str>,
    fixed: &[String],
    changes: &[GrantChange],
    user: &str,
    (a, b): (i64, i64),
) -> Result<(), String> {
    for scope in held {
        if !fixed.iter().any(|f| f == scope) && !granted_during(changes, user, scope, a, b) {
            return Err(format!(
                "holds rows of {scope} after a page, which its user was not assigned while the page was made"
            ));
        }
    }
    Ok(())
}

fn note_identity(note: &str) -> Vec<u8> {
    RowIdentity::new(
        "tbl_notes",
        "fld_notes_id",
        &TypedValue::String(note.to_owned()),
    )
    .as_bytes()
    .to_vec()
}

/// Every invariant of the module; each violation once.
pub fn check_system(clients: &[ClientEnd], server: &ServerEnd) -> Result<(), Vec<String>> {
    let mut v = Vec::new();
    for c in clients {
        let id = &c.client_id;
        let assigned = server.assigned.get(id).cloned().unwrap_or_default();
        let held: Vec<&String> = c.scopes.keys().collect();
        if held
            .iter()
            .map(|s| s.as_str())
            .ne(assigned.iter().map(String::as_str))
        {
            v.push(format!(
                "{id}: holds scopes {held:?}, assigned {assigned:?}"
            ));
        }
        for scope in &assigned {
            let mine = c.scopes.get(scope).map(Vec::as_slice).unwrap_or_default();
            let theirs = server
                .members
                .get(scope)
                .map(Vec::as_slice)
                .unwrap_or_default();
            if mine != theirs {
                v.push(format!(
                    "{id} {scope}: the local copy ({} rows) is not the server's ({} rows)",
                    mine.len(),
                    theirs.len()
                ));
            }
        }
        if c.pending > 0 {
            v.push(format!(
                "{id}: {} write(s) never left the outbox",
                c.pending
            ));
        }
        let mut settled: BTreeMap<&str, Vec<&Settled>> = BTreeMap::new();
        for o in &c.outcomes {
            settled.entry(o.mutation_id.as_str()).or_default().push(o);
        }
        for a in &c.authored {
            match settled.remove(a.mutation_id.as_str()).as_deref() {
                None | Some([]) => v.push(format!("{id}: mutation of {} has no outcome", a.note)),
                Some([o]) => {
                    if a.fresh_insert && o.status != "applied" {
                        v.push(format!(
                            "{id}: the insert of {} was {} {:?}: executed twice",
                            a.note, o.status, o.code
                        ));
                    }
                }
                Some(_) => v.push(format!("{id}: mutation of {} settled twice", a.note)),
            }
        }
        if !settled.is_empty() {
            v.push(format!("{id}: outcomes of mutations it never authored"));
        }
        if let Some(m) = &server.manifest
            && let Some(h) = c.held.iter().find(|h| !digests_to_itself(m, h))
        {
            v.push(format!(
                "{id}: holds a {} row in {} whose content is not its digest",
                h.table, h.scope
            ));
        }
        if !c.mismatched.is_empty() {
            v.push(format!(
                "{id}: terminal checksums differed from its copy in {:?}",
                c.mismatched
            ));
        }
        // Every accepted insert reached every client of its author's user.
        for a in c.authored.iter().filter(|a| a.fresh_insert) {
            let applied = c
                .outcomes
                .iter()
                .any(|o| o.mutation_id == a.mutation_id && o.status == "applied");
            if !applied {
                continue;
            }
            let identity = note_identity(&a.note);
            let scope = format!("user:{}", c.user);
            for other in clients.iter().filter(|o| o.user == c.user) {
                let holds = other
                    .scopes
                    .get(&scope)
                    .is_some_and(|rows| rows.iter().any(|(i, _)| *i == identity));
                if !holds {
                    v.push(format!(
                        "{}: the accepted insert of {} by {id} never arrived",
                        other.client_id, a.note
                    ));
                }
            }
        }
    }
    if v.is_empty() { Ok(()) } else { Err(v) }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn settled(m: &str, status: &str, code: Option<&str>) -> Settled {
        Settled {
            mutation_id: m.into(),
            status: status.into(),
            code: code.map(str::to_owned),
        }
    }

    fn world() -> (Vec<ClientEnd>, ServerEnd) {
        let n1 = note_identity("n1");
        let rows = vec![(n1, Digest([1; 32]))];
        let client = |id: &str| ClientEnd {
            client_id: id.into(),
            user: "u".into(),
            scopes: BTreeMap::from([("user:u".to_owned(), rows.clone())]),
            ..ClientEnd::default()
        };
        let mut a = client("a");
        a.authored.push(Authored {
            mutation_id: "m1".into(),
            note: "n1".into(),
            fresh_insert: true,
        });
        a.outcomes.push(settled("m1", "applied", None));
        let server = ServerEnd {
            assigned: BTreeMap::from([
                ("a".to_owned(), vec!["user:u".to_owned()]),
                ("b".to_owned(), vec!["user:u".to_owned()]),
            ]),
            members: BTreeMap::from([("user:u".to_owned(), rows.clone())]),
            manifest: None,
        };
        (vec![a, client("b")], server)
    }

    #[test]
    fn a_converged_run_passes_and_each_defect_fails() {
        let (clients, server) = world();
        assert_eq!(check_system(&clients, &server), Ok(()));
        type Defect = Box<dyn Fn(&mut Vec<ClientEnd>)>;
        let broken: Vec<Defect> = vec![
            Box::new(|c| c[1].scopes.clear()), // never arrived, and scopes
            Box::new(|c| c[0].scopes.get_mut("user:u").unwrap()[0].1 = Digest([2; 32])),
            Box::new(|c| c[0].pending = 1),      // lost in the outbox
            Box::new(|c| c[0].outcomes.clear()), // no outcome
            Box::new(|c| c[0].outcomes.push(settled("m1", "applied", None))), // twice
            Box::new(|c| c[0].outcomes[0] = settled("m1", "conflict", Some("row_already_exists"))), // re-executed
            Box::new(|c| c[1].mismatched.push("user:u".into())),
            Box::new(|c| c[1].outcomes.push(settled("m9", "applied", None))),
        ];
        for (k, b) in broken.iter().enumerate() {
            let mut c = clients.clone();
            b(&mut c);
            assert!(check_system(&c, &server).is_err(), "defect {k} is caught");
        }
    }

    fn change(scope: &str, granted: bool, from: i64, to: i64) -> GrantChange {
        GrantChange {
            user: "u".into(),
            scope: scope.into(),
            granted,
            from,
            to,
        }
    }

    #[test]
    fn a_page_may_hold_only_what_was_assigned_while_it_was_made() {
        // team:a granted within [10, 12], revoked within [20, 25].
        let log = [
            change("team:a", true, 10, 12),
            change("team:a", false, 20, 25),
        ];
        let fixed = ["user:u".to_owned()];
        let judge =
            |held: &[&str], span| assigned_during(held.iter().copied(), &fixed, &log, "u", span);
        assert_eq!(judge(&["user:u"], (0, 5)), Ok(()), "its own scope, always");
        assert!(judge(&["team:a"], (0, 9)).is_err(), "before the grant");
        assert_eq!(
            judge(&["team:a"], (0, 10)),
            Ok(()),
            "the grant may have happened"
        );
        assert_eq!(judge(&["team:a"], (13, 19)), Ok(()), "granted throughout");
        assert_eq!(
            judge(&["team:a"], (24, 30)),
            Ok(()),
            "the revoke may not have happened"
        );
        assert!(judge(&["team:a"], (26, 30)).is_err(), "after the revoke");
        assert!(
            judge(&["user:u", "team:b"], (13, 19)).is_err(),
            "never granted"
        );
        let other = [GrantChange {
            user: "v".into(),
            ..change("team:a", true, 0, 1)
        }];
        assert!(
            assigned_during(["team:a"], &fixed, &other, "u", (5, 6)).is_err(),
            "another user's grant"
        );
    }
}
