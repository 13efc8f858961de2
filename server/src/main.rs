//! `synchro`: run the server, or print a development bearer token.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use actors::Engine;
use actors::config::{AuthConfig, SyncConfig};
use clap::{Parser, Subcommand};
use server::adapter::{AppState, router};
use server::auth::{Authenticator, dev_token, hs256_secret, hs256_secret_file};
use server::listener::HttpLimits;
use sqlx::postgres::PgConnectOptions;
use store_pg::cluster::PgCluster;
use store_pg::{PgStore, catalog};

#[derive(Parser)]
#[command(
    name = "synchro",
    version,
    about = "A server for the Synchro offline-first sync protocol, version 3"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Runs the server. Without --database-url it starts a private PostgreSQL under --data-dir.
    Serve {
        /// The sync config (TOML).
        #[arg(long, default_value = "synchro.toml")]
        config: PathBuf,
        /// The listen address; keep it private (loopback or a private network behind a TLS proxy).
        #[arg(long, default_value = "127.0.0.1:8787")]
        listen: SocketAddr,
        /// An existing PostgreSQL database (wal_level = logical) instead of the embedded one.
        #[arg(long)]
        database_url: Option<String>,
        /// Where the embedded PostgreSQL keeps its data.
        #[arg(long, default_value = ".synchro")]
        data_dir: PathBuf,
    },
    /// Operator actions on the capture stream: its status, and the stream reset.
    Stream {
        #[command(subcommand)]
        action: StreamAction,
    },
    /// Moves the retention floor and compacts below it now, as the server
    /// does every `[retention] compact_interval_seconds` (ADR 0024).
    Compact {
        /// The sync config (TOML): its `[retention]` window.
        #[arg(long, default_value = "synchro.toml")]
        config: PathBuf,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Operator actions on one client.
    Client {
        #[command(subcommand)]
        action: ClientAction,
    },
    /// Prints a bearer token for USER that a local server (auth mode hs256) accepts.
    Token {
        #[arg(long)]
        user: String,
        #[arg(long, default_value = "synchro.toml")]
        config: PathBuf,
    },
}

/// Where the stream's database is: as `serve` finds it.
#[derive(clap::Args)]
struct DatabaseArgs {
    /// An existing PostgreSQL database instead of the embedded one.
    #[arg(long)]
    database_url: Option<String>,
    /// Where the embedded PostgreSQL keeps its data.
    #[arg(long, default_value = ".synchro")]
    data_dir: PathBuf,
}

#[derive(Subcommand)]
enum StreamAction {
    /// Shows the stream's generation, its replication slot, capture's
    /// progress, whether a baseline is owed or capture is blocked, and
    /// the relations still being rematerialized.
    Status {
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Resets the stream (ADR 0012): a new stream generation, every client
    /// cursor and rebuild session stale (clients rebuild), and a new slot and
    /// baseline, which the running server materializes. The way out of a
    /// lost slot or a quarantine nothing can repair. Needs --confirm.
    Reset {
        /// Confirms the reset: every client rebuilds every scope.
        #[arg(long)]
        confirm: bool,
        #[command(flatten)]
        database: DatabaseArgs,
    },
}

#[derive(Subcommand)]
enum ClientAction {
    /// Retires a client irreversibly: every request of it then answers
    /// `409 client_retired`, and its checkpoints, rebuild sessions and push
    /// outcomes are released (ADR 0024). Needs --confirm.
    Retire {
        #[arg(long)]
        client_id: String,
        /// Confirms the retirement: the client ID can never sync again.
        #[arg(long)]
        confirm: bool,
        #[command(flatten)]
        database: DatabaseArgs,
    },
}

/// How long `synchro compact` waits between reading the boundary and
/// moving the floor to at most it: a cursor or rebuild being issued
/// meanwhile is not made stale at once.
const COMPACT_GUARD_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

fn load_config(path: &Path) -> Result<SyncConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    SyncConfig::from_toml(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Token { user, config } => token(&user, &config),
        Command::Stream { action } => run(stream(action)),
        Command::Compact { config, database } => run(compact(&config, database)),
        Command::Client { action } => run(client(action)),
        Command::Serve {
            config,
            listen,
            database_url,
            data_dir,
        } => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "info".into()),
                )
                .init();
            match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(serve(&config, listen, database_url, &data_dir)),
                Err(e) => Err(format!("cannot start the runtime: {e}")),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("synchro: {message}");
            ExitCode::FAILURE
        }
    }
}

fn token(user: &str, config: &Path) -> Result<(), String> {
    let config = load_config(config)?;
    let AuthConfig::Hs256(auth) = &config.auth else {
        return Err("synchro token works only with auth mode hs256".into());
    };
    let secret = hs256_secret(Path::new(hs256_secret_file(auth)))?;
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    println!("{}", dev_token(&secret, user, now, auth)?);
    Ok(())
}

/// Ctrl-C or SIGTERM (what `docker stop` and systemd send): both stop the
/// server gracefully, and with it the embedded cluster.
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

