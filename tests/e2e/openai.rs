//! Real clients against the server (installed in `.venv-test` by `make test`): the official
//! `openai` and `anthropic` SDKs and MCP's Python SDK, each a script in `tests/`.

use std::path::PathBuf;

use serde_json::json;

use crate::harness::{ADMIN, Server, sqlite_url};

/// Runs `tests/{script}` with the `.venv-test` Python (`make test` installs the SDKs there)
/// against `srv` and `args`; answers its standard output, asserting it succeeded and printed
/// `ok_line`.
fn run_script(srv: &Server, script: &str, args: &[&str], ok_line: &str) -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv-test/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: `make test` installs the SDKs there",
        python.display()
    );
    let out = std::process::Command::new(&python)
        .arg(root.join("tests").join(script))
        .arg(format!("http://{}", srv.addr))
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains(ok_line), "{stdout}");
    println!("{stdout}");
    stdout
}

/// A new tenant's key.
fn tenant(srv: &Server, name: &str) -> String {
    let (_, t) = srv.call(
        "POST",
        "/v1/admin/tenants",
        Some(ADMIN),
        json!({"name": name}),
    );
    t["api_key"].as_str().unwrap().to_string()
}

#[test]
fn the_official_openai_sdk_works_unchanged() {
    // SQLite: the SDK exercises HTTP, not the database.
    let srv = Server::start(&sqlite_url(), 1 << 20);
    let key = tenant(&srv, "sdk");
    let layers = json!([{"kind": "axioms", "content": "! Answer in one short sentence."}]);
    let (s, _) = srv.call(
        "POST",
        "/v1/agents",
        Some(&key),
        json!({"name": "helper", "layers": layers}),
    );
    assert_eq!(s, 201);
    run_script(&srv, "openai_sdk.py", &[&key, "helper"], "openai sdk ok");
}

