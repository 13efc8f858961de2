//! Push invariants, judged from wire bytes and the captured version chains:
//!
//! - every 200 response partitions its request: each mutation exactly once,
//!   request order kept in each array, and an atomic response in one of its
//!   two forms;
//! - a replay is byte-identical: every 200 answer to one (client, batch) is
//!   the same bytes;
//! - every mutation has exactly one terminal outcome forever: every outcome
//!   object seen for one (client, mutation) is the same bytes;
//! - an accepted write is never lost or applied twice: each row's captured
//!   version chain is exactly its applied push versions and its direct
//!   writes, each once;
//! - no two accepted writes advance the same prior version: an applied
//!   update or delete produced the version that follows its base version in
//!   the chain, and no two applied writes share a base;
//! - a request holding a key of the wrong JSON type (every key of the
//!   example's tables is a string) is refused whole with `400`: it never
//!   gets per-mutation outcomes;
//! - once capture has passed an accepted push's commit, none of its fences
//!   is pending (`check_fences`): its client is never told
//!   `capture_pending` for a write that is already pull-visible.

use std::collections::{BTreeMap, BTreeSet};

use protocol::json::{self, Value};

/// One answered push as a client saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushExchange {
    pub client_id: String,
    /// The canonical request body.
    pub request: Vec<u8>,
    pub status: u16,
    pub response: Vec<u8>,
}

/// The captured history of one row: its versions in commit order, with the
/// row each carried (canonical JSON).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionChain {
    pub table_id: String,
    /// The primary key as its wire string.
    pub key: String,
    pub versions: Vec<(String, Vec<u8>)>,
}

/// A write made by the application directly, with the version it created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirectWrite {
    pub table_id: String,
    pub key: String,
    pub version: String,
}

/// What the checker saw, for the run's statistics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PushStats {
    pub batches: usize,
    pub replays: usize,
    pub applied: usize,
    pub conflicts: usize,
    pub terminal: usize,
    pub atomic_rejections: usize,
    pub reused: usize,
    /// Sealed batches answered `400 invalid_request` (a key no column keeps,
    /// or a key of the wrong JSON type).
    pub invalid: usize,
}

fn obj(v: &Value) -> Option<&json::Object> {
    v.as_object()
}

fn text<'v>(v: &'v Value, member: &str) -> Option<&'v str> {
    obj(v)?.get(member)?.as_str()
}

fn array<'v>(v: &'v Value, member: &str) -> Option<&'v [Value]> {
    match obj(v)?.get(member)? {
        Value::Array(a) => Some(a),
        _ => None,
    }
}

/// Whether a mutation of `request` holds a key that is not a JSON string
/// (every key of the example's tables is a `string` field).
fn has_mistyped_key(request: &[u8]) -> bool {
    let Ok(req) = json::parse(request) else {
        return false;
    };
    array(&req, "mutations")
        .unwrap_or_default()
        .iter()
        .filter_map(|m| obj(obj(m)?.get("pk")?))
        .any(|pk| pk.values().any(|k| k.as_str().is_none()))
}

/// An applied write as the ledger reported it.
struct Applied {
    table_id: String,
    key: String,
    op: String,
    base: Option<String>,
    version: String,
    row: Option<Vec<u8>>,
}

