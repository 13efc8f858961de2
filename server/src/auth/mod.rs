//! Bearer authentication: resolves exactly one user identity per request.
//! Four modes: JWTs signed with a local HS256 secret (the embedded default,
//! which `synchro token` signs for), JWTs from an identity provider (JWKS
//! URLs, key files), a static token file for local use, or a trusted
//! upstream header set by an authenticating proxy.

mod claims;
mod jwks;
mod keys;
mod refusal;
mod token;

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr as _;

use actors::config::AuthConfig;
use actors::config::auth::{DEFAULT_SECRET_FILE, TokenAuth};
use axum::http::{HeaderMap, HeaderName, header};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde::Serialize;

pub use keys::SUPPORTED as SUPPORTED_ALGORITHMS;
pub use refusal::Refusal;

use claims::ClaimRules;
use keys::VerifyingKey;
use token::TokenVerifier;

/// How long a dev token from `synchro token` is valid.
const DEV_TOKEN_SECONDS: u64 = 30 * 24 * 3600;

/// Resolves a request's user.
pub enum Authenticator {
    /// `hs256` and `jwt`.
    Token(TokenVerifier),
    Static {
        users_by_token: HashMap<String, String>,
    },
    Upstream {
        header: HeaderName,
    },
}

/// The claims `synchro token` signs.
#[derive(Serialize)]
struct DevClaims<'a> {
    sub: &'a str,
    exp: u64,
    iat: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    iss: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    aud: Option<&'a str>,
}

/// Reads the HS256 secret, creating a random one (mode 0600) when absent.
pub fn hs256_secret(path: &Path) -> Result<Vec<u8>, String> {
    if let Ok(text) = std::fs::read_to_string(path) {
        let secret = text.trim().as_bytes().to_vec();
        if secret.len() < 32 {
            return Err(format!(
                "{}: the secret must be at least 32 characters",
                path.display()
            ));
        }
        return Ok(secret);
    }
    let mut raw = [0u8; 32];
    getrandom::fill(&mut raw).map_err(|e| format!("no entropy for a new secret: {e}"))?;
    let secret: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    write_private(path, &secret).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(secret.into_bytes())
}

fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(text.as_bytes())
}

/// A signed HS256 token for `user`, valid for 30 days from `now_seconds`,
/// carrying the `iss` and first `aud` the config checks.
pub fn dev_token(
    secret: &[u8],
    user: &str,
    now_seconds: u64,
    config: &TokenAuth,
) -> Result<String, String> {
    let claims = DevClaims {
        sub: user,
        iat: now_seconds,
        exp: now_seconds + DEV_TOKEN_SECONDS,
        iss: config.issuer.as_deref(),
        aud: config.audience.first().map(String::as_str),
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret),
    )
    .map_err(|e| e.to_string())
}

/// The secret file of `mode = "hs256"`.
pub fn hs256_secret_file(config: &TokenAuth) -> &str {
    config.secret_file.as_deref().unwrap_or(DEFAULT_SECRET_FILE)
}

impl Authenticator {
    /// The authenticator the config names; in `jwt` mode, after every JWKS
    /// URL answered once.
    pub async fn from_config(config: &AuthConfig) -> Result<Authenticator, String> {
        Ok(match config {
            AuthConfig::Hs256(config) => Authenticator::Token(hs256_verifier(config)?),
            AuthConfig::Jwt(config) => Authenticator::Token(jwt_verifier(config).await?),
            AuthConfig::StaticTokens(config) => {
                let file = &config.tokens_file;
                let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
                Authenticator::Static {
                    users_by_token: parse_tokens(&text)?,
                }
            }
            AuthConfig::Upstream(config) => Authenticator::Upstream {
                header: HeaderName::try_from(config.header.as_str())
                    .map_err(|_| format!("`{}` is not a header name", config.header))?,
            },
        })
    }

