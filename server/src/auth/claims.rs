//! The claim rules a verified token must meet (RFC 7519 §4.1), the same in
//! every JWT mode: `exp` required, `nbf` and `iat` honoured, all three with
//! the leeway; `iss` and `aud` checked when configured and otherwise
//! accepted; the user from one string claim.

use actors::config::auth::TokenAuth;
use serde_json::{Map, Value};

use super::refusal::Refusal;

/// What a token's claims must satisfy.
#[derive(Clone, Debug)]
pub struct ClaimRules {
    issuer: Option<String>,
    audience: Vec<String>,
    leeway: f64,
    user_claim: String,
    max_lifetime: Option<f64>,
}

impl ClaimRules {
    /// The rules a JWT mode declares.
    pub fn of(config: &TokenAuth) -> ClaimRules {
        ClaimRules {
            issuer: config.issuer.clone(),
            audience: config.audience.clone(),
            leeway: config.leeway_seconds as f64,
            user_claim: config.user_claim.clone(),
            max_lifetime: config.max_lifetime_seconds.map(|s| s as f64),
        }
    }

    /// The user the claims name, at `now` (seconds since the epoch).
    pub fn user(&self, claims: &Map<String, Value>, now: f64) -> Result<String, Refusal> {
        let exp = numeric_date(claims, "exp")?.ok_or(Refusal::NoExpiry)?;
        if exp + self.leeway < now {
            return Err(Refusal::Expired);
        }
        if numeric_date(claims, "nbf")?.is_some_and(|nbf| nbf > now + self.leeway) {
            return Err(Refusal::NotYetValid);
        }
        let iat = numeric_date(claims, "iat")?;
        if iat.is_some_and(|iat| iat > now + self.leeway) {
            return Err(Refusal::IssuedInFuture);
        }
        if let Some(max) = self.max_lifetime
            && exp - iat.unwrap_or(now) > max
        {
            return Err(Refusal::LifetimeTooLong);
        }
        if let Some(issuer) = &self.issuer
            && claims.get("iss").and_then(Value::as_str) != Some(issuer)
        {
            return Err(Refusal::WrongIssuer);
        }
        if !self.audience.is_empty() && !self.names_our_audience(claims.get("aud")) {
            return Err(Refusal::WrongAudience);
        }
        match claims.get(&self.user_claim) {
            Some(Value::String(user))
                if !user.is_empty() && user.len() <= protocol::limits::MAX_IDENTIFIER_OCTETS =>
            {
                Ok(user.clone())
            }
            _ => Err(Refusal::NoUser),
        }
    }

    /// `aud` is one string or an array of them (RFC 7519 §4.1.3).
    fn names_our_audience(&self, aud: Option<&Value>) -> bool {
        let ours = |v: &Value| {
            v.as_str()
                .is_some_and(|a| self.audience.iter().any(|o| o == a))
        };
        match aud {
            Some(Value::Array(values)) => values.iter().any(ours),
            Some(value) => ours(value),
            None => false,
        }
    }
}

