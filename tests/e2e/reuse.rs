//! The acceptance's reuse case: an agent whose stable layers fill their standard budgets
//! (axioms 200 + identity 300 + rules 600 + capabilities 1,500 ≈ 2,600 tokens). Turn 2, after
//! the clock layer changed, reuses at least the stable prefix and answers sooner.

use serde_json::json;

use crate::harness::{ADMIN, Server, sqlite_url};
use crate::service::{long_text, usage};

#[test]
fn a_2600_token_stable_prefix_is_reused_and_turn_two_is_faster() {
    let srv = Server::start(&sqlite_url(), 1 << 20);
    let (s, t) = srv.call(
        "POST",
        "/v1/admin/tenants",
        Some(ADMIN),
        json!({"name": "acme"}),
    );
    assert_eq!(s, 201, "{t}");
    let key = t["api_key"].as_str().unwrap().to_string();
    let layers = json!([
        {"kind": "axioms", "content": long_text("honesty", 20)},
        {"kind": "identity", "content": long_text("who I am", 30)},
        {"kind": "rules", "content": long_text("billing", 60)},
        {"kind": "capabilities", "content": long_text("tools", 140)},
        {"kind": "memories", "content": "The user prefers short answers."},
        {"kind": "current_time", "content": "2026-11-21 09:00"}
    ]);
    let (s, v) = srv.call(
        "POST",
        "/v1/agents",
        Some(&key),
        json!({"name": "helper", "layers": layers}),
    );
    assert_eq!(s, 201, "{v}");
    let turn = |msg: &str| {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/helper/sessions/s1/turns",
            Some(&key),
            json!({"message": msg, "max_tokens": 4}),
        );
        assert_eq!(s, 200, "{v}");
        let (prompt, cached) = usage(&v);
        (prompt, cached, v["ttft_ms"].as_f64().unwrap())
    };
    let (p1, c1, ttft1) = turn("Which invoices are overdue?");
    assert_eq!(c1, 0);
    let (s, _) = srv.call(
        "PUT",
        "/v1/agents/helper/layers/current_time",
        Some(&key),
        json!({"content": "2026-11-21 09:05"}),
    );
    assert_eq!(s, 200);
    let (_, preview) = srv.call(
        "POST",
        "/v1/agents/helper/context",
        Some(&key),
        json!({"message": "And which tools can pay them?", "session": "s1"}),
    );
    let stable: u64 = preview["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| {
            ["axioms", "identity", "rules", "capabilities"].contains(&l["kind"].as_str().unwrap())
        })
        .map(|l| l["tokens"].as_u64().unwrap())
        .sum();
    assert!(
        (2_300..=2_600).contains(&stable),
        "stable layers hold {stable} tokens: {preview}"
    );
    let (p2, c2, ttft2) = turn("And which tools can pay them?");
    assert!(c2 >= stable, "turn 2 cached {c2} < stable prefix {stable}");
    assert!(
        c2 + 40 >= p1,
        "turn 2 cached {c2}; turn 1's prompt was {p1}"
    );
    assert!(
        ttft2 < ttft1,
        "turn 2 TTFT {ttft2} ms is not below turn 1's {ttft1} ms"
    );
    eprintln!(
        "reuse: stable {stable} tokens; turn 1 {p1} prompt tokens, TTFT {ttft1:.0} ms; \
         turn 2 {p2} prompt, {c2} cached, TTFT {ttft2:.0} ms ({:.1}x)",
        ttft1 / ttft2
    );
}
