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
use store_pg::operator::StreamReport;
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
        /// Serves Prometheus metrics at GET /metrics on this address (off
        /// unless given); keep it private.
        #[arg(long)]
        metrics_listen: Option<SocketAddr>,
        /// How log lines are written: `text` for people, `json` for log pipelines.
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
        /// Starts with a config that a newer one replaced, on purpose (a
        /// rollback). Without it such a config is refused: it is what a
        /// process of an older deploy would bring back.
        #[arg(long)]
        roll_back: bool,
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
    /// Operator actions on the token key ring (ADR 0025).
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
    /// A quarantined (poison) transaction that blocks capture: show it, and
    /// retry it once its cause is repaired.
    Quarantine {
        #[command(subcommand)]
        action: QuarantineAction,
    },
    /// Prints a bearer token for USER that a local server (auth mode hs256) accepts.
    Token {
        #[arg(long)]
        user: String,
        #[arg(long, default_value = "synchro.toml")]
        config: PathBuf,
    },
}

/// How `serve` writes its log.
#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
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
        /// Prints one JSON object instead of lines for people.
        #[arg(long)]
        json: bool,
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
    /// Lists the clients of a user (at most 1,000), one line each.
    List {
        #[arg(long)]
        user: String,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Shows one client: generation, schema, scopes, checkpoints, rebuild
    /// sessions and the push outcomes kept for it.
    Show {
        #[arg(long)]
        client_id: String,
        #[command(flatten)]
        database: DatabaseArgs,
    },
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

#[derive(Subcommand)]
enum KeysAction {
    /// Lists the token keys: ID, kind and state (never a secret).
    List {
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// A new active key for cursors and for continuations; the old ones
    /// verify only, so no token issued before becomes invalid. Running
    /// servers take the new keys within 10 seconds. Needs --confirm.
    Rotate {
        #[arg(long)]
        confirm: bool,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Deletes a verify-only key: every cursor and continuation issued
    /// under it is then refused (`400 invalid_request`), so retire a key
    /// only a retention window after the rotation (docs/OPERATIONS.md).
    /// Needs --confirm.
    Retire {
        #[arg(long)]
        key_id: String,
        #[arg(long)]
        confirm: bool,
        #[command(flatten)]
        database: DatabaseArgs,
    },
}

#[derive(Subcommand)]
enum QuarantineAction {
    /// Shows what blocks capture, if anything.
    Show {
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Forgets the quarantine, so that capture's next attempt (every
    /// `[capture] retry_ms`) is judged afresh, and waits for its outcome.
    /// Needs --confirm.
    Retry {
        #[arg(long)]
        confirm: bool,
        #[command(flatten)]
        database: DatabaseArgs,
    },
}

/// How long `synchro quarantine retry` watches for capture's next attempt.
const RETRY_WATCH: std::time::Duration = std::time::Duration::from_secs(30);

/// A quarantine not recorded again within this long after a retry counts
/// as repaired, even when no transaction has committed since.
const RETRY_QUIET: std::time::Duration = std::time::Duration::from_secs(10);

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
        Command::Keys { action } => run(keys(action)),
        Command::Quarantine { action } => run(quarantine(action)),
        Command::Serve {
            config,
            listen,
            database_url,
            data_dir,
            metrics_listen,
            log_format,
            roll_back,
        } => {
            let filter = tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info".into());
            let log = tracing_subscriber::fmt().with_env_filter(filter);
            match log_format {
                LogFormat::Text => log.init(),
                LogFormat::Json => log.json().init(),
            }
            let listeners = Listeners {
                sync: listen,
                metrics: metrics_listen,
            };
            match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(serve(
                    &config,
                    listeners,
                    database_url,
                    &data_dir,
                    roll_back,
                )),
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
    let (confirm, database, reset, json) = match action {
        StreamAction::Status { json, database } => (false, database, false, json),
        StreamAction::Reset { confirm, database } => (confirm, database, true, false),
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
    if json {
        println!("{}", status_json(&r));
    } else {
        print_status(&r);
    }
    Ok(())
}

fn lsn_text(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

fn boundary_text(b: protocol::position::Boundary) -> String {
    match b {
        protocol::position::Boundary::GenerationStart => "generation start".to_owned(),
        protocol::position::Boundary::TransactionEnd { commit_lsn } => lsn_text(commit_lsn),
    }
}

fn slot_state(r: &StreamReport) -> &'static str {
    match (&r.slot, r.slot_present.as_deref()) {
        (None, _) => "not_created",
        (Some(_), None) => "missing",
        (Some(_), Some("lost")) => "lost",
        (Some(_), Some(_)) => "present",
    }
}

/// `synchro stream status` for people.
fn print_status(r: &StreamReport) {
    println!("stream generation: {}", r.generation);
    match &r.slot {
        Some((name, lsn)) => println!(
            "slot: {name}, stream began at {}, {}",
            lsn_text(*lsn),
            match slot_state(r) {
                "missing" => "missing",
                "lost" => "invalidated (its WAL was removed)",
                _ => "present",
            }
        ),
        None => println!("slot: not created yet"),
    }
    if let Some(wal) = &r.wal {
        println!(
            "slot holds: {} bytes of WAL ({} bytes not yet confirmed by capture)",
            wal.retained_bytes, wal.unconfirmed_bytes
        );
    }
    println!(
        "baseline: {}",
        if r.baseline_owed {
            "owed (capture has not materialized it)"
        } else {
            "materialized"
        }
    );
    println!("materialized through: {}", boundary_text(r.boundary));
    match (r.health.heartbeat_age, r.health.caught_up_age) {
        (None, _) => println!("capture lag: no heartbeat yet"),
        (Some(beat), caught_up) => println!(
            "capture lag: {}; last heartbeat {:.1} s ago",
            caught_up.map_or("never caught up".to_owned(), |a| format!(
                "caught up {:.1} s ago",
                a.as_secs_f64()
            )),
            beat.as_secs_f64()
        ),
    }
    println!("retention floor: {}", position_text(r.floor));
    match &r.quarantine {
        Some(class) => println!("capture: blocked ({class})"),
        None => println!("capture: not blocked"),
    }
    if r.rematerializing.is_empty() {
        println!("rematerializing: nothing");
    }
    for m in &r.rematerializing {
        match m.estimated_rows {
            Some(of) => println!(
                "rematerializing: {}, {} rows re-read so far of about {of}",
                m.relation, m.rows
            ),
            None => println!(
                "rematerializing: {}, {} rows re-read so far",
                m.relation, m.rows
            ),
        }
    }
    println!("rebuild sessions: {}", r.rebuild_sessions);
}

/// `synchro stream status --json`: the same facts, with stable member names.
fn status_json(r: &StreamReport) -> serde_json::Value {
    let seconds = |d: Option<std::time::Duration>| d.map(|d| d.as_secs_f64());
    serde_json::json!({
        "stream_generation": r.generation,
        "slot": {
            "name": r.slot.as_ref().map(|s| s.0.clone()),
            "stream_start_lsn": r.slot.as_ref().map(|s| lsn_text(s.1)),
            "state": slot_state(r),
            "retained_wal_bytes": r.wal.map(|w| w.retained_bytes),
            "unconfirmed_wal_bytes": r.wal.map(|w| w.unconfirmed_bytes),
        },
        "baseline_owed": r.baseline_owed,
        "materialized_through": boundary_text(r.boundary),
        "capture": {
            "blocked": r.quarantine,
            "heartbeat_age_seconds": seconds(r.health.heartbeat_age),
            "lag_seconds": seconds(r.health.caught_up_age),
            "lag_bytes": r.health.lag_bytes,
        },
        "retention_floor": position_text(r.floor),
        "rematerializing": r.rematerializing.iter()
            .map(|m| serde_json::json!({
                "relation": m.relation,
                "rows_reread": m.rows,
                "estimated_rows": m.estimated_rows,
            }))
            .collect::<Vec<_>>(),
        "rebuild_sessions": r.rebuild_sessions,
    })
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
    let (client_id, confirm, database) = match action {
        ClientAction::List { user, database } => {
            let (_cluster, store) = operator_store(database).await?;
            let clients = store.clients_of(&user).await.map_err(|e| e.to_string())?;
            if clients.is_empty() {
                println!("no clients");
            }
            for c in &clients {
                println!("{}", client_line(c));
            }
            return Ok(());
        }
        ClientAction::Show {
            client_id,
            database,
        } => {
            let (_cluster, store) = operator_store(database).await?;
            let Some(c) = store
                .client_report(&client_id)
                .await
                .map_err(|e| e.to_string())?
            else {
                return Err("no such client".into());
            };
            print_client(&c);
            return Ok(());
        }
        ClientAction::Retire {
            client_id,
            confirm,
            database,
        } => (client_id, confirm, database),
    };
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

async fn keys(action: KeysAction) -> Result<(), String> {
    use actors::store::{Store, StoreTx};
    let print = |keys: &[protocol::token::TokenKey]| {
        for k in keys {
            println!(
                "{}  {}  {}",
                k.key_id,
                match k.kind {
                    protocol::token::TokenKind::IncrementalCursor => "cursor",
                    protocol::token::TokenKind::RebuildContinuation => "continuation",
                },
                match k.state {
                    protocol::token::KeyState::Active => "active",
                    protocol::token::KeyState::VerifyOnly => "verify-only",
                }
            );
        }
    };
    let stored = |store: PgStore| async move {
        let mut tx = store.begin().await.map_err(|e| e.to_string())?;
        let keys = tx.token_keys().await.map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        Ok::<_, String>(keys)
    };
    match action {
        KeysAction::List { database } => {
            let (_cluster, store) = operator_store(database).await?;
            print(&stored(store).await?);
        }
        KeysAction::Rotate { confirm, database } => {
            if !confirm {
                return Err("rotating makes new keys active on every server within 10 \
                            seconds; run it again with --confirm"
                    .into());
            }
            let (_cluster, store) = operator_store(database).await?;
            actors::key_ring::rotate(&store)
                .await
                .map_err(|e| e.to_string())?;
            println!("synchro: the token keys were rotated");
            print(&stored(store).await?);
        }
        KeysAction::Retire {
            key_id,
            confirm,
            database,
        } => {
            if !confirm {
                return Err(
                    "every token issued under a retired key is refused from then \
                            on; run it again with --confirm"
                        .into(),
                );
            }
            let (_cluster, store) = operator_store(database).await?;
            let mut tx = store.begin().await.map_err(|e| e.to_string())?;
            let dropped = tx
                .drop_token_key(&key_id)
                .await
                .map_err(|e| e.to_string())?;
            tx.commit().await.map_err(|e| e.to_string())?;
            if !dropped {
                return Err("no such verify-only key (an active key is never retired; \
                            rotate first)"
                    .into());
            }
            println!("synchro: the key is retired");
        }
    }
    Ok(())
}

async fn quarantine(action: QuarantineAction) -> Result<(), String> {
    let (confirm, database, retry) = match action {
        QuarantineAction::Show { database } => (false, database, false),
        QuarantineAction::Retry { confirm, database } => (confirm, database, true),
    };
    if retry && !confirm {
        return Err("run it again with --confirm once the cause is repaired".into());
    }
    let (_cluster, store) = operator_store(database).await?;
    let report = store.stream_report().await.map_err(|e| e.to_string())?;
    let (Some(class), Some(lsn)) = (&report.quarantine, report.quarantine_lsn) else {
        println!("capture: not blocked");
        return Ok(());
    };
    println!("capture: blocked ({class}) at {}", lsn_text(lsn));
    println!("what it means: {}", quarantine_advice(class));
    if !retry {
        return Ok(());
    }
    store.clear_quarantine().await.map_err(|e| e.to_string())?;
    println!("synchro: quarantine cleared; watching capture's next attempt");
    let start = std::time::Instant::now();
    while start.elapsed() < RETRY_WATCH {
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        let r = store.stream_report().await.map_err(|e| e.to_string())?;
        if let Some(again) = &r.quarantine {
            return Err(format!("capture is blocked again ({again})"));
        }
        let passed = match r.boundary {
            protocol::position::Boundary::TransactionEnd { commit_lsn } => commit_lsn >= lsn,
            protocol::position::Boundary::GenerationStart => false,
        };
        if passed || start.elapsed() >= RETRY_QUIET {
            println!(
                "synchro: capture resumed; materialized through {}",
                boundary_text(r.boundary)
            );
            return Ok(());
        }
    }
    Err("no capture leader attempted it: is synchro serve running?".into())
}

/// What an operator does about a quarantine of `class` (docs/OPERATIONS.md).
fn quarantine_advice(class: &str) -> &'static str {
    match class {
        "slot_lost" => {
            "the replication slot is gone or invalidated; only `synchro stream reset` recovers"
        }
        "capture_disabled" => {
            "a capture trigger is missing or disabled; restart synchro serve to reinstall it"
        }
        "column_missing" | "column_retyped" => {
            "a mapped column was dropped, renamed or retyped; restore it or change the config"
        }
        "truncate" | "relation_drift" => {
            "a captured table was truncated, renamed or recreated; a stream reset recovers"
        }
        _ => {
            "a source transaction cannot be materialized; repair its cause, then retry \
             (docs/OPERATIONS.md)"
        }
    }
}

/// One line of `synchro client list`.
fn client_line(c: &store_pg::operator::ClientReport) -> String {
    format!(
        "{}  generation {}  {}  {} scopes  last acknowledged {}",
        c.client_id,
        c.generation,
        if c.retired { "retired" } else { "active" },
        c.assigned_scopes,
        acknowledged_text(c.last_acknowledged)
    )
}

fn acknowledged_text(at: Option<i64>) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    at.map_or("never".into(), |t| format!("{} s ago", (now - t).max(0)))
}

/// `synchro client show`.
fn print_client(c: &store_pg::operator::ClientReport) {
    println!("client: {}", c.client_id);
    println!("user: {}", c.user_id);
    println!("generation: {}", c.generation);
    println!("retired: {}", if c.retired { "yes" } else { "no" });
    println!(
        "installed schema version: {}",
        c.schema_version
            .map_or("none declared yet".into(), |v| v.to_string())
    );
    println!(
        "scope set version: {}, {} scopes assigned",
        c.scope_set_version, c.assigned_scopes
    );
    println!(
        "checkpoints: {} scopes, last acknowledged {}",
        c.checkpoints,
        acknowledged_text(c.last_acknowledged)
    );
    println!("rebuild sessions: {}", c.rebuild_sessions);
    println!(
        "push outcomes kept: {} batches, {} mutations",
        c.push_batches, c.push_mutations
    );
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

/// Where `serve` listens: the sync endpoints, and `/metrics` when asked.
struct Listeners {
    sync: SocketAddr,
    metrics: Option<SocketAddr>,
}

async fn serve(
    config_path: &Path,
    listen: Listeners,
    database_url: Option<String>,
    data_dir: &Path,
    roll_back: bool,
) -> Result<(), String> {
    let mut config = load_config(config_path)?;
    config.roll_back = roll_back;
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
    // The requests' pool at its configured size; capture keeps its own.
    // The pool that set the database up closes its connections.
    let sized = store.with_connections(config.server.database_connections);
    store.pool().close().await;
    let store = sized;
    let auth = Authenticator::from_config(&config.auth).await?;
    let engine = Engine::start(store.clone(), config.clone())
        .await
        .map_err(|e| e.to_string())?;
    let mut state = AppState::new(engine.clone(), Arc::new(auth), &config.server);
    if let Some(addr) = listen.metrics {
        let metrics = Arc::new(server::metrics::Metrics::new().map_err(|e| e.to_string())?);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("{addr}: {e}"))?;
        println!(
            "synchro: metrics at http://{}/metrics",
            listener.local_addr().map_err(|e| e.to_string())?
        );
        let app = server::metrics::router(server::metrics::MetricsState {
            metrics: metrics.clone(),
            engine: engine.clone(),
            store,
        });
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "the metrics listener stopped");
            }
        });
        state = state.with_metrics(metrics);
    }
    let listener = tokio::net::TcpListener::bind(listen.sync)
        .await
        .map_err(|e| format!("{}: {e}", listen.sync))?;
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
    let app = router(state);
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
