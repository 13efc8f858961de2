//! A `synchro serve` process for a bench: its own memory is the server's alone.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a load tool fails loudly

/// A `synchro serve` process on the bench's database, with the bench's
/// HS256 secret; killed when dropped.
pub struct Served {
    pub child: std::process::Child,
    #[allow(dead_code)] // not every bench talks to it
    pub addr: std::net::SocketAddr,
    _dir: tempfile::TempDir,
}

impl Served {
    #[allow(dead_code)] // the baseline bench starts with an edited config
    pub async fn start(database_url: &str, secret_file: &str) -> Served {
        Served::start_with(database_url, secret_file, |c| c).await
    }

    /// [`Served::start`] with the config `edit` makes of the example's.
    pub async fn start_with(
        database_url: &str,
        secret_file: &str,
        edit: impl Fn(String) -> String,
    ) -> Served {
        use std::io::BufRead;
        let dir = tempfile::tempdir().unwrap();
        let config = actors::testkit::push_config_toml(actors::testkit::EXAMPLE_CONFIG.to_owned())
            .replace(".synchro/hs256.secret", secret_file)
            .replace("bootstrap_sql = \"schema.sql\"\n", "");
        let config = edit(config);
        // Limits to try, in TOML (`a = 1; b = 2`), above the defaults.
        let config = match std::env::var("SYNCHRO_LOAD_LIMITS") {
            Ok(limits) => config.replace(
                "[server]",
                &format!("[limits]\n{}\n\n[server]", limits.replace(';', "\n")),
            ),
            Err(_) => config,
        };
        std::fs::write(dir.path().join("config.toml"), config).unwrap();
        // `SYNCHRO_BENCH_METRICS=1`: /metrics on, scraped every second
        // (Prometheus scrapes every 15 s), to measure what it costs.
        let metrics = std::env::var("SYNCHRO_BENCH_METRICS").is_ok_and(|v| v == "1");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_synchro"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--database-url",
                database_url,
            ])
            .args(if metrics {
                &["--metrics-listen", "127.0.0.1:0"][..]
            } else {
                &[]
            })
            .arg("--config")
            .arg(dir.path().join("config.toml"))
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("the server printed its address")
                .unwrap();
            if let Some(a) = line.strip_prefix("synchro: listening on http://") {
                break a.parse().unwrap();
            }
            if let Some(m) = line
                .strip_prefix("synchro: metrics at http://")
                .and_then(|l| l.strip_suffix("/metrics"))
            {
                scrape_every_second(m.parse().unwrap());
            }
        };
        // Keep reading what it prints, so that it never writes to a closed pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Served {
            child,
            addr,
            _dir: dir,
        }
    }
}

/// Scrapes `GET /metrics` at `addr` every second while the bench runs.
fn scrape_every_second(addr: std::net::SocketAddr) {
    use std::io::{Read, Write};
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
            let Ok(mut s) = std::net::TcpStream::connect(addr) else {
                return; // the server is gone
            };
            let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
            let _ = s.read_to_end(&mut Vec::new());
        }
    });
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
