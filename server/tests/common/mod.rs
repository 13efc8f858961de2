//! What the server's HTTP tests share.
#![allow(clippy::unwrap_used)] // tests fail loudly

use std::net::SocketAddr;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

/// One HTTP/1.1 request; the status, headers and body.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> (u16, hyper::HeaderMap, Vec<u8>) {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let response = sender
        .send_request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, headers, body)
}

/// Spawns `synchro serve` with `args` (stdout piped, stderr as `stderr`
/// says) and waits for the address it prints; its output is drained after.
#[allow(dead_code)] // not every test binary spawns the server
pub fn spawn_serve(
    args: &[&std::ffi::OsStr],
    stderr: std::process::Stdio,
) -> (std::process::Child, SocketAddr) {
    let (child, addr, _) = spawn_serve_lines(args, stderr);
    (child, addr)
}

/// `spawn_serve`, also returning the lines printed before the address.
#[allow(dead_code)] // not every test binary spawns the server
pub fn spawn_serve_lines(
    args: &[&std::ffi::OsStr],
    stderr: std::process::Stdio,
) -> (std::process::Child, SocketAddr, Vec<String>) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_synchro"))
        .arg("serve")
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut before = Vec::new();
    let addr = loop {
        let line = lines
            .next()
            .expect("the server printed its address")
            .unwrap();
        if let Some(a) = line.strip_prefix("synchro: listening on http://") {
            break a.parse().unwrap();
        }
        before.push(line);
    };
    // Keep draining stdout so the process never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (child, addr, before)
}

/// `synchro serve` on loopback with `dir/config.toml` and `dir/data`: on
/// `database_url` when given, else on its embedded cluster. Its address.
#[allow(dead_code)] // not every test binary spawns the server
pub fn serve_dir(
    dir: &std::path::Path,
    database_url: Option<&str>,
    stderr: std::process::Stdio,
) -> (std::process::Child, SocketAddr) {
    use std::ffi::OsStr;
    let (config, data) = (dir.join("config.toml"), dir.join("data"));
    let mut args: Vec<&OsStr> = vec![OsStr::new("--listen"), OsStr::new("127.0.0.1:0")];
    if let Some(url) = database_url {
        args.extend([OsStr::new("--database-url"), OsStr::new(url)]);
    }
    args.extend([
        OsStr::new("--config"),
        config.as_os_str(),
        OsStr::new("--data-dir"),
        data.as_os_str(),
    ]);
    spawn_serve(&args, stderr)
}

/// A database `name` on `cluster` for `synchro serve`: a directory with the
/// example's config (trusted upstream header `x-user`, fast heartbeats so
/// that readiness follows within a second) and schema, the database's URL,
/// and a pool on it.
#[allow(dead_code)] // not every test binary spawns the server
pub async fn upstream_setup(
    cluster: &store_pg::cluster::PgCluster,
    name: &str,
) -> (tempfile::TempDir, String, sqlx::PgPool) {
    cluster.create_database(name).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = actors::testkit::EXAMPLE_CONFIG
        .replace(
            "mode = \"hs256\"\nsecret_file = \".synchro/hs256.secret\"",
            "mode = \"upstream\"\nheader = \"x-user\"",
        )
        .replace(
            "[auth]",
            "[capture]\nheartbeat_ms = 100\nmax_heartbeat_age_ms = 2000\n\n[auth]",
        );
    std::fs::write(dir.path().join("config.toml"), config).unwrap();
    std::fs::write(
        dir.path().join("schema.sql"),
        include_str!("../../../examples/notes/schema.sql"),
    )
    .unwrap();
    let pool = sqlx::PgPool::connect_with(cluster.connect_options(name))
        .await
        .unwrap();
    (dir, cluster.url(name), pool)
}