    /// The authenticated user, or why there is none (401).
    pub async fn authenticate(&self, headers: &HeaderMap) -> Result<String, Refusal> {
        let user = match self {
            Authenticator::Upstream { header } => headers
                .get(header)
                .ok_or(Refusal::Missing)?
                .to_str()
                .map_err(|_| Refusal::UnknownCredential)?
                .to_owned(),
            Authenticator::Token(verifier) => {
                verifier
                    .verify(bearer(headers).ok_or(Refusal::Missing)?)
                    .await?
            }
            Authenticator::Static { users_by_token } => users_by_token
                .get(bearer(headers).ok_or(Refusal::Missing)?)
                .ok_or(Refusal::UnknownCredential)?
                .clone(),
        };
        if user.is_empty() || user.len() > protocol::limits::MAX_IDENTIFIER_OCTETS {
            return Err(Refusal::UnknownCredential);
        }
        Ok(user)
    }
}

/// `mode = "hs256"`: the local secret (created when absent) and nothing else.
fn hs256_verifier(config: &TokenAuth) -> Result<TokenVerifier, String> {
    if !config.jwks_url.is_empty() || config.jwks_file.is_some() || config.public_key_file.is_some()
    {
        return Err(
            "mode hs256 takes only secret_file; use mode jwt for JWKS or public keys".into(),
        );
    }
    let algorithms = if config.algorithms.is_empty() {
        vec![Algorithm::HS256]
    } else {
        algorithms(config)?
    };
    let secret = hs256_secret(Path::new(hs256_secret_file(config)))?;
    TokenVerifier::new(
        vec![VerifyingKey::from_secret(&secret)?],
        None,
        algorithms,
        ClaimRules::of(config),
    )
}

/// `mode = "jwt"`: keys from every source given; at least one is.
async fn jwt_verifier(config: &TokenAuth) -> Result<TokenVerifier, String> {
    let mut local = Vec::new();
    if let Some(file) = &config.secret_file {
        let secret = read_secret(Path::new(file))?;
        local.push(VerifyingKey::from_secret(&secret).map_err(|e| format!("{file}: {e}"))?);
    }
    if let Some(file) = &config.public_key_file {
        let pem = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
        local.push(VerifyingKey::from_pem(&pem).map_err(|e| format!("{file}: {e}"))?);
    }
    if let Some(file) = &config.jwks_file {
        let text = std::fs::read(file).map_err(|e| format!("{file}: {e}"))?;
        let keys = keys::parse_jwks(&text, true).map_err(|e| format!("{file}: {e}"))?;
        if keys.is_empty() {
            return Err(format!("{file}: no usable signing key"));
        }
        local.extend(keys);
    }
    let remote = if config.jwks_url.is_empty() {
        None
    } else {
        Some(jwks::RemoteKeys::start(config).await?)
    };
    if local.is_empty() && remote.is_none() {
        return Err(
            "mode jwt needs keys: jwks_url, jwks_file, public_key_file or secret_file".into(),
        );
    }
    let algorithms = if config.algorithms.is_empty() {
        keys::SUPPORTED.to_vec()
    } else {
        algorithms(config)?
    };
    TokenVerifier::new(local, remote, algorithms, ClaimRules::of(config))
}

/// The allow-list, by the names JWS uses (`RS256`, `EdDSA`, ...).
fn algorithms(config: &TokenAuth) -> Result<Vec<Algorithm>, String> {
    config
        .algorithms
        .iter()
        .map(|name| {
            Algorithm::from_str(name)
                .ok()
                .filter(|alg| keys::SUPPORTED.contains(alg))
                .ok_or_else(|| {
                    format!(
                        "algorithm `{name}` is not supported; choose from {}",
                        keys::SUPPORTED.map(|a| format!("{a:?}")).join(", ")
                    )
                })
        })
        .collect()
}

/// A secret file that must exist: its trimmed bytes.
fn read_secret(path: &Path) -> Result<Vec<u8>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(text.trim().as_bytes().to_vec())
}

/// The credential of `Authorization: Bearer <credential>`.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, credential) = value.split_once(' ')?;
    (scheme.eq_ignore_ascii_case("bearer") && !credential.is_empty()).then_some(credential.trim())
}

