//! A private PostgreSQL cluster from the machine's binaries: `initdb` into a
//! directory, `pg_ctl start` with logical decoding on, stop on drop. Used by
//! `synchro serve` without `--database-url` and by every test that needs
//! PostgreSQL; nothing here touches a machine-wide service.
//!
//! The server listens only on a Unix socket inside the data directory
//! (mode 0700), so trust authentication is reachable only by the directory's
//! owner (and root). `initdb` and `postgres` refuse to run as root; as root,
//! both run as the `postgres` user through `setpriv`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use sqlx::postgres::PgConnectOptions;

/// The socket's port number (only names the socket file; nothing listens on TCP).
const PORT: u16 = 5432;

/// Why the cluster could not be started.
#[derive(Debug)]
pub struct ClusterError(pub String);

impl fmt::Display for ClusterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ClusterError {}

/// A running private cluster; stopped when dropped (unless it was already running).
pub struct PgCluster {
    dir: PathBuf,
    bin: PathBuf,
    run_as_postgres: bool,
    owned: bool,
    _temp: Option<tempfile::TempDir>,
}

fn fail(msg: impl Into<String>) -> ClusterError {
    ClusterError(msg.into())
}

/// The directory of the newest installed PostgreSQL's binaries.
fn find_bin_dir() -> Result<PathBuf, ClusterError> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("pg_ctl").exists().then_some((major, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }
    let out = Command::new("pg_config").arg("--bindir").output();
    match out {
        Ok(o) if o.status.success() => Ok(PathBuf::from(String::from_utf8_lossy(&o.stdout).trim())),
        _ => Err(fail(
            "no PostgreSQL binaries found under /usr/lib/postgresql/*/bin or via pg_config; \
             install them (Debian: apt-get install postgresql)",
        )),
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

impl PgCluster {
    /// Starts (creating if needed) the cluster in `dir`.
    pub fn start(dir: &Path) -> Result<PgCluster, ClusterError> {
        Self::start_with(dir, None, false)
    }

    /// A throwaway cluster in a new temporary directory, tuned for tests (fsync off).
    pub fn temp() -> Result<PgCluster, ClusterError> {
        let temp = tempfile::Builder::new()
            .prefix("synchro-pg-")
            .tempdir()
            .map_err(|e| fail(format!("cannot create a temporary directory: {e}")))?;
        let dir = temp.path().join("data");
        Self::start_with(&dir, Some(temp), true)
    }

    fn start_with(
        dir: &Path,
        temp: Option<tempfile::TempDir>,
        for_tests: bool,
    ) -> Result<PgCluster, ClusterError> {
        let bin = find_bin_dir()?;
        let run_as_postgres = is_root();
        std::fs::create_dir_all(dir)
            .map_err(|e| fail(format!("cannot create {}: {e}", dir.display())))?;
        let dir = dir
            .canonicalize()
            .map_err(|e| fail(format!("cannot resolve {}: {e}", dir.display())))?;
        if run_as_postgres {
            if let Some(t) = &temp {
                run(
                    Command::new("chown")
                        .args(["postgres:postgres"])
                        .arg(t.path()),
                    "chown",
                )?;
            }
            run(
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&dir),
                "chown",
            )?;
        }
        let mut cluster = PgCluster {
            dir,
            bin,
            run_as_postgres,
            owned: true,
            _temp: temp,
        };
        if !cluster.dir.join("PG_VERSION").exists() {
            let mut initdb = cluster.command("initdb");
            initdb.arg("-D").arg(&cluster.dir).args([
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-instructions",
            ]);
            run(&mut initdb, "initdb")?;
        }
        if cluster.running() {
            cluster.owned = false; // someone else started it; leave it running
            return Ok(cluster);
        }
        let socket_dir = cluster.dir.display().to_string();
        let mut options = format!(
            "-c listen_addresses='' -c unix_socket_directories='{socket_dir}' -c port={PORT} \
             -c wal_level=logical -c max_replication_slots=16 -c max_wal_senders=16 \
             -c synchronous_commit=on"
        );
        if for_tests {
            // Every test database runs its own capture (a slot, a walsender,
            // a leader connection): room for many at once.
            options.push_str(
                " -c fsync=off -c full_page_writes=off -c max_connections=300 \
                 -c max_replication_slots=64 -c max_wal_senders=64",
            );
        }
        let mut start = cluster.command("pg_ctl");
        start
            .arg("-D")
            .arg(&cluster.dir)
            .arg("-l")
            .arg(cluster.dir.join("server.log"))
            .args(["-w", "-t", "60", "-o", &options, "start"]);
        run(&mut start, "pg_ctl start")?;
        Ok(cluster)
    }

    fn command(&self, program: &str) -> Command {
        command_in(&self.bin, self.run_as_postgres, program)
    }

    fn running(&self) -> bool {
        self.probe()()
    }

    /// A check of whether the cluster's postmaster is alive, for a
    /// supervisor to call from anywhere (it runs `pg_ctl status`).
    pub fn probe(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        let (bin, dir, as_postgres) = (self.bin.clone(), self.dir.clone(), self.run_as_postgres);
        move || {
            command_in(&bin, as_postgres, "pg_ctl")
                .arg("-D")
                .arg(&dir)
                .arg("status")
                .output()
                .is_ok_and(|o| o.status.success())
        }
    }

    /// Takes over a cluster found running (its server process crashed and
    /// left it): this handle stops it when dropped, as if it had started it.
    pub fn take_over(&mut self) {
        self.owned = true;
    }

    /// Connection options for `database` over the private socket.
    pub fn connect_options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .socket(&self.dir)
            .port(PORT)
            .username("postgres")
            .database(database)
    }

    /// Creates database `name` (owned by `postgres`) and returns its connection options.
    pub async fn create_database(&self, name: &str) -> Result<PgConnectOptions, ClusterError> {
        use sqlx::Connection as _;
        if !actors::config::is_identifier(name) {
            return Err(fail(format!(
                "database name `{name}` is not a plain identifier"
            )));
        }
        let mut c = sqlx::PgConnection::connect_with(&self.connect_options("postgres"))
            .await
            .map_err(|e| fail(format!("cannot connect to the cluster: {e}")))?;
        sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut c)
            .await
            .map_err(|e| fail(format!("cannot create database {name}: {e}")))?;
        Ok(self.connect_options(name))
    }

    /// A URL for humans and `psql` (credentials are trust-only, so none are in it).
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@localhost/{database}?host={}&port={PORT}",
            self.dir.display()
        )
    }

    /// The data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops the cluster (fast shutdown).
    pub fn stop(&self) {
        // A throwaway cluster needs no clean shutdown; `fast` would also wait
        // for logical walsenders whose client may be blocked by this very call.
        let mode = if self._temp.is_some() {
            "immediate"
        } else {
            "fast"
        };
        let mut stop = self.command("pg_ctl");
        stop.arg("-D")
            .arg(&self.dir)
            .args(["-m", mode, "-w", "stop"]);
        let _ = stop.output();
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.owned {
            self.stop();
        }
    }
}

/// `program` of the PostgreSQL binaries, run as `postgres` when we are root.
fn command_in(bin: &Path, as_postgres: bool, program: &str) -> Command {
    let path = bin.join(program);
    if as_postgres {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=postgres", "--regid=postgres", "--init-groups"])
            .arg(path);
        c
    } else {
        Command::new(path)
    }
}

fn run(c: &mut Command, what: &str) -> Result<(), ClusterError> {
    let out = c
        .output()
        .map_err(|e| fail(format!("{what}: cannot run: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(fail(format!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}
