//! Keys published at JWKS URLs: fetched once at startup (a failure stops
//! startup), again in the background every `jwks_refresh_seconds`, and at
//! once when a token names a `kid` no key answers (at most once per
//! `jwks_refetch_min_seconds`, so unknown `kid`s cannot make the server
//! hammer the provider). A URL's last good keys keep verifying through
//! failed fetches for `jwks_max_stale_seconds`, then stop.

use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, Instant};

use actors::config::auth::TokenAuth;
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::Uri;
use hyper::body::Bytes;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::keys::{VerifyingKey, parse_jwks};

/// The largest JWKS document read; providers publish a few kilobytes.
const MAX_JWKS_OCTETS: usize = 256 * 1024;
/// One fetch, connection to last byte.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// The keys of every configured JWKS URL.
pub struct RemoteKeys {
    sources: Vec<Source>,
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    /// When an unknown `kid` last caused a fetch; held across that fetch,
    /// so concurrent requests wait for it rather than fetch again.
    last_refetch: tokio::sync::Mutex<Option<Instant>>,
    refetch_min: Duration,
    max_stale: Duration,
}

struct Source {
    url: Uri,
    fetched: RwLock<Fetched>,
}

/// A URL's last good keys, and when they were fetched.
struct Fetched {
    keys: Arc<[VerifyingKey]>,
    at: Instant,
}

impl RemoteKeys {
    /// Fetches every URL once (startup fails on any failure) and starts the
    /// background refresh, which ends when the keys are dropped.
    pub async fn start(config: &TokenAuth) -> Result<Arc<RemoteKeys>, String> {
        let mut connector = HttpConnector::new();
        connector.enforce_http(false);
        connector.set_connect_timeout(Some(FETCH_TIMEOUT));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let client = Client::builder(TokioExecutor::new()).build(https);
        let mut sources = Vec::new();
        for url in &config.jwks_url {
            let uri = checked_url(url).map_err(|e| format!("jwks_url {url}: {e}"))?;
            let keys = fetch(&client, &uri)
                .await
                .map_err(|e| format!("jwks_url {url}: {e}"))?;
            sources.push(Source {
                url: uri,
                fetched: RwLock::new(Fetched {
                    keys,
                    at: Instant::now(),
                }),
            });
        }
        let remote = Arc::new(RemoteKeys {
            sources,
            client,
            last_refetch: tokio::sync::Mutex::new(None),
            refetch_min: Duration::from_secs(config.jwks_refetch_min_seconds),
            max_stale: Duration::from_secs(config.jwks_max_stale_seconds),
        });
        let every = Duration::from_secs(config.jwks_refresh_seconds.max(1));
        tokio::spawn(refresh(Arc::downgrade(&remote), every));
        Ok(remote)
    }

    /// The keys that still verify: each URL's last good set, unless stale.
    pub fn current(&self) -> Vec<Arc<[VerifyingKey]>> {
        self.sources
            .iter()
            .filter_map(|source| {
                let fetched = source.fetched.read().unwrap_or_else(|e| e.into_inner());
                (fetched.at.elapsed() <= self.max_stale).then(|| fetched.keys.clone())
            })
            .collect()
    }

    /// Fetches every URL again because a token named an unknown `kid`,
    /// unless such a fetch happened within `jwks_refetch_min_seconds`.
    pub async fn refetch_for_unknown_kid(&self) {
        let mut last = self.last_refetch.lock().await;
        if last.is_some_and(|at| at.elapsed() < self.refetch_min) {
            return;
        }
        *last = Some(Instant::now());
        self.fetch_all("unknown kid").await;
    }

    async fn fetch_all(&self, why: &'static str) {
        for source in &self.sources {
            match fetch(&self.client, &source.url).await {
                Ok(keys) => {
                    *source.fetched.write().unwrap_or_else(|e| e.into_inner()) = Fetched {
                        keys,
                        at: Instant::now(),
                    };
                }
                Err(error) => tracing::warn!(
                    url = %source.url,
                    why,
                    %error,
                    "JWKS fetch failed; the last good keys keep verifying"
                ),
            }
        }
    }
}

async fn refresh(remote: Weak<RemoteKeys>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(remote) = remote.upgrade() else {
            return;
        };
        remote.fetch_all("refresh").await;
    }
}

/// `https://`, or `http://` to a loopback host only: keys fetched in the
/// clear could be swapped by anyone on the path.
fn checked_url(url: &str) -> Result<Uri, String> {
    let uri: Uri = url.parse().map_err(|_| "not an https:// URL".to_owned())?;
    let host = uri.host().ok_or("no host")?;
    match uri.scheme_str() {
        Some("https") => Ok(uri),
        Some("http") if is_loopback(host) => Ok(uri),
        Some("http") => Err("plain http is allowed only to a loopback host; use https".into()),
        _ => Err("the scheme must be https".into()),
    }
}

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// One JWKS document's usable keys. A document with none is an error, so a
/// provider's broken answer never replaces good keys.
async fn fetch(
    client: &Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    url: &Uri,
) -> Result<Arc<[VerifyingKey]>, String> {
    let get = async {
        let response = client
            .get(url.clone())
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        if response.status() != hyper::StatusCode::OK {
            return Err(format!("answered {}", response.status()));
        }
        Limited::new(response.into_body(), MAX_JWKS_OCTETS)
            .collect()
            .await
            .map(|body| body.to_bytes())
            .map_err(|e| format!("reading the body: {e}"))
    };
    let body = tokio::time::timeout(FETCH_TIMEOUT, get)
        .await
        .map_err(|_| format!("no answer within {} s", FETCH_TIMEOUT.as_secs()))??;
    let keys = parse_jwks(&body, false)?;
    if keys.is_empty() {
        return Err("no usable signing key in the document".into());
    }
    Ok(keys.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_https_or_loopback_http() {
        assert!(checked_url("https://idp.example/.well-known/jwks.json").is_ok());
        assert!(checked_url("http://127.0.0.1:8080/jwks").is_ok());
        assert!(checked_url("http://[::1]:8080/jwks").is_ok());
        assert!(checked_url("http://localhost/jwks").is_ok());
        assert!(checked_url("http://idp.example/jwks").is_err());
        assert!(checked_url("ftp://idp.example/jwks").is_err());
        assert!(checked_url("jwks.json").is_err());
    }
}
