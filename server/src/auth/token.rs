//! JWT verification: the header first (no `crit`, an allowed `alg`, a key
//! that answers its `kid` and `alg`), then the signature, then the claims.

use std::collections::HashSet;
use std::str::FromStr as _;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::{Algorithm, Validation};
use serde_json::{Map, Value};

use super::claims::ClaimRules;
use super::jwks::RemoteKeys;
use super::keys::VerifyingKey;
use super::refusal::Refusal;

/// A JOSE header larger than this is refused before it is parsed.
const MAX_HEADER_OCTETS: usize = 4096;

/// Verifies bearer JWTs against local and remote keys.
pub struct TokenVerifier {
    /// Keys from files: a secret, a PEM key, a JWKS file.
    local: Arc<[VerifyingKey]>,
    remote: Option<Arc<RemoteKeys>>,
    algorithms: Vec<Algorithm>,
    rules: ClaimRules,
}

/// What the header says, once it passed.
struct Header {
    alg: Algorithm,
    kid: Option<String>,
}

impl TokenVerifier {
    /// A verifier over these keys, accepting these algorithms.
    pub fn new(
        local: Vec<VerifyingKey>,
        remote: Option<Arc<RemoteKeys>>,
        algorithms: Vec<Algorithm>,
        rules: ClaimRules,
    ) -> Result<TokenVerifier, String> {
        let verifier = TokenVerifier {
            local: local.into(),
            remote,
            algorithms,
            rules,
        };
        let usable = verifier.algorithms.iter().any(|&alg| {
            verifier
                .keys()
                .iter()
                .any(|keys| keys.iter().any(|k| k.answers(None, alg)))
        });
        if !usable {
            return Err("no configured key can verify any allowed algorithm".into());
        }
        Ok(verifier)
    }

    /// The user a valid token names.
    pub async fn verify(&self, token: &str) -> Result<String, Refusal> {
        let header = self.header(token)?;
        let mut candidates = self.candidates(&header);
        // A `kid` that no key names is fetched for, even when keys without
        // a `kid` (which answer any) are candidates.
        let named = |keys: &[VerifyingKey]| keys.iter().any(|k| k.kid.is_some());
        if header.kid.is_some()
            && !named(&candidates)
            && let Some(remote) = &self.remote
        {
            remote.refetch_for_unknown_kid().await;
            candidates = self.candidates(&header);
        }
        if candidates.is_empty() {
            return Err(Refusal::UnknownKey);
        }
        let claims = self.signed_claims(token, &header, &candidates)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.rules.user(&claims, now)
    }

    /// Step 1: a compact JWS whose header names an allowed `alg` and no
    /// critical extension (RFC 7515 §4.1.11: none is implemented here).
    fn header(&self, token: &str) -> Result<Header, Refusal> {
        let mut parts = token.split('.');
        let (Some(header), Some(_), Some(_), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Refusal::Malformed);
        };
        if header.len() > MAX_HEADER_OCTETS {
            return Err(Refusal::Malformed);
        }
        let bytes = URL_SAFE_NO_PAD
            .decode(header)
            .map_err(|_| Refusal::Malformed)?;
        let header: Map<String, Value> =
            serde_json::from_slice(&bytes).map_err(|_| Refusal::Malformed)?;
        if header.contains_key("crit") {
            return Err(Refusal::CriticalExtension);
        }
        let alg = header
            .get("alg")
            .and_then(Value::as_str)
            .ok_or(Refusal::Malformed)?;
        let alg = Algorithm::from_str(alg).map_err(|_| Refusal::AlgorithmNotAllowed)?;
        if !self.algorithms.contains(&alg) {
            return Err(Refusal::AlgorithmNotAllowed);
        }
        let kid = match header.get("kid") {
            None => None,
            Some(Value::String(kid)) => Some(kid.clone()),
            Some(_) => return Err(Refusal::Malformed),
        };
        Ok(Header { alg, kid })
    }

    /// Every key (local first) that answers the header's `kid` and `alg`.
    fn candidates(&self, header: &Header) -> Vec<VerifyingKey> {
        self.keys()
            .iter()
            .flat_map(|keys| keys.iter())
            .filter(|k| k.answers(header.kid.as_deref(), header.alg))
            .cloned()
            .collect()
    }

    fn keys(&self) -> Vec<Arc<[VerifyingKey]>> {
        let mut all: Vec<Arc<[VerifyingKey]>> = vec![self.local.clone()];
        if let Some(remote) = &self.remote {
            all.extend(remote.current());
        }
        all
    }

    /// Step 2: the claims of the first candidate whose signature verifies.
    fn signed_claims(
        &self,
        token: &str,
        header: &Header,
        candidates: &[VerifyingKey],
    ) -> Result<Map<String, Value>, Refusal> {
        // The claims are judged by `ClaimRules`, not by the JWT crate.
        let mut validation = Validation::new(header.alg);
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.validate_aud = false;
        validation.required_spec_claims = HashSet::new();
        validation.leeway = 0;
        for candidate in candidates {
            match jsonwebtoken::decode::<Map<String, Value>>(token, &candidate.key, &validation) {
                Ok(data) => return Ok(data.claims),
                Err(e) if *e.kind() == jsonwebtoken::errors::ErrorKind::InvalidSignature => {}
                Err(e) if matches!(e.kind(), jsonwebtoken::errors::ErrorKind::Crypto(_)) => {}
                Err(_) => return Err(Refusal::Malformed),
            }
        }
        Err(Refusal::BadSignature)
    }
}
