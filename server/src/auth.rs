//! Bearer authentication: resolves exactly one user identity per request.
//! Three modes: HS256 JWTs (`sub` is the user), a static token file for
//! local use, or a trusted upstream header set by an authenticating proxy.

use std::collections::HashMap;
use std::path::Path;

use actors::config::AuthConfig;
use axum::http::{HeaderMap, HeaderName, header};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

/// How long a dev token from `synchro token` is valid.
const DEV_TOKEN_SECONDS: u64 = 30 * 24 * 3600;

/// Resolves a request's user.
pub enum Authenticator {
    Hs256 {
        key: Box<DecodingKey>,
        validation: Box<Validation>,
    },
    Static {
        users_by_token: HashMap<String, String>,
    },
    Upstream {
        header: HeaderName,
    },
}

#[derive(Serialize, Deserialize)]
struct Claims {
    sub: String,
    exp: u64,
    iat: u64,
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

/// A signed HS256 token for `user`, valid for 30 days from `now_seconds`.
pub fn dev_token(secret: &[u8], user: &str, now_seconds: u64) -> Result<String, String> {
    let claims = Claims {
        sub: user.to_owned(),
        iat: now_seconds,
        exp: now_seconds + DEV_TOKEN_SECONDS,
    };
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret),
    )
    .map_err(|e| e.to_string())
}

impl Authenticator {
    /// The authenticator the config names.
    pub fn from_config(config: &AuthConfig) -> Result<Authenticator, String> {
        Ok(match config {
            AuthConfig::Hs256 { secret_file } => {
                let secret = hs256_secret(Path::new(secret_file))?;
                let mut validation = Validation::new(Algorithm::HS256);
                validation.set_required_spec_claims(&["exp", "sub"]);
                Authenticator::Hs256 {
                    key: Box::new(DecodingKey::from_secret(&secret)),
                    validation: Box::new(validation),
                }
            }
            AuthConfig::StaticTokens { tokens_file } => {
                let text = std::fs::read_to_string(tokens_file)
                    .map_err(|e| format!("{tokens_file}: {e}"))?;
                Authenticator::Static {
                    users_by_token: parse_tokens(&text)?,
                }
            }
            AuthConfig::Upstream { header } => Authenticator::Upstream {
                header: HeaderName::try_from(header.as_str())
                    .map_err(|_| format!("`{header}` is not a header name"))?,
            },
        })
    }

    /// The authenticated user, or `None` (401).
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<String> {
        let user = match self {
            Authenticator::Upstream { header } => headers.get(header)?.to_str().ok()?.to_owned(),
            Authenticator::Hs256 { key, validation } => {
                jsonwebtoken::decode::<Claims>(bearer(headers)?, key, validation)
                    .ok()?
                    .claims
                    .sub
            }
            Authenticator::Static { users_by_token } => {
                users_by_token.get(bearer(headers)?)?.clone()
            }
        };
        (!user.is_empty() && user.len() <= protocol::limits::MAX_IDENTIFIER_OCTETS).then_some(user)
    }
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

    #[test]
    fn hs256_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s/secret");
        let secret = hs256_secret(&path).unwrap();
        assert_eq!(hs256_secret(&path).unwrap(), secret, "the secret persists");
        let auth = Authenticator::from_config(&AuthConfig::Hs256 {
            secret_file: path.display().to_string(),
        })
        .unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let token = dev_token(&secret, "alice", now).unwrap();
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", &format!("Bearer {token}"))])),
            Some("alice".into())
        );
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", &format!("bearer {token}"))])),
            Some("alice".into())
        );
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", &format!("Basic {token}"))])),
            None
        );
        assert_eq!(auth.authenticate(&headers(&[])), None);
        let expired = dev_token(&secret, "alice", now - 2 * DEV_TOKEN_SECONDS).unwrap();
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", &format!("Bearer {expired}"))])),
            None
        );
        let forged = dev_token(&[7u8; 32], "alice", now).unwrap();
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", &format!("Bearer {forged}"))])),
            None
        );
        let mut tampered = token.clone().into_bytes();
        let i = tampered.len() / 2;
        tampered[i] = if tampered[i] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(tampered).unwrap();
        assert_eq!(
            auth.authenticate(&headers(&[(
                "authorization",
                &format!("Bearer {tampered}")
            )])),
            None
        );
    }

    #[test]
    fn static_and_upstream() {
        let map = parse_tokens("# dev\n0123456789abcdef alice\n\nfedcba9876543210 bob\n").unwrap();
        let auth = Authenticator::Static {
            users_by_token: map,
        };
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", "Bearer 0123456789abcdef")])),
            Some("alice".into())
        );
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", "Bearer 0123456789abcdeX")])),
            None
        );
        assert!(parse_tokens("short alice").is_err());
        assert!(parse_tokens("0123456789abcdef alice extra").is_err());
        let auth = Authenticator::from_config(&AuthConfig::Upstream {
            header: "x-synchro-user".into(),
        })
        .unwrap();
        assert_eq!(
            auth.authenticate(&headers(&[("x-synchro-user", "carol")])),
            Some("carol".into())
        );
        assert_eq!(auth.authenticate(&headers(&[("x-synchro-user", "")])), None);
        assert_eq!(
            auth.authenticate(&headers(&[("authorization", "Bearer 0123456789abcdef")])),
            None
        );
    }
}