/// What agent frameworks send, through the official SDK (tests/openai_tools.py): a tenant with
/// no agent, any model name, an e-mail as `user`, content parts, tool calls forced to their
/// schema (validated with `jsonschema`), streamed tool-call deltas, structured output, log
/// probabilities, seeds and stops.
#[test]
fn frameworks_calls_work_through_the_sdk_on_a_fresh_tenant() {
    let srv = Server::start(&sqlite_url(), 1 << 20);
    let key = tenant(&srv, "frameworks");
    let out = run_script(&srv, "openai_tools.py", &[&key], "openai tools ok");
    assert!(out.contains("openai responses ok"), "{out}");
    // Nothing but the default agent was created, once.
    let (_, agents) = srv.call("GET", "/v1/agents", Some(&key), serde_json::Value::Null);
    let names: Vec<&str> = agents["agents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["default"]);
}

/// One agent framework end to end (tests/agents_framework.py): the OpenAI Agents SDK runs a
/// two-turn task with two tools on Qwen2.5-Coder-1.5B-Instruct (`make models-test` fetches
/// it); every call parses and validates, the calls after the first reuse the cache, and the
/// history the SDK resends on every call matches the session's log (no fork).
#[test]
fn an_agent_framework_runs_a_tool_task_on_qwen2_5_coder_1_5b() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    assert!(
        model.is_file(),
        "{} is missing: run `make models-test`",
        model.display()
    );
    let mut c = crate::harness::test_config(&sqlite_url(), 1 << 20);
    c.model.path = model;
    c.model.context_tokens = 4096;
    // A full 4K context of this model's KV (28 layers) in the hot tier.
    c.model.hot_mib = Some(512);
    c.limits.requests_per_sec = 0;
    let srv = Server::start_with(c);
    let key = tenant(&srv, "agents");
    run_script(&srv, "agents_framework.py", &[&key], "agents framework ok");
    let (s, v) = srv.call(
        "GET",
        "/v1/agents/default/sessions",
        Some(&key),
        json!(null),
    );
    assert_eq!(s, 200, "{v}");
    let sessions = v["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 1, "a resent history forked the log: {v}");
    assert_eq!(sessions[0]["label"], "shopper@example.com", "{v}");
}

/// The official `anthropic` SDK (tests/anthropic_sdk.py) against Messages: its `x-api-key`
/// header, content blocks, a tool loop with a forced call, streaming, count_tokens.
#[test]
fn the_official_anthropic_sdk_works_unchanged() {
    let srv = Server::start(&sqlite_url(), 1 << 20);
    let key = tenant(&srv, "claude");
    run_script(&srv, "anthropic_sdk.py", &[&key], "anthropic sdk ok");
}

/// MCP's official Python SDK client against `/mcp` (tests/mcp_client.py): the memory tools and a
/// turn, scoped by the tenant key.
#[test]
fn an_mcp_client_uses_the_memory_graph() {
    let srv = Server::start(&sqlite_url(), 1 << 20);
    let (key, _) = srv.tenant_with_bot("mcp", "Be brief.");
    run_script(&srv, "mcp_client.py", &[&key, "bot"], "mcp ok");
    // The turn the MCP client ran is in the session's log.
    let (s, v) = srv.call(
        "GET",
        "/v1/agents/bot/sessions/mcp/cache",
        Some(&key),
        json!(null),
    );
    assert_eq!(s, 200, "{v}");
}

/// In a `user` session, tool results that end a request are logged with the turn (role `tool`,
/// before its reply): the next request reuses them from the cache, and after a restart that
/// lost the cache the turn with the tool results is replayed as it ran, so the next answer
/// equals a run that never restarted.
#[test]
fn a_session_s_tool_results_are_logged_reused_and_replayed() {
    let config = |url: &str| {
        let mut c = crate::harness::test_config(url, 1 << 20);
        c.memory.enabled = false;
        c.shadow.enabled = false;
        c.tiers.enabled = false;
        c
    };
    let system = json!({"role": "system", "content": "You are a weather assistant. Answer in one short sentence."});
    let ask = json!({"role": "user", "content": "What is the weather in Paris and in Lyon?"});
    let call = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Lyon\"}"}},
    ]});
    let paris =
        json!({"role": "tool", "tool_call_id": "c1", "content": "Paris: 14 C, light rain."});
    let lyon = json!({"role": "tool", "tool_call_id": "c2", "content": "Lyon: 19 C, sunny."});
    let follow = json!({"role": "user", "content": "Which city is warmer?"});
    let chat = |srv: &Server, key: &str, messages: serde_json::Value| {
        let (s, v) = srv.call(
            "POST",
            "/v1/chat/completions",
            Some(key),
            json!({"model": "bot", "user": "trip", "messages": messages, "max_tokens": 10}),
        );
        assert_eq!(s, 200, "{v}");
        v
    };
    let text = |v: &serde_json::Value| v["choices"][0]["message"]["content"].clone();
    let first = json!([system, ask]);
    // The client's conversation has the call where the model's first reply was: the log forks
    // there (`api/history.rs`), and the call, the results and their reply are logged.
    let tools = json!([system, ask, call, paris, lyon]);
    let last = |answered: &serde_json::Value| {
        json!([system, ask, call, paris, lyon,
               {"role": "assistant", "content": text(answered)}, follow])
    };
    // A run that keeps its cache.
    let url = sqlite_url();
    let srv = Server::start_with(config(&url));
    let (key, _) = srv.tenant_with_bot("t", "Be helpful.");
    chat(&srv, &key, first.clone());
    let answered = chat(&srv, &key, tools.clone());
    let reference = chat(&srv, &key, last(&answered));
    srv.stop();
    // The log: the question, the call, both tool results, the reply to them, the follow-up.
    let roles: Vec<String> = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = engram_store::Store::connect(&url).await.unwrap();
        let t = store.tenants().await.unwrap();
        let a = store.agents(&t[0].id).await.unwrap();
        let rows = store.turns(&a[0].id, "trip").await.unwrap();
        store.close().await;
        rows.iter()
            .map(|r| format!("{}:{}", r.role.as_str(), r.text))
            .collect()
    });
    assert_eq!(roles.len(), 7, "{roles:?}");
    assert!(roles[1].starts_with("assistant:<tool_call>"), "{roles:?}");
    assert_eq!(roles[2], "tool:Paris: 14 C, light rain.");
    assert_eq!(roles[3], "tool:Lyon: 19 C, sunny.");
    assert!(roles[4].starts_with("assistant:"), "{roles:?}");
    assert_eq!(
        roles[4],
        format!("assistant:{}", text(&answered).as_str().unwrap())
    );
    // The follow-up reused everything before its own message (its ~12 tokens, and at most a
    // block's worth before them).
    let u = &reference["usage"];
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        u["prompt_tokens"].as_u64().unwrap() - cached <= 12 + 16,
        "{u}"
    );
    // The same turns, a restart that loses the cache before the follow-up.
    let url = sqlite_url();
    let srv = Server::start_with(config(&url));
    let (key, _) = srv.tenant_with_bot("t", "Be helpful.");
    chat(&srv, &key, first);
    let answered_again = chat(&srv, &key, tools);
    assert_eq!(text(&answered_again), text(&answered));
    srv.stop();
    let srv = Server::start_with(config(&url));
    let again = chat(&srv, &key, last(&answered_again));
    let (_, m) = srv.call("GET", "/metrics", Some(ADMIN), serde_json::Value::Null);
    let m = m.as_str().unwrap_or_default().to_string();
    // Two turns, each its prompt and the conversation warmed after it.
    assert!(m.contains("engram_replayed_turns_total 4"), "{m}");
    assert_eq!(text(&again), text(&reference));
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"],
        reference["usage"]["prompt_tokens_details"]["cached_tokens"]
    );
    srv.stop();
}

