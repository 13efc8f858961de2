//! Evolution (ADR 0020): after the config changed mid-run and everything
//! settled, every scope holds exactly the rows the current config places
//! in it, with the fields of the current manifest. The expected contents
//! are computed here from the source tables, by the notes example's rules
//! written by hand (they share no code with the materializer): notes in
//! `user:{owner_id}` and, through `note_shares`, `group:{team_id}`;
//! templates in `templates_public`. And a process of the old deploy that
//! restarts after the change is refused.

use std::collections::{BTreeMap, BTreeSet};

use protocol::json::Value;

/// A row of a source table, column -> text form (`None`: NULL).
pub type SourceRow = BTreeMap<String, Option<String>>;

/// What a client holds: scope -> row key -> wire row.
pub type Held = BTreeMap<String, BTreeMap<String, Value>>;

/// The fields compared, per table: (column, field ID) of text columns.
const NOTE_FIELDS: [(&str, &str); 4] = [
    ("id", "fld_notes_id"),
    ("owner_id", "fld_notes_owner"),
    ("title", "fld_notes_title"),
    ("body", "fld_notes_body"),
];
const TEMPLATE_FIELDS: [(&str, &str); 3] = [
    ("id", "fld_templates_id"),
    ("name", "fld_templates_name"),
    ("body", "fld_templates_body"),
];

fn text(row: &SourceRow, column: &str) -> Option<String> {
    row.get(column).cloned().flatten()
}

/// Before the change, once capture settled: every note of the source is
/// held in its owner's scope (a baseline, whole or handed over to
/// re-reads, left none out, ADR 0030). `notes` are the source's notes then,
/// `held` the `user:` scopes' rows then.
pub fn check_owned_notes(notes: &[SourceRow], held: &Held) -> Result<(), Vec<String>> {
    let missing: Vec<String> = notes
        .iter()
        .filter_map(|n| Some((text(n, "id")?, text(n, "owner_id")?)))
        .filter(|(id, owner)| {
            !held
                .get(&format!("user:{owner}"))
                .is_some_and(|rows| rows.contains_key(id))
        })
        .map(|(id, owner)| format!("note {id} is not held in user:{owner} before the change"))
        .collect();
    match missing.is_empty() {
        true => Ok(()),
        false => Err(missing),
    }
}

/// Every scope's rows under the config after the change, from the final
/// source tables.
pub fn expected_after(notes: &[SourceRow], shares: &[SourceRow], templates: &[SourceRow]) -> Held {
    let mut held: Held = BTreeMap::new();
    let wire = |row: &SourceRow, fields: &[(&str, &str)]| {
        let members = fields.iter().map(|(c, f)| {
            let v = text(row, c).map_or(Value::Null, Value::string);
            ((*f).to_owned(), v)
        });
        Value::Object(members.collect())
    };
    for n in notes {
        let (Some(id), Some(owner)) = (text(n, "id"), text(n, "owner_id")) else {
            continue;
        };
        let row = wire(n, &NOTE_FIELDS);
        let mut scopes = vec![format!("user:{owner}")];
        scopes.extend(
            shares
                .iter()
                .filter(|s| text(s, "note_id").as_ref() == Some(&id))
                .filter_map(|s| text(s, "team_id"))
                .map(|t| format!("group:{t}")),
        );
        for scope in scopes {
            held.entry(scope)
                .or_default()
                .insert(id.clone(), row.clone());
        }
    }
    for t in templates {
        if let Some(id) = text(t, "id") {
            held.entry("templates_public".into())
                .or_default()
                .insert(id, wire(t, &TEMPLATE_FIELDS));
        }
    }
    held
}

/// The compared fields of a held wire row (the others are not modelled).
fn compared(row: &Value) -> Value {
    let Some(o) = row.as_object() else {
        return Value::Null;
    };
    let fields = NOTE_FIELDS.iter().chain(&TEMPLATE_FIELDS).map(|(_, f)| *f);
    Value::Object(
        fields
            .filter_map(|f| o.get(f).map(|v| (f.to_owned(), v.clone())))
            .collect(),
    )
}

