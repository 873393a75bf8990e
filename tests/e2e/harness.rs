//! Starts a server per backend and speaks plain HTTP/1.1 to it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use actix_web::{App, HttpServer, web};
use engram_server::{Config, build_state, configure_app};
use serde_json::Value;

pub const ADMIN: &str = "test-admin-key-0123456789";

static N: AtomicUsize = AtomicUsize::new(0);

pub fn model_path() -> PathBuf {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(p.is_file(), "{} is missing: run `make models`", p.display());
    p
}

fn pg_admin_url() -> String {
    std::env::var("ENGRAM_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A name no other test process of this run or an earlier one has used: the process id alone
/// repeats across runs on a machine whose temp dir outlives them (a CI runner).
fn tag() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{}_{}_{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A fresh SQLite database URL.
/// The address in the service's "serving on http://ADDR" log line (text or JSON), if `line` is
/// that line.
pub fn served_at(line: &str) -> Option<SocketAddr> {
    let rest = line.split("serving on http://").nth(1)?;
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '"')
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

pub fn sqlite_url() -> String {
    let dir = std::env::temp_dir().join(format!("engram-e2e-{}", tag()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    format!("sqlite://{}/engram.db?mode=rwc", dir.display())
}

/// A database URL of each backend, fresh.
pub fn database_urls() -> Vec<String> {
    let sqlite = sqlite_url();
    let tag = tag();
    let db = format!("engram_e2e_{tag}");
    let admin = pg_admin_url();
    let status = std::process::Command::new("psql")
        .args([&admin, "-qc", &format!("DROP DATABASE IF EXISTS {db}")])
        .status();
    let created = std::process::Command::new("psql")
        .args([&admin, "-qc", &format!("CREATE DATABASE {db}")])
        .status();
    assert!(
        status.is_ok_and(|s| s.success()) && created.is_ok_and(|s| s.success()),
        "PostgreSQL at {admin} (psql) is required"
    );
    let pg = format!("{}/{db}", &admin[..admin.rfind('/').unwrap()]);
    vec![sqlite, pg]
}

pub fn embedder_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/all-MiniLM-L6-v2")
}

/// A fresh directory for a server's vector index.
pub fn vector_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("engram-e2e-vectors-{}", tag()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The configuration [`Server::start`] serves: the test model and embedder, small tiers.
pub fn test_config(database_url: &str, body_limit: usize) -> Config {
    let mut config = Config::default();
    config.database.url = database_url.to_string();
    config.auth.admin_key.0 = ADMIN.into();
    config.model.path = model_path();
    config.model.hot_mib = Some(256);
    config.model.cold_mib = Some(256);
    config.server.body_limit_bytes = body_limit;
    config.memory.embedder_path = embedder_path();
    config.memory.vector_dir = vector_dir();
    // `ENGRAM__MODEL__RELOCATE_SEGMENTS=true` runs the suite with relocated segment reuse on
    // (issue 26), in these servers as in the child processes that read it themselves.
    config.model.relocate_segments =
        std::env::var("ENGRAM__MODEL__RELOCATE_SEGMENTS").is_ok_and(|v| v == "true");
    config
}

/// A running server.
pub struct Server {
    pub addr: SocketAddr,
    handle: Option<actix_web::dev::ServerHandle>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    pub fn start(database_url: &str, body_limit: usize) -> Self {
        Self::start_with(test_config(database_url, body_limit))
    }

    /// Serves `config` as is.
    pub fn start_with(config: Config) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let state = web::Data::new(build_state(config).await.unwrap());
                let server =
                    HttpServer::new(move || App::new().configure(configure_app(state.clone())))
                        .workers(2)
                        .bind(("127.0.0.1", 0))
                        .unwrap();
                let addr = server.addrs()[0];
                let server = server.run();
                tx.send((addr, server.handle())).unwrap();
                server.await.unwrap();
            });
        });
        let (addr, handle) = rx.recv().unwrap();
        Self {
            addr,
            handle: Some(handle),
            thread: Some(thread),
        }
    }

    /// A server started elsewhere (a child process).
    pub fn at(addr: SocketAddr) -> Self {
        Self {
            addr,
            handle: None,
            thread: None,
        }
    }

    /// Stops the server and waits until its state (database pool, engine, vector index) is
    /// dropped, as a process exit would.
    pub fn stop(mut self) {
        if let Some(h) = self.handle.take() {
            actix_web::rt::System::new().block_on(h.stop(true));
        }
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }

    /// Sends a request; returns the status and the body.
    pub fn raw(&self, method: &str, path: &str, key: Option<&str>, body: &[u8]) -> (u16, Vec<u8>) {
        let (status, _, body) = self.raw_full(method, path, key, body);
        (status, body)
    }

    /// Sends a request; returns the status, the response head (lower-cased) and the body.
    pub fn raw_full(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: &[u8],
    ) -> (u16, String, Vec<u8>) {
        self.raw_with(method, path, key, &[], body)
    }

    /// [`Server::raw_full`] with more request headers.
    pub fn raw_with(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u16, String, Vec<u8>) {
        let mut s = TcpStream::connect(self.addr).unwrap();
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        );
        if let Some(k) = key {
            head.push_str(&format!("authorization: Bearer {k}\r\n"));
        }
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).unwrap();
        // A server may answer (a 413, say) and close before it has read the whole body.
        let _ = s.write_all(body);
        let mut out = Vec::new();
        let mut buf = [0u8; 64 * 1024];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
        let split = out.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let status_line = String::from_utf8_lossy(&out[..split]).to_string();
        let status: u16 = status_line.split(' ').nth(1).unwrap().parse().unwrap();
        let mut body = out[split + 4..].to_vec();
        let head = status_line.to_lowercase();
        if head.contains("transfer-encoding: chunked") {
            body = dechunk(&body);
        }
        (status, head, body)
    }

    /// Creates a tenant with `quotas` (admin); returns its id and API key.
    pub fn tenant(&self, name: &str, quotas: Value) -> (String, String) {
        let (s, v) = self.call(
            "POST",
            "/v1/admin/tenants",
            Some(ADMIN),
            serde_json::json!({"name": name, "quotas": quotas}),
        );
        assert_eq!(s, 201, "{v}");
        (
            v["tenant"]["id"].as_str().unwrap().to_string(),
            v["api_key"].as_str().unwrap().to_string(),
        )
    }

    /// Creates tenant `tenant` (admin) and an agent `bot` with one axioms layer; returns the
    /// tenant's API key and the created agent's JSON.
    pub fn tenant_with_bot(&self, tenant: &str, axioms: &str) -> (String, Value) {
        let (s, t) = self.call(
            "POST",
            "/v1/admin/tenants",
            Some(ADMIN),
            serde_json::json!({ "name": tenant }),
        );
        assert_eq!(s, 201, "{t}");
        let key = t["api_key"].as_str().unwrap().to_string();
        let (s, a) = self.call(
            "POST",
            "/v1/agents",
            Some(&key),
            serde_json::json!({"name": "bot", "layers": [{"kind": "axioms", "content": axioms}]}),
        );
        assert_eq!(s, 201, "{a}");
        (key, a)
    }

    /// JSON in, JSON out.
    pub fn call(&self, method: &str, path: &str, key: Option<&str>, body: Value) -> (u16, Value) {
        let bytes = if body.is_null() {
            Vec::new()
        } else {
            body.to_string().into_bytes()
        };
        let (status, out) = self.raw(method, path, key, &bytes);
        let v = serde_json::from_slice(&out)
            .unwrap_or(Value::String(String::from_utf8_lossy(&out).into()));
        (status, v)
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + size]);
        b = &b[eol + 4 + size..];
    }
}
