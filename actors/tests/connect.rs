//! The connect suite on the in-memory store.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use actors::Engine;
use actors::config::SyncConfig;
use actors::store::{MemStore, Store, StoreTx};
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
        let mut tx = self.store.begin().await.unwrap();
        assert!(tx.retire_client(client_id).await.unwrap());
        tx.commit().await.unwrap();
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

/// A field ID names a field within its table: two tables may both have an
/// `id`, and the config that started starts again, unchanged (ADR 0016).
#[tokio::test]
async fn field_ids_are_per_table_at_every_start() {
    use actors::testkit::example_config;
    let shared_ids = |s: String| {
        s.replace("fld_notes_id", "id")
            .replace("fld_templates_id", "id")
            .replace("fld_notes_body", "body")
            .replace("fld_templates_body", "body")
    };
    let store = MemStore::new();
    for start in ["first", "restart", "second restart"] {
        let engine = Engine::start(store.clone(), example_config(shared_ids)).await;
        assert!(
            engine.is_ok(),
            "{start}: {:?}",
            engine.err().map(|e| e.to_string())
        );
    }
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        tx.manifests().await.unwrap().len(),
        1,
        "one manifest, never re-registered"
    );
}

#[tokio::test]
async fn ids_are_never_reused_across_versions() {
    use actors::testkit::example_config;
    let store = MemStore::new();
    Engine::start(store.clone(), example_config(|s| s))
        .await
        .unwrap();
    let start = |edit: fn(String) -> String| {
        let store = store.clone();
        async move {
            Engine::start(store, example_config(edit))
                .await
                .err()
                .map(|e| e.to_string())
        }
    };
    let rebound = start(|s| {
        s.replace(
            "relation_id = \"rel_templates\"",
            "relation_id = \"rel_templates_2\"",
        )
    })
    .await
    .unwrap();
    assert!(
        rebound.contains(
            "table tbl_templates: schema version 1 bound it to relation_id rel_templates"
        ),
        "{rebound}"
    );
    // Remove a field (class 4), then try to bring its ID back.
    let without = |s: String| {
        s.replace("  { field_id = \"fld_notes_pinned\", column = \"pinned\", type = \"boolean\", writable = true },\n", "")
    };
    Engine::start(store.clone(), example_config(without))
        .await
        .unwrap();
    // A return to the first config is refused as a replaced one, and on
    // purpose (`--roll-back`) as a reuse of a removed field ID.
    let replaced = start(|s| s).await.unwrap();
    assert!(replaced.contains("--roll-back"), "{replaced}");
    let mut first = example_config(|s| s);
    first.roll_back = true;
    let back = Engine::start(store.clone(), first)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap();
    assert!(
        back.contains("table tbl_notes, field fld_notes_pinned: the field ID was removed earlier"),
        "{back}"
    );
}

/// A config's fingerprint (ADR 0020 §8) is what it means: the order of
/// tables and lists in the file, the server's knobs and the roll-back flag
/// are not part of it; a rule, a field or the assignment is.
#[test]
fn a_config_fingerprint_is_its_meaning() {
    use actors::registry::config_fingerprint;
    use actors::testkit::example_config;
    let two_shared = |first: &'static str, second: &'static str| {
        example_config(move |s| {
            s.replace(
                r#"shared = ["templates_public"]"#,
                &format!(r#"shared = ["{first}", "{second}"]"#),
            )
        })
    };
    let base = config_fingerprint(&two_shared("templates_public", "news")).unwrap();
    let mut reordered = two_shared("news", "templates_public");
    reordered.tables.reverse();
    reordered.roll_back = true;
    reordered.capture.rematerialize_chunk_rows = 7;
    assert_eq!(config_fingerprint(&reordered).unwrap(), base);
    let mut changed = two_shared("templates_public", "news");
    changed.assignment.shared.pop();
    assert_ne!(config_fingerprint(&changed).unwrap(), base);
    let regrouped = example_config(|s| {
        s.replace(
            r#"shared = ["templates_public"]"#,
            r#"shared = ["templates_public", "news"]"#,
        )
        .replace("team:{team_id}", "group:{team_id}")
    });
    assert_ne!(config_fingerprint(&regrouped).unwrap(), base);
    let without_body = example_config(|s| {
        s.replace(r#"shared = ["templates_public"]"#, r#"shared = ["templates_public", "news"]"#)
            .replace(
                "  { field_id = \"fld_notes_body\", column = \"body\", type = \"string\", nullable = true, writable = true },\n",
                "",
            )
    });
    assert_ne!(config_fingerprint(&without_body).unwrap(), base);
}