/// `token user_id` per line; `#` starts a comment.
fn parse_tokens(text: &str) -> Result<HashMap<String, String>, String> {
    let mut map = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(token), Some(user), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!(
                "tokens file line {}: expected `token user_id`",
                n + 1
            ));
        };
        if token.len() < 16 {
            return Err(format!(
                "tokens file line {}: tokens must be at least 16 characters",
                n + 1
            ));
        }
        map.insert(token.to_owned(), user.to_owned());
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    /// A token with these header fields and claims, signed with `secret`.
    fn signed(secret: &[u8], header: serde_json::Value, claims: serde_json::Value) -> String {
        use hmac::Mac as _;
        let b64 = |v: &serde_json::Value| URL_SAFE_NO_PAD.encode(v.to_string());
        let input = format!("{}.{}", b64(&header), b64(&claims));
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
        mac.update(input.as_bytes());
        format!(
            "{input}.{}",
            URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
        )
    }
    use base64::Engine as _;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;

    async fn user(auth: &Authenticator, token: &str) -> Result<String, Refusal> {
        auth.authenticate(&headers(&[("authorization", &format!("Bearer {token}"))]))
            .await
    }

    #[tokio::test]
    async fn hs256_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s/secret");
        let secret = hs256_secret(&path).unwrap();
        assert_eq!(hs256_secret(&path).unwrap(), secret, "the secret persists");
        let config = TokenAuth {
            secret_file: Some(path.display().to_string()),
            ..TokenAuth::default()
        };
        let auth = Authenticator::from_config(&AuthConfig::Hs256(config.clone()))
            .await
            .unwrap();
        let now = now();
        let token = dev_token(&secret, "alice", now, &config).unwrap();
        assert_eq!(user(&auth, &token).await, Ok("alice".into()));
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", &format!("bearer {token}"))]))
                .await,
            Ok("alice".into())
        );
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", &format!("Basic {token}"))]))
                .await,
            Err(Refusal::Missing)
        );
        assert_eq!(
            auth.authenticate(&headers(&[])).await,
            Err(Refusal::Missing)
        );
        let expired = dev_token(&secret, "alice", now - 2 * DEV_TOKEN_SECONDS, &config).unwrap();
        assert_eq!(user(&auth, &expired).await, Err(Refusal::Expired));
        let forged = dev_token(&[7u8; 32], "alice", now, &config).unwrap();
        assert_eq!(user(&auth, &forged).await, Err(Refusal::BadSignature));
        let mut tampered = token.clone().into_bytes();
        let i = tampered.len() - 5;
        tampered[i] = if tampered[i] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(tampered).unwrap();
        assert_eq!(user(&auth, &tampered).await, Err(Refusal::BadSignature));
    }

    /// The claim rules the issue found diverging, in the embedded default mode.
    #[tokio::test]
    async fn hs256_claims_follow_the_rules_providers_expect() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        let secret = hs256_secret(&path).unwrap();
        let open = Authenticator::from_config(&AuthConfig::hs256(&path.display().to_string()))
            .await
            .unwrap();
        let t = now();
        let hs = serde_json::json!({"alg": "HS256", "typ": "JWT"});
        let sign = |claims| signed(&secret, hs.clone(), claims);
        let ok = serde_json::json!({"sub": "u", "exp": t + 600});
        assert_eq!(
            user(&open, &sign(ok)).await,
            Ok("u".into()),
            "iat is optional"
        );
        let with_aud =
            serde_json::json!({"sub": "u", "exp": t + 600, "aud": "authenticated", "iss": "x"});
        assert_eq!(
            user(&open, &sign(with_aud.clone())).await,
            Ok("u".into()),
            "aud accepted when not configured"
        );
        let future = serde_json::json!({"sub": "u", "exp": t + 600, "nbf": t + 86_400});
        assert_eq!(user(&open, &sign(future)).await, Err(Refusal::NotYetValid));
        let crit = signed(
            &secret,
            serde_json::json!({"alg": "HS256", "crit": ["x-unknown"], "x-unknown": 1}),
            serde_json::json!({"sub": "u", "exp": t + 600}),
        );
        assert_eq!(user(&open, &crit).await, Err(Refusal::CriticalExtension));
        let hs512 = signed(
            &secret,
            serde_json::json!({"alg": "HS512"}),
            serde_json::json!({"sub": "u", "exp": t + 600}),
        );
        assert_eq!(user(&open, &hs512).await, Err(Refusal::AlgorithmNotAllowed));
        let none = format!(
            "{}.{}.",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"none"}"#),
            URL_SAFE_NO_PAD.encode(format!(r#"{{"sub":"u","exp":{}}}"#, t + 600))
        );
        assert_eq!(user(&open, &none).await, Err(Refusal::AlgorithmNotAllowed));

        let config = TokenAuth {
            secret_file: Some(path.display().to_string()),
            issuer: Some("x".into()),
            audience: vec!["authenticated".into()],
            ..TokenAuth::default()
        };
        let strict = Authenticator::from_config(&AuthConfig::Hs256(config.clone()))
            .await
            .unwrap();
        assert_eq!(user(&strict, &sign(with_aud)).await, Ok("u".into()));
        let other = serde_json::json!({"sub": "u", "exp": t + 600, "aud": "anon", "iss": "x"});
        assert_eq!(
            user(&strict, &sign(other)).await,
            Err(Refusal::WrongAudience)
        );
        let dev = dev_token(&secret, "alice", t, &config).unwrap();
        assert_eq!(
            user(&strict, &dev).await,
            Ok("alice".into()),
            "synchro token signs what it checks"
        );
    }

    #[tokio::test]
    async fn hs256_mode_takes_only_its_secret() {
        for config in [
            TokenAuth {
                public_key_file: Some("k.pem".into()),
                ..TokenAuth::default()
            },
            TokenAuth {
                jwks_url: vec!["https://idp.example/jwks".into()],
                ..TokenAuth::default()
            },
        ] {
            assert!(
                Authenticator::from_config(&AuthConfig::Hs256(config))
                    .await
                    .is_err()
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let config = TokenAuth {
            secret_file: Some(dir.path().join("s").display().to_string()),
            algorithms: vec!["RS256".into()],
            ..TokenAuth::default()
        };
        let Err(e) = Authenticator::from_config(&AuthConfig::Hs256(config)).await else {
            panic!("RS256 has no key in hs256 mode");
        };
        assert!(e.contains("no configured key"), "{e}");
        let config = TokenAuth {
            secret_file: Some(dir.path().join("s").display().to_string()),
            algorithms: vec!["none".into()],
            ..TokenAuth::default()
        };
        let Err(e) = Authenticator::from_config(&AuthConfig::Hs256(config)).await else {
            panic!("none is no algorithm");
        };
        assert!(e.contains("`none` is not supported"), "{e}");
    }

    #[tokio::test]
    async fn static_and_upstream() {
        let map = parse_tokens("# dev\n0123456789abcdef alice\n\nfedcba9876543210 bob\n").unwrap();
        let auth = Authenticator::Static {
            users_by_token: map,
        };
        assert_eq!(user(&auth, "0123456789abcdef").await, Ok("alice".into()));
        assert_eq!(
            user(&auth, "0123456789abcdeX").await,
            Err(Refusal::UnknownCredential)
        );
        assert!(parse_tokens("short alice").is_err());
        assert!(parse_tokens("0123456789abcdef alice extra").is_err());
        let auth =
            Authenticator::from_config(&AuthConfig::Upstream(actors::config::auth::UpstreamAuth {
                header: "x-synchro-user".into(),
            }))
            .await
            .unwrap();
        assert_eq!(
            auth.authenticate(&headers(&[("x-synchro-user", "carol")]))
                .await,
            Ok("carol".into())
        );
        assert!(
            auth.authenticate(&headers(&[("x-synchro-user", "")]))
                .await
                .is_err()
        );
        assert_eq!(user(&auth, "0123456789abcdef").await, Err(Refusal::Missing));
    }
}
