//! Sessions that move between nodes: two `engram serve` processes sharing one PostgreSQL
//! database and one S3 bucket (each writing its own prefix, each reading the other's), behind
//! HAProxy with the shipped reference config (`deploy/haproxy/engram.cfg`). The node serving a
//! session is killed mid-conversation; the next turn, routed to the other node, reports the
//! session's prefix as cached (adopted from the dead node's shadow) and answers like a node
//! that never died.

#![cfg(feature = "s3")]

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, database_urls, model_path};
use crate::storage::{S3_KEY, S3Server};

const SESSION: &str = "trip";
const AXIOMS: &str = "You are a terse travel assistant. Answer in one short sentence.";
const MESSAGES: [&str; 4] = [
    "I am planning a week in Lisbon in May.",
    "Which neighbourhood should I stay in?",
    "And one day trip from there?",
    "What should I pack for the weather?",
];

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Reads a started child's log to the end in the background: a full pipe must never block it.
fn drain(child: &mut Child) {
    if let Some(mut e) = child.stderr.take() {
        std::thread::spawn(move || std::io::copy(&mut e, &mut std::io::sink()));
    }
}

fn wait_for(child: &mut Child, port: u16, what: &str) {
    let started = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            panic!("{what} exited ({status}): {err}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "{what} did not listen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `engram serve` on `port`, its shadow at `s3://engram-shadow/<own>`, reading `peer`'s.
fn node(db: &str, s3: &S3Server, port: u16, own: &str, peer: &str) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_engram-under-test"))
        .args(["serve", "--bind", &format!("127.0.0.1:{port}")])
        .args(["--database-url", db])
        .env("ENGRAM__AUTH__ADMIN_KEY", ADMIN)
        .env("ENGRAM__MODEL__PATH", model_path())
        .env("ENGRAM__MODEL__HOT_MIB", "128")
        .env("ENGRAM__MODEL__COLD_MIB", "64")
        .env("ENGRAM__MEMORY__ENABLED", "false")
        .env("ENGRAM__TIERS__ENABLED", "false")
        .env("ENGRAM__SHADOW__URL", format!("s3://engram-shadow/{own}"))
        .env(
            "ENGRAM__SHADOW__PEERS",
            format!("s3://engram-shadow/{peer}"),
        )
        .env("ENGRAM__SHADOW__S3_ENDPOINT", &s3.endpoint)
        .env("ENGRAM__SHADOW__S3_ALLOW_HTTP", "true")
        .env("ENGRAM__SHADOW__S3_ACCESS_KEY_ID", S3_KEY.0)
        .env("ENGRAM__SHADOW__S3_SECRET_ACCESS_KEY", S3_KEY.1)
        .env("ENGRAM__SHADOW__INTERVAL_MS", "3600000")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&mut child, port, "engram");
    drain(&mut child);
    child
}

/// HAProxy with the shipped config, listening on `port` in front of the two nodes.
fn haproxy(port: u16, nodes: [u16; 2]) -> Child {
    let binary = std::env::var("ENGRAM_HAPROXY").unwrap_or_else(|_| {
        let debian = "/usr/sbin/haproxy";
        if std::path::Path::new(debian).is_file() {
            debian
        } else {
            "haproxy"
        }
        .into()
    });
    let config =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/haproxy/engram.cfg");
    let mut child = Command::new(&binary)
        .args(["-db", "-f"])
        .arg(config)
        .env("ENGRAM_LISTEN", format!("127.0.0.1:{port}"))
        .env("ENGRAM_NODE1", format!("127.0.0.1:{}", nodes[0]))
        .env("ENGRAM_NODE2", format!("127.0.0.1:{}", nodes[1]))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("HAProxy ({binary}): {e}; run `make haproxy` (Debian's package) or set ENGRAM_HAPROXY")
        });
    wait_for(&mut child, port, "haproxy");
    drain(&mut child);
    child
}

struct Killed(Vec<Child>);

