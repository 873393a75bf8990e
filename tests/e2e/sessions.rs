//! One turn of a session at a time, and a turn sent again with its `Idempotency-Key` answered
//! from the log instead of run twice.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{Server, sqlite_url, test_config};

/// The session's turn log as `(role, text)`, read from the database.
fn log(url: &str, session: &str) -> Vec<(String, String)> {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = engram_store::Store::connect(url).await.unwrap();
        let mut out = Vec::new();
        for t in store.tenants().await.unwrap() {
            for a in store.agents(&t.id).await.unwrap() {
                for turn in store.turns(&a.id, session).await.unwrap() {
                    out.push((turn.role.as_str().to_string(), turn.text));
                }
            }
        }
        store.close().await;
        out
    })
}

fn server(url: &str, wait_ms: u64) -> Server {
    let mut c = test_config(url, 1 << 20);
    c.memory.enabled = false;
    c.shadow.enabled = false;
    c.limits.session_wait_ms = wait_ms;
    Server::start_with(c)
}

fn turn_body(msg: &str, max_tokens: usize) -> Vec<u8> {
    json!({"message": msg, "max_tokens": max_tokens})
        .to_string()
        .into_bytes()
}

#[test]
fn two_turns_at_once_in_one_session_run_one_after_the_other() {
    let url = sqlite_url();
    let srv = server(&url, 60_000);
    let (key, _) = srv.tenant_with_bot("t", "Be brief.");
    let (a, b) = std::thread::scope(|s| {
        let one = s.spawn(|| {
            srv.raw(
                "POST",
                "/v1/agents/bot/sessions/s/turns",
                Some(&key),
                &turn_body("What is tea?", 8),
            )
        });
        let two = s.spawn(|| {
            srv.raw(
                "POST",
                "/v1/agents/bot/sessions/s/turns",
                Some(&key),
                &turn_body("What is coffee?", 8),
            )
        });
        (one.join().unwrap(), two.join().unwrap())
    });
    assert_eq!(a.0, 200, "{}", String::from_utf8_lossy(&a.1));
    assert_eq!(b.0, 200, "{}", String::from_utf8_lossy(&b.1));
    let log = log(&url, "s");
    let roles: Vec<&str> = log.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"], "{log:?}");
    // Each reply follows its own question.
    let first = if log[0].1 == "What is tea?" { &a } else { &b };
    let reply: Value = serde_json::from_slice(&first.1).unwrap();
    assert_eq!(log[1].1, reply["text"].as_str().unwrap());
    srv.stop();
}

#[test]
fn a_turn_that_waits_too_long_for_its_session_is_refused_and_stores_nothing() {
    let url = sqlite_url();
    let srv = server(&url, 1);
    let (key, _) = srv.tenant_with_bot("t", "Be brief.");
    // A prompt of some 2,000 tokens: its prefill keeps the session busy for seconds.
    let long_message = format!(
        "{} What is tea?",
        "Tea leaves steep in hot water. ".repeat(300)
    );
    let (long, short) = std::thread::scope(|s| {
        let long = s.spawn(|| {
            srv.raw(
                "POST",
                "/v1/agents/bot/sessions/s/turns",
                Some(&key),
                &turn_body(&long_message, 4),
            )
        });
        std::thread::sleep(Duration::from_millis(300));
        let short = srv.call(
            "POST",
            "/v1/agents/bot/sessions/s/turns",
            Some(&key),
            json!({"message": "And coffee?", "max_tokens": 4}),
        );
        (long.join().unwrap(), short)
    });
    assert_eq!(long.0, 200);
    assert_eq!(short.0, 409, "{}", short.1);
    assert_eq!(short.1["code"], "session_busy");
    assert_eq!(log(&url, "s").len(), 2);
    srv.stop();
}

#[test]
fn a_retried_turn_returns_the_stored_answer_and_adds_nothing() {
    let url = sqlite_url();
    let srv = server(&url, 60_000);
    let (key, _) = srv.tenant_with_bot("t", "Be brief.");
    let send = |msg: &str, idem: &str, stream: bool| {
        let body = json!({"message": msg, "max_tokens": 8, "stream": stream}).to_string();
        srv.raw_with(
            "POST",
            "/v1/agents/bot/sessions/s/turns",
            Some(&key),
            &[("idempotency-key", idem)],
            body.as_bytes(),
        )
    };
    let (s1, _, first) = send("What is tea?", "req-1", false);
    assert_eq!(s1, 200, "{}", String::from_utf8_lossy(&first));
    let (s2, _, again) = send("What is tea?", "req-1", false);
    assert_eq!(s2, 200);
    assert_eq!(first, again, "the stored answer, byte for byte");
    assert_eq!(log(&url, "s").len(), 2, "a retry adds nothing");
    // As a stream, the stored answer comes back as its events.
    let (s3, _, events) = send("What is tea?", "req-1", true);
    assert_eq!(s3, 200);
    let first: Value = serde_json::from_slice(&first).unwrap();
    let events = String::from_utf8_lossy(&events).to_string();
    assert!(
        events.contains(&json!({"delta": first["text"]}).to_string()),
        "{events}"
    );
    assert!(events.contains("\"done\":true"), "{events}");
    assert_eq!(log(&url, "s").len(), 2);
    // Another key is another turn.
    let (s4, _, _) = send("What is tea?", "req-2", false);
    assert_eq!(s4, 200);
    assert_eq!(log(&url, "s").len(), 4);
    // A key that is not a header value of visible ASCII is refused before anything runs.
    let (s5, _, bad) = send("What is tea?", &"k".repeat(300), false);
    assert_eq!(s5, 400, "{}", String::from_utf8_lossy(&bad));
    assert_eq!(log(&url, "s").len(), 4);
    srv.stop();
}
