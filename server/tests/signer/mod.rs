//! Signing keys for JWT tests and benches: each private key with the public
//! JWK a provider would publish for it.
#![allow(clippy::unwrap_used, dead_code)] // tests fail loudly; each user takes what it needs

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use ring::rand::SystemRandom;
use ring::signature::{self, KeyPair as _};
use serde_json::{Value, json};

/// Base64url without padding, as JOSE writes it.
pub fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// A private key, its `kid`, and the public JWK a provider would publish.
pub struct Signer {
    pub kid: Option<String>,
    pub alg: Algorithm,
    pub key: EncodingKey,
    pub jwk: Value,
}

impl Signer {
    /// A fixture RSA key (`tests/keys`); the JWK names `alg` when given.
    pub fn rsa(kid: &str, fixture: &str, alg: Algorithm, jwk_alg: bool) -> Signer {
        let pem = std::fs::read(format!(
            "{}/tests/keys/{fixture}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap();
        let text = String::from_utf8(pem.clone()).unwrap();
        let body: String = text.lines().filter(|l| !l.starts_with("-----")).collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(body)
            .unwrap();
        let pair = signature::RsaKeyPair::from_der(&der).unwrap();
        let public = signature::RsaPublicKeyComponents::<Vec<u8>>::from(pair.public());
        let mut jwk = json!({"kty": "RSA", "use": "sig", "kid": kid, "n": b64(&public.n), "e": b64(&public.e)});
        if jwk_alg {
            jwk["alg"] = json!(format!("{alg:?}"));
        }
        Signer {
            kid: Some(kid.into()),
            alg,
            key: EncodingKey::from_rsa_pem(&pem).unwrap(),
            jwk,
        }
    }

    /// A fresh EC key on P-256 (ES256) or P-384 (ES384).
    pub fn ec(kid: &str, alg: Algorithm) -> Signer {
        let (ring_alg, crv, half) = match alg {
            Algorithm::ES256 => (&signature::ECDSA_P256_SHA256_FIXED_SIGNING, "P-256", 32),
            Algorithm::ES384 => (&signature::ECDSA_P384_SHA384_FIXED_SIGNING, "P-384", 48),
            _ => unreachable!(),
        };
        let rng = SystemRandom::new();
        let pkcs8 = signature::EcdsaKeyPair::generate_pkcs8(ring_alg, &rng).unwrap();
        let pair = signature::EcdsaKeyPair::from_pkcs8(ring_alg, pkcs8.as_ref(), &rng).unwrap();
        // An uncompressed point: 0x04, x, y.
        let point = pair.public_key().as_ref();
        let (x, y) = point[1..].split_at(half);
        Signer {
            kid: Some(kid.into()),
            alg,
            key: EncodingKey::from_ec_der(pkcs8.as_ref()),
            jwk: json!({"kty": "EC", "crv": crv, "kid": kid, "x": b64(x), "y": b64(y), "alg": format!("{alg:?}")}),
        }
    }

    /// A fresh Ed25519 key (EdDSA).
    pub fn ed25519(kid: &str) -> Signer {
        let pkcs8 = signature::Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).unwrap();
        let pair = signature::Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
        Signer {
            kid: Some(kid.into()),
            alg: Algorithm::EdDSA,
            key: EncodingKey::from_ed_der(pkcs8.as_ref()),
            jwk: json!({"kty": "OKP", "crv": "Ed25519", "kid": kid, "x": b64(pair.public_key().as_ref())}),
        }
    }

    pub fn sign(&self, claims: &Value) -> String {
        self.sign_with(self.alg, self.kid.as_deref(), claims)
    }

    pub fn sign_with(&self, alg: Algorithm, kid: Option<&str>, claims: &Value) -> String {
        let mut header = Header::new(alg);
        header.kid = kid.map(str::to_owned);
        jsonwebtoken::encode(&header, claims, &self.key).unwrap()
    }
}

/// A token signed by HMAC with `secret`, with any header (even one the JWT
/// crate would not write).
pub fn hmac_token(secret: &[u8], header: &Value, claims: &Value) -> String {
    use hmac::Mac as _;
    let input = format!(
        "{}.{}",
        b64(header.to_string().as_bytes()),
        b64(claims.to_string().as_bytes())
    );
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
    mac.update(input.as_bytes());
    format!("{input}.{}", b64(&mac.finalize().into_bytes()))
}
