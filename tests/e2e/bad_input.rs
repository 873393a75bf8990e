//! Bad input on every write route: malformed JSON, wrong types, missing fields, oversize
//! bodies, invalid UTF-8, control characters in names, negative and huge numbers. Each gets a
//! 4xx with a stable code, and the stored state is unchanged (the admin listings, the agent's
//! layers and memory, and the turn log compared before and after), on SQLite and PostgreSQL.

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, database_urls, test_config};

const CODES: &[&str] = &[
    "invalid_request",
    "payload_too_large",
    "unsupported_media_type",
    "not_found",
    "context_overflow",
    "invalid_cache_file",
    "unsupported_content",
    "unsupported_parameter",
];

/// Everything a bad request could have changed.
fn state(srv: &Server, url: &str, key: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for (path, k) in [
        ("/v1/admin/tenants", ADMIN),
        ("/v1/agents", key),
        ("/v1/agents/bot", key),
        ("/v1/agents/bot/memory/nodes", key),
        ("/v1/agents/bot/memory/edges", key),
        ("/v1/agents/bot/sessions/s/working-memory", key),
        ("/v1/agents/bot/sessions", key),
    ] {
        let (s, v) = srv.call("GET", path, Some(k), Value::Null);
        assert_eq!(s, 200, "{path}: {v}");
        out.push(v);
    }
    let turns = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = engram_store::Store::connect(url).await.unwrap();
        let tenants = store.tenants().await.unwrap();
        let mut all = Vec::new();
        for t in &tenants {
            for a in store.agents(&t.id).await.unwrap() {
                for s in store.sessions(&a.id).await.unwrap() {
                    let turns = store.turns(&a.id, &s).await.unwrap();
                    all.push(json!([a.id, s, turns.len()]));
                }
            }
        }
        store.close().await;
        all
    });
    out.push(json!(turns));
    out
}