/// The password of a `postgres://user:password@host/db` URL, or `PGPASSWORD`.
fn url_password(database_url: &str) -> Option<String> {
    let from_url = url::Url::parse(database_url).ok().and_then(|u| {
        u.password().map(|p| {
            percent_encoding::percent_decode_str(p)
                .decode_utf8_lossy()
                .into_owned()
        })
    });
    from_url.or_else(|| std::env::var("PGPASSWORD").ok())
}

/// The database's connection options and password, and the embedded
/// cluster when there is no URL (started, or found running; it lives as
/// long as the handle).
async fn open_database(
    database_url: Option<String>,
    data_dir: &Path,
) -> Result<(Option<PgCluster>, PgConnectOptions, Option<String>), String> {
    let mut password = None;
    let (cluster, options) = match database_url {
        Some(url) => {
            // The replication connection of capture needs the password too.
            password = url_password(&url);
            (
                None,
                PgConnectOptions::from_str(&url).map_err(|e| format!("--database-url: {e}"))?,
            )
        }
        None => {
            let dir = data_dir.join("pg");
            let cluster = tokio::task::spawn_blocking(move || PgCluster::start(&dir))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| format!("embedded PostgreSQL: {e}"))?;
            let options = cluster.connect_options("postgres");
            println!(
                "synchro: embedded PostgreSQL at {}",
                cluster.url("postgres")
            );
            (Some(cluster), options)
        }
    };
    Ok((cluster, options, password))
}

/// Watches the embedded cluster: if its postmaster dies, nothing can be
/// served until it is back, so the process exits non-zero at once, with a
/// clear message, for its supervisor to restart it (the next start
/// recovers the cluster).
/// The returned flag, once set, stops the watch: the process is stopping
/// the cluster itself.
fn supervise(alive: impl Fn() -> bool + Send + Sync + 'static) -> Arc<AtomicBool> {
    let alive = Arc::new(alive);
    let stopping = Arc::new(AtomicBool::new(false));
    let flag = stopping.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            let probe = alive.clone();
            let dead = matches!(
                tokio::task::spawn_blocking(move || probe()).await,
                Ok(false)
            );
            if flag.load(Ordering::SeqCst) {
                return;
            }
            if dead {
                eprintln!(
                    "synchro: the embedded PostgreSQL stopped; exiting so that a supervisor \
                     restarts synchro (the next start recovers the cluster)"
                );
                std::process::exit(3);
            }
        }
    });
    stopping
}

/// `synchro stream status` and `synchro stream reset`.
async fn stream(action: StreamAction) -> Result<(), String> {
    let (confirm, database, reset) = match action {
        StreamAction::Status { database } => (false, database, false),
        StreamAction::Reset { confirm, database } => (confirm, database, true),
    };
    if reset && !confirm {
        return Err(
            "a stream reset makes every client rebuild every scope, and drops \
             the replication slot; run it again with --confirm"
                .into(),
        );
    }
    let (_cluster, store) = operator_store(database).await?;
    if reset {
        let generation = store.reset_stream().await.map_err(|e| e.to_string())?;
        println!(
            "synchro: the stream was reset to generation {generation}; the server takes \
             its baseline now (its terminal, its log and GET /ready show the progress)"
        );
        return Ok(());
    }
    let r = store.stream_report().await.map_err(|e| e.to_string())?;
    println!("stream generation: {}", r.generation);
    match &r.slot {
        Some((name, lsn)) => println!(
            "slot: {name}, stream began at {:X}/{:X}, {}",
            lsn >> 32,
            lsn & 0xffff_ffff,
            match r.slot_present.as_deref() {
                None => "missing",
                Some("lost") => "invalidated (its WAL was removed)",
                Some(_) => "present",
            }
        ),
        None => println!("slot: not created yet"),
    }
    println!(
        "baseline: {}",
        if r.baseline_owed {
            "owed (capture has not materialized it)"
        } else {
            "materialized"
        }
    );
    println!(
        "materialized through: {}",
        match r.boundary {
            protocol::position::Boundary::GenerationStart => "generation start".to_owned(),
            protocol::position::Boundary::TransactionEnd { commit_lsn } =>
                format!("{:X}/{:X}", commit_lsn >> 32, commit_lsn & 0xffff_ffff),
        }
    );
    println!("retention floor: {}", position_text(r.floor));
    match &r.quarantine {
        Some(class) => println!("capture: blocked ({class})"),
        None => println!("capture: not blocked"),
    }
    if r.rematerializing.is_empty() {
        println!("rematerializing: nothing");
    }
    for (relation, rows) in &r.rematerializing {
        println!("rematerializing: {relation}, {rows} rows re-read so far");
    }
    Ok(())
}

/// Runs an operator command on a runtime of its own.
fn run(command: impl std::future::Future<Output = Result<(), String>>) -> Result<(), String> {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(command),
        Err(e) => Err(format!("cannot start the runtime: {e}")),
    }
}

