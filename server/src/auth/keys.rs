//! Verifying keys: each key with the `kid` it answers to and the algorithms
//! it may verify. An algorithm is allowed only by the key's own kind (and
//! its JWK `alg`, when given), so a public key is never taken for an HMAC
//! secret, nor an RSA key for a curve.

use std::str::FromStr as _;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

/// Every algorithm a key can verify (ES512 and Ed448 are not supported).
pub const SUPPORTED: [Algorithm; 12] = [
    Algorithm::HS256,
    Algorithm::HS384,
    Algorithm::HS512,
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
    Algorithm::ES256,
    Algorithm::ES384,
    Algorithm::EdDSA,
];

const HMAC: &[Algorithm] = &[Algorithm::HS256, Algorithm::HS384, Algorithm::HS512];
const RSA: &[Algorithm] = &[
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
];
/// A PEM EC key's curve is not read here: the signature check fails on the other curve.
const EC_ANY: &[Algorithm] = &[Algorithm::ES256, Algorithm::ES384];

/// An HMAC secret shorter than this is refused (RFC 7518 §3.2 for HS256).
pub const MIN_SECRET_OCTETS: usize = 32;

/// One key that may verify tokens.
#[derive(Clone)]
pub struct VerifyingKey {
    /// The `kid` it answers to; a key without one is tried for any token.
    pub kid: Option<String>,
    /// The algorithms it may verify.
    pub algorithms: Vec<Algorithm>,
    /// The key itself.
    pub key: DecodingKey,
}

impl VerifyingKey {
    /// Whether it may verify a token with this header.
    pub fn answers(&self, kid: Option<&str>, alg: Algorithm) -> bool {
        let kid_fits = match (&self.kid, kid) {
            (Some(own), Some(asked)) => own == asked,
            _ => true,
        };
        kid_fits && self.algorithms.contains(&alg)
    }

    /// An HMAC secret, used as its bytes.
    pub fn from_secret(secret: &[u8]) -> Result<VerifyingKey, String> {
        if secret.len() < MIN_SECRET_OCTETS {
            return Err(format!(
                "an HMAC secret must be at least {MIN_SECRET_OCTETS} octets"
            ));
        }
        Ok(VerifyingKey {
            kid: None,
            algorithms: HMAC.to_vec(),
            key: DecodingKey::from_secret(secret),
        })
    }

    /// A PEM public key: RSA, EC (P-256 or P-384) or Ed25519.
    pub fn from_pem(pem: &[u8]) -> Result<VerifyingKey, String> {
        let (key, algorithms) = if let Ok(key) = DecodingKey::from_rsa_pem(pem) {
            (key, RSA)
        } else if let Ok(key) = DecodingKey::from_ec_pem(pem) {
            (key, EC_ANY)
        } else if let Ok(key) = DecodingKey::from_ed_pem(pem) {
            (key, &[Algorithm::EdDSA][..])
        } else {
            return Err("not a PEM RSA, EC or Ed25519 public key".into());
        };
        Ok(VerifyingKey {
            kid: None,
            algorithms: algorithms.to_vec(),
            key,
        })
    }

    /// A JWK meant for signatures. `allow_secret` admits `kty = "oct"`
    /// keys: never from a URL, where a symmetric key would be public.
    pub fn from_jwk(jwk: &Jwk, allow_secret: bool) -> Result<VerifyingKey, String> {
        if matches!(
            jwk.common.public_key_use,
            Some(PublicKeyUse::Encryption | PublicKeyUse::Other(_))
        ) {
            return Err("the key is not for signatures".into());
        }
        let by_kind: &[Algorithm] = match &jwk.algorithm {
            AlgorithmParameters::RSA(_) => RSA,
            AlgorithmParameters::EllipticCurve(p) => match p.curve {
                EllipticCurve::P256 => &[Algorithm::ES256],
                EllipticCurve::P384 => &[Algorithm::ES384],
                _ => return Err("unsupported curve".into()),
            },
            AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
                &[Algorithm::EdDSA]
            }
            AlgorithmParameters::OctetKeyPair(_) => return Err("unsupported curve".into()),
            // 43 base64url characters hold 32 octets.
            AlgorithmParameters::OctetKey(p) if allow_secret => {
                if p.value.trim_end_matches('=').len() < 43 {
                    return Err(format!(
                        "an HMAC secret must be at least {MIN_SECRET_OCTETS} octets"
                    ));
                }
                HMAC
            }
            AlgorithmParameters::OctetKey(_) => {
                return Err("a symmetric key is refused from a URL".into());
            }
        };
        let algorithms: Vec<Algorithm> = match jwk.common.key_algorithm {
            Some(named) => {
                let named = Algorithm::from_str(&named.to_string())
                    .map_err(|_| "the key's `alg` is not a signature algorithm".to_owned())?;
                if !by_kind.contains(&named) {
                    return Err("the key's `alg` does not fit its type".into());
                }
                vec![named]
            }
            None => by_kind.to_vec(),
        };
        let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("unusable key: {e}"))?;
        Ok(VerifyingKey {
            kid: jwk.common.key_id.clone(),
            algorithms,
            key,
        })
    }
}

/// The keys of a JWKS document; keys this server cannot use are skipped
/// (a provider may publish encryption keys or curves it does not sign with).
pub fn parse_jwks(text: &[u8], allow_secret: bool) -> Result<Vec<VerifyingKey>, String> {
    #[derive(serde::Deserialize)]
    struct Document {
        keys: Vec<serde_json::Value>,
    }
    let document: Document =
        serde_json::from_slice(text).map_err(|e| format!("not a JWKS document: {e}"))?;
    if document.keys.len() > MAX_KEYS {
        return Err(format!("more than {MAX_KEYS} keys"));
    }
    Ok(document
        .keys
        .into_iter()
        .filter_map(|value| serde_json::from_value::<Jwk>(value).ok())
        .filter_map(|jwk| VerifyingKey::from_jwk(&jwk, allow_secret).ok())
        .collect())
}

/// Keys one JWKS document may hold: bounds the keys a token is tried against.
pub const MAX_KEYS: usize = 64;
