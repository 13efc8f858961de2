//! The Rust client against the real binary over HTTP, on its embedded
//! PostgreSQL, as a user runs it: two devices of one user write offline,
//! sync, conflict, survive a restart with a write still queued, and a
//! third device and a damaged local copy are rebuilt. Every page each
//! device applies is verified by its row and scope checksums; at the end
//! every device's copy is the server's.
#![cfg(not(madsim))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use client::local::{LocalStore, Transition};
use client::{Client, Config, HttpTransport, SqliteStore, Write, WriteOp};
use protocol::json::{Object, Value};

mod common;

struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM stops the server gracefully, and with it the embedded cluster.
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

fn serve(dir: &Path) -> Server {
    let (child, addr) = common::serve_dir(dir, None, Stdio::null());
    Server { child, addr }
}

fn token(dir: &Path, user: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_synchro"))
        .args(["token", "--user", user, "--config"])
        .arg(dir.join("config.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

type Device = Client<SqliteStore, HttpTransport>;

fn device(dir: &Path, addr: SocketAddr, token: &str, name: &str, seed: u64) -> Device {
    let store = SqliteStore::open(&dir.join(format!("{name}.db"))).unwrap();
    let config = Config {
        pull_limit: 3,
        rebuild_limit: 2,
        backoff_base: Duration::from_millis(50),
        backoff_cap: Duration::from_secs(2),
        ..Config::default()
    };
    Client::open(
        store,
        HttpTransport::bearer(addr, token),
        name,
        config,
        seed,
    )
    .unwrap()
}

fn now() -> String {
    client::datetime(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros() as i64,
    )
}

fn columns(members: &[(&str, Value)]) -> Object {
    members
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect()
}

fn note_id(n: u64) -> String {
    format!("00000000-0000-4000-8000-{n:012x}")
}

fn insert(n: u64, title: &str) -> Write {
    Write {
        table: "tbl_notes".into(),
        pk: Value::string(note_id(n)),
        op: WriteOp::Insert {
            columns: columns(&[
                ("fld_notes_title", Value::string(title)),
                ("fld_notes_pinned", Value::Bool(false)),
            ]),
        },
        client_version: now(),
    }
}

fn retitle(d: &Device, n: u64, title: &str) -> Write {
    let pk = Value::string(note_id(n));
    Write {
        table: "tbl_notes".into(),
        op: WriteOp::Update {
            base_version: base_version_of(d, &pk),
            columns: columns(&[("fld_notes_title", Value::string(title))]),
        },
        pk,
        client_version: now(),
    }
}

fn base_version_of(d: &Device, pk: &Value) -> String {
    d.version_of("tbl_notes", pk)
        .unwrap()
        .expect("a known version")
}

fn titles(d: &Device) -> Vec<(String, String)> {
    d.rows("tbl_notes")
        .unwrap()
        .into_iter()
        .map(|r| {
            let o = r.row.as_object().unwrap();
            let s = |k: &str| o[k].as_str().unwrap().to_owned();
            (s("fld_notes_id"), s("fld_notes_title"))
        })
        .collect()
}

/// Pulls every device until all hold `want` (capture trails a push by a moment).
async fn converge(devices: &mut [&mut Device], want: &[(String, String)]) {
    for _ in 0..600 {
        let mut all = true;
        for d in devices.iter_mut() {
            let report = d.pull().await.unwrap();
            assert!(report.mismatched.is_empty(), "no checksum differed");
            all &= titles(d) == want;
        }
        if all {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got: Vec<_> = devices.iter().map(|d| titles(d)).collect();
    panic!("the devices did not converge on {want:?}: {got:?}");
}

#[tokio::test]
async fn two_devices_sync_through_the_real_server() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("hs256.secret");
    let config = actors::testkit::EXAMPLE_CONFIG.replace(
        "secret_file = \".synchro/hs256.secret\"",
        &format!("secret_file = {:?}", secret.display().to_string()),
    );
    std::fs::write(dir.path().join("config.toml"), config).unwrap();
    std::fs::write(
        dir.path().join("schema.sql"),
        include_str!("../../examples/notes/schema.sql"),
    )
    .unwrap();
    let server = serve(dir.path());
    for _ in 0..600 {
        let (status, _, body) =
            common::request(server.addr, "GET", "/ready", &[], Vec::new()).await;
        if status == 200 && body == b"{\"ready\":true}" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let alice = token(dir.path(), "alice");
    let mut phone = device(dir.path(), server.addr, &alice, "phone", 1);
    let mut laptop = device(dir.path(), server.addr, &alice, "laptop", 2);
    phone.connect().await.unwrap();
    laptop.connect().await.unwrap();

    // Offline writes on both, then sync.
    for n in 1..=3 {
        phone.write(&insert(n, &format!("phone {n}"))).unwrap();
    }
    laptop.write(&insert(4, "laptop 4")).unwrap();
    let (pushed, _) = phone.sync().await.unwrap();
    assert_eq!(pushed.outcomes.len(), 3);
    assert!(
        pushed
            .outcomes
            .iter()
            .all(|o| o.status == "applied" && o.verified)
    );
    laptop.sync().await.unwrap();
    let mut want: Vec<(String, String)> = (1..=3)
        .map(|n| (note_id(n), format!("phone {n}")))
        .chain([(note_id(4), "laptop 4".into())])
        .collect();
    converge(&mut [&mut phone, &mut laptop], &want).await;

    // A conflict: both edit note 1 from the same version; the laptop's lands.
    let from_phone = retitle(&phone, 1, "phone's edit");
    laptop.write(&retitle(&laptop, 1, "laptop's edit")).unwrap();
    laptop.push().await.unwrap();
    phone.write(&from_phone).unwrap();
    let pushed = phone.push().await.unwrap();
    assert_eq!(
        (
            pushed.outcomes[0].status.as_str(),
            pushed.outcomes[0].code.as_deref()
        ),
        ("conflict", Some("version_conflict"))
    );
    want[0].1 = "laptop's edit".into();
    converge(&mut [&mut phone, &mut laptop], &want).await;

    // The phone is killed with a write queued; reopened from its file, it sends it.
    phone
        .write(&insert(5, "queued before the restart"))
        .unwrap();
    drop(phone);
    let mut phone = device(dir.path(), server.addr, &alice, "phone", 3);
    assert_eq!(phone.pending().unwrap(), 1, "the queued write survived");
    let pushed = phone.push().await.unwrap();
    assert_eq!(pushed.outcomes[0].status, "applied");
    want.push((note_id(5), "queued before the restart".into()));

    // A new device rebuilds everything; a damaged local copy is rebuilt.
    let mut tablet = device(dir.path(), server.addr, &alice, "tablet", 4);
    tablet.connect().await.unwrap();
    converge(&mut [&mut phone, &mut laptop, &mut tablet], &want).await;
    let mut damaged = laptop.store().holdings("user:alice").unwrap();
    damaged[0].digest[0] ^= 0x5a;
    drop(laptop);
    let mut file = SqliteStore::open(&dir.path().join("laptop.db")).unwrap();
    file.commit(Transition {
        put: damaged,
        ..Transition::default()
    })
    .unwrap();
    drop(file);
    let mut laptop = device(dir.path(), server.addr, &alice, "laptop", 5);
    let report = laptop.pull().await.unwrap();
    assert_eq!(report.mismatched, vec!["user:alice".to_owned()]);
    assert!(report.rebuilt.contains(&"user:alice".to_owned()));
    converge(&mut [&mut phone, &mut laptop, &mut tablet], &want).await;
    // Every device holds exactly the server's scope (the last terminal
    // checksums matched), and the same rows.
    let keys = |d: &Device| d.store().holdings("user:alice").unwrap().len();
    assert_eq!((keys(&phone), keys(&laptop), keys(&tablet)), (5, 5, 5));
}
