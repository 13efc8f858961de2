//! A "device" of the notes example: a local SQLite copy that syncs with a
//! `synchro serve` (README, "Two devices"). Run two with different
//! `--device` names against one server.
//!
//! ```text
//! cargo run -p client --example notes -- --device phone sync
//! cargo run -p client --example notes -- --device phone add "Buy milk"   # offline
//! cargo run -p client --example notes -- --device phone sync
//! cargo run -p client --example notes -- --device laptop sync
//! cargo run -p client --example notes -- --device laptop list
//! ```
#![allow(clippy::print_stdout)]

#[cfg(not(madsim))]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    device::main()
}

/// The simulator builds no example.
#[cfg(madsim)]
fn main() {}

#[cfg(not(madsim))]
mod device {
    use std::net::SocketAddr;
    use std::path::PathBuf;
    use std::time::{SystemTime, UNIX_EPOCH};

    use clap::{Parser, Subcommand};
    use client::{Client, Config, HttpTransport, SqliteStore, Write, WriteOp};
    use protocol::json::Value;

    #[derive(Parser)]
    struct Args {
        /// This device's name (its local file is DIR/NAME.db).
        #[arg(long)]
        device: String,
        /// Where devices keep their local copies.
        #[arg(long, default_value = ".synchro/devices")]
        dir: PathBuf,
        /// The server's listen address.
        #[arg(long, default_value = "127.0.0.1:8787")]
        server: SocketAddr,
        /// A bearer token (`synchro token --user NAME`).
        #[arg(long, env = "SYNCHRO_TOKEN", hide_env_values = true)]
        token: String,
        #[command(subcommand)]
        command: Action,
    }

    #[derive(Subcommand)]
    enum Action {
        /// Pushes what was written here and pulls what changed elsewhere.
        Sync,
        /// Writes a note locally (no network): it is sent by the next sync.
        Add { title: String },
        /// Lists the notes this device holds.
        List,
    }

    fn now_micros() -> i64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64)
    }

    /// A random UUID for a new note's key.
    fn new_id() -> String {
        let mut b = [0u8; 16];
        getrandom::fill(&mut b).unwrap_or_default();
        b[6] = (b[6] & 0x0f) | 0x40;
        b[8] = (b[8] & 0x3f) | 0x80;
        protocol::ids::CanonicalUuid::from_bytes(b).map_or_else(String::new, |u| u.to_string())
    }

    #[tokio::main(flavor = "current_thread")]
    pub async fn main() -> Result<(), Box<dyn std::error::Error>> {
        let args = Args::parse();
        std::fs::create_dir_all(&args.dir)?;
        let store = SqliteStore::open(&args.dir.join(format!("{}.db", args.device)))?;
        let transport = HttpTransport::bearer(args.server, &args.token);
        // Fresh entropy on every open: the IDs the client makes never repeat.
        let mut seed = [0u8; 8];
        getrandom::fill(&mut seed).map_err(|e| format!("no OS entropy: {e}"))?;
        let seed = u64::from_le_bytes(seed);
        let mut device = Client::open(store, transport, &args.device, Config::default(), seed)?;
        match args.command {
            Action::Sync => {
                let (pushed, pulled) = device.sync().await?;
                for o in &pushed.outcomes {
                    let code = o
                        .code
                        .as_deref()
                        .map_or(String::new(), |c| format!(" ({c})"));
                    println!("pushed: {} {}{code}", o.table, o.status);
                }
                println!(
                    "pulled {} change(s) in {} page(s); rebuilt {:?}; every checksum verified",
                    pulled.changes, pulled.pages, pulled.rebuilt
                );
            }
            Action::Add { title } => {
                let columns = [
                    ("fld_notes_title".to_owned(), Value::string(title)),
                    ("fld_notes_pinned".to_owned(), Value::Bool(false)),
                ];
                let write = Write {
                    table: "tbl_notes".into(),
                    pk: Value::string(new_id()),
                    op: WriteOp::Insert {
                        columns: columns.into_iter().collect(),
                    },
                    client_version: client::datetime(now_micros()),
                };
                match device.write(&write) {
                    Ok(_) => println!("queued ({} write(s) waiting for sync)", device.pending()?),
                    Err(e) => println!("not queued: {e:?} (sync once first, to learn the schema)"),
                }
            }
            Action::List => {
                for r in device.rows("tbl_notes")? {
                    let o = r.row.as_object().ok_or("a note is not an object")?;
                    let title = o
                        .get("fld_notes_title")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    let owner = o
                        .get("fld_notes_owner")
                        .and_then(Value::as_str)
                        .unwrap_or("");
                    println!("{title}  (by {owner})");
                }
                let pending = device.pending()?;
                if pending > 0 {
                    println!("{pending} write(s) not yet synced");
                }
            }
        }
        Ok(())
    }
}
