//! What a request carries stays in its session (issue 64, item 1): an OpenAI request's system
//! text is never stored (issue 67: it is the prompt's own segment, never spilled), and the
//! session's episodes are recalled only in that session unless the agent's `memory_scope` is
//! `agent`; deleting the session removes them, with their vectors.

use serde_json::{Value, json};

use crate::harness::{Server, sqlite_url, test_config};

const PIN: &str = "Alice's bank account PIN is 4417 and her card ends in 9032.";

/// A system prompt of about 3K tokens whose last line (once the least likely to be kept) is
/// the PIN.
fn alice_system_prompt() -> String {
    let mut lines: Vec<String> = (0..150)
        .map(|i| format!("Guideline {i}: answer politely and keep replies short and on topic."))
        .collect();
    lines.push(PIN.to_string());
    lines.join("\n")
}

fn chat(srv: &Server, key: &str, model: &str, user: &str, messages: Value) {
    let (s, v) = srv.call(
        "POST",
        "/v1/chat/completions",
        Some(key),
        json!({"model": model, "user": user, "messages": messages, "max_tokens": 4,
               "temperature": 0}),
    );
    assert_eq!(s, 200, "{v}");
}

/// Nodes of `agent` whose text holds `needle`: (id, session).
fn nodes_with(srv: &Server, key: &str, agent: &str, needle: &str) -> Vec<(i64, Value)> {
    let (s, v) = srv.call(
        "GET",
        &format!("/v1/agents/{agent}/memory/nodes?limit=1000"),
        Some(key),
        Value::Null,
    );
    assert_eq!(s, 200, "{v}");
    v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["text"].as_str().unwrap().contains(needle))
        .map(|n| (n["id"].as_i64().unwrap(), n["session_id"].clone()))
        .collect()
}

/// Ids a recall of `text` as a turn of `session` would see.
fn recalled(srv: &Server, key: &str, agent: &str, session: &str, text: &str) -> Vec<i64> {
    let (s, v) = srv.call(
        "POST",
        &format!("/v1/agents/{agent}/memory/query"),
        Some(key),
        json!({"text": text, "session": session, "k": 16}),
    );
    assert_eq!(s, 200, "{v}");
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect()
}

/// The memories a preview of `session`'s next turn would show.
fn previewed(srv: &Server, key: &str, agent: &str, session: &str, text: &str) -> Vec<i64> {
    let (s, v) = srv.call(
        "POST",
        &format!("/v1/agents/{agent}/context"),
        Some(key),
        json!({"message": text, "session": session}),
    );
    assert_eq!(s, 200, "{v}");
    v["memories"]
        .as_array()
        .map(|a| a.iter().map(|x| x.as_i64().unwrap()).collect())
        .unwrap_or_default()
}

