//! Tenancy, layers, turns with prefix reuse, isolation and bad input — on both backends.

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, database_urls};

pub(crate) fn long_text(topic: &str, lines: usize) -> String {
    (0..lines)
        .map(|i| format!("Rule {i} about {topic}: always explain the reasoning step {i} clearly."))
        .collect::<Vec<_>>()
        .join("\n")
}

pub(crate) fn usage(v: &Value) -> (u64, u64) {
    (
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        v["usage"]["cached_tokens"].as_u64().unwrap(),
    )
}

#[test]
fn tenancy_turns_reuse_isolation_and_bad_input() {
    for url in database_urls() {
        let srv = Server::start(&url, 64 * 1024);
        // Every request is authenticated.
        let (s, v) = srv.call("GET", "/v1/agents", Some("ek_nope"), Value::Null);
        assert_eq!(
            (s, v["code"].as_str()),
            (401, Some("unauthorized")),
            "{url}"
        );
        let (s, _) = srv.call(
            "POST",
            "/v1/admin/tenants",
            Some("wrong"),
            json!({"name": "x"}),
        );
        assert_eq!(s, 401);

        // The spec and an offline Swagger UI.
        let (s, spec) = srv.call("GET", "/openapi.json", None, Value::Null);
        assert_eq!(s, 200);
        assert!(
            spec["paths"]["/v1/chat/completions"]["post"].is_object(),
            "{spec}"
        );
        let (s, page) = srv.raw("GET", "/docs/", None, b"");
        assert_eq!(s, 200);
        assert!(
            String::from_utf8_lossy(&page)
                .to_lowercase()
                .contains("swagger")
        );

        let (s, a) = srv.call(
            "POST",
            "/v1/admin/tenants",
            Some(ADMIN),
            json!({"name": "acme"}),
        );
        assert_eq!(s, 201, "{a}");
        let ka = a["api_key"].as_str().unwrap().to_string();
        let (_, b) = srv.call(
            "POST",
            "/v1/admin/tenants",
            Some(ADMIN),
            json!({"name": "globex"}),
        );
        let kb = b["api_key"].as_str().unwrap().to_string();

        let layers = json!([
            {"kind": "axioms", "content": long_text("honesty", 12)},
            {"kind": "identity", "content": "I am the Acme helper."},
            {"kind": "rules", "content": long_text("billing", 12)},
            {"kind": "memories", "content": "The user prefers short answers."},
            {"kind": "current_time", "content": "2026-11-21 09:00"}
        ]);
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(&ka),
            json!({"name": "helper", "layers": layers}),
        );
        assert_eq!(s, 201, "{v}");

        // Turn 1: nothing cached yet.
        let turn = |key: &str, agent: &str, session: &str, msg: &str| {
            srv.call(
                "POST",
                &format!("/v1/agents/{agent}/sessions/{session}/turns"),
                Some(key),
                json!({"message": msg, "max_tokens": 8}),
            )
        };
        let (s, t1) = turn(&ka, "helper", "s1", "What is the capital of France?");
        assert_eq!(s, 200, "{t1}");
        let (p1, c1) = usage(&t1);
        assert_eq!(c1, 0);
        // The clock moves (a volatile layer); turn 2 reuses the stable prefix, the slow layer and
        // turn 1, everything before the volatile block.
        let (s, _) = srv.call(
            "PUT",
            "/v1/agents/helper/layers/current_time",
            Some(&ka),
            json!({"content": "2026-11-21 09:05"}),
        );
        assert_eq!(s, 200);
        let (_, preview) = srv.call(
            "POST",
            "/v1/agents/helper/context",
            Some(&ka),
            json!({"message": "And Italy?", "session": "s1"}),
        );
        let stable: u64 = preview["layers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| {
                ["axioms", "identity", "rules", "memories"].contains(&l["kind"].as_str().unwrap())
            })
            .map(|l| l["tokens"].as_u64().unwrap())
            .sum();
        let reused = preview["blocks"]["reused_hot"].as_u64().unwrap();
        assert!(
            reused * 16 >= stable,
            "the preview sees {reused} reusable blocks: {preview}"
        );
        assert!(preview["blocks"]["new"].as_u64().unwrap() > 0, "{preview}");
        let (s, t2) = turn(&ka, "helper", "s1", "And Italy?");
        assert_eq!(s, 200, "{t2}");
        let (p2, c2) = usage(&t2);
        let turn1_tokens = p1 - 20; // at least turn 1's question, answer and markup remain after the layers
        assert!(c2 >= stable, "cached {c2} < stable + slow layers {stable}");
        assert!(
            c2 + 40 >= p1 && c2 > stable,
            "turn 2 cached {c2} of {p2}; turn 1 prompt {p1} ({turn1_tokens})"
        );
        assert!(t1["stable_prefix_hash"] == t2["stable_prefix_hash"]);

        // The session's cache state: its blocks by tier and source.
        let (s, sc) = srv.call(
            "GET",
            "/v1/agents/helper/sessions/s1/cache",
            Some(&ka),
            Value::Null,
        );
        assert_eq!(s, 200, "{sc}");
        assert!(
            sc["blocks"].as_u64().unwrap() > 0 && sc["by_source"]["axioms"].as_u64().unwrap() > 0,
            "{sc}"
        );

        // Tenant B sees nothing of A's, and reuses nothing even with the same layers.
        let (s, v) = srv.call("GET", "/v1/agents/helper", Some(&kb), Value::Null);
        assert_eq!((s, v["code"].as_str()), (404, Some("not_found")));
        let (s, _) = srv.call(
            "POST",
            "/v1/agents",
            Some(&kb),
            json!({"name": "helper", "layers": layers}),
        );
        assert_eq!(s, 201);
        let (s, tb) = turn(&kb, "helper", "s1", "What is the capital of France?");
        assert_eq!(s, 200);
        assert_eq!(usage(&tb).1, 0, "tenant B reused tenant A's blocks");
        let (_, wm) = srv.call(
            "GET",
            "/v1/agents/helper/sessions/s1/working-memory",
            Some(&kb),
            Value::Null,
        );
        assert!(wm["lines"].as_array().unwrap().is_empty());

        // Admin inspection: A's axioms blocks are pinned at 999, tagged with source and tenant.
        let tenant_a = a["tenant"]["id"].as_str().unwrap();
        let (s, page) = srv.call(
            "GET",
            &format!("/v1/admin/blocks?tenant={tenant_a}&source=axioms&limit=1000"),
            Some(ADMIN),
            Value::Null,
        );
        assert_eq!(s, 200, "{page}");
        let blocks = page["blocks"].as_array().unwrap();
        assert!(!blocks.is_empty(), "{page}");
        let full_pinned = blocks
            .iter()
            .filter(|b| b["pin"] == "pinned" && b["priority"] == 999)
            .count();
        assert!(full_pinned >= 2, "{page}");
        for blk in blocks {
            assert_eq!(
                (blk["source"].as_str(), blk["tenant_id"].as_str()),
                (Some("axioms"), Some(tenant_a))
            );
        }
        let (s, _) = srv.call("GET", "/v1/admin/blocks", Some(&ka), Value::Null);
        assert_eq!(s, 401, "a tenant key is not the admin key");
        // Editing a stable layer changes the prefix hash and unpins the old prefix.
        let (s, edited) = srv.call(
            "PUT",
            "/v1/agents/helper/layers/identity",
            Some(&ka),
            json!({"content": "I am the Acme helper, version 2."}),
        );
        assert_eq!(s, 200, "{edited}");
        assert!(
            edited["unpinned_blocks"].as_u64().unwrap() >= full_pinned as u64,
            "{edited}"
        );
        let (_, page) = srv.call(
            "GET",
            &format!("/v1/admin/blocks?tenant={tenant_a}&source=axioms&pinned=true"),
            Some(ADMIN),
            Value::Null,
        );
        assert_eq!(page["total"], 0, "{page}");
        let (_, cache) = srv.call("GET", "/v1/admin/cache", Some(ADMIN), Value::Null);
        assert!(
            cache["counters"]["hot_hits"].as_u64().unwrap() > 0,
            "{cache}"
        );
        let (s, metrics) = srv.raw("GET", "/metrics", Some(ADMIN), b"");
        let metrics = String::from_utf8_lossy(&metrics);
        assert_eq!(s, 200);
        assert!(
            metrics.contains("engram_cache_blocks_total{result=\"hot_hit\"}"),
            "{metrics}"
        );
        assert!(metrics.contains("engram_ttft_seconds_count"), "{metrics}");

        // Bad input: 4xx with a code, nothing stored changes.
        let before = srv
            .call("GET", "/v1/agents/helper/layers", Some(&ka), Value::Null)
            .1;
        let (s, v) = turn(&ka, "nope", "s1", "hi");
        assert_eq!((s, v["code"].as_str()), (404, Some("not_found")));
        let big = json!({"content": "x".repeat(70 * 1024)});
        let (s, v) = srv.call("PUT", "/v1/agents/helper/layers/axioms", Some(&ka), big);
        assert_eq!((s, v["code"].as_str()), (413, Some("payload_too_large")));
        let (s, v) = srv.raw(
            "PUT",
            "/v1/agents/helper/layers/axioms",
            Some(&ka),
            b"{\"content\": \"\xff\xfe\"}",
        );
        let v: Value = serde_json::from_slice(&v).unwrap();
        assert_eq!((s, v["code"].as_str()), (400, Some("invalid_request")));
        let (s, v) = srv.call(
            "PUT",
            "/v1/agents/helper/layers/axioms",
            Some(&ka),
            json!({"content": "x", "budget": -5}),
        );
        assert_eq!((s, v["code"].as_str()), (400, Some("invalid_request")));
        let (s, v) = srv.call(
            "PUT",
            "/v1/agents/helper/layers/nonsense",
            Some(&ka),
            json!({"content": "x"}),
        );
        assert_eq!((s, v["code"].as_str()), (400, Some("invalid_request")));
        let after = srv
            .call("GET", "/v1/agents/helper/layers", Some(&ka), Value::Null)
            .1;
        assert_eq!(before, after, "a refused request changed the layers");

        // Server-sent events.
        let (s, body) = srv.raw(
            "POST",
            "/v1/agents/helper/sessions/s2/turns",
            Some(&ka),
            json!({"message": "Say hello.", "max_tokens": 5, "stream": true})
                .to_string()
                .as_bytes(),
        );
        let text = String::from_utf8_lossy(&body);
        assert_eq!(s, 200);
        assert!(text.contains("data: {\"delta\""), "{text}");
        assert!(text.contains("\"done\":true"), "{text}");

        if url.starts_with("postgres") {
            let db = &url[url.rfind('/').unwrap() + 1..];
            let admin = std::env::var("ENGRAM_TEST_POSTGRES")
                .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
            let _ = std::process::Command::new("psql")
                .args([
                    &admin,
                    "-qc",
                    &format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"),
                ])
                .status();
        }
    }
}
