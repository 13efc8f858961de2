//! Evolution (ADR 0020): after the config changed mid-run and everything
//! settled, every scope holds exactly the rows the current config places
//! in it, with the fields of the current manifest. The expected contents
//! are computed here from the source tables, by the notes example's rules
//! written by hand (they share no code with the materializer): notes in
//! `user:{owner_id}` and, through `note_shares`, `group:{team_id}`;
//! templates in `templates_public`.

use std::collections::BTreeMap;

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
}
