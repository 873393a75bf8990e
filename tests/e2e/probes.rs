//! The tenant-probe suite: tenant B tries every tenant route against tenant A's agents,
//! sessions, blocks, memory nodes, edges, reservations and cache files (read, list, warm,
//! export, import, delete, link), a crafted import, and a `cached_tokens` probe for A's private
//! text. Every probe is refused or answers only B's own (empty) data, and A's next answer and
//! its `cached_tokens` are the same as before the probes.

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, sqlite_url, test_config};

const PRIVATE: &str = "The launch code of the Alpha project is ZEBRA-4471-ORCHID. \
                       Never tell anyone outside Alpha.";

#[test]
fn tenant_b_reaches_nothing_of_tenant_a() {
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    config.limits.requests_per_sec = 0;
    // A's own turns must not change A's next prompt: no episodes from turns, no tier moves.
    config.memory.ingest_turns = false;
    config.tiers.enabled = false;
    let srv = Server::start_with(config);
    let (ka, agent_a) = srv.tenant_with_bot("alpha", PRIVATE);
    let (kb, _) = srv.tenant_with_bot("beta", "Be kind.");
    let a_agent_id = agent_a["agent"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let (_, tenants) = srv.call("GET", "/v1/admin/tenants", Some(ADMIN), Value::Null);
    let ta = tenants["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "alpha")
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    // A's data: an agent with a private axiom, a session with turns, a node, an edge, a
    // reservation, a cache file.
    let turn = |key: &str, session: &str, msg: &str| {
        let (s, v) = srv.call(
            "POST",
            &format!("/v1/agents/bot/sessions/{session}/turns"),
            Some(key),
            json!({"message": msg, "max_tokens": 4}),
        );
        assert_eq!(s, 200, "{v}");
        (
            v["text"].as_str().unwrap().to_string(),
            v["usage"]["cached_tokens"].as_u64().unwrap(),
        )
    };
    turn(&ka, "warm", "Hello?");
    turn(&ka, "secret", "Remember: the vault opens on Tuesdays.");
    let node = |key: &str, text: &str| {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/memory/nodes",
            Some(key),
            json!({"kind": "fact", "text": text}),
        );
        assert_eq!(s, 201, "{v}");
        v["id"].as_i64().unwrap()
    };
    let n1 = node(&ka, "The vault opens on Tuesdays.");
    let n2 = node(&ka, "Only Alpha staff know the vault.");
    // Ids are random, not counters whose gaps would show other tenants' activity.
    assert!((n2 - n1).abs() > 1000, "{n1} then {n2}");
    let (s, e) = srv.call(
        "POST",
        "/v1/agents/bot/memory/edges",
        Some(&ka),
        json!({"from": n1, "to": n2, "kind": "relates_to"}),
    );
    assert_eq!(s, 201, "{e}");
    let edge = e["id"].as_i64().unwrap();
    let (s, q) = srv.call(
        "POST",
        "/v1/agents/bot/memory/query",
        Some(&ka),
        json!({"text": "vault", "reserve": true}),
    );
    assert_eq!(s, 200, "{q}");
    let (_, rs) = srv.call(
        "GET",
        "/v1/agents/bot/memory/reservations",
        Some(&ka),
        Value::Null,
    );
    let reservation = rs["reservations"]
        .as_array()
        .and_then(|r| r.first())
        .map(|r| r["id"].clone())
        .unwrap_or_else(|| panic!("the query reserved nothing: {q} {rs}"));
    let rid = reservation.as_u64().unwrap();
    assert!(rid > 1000, "reservation ids are random: {rid}");
    let (s, a_file) = srv.raw(
        "GET",
        "/v1/agents/bot/sessions/secret/cache/export",
        Some(&ka),
        b"",
    );
    assert_eq!(s, 200);
    let (s, a_agent_file) = srv.raw("GET", "/v1/agents/bot/cache/export", Some(&ka), b"");
    assert_eq!(s, 200);
    // A steady state first: the same question once, so that A's own cache is settled.
    turn(&ka, "check-0", "What day does the vault open?");
    let before = turn(&ka, "check-1", "What day does the vault open?");
    let blocks_of_a = |srv: &Server| {
        let (_, p) = srv.call(
            "GET",
            &format!("/v1/admin/blocks?tenant={ta}&limit=1"),
            Some(ADMIN),
            Value::Null,
        );
        p["total"].as_u64().unwrap()
    };
    let a_blocks = blocks_of_a(&srv);

    // B's probes. B has an agent named `bot` of its own: A's names resolve to B's own data,
    // A's ids to nothing.
    let probes = std::cell::Cell::new(0usize);
    let count = || probes.set(probes.get() + 1);
    let probe = |method: &str, path: String, body: Value, ok: &[u16]| {
        count();
        let sent = format!("{path} {body}");
        let (s, v) = srv.call(method, &path, Some(&kb), body);
        assert!(ok.contains(&s), "{method} {path}: {s} {v}");
        // Nothing of A that B did not send itself (a 404 may echo the id B asked for).
        let text = v.to_string();
        for leak in ["ZEBRA", "vault", "Tuesday", &a_agent_id, &ta] {
            assert!(
                sent.contains(leak) || !text.contains(leak),
                "{method} {path} leaked {leak}: {text}"
            );
        }
        v
    };
    let id = &a_agent_id;
    // A's agent by id: 404 everywhere.
    for (m, p) in [
        ("GET", format!("/v1/agents/{id}")),
        ("GET", format!("/v1/agents/{id}/layers")),
        (
            "GET",
            format!("/v1/agents/{id}/sessions/secret/working-memory"),
        ),
        ("GET", format!("/v1/agents/{id}/sessions/secret/cache")),
        ("GET", format!("/v1/agents/{id}/sessions")),
        ("GET", format!("/v1/agents/{id}/sessions/secret/turns")),
        (
            "GET",
            format!("/v1/agents/{id}/sessions/secret/cache/export"),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/sessions/secret/cache/save"),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/sessions/secret/cache/load"),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/sessions/secret/cache/evict"),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/sessions/secret/cache/archive"),
        ),
        ("GET", format!("/v1/agents/{id}/cache/export")),
        ("POST", format!("/v1/agents/{id}/cache/import")),
        ("GET", format!("/v1/agents/{id}/memory/nodes")),
        ("GET", format!("/v1/agents/{id}/memory/edges")),
        ("GET", format!("/v1/agents/{id}/memory/reservations")),
        ("DELETE", format!("/v1/agents/{id}/sessions/secret")),
        ("DELETE", format!("/v1/agents/{id}")),
    ] {
        probe(m, p, Value::Null, &[404]);
    }
    for (m, p, body) in [
        (
            "PUT",
            format!("/v1/agents/{id}/layers/axioms"),
            json!({"content": "pwned"}),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/context"),
            json!({"message": "hi"}),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/sessions/secret/turns"),
            json!({"message": "hi", "max_tokens": 1}),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/sessions/secret/context"),
            json!({"entries": [{"role": "system", "content": "pwned"}]}),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/sessions/secret/fork"),
            json!({"session": "stolen"}),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/sessions/secret/prefetch"),
            json!({"text": "When does the vault open"}),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/memory/nodes"),
            json!({"kind": "fact", "text": "x"}),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/memory/query"),
            json!({"text": "vault"}),
        ),
        (
            "POST",
            format!("/v1/agents/{id}/memory/edges"),
            json!({"from": n1, "to": n2, "kind": "relates_to"}),
        ),
    ] {
        probe(m, p, body, &[404]);
    }
    // A's agent id as `model`: not A's agent but B's own default one (a name that is none of
    // B's agents), with nothing of A's in the answer.
    let v = probe(
        "POST",
        "/v1/chat/completions".into(),
        json!({"model": a_agent_id, "messages": [{"role": "user", "content": "What day does the vault open?"}], "max_tokens": 8, "temperature": 0}),
        &[200],
    );
    assert_eq!(v["model"], "default", "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{v}"
    );
    // A's session name as `user` (one the probes below do not use), through B's own agent:
    // B's own, empty session.
    let v = probe(
        "POST",
        "/v1/chat/completions".into(),
        json!({"model": "bot", "user": "warm", "messages": [{"role": "user", "content": "What did I tell you to remember?"}], "max_tokens": 8, "temperature": 0}),
        &[200],
    );
    assert_eq!(v["model"], "bot", "{v}");
    // The tokenizer and the embedder hold no tenant data; they answer B for B.
    probe(
        "POST",
        "/tokenize".into(),
        json!({"content": "When does the vault open?"}),
        &[200],
    );
    probe(
        "POST",
        "/detokenize".into(),
        json!({"tokens": [1, 2, 3]}),
        &[200],
    );
    probe(
        "POST",
        "/v1/embeddings".into(),
        json!({"input": ["the launch code"]}),
        &[200, 503],
    );
    // A's node, edge and reservation ids through B's own agent: 404.
    for n in [n1, n2] {
        probe(
            "GET",
            format!("/v1/agents/bot/memory/nodes/{n}"),
            Value::Null,
            &[404],
        );
        probe(
            "PATCH",
            format!("/v1/agents/bot/memory/nodes/{n}"),
            json!({"text": "pwned"}),
            &[404],
        );
        probe(
            "DELETE",
            format!("/v1/agents/bot/memory/nodes/{n}"),
            Value::Null,
            &[404],
        );
    }
    probe(
        "DELETE",
        format!("/v1/agents/bot/memory/edges/{edge}"),
        Value::Null,
        &[404],
    );
    probe(
        "POST",
        "/v1/agents/bot/memory/edges".into(),
        json!({"from": n1, "to": n2, "kind": "relates_to"}),
        &[404],
    );
    probe(
        "POST",
        format!("/v1/agents/bot/memory/reservations/{reservation}/warm"),
        Value::Null,
        &[404],
    );
    // Listings under B's own names hold only B's own data.
    for path in [
        "/v1/agents",
        "/v1/agents/bot/memory/nodes",
        "/v1/agents/bot/memory/edges",
        "/v1/agents/bot/memory/reservations",
        "/v1/agents/bot/sessions",
        "/v1/models",
    ] {
        let v = probe("GET", path.into(), Value::Null, &[200]);
        assert!(!v.to_string().contains("secret"), "{path}: {v}");
    }
    // A's session's log under B's agent: B has no such session.
    probe(
        "GET",
        "/v1/agents/bot/sessions/secret/turns".into(),
        Value::Null,
        &[404],
    );
    let v = probe(
        "POST",
        "/v1/agents/bot/memory/query".into(),
        json!({"text": "When does the vault open? ZEBRA launch code"}),
        &[200],
    );
    assert!(v["results"].as_array().is_none_or(Vec::is_empty) || !v.to_string().contains("vault"));
    // A prefetch under B's own agent with A's session name and A's words: B's own (empty)
    // memory graph, nothing of A's recalled or reserved.
    let v = probe(
        "POST",
        "/v1/agents/bot/sessions/secret/prefetch".into(),
        json!({"text": "When does the vault open? ZEBRA launch code"}),
        &[200],
    );
    assert!(!v.to_string().contains("vault"), "{v}");
    assert_ne!(v["outcome"], "reserved", "{v}");
    // A fork of A's session name under B's agent: B has no such session.
    probe(
        "POST",
        "/v1/agents/bot/sessions/secret/fork".into(),
        json!({"session": "stolen"}),
        &[404],
    );
    // A's session name under B's agent: B's own, empty.
    for (m, p) in [
        ("GET", "/v1/agents/bot/sessions/secret/working-memory"),
        ("GET", "/v1/agents/bot/sessions/secret/cache/export"),
        ("POST", "/v1/agents/bot/sessions/secret/cache/load"),
        ("POST", "/v1/agents/bot/sessions/secret/cache/evict"),
        ("POST", "/v1/agents/bot/sessions/secret/cache/archive"),
        ("GET", "/v1/agents/bot/cache/export"),
        ("DELETE", "/v1/agents/bot/sessions/secret"),
    ] {
        probe(m, p.into(), Value::Null, &[200, 404]);
    }
    // Admin routes with a tenant key: 401.
    for (m, p) in [
        ("GET", "/v1/admin/tenants".to_string()),
        ("GET", format!("/v1/admin/blocks?tenant={ta}")),
        ("GET", "/v1/admin/shadow".into()),
        ("GET", "/v1/admin/memory".into()),
        ("GET", "/v1/admin/reservations".into()),
        ("GET", "/v1/admin/cache".into()),
        ("GET", format!("/v1/admin/tenants/{ta}/memory/nodes/1")),
        ("GET", "/metrics".into()),
        ("POST", format!("/v1/admin/tenants/{ta}/keys")),
        ("DELETE", format!("/v1/admin/tenants/{ta}")),
        ("GET", "/v1/admin/keys".into()),
        ("DELETE", "/v1/admin/keys/akey_0000000000000000".into()),
    ] {
        probe(m, p, Value::Null, &[401]);
    }
    probe(
        "POST",
        "/v1/admin/keys".into(),
        json!({"name": "mine", "scopes": ["admin"]}),
        &[401],
    );
    // A's memory through B's agent, recalled as A's session would: B's own, empty.
    probe(
        "POST",
        "/v1/agents/bot/memory/query".into(),
        json!({"text": "When does the vault open?", "session": "secret"}),
        &[200, 503],
    );
    probe(
        "PUT",
        format!("/v1/admin/tenants/{ta}/agents/bot/layers/axioms/public"),
        json!({"public": true}),
        &[401],
    );
    // The cached_tokens probe: B builds A's exact prompt (same axioms, same question) and asks:
    // nothing of A's cache is reused, so B cannot learn what A has computed.
    let (s, _) = srv.call(
        "PUT",
        "/v1/agents/bot/layers/axioms",
        Some(&kb),
        json!({"content": PRIVATE}),
    );
    assert_eq!(s, 200);
    let (_, cached) = turn(&kb, "probe", "What day does the vault open?");
    count();
    assert_eq!(cached, 0, "B reused {cached} tokens of A's private prompt");
    // A's cache file imported by B lands under B's salt (and never as public blocks).
    let (s, _) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/stolen/cache/import",
        Some(&kb),
        &a_file,
    );
    assert!(s == 200 || s == 422, "{s}");
    count();
    // A's agent file imported by B: B's own sessions of the same names, under B's salt.
    let (s, _) = srv.raw(
        "POST",
        "/v1/agents/bot/cache/import",
        Some(&kb),
        &a_agent_file,
    );
    assert!(s == 200 || s == 422, "{s}");
    count();
    let (_, public) = srv.call(
        "GET",
        "/v1/admin/blocks?tenant=public&limit=1",
        Some(ADMIN),
        Value::Null,
    );
    assert_eq!(public["total"], 0, "{public}");

    // A is untouched: same answer, same reuse, same blocks.
    let after = turn(&ka, "check-2", "What day does the vault open?");
    assert_eq!(after, before, "A's answer or cached_tokens changed");
    assert!(blocks_of_a(&srv) >= a_blocks);
    let (s, v) = srv.call("GET", "/v1/agents/bot/memory/nodes", Some(&ka), Value::Null);
    assert_eq!(s, 200);
    let texts: Vec<&str> = v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["text"].as_str())
        .collect();
    assert!(texts.contains(&"The vault opens on Tuesdays."), "{texts:?}");
    assert!(!texts.contains(&"pwned"));
    println!("tenant probes: {}", probes.get());
    srv.stop();
}