/// A NumericDate claim: absent, or a JSON number (fractions allowed).
fn numeric_date(claims: &Map<String, Value>, name: &str) -> Result<Option<f64>, Refusal> {
    match claims.get(name) {
        None => Ok(None),
        Some(value) => value
            .as_f64()
            .filter(|v| v.is_finite())
            .map(Some)
            .ok_or(Refusal::Malformed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: f64 = 1_800_000_000.0;

    fn rules(edit: impl FnOnce(&mut TokenAuth)) -> ClaimRules {
        let mut config = TokenAuth::default();
        edit(&mut config);
        ClaimRules::of(&config)
    }

    fn check(rules: &ClaimRules, claims: Value) -> Result<String, Refusal> {
        let Value::Object(map) = claims else {
            unreachable!()
        };
        rules.user(&map, NOW)
    }

    #[test]
    fn time_claims_take_the_leeway_and_nothing_more() {
        let r = rules(|_| ());
        assert_eq!(
            check(&r, json!({"sub": "u", "exp": NOW + 1.0})),
            Ok("u".into())
        );
        assert_eq!(
            check(&r, json!({"sub": "u", "exp": NOW - 60.0})),
            Ok("u".into())
        );
        assert_eq!(
            check(&r, json!({"sub": "u", "exp": NOW - 61.0})),
            Err(Refusal::Expired)
        );
        assert_eq!(check(&r, json!({"sub": "u"})), Err(Refusal::NoExpiry));
        assert_eq!(
            check(&r, json!({"sub": "u", "exp": "soon"})),
            Err(Refusal::Malformed)
        );
        let later = NOW + 3600.0;
        assert_eq!(
            check(&r, json!({"sub": "u", "exp": later, "nbf": NOW + 86_400.0})),
            Err(Refusal::NotYetValid)
        );
        assert_eq!(
            check(&r, json!({"sub": "u", "exp": later, "nbf": NOW + 60.0})),
            Ok("u".into())
        );
        assert_eq!(
            check(&r, json!({"sub": "u", "exp": later, "iat": NOW + 61.0})),
            Err(Refusal::IssuedInFuture)
        );
        let strict = rules(|c| c.leeway_seconds = 0);
        assert_eq!(
            check(&strict, json!({"sub": "u", "exp": NOW - 1.0})),
            Err(Refusal::Expired)
        );
        assert_eq!(
            check(&strict, json!({"sub": "u", "exp": NOW + 0.5})),
            Ok("u".into())
        );
    }

    #[test]
    fn issuer_and_audience_only_when_configured() {
        let open = rules(|_| ());
        let claims = json!({"sub": "u", "exp": NOW + 60.0, "iss": "https://a/", "aud": ["x", "y"]});
        assert_eq!(check(&open, claims.clone()), Ok("u".into()));
        let strict = rules(|c| {
            c.issuer = Some("https://a/".into());
            c.audience = vec!["y".into(), "z".into()];
        });
        assert_eq!(check(&strict, claims), Ok("u".into()));
        let single = json!({"sub": "u", "exp": NOW + 60.0, "iss": "https://a/", "aud": "z"});
        assert_eq!(check(&strict, single), Ok("u".into()));
        for (claims, refusal) in [
            (
                json!({"sub": "u", "exp": NOW + 60.0, "aud": "y"}),
                Refusal::WrongIssuer,
            ),
            (
                json!({"sub": "u", "exp": NOW + 60.0, "iss": "https://a", "aud": "y"}),
                Refusal::WrongIssuer,
            ),
            (
                json!({"sub": "u", "exp": NOW + 60.0, "iss": "https://a/"}),
                Refusal::WrongAudience,
            ),
            (
                json!({"sub": "u", "exp": NOW + 60.0, "iss": "https://a/", "aud": ["x"]}),
                Refusal::WrongAudience,
            ),
            (
                json!({"sub": "u", "exp": NOW + 60.0, "iss": "https://a/", "aud": 7}),
                Refusal::WrongAudience,
            ),
        ] {
            assert_eq!(check(&strict, claims), Err(refusal));
        }
    }

    #[test]
    fn the_user_claim_and_the_lifetime() {
        let r = rules(|c| {
            c.user_claim = "user_id".into();
            c.max_lifetime_seconds = Some(3600);
        });
        assert_eq!(
            check(
                &r,
                json!({"sub": "s", "user_id": "u", "exp": NOW + 60.0, "iat": NOW})
            ),
            Ok("u".into())
        );
        assert_eq!(
            check(&r, json!({"sub": "s", "exp": NOW + 60.0})),
            Err(Refusal::NoUser)
        );
        assert_eq!(
            check(&r, json!({"user_id": 7, "exp": NOW + 60.0})),
            Err(Refusal::NoUser)
        );
        assert_eq!(
            check(&r, json!({"user_id": "", "exp": NOW + 60.0})),
            Err(Refusal::NoUser)
        );
        let long = "u".repeat(protocol::limits::MAX_IDENTIFIER_OCTETS + 1);
        assert_eq!(
            check(&r, json!({"user_id": long, "exp": NOW + 60.0})),
            Err(Refusal::NoUser)
        );
        assert_eq!(
            check(&r, json!({"user_id": "u", "exp": NOW + 3601.0, "iat": NOW})),
            Err(Refusal::LifetimeTooLong)
        );
        assert_eq!(
            check(&r, json!({"user_id": "u", "exp": NOW + 3601.0})),
            Err(Refusal::LifetimeTooLong)
        );
    }
}
