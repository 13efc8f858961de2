//! The whole pull and rebuild suites over real HTTP on a throwaway PostgreSQL cluster:
//! every engine the suite starts gets its own server (adapter, HS256 auth)
//! on loopback, and every client request goes through it.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::sync::Arc;

use actors::Engine;
use actors::config::AuthConfig;
use actors::reply::Reply;
use actors::testkit::{Route, Serve, Transport, pull_suite_via, rebuild_suite_via};
use server::adapter::{AppState, router};
use server::auth::{Authenticator, dev_token, hs256_secret};
use store_pg::cluster::PgCluster;
use store_pg::{PgWorld, example_store};

mod common;
use common::request;

/// Serves `engine` on a fresh loopback port; requests carry a dev token
/// of the user they are sent as.
fn http(engine: &Engine, auth: Arc<Authenticator>, secret: Arc<Vec<u8>>) -> Transport {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    let app = router(AppState::new(engine.clone(), auth, &Default::default()));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Transport::new(move |route: Route, user: String, body: Vec<u8>| {
        let secret = secret.clone();
        Box::pin(async move {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            let bearer = format!(
                "Bearer {}",
                dev_token(&secret, &user, now, &Default::default()).unwrap()
            );
            let headers = [
                ("authorization", bearer.as_str()),
                ("content-type", "application/json"),
            ];
            let (status, h, body) = request(addr, "POST", route.path(), &headers, body).await;
            assert_eq!(h.get("content-type").unwrap(), "application/json");
            let retry_after = h
                .get("retry-after")
                .map(|v| v.to_str().unwrap().parse().unwrap());
            Reply {
                status,
                body,
                retry_after,
                code: None,
            }
        })
    })
}

/// Every engine a suite starts, served over HTTP with one HS256 secret.
async fn serve(secrets: &std::path::Path) -> Serve {
    let secret_file = secrets.join("hs256.secret").display().to_string();
    let secret = Arc::new(hs256_secret(std::path::Path::new(&secret_file)).unwrap());
    let auth = Arc::new(
        Authenticator::from_config(&AuthConfig::hs256(&secret_file))
            .await
            .unwrap(),
    );
    Arc::new(move |engine: &Engine| http(engine, auth.clone(), secret.clone()))
}

#[tokio::test]
async fn every_pull_rule_over_http() {
    let cluster = PgCluster::temp().unwrap();
    let world = PgWorld {
        store: example_store(&cluster, "pull_http").await,
    };
    let secrets = tempfile::tempdir().unwrap();
    pull_suite_via(&world, serve(secrets.path()).await).await;
}

#[tokio::test]
async fn every_rebuild_rule_over_http() {
    let cluster = PgCluster::temp().unwrap();
    let world = PgWorld {
        store: example_store(&cluster, "rebuild_http").await,
    };
    let secrets = tempfile::tempdir().unwrap();
    rebuild_suite_via(&world, serve(secrets.path()).await).await;
}
