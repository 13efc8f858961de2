//! Checkers that judge recorded protocol histories. They know only the wire
//! contract (through `protocol`), never the engine's internals, so a bug in
//! the engine cannot hide in a shared assumption.
//!
//! Connect invariants (issue 3):
//! - every 200 connect response has exactly the members its action requires;
//! - a client's generation never decreases;
//! - a client's `scope_set_version` never decreases, and between two of its
//!   responses it is unchanged exactly when the assignment is unchanged;
//! - a `client_id` is bound to one user forever: only that user ever gets a
//!   200 for it, and every other user gets 401 `auth_required`.

pub mod admission;
pub mod capture;
pub mod evolution;
pub mod pull;
pub mod push;
pub mod rebuild;
pub mod system;
pub mod tokens;

use std::collections::{BTreeMap, BTreeSet};

use protocol::json::{self, Value};
use protocol::manifest::Manifest;

/// One connect exchange as a client saw it, in the order the client received them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectObservation {
    /// The authenticated user that sent it.
    pub user: String,
    pub client_id: String,
    /// The scope IDs the request presented in `known_scopes`.
    pub known: BTreeSet<String>,
    pub status: u16,
    pub body: Vec<u8>,
}

/// The last accepted state of one client, as the checker follows it.
struct ClientView {
    generation: u64,
    scope_set_version: u64,
    assigned: BTreeSet<String>,
}

fn get<'a>(v: &'a Value, path: &[&str]) -> Result<&'a Value, String> {
    let mut v = v;
    for p in path {
        v = v
            .as_object()
            .and_then(|o| o.get(*p))
            .ok_or_else(|| format!("missing member {}", path.join(".")))?;
    }
    Ok(v)
}

fn uint(v: &Value) -> Result<u64, String> {
    match v {
        Value::Number(n) => n
            .as_exact_i64()
            .and_then(|i| u64::try_from(i).ok())
            .ok_or("not a nonnegative integer".into()),
        _ => Err("not an integer".into()),
    }
}

fn strings(v: &Value) -> Result<Vec<String>, String> {
    match v {
        Value::Array(items) => items
            .iter()
            .map(|s| s.as_str().map(str::to_owned).ok_or("not a string".into()))
            .collect(),
        _ => Err("not an array".into()),
    }
}

/// The member rules of each schema action (wire spec, "Exact schema action dispatch").
pub fn check_connect_shape(v: &Value) -> Result<(), String> {
    let schema = get(v, &["schema"])?;
    let action = get(schema, &["action"])?
        .as_str()
        .ok_or("schema.action is not a string")?;
    let has = |o: &Value, m: &str| o.as_object().is_some_and(|o| o.contains_key(m));
    let (def, affected, reason) = (
        has(v, "schema_definition"),
        has(v, "affected_scopes"),
        has(schema, "reason"),
    );
    let ok = match action {
        "none" => !def && !affected && !reason,
        "replace" => def && !affected && !reason,
        "rebuild_local" => {
            def && affected && !reason && !strings(get(v, &["affected_scopes"])?)?.is_empty()
        }
        "unsupported" => {
            let r = get(schema, &["reason"])?.as_str();
            !def && !affected
                && matches!(
                    r,
                    Some("unknown_schema_lineage" | "incompatible_schema_transition")
                )
        }
        other => return Err(format!("unknown schema action {other}")),
    };
    if !ok {
        return Err(format!(
            "action {action} has forbidden or lacks required members"
        ));
    }
    if def {
        let m = Manifest::from_json(get(v, &["schema_definition"])?.clone())
            .map_err(|e| format!("schema_definition: {e}"))?;
        if uint(get(schema, &["version"])?)? != m.schema_version()
            || get(schema, &["hash"])?.as_str() != Some(m.hash().to_hex().as_str())
        {
            return Err("schema version/hash differ from the inline manifest".into());
        }
    }
    if let Ok(affected) = get(v, &["affected_scopes"]).and_then(strings) {
        let mut sorted = affected.clone();
        sorted.sort();
        sorted.dedup();
        if sorted != affected {
            return Err("affected_scopes is not sorted and deduplicated".into());
        }
    }
    for m in [
        "server_time",
        "protocol_version",
        "client_generation",
        "scope_set_version",
        "scopes",
        "scope_cursor_updates",
    ] {
        get(v, &[m])?;
    }
    if uint(get(v, &["client_generation"])?)? == 0 {
        return Err("client_generation must be positive".into());
    }
    Ok(())
}

