//! Sign-in with identity providers' JWTs (issue 27), against a JWKS server
//! this test starts on loopback: keys picked by `kid`, every bad token
//! refused with its reason (and `401 auth_required` over HTTP, the token
//! never echoed), rotation without a restart, an outage survived for a
//! bounded time, and tokens shaped like each documented provider's accepted
//! with that provider's recipe from `docs/CONFIG.md`.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use actors::Engine;
use actors::config::AuthConfig;
use actors::config::auth::TokenAuth;
use actors::testkit::{example_config, example_mem_store};
use axum::http::{HeaderMap, StatusCode};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};
use server::adapter::{AppState, router};
use server::auth::{Authenticator, Refusal};
use signer::{Signer, b64, hmac_token};

mod common;
mod signer;

const ISSUER: &str = "https://idp.test/";
const AUDIENCE: &str = "synchro-api";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Claims a provider would send for `alice`.
fn claims() -> Value {
    let t = now();
    json!({"sub": "alice", "iss": ISSUER, "aud": AUDIENCE, "iat": t, "exp": t + 600})
}

/// A JWKS endpoint on loopback whose keys, and whether it answers, the test
/// changes as it goes.
struct Jwks {
    url: String,
    state: Arc<Mutex<JwksState>>,
}

struct JwksState {
    keys: Vec<Value>,
    up: bool,
    fetches: usize,
}