/// Every scope, expected or held, holds exactly its expected rows.
pub fn check_evolved(expected: &Held, held: &Held) -> Result<(), Vec<String>> {
    let empty = BTreeMap::new();
    let mut violations = Vec::new();
    let scopes = expected.keys().chain(held.keys());
    for scope in scopes.collect::<std::collections::BTreeSet<_>>() {
        let want = expected.get(scope).unwrap_or(&empty);
        let have = held.get(scope).unwrap_or(&empty);
        for (key, row) in want {
            match have.get(key) {
                None => violations.push(format!("{scope}: row {key} is missing")),
                Some(h) if compared(h) != *row => {
                    violations.push(format!("{scope}: row {key} holds other values"));
                }
                Some(_) => {}
            }
        }
        for key in have.keys().filter(|k| !want.contains_key(*k)) {
            violations.push(format!("{scope}: row {key} does not belong"));
        }
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

/// A device at the end of a run.
#[derive(Clone, Debug, Default)]
pub struct DeviceEnd {
    pub client_id: String,
    pub user: String,
    /// The scopes its session holds.
    pub scopes: BTreeSet<String>,
    /// What it holds, by scope and row key.
    pub held: Held,
    /// Terminal checksums that differed, as the client reported them.
    pub mismatched: Vec<String>,
}

/// A device converged under the current config: it is assigned exactly
/// its user's scope, the shared one and a `group:` scope per team of
/// `teams`, holds exactly their expected rows, and no checksum differed.
pub fn check_device(
    expected: &Held,
    teams: &[&str],
    device: &DeviceEnd,
) -> Result<(), Vec<String>> {
    let id = &device.client_id;
    let mut want: BTreeSet<String> = teams.iter().map(|t| format!("group:{t}")).collect();
    want.insert(format!("user:{}", device.user));
    want.insert("templates_public".into());
    let mut violations = Vec::new();
    if device.scopes != want {
        violations.push(format!("{id}: assigned {:?}, not {want:?}", device.scopes));
    }
    violations.extend(
        device
            .mismatched
            .iter()
            .map(|m| format!("{id}: checksum differed: {m}")),
    );
    let expected: Held = expected
        .iter()
        .filter(|(scope, _)| want.contains(*scope))
        .map(|(s, rows)| (s.clone(), rows.clone()))
        .collect();
    if let Err(v) = check_evolved(&expected, &device.held) {
        violations.extend(v.into_iter().map(|v| format!("{id}: {v}")));
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

/// A process of the old deploy that restarted after the new config
/// started was refused (ADR 0020 §8): `refused` is how it fared, `None`
/// if it never got an answer. Started, it would bring the replaced
/// config's schema and rules back over the newer ones.
pub fn check_replaced_refused(refused: Option<bool>) -> Result<(), Vec<String>> {
    match refused {
        Some(true) => Ok(()),
        Some(false) => Err(vec![
            "a process started under a config that a newer one replaced".into(),
        ]),
        None => Err(vec![
            "the old deploy's process got no answer to its start".into(),
        ]),
    }
}

/// The old deploy's process that ran all along no longer leads capture
/// once the new config started (ADR 0020 §6): leading, it would
/// materialize with the old model. `leads` is whether it led at the end,
/// `None` if it never started.
pub fn check_old_process_gave_way(leads: Option<bool>) -> Result<(), Vec<String>> {
    match leads {
        Some(false) => Ok(()),
        Some(true) => Err(vec![
            "a process on the replaced config still leads capture".into(),
        ]),
        None => Err(vec![
            "the old deploy's running process never started".into(),
        ]),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)] // tests fail loudly
    use super::*;

    fn row(cols: &[(&str, Option<&str>)]) -> SourceRow {
        cols.iter()
            .map(|(c, v)| ((*c).to_owned(), v.map(str::to_owned)))
            .collect()
    }

    #[test]
    fn a_missing_field_or_an_old_scope_is_caught() {
        let notes = [row(&[
            ("id", Some("n1")),
            ("owner_id", Some("u")),
            ("title", Some("t")),
            ("body", Some("b")),
        ])];
        let shares = [row(&[("note_id", Some("n1")), ("team_id", Some("red"))])];
        let expected = expected_after(&notes, &shares, &[]);
        assert_eq!(check_evolved(&expected, &expected), Ok(()));
        // The row as the old manifest had it: no body.
        let mut old = expected.clone();
        let stale = old.get_mut("user:u").unwrap().get_mut("n1").unwrap();
        let Value::Object(o) = stale else { panic!() };
        o.remove("fld_notes_body");
        assert!(check_evolved(&expected, &old).is_err());
        // The old membership: the note still in its team scope.
        let mut kept = expected.clone();
        let moved = kept.remove("group:red").unwrap();
        kept.insert("team:red".into(), moved);
        assert_eq!(check_evolved(&expected, &kept).unwrap_err().len(), 2);
    }

    #[test]
    fn a_device_with_an_old_scope_or_a_missing_row_is_caught() {
        let notes = [
            row(&[
                ("id", Some("n1")),
                ("owner_id", Some("u")),
                ("title", Some("t")),
            ]),
            row(&[
                ("id", Some("n2")),
                ("owner_id", Some("v")),
                ("title", Some("t")),
            ]),
        ];
        let shares = [row(&[("note_id", Some("n2")), ("team_id", Some("red"))])];
        let expected = expected_after(&notes, &shares, &[]);
        let mut device = DeviceEnd {
            client_id: "d".into(),
            user: "u".into(),
            scopes: ["user:u", "group:red", "templates_public"]
                .map(str::to_owned)
                .into(),
            held: expected
                .iter()
                .filter(|(s, _)| *s != "user:v")
                .map(|(s, r)| (s.clone(), r.clone()))
                .collect(),
            mismatched: Vec::new(),
        };
        assert_eq!(check_device(&expected, &["red"], &device), Ok(()));
        // Still assigned the team scope of the old config.
        let mut old = device.clone();
        old.scopes.insert("team:red".into());
        assert!(check_device(&expected, &["red"], &old).is_err());
        // A shared row missing.
        device.held.remove("group:red");
        assert_eq!(
            check_device(&expected, &["red"], &device)
                .unwrap_err()
                .len(),
            1
        );
    }
}