/// The stream's database, as `serve` finds it, for an operator command.
async fn operator_store(database: DatabaseArgs) -> Result<(Option<PgCluster>, PgStore), String> {
    let (cluster, options, password) =
        open_database(database.database_url, &database.data_dir).await?;
    let store = PgStore::connect_with_password(options, password.as_deref())
        .await
        .map_err(|e| format!("database: {e}"))?;
    Ok((cluster, store))
}

async fn compact(config_path: &Path, database: DatabaseArgs) -> Result<(), String> {
    use actors::store::{Store, StoreTx};
    let config = load_config(config_path)?;
    let (_cluster, store) = operator_store(database).await?;
    let seen = {
        let mut tx = store.begin().await.map_err(|e| e.to_string())?;
        let generation = tx
            .stream_state()
            .await
            .map_err(|e| e.to_string())?
            .generation;
        let boundary = tx
            .capture_progress()
            .await
            .map_err(|e| e.to_string())?
            .boundary;
        actors::retention::Guard {
            generation,
            boundary,
        }
    };
    tokio::time::sleep(COMPACT_GUARD_WAIT).await;
    let report = |deleted: u64| {
        if deleted > 0 {
            println!("compacting: {deleted} effects deleted");
        }
    };
    let c = actors::retention::compact(&store, &config.retention, Some(seen), report)
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "retention floor: {} ({}); {} effects deleted",
        position_text(c.floor),
        if c.moved { "moved" } else { "unchanged" },
        c.deleted
    );
    Ok(())
}

async fn client(action: ClientAction) -> Result<(), String> {
    use actors::store::{Store, StoreTx};
    let ClientAction::Retire {
        client_id,
        confirm,
        database,
    } = action;
    if !confirm {
        return Err(
            "retiring a client is irreversible: it can never sync again; run it again \
             with --confirm"
                .into(),
        );
    }
    let (_cluster, store) = operator_store(database).await?;
    let mut tx = store.begin().await.map_err(|e| e.to_string())?;
    let found = tx
        .retire_client(&client_id)
        .await
        .map_err(|e| e.to_string())?;
    tx.commit().await.map_err(|e| e.to_string())?;
    if !found {
        return Err("no such client".into());
    }
    println!("synchro: the client is retired");
    Ok(())
}

/// A stream position as an operator reads it.
fn position_text(p: protocol::position::StreamPosition) -> String {
    use protocol::position::StreamPosition;
    let lsn = |l: u64| format!("{:X}/{:X}", l >> 32, l & 0xffff_ffff);
    match p {
        StreamPosition::GenerationStart => "generation start".into(),
        StreamPosition::TransactionEnd { commit_lsn } => format!("end of {}", lsn(commit_lsn)),
        StreamPosition::Effect {
            commit_lsn,
            event_ordinal,
            effect_ordinal,
        } => format!(
            "{} event {event_ordinal} effect {effect_ordinal}",
            lsn(commit_lsn)
        ),
    }
}

async fn serve(
    config_path: &Path,
    listen: SocketAddr,
    database_url: Option<String>,
    data_dir: &Path,
) -> Result<(), String> {
    let config = load_config(config_path)?;
    // The embedded cluster lives as long as this function; dropping it stops
    // PostgreSQL, also one a crashed process left running (taken over).
    let (mut cluster, options, password) = open_database(database_url, data_dir).await?;
    let supervised = cluster.as_mut().map(|c| {
        c.take_over();
        supervise(c.probe())
    });
    let store = PgStore::connect_with_password(options, password.as_deref())
        .await
        .map_err(|e| format!("database: {e}"))?;
    catalog::check_server(store.pool())
        .await
        .map_err(|p| format!("the database is not ready:\n  {}", p.join("\n  ")))?;
    if let Some(sql) = &config.server.bootstrap_sql {
        let path = config_path.parent().unwrap_or(Path::new(".")).join(sql);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("bootstrap_sql {}: {e}", path.display()))?;
        sqlx::raw_sql(&text)
            .execute(store.pool())
            .await
            .map_err(|e| format!("bootstrap_sql {}: {e}", path.display()))?;
    }
    catalog::validate(store.pool(), &config)
        .await
        .map_err(|p| {
            format!(
                "the config does not match the database:\n  {}",
                p.join("\n  ")
            )
        })?;
    let auth = Authenticator::from_config(&config.auth).await?;
    let engine = Engine::start(store, config.clone())
        .await
        .map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| format!("{listen}: {e}"))?;
    println!(
        "synchro: listening on http://{}",
        listener.local_addr().map_err(|e| e.to_string())?
    );
    if let AuthConfig::Hs256(_) = config.auth {
        println!(
            "synchro: get a dev token with: cargo run -p server -- token --user <user-id> --config {}",
            config_path.display()
        );
    }
    server::progress::draw_on_terminal(engine.clone());
    let app = router(AppState::new(engine, Arc::new(auth), &config.server));
    server::listener::serve(
        listener,
        app,
        HttpLimits::of(&config.server),
        shutdown_signal(),
    )
    .await;
    // The cluster stops when this returns: that is no death to report.
    if let Some(stopping) = supervised {
        stopping.store(true, Ordering::SeqCst);
    }
    Ok(())
}