#[test]
fn bad_input_on_every_write_route_is_a_4xx_with_a_stable_code_and_changes_nothing() {
    for url in database_urls() {
        let mut config = test_config(&url, 64 * 1024);
        config.tiers.enabled = false;
        config.limits.requests_per_sec = 0;
        let srv = Server::start_with(config);
        let (key, _) = srv.tenant_with_bot("t", "Be kind.");
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/s/turns",
            Some(&key),
            json!({"message": "Hello?", "max_tokens": 2}),
        );
        assert_eq!(s, 200, "{v}");
        let node = |text: &str| {
            let (s, v) = srv.call(
                "POST",
                "/v1/agents/bot/memory/nodes",
                Some(&key),
                json!({"kind": "fact", "text": text}),
            );
            assert_eq!(s, 201, "{v}");
            v["id"].as_i64().unwrap()
        };
        let (n1, n2) = (node("Tea."), node("Milk."));
        let (_, tenants) = srv.call("GET", "/v1/admin/tenants", Some(ADMIN), Value::Null);
        let tid = tenants["tenants"][0]["id"].as_str().unwrap().to_string();
        let before = state(&srv, &url, &key);

        // (method, path, key, a valid body to corrupt, targeted bad bodies)
        let routes: Vec<(&str, String, &str, Value, Vec<Value>)> = vec![
            (
                "POST",
                "/v1/admin/tenants".into(),
                ADMIN,
                json!({"name": "new"}),
                vec![
                    json!({"name": "bad name"}),
                    json!({"name": "a\u{0}b"}),
                    json!({"name": "line\nbreak"}),
                    json!({"name": "x".repeat(65)}),
                    json!({"name": "ok", "quotas": {"hot_blocks": -1, "cold_blocks": 1, "sessions": 1}}),
                    json!({"name": "ok", "quotas": {"hot_blocks": 1e40, "cold_blocks": 1, "sessions": 1}}),
                ],
            ),
            (
                "PUT",
                format!("/v1/admin/tenants/{tid}/agents/bot/layers/axioms/public"),
                ADMIN,
                json!({"public": true}),
                vec![json!({"public": "yes"}), json!({"public": 1})],
            ),
            (
                "POST",
                "/v1/agents".into(),
                &key,
                json!({"name": "other"}),
                vec![
                    json!({"name": "tab\there"}),
                    json!({"name": "\u{7f}"}),
                    json!({"name": "fine", "layers": [{"kind": "axioms", "content": "x", "budget": -5}]}),
                    json!({"name": "fine", "layers": [{"kind": "axioms", "content": "x", "budget": 18_446_744_073_709_551_615u64}]}),
                    json!({"name": "fine", "layers": [{"kind": "axioms", "content": "x"}, {"kind": "rules", "content": "y", "importance": 7}]}),
                    json!({"name": "fine", "layers": [{"kind": "nonsense", "content": "x"}]}),
                ],
            ),
            (
                "PUT",
                "/v1/agents/bot/layers/axioms".into(),
                &key,
                json!({"content": "Be kinder."}),
                vec![
                    json!({"content": "x", "importance": -0.5}),
                    json!({"content": "x", "importance": 1e308}),
                    json!({"content": "x", "budget": 1_000_000_000u64}),
                ],
            ),
            (
                "POST",
                "/v1/agents/bot/context".into(),
                &key,
                json!({"message": "hi"}),
                vec![json!({"message": 5})],
            ),
            (
                "POST",
                "/v1/agents/bot/sessions/s/turns".into(),
                &key,
                json!({"message": "hi", "max_tokens": 2}),
                vec![
                    json!({"message": "hi", "max_tokens": -1}),
                    json!({"message": "hi", "max_tokens": 1e30}),
                    json!({"message": "hi", "max_tokens": 1_000_000_000}),
                    json!({"message": "hi", "temperature": -3.0}),
                    json!({"message": "hi", "top_p": 9.0}),
                    json!({"message": ""}),
                    json!({"message": "x".repeat(70_000)}),
                ],
            ),
            (
                "POST",
                "/v1/agents/bot/sessions/bad%00name/turns".into(),
                &key,
                json!({"message": "hi", "max_tokens": 2}),
                vec![json!({"message": "hi", "max_tokens": 2})],
            ),
            (
                "POST",
                "/v1/agents/bot/sessions/bad%0Aname/turns".into(),
                &key,
                json!({"message": "hi", "max_tokens": 2}),
                vec![json!({"message": "hi", "max_tokens": 2})],
            ),
            (
                "POST",
                "/v1/chat/completions".into(),
                &key,
                json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                vec![
                    json!({"model": "bot", "messages": []}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -2}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "user": "u".repeat(257)}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a b"}}]}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}),
                    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}], "stop": 5}),
                    // More messages than a request may carry.
                    json!({"model": "bot", "messages": vec![json!({"role": "user", "content": "hi"}); 1025]}),
                ],
            ),
            (
                "POST",
                "/v1/completions".into(),
                &key,
                json!({"model": "bot", "prompt": "hi", "max_tokens": 2}),
                vec![
                    json!({"model": "bot", "prompt": ""}),
                    json!({"model": "bot", "prompt": [99_999_999]}),
                    json!({"model": "bot", "prompt": ["a", "b"]}),
                    json!({"model": "bot", "prompt": "hi", "logprobs": 6}),
                    json!({"model": "bot", "prompt": "hi", "suffix": "x"}),
                ],
            ),
            (
                "POST",
                "/v1/embeddings".into(),
                &key,
                json!({"input": "hi"}),
                vec![
                    json!({"input": []}),
                    json!({"input": [[1, 2]]}),
                    json!({"input": "hi", "encoding_format": "hex"}),
                ],
            ),
            (
                "POST",
                "/v1/responses".into(),
                &key,
                json!({"model": "bot", "input": "hi", "max_output_tokens": 2}),
                vec![
                    json!({"model": "bot", "input": []}),
                    json!({"model": "bot", "input": "hi", "previous_response_id": "resp_none"}),
                    json!({"model": "bot", "input": "hi", "tools": [{"type": "web_search"}]}),
                    json!({"model": "bot", "input": [{"type": "computer_call"}]}),
                ],
            ),
            (
                "POST",
                "/v1/messages".into(),
                &key,
                json!({"model": "bot", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
                vec![
                    json!({"model": "bot", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}),
                    json!({"model": "bot", "max_tokens": 2, "messages": [{"role": "robot", "content": "hi"}]}),
                    json!({"model": "bot", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
                    json!({"model": "bot", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "sometimes"}}),
                ],
            ),
            (
                "POST",
                "/detokenize".into(),
                &key,
                json!({"tokens": [1]}),
                vec![json!({"tokens": [99_999_999]}), json!({"tokens": "x"})],
            ),
            (
                "POST",
                "/v1/agents/bot/memory/nodes".into(),
                &key,
                json!({"kind": "fact", "text": "x"}),
                vec![
                    json!({"kind": "fact", "text": "x", "importance": -1}),
                    json!({"kind": "gossip", "text": "x"}),
                    json!({"kind": "fact", "text": ""}),
                    json!({"kind": "fact", "text": "x", "session": "a\u{0}b"}),
                ],
            ),
            (
                "PATCH",
                format!("/v1/agents/bot/memory/nodes/{n1}"),
                &key,
                json!({"text": "y"}),
                vec![json!({"importance": 2.5}), json!({"text": ""})],
            ),
            (
                "POST",
                "/v1/agents/bot/memory/edges".into(),
                &key,
                json!({"from": n1, "to": n2, "kind": "relates_to"}),
                vec![
                    json!({"from": -1, "to": n2, "kind": "relates_to"}),
                    json!({"from": n1, "to": 9_007_199_254_740_993i64, "kind": "relates_to"}),
                    json!({"from": n1, "to": n2, "kind": "hates"}),
                    json!({"from": n1, "to": n2, "kind": "relates_to", "weight": -3}),
                    json!({"from": n1, "to": n1, "kind": "relates_to"}),
                ],
            ),
            (
                "POST",
                "/v1/agents/bot/memory/query".into(),
                &key,
                json!({"text": "tea"}),
                vec![
                    json!({"text": "tea", "k": -1}),
                    json!({"text": "tea", "k": 100_000}),
                    json!({"text": "tea", "hops": 99}),
                ],
            ),
        ];
        let mut cases = 0;
        let mut check = |method: &str, path: &str, k: &str, body: &[u8], what: &str| {
            cases += 1;
            let (s, out) = srv.raw(method, path, Some(k), body);
            let v: Value = serde_json::from_slice(&out).unwrap_or(Value::Null);
            let code = v["code"].as_str().unwrap_or_default();
            assert!(
                (400..500).contains(&s) && CODES.contains(&code),
                "{method} {path} ({what}): {s} {v}"
            );
            assert!(v["message"].is_string(), "{method} {path}: {v}");
        };
        for (method, path, k, valid, bad) in &routes {
            let valid = valid.to_string();
            check(method, path, k, b"{\"a\":", "malformed JSON");
            check(
                method,
                path,
                k,
                &valid.as_bytes()[..valid.len() / 2],
                "truncated JSON",
            );
            check(method, path, k, b"[1, 2, 3]", "wrong type: array");
            check(method, path, k, b"\"text\"", "wrong type: string");
            check(method, path, k, b"{}", "missing fields");
            check(
                method,
                path,
                k,
                b"{\"name\": \"\xff\xfe\"}",
                "invalid UTF-8",
            );
            let huge = format!("{{\"pad\": \"{}\"}}", "x".repeat(70 * 1024));
            check(method, path, k, huge.as_bytes(), "oversize body");
            for b in bad {
                check(method, path, k, b.to_string().as_bytes(), &b.to_string());
            }
        }
        // A junk cache file.
        check(
            "POST",
            "/v1/agents/bot/sessions/s/cache/import",
            &key,
            b"not a safetensors file",
            "junk import",
        );
        println!("bad-input cases: {cases}");
        let after = state(&srv, &url, &key);
        assert_eq!(before, after, "a refused request changed what is stored");
        srv.stop();
    }
}

