//! Lifecycle: graceful shutdown of the real binary (SIGTERM stops new connections, lets a
//! running stream finish and reach the turn log, then the process exits 0), its structured
//! JSON log (one line per request with the request id, tenant, route, status and latency, and
//! the turn's figures), and a service started without a model.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, model_path, served_at, sqlite_url};

#[test]
fn sigterm_drains_a_running_stream_and_exits_cleanly() {
    let url = sqlite_url();
    let mut child = Command::new(env!("CARGO_BIN_EXE_engram-under-test"))
        .args(["serve", "--bind", "127.0.0.1:0", "--database-url", &url])
        .env("ENGRAM__AUTH__ADMIN_KEY", ADMIN)
        .env("ENGRAM__MODEL__PATH", model_path())
        .env("ENGRAM__MODEL__HOT_MIB", "128")
        .env("ENGRAM__MODEL__COLD_MIB", "64")
        .env("ENGRAM__SERVER__SHUTDOWN_GRACE_SECS", "120")
        .env("ENGRAM__LOG__FORMAT", "json")
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, lines) = mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let next_line = || lines.recv_timeout(Duration::from_secs(300)).unwrap();
    let mut log: Vec<Value> = Vec::new();
    let addr: SocketAddr = loop {
        let line = next_line();
        log.push(serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}")));
        if let Some(a) = served_at(&line) {
            break a;
        }
    };
    let srv = Server::at(addr);
    let (key, a) = srv.tenant_with_bot("t", "Be thorough.");
    let agent_id = a["agent"]["id"].as_str().unwrap().to_string();
    let tenant_id = a["agent"]["tenant_id"].as_str().unwrap().to_string();
    // A JSON turn first: its request line carries the turn's figures.
    let (s, first) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s/turns",
        Some(&key),
        json!({"message": "Say hello.", "max_tokens": 4}),
    );
    assert_eq!(s, 200, "{first}");

    // A streamed turn is under way when SIGTERM arrives.
    let body = json!({
        "message": "Count from one to forty in words, one number per line.",
        "max_tokens": 96,
        "stream": true
    })
    .to_string();
    let mut conn = TcpStream::connect(addr).unwrap();
    write!(
        conn,
        "POST /v1/agents/bot/sessions/s/turns HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
         authorization: Bearer {key}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: {\"delta\"") {
        let n = conn.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before its first token");
        got.extend_from_slice(&buf[..n]);
    }
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    loop {
        let line = next_line();
        log.push(serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}")));
        if line.contains("SIGTERM: draining") {
            break;
        }
    }
    // New connections are refused while the stream drains.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_err(),
        "the listener still accepts after SIGTERM"
    );
    conn.read_to_end(&mut got).unwrap();
    let text = String::from_utf8_lossy(&got);
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let done = events.last().unwrap();
    assert_eq!(done["done"], true, "{text}");
    let streamed: String = events.iter().filter_map(|e| e["delta"].as_str()).collect();
    assert!(!streamed.is_empty());

    let status = child.wait().unwrap();
    assert!(status.success(), "exit status {status}");
    while let Ok(line) = lines.recv_timeout(Duration::from_secs(5)) {
        log.push(serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}")));
    }
    // Every line is a JSON object with a level and a message.
    for l in &log {
        assert!(l["level"].is_string() && l["message"].is_string(), "{l}");
    }
    let turns_route = "/v1/agents/{agent}/sessions/{session}/turns";
    let requests: Vec<&Value> = log
        .iter()
        .filter(|l| l["message"] == "request answered")
        .collect();
    // The JSON turn: one line with the tenant, route, status, latency, request id and figures.
    let turn_line = requests
        .iter()
        .find(|l| l["span"]["route"] == turns_route && l["span"].get("ttft_ms").is_some())
        .unwrap_or_else(|| panic!("no turn request line in {log:?}"));
    let span = &turn_line["span"];
    assert_eq!(span["method"], "POST", "{span}");
    assert_eq!(span["status"], 200, "{span}");
    assert_eq!(span["tenant"].as_str(), Some(tenant_id.as_str()), "{span}");
    assert_eq!(
        span["request_id"].as_str().map(str::len),
        Some(32),
        "{span}"
    );
    assert!(span["latency_ms"].as_f64().unwrap() > 0.0, "{span}");
    assert_eq!(
        span["cached_tokens"].as_u64().unwrap() + span["prefilled_tokens"].as_u64().unwrap(),
        first["usage"]["prompt_tokens"].as_u64().unwrap(),
        "{span} {first}"
    );
    assert_eq!(
        span["completion_tokens"], first["usage"]["completion_tokens"],
        "{span}"
    );
    assert!(span["ttft_ms"].as_f64().unwrap() > 0.0, "{span}");
    // The streamed turn: its request line when the stream starts, and a line in the same
    // request's span with its figures when the stream ends.
    let streamed_end = log
        .iter()
        .find(|l| l["message"] == "stream finished")
        .unwrap_or_else(|| panic!("no stream line in {log:?}"));
    let id = streamed_end["span"]["request_id"].as_str().unwrap();
    assert!(
        requests
            .iter()
            .any(|l| l["span"]["request_id"] == id && l["span"]["status"] == 200),
        "{log:?}"
    );
    assert!(streamed_end["span"]["ttft_ms"].as_f64().unwrap() > 0.0);
    assert!(
        requests.iter().all(|l| l["span"]["request_id"].is_string()),
        "{log:?}"
    );
    // The drained turn reached the durable log whole.
    let turns = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = engram_store::Store::connect(&url).await.unwrap();
        let t = store.turns(&agent_id, "s").await.unwrap();
        store.close().await;
        t
    });
    assert_eq!(turns.len(), 4);
    assert_eq!(turns[3].text, streamed);
    assert!(!turns[3].tokens.is_empty());
}