/// Judges every exchange and the final version chains.
pub fn check_push(
    exchanges: &[PushExchange],
    chains: &[VersionChain],
    direct: &[DirectWrite],
) -> Result<PushStats, Vec<String>> {
    let mut errors = Vec::new();
    let mut stats = PushStats::default();
    let mut batch_bodies: BTreeMap<(String, String), Vec<u8>> = BTreeMap::new();
    let mut outcomes: BTreeMap<(String, String), Vec<u8>> = BTreeMap::new();
    let mut applied: BTreeMap<(String, String), Applied> = BTreeMap::new();
    // A sealed batch's terminal answer never changes: the same bytes always
    // get the same status (a 400 is never retried into a 200, or back).
    let mut terminal: BTreeMap<(&str, &[u8]), u16> = BTreeMap::new();
    for (i, x) in exchanges.iter().enumerate() {
        let mut fail = |m: String| errors.push(format!("exchange {i} of {}: {m}", x.client_id));
        let first = *terminal
            .entry((x.client_id.as_str(), x.request.as_slice()))
            .or_insert(x.status);
        if first != x.status {
            fail(format!(
                "a sealed batch was answered {first}, then {}",
                x.status
            ));
        }
        if x.status == 400 {
            let code = json::parse(&x.response).ok().and_then(|v| {
                let e = obj(&v)?.get("error")?.clone();
                let retryable = obj(&e)?.get("retryable")? == &Value::Bool(true);
                Some((text(&e, "code")?.to_owned(), retryable))
            });
            if code != Some(("invalid_request".into(), false)) {
                fail("a 400 is not a terminal invalid_request".into());
            }
            if first == 400 && x.status == 400 {
                stats.invalid += 1;
            }
        }
        if x.status != 400 && has_mistyped_key(&x.request) {
            fail(format!(
                "a key of the wrong type was answered {}, not refused whole",
                x.status
            ));
        }
        if x.status != 200 {
            continue;
        }
        let (Ok(req), Ok(resp)) = (json::parse(&x.request), json::parse(&x.response)) else {
            fail("request or response is not JSON".into());
            continue;
        };
        let batch = text(&req, "batch_id").unwrap_or_default().to_owned();
        if text(&resp, "batch_id") != Some(batch.as_str()) {
            fail("batch_id differs from the request".into());
        }
        match batch_bodies.get(&(x.client_id.clone(), batch.clone())) {
            Some(first) if *first != x.response => fail(format!("replay of batch {batch} differs")),
            Some(_) => stats.replays += 1,
            None => {
                stats.batches += 1;
                batch_bodies.insert((x.client_id.clone(), batch.clone()), x.response.clone());
            }
        }
        let atomic = obj(&req).is_some_and(|o| o.contains_key("atomic"));
        let mutations = array(&req, "mutations").unwrap_or_default();
        let (Some(accepted), Some(rejected)) = (array(&resp, "accepted"), array(&resp, "rejected"))
        else {
            fail("accepted or rejected is missing".into());
            continue;
        };
        // The partition: each mutation once, request order kept in each array.
        let position: BTreeMap<&str, usize> = mutations
            .iter()
            .enumerate()
            .filter_map(|(i, m)| Some((text(m, "mutation_id")?, i)))
            .collect();
        let mut seen = BTreeSet::new();
        for list in [accepted, rejected] {
            let mut last = None;
            for o in list {
                let Some(p) = text(o, "mutation_id").and_then(|id| position.get(id)) else {
                    fail("an outcome for a mutation not in the request".into());
                    continue;
                };
                if last.is_some_and(|l| l >= *p) {
                    fail("request order is not kept".into());
                }
                last = Some(*p);
                seen.insert(*p);
            }
        }
        if seen.len() != mutations.len() || accepted.len() + rejected.len() != mutations.len() {
            fail("not every mutation has exactly one outcome".into());
        }
        let atomic_rejects = rejected
            .iter()
            .filter(|o| text(o, "code") == Some("atomic_batch_rejected"))
            .count();
        if atomic {
            let all_applied = rejected.is_empty();
            let one_failure = accepted.is_empty() && atomic_rejects + 1 == mutations.len();
            if !(all_applied || one_failure) {
                fail("an atomic response in neither form".into());
            }
            if one_failure {
                stats.atomic_rejections += 1;
            }
        } else if atomic_rejects > 0 {
            fail("atomic_batch_rejected outside an atomic batch".into());
        }
        for o in accepted.iter().chain(rejected) {
            let id = text(o, "mutation_id").unwrap_or_default().to_owned();
            let bytes = json::to_canonical(o);
            let key = (x.client_id.clone(), id.clone());
            match outcomes.get(&key) {
                Some(first) if *first != bytes => {
                    fail(format!("mutation {id} has two different outcomes"));
                    continue;
                }
                Some(_) => {
                    stats.reused += 1;
                    continue;
                }
                None => {
                    outcomes.insert(key.clone(), bytes);
                }
            }
            match text(o, "status") {
                Some("applied") => {
                    stats.applied += 1;
                    let Some(m) = mutations
                        .iter()
                        .find(|m| text(m, "mutation_id") == Some(&id))
                    else {
                        continue;
                    };
                    let pk = obj(o).and_then(|o| o.get("pk")).and_then(obj);
                    let key_text = pk
                        .and_then(|pk| pk.values().next())
                        .map(|v| match v {
                            Value::String(s) => s.clone(),
                            v => json::to_canonical_string(v),
                        })
                        .unwrap_or_default();
                    applied.insert(
                        key,
                        Applied {
                            table_id: text(o, "table").unwrap_or_default().to_owned(),
                            key: key_text,
                            op: text(m, "op").unwrap_or_default().to_owned(),
                            base: text(m, "base_version").map(str::to_owned),
                            version: text(o, "server_version").unwrap_or_default().to_owned(),
                            row: obj(o)
                                .and_then(|o| o.get("server_row"))
                                .map(json::to_canonical),
                        },
                    );
                }
                Some("conflict") => stats.conflicts += 1,
                _ => stats.terminal += 1,
            }
        }
    }
    // Version chains: every applied write once, in the position its base allows.
    let chain_of: BTreeMap<(&str, &str), &VersionChain> = chains
        .iter()
        .map(|c| ((c.table_id.as_str(), c.key.as_str()), c))
        .collect();
    let mut claimed: BTreeMap<(&str, &str, &str), usize> = BTreeMap::new();
    let mut bases: BTreeMap<(&str, &str, &str), usize> = BTreeMap::new();
    for a in applied.values() {
        *claimed
            .entry((a.table_id.as_str(), a.key.as_str(), a.version.as_str()))
            .or_default() += 1;
        if let Some(b) = &a.base {
            *bases
                .entry((a.table_id.as_str(), a.key.as_str(), b.as_str()))
                .or_default() += 1;
        }
        let Some(chain) = chain_of.get(&(a.table_id.as_str(), a.key.as_str())) else {
            errors.push(format!(
                "applied write {} of {} was never captured",
                a.version, a.key
            ));
            continue;
        };
        let Some(at) = chain.versions.iter().position(|(v, _)| *v == a.version) else {
            errors.push(format!("applied write {} of {} is lost", a.version, a.key));
            continue;
        };
        if let Some(row) = &a.row
            && *row != chain.versions[at].1
        {
            errors.push(format!(
                "the echo of {} differs from its captured row",
                a.version
            ));
        }
        match (&a.base, a.op.as_str()) {
            (Some(b), "update" | "delete") if at == 0 || chain.versions[at - 1].0 != *b => {
                errors.push(format!(
                    "applied {} of {} did not advance its base version",
                    a.op, a.key
                ));
            }
            (None, "insert") if at != 0 => {
                errors.push(format!("insert of {} did not start its chain", a.key));
            }
            _ => {}
        }
    }
    for ((_, key, base), n) in &bases {
        if *n > 1 {
            errors.push(format!(
                "{n} applied writes advanced version {base} of {key}"
            ));
        }
    }
    for d in direct {
        *claimed
            .entry((d.table_id.as_str(), d.key.as_str(), d.version.as_str()))
            .or_default() += 1;
    }
    for c in chains {
        for (v, _) in &c.versions {
            match claimed.get(&(c.table_id.as_str(), c.key.as_str(), v.as_str())) {
                Some(1) => {}
                Some(n) => errors.push(format!("version {v} of {} claimed {n} times", c.key)),
                None => errors.push(format!(
                    "version {v} of {} was written by no reported write (applied twice?)",
                    c.key
                )),
            }
        }
    }
    if errors.is_empty() {
        Ok(stats)
    } else {
        Err(errors)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn exchange(client: &str, req: &str, resp: &str) -> PushExchange {
        PushExchange {
            client_id: client.into(),
            request: req.as_bytes().to_vec(),
            status: 200,
            response: resp.as_bytes().to_vec(),
        }
    }

    const REQ: &str = r#"{"batch_id":"b1","mutations":[{"mutation_id":"m1","op":"update","base_version":"v1"},{"mutation_id":"m2","op":"insert"}]}"#;

    #[test]
    fn a_terminal_answer_never_changes() {
        let invalid = r#"{"error":{"code":"invalid_request","message":"m","retryable":false}}"#;
        let refused = PushExchange {
            status: 400,
            ..exchange("c1", REQ, invalid)
        };
        let h = vec![refused.clone(), refused.clone()];
        assert_eq!(check_push(&h, &[], &[]).unwrap().invalid, 2);
        // The same sealed bytes later executed: caught.
        let resp = r#"{"accepted":[],"batch_id":"b1","rejected":[{"code":"row_already_exists","mutation_id":"m1","status":"conflict"},{"code":"row_already_exists","mutation_id":"m2","status":"conflict"}]}"#;
        let h = vec![refused.clone(), exchange("c1", REQ, resp)];
        let e = check_push(&h, &[], &[]).unwrap_err();
        assert!(e[0].contains("answered 400, then 200"), "{e:?}");
        // A 400 that says retry: caught.
        let retry = PushExchange {
            response: invalid.replace("false", "true").into_bytes(),
            ..refused
        };
        let e = check_push(&[retry], &[], &[]).unwrap_err();
        assert!(e[0].contains("not a terminal invalid_request"), "{e:?}");
    }

    #[test]
    fn a_mistyped_key_must_be_refused_whole() {
        let req =
            r#"{"batch_id":"b1","mutations":[{"mutation_id":"m1","op":"insert","pk":{"id":5}}]}"#;
        let invalid = r#"{"error":{"code":"invalid_request","message":"m","retryable":false}}"#;
        let refused = PushExchange {
            status: 400,
            ..exchange("c1", req, invalid)
        };
        assert!(check_push(&[refused], &[], &[]).is_ok());
        // Coerced and judged per mutation: caught.
        let judged = r#"{"accepted":[],"batch_id":"b1","rejected":[{"code":"validation_failed","mutation_id":"m1","status":"rejected_terminal"}]}"#;
        let e = check_push(&[exchange("c1", req, judged)], &[], &[]).unwrap_err();
        assert!(
            e[0].contains("key of the wrong type was answered 200"),
            "{e:?}"
        );
    }

    fn resp(v: &str) -> String {
        format!(
            r#"{{"accepted":[{{"mutation_id":"m1","pk":{{"id":"k"}},"server_row":{{"id":"k"}},"server_version":"{v}","status":"applied","table":"t"}}],"batch_id":"b1","rejected":[{{"code":"row_already_exists","mutation_id":"m2","status":"conflict"}}]}}"#
        )
    }

    fn chain(versions: &[&str]) -> Vec<VersionChain> {
        vec![VersionChain {
            table_id: "t".into(),
            key: "k".into(),
            versions: versions
                .iter()
                .map(|v| ((*v).to_owned(), br#"{"id":"k"}"#.to_vec()))
                .collect(),
        }]
    }

    fn direct(v: &str) -> DirectWrite {
        DirectWrite {
            table_id: "t".into(),
            key: "k".into(),
            version: v.into(),
        }
    }

    #[test]
    fn a_good_history_passes() {
        let x = [
            exchange("c", REQ, &resp("v2")),
            exchange("c", REQ, &resp("v2")),
        ];
        let stats = check_push(&x, &chain(&["v1", "v2"]), &[direct("v1")]).unwrap();
        assert_eq!((stats.batches, stats.replays, stats.applied), (1, 1, 1));
    }

    #[test]
    fn every_violation_is_caught() {
        let ok = chain(&["v1", "v2"]);
        let d = [direct("v1")];
        // A replay with other bytes (the batch executed twice).
        let x = [
            exchange("c", REQ, &resp("v2")),
            exchange("c", REQ, &resp("v3")),
        ];
        assert!(check_push(&x, &chain(&["v1", "v2", "v3"]), &d).is_err());
        // A lost write.
        assert!(check_push(&[exchange("c", REQ, &resp("v2"))], &chain(&["v1"]), &d).is_err());
        // A version nobody reported (an unreported second execution).
        assert!(
            check_push(
                &[exchange("c", REQ, &resp("v2"))],
                &chain(&["v1", "v2", "v9"]),
                &d
            )
            .is_err()
        );
        // An update that did not advance its base (a lost update).
        assert!(
            check_push(
                &[exchange("c", REQ, &resp("v2"))],
                &chain(&["v1", "v0", "v2"]),
                &[direct("v1"), direct("v0")]
            )
            .is_err()
        );
        // A mutation missing from the response.
        let partial = r#"{"accepted":[],"batch_id":"b1","rejected":[{"code":"row_already_exists","mutation_id":"m2","status":"conflict"}]}"#;
        assert!(check_push(&[exchange("c", REQ, partial)], &ok, &d).is_err());
        // Request order broken within an array.
        let req = r#"{"batch_id":"b1","mutations":[{"mutation_id":"m1","op":"insert"},{"mutation_id":"m2","op":"insert"}]}"#;
        let swapped = r#"{"accepted":[],"batch_id":"b1","rejected":[{"mutation_id":"m2","status":"conflict"},{"mutation_id":"m1","status":"conflict"}]}"#;
        assert!(check_push(&[exchange("c", req, swapped)], &[], &[]).is_err());
        // atomic_batch_rejected in a non-atomic response.
        let atomic_code = r#"{"accepted":[],"batch_id":"b1","rejected":[{"code":"atomic_batch_rejected","mutation_id":"m1","status":"rejected_terminal"},{"mutation_id":"m2","status":"conflict"}]}"#;
        assert!(check_push(&[exchange("c", req, atomic_code)], &[], &[]).is_err());
        // Two applied writes from one base.
        let req2 = r#"{"batch_id":"b2","mutations":[{"mutation_id":"m3","op":"update","base_version":"v1"}]}"#;
        let resp2 = r#"{"accepted":[{"mutation_id":"m3","pk":{"id":"k"},"server_row":{"id":"k"},"server_version":"v3","status":"applied","table":"t"}],"batch_id":"b2","rejected":[]}"#;
        let x = [exchange("c", REQ, &resp("v2")), exchange("c", req2, resp2)];
        assert!(check_push(&x, &chain(&["v1", "v2", "v3"]), &d).is_err());
        // One mutation, two different outcomes across batches.
        let resp3 = r#"{"accepted":[],"batch_id":"b2","rejected":[{"code":"version_conflict","mutation_id":"m1","status":"conflict"}]}"#;
        let req3 = r#"{"batch_id":"b2","mutations":[{"mutation_id":"m1","op":"update","base_version":"v1"}]}"#;
        let x = [exchange("c", REQ, &resp("v2")), exchange("c", req3, resp3)];
        assert!(check_push(&x, &ok, &d).is_err());
    }
}

/// What the store says is pending for one client once capture has passed
/// every commit: the fences of its accepted writes not yet satisfied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingAfterCapture {
    pub client_id: String,
    pub fences: Vec<u64>,
}

/// Once capture has passed an accepted push's commit, none of its fences is
/// pending. `pending` is read after capture passed the newest commit.
pub fn check_fences(pending: &[PendingAfterCapture]) -> Result<(), Vec<String>> {
    let violations: Vec<String> = pending
        .iter()
        .filter(|p| !p.fences.is_empty())
        .map(|p| {
            format!(
                "{} has {} fence(s) pending after capture passed every commit: {:?}",
                p.client_id,
                p.fences.len(),
                p.fences
            )
        })
        .collect();
    if violations.is_empty() {
        Ok(())
    } else {
        Err(violations)
    }
}