#[test]
fn one_end_user_s_system_text_and_turns_never_reach_another_session() {
    let mut config = test_config(&sqlite_url(), 256 * 1024);
    config.limits.requests_per_sec = 0;
    let srv = Server::start_with(config);
    let (key, _) = srv.tenant_with_bot("platform", "You are a helpful assistant.");
    let ask = "Where does my sister live?";
    chat(
        &srv,
        &key,
        "bot",
        "alice",
        json!([{"role": "system", "content": alice_system_prompt()},
               {"role": "user", "content": "Hello, I am Alice and my sister lives in Lisbon."}]),
    );
    // The request's system text (3K tokens, over the rules budget) is the prompt's own
    // segment, never cut and never spilled: nothing of it is stored, in any session.
    assert!(nodes_with(&srv, &key, "bot", "4417").is_empty());
    assert!(nodes_with(&srv, &key, "bot", "Guideline").is_empty());
    // The turn is an episode of Alice's session, not of the agent.
    let episode = nodes_with(&srv, &key, "bot", "Lisbon");
    assert!(
        !episode.is_empty() && episode.iter().all(|(_, s)| s == "alice"),
        "{episode:?}"
    );
    // Alice's own session recalls it (so a recall that could leak would find it) ...
    let own = recalled(&srv, &key, "bot", "alice", ask);
    assert!(episode.iter().any(|(id, _)| own.contains(id)), "{own:?}");
    // ... Bob's does not, in a recall or in the prompt of his turn.
    chat(
        &srv,
        &key,
        "bot",
        "bob",
        json!([{"role": "user", "content": ask}]),
    );
    let bob = recalled(&srv, &key, "bot", "bob", ask);
    let bob_prompt = previewed(&srv, &key, "bot", "bob", ask);
    for (id, _) in &episode {
        assert!(!bob.contains(id), "bob recalls {id}: {bob:?}");
        assert!(!bob_prompt.contains(id), "bob's prompt shows {id}");
    }
    // Deleting Alice's session removes her episodes, and their vectors.
    let (s, d) = srv.call(
        "DELETE",
        "/v1/agents/bot/sessions/alice",
        Some(&key),
        Value::Null,
    );
    assert_eq!(s, 200, "{d}");
    assert!(d["memory_nodes"].as_u64().unwrap() >= 1, "{d}");
    assert!(nodes_with(&srv, &key, "bot", "Lisbon").is_empty());
    let (_, stats) = srv.call(
        "GET",
        "/v1/admin/memory",
        Some(crate::harness::ADMIN),
        Value::Null,
    );
    assert_eq!(
        stats["nodes"], stats["vectors"],
        "a vector outlived its node: {stats}"
    );

    // An agent whose memory is agent-wide shares what one session brought with the others.
    let (s, v) = srv.call(
        "POST",
        "/v1/agents",
        Some(&key),
        json!({"name": "team", "memory_scope": "agent",
               "layers": [{"kind": "axioms", "content": "You are a helpful assistant."}]}),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["agent"]["memory_scope"], "agent", "{v}");
    chat(
        &srv,
        &key,
        "team",
        "alice",
        json!([{"role": "system", "content": alice_system_prompt()},
               {"role": "user", "content": "Hello, my sister lives in Lisbon."}]),
    );
    assert!(nodes_with(&srv, &key, "team", "4417").is_empty());
    let shared = nodes_with(&srv, &key, "team", "Lisbon");
    assert!(!shared.is_empty(), "{shared:?}");
    assert!(
        shared.iter().all(|(_, s)| s == "alice"),
        "still Alice's, deleted with her session: {shared:?}"
    );
    let bob = recalled(&srv, &key, "team", "bob", ask);
    assert!(shared.iter().any(|(id, _)| bob.contains(id)), "{bob:?}");
    // A scope nobody knows is refused, and no agent is made.
    let (s, v) = srv.call(
        "POST",
        "/v1/agents",
        Some(&key),
        json!({"name": "odd", "memory_scope": "everyone"}),
    );
    assert_eq!(s, 400, "{v}");
    let (s, _) = srv.call("GET", "/v1/agents/odd", Some(&key), Value::Null);
    assert_eq!(s, 404);
    srv.stop();
}

/// Query embeddings cached now (all tenants').
fn cached_queries(srv: &Server) -> u64 {
    let (s, stats) = srv.call(
        "GET",
        "/v1/admin/memory",
        Some(crate::harness::ADMIN),
        Value::Null,
    );
    assert_eq!(s, 200, "{stats}");
    stats["cached_queries"].as_u64().unwrap()
}

/// Deleting a session forgets every text its requests embedded — its messages, its prefetches,
/// memory queries asked as the session — and leaves the agent's own and other sessions' cached.
#[test]
fn deleting_a_session_forgets_the_texts_its_requests_embedded() {
    let mut config = test_config(&sqlite_url(), 256 * 1024);
    config.limits.requests_per_sec = 0;
    // The reserver (off by default) would recall after a turn in the background, asked as the
    // session and forgotten with it; off, the counts below do not depend on when it ran.
    assert!(!config.memory.reserve);
    let srv = Server::start_with(config);
    let (key, _) = srv.tenant_with_bot("embedder", "You are a helpful assistant.");
    let call = |path: &str, body: Value| {
        let (s, v) = srv.call("POST", path, Some(&key), body);
        assert_eq!(s, 200, "{path}: {v}");
    };
    // The agent's own query (no session) and another session's turn stay cached.
    call(
        "/v1/agents/bot/memory/query",
        json!({"text": "What does the agent know about tea?"}),
    );
    call(
        "/v1/agents/bot/sessions/keep/turns",
        json!({"message": "My cat is called Miso.", "max_tokens": 2}),
    );
    let before = cached_queries(&srv);
    call(
        "/v1/agents/bot/sessions/gone/turns",
        json!({"message": "My locker code is 5521.", "max_tokens": 2}),
    );
    call(
        "/v1/agents/bot/sessions/gone/prefetch",
        json!({"text": "Next I will ask about my locker code 5521."}),
    );
    call(
        "/v1/agents/bot/memory/query",
        json!({"text": "Which locker code did I give?", "session": "gone"}),
    );
    let during = cached_queries(&srv);
    assert!(
        during >= before + 3,
        "the session's texts were embedded: {before} -> {during}"
    );
    let (s, v) = srv.call(
        "DELETE",
        "/v1/agents/bot/sessions/gone",
        Some(&key),
        Value::Null,
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        cached_queries(&srv),
        before,
        "every text the deleted session embedded is forgotten, nothing else"
    );
    srv.stop();
}
