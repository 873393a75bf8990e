//! A supervised engine: a panic while serving one request fails that request (500 `internal`,
//! logged under the response's `x-request-id`) and the engine goes on; an engine thread that is
//! gone makes `/readyz` answer 503 and generation 503 `model_unavailable`. The faults are
//! injected on purpose (`model.fault`, a test-only setting): the one test double of this suite.

use serde_json::{Value, json};

use crate::harness::{Server, sqlite_url, test_config};

fn turn(srv: &Server, key: &str, session: &str, message: &str) -> (u16, String, Value) {
    let body = json!({"message": message, "max_tokens": 2}).to_string();
    let (s, head, b) = srv.raw_full(
        "POST",
        &format!("/v1/agents/bot/sessions/{session}/turns"),
        Some(key),
        body.as_bytes(),
    );
    (s, head, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

fn request_id(head: &str) -> String {
    head.lines()
        .find_map(|l| l.strip_prefix("x-request-id: "))
        .unwrap_or_else(|| panic!("no x-request-id in {head}"))
        .trim()
        .to_string()
}

#[test]
fn a_panic_fails_one_request_and_the_engine_goes_on() {
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    config.model.fault = "panic:XYZZY-PANIC".into();
    config.memory.enabled = false;
    let srv = Server::start_with(config);
    let (key, _) = srv.tenant_with_bot("t", "Be kind.");
    let (s, _, v) = turn(&srv, &key, "a", "Hello?");
    assert_eq!(s, 200, "{v}");
    let answer = v["text"].clone();
    let (s, head, v) = turn(&srv, &key, "b", "Say XYZZY-PANIC now.");
    assert_eq!((s, v["code"].as_str()), (500, Some("internal")), "{v}");
    // The body is generic; the id names the log line with the detail.
    assert!(!v.to_string().contains("panic"), "{v}");
    let id = request_id(&head);
    assert_eq!(id.len(), 32, "{id}");
    // The engine goes on: the same first turn as before answers the same, and it is ready.
    let (s, head2, v) = turn(&srv, &key, "c", "Hello?");
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["text"], answer);
    assert_ne!(request_id(&head2), id);
    let (s, ready) = srv.call("GET", "/readyz", None, Value::Null);
    assert_eq!(
        (s, ready["engine"].as_str()),
        (200, Some("running")),
        "{ready}"
    );
    // Every answer carries an id, the 404 of no route included.
    for path in ["/healthz", "/no/such/route"] {
        let (_, head, _) = srv.raw_full("GET", path, None, b"");
        assert_eq!(request_id(&head).len(), 32, "{head}");
    }
    srv.stop();
}

#[test]
fn a_stopped_engine_makes_readyz_and_generation_answer_503() {
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    config.model.fault = "stop:XYZZY-STOP".into();
    config.memory.enabled = false;
    let srv = Server::start_with(config);
    let (key, _) = srv.tenant_with_bot("t", "Be kind.");
    let (s, _, v) = turn(&srv, &key, "a", "Hello?");
    assert_eq!(s, 200, "{v}");
    let (s, _, v) = turn(&srv, &key, "b", "Say XYZZY-STOP now.");
    assert!(s == 500 || s == 503, "{s} {v}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (s, ready) = srv.call("GET", "/readyz", None, Value::Null);
    assert_eq!(
        (s, ready["engine"].as_str()),
        (503, Some("stopped")),
        "{ready}"
    );
    let (s, _, v) = turn(&srv, &key, "c", "Hello?");
    assert_eq!(
        (s, v["code"].as_str()),
        (503, Some("model_unavailable")),
        "{v}"
    );
    let (s, v) = srv.call(
        "POST",
        "/v1/chat/completions",
        Some(&key),
        json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (503, Some("model_unavailable")),
        "{v}"
    );
    // What needs no engine still works.
    let (s, v) = srv.call("GET", "/v1/agents/bot", Some(&key), Value::Null);
    assert_eq!(s, 200, "{v}");
    srv.stop();
}
