//! The app evolves (issue 23, ADR 0020), through the real binary over HTTP
//! on PostgreSQL: one config change per restart, while the application
//! keeps writing by SQL. A device that synced under every earlier config
//! and a fresh device follow connect's action (with the client library,
//! which verifies every row and scope checksum), and after each change
//! both hold exactly the rows a query of the source tables says they
//! must: an added nullable field over a column with values, a table
//! registered over its rows, an added required field, a changed `via`
//! template, a `via` rule added and the `via` rules removed, the shared
//! scopes changed, a field retyped (with its column), a removed field, a
//! removed table and a field's column renamed. One rematerialization is
//! killed (`SIGKILL`) halfway, and the next process resumes it. A
//! process of an older deploy that restarts is refused.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use client::{Client, Config, HttpTransport, SqliteStore, SyncError};
use protocol::json::Value;
use sqlx::PgPool;
use store_pg::cluster::PgCluster;

mod common;

/// The notes example, signed in by a trusted header, capture quick, and
/// rematerialized in chunks of 3 rows.
fn base_config() -> String {
    actors::testkit::EXAMPLE_CONFIG
        .replace(
            "mode = \"hs256\"\nsecret_file = \".synchro/hs256.secret\"",
            "mode = \"upstream\"\nheader = \"x-user\"",
        )
        .replace("bootstrap_sql = \"schema.sql\"\n", "")
        .replace(
            "[assignment]",
            "[capture]\nheartbeat_ms = 100\nretry_ms = 100\nrematerialize_chunk_rows = 3\n\n[assignment]",
        )
}

fn line_of<'a>(config: &'a str, needle: &str) -> &'a str {
    config.lines().find(|l| l.contains(needle)).unwrap()
}

/// One change: its config, the SQL the application runs before it (with
/// the server stopped), and what alice must see under it.
struct Step {
    what: &'static str,
    config: String,
    ddl: &'static str,
    /// Notes shared with her team (a `via` rule places them in her scopes).
    shared: bool,
    /// Templates (registered, and their scope assigned to everyone).
    templates: bool,
}

/// One change after another, each config the one before with one change.
fn steps() -> Vec<Step> {
    let full = base_config();
    let body = format!("{}\n", line_of(&full, "fld_notes_body"));
    let pinned = format!("{}\n", line_of(&full, "fld_notes_pinned"));
    let via = line_of(&full, "via = \"public.note_shares\"").to_owned();
    let cut_templates =
        |c: &str| c[..c.find("[[tables]]\ntable_id = \"tbl_templates\"").unwrap()].to_owned();
    let first = cut_templates(&full).replace(&body, "").replace(&pinned, "");
    let with_body = cut_templates(&full).replace(&pinned, "");
    let with_templates = full.replace(&pinned, "");
    let with_pinned = full.clone();
    let groups = full.replace("team:{team_id}", "group:{team_id}");
    let group_via = via.replace("team:{team_id}", "group:{team_id}");
    let another_via = format!(
        "{group_via}\n{}",
        group_via.replace("group:{team_id}", "shared:{team_id}")
    );
    let two_vias = groups.replace(&group_via, &another_via);
    let no_vias = groups.replace(&format!("{group_via}\n"), "");
    let no_shared = no_vias.replace("shared = [\"templates_public\"]", "shared = []");
    let retyped = no_shared.replace(
        "column = \"pinned\", type = \"boolean\"",
        "column = \"pinned\", type = \"int\"",
    );
    let no_body = retyped.replace(&body, "");
    let no_templates = cut_templates(&no_body);
    let renamed = no_templates.replace(
        "column = \"pinned\", type = \"int\"",
        "column = \"starred\", type = \"int\"",
    );
    assert_ne!(renamed, no_templates, "the rename applies");
    let step = |what, config: &String, ddl, shared, templates| Step {
        what,
        config: config.clone(),
        ddl,
        shared,
        templates,
    };
    vec![
        step("first", &first, "", true, false),
        step(
            "a nullable field added over values",
            &with_body,
            "",
            true,
            false,
        ),
        step(
            "a table registered over its rows",
            &with_templates,
            "",
            true,
            true,
        ),
        step("a required field added", &with_pinned, "", true, true),
        step("a via rule's template changed", &groups, "", true, true),
        step("a via rule added", &two_vias, "", true, true),
        step("the via rules removed", &no_vias, "", false, true),
        step("the shared scopes changed", &no_shared, "", false, false),
        step(
            "a field retyped",
            &retyped,
            "ALTER TABLE public.notes ALTER COLUMN pinned DROP DEFAULT, \
             ALTER COLUMN pinned TYPE integer USING (CASE WHEN pinned THEN 1 ELSE 0 END), \
             ALTER COLUMN pinned SET DEFAULT 0",
            false,
            false,
        ),
        step("a field removed", &no_body, "", false, false),
        step("a table removed", &no_templates, "", false, false),
        step(
            "a field's column renamed",
            &renamed,
            "ALTER TABLE public.notes RENAME COLUMN pinned TO starred",
            false,
            false,
        ),
    ]
}

struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    async fn start(dir: &Path, url: &str) -> Server {
        let (child, addr) = common::serve_dir(dir, Some(url), Stdio::null());
        let server = Server { child, addr };
        let start = Instant::now();
        loop {
            let (status, _, _) = common::request(addr, "GET", "/ready", &[], Vec::new()).await;
            if status == 200 {
                return server;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "never ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn stop(mut self) {
        Command::new("kill")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(self.child.wait().unwrap().success());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

type Device = Client<SqliteStore, HttpTransport>;

fn device(dir: &Path, addr: SocketAddr, name: &str, seed: u64) -> Device {
    let store = SqliteStore::open(&dir.join(format!("{name}.db"))).unwrap();
    let config = Config {
        pull_limit: 4,
        rebuild_limit: 3,
        backoff_base: Duration::from_millis(20),
        backoff_cap: Duration::from_millis(500),
        ..Config::default()
    };
    let transport = HttpTransport::with_headers(addr, vec![("x-user".into(), "alice".into())]);
    Client::open(store, transport, name, config, seed).unwrap()
}

/// What alice must hold, by a query of the source tables: each visible
/// note's (title, body) and each template's name, by key.
async fn authoritative(
    pool: &PgPool,
    step: &Step,
    body: bool,
) -> BTreeMap<String, Vec<Option<String>>> {
    let shared = match step.shared {
        true => {
            "OR EXISTS (SELECT 1 FROM public.note_shares s JOIN public.team_members m \
             ON m.team_id = s.team_id WHERE s.note_id = n.id AND m.user_id = 'alice')"
        }
        false => "",
    };
    let sql = format!(
        "SELECT id::text, title, body FROM public.notes n WHERE owner_id = 'alice' {shared}"
    );
    let templates = step.templates;
    let mut want = BTreeMap::new();
    for (id, title, b) in sqlx::query_as::<_, (String, String, Option<String>)>(&sql)
        .fetch_all(pool)
        .await
        .unwrap()
    {
        let mut fields = vec![Some(title)];
        if body {
            fields.push(b);
        }
        want.insert(id, fields);
    }
    if templates {
        for (id, name) in
            sqlx::query_as::<_, (String, String)>("SELECT id, name FROM public.templates")
                .fetch_all(pool)
                .await
                .unwrap()
        {
            want.insert(id, vec![Some(name)]);
        }
    }
    want
}

/// What a device holds, in the same shape.
fn held(d: &Device, body: bool) -> BTreeMap<String, Vec<Option<String>>> {
    let text =
        |o: &protocol::json::Object, f: &str| o.get(f).and_then(Value::as_str).map(str::to_owned);
    let mut out = BTreeMap::new();
    for r in d.rows("tbl_notes").unwrap() {
        let o = r.row.as_object().unwrap();
        // A row of another manifest than the current one never matches.
        let mut fields = vec![text(o, "fld_notes_title")];
        match (body, o.contains_key("fld_notes_body")) {
            (true, true) => fields.push(text(o, "fld_notes_body")),
            (false, false) => {}
            _ => fields.push(Some("a row of another manifest".into())),
        }
        out.insert(text(o, "fld_notes_id").unwrap(), fields);
    }
    for r in d.rows("tbl_templates").unwrap() {
        let o = r.row.as_object().unwrap();
        out.insert(
            text(o, "fld_templates_id").unwrap(),
            vec![text(o, "fld_templates_name")],
        );
    }
    out
}

/// Syncs until the device holds `want`; every page verified, no checksum
/// differed, and an unsupported schema reset as an upgraded app would.
async fn converge(
    d: &mut Device,
    want: &BTreeMap<String, Vec<Option<String>>>,
    body: bool,
    what: &str,
) {
    let start = Instant::now();
    loop {
        match d.sync().await {
            Ok((_, pulled)) => {
                assert!(pulled.mismatched.is_empty(), "{what}: no checksum differed")
            }
            Err(SyncError::Unsupported(_)) => d.reset_schema().await.unwrap(),
            Err(e) => {
                let s = e.to_string();
                assert!(!s.contains("500"), "{what}: {s}");
            }
        }
        if held(d, body) == *want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{what}: the device did not converge: {:?} against {want:?}",
            held(d, body)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The application: notes of alice and bob (bob's shared with alice's
/// team now and then), with bodies, and templates, written by SQL.
async fn write_some(pool: &PgPool, n: &AtomicU64, rounds: u64) {
    for _ in 0..rounds {
        let i = n.fetch_add(1, Ordering::Relaxed);
        let owner = if i.is_multiple_of(3) { "bob" } else { "alice" };
        let id = format!("00000000-0000-4000-8000-{i:012x}");
        let body = (!i.is_multiple_of(4)).then(|| format!("body {i}"));
        sqlx::query(
            "INSERT INTO public.notes (id, owner_id, title, body) VALUES ($1::uuid, $2, $3, $4)",
        )
        .bind(&id)
        .bind(owner)
        .bind(format!("title {i}"))
        .bind(&body)
        .execute(pool)
        .await
        .unwrap();
        if owner == "bob" && i % 2 == 1 {
            sqlx::query(
                "INSERT INTO public.note_shares (note_id, team_id) VALUES ($1::uuid, 'red')",
            )
            .bind(&id)
            .execute(pool)
            .await
            .unwrap();
        }
        if i.is_multiple_of(5) {
            let old = format!("00000000-0000-4000-8000-{:012x}", i / 2);
            sqlx::query("UPDATE public.notes SET title = $2, body = $3 WHERE id = $1::uuid")
                .bind(&old)
                .bind(format!("edited {i}"))
                .bind(format!("edited body {i}"))
                .execute(pool)
                .await
                .unwrap();
        }
        sqlx::query(
            "INSERT INTO public.templates (id, name, body) VALUES ($1, $2, 'b') \
             ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name",
        )
        .bind(format!("tpl-{}", i % 7))
        .bind(format!("name {i}"))
        .execute(pool)
        .await
        .unwrap();
    }
}

#[tokio::test]
async fn every_change_keeps_every_client_reading() {
    let cluster = PgCluster::temp().unwrap();
    cluster.create_database("evolution").await.unwrap();
    let url = cluster.url("evolution");
    let pool = PgPool::connect_with(cluster.connect_options("evolution"))
        .await
        .unwrap();
    sqlx::raw_sql(include_str!("../../examples/notes/schema.sql"))
        .execute(&pool)
        .await
        .unwrap();
    sqlx::raw_sql("INSERT INTO public.team_members VALUES ('alice', 'red')")
        .execute(&pool)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let n = Arc::new(AtomicU64::new(1));
    write_some(&pool, &n, 20).await;

    let mut seed = 1;
    let mut old: Option<Device> = None;
    for step in steps() {
        let (what, config) = (step.what, &step.config);
        if !step.ddl.is_empty() {
            sqlx::raw_sql(step.ddl).execute(&pool).await.unwrap();
        }
        std::fs::write(dir.path().join("config.toml"), config).unwrap();
        let mut server = Server::start(dir.path(), &url).await;
        if what == "a nullable field added over values" {
            // Killed mid-rematerialization, the next process resumes it.
            let start = Instant::now();
            loop {
                let (chunks_done,): (i64,) = sqlx::query_as(
                    "SELECT count(*) FROM synchro.rematerializations WHERE pending AND rows > 0",
                )
                .fetch_one(&pool)
                .await
                .unwrap();
                if chunks_done > 0 {
                    break;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "no chunk was done"
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            drop(server); // SIGKILL
            // Statistics, so the report can say how much is left.
            sqlx::query("ANALYZE public.notes")
                .execute(&pool)
                .await
                .unwrap();
            let status = Command::new(env!("CARGO_BIN_EXE_synchro"))
                .args(["stream", "status", "--database-url", &url])
                .output()
                .unwrap();
            let out = String::from_utf8_lossy(&status.stdout);
            assert!(
                out.contains("rematerializing: public.notes, ") && out.contains(" of about "),
                "the operator sees what is owed, and of how much: {out}"
            );
            server = Server::start(dir.path(), &url).await;
        }
        // The application writes while the change is rematerialized.
        let writing = Arc::new(AtomicBool::new(true));
        let writer = {
            let (pool, n, writing) = (pool.clone(), n.clone(), writing.clone());
            tokio::spawn(async move {
                while writing.load(Ordering::Relaxed) {
                    write_some(&pool, &n, 1).await;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        let body = config.contains("fld_notes_body");
        let mut devices = Vec::new();
        if let Some(mut d) = old.take() {
            *d.transport_mut() =
                HttpTransport::with_headers(server.addr, vec![("x-user".into(), "alice".into())]);
            devices.push(d);
        }
        seed += 1;
        devices.push(device(
            dir.path(),
            server.addr,
            &format!("fresh-{seed}"),
            seed,
        ));
        tokio::time::sleep(Duration::from_millis(200)).await;
        writing.store(false, Ordering::Relaxed);
        writer.await.unwrap();
        let want = authoritative(&pool, &step, body).await;
        for d in &mut devices {
            converge(d, &want, body, what).await;
        }
        // The device that has followed every change goes on to the next.
        old = Some(devices.remove(0));
        server.stop();
    }
}

/// A process of an older deploy, restarted after a newer config started,
/// is refused with the way out in its message (ADR 0020 §8), and
/// `--roll-back` returns to that config on purpose.
#[tokio::test]
async fn a_replaced_config_is_refused_unless_rolled_back() {
    let cluster = PgCluster::temp().unwrap();
    let (dir, url, _pool) = common::upstream_setup(&cluster, "replaced").await;
    let config = dir.path().join("config.toml");
    let older = std::fs::read_to_string(&config).unwrap();
    let newer = older.replace("team:{team_id}", "group:{team_id}");
    let serve = |roll_back: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_synchro"));
        c.args(["serve", "--listen", "127.0.0.1:0", "--database-url", &url])
            .arg("--config")
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.path().join("data"));
        if roll_back {
            c.arg("--roll-back");
        }
        c
    };
    let started = |mut c: Command| {
        let mut child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(out));
        assert!(
            lines.any(|l| l.unwrap().starts_with("synchro: listening on ")),
            "the server started"
        );
        // Its config was applied before it listened.
        child.kill().unwrap();
        child.wait().unwrap();
    };
    started(serve(false));
    std::fs::write(&config, &newer).unwrap();
    started(serve(false));
    // The older deploy's process comes back: refused, nothing changed.
    std::fs::write(&config, &older).unwrap();
    let refused = serve(false).output().unwrap();
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("replaced by a newer one") && stderr.contains("--roll-back"),
        "{stderr}"
    );
    std::fs::write(&config, &newer).unwrap();
    started(serve(false));
    // On purpose: the older config becomes the newest, and the one it
    // replaced is refused in turn.
    std::fs::write(&config, &older).unwrap();
    started(serve(true));
    started(serve(false));
    std::fs::write(&config, &newer).unwrap();
    assert!(!serve(false).output().unwrap().status.success());
}