impl Drop for Killed {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn at(port: u16) -> Server {
    Server::at(SocketAddr::from(([127, 0, 0, 1], port)))
}

/// One turn through `srv` with the routing header; returns the text and usage.
fn turn(srv: &Server, key: &str, routing: &str, msg: &str) -> (String, Value) {
    let body = json!({"message": msg, "max_tokens": 12}).to_string();
    let (s, _, out) = srv.raw_with(
        "POST",
        &format!("/v1/agents/bot/sessions/{SESSION}/turns"),
        Some(key),
        &[("x-engram-session", routing)],
        body.as_bytes(),
    );
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(s, 200, "{v}");
    (v["text"].as_str().unwrap().to_string(), v["usage"].clone())
}

/// Blocks of the session a node holds in memory.
fn held(port: u16, key: &str) -> u64 {
    let (s, v) = at(port).call(
        "GET",
        &format!("/v1/agents/bot/sessions/{SESSION}/cache"),
        Some(key),
        Value::Null,
    );
    assert_eq!(s, 200, "{v}");
    v["blocks"].as_u64().unwrap()
}

fn metric(port: u16, name: &str) -> u64 {
    let (_, m) = at(port).call("GET", "/metrics", Some(ADMIN), Value::Null);
    let m = m.as_str().unwrap_or_default().to_string();
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {m}"))
}

#[test]
fn a_session_whose_node_is_killed_resumes_its_cache_on_the_other_node_behind_haproxy() {
    let s3 = S3Server::start("engram-shadow");
    // The reference: one node that never dies (its own bucket prefix, same conversation).
    let reference: Vec<String> = {
        let db = database_urls().pop().unwrap();
        let port = free_port();
        let _node = Killed(vec![node(&db, &s3, port, "reference", "nobody")]);
        let srv = at(port);
        let (key, _) = srv.tenant_with_bot("travel", AXIOMS);
        MESSAGES
            .iter()
            .map(|m| turn(&srv, &key, "x", m).0)
            .collect()
    };

    let db = database_urls().pop().unwrap();
    let ports = [free_port(), free_port()];
    let mut nodes = Killed(vec![
        node(&db, &s3, ports[0], "node-1", "node-2"),
        node(&db, &s3, ports[1], "node-2", "node-1"),
    ]);
    let front = free_port();
    let _proxy = Killed(vec![haproxy(front, ports)]);
    let lb = at(front);
    let (key, _) = lb.tenant_with_bot("travel", AXIOMS);
    let routing = format!("travel/bot/{SESSION}");
    let mut usage = Value::Null;
    for (i, m) in MESSAGES[..3].iter().enumerate() {
        let (text, u) = turn(&lb, &key, &routing, m);
        assert_eq!(text, reference[i], "turn {i}");
        usage = u;
    }
    // One node served every turn of the session (the header pins it there).
    let held_by: Vec<u64> = ports.iter().map(|&p| held(p, &key)).collect();
    let (serving, other) = if held_by[0] > 0 { (0, 1) } else { (1, 0) };
    assert!(held_by[serving] > 0 && held_by[other] == 0, "{held_by:?}");
    // Its shadow is written (as every `shadow.interval_ms`), then it is killed mid-conversation.
    let (s, f) =
        at(ports[serving]).call("POST", "/v1/admin/shadow/flush", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{f}");
    assert!(f["blocks"].as_u64().unwrap() > 0, "{f}");
    nodes.0[serving].kill().unwrap();
    nodes.0[serving].wait().unwrap();
    let prefix = |i: usize| {
        s3.root
            .join(format!("engram-shadow/node-{}/entries", i + 1))
    };
    // Session entries holding objects (the S3 server keeps emptied "directories" as such).
    let entries = |i: usize| -> Vec<String> {
        std::fs::read_dir(prefix(i))
            .map(|d| {
                d.filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().starts_with("s-"))
                    .filter(|e| {
                        std::fs::read_dir(e.path()).is_ok_and(|mut files| files.next().is_some())
                    })
                    .map(|e| e.file_name().to_string_lossy().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    let moved = entries(serving);
    assert_eq!(moved.len(), 1, "{moved:?}");

    // The next turn goes to the surviving node (HAProxy's check or redispatch), which adopts
    // the session's cache from the dead node's shadow: the conversation so far is cached.
    let (text, after) = turn(&lb, &key, &routing, MESSAGES[3]);
    assert_eq!(text, reference[3]);
    let before = usage["prompt_tokens"].as_u64().unwrap();
    let cached = after["cached_tokens"].as_u64().unwrap();
    assert!(
        cached + 32 >= before,
        "the surviving node reused {cached} tokens of a {before}-token conversation: {after}"
    );
    assert!(held(ports[other], &key) > 0);
    assert_eq!(
        metric(
            ports[other],
            "engram_shadow_miss_reads_total{result=\"adopted\"}"
        ),
        1
    );
    // Adopted, not duplicated: the entry now lives in the survivor's prefix only.
    assert!(entries(serving).is_empty(), "{:?}", entries(serving));
    assert_eq!(entries(other), moved);
}