#[test]
fn without_a_model_the_service_runs_and_generation_answers_503() {
    let mut config = engram_server::Config::default();
    config.database.url = sqlite_url();
    config.auth.admin_key.0 = ADMIN.into();
    config.model.path = std::env::temp_dir().join("engram-no-such-model.gguf");
    let srv = Server::start_with(config);
    let (s, ready) = srv.call("GET", "/readyz", None, Value::Null);
    assert_eq!(s, 200);
    assert_eq!(
        (ready["database"].as_bool(), ready["model"].as_bool()),
        (Some(true), Some(false))
    );
    let (key, _) = srv.tenant_with_bot("t", "Be kind.");
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s/turns",
        Some(&key),
        json!({"message": "hi"}),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (503, Some("model_unavailable")),
        "{v}"
    );
    // The body names no server path (the log does).
    assert!(!v["message"].as_str().unwrap().contains('/'), "{v}");
    let (s, v) = srv.call(
        "POST",
        "/v1/chat/completions",
        Some(&key),
        json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (503, Some("model_unavailable")),
        "{v}"
    );
    // The preview still works (token counts are estimated without a tokenizer).
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/context",
        Some(&key),
        json!({"message": "hi"}),
    );
    assert_eq!(s, 200, "{v}");
    assert!(v["blocks"].is_null(), "{v}");
}

/// `engram eval|calibrate|check` hand their arguments, unread (`--help` included), to
/// `engram-lab` and exit with its status; without it they say how to build it. `/bin/echo`
/// stands in for engram-lab here (the routing is under test, not the harness: engram-lab's own
/// tests run it).
#[test]
fn the_lab_commands_are_handed_to_engram_lab() {
    let bin = env!("CARGO_BIN_EXE_engram-under-test");
    for (command, args) in [
        ("eval", vec!["kv", "--help"]),
        (
            "calibrate",
            vec!["kv", "--budget", "0.01", "--out", "p.json"],
        ),
        ("check", vec!["device", "--device", "cuda"]),
    ] {
        let out = Command::new(bin)
            .arg(command)
            .args(&args)
            .env("ENGRAM_LAB", "/bin/echo")
            .output()
            .unwrap();
        assert!(out.status.success(), "{command}: {out:?}");
        let said = String::from_utf8(out.stdout).unwrap();
        assert_eq!(said.trim(), format!("{command} {}", args.join(" ")));
    }
    let out = Command::new(bin)
        .args(["eval", "kv"])
        .env("ENGRAM_LAB", "/nonexistent/engram-lab")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("cargo build --release -p engram-lab"),
        "{said}"
    );
    // `false` exits 1: the status comes back.
    let out = Command::new(bin)
        .args(["check", "device"])
        .env("ENGRAM_LAB", "/bin/false")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
}