impl Jwks {
    async fn start(keys: Vec<Value>) -> Jwks {
        let state = Arc::new(Mutex::new(JwksState {
            keys,
            up: true,
            fetches: 0,
        }));
        let shared = state.clone();
        let app = axum::Router::new().route(
            "/.well-known/jwks.json",
            axum::routing::get(move || {
                let state = shared.clone();
                async move {
                    let mut s = state.lock().unwrap();
                    s.fetches += 1;
                    if !s.up {
                        return (StatusCode::SERVICE_UNAVAILABLE, String::new());
                    }
                    (StatusCode::OK, json!({"keys": s.keys}).to_string())
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Jwks {
            url: format!("http://{addr}/.well-known/jwks.json"),
            state,
        }
    }

    fn set(&self, keys: Vec<Value>) {
        self.state.lock().unwrap().keys = keys;
    }

    fn set_up(&self, up: bool) {
        self.state.lock().unwrap().up = up;
    }

    fn fetches(&self) -> usize {
        self.state.lock().unwrap().fetches
    }

    /// `mode = "jwt"` over this endpoint, with the test's issuer and audience.
    fn config(&self) -> TokenAuth {
        TokenAuth {
            jwks_url: vec![self.url.clone()],
            issuer: Some(ISSUER.into()),
            audience: vec![AUDIENCE.into()],
            ..TokenAuth::default()
        }
    }
}

async fn jwt(config: TokenAuth) -> Authenticator {
    Authenticator::from_config(&AuthConfig::Jwt(config))
        .await
        .unwrap()
}

async fn user(auth: &Authenticator, token: &str) -> Result<String, Refusal> {
    let mut headers = HeaderMap::new();
    headers.insert("authorization", format!("Bearer {token}").parse().unwrap());
    auth.authenticate(&headers).await
}

#[tokio::test]
async fn tokens_are_verified_by_the_key_their_kid_names() {
    let rs = Signer::rsa("r1", "rsa-1.pem", Algorithm::RS256, true);
    let ps = Signer::rsa("r2", "rsa-2.pem", Algorithm::PS256, false);
    let es = Signer::ec("e1", Algorithm::ES256);
    let es384 = Signer::ec("e2", Algorithm::ES384);
    let ed = Signer::ed25519("d1");
    let unusable = vec![
        json!({"kty": "RSA", "use": "enc", "kid": "enc", "n": rs.jwk["n"], "e": "AQAB"}),
        json!({"kty": "EC", "crv": "P-521", "kid": "p521", "x": "AA", "y": "AA"}),
        json!({"kty": "oct", "kid": "shared", "k": b64(&[7; 32])}),
    ];
    let mut keys: Vec<Value> = [&rs, &ps, &es, &es384, &ed].map(|s| s.jwk.clone()).to_vec();
    keys.extend(unusable);
    let jwks = Jwks::start(keys).await;
    let auth = jwt(jwks.config()).await;
    for signer in [&rs, &ps, &es, &es384, &ed] {
        assert_eq!(
            user(&auth, &signer.sign(&claims())).await,
            Ok("alice".into()),
            "{:?}",
            signer.alg
        );
    }
    // Without a `kid`, every key of the algorithm's kind is tried.
    let no_kid = rs.sign_with(Algorithm::RS256, None, &claims());
    assert_eq!(user(&auth, &no_kid).await, Ok("alice".into()));
    // A key published with no `alg` verifies each algorithm of its kind.
    let rs512 = ps.sign_with(Algorithm::RS512, Some("r2"), &claims());
    assert_eq!(user(&auth, &rs512).await, Ok("alice".into()));
    // The RSA public key taken for an HMAC secret: no RSA key answers HS256.
    let modulus = URL_SAFE_NO_PAD
        .decode(rs.jwk["n"].as_str().unwrap())
        .unwrap();
    let confused = hmac_token(&modulus, &json!({"alg": "HS256", "kid": "r1"}), &claims());
    assert_eq!(user(&auth, &confused).await, Err(Refusal::UnknownKey));
    // A symmetric key from a URL would be public: never used.
    let hs = hmac_token(
        &[7; 32],
        &json!({"alg": "HS256", "kid": "shared"}),
        &claims(),
    );
    assert_eq!(user(&auth, &hs).await, Err(Refusal::UnknownKey));
}

#[tokio::test]
async fn every_bad_token_is_refused_for_its_reason() {
    let rs = Signer::rsa("r1", "rsa-1.pem", Algorithm::RS256, true);
    let es = Signer::ec("e1", Algorithm::ES256);
    let ed = Signer::ed25519("d1");
    let jwks = Jwks::start(vec![rs.jwk.clone(), es.jwk.clone(), ed.jwk.clone()]).await;
    let mut config = jwks.config();
    config.algorithms = vec!["RS256".into(), "PS256".into(), "ES256".into()];
    config.leeway_seconds = 30;
    let auth = jwt(config).await;
    let t = now();
    let with = |edit: &dyn Fn(&mut Value)| {
        let mut c = claims();
        edit(&mut c);
        c
    };
    let impostor = Signer::ec("e1", Algorithm::ES256);
    let modulus = URL_SAFE_NO_PAD
        .decode(rs.jwk["n"].as_str().unwrap())
        .unwrap();
    let none = format!(
        "{}.{}.",
        b64(br#"{"alg":"none","kid":"r1"}"#),
        b64(claims().to_string().as_bytes())
    );
    let cases: Vec<(&str, String, Refusal)> = vec![
        (
            "a wrong key under a known kid",
            impostor.sign(&claims()),
            Refusal::BadSignature,
        ),
        (
            "an alg the key's JWK does not name",
            rs.sign_with(Algorithm::PS256, Some("r1"), &claims()),
            Refusal::UnknownKey,
        ),
        (
            "an EC kid under an RSA alg",
            rs.sign_with(Algorithm::RS256, Some("e1"), &claims()),
            Refusal::UnknownKey,
        ),
        (
            "the RSA public key used as an HMAC secret",
            hmac_token(&modulus, &json!({"alg": "HS256", "kid": "r1"}), &claims()),
            Refusal::AlgorithmNotAllowed,
        ),
        (
            "an alg outside the allow-list",
            ed.sign(&claims()),
            Refusal::AlgorithmNotAllowed,
        ),
        ("alg none", none, Refusal::AlgorithmNotAllowed),
        (
            "a wrong iss",
            es.sign(&with(&|c| c["iss"] = json!("https://other.test/"))),
            Refusal::WrongIssuer,
        ),
        (
            "no iss",
            es.sign(&with(&|c| {
                c.as_object_mut().unwrap().remove("iss");
            })),
            Refusal::WrongIssuer,
        ),
        (
            "a wrong aud",
            es.sign(&with(&|c| c["aud"] = json!(["other-api"]))),
            Refusal::WrongAudience,
        ),
        (
            "a future nbf",
            es.sign(&with(&|c| c["nbf"] = json!(t + 3600))),
            Refusal::NotYetValid,
        ),
        (
            "an exp past the leeway",
            es.sign(&with(&|c| c["exp"] = json!(t - 31))),
            Refusal::Expired,
        ),
        (
            "no exp",
            es.sign(&with(&|c| {
                c.as_object_mut().unwrap().remove("exp");
            })),
            Refusal::NoExpiry,
        ),
        (
            "an unknown critical extension",
            {
                let mut header = Header::new(Algorithm::ES256);
                header.kid = Some("e1".into());
                let mut h = serde_json::to_value(&header).unwrap();
                h["crit"] = json!(["exp"]);
                let signing = format!(
                    "{}.{}",
                    b64(h.to_string().as_bytes()),
                    b64(claims().to_string().as_bytes())
                );
                // Signed properly: the refusal is for the header alone.
                let sig = jsonwebtoken::crypto::sign(signing.as_bytes(), &es.key, Algorithm::ES256)
                    .unwrap();
                format!("{signing}.{sig}")
            },
            Refusal::CriticalExtension,
        ),
        ("not a JWS", "a.b".into(), Refusal::Malformed),
        ("a JWE", "a.b.c.d.e".into(), Refusal::Malformed),
    ];
    assert_eq!(
        user(&auth, &es.sign(&with(&|c| c["exp"] = json!(t - 20)))).await,
        Ok("alice".into()),
        "within the leeway"
    );
    let app = Served::start(auth).await;
    for (what, token, refusal) in cases {
        assert_eq!(user(&app.auth, &token).await, Err(refusal), "{what}");
        let (status, body) = app.connect(&token).await;
        assert_eq!(status, 401, "{what}");
        let error = &serde_json::from_str::<Value>(&body).unwrap()["error"];
        assert_eq!(error["code"], "auth_required", "{what}");
        assert!(error["message"].as_str().unwrap().len() <= 200, "{what}");
        let signature = token.rsplit('.').next().unwrap();
        assert!(
            !body.contains(&token) && (signature.len() < 8 || !body.contains(signature)),
            "{what}: the token is echoed"
        );
    }
    let (status, body) = app.connect(&es.sign(&claims())).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn a_rotated_key_signs_in_without_a_restart() {
    let old = Signer::ec("2026-11", Algorithm::ES256);
    let new = Signer::rsa("2026-12", "rsa-1.pem", Algorithm::RS256, true);
    let jwks = Jwks::start(vec![old.jwk.clone()]).await;
    let mut config = jwks.config();
    config.jwks_refresh_seconds = 1;
    config.jwks_refetch_min_seconds = 60;
    // A key without a `kid` answers any: an unknown `kid` is still fetched for.
    config.public_key_file = Some(format!(
        "{}/tests/keys/rsa-2.pub.pem",
        env!("CARGO_MANIFEST_DIR")
    ));
    let auth = jwt(config).await;
    assert_eq!(user(&auth, &old.sign(&claims())).await, Ok("alice".into()));

    // The provider publishes the new key beside the old one and starts
    // signing with it: the first token naming it fetches the keys at once.
    jwks.set(vec![old.jwk.clone(), new.jwk.clone()]);
    let before = jwks.fetches();
    assert_eq!(user(&auth, &new.sign(&claims())).await, Ok("alice".into()));
    assert!(jwks.fetches() > before);
    assert_eq!(user(&auth, &old.sign(&claims())).await, Ok("alice".into()));

    // Unknown kids cause at most one fetch per jwks_refetch_min_seconds.
    let stranger = Signer::ec("unknown", Algorithm::ES256);
    let before = jwks.fetches();
    for _ in 0..20 {
        assert_eq!(
            user(&auth, &stranger.sign(&claims())).await,
            Err(Refusal::UnknownKey)
        );
    }
    assert!(jwks.fetches() - before <= 1, "{}", jwks.fetches() - before);

    // The old key is withdrawn: after the next refresh its tokens fail.
    jwks.set(vec![new.jwk.clone()]);
    let old_token = old.sign(&claims());
    until(
        Duration::from_secs(10),
        "the withdrawn key stops verifying",
        || async { user(&auth, &old_token).await == Err(Refusal::UnknownKey) },
    )
    .await;
    assert_eq!(user(&auth, &new.sign(&claims())).await, Ok("alice".into()));
}

#[tokio::test]
async fn the_last_good_keys_outlive_an_outage_for_a_bounded_time() {
    let signer = Signer::ed25519("k1");
    let jwks = Jwks::start(vec![signer.jwk.clone()]).await;
    let mut config = jwks.config();
    config.jwks_refresh_seconds = 1;
    config.jwks_max_stale_seconds = 4;
    let auth = jwt(config).await;
    let token = signer.sign(&claims());
    jwks.set_up(false);
    let down = Instant::now();
    let fetches = jwks.fetches();
    until(Duration::from_secs(5), "a refresh fails", || async {
        jwks.fetches() > fetches
    })
    .await;
    assert_eq!(
        user(&auth, &token).await,
        Ok("alice".into()),
        "kept through a failed fetch"
    );
    until(
        Duration::from_secs(15),
        "stale keys stop verifying",
        || async { user(&auth, &token).await == Err(Refusal::UnknownKey) },
    )
    .await;
    assert!(
        down.elapsed() >= Duration::from_secs(3),
        "dropped too early"
    );
    // The provider comes back: the next refresh restores the keys.
    jwks.set_up(true);
    until(Duration::from_secs(5), "the keys come back", || async {
        user(&auth, &token).await == Ok("alice".into())
    })
    .await;
}

#[tokio::test]
async fn startup_needs_every_jwks_url_to_answer() {
    let jwks = Jwks::start(vec![Signer::ed25519("k").jwk]).await;
    jwks.set_up(false);
    let Err(e) = Authenticator::from_config(&AuthConfig::Jwt(jwks.config())).await else {
        panic!("started without keys");
    };
    assert!(e.contains(&jwks.url) && e.contains("503"), "{e}");
    jwks.set_up(true);
    jwks.set(vec![
        json!({"kty": "RSA", "use": "enc", "kid": "x", "n": "AQAB", "e": "AQAB"}),
    ]);
    let Err(e) = Authenticator::from_config(&AuthConfig::Jwt(jwks.config())).await else {
        panic!("started without a usable key");
    };
    assert!(e.contains("no usable signing key"), "{e}");
    // https is TLS, never a quiet fallback to plain text.
    let plain = jwks.url.replace("http://", "https://");
    let Err(e) = Authenticator::from_config(&AuthConfig::Jwt(TokenAuth {
        jwks_url: vec![plain.clone()],
        ..TokenAuth::default()
    }))
    .await
    else {
        panic!("plain http taken for https");
    };
    assert!(e.contains(&plain) && e.contains("request failed"), "{e}");
    for url in ["http://idp.test/jwks.json", "file:///etc/jwks.json"] {
        let config = TokenAuth {
            jwks_url: vec![url.into()],
            ..TokenAuth::default()
        };
        let Err(e) = Authenticator::from_config(&AuthConfig::Jwt(config)).await else {
            panic!("{url} accepted");
        };
        assert!(e.contains("https"), "{e}");
    }
    let Err(e) = Authenticator::from_config(&AuthConfig::Jwt(TokenAuth::default())).await else {
        panic!("jwt mode without keys");
    };
    assert!(e.contains("needs keys"), "{e}");
}

#[tokio::test]
async fn inline_keys_verify_without_a_url() {
    let dir = tempfile::tempdir().unwrap();
    let pem = format!("{}/tests/keys/rsa-2.pub.pem", env!("CARGO_MANIFEST_DIR"));
    let secret = "a-legacy-shared-secret-of-forty-characters";
    let secret_file = dir.path().join("secret");
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let oct = [9u8; 48];
    let jwks_file = dir.path().join("jwks.json");
    std::fs::write(
        &jwks_file,
        json!({"keys": [{"kty": "oct", "kid": "o1", "alg": "HS384", "k": b64(&oct)}]}).to_string(),
    )
    .unwrap();
    let auth = jwt(TokenAuth {
        public_key_file: Some(pem),
        secret_file: Some(secret_file.display().to_string()),
        jwks_file: Some(jwks_file.display().to_string()),
        ..TokenAuth::default()
    })
    .await;
    let rsa = Signer::rsa("any", "rsa-2.pem", Algorithm::PS384, false);
    assert_eq!(user(&auth, &rsa.sign(&claims())).await, Ok("alice".into()));
    let hs256 = hmac_token(secret.as_bytes(), &json!({"alg": "HS256"}), &claims());
    assert_eq!(user(&auth, &hs256).await, Ok("alice".into()));
    let hs384 = jsonwebtoken::encode(
        &Header {
            kid: Some("o1".into()),
            ..Header::new(Algorithm::HS384)
        },
        &claims(),
        &EncodingKey::from_secret(&oct),
    )
    .unwrap();
    assert_eq!(user(&auth, &hs384).await, Ok("alice".into()));
    let other = Signer::rsa("any", "rsa-1.pem", Algorithm::RS256, false);
    assert_eq!(
        user(&auth, &other.sign(&claims())).await,
        Err(Refusal::BadSignature)
    );
}

/// Tokens shaped as each provider sends them (header and claims), checked
/// with the recipe `docs/CONFIG.md` gives for it; only the JWKS URL is the
/// test's own.
#[tokio::test]
async fn each_documented_provider_signs_in_with_its_recipe() {
    let t = now();
    let supabase_key = Signer::ec("7c1f5b06-2f9c-4b0e-9d43-1e0f3d1c9a01", Algorithm::ES256);
    let auth0_key = Signer::rsa(
        "NjVBRjY5MDlCMUIwNzU4RTA2QzZFMDQ4QzQ2MDAyQjVDNjk1RTM2Qg",
        "rsa-1.pem",
        Algorithm::RS256,
        true,
    );
    let clerk_key = Signer::rsa(
        "ins_2abcDEFghiJKLmnoPQRstuVWxyz",
        "rsa-2.pem",
        Algorithm::RS256,
        true,
    );
    let firebase_key = Signer::rsa(
        "a1b2c3d4e5f60718293a4b5c6d7e8f9012345678",
        "rsa-1.pem",
        Algorithm::RS256,
        true,
    );
    let user_id = "d0c6a4f0-3b7e-4c5e-9f0a-2b1c3d4e5f60";

    // Supabase, asymmetric keys: ES256 from the project's JWKS.
    let jwks = Jwks::start(vec![supabase_key.jwk.clone()]).await;
    let iss = "https://abcdefghijklmnopqrst.supabase.co/auth/v1";
    let recipe = TokenAuth {
        jwks_url: vec![jwks.url.clone()],
        issuer: Some(iss.into()),
        audience: vec!["authenticated".into()],
        ..TokenAuth::default()
    };
    let supabase_claims = json!({
        "iss": iss, "sub": user_id, "aud": "authenticated", "exp": t + 3600, "iat": t,
        "email": "alice@example.com", "phone": "", "app_metadata": {"provider": "email", "providers": ["email"]},
        "user_metadata": {}, "role": "authenticated", "aal": "aal1",
        "amr": [{"method": "password", "timestamp": t}], "session_id": "5b3e8d2a-0c1f-4f6e-8a9b-7c6d5e4f3a2b",
        "is_anonymous": false,
    });
    let auth = jwt(recipe).await;
    assert_eq!(
        user(&auth, &supabase_key.sign(&supabase_claims)).await,
        Ok(user_id.into())
    );
    let mut anon = supabase_claims.clone();
    anon["aud"] = json!("anon");
    assert_eq!(
        user(&auth, &supabase_key.sign(&anon)).await,
        Err(Refusal::WrongAudience)
    );

    // Supabase, legacy JWT secret: HS256 with the project's secret string.
    let dir = tempfile::tempdir().unwrap();
    let secret = "super-secret-jwt-token-with-at-least-32-characters-long";
    let secret_file = dir.path().join("supabase.secret");
    std::fs::write(&secret_file, secret).unwrap();
    let auth = jwt(TokenAuth {
        secret_file: Some(secret_file.display().to_string()),
        algorithms: vec!["HS256".into()],
        issuer: Some(iss.into()),
        audience: vec!["authenticated".into()],
        ..TokenAuth::default()
    })
    .await;
    let legacy = hmac_token(
        secret.as_bytes(),
        &json!({"alg": "HS256", "typ": "JWT"}),
        &supabase_claims,
    );
    assert_eq!(user(&auth, &legacy).await, Ok(user_id.into()));

    // Auth0: RS256, `iss` with its trailing slash, `aud` with the API and userinfo.
    let jwks = Jwks::start(vec![auth0_key.jwk.clone()]).await;
    let auth = jwt(TokenAuth {
        jwks_url: vec![jwks.url.clone()],
        issuer: Some("https://example-tenant.us.auth0.com/".into()),
        audience: vec!["https://api.example.com".into()],
        ..TokenAuth::default()
    })
    .await;
    let auth0 = json!({
        "iss": "https://example-tenant.us.auth0.com/", "sub": "auth0|64f1c2d3e4b5a6978899aabb",
        "aud": ["https://api.example.com", "https://example-tenant.us.auth0.com/userinfo"],
        "iat": t, "exp": t + 86_400, "scope": "openid profile email", "azp": "AbCdEfGhIjKlMnOpQrStUvWxYz012345",
    });
    assert_eq!(
        user(&auth, &auth0_key.sign(&auth0)).await,
        Ok("auth0|64f1c2d3e4b5a6978899aabb".into())
    );

    // Clerk: RS256 session tokens without `aud`, with `nbf` and `azp`.
    let jwks = Jwks::start(vec![clerk_key.jwk.clone()]).await;
    let auth = jwt(TokenAuth {
        jwks_url: vec![jwks.url.clone()],
        issuer: Some("https://clerk.example.com".into()),
        ..TokenAuth::default()
    })
    .await;
    let clerk = json!({
        "azp": "https://app.example.com", "exp": t + 60, "iat": t, "iss": "https://clerk.example.com",
        "nbf": t - 10, "sid": "sess_2abcDEFghiJKLmnoPQRstuVWxyz", "sub": "user_2abcDEFghiJKLmnoPQRstuVWxyz",
        "v": 2, "fva": [0, -1],
    });
    assert_eq!(
        user(&auth, &clerk_key.sign(&clerk)).await,
        Ok("user_2abcDEFghiJKLmnoPQRstuVWxyz".into())
    );

    // Firebase: RS256, `iss` and `aud` both name the project.
    let jwks = Jwks::start(vec![firebase_key.jwk.clone()]).await;
    let auth = jwt(TokenAuth {
        jwks_url: vec![jwks.url.clone()],
        issuer: Some("https://securetoken.google.com/my-project".into()),
        audience: vec!["my-project".into()],
        ..TokenAuth::default()
    })
    .await;
    let firebase = json!({
        "iss": "https://securetoken.google.com/my-project", "aud": "my-project", "auth_time": t,
        "user_id": "kX9pQ2rS3tU4vW5xY6zA7bC8dE9f", "sub": "kX9pQ2rS3tU4vW5xY6zA7bC8dE9f",
        "iat": t, "exp": t + 3600, "email": "alice@example.com", "email_verified": true,
        "firebase": {"identities": {"email": ["alice@example.com"]}, "sign_in_provider": "password"},
    });
    assert_eq!(
        user(&auth, &firebase_key.sign(&firebase)).await,
        Ok("kX9pQ2rS3tU4vW5xY6zA7bC8dE9f".into())
    );
    let mut other_project = firebase.clone();
    other_project["aud"] = json!("other-project");
    other_project["iss"] = json!("https://securetoken.google.com/other-project");
    assert_eq!(
        user(&auth, &firebase_key.sign(&other_project)).await,
        Err(Refusal::WrongIssuer)
    );
}

/// Polls `check` every 100 ms until it holds, or fails after `within`.
async fn until<F, Fut>(within: Duration, what: &str, check: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !check().await {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The HTTP adapter over MemStore with an authenticator.
struct Served {
    addr: std::net::SocketAddr,
    auth: Arc<Authenticator>,
}

impl Served {
    async fn start(auth: Authenticator) -> Served {
        let auth = Arc::new(auth);
        let config = example_config(|s| s);
        let engine = Engine::start(example_mem_store(1).await, config.clone())
            .await
            .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(AppState::new(engine, auth.clone(), &config.server));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Served { addr, auth }
    }

    /// A fresh client's connect with this bearer token: status and body.
    async fn connect(&self, token: &str) -> (u16, String) {
        let body = json!({
            "client_id": "0f8fad5b-d9cb-469f-a165-70867728950e", "platform": "ios",
            "app_version": "1.0.0", "protocol_version": 3, "schema": {"version": 0, "hash": ""},
            "scope_set_version": 0, "known_scopes": {},
        });
        let bearer = format!("Bearer {token}");
        let headers = [
            ("authorization", bearer.as_str()),
            ("content-type", "application/json"),
        ];
        let (status, _, body) = common::request(
            self.addr,
            "POST",
            "/sync/connect",
            &headers,
            body.to_string().into_bytes(),
        )
        .await;
        (status, String::from_utf8(body).unwrap())
    }
}