/// Judges a connect history; returns every violation found.
pub fn check_connects(history: &[ConnectObservation]) -> Result<(), Vec<String>> {
    let mut violations = Vec::new();
    let mut clients: BTreeMap<&str, ClientView> = BTreeMap::new();
    // The user each client_id was first answered 200 for.
    let mut bound: BTreeMap<&str, &str> = BTreeMap::new();
    for o in history.iter().filter(|o| o.status == 200) {
        bound.entry(&o.client_id).or_insert(&o.user);
    }
    for (i, o) in history.iter().enumerate() {
        let mut fail =
            |m: String| violations.push(format!("observation {i} (client {}): {m}", o.client_id));
        let owner = bound.get(o.client_id.as_str()).copied();
        if o.status == 200 && owner != Some(o.user.as_str()) {
            fail("a second user was answered 200 for a bound client_id".into());
            continue;
        }
        if o.status == 401 && owner == Some(o.user.as_str()) {
            fail("the bound user was refused its own client_id".into());
        }
        if o.status != 200 {
            continue;
        }
        let v = match json::parse(&o.body) {
            Ok(v) => v,
            Err(e) => {
                fail(format!("200 body is not JSON: {e}"));
                continue;
            }
        };
        if let Err(e) = check_connect_shape(&v) {
            fail(e);
            continue;
        }
        let parsed = (|| -> Result<(u64, u64, BTreeSet<String>), String> {
            let generation = uint(get(&v, &["client_generation"])?)?;
            let version = uint(get(&v, &["scope_set_version"])?)?;
            let mut assigned = o.known.clone();
            for r in strings(get(&v, &["scopes", "remove"])?)? {
                assigned.remove(&r);
            }
            let Value::Array(add) = get(&v, &["scopes", "add"])? else {
                return Err("scopes.add".into());
            };
            for a in add {
                assigned.insert(get(a, &["id"])?.as_str().ok_or("scopes.add id")?.to_owned());
            }
            Ok((generation, version, assigned))
        })();
        let (generation, version, assigned) = match parsed {
            Ok(p) => p,
            Err(e) => {
                fail(e);
                continue;
            }
        };
        if let Some(prev) = clients.get(o.client_id.as_str()) {
            if generation < prev.generation {
                fail(format!(
                    "client_generation decreased from {} to {generation}",
                    prev.generation
                ));
            }
            if version < prev.scope_set_version {
                fail(format!(
                    "scope_set_version decreased from {} to {version}",
                    prev.scope_set_version
                ));
            }
            if version == prev.scope_set_version && assigned != prev.assigned {
                fail(format!(
                    "the assignment changed but scope_set_version stayed {version}"
                ));
            }
            if version != prev.scope_set_version
                && assigned == prev.assigned
                && version == prev.scope_set_version + 1
            {
                fail(format!(
                    "scope_set_version moved to {version} by one without an assignment change"
                ));
            }
        }
        clients.insert(
            &o.client_id,
            ClientView {
                generation,
                scope_set_version: version,
                assigned,
            },
        );
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn response(
        generation: u64,
        version: u64,
        action: &str,
        add: &[&str],
        remove: &[&str],
    ) -> Vec<u8> {
        let add: Vec<String> = add
            .iter()
            .map(|s| format!(r#"{{"cursor":null,"id":"{s}"}}"#))
            .collect();
        let remove: Vec<String> = remove.iter().map(|s| format!(r#""{s}""#)).collect();
        format!(
            r#"{{"client_generation":{generation},"protocol_version":3,"schema":{{"action":"{action}","hash":"{h}","version":1}},"scope_cursor_updates":{{}},"scope_set_version":{version},"scopes":{{"add":[{}],"remove":[{}]}},"server_time":"2026-07-18T14:00:00.000000Z"}}"#,
            add.join(","),
            remove.join(","),
            h = "ab".repeat(32)
        )
        .into_bytes()
    }

    fn obs(known: &[&str], body: Vec<u8>) -> ConnectObservation {
        ConnectObservation {
            user: "u1".into(),
            client_id: "c1".into(),
            known: known.iter().map(|s| s.to_string()).collect(),
            status: 200,
            body,
        }
    }

    fn good() -> Vec<ConnectObservation> {
        vec![
            obs(&[], response(1, 1, "none", &["a"], &[])),
            obs(&["a"], response(1, 1, "none", &[], &[])),
            obs(&["a"], response(1, 2, "none", &["b"], &[])),
            obs(&["a", "b"], response(2, 3, "none", &[], &["a"])),
        ]
    }

    #[test]
    fn a_good_history_passes() {
        assert_eq!(check_connects(&good()), Ok(()));
    }

    #[test]
    fn mutated_histories_are_caught() {
        // Generation goes back.
        let mut h = good();
        h[3].body = response(0, 3, "none", &[], &["a"]);
        assert!(check_connects(&h).is_err());
        h[3].body = response(1, 3, "none", &[], &["a"]);
        h.push(obs(&["b"], response(1, 3, "none", &[], &[])));
        h[3].body = response(2, 3, "none", &[], &["a"]);
        let e = check_connects(&h).unwrap_err();
        assert!(
            e[0].contains("client_generation decreased from 2 to 1"),
            "{e:?}"
        );
        // The set changes without a version step.
        let mut h = good();
        h[2].body = response(1, 1, "none", &["b"], &[]);
        let e = check_connects(&h).unwrap_err();
        assert!(
            e[0].contains("the assignment changed but scope_set_version stayed 1"),
            "{e:?}"
        );
        // The version steps without a change.
        let mut h = good();
        h[1].body = response(1, 2, "none", &[], &[]);
        assert!(check_connects(&h).unwrap_err()[0].contains("without an assignment change"));
        // The version goes back.
        let mut h = good();
        h[3].body = response(2, 1, "none", &[], &["a"]);
        assert!(check_connects(&h).unwrap_err()[0].contains("scope_set_version decreased"));
        // An action with a forbidden member.
        let mut h = good();
        h[0].body = String::from_utf8(h[0].body.clone())
            .unwrap()
            .replace(
                r#""scope_set_version""#,
                r#""affected_scopes":["a"],"scope_set_version""#,
            )
            .into_bytes();
        assert!(
            check_connects(&h).unwrap_err()[0]
                .contains("action none has forbidden or lacks required members")
        );
        // replace without its manifest.
        let mut h = good();
        h[0].body = response(1, 1, "replace", &["a"], &[]);
        assert!(check_connects(&h).is_err());
        // A binding rewritten: a second user is answered 200 for the ID.
        let mut h = good();
        h[2].user = "u2".into();
        assert!(check_connects(&h).unwrap_err()[0].contains("a second user"));
        // A loser of the race refused, and the winner not: fine.
        let mut h = good();
        let mut refused = obs(&[], br#"{"error":{}}"#.to_vec());
        refused.user = "u2".into();
        refused.status = 401;
        h.insert(1, refused.clone());
        assert_eq!(check_connects(&h), Ok(()));
        // The winner refused its own ID.
        refused.user = "u1".into();
        h.insert(2, refused);
        assert!(check_connects(&h).unwrap_err()[0].contains("refused its own"));
    }
}