/// A client that names a session with `user` and resends its history (issue 67, item 4): an
/// edited message forks the log where it differs — the session goes on with the client's
/// conversation, the old branch is kept as a session of its own, labelled — and the common
/// prefix is reused from the cache, which `cached_tokens` shows.
#[test]
fn a_resent_history_that_diverges_forks_the_log_and_reuses_the_common_prefix() {
    let mut c = crate::harness::test_config(&sqlite_url(), 1 << 20);
    c.memory.enabled = false;
    c.tiers.enabled = false;
    c.limits.requests_per_sec = 0;
    let srv = Server::start_with(c);
    let (key, _) = srv.tenant_with_bot("t", "You are a helpful assistant. Answer briefly.");
    let user = "alice@example.com";
    let chat = |messages: serde_json::Value| {
        let (s, v) = srv.call(
            "POST",
            "/v1/chat/completions",
            Some(&key),
            json!({"model": "bot", "user": user, "messages": messages, "max_tokens": 12,
                   "temperature": 0}),
        );
        assert_eq!(s, 200, "{v}");
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let u = &v["usage"];
        let prompt = u["prompt_tokens"].as_u64().unwrap();
        let cached = u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        (text, prompt, cached)
    };
    let q1 = "Name a large city in France.";
    let q2 = "Name a river that flows through it.";
    let q2_edited = "Name a famous museum there.";
    let (r1, _, _) = chat(json!([{"role": "user", "content": q1}]));
    let (r2, _, _) = chat(json!([
        {"role": "user", "content": q1}, {"role": "assistant", "content": r1},
        {"role": "user", "content": q2}]));
    // The session, found by its label.
    let sessions = |srv: &Server| {
        let (s, v) = srv.call("GET", "/v1/agents/bot/sessions", Some(&key), json!(null));
        assert_eq!(s, 200, "{v}");
        v["sessions"].as_array().unwrap().clone()
    };
    let listed = sessions(&srv);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["label"], user, "{listed:?}");
    assert_eq!(listed[0]["entries"], 4, "two turns: {listed:?}");
    let session = listed[0]["id"].as_str().unwrap().to_string();
    assert!(session.starts_with("u-"), "{session}");
    let log = |name: &str| {
        let (s, v) = srv.call(
            "GET",
            &format!("/v1/agents/bot/sessions/{name}/turns"),
            Some(&key),
            json!(null),
        );
        assert_eq!(s, 200, "{v}");
        v["turns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                format!(
                    "{}:{}",
                    t["role"].as_str().unwrap(),
                    t["text"].as_str().unwrap()
                )
            })
            .collect::<Vec<_>>()
    };
    let before = log(&session);
    // The second question edited: the first exchange is common, the rest is the client's.
    let (_, prompt, cached) = chat(json!([
        {"role": "user", "content": q1}, {"role": "assistant", "content": r1},
        {"role": "user", "content": q2_edited}]));
    let after = log(&session);
    assert_eq!(after.len(), 4, "{after:?}");
    assert_eq!(after[..2], before[..2], "the common part stays");
    assert_eq!(after[2], format!("user:{q2_edited}"));
    assert!(!after.iter().any(|t| t.contains(q2)), "{after:?}");
    // Everything but the edited message (and its block) came from the cache.
    assert!(
        cached > 0 && prompt - cached <= 16 + 16,
        "prompt {prompt}, cached {cached}"
    );
    // The old branch, whole, under its own label.
    let listed = sessions(&srv);
    assert_eq!(listed.len(), 2, "{listed:?}");
    let branch = listed.iter().find(|s| s["id"] != session.as_str()).unwrap();
    let label = branch["label"].as_str().unwrap();
    assert!(
        label.starts_with(user) && label.contains("entry 3"),
        "{label}"
    );
    let old = log(branch["id"].as_str().unwrap());
    assert_eq!(old, before);
    assert!(old[3].ends_with(&r2), "{old:?}");
    // A regenerate (the client drops the last reply and asks again): forks after the question
    // is dropped, and the prompt is the one the cache already holds but for the message.
    let (_, prompt, cached) = chat(json!([
        {"role": "user", "content": q1}, {"role": "assistant", "content": r1},
        {"role": "user", "content": q2_edited}]));
    assert!(
        prompt - cached <= 16 + 16,
        "prompt {prompt}, cached {cached}"
    );
    assert_eq!(log(&session).len(), 4);
    assert_eq!(sessions(&srv).len(), 3);
    // A client that resends the history exactly goes on from the log: no fork.
    let (r3, _, _) = chat(json!([{"role": "user", "content": "Thanks!"}]));
    assert_eq!(sessions(&srv).len(), 3);
    let now = log(&session);
    assert_eq!(now.len(), 6);
    assert_eq!(now[5], format!("assistant:{r3}"));
    // Unknown sessions and bad paging.
    let (s, v) = srv.call(
        "GET",
        "/v1/agents/bot/sessions/nobody/turns",
        Some(&key),
        json!(null),
    );
    assert_eq!((s, v["code"].as_str()), (404, Some("not_found")), "{v}");
    let (s, v) = srv.call(
        "GET",
        "/v1/agents/bot/sessions?limit=0",
        Some(&key),
        json!(null),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (400, Some("invalid_request")),
        "{v}"
    );
    srv.stop();
}
