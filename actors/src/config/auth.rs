//! `[auth]`: how the adapter turns a bearer credential into a user ID.
//! The adapter (`server::auth`) builds the verifier; this is only what the
//! operator declares, with its defaults.

use serde::{Deserialize, Deserializer};

/// How the adapter authenticates bearer credentials.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum AuthConfig {
    /// JWTs signed with a local HMAC secret that `synchro token` also signs
    /// with; the secret file is created when absent. The embedded default.
    Hs256(TokenAuth),
    /// JWTs from an identity provider: keys from JWKS URLs, a JWKS file, a
    /// PEM public key and/or an HMAC secret.
    Jwt(TokenAuth),
    /// A file of `token user_id` lines, for local use.
    StaticTokens(StaticTokensAuth),
    /// A trusted upstream proxy has authenticated the request and names the user in a header.
    Upstream(UpstreamAuth),
}

impl Default for AuthConfig {
    fn default() -> Self {
        AuthConfig::hs256(DEFAULT_SECRET_FILE)
    }
}

impl AuthConfig {
    /// `mode = "hs256"` with `secret_file` and every other key at its default.
    pub fn hs256(secret_file: &str) -> AuthConfig {
        AuthConfig::Hs256(TokenAuth {
            secret_file: Some(secret_file.to_owned()),
            ..TokenAuth::default()
        })
    }
}

/// Where `mode = "hs256"` keeps its secret unless told otherwise.
pub const DEFAULT_SECRET_FILE: &str = ".synchro/hs256.secret";

/// The keys and claim rules of a JWT mode (`hs256` or `jwt`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TokenAuth {
    /// JWKS URLs (`https://`, or `http://` on loopback only), one or more.
    #[serde(default, deserialize_with = "one_or_many")]
    pub jwks_url: Vec<String>,
    /// A local JWKS document.
    #[serde(default)]
    pub jwks_file: Option<String>,
    /// A PEM public key (RSA, EC P-256/P-384 or Ed25519).
    #[serde(default)]
    pub public_key_file: Option<String>,
    /// An HMAC secret (HS256/384/512), used as its bytes, at least 32 of them.
    #[serde(default)]
    pub secret_file: Option<String>,
    /// The accepted `alg` values; empty means every supported one. Each is
    /// still checked against the kind of the key that verifies it.
    #[serde(default)]
    pub algorithms: Vec<String>,
    /// When set, `iss` must be present and equal to it.
    #[serde(default)]
    pub issuer: Option<String>,
    /// When set, `aud` must be present and contain one of these.
    #[serde(default, deserialize_with = "one_or_many")]
    pub audience: Vec<String>,
    /// Clock skew allowed on `exp`, `nbf` and `iat`.
    #[serde(default = "default_leeway_seconds")]
    pub leeway_seconds: u64,
    /// The claim that names the user.
    #[serde(default = "default_user_claim")]
    pub user_claim: String,
    /// When set, a token may not live longer than this (`exp - iat`, and
    /// `exp - now` for a token without `iat`).
    #[serde(default)]
    pub max_lifetime_seconds: Option<u64>,
    /// How often every JWKS URL is fetched again in the background.
    #[serde(default = "default_jwks_refresh_seconds")]
    pub jwks_refresh_seconds: u64,
    /// The least time between two fetches caused by an unknown `kid`.
    #[serde(default = "default_jwks_refetch_min_seconds")]
    pub jwks_refetch_min_seconds: u64,
    /// How long a URL's last good keys keep verifying while every fetch fails.
    #[serde(default = "default_jwks_max_stale_seconds")]
    pub jwks_max_stale_seconds: u64,
}

impl Default for TokenAuth {
    fn default() -> Self {
        TokenAuth {
            jwks_url: Vec::new(),
            jwks_file: None,
            public_key_file: None,
            secret_file: None,
            algorithms: Vec::new(),
            issuer: None,
            audience: Vec::new(),
            leeway_seconds: default_leeway_seconds(),
            user_claim: default_user_claim(),
            max_lifetime_seconds: None,
            jwks_refresh_seconds: default_jwks_refresh_seconds(),
            jwks_refetch_min_seconds: default_jwks_refetch_min_seconds(),
            jwks_max_stale_seconds: default_jwks_max_stale_seconds(),
        }
    }
}

/// `mode = "static_tokens"`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StaticTokensAuth {
    pub tokens_file: String,
}

/// `mode = "upstream"`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UpstreamAuth {
    pub header: String,
}

fn default_leeway_seconds() -> u64 {
    60
}

fn default_user_claim() -> String {
    "sub".into()
}

/// Five minutes, as identity providers' own SDKs refresh.
fn default_jwks_refresh_seconds() -> u64 {
    300
}

fn default_jwks_refetch_min_seconds() -> u64 {
    30
}

/// A day: an identity provider's outage does not sign everyone out, and a
/// withdrawn key stops verifying within a day even if the provider stays down.
fn default_jwks_max_stale_seconds() -> u64 {
    86_400
}

/// A string or a list of strings.
fn one_or_many<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(deserializer)? {
        OneOrMany::One(one) => vec![one],
        OneOrMany::Many(many) => many,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<AuthConfig, toml::de::Error> {
        #[derive(Deserialize)]
        struct File {
            auth: AuthConfig,
        }
        toml::from_str::<File>(text).map(|f| f.auth)
    }

    #[test]
    fn modes_parse_with_their_defaults() {
        assert_eq!(
            parse("[auth]\nmode = \"hs256\"\nsecret_file = \"s\"").unwrap(),
            AuthConfig::hs256("s")
        );
        let AuthConfig::Jwt(jwt) = parse(
            "[auth]\nmode = \"jwt\"\njwks_url = \"https://idp.example/jwks\"\naudience = [\"a\", \"b\"]\nissuer = \"https://idp.example/\"",
        )
        .unwrap() else {
            panic!("jwt mode")
        };
        assert_eq!(jwt.jwks_url, ["https://idp.example/jwks"]);
        assert_eq!(jwt.audience, ["a", "b"]);
        assert_eq!(jwt.issuer.as_deref(), Some("https://idp.example/"));
        assert_eq!((jwt.leeway_seconds, jwt.user_claim.as_str()), (60, "sub"));
        assert_eq!(
            parse("[auth]\nmode = \"upstream\"\nheader = \"x-user\"").unwrap(),
            AuthConfig::Upstream(UpstreamAuth {
                header: "x-user".into()
            })
        );
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e =
            parse("[auth]\nmode = \"jwt\"\njwks_uri = \"https://idp.example/jwks\"").unwrap_err();
        assert!(e.to_string().contains("jwks_uri"), "{e}");
        assert!(parse("[auth]\nmode = \"upstream\"\nheader = \"x\"\nextra = 1").is_err());
        assert!(parse("[auth]\nmode = \"rs256\"").is_err());
    }
}