#[test]
fn an_out_of_range_node_filter_and_an_oversize_message_are_refused() {
    let srv = Server::start(&crate::harness::sqlite_url(), 1 << 20);
    let (key, _) = srv.tenant_with_bot("t", "Be brief.");
    // One message past its limit, in a body under the 1 MiB body limit (so the message check,
    // not the body limit, answers): 64 KiB on the turn route, 256 KiB on the OpenAI route.
    for (path, body) in [
        (
            "/v1/agents/bot/sessions/s/turns",
            json!({"message": "x".repeat(64 * 1024 + 1)}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "bot", "messages": [{"role": "user", "content": "x".repeat(256 * 1024 + 1)}]}),
        ),
    ] {
        let (s, v) = srv.call("POST", path, Some(&key), body);
        assert_eq!(s, 400, "{path}: {v}");
        assert_eq!(v["code"], "invalid_request", "{path}: {v}");
    }
    for (q, want) in [
        ("node=9223372036854775808", 400),
        ("node=-1", 400),
        ("node=9007199254740993", 400),
        ("node=42", 200),
    ] {
        let (s, v) = srv.call(
            "GET",
            &format!("/v1/agents/bot/memory/reservations?{q}"),
            Some(&key),
            Value::Null,
        );
        assert_eq!(s, want, "{q}: {v}");
        if want == 400 {
            assert_eq!(v["code"], "invalid_request", "{q}: {v}");
        }
    }
    srv.stop();
}
