//! Token invariants (ADR 0025): a cursor or rebuild continuation the
//! server issued is never refused as forged, key rotations included. Only
//! an operator's retirement of a key may make one forged, and the judged
//! runs retire none.

use protocol::json::{self, Value};
use protocol::token::named_key;

/// One pull or rebuild request a device sent, with the tokens in it, and
/// how it was answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenUse {
    pub endpoint: &'static str,
    /// The key IDs its cursors or continuation name.
    pub keys: Vec<String>,
    pub status: u16,
    /// The error code of a non-200 answer.
    pub code: Option<String>,
    /// Key rotations completed before it was sent.
    pub rotations_before: usize,
}

impl TokenUse {
    /// The use of a request `body` (its tokens) answered `status`/`answer`.
    pub fn of(
        endpoint: &'static str,
        body: &[u8],
        status: u16,
        answer: &[u8],
        rotations_before: usize,
    ) -> TokenUse {
        let code = (status != 200)
            .then(|| {
                let v = json::parse(answer).ok()?;
                let error = v.as_object()?.get("error")?.as_object()?;
                error.get("code")?.as_str().map(str::to_owned)
            })
            .flatten();
        TokenUse {
            endpoint,
            keys: token_keys(body),
            status,
            code,
            rotations_before,
        }
    }

    /// Whether it presented a token under a key that a rotation before it
    /// made verify-only (`ic-N`, `rc-N` with N at most the rotations): what
    /// rotation must keep working.
    pub fn presents_rotated_key(&self) -> bool {
        self.keys.iter().any(|k| {
            k.rsplit_once('-')
                .and_then(|(_, n)| n.parse::<usize>().ok())
                .is_some_and(|n| n <= self.rotations_before)
        })
    }
}

/// The key IDs of every token-shaped string in a request body.
pub fn token_keys(body: &[u8]) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::String(s) => out.extend(named_key(s).map(|(_, id)| id)),
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            Value::Object(o) => o.values().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    if let Ok(v) = json::parse(body) {
        walk(&v, &mut out);
    }
    out
}

/// No request presenting issued tokens was refused `400 invalid_request`:
/// the only answer that judges a token forged.
pub fn check_token_uses(uses: &[TokenUse]) -> Result<(), Vec<String>> {
    let violations: Vec<String> = uses
        .iter()
        .filter(|u| !u.keys.is_empty() && u.status == 400)
        .map(|u| {
            format!(
                "a {} presenting tokens under {:?} (after {} rotations) was refused 400 {}",
                u.endpoint,
                u.keys,
                u.rotations_before,
                u.code.as_deref().unwrap_or("")
            )
        })
        .collect();
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

    #[test]
    fn a_refused_token_is_a_violation_and_nothing_else_is() {
        let use_of = |keys: &[&str], status| TokenUse {
            endpoint: "pull",
            keys: keys.iter().map(|k| k.to_string()).collect(),
            status,
            code: Some("invalid_request".into()),
            rotations_before: 1,
        };
        assert_eq!(
            check_token_uses(&[use_of(&["ic-1"], 200), use_of(&[], 400)]),
            Ok(())
        );
        let e = check_token_uses(&[use_of(&["ic-1"], 400)]).unwrap_err();
        assert!(e[0].contains("refused 400 invalid_request"), "{e:?}");
        assert!(use_of(&["ic-1"], 200).presents_rotated_key());
        assert!(!use_of(&["ic-2"], 200).presents_rotated_key());
    }

    #[test]
    fn keys_are_read_from_the_tokens_of_a_body() {
        // {"key_id":"ic-7"} as a payload.
        let token = "ic1.eyJrZXlfaWQiOiJpYy03In0.x";
        let body = format!(r#"{{"scopes":{{"a":{{"cursor":"{token}"}},"b":{{"cursor":null}}}}}}"#);
        assert_eq!(token_keys(body.as_bytes()), ["ic-7"]);
        assert!(token_keys(b"{}").is_empty());
    }
}
