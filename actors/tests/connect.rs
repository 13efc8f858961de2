//! The connect suite on the in-memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::Engine;
use actors::config::SyncConfig;
use actors::store::MemStore;
use actors::testkit::{Harness, HarnessFactory, connect_suite};
use protocol::json::{self, Value};

struct Mem {
    store: MemStore,
    engine: Engine,
    config: SyncConfig,
}

impl Harness for Mem {
    async fn connect(&mut self, user: &str, body: &Value) -> (u16, Value) {
        let reply = self
            .engine
            .connect(user, json::to_canonical(body), 1_784_383_200_000_000)
            .await;
        (reply.status, json::parse(&reply.body).unwrap())
    }

    async fn restart(&mut self, config: &SyncConfig) {
        self.engine = Engine::start(self.store.clone(), config.clone())
            .await
            .unwrap();
        self.config = config.clone();
    }

    async fn grant(&mut self, user: &str, scope: &str, on: bool) {
        if on {
            self.store.grant(user, scope).await
        } else {
            self.store.revoke(user, scope).await
        }
    }

    async fn team_member(&mut self, user: &str, team: &str, on: bool) {
        let source = self.config.assignment.dependency[0].clone();
        self.store.dependency_row(&source, user, team, on).await;
    }

    async fn retire(&mut self, client_id: &str) {
        self.store.retire_client(client_id).await;
    }
}

struct MemFactory;

impl HarnessFactory for MemFactory {
    type H = Mem;

    async fn fresh(&self, config: &SyncConfig) -> Mem {
        let store = MemStore::new();
        let engine = Engine::start(store.clone(), config.clone()).await.unwrap();
        Mem {
            store,
            engine,
            config: config.clone(),
        }
    }
}

#[tokio::test]
async fn connect_on_memstore() {
    connect_suite(&MemFactory).await;
}

#[tokio::test]
async fn store_conformance_on_memstore() {
    actors::testkit::store_suite(&MemStore::new()).await;
}
