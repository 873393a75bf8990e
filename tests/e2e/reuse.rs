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
    // All of turn 1's prompt but its volatile block (the memories layer, which depends on the
    // message, and the clock) and its message.
    assert!(
        c2 + 60 >= p1,
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

/// 100 turns of one session in a context of 1,024 tokens (`model.context_tokens`): no turn
/// answers `context_overflow`, the conversation's window moves in a few steps, and once it has
/// started to move the turns still reuse at least 70 % of their prompts from the cache.
#[test]
fn a_100_turn_session_never_overflows_and_keeps_its_cache() {
    let mut c = crate::harness::test_config(&sqlite_url(), 1 << 20);
    c.model.context_tokens = 1_024;
    c.memory.enabled = false;
    c.tiers.enabled = false;
    c.shadow.enabled = false;
    let srv = Server::start_with(c);
    let (key, _) = srv.tenant_with_bot("long", "You are terse. Answer in a few words.");
    let (mut steps, mut last_dropped) = (0, 0);
    let (mut prompt, mut cached) = (0u64, 0u64);
    for i in 0..100 {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/long/turns",
            Some(&key),
            json!({"message": format!("Note {i}: the parcel for desk {} arrived.", i * 7 % 31), "max_tokens": 6}),
        );
        assert_eq!(s, 200, "turn {i}: {v}");
        let b = &v["budgets"];
        assert_eq!(b["context"], 1_024, "{v}");
        let dropped = b["dropped_turns"].as_u64().unwrap();
        assert!(
            dropped >= last_dropped,
            "turn {i}: the window went back: {v}"
        );
        if dropped > last_dropped {
            steps += 1;
        }
        if last_dropped > 0 {
            prompt += v["usage"]["prompt_tokens"].as_u64().unwrap();
            cached += v["usage"]["cached_tokens"].as_u64().unwrap();
        }
        last_dropped = dropped;
    }
    assert!(steps >= 2, "the window moved {steps} times");
    assert!(steps <= 20, "the window moved {steps} times in 100 turns");
    let share = cached as f64 / prompt.max(1) as f64;
    println!("window steps {steps}, cached share after the first step {share:.3}");
    assert!(
        share >= 0.7,
        "cached share {share:.3} after the window started to move"
    );
    srv.stop();
}

/// A turn tokenizes only its new text: the segments every turn shows again (the layers, each
/// earlier turn) keep their token ids from the turn that first tokenized them.
#[test]
fn a_turn_tokenizes_only_its_new_text() {
    let mut config = crate::harness::test_config(&sqlite_url(), 1 << 20);
    config.memory.enabled = false;
    let srv = Server::start_with(config);
    let (key, _) = srv.tenant_with_bot("t", &long_text("rules of the house", 20));
    let counts = || {
        let (_, m) = srv.call("GET", "/metrics", Some(ADMIN), serde_json::Value::Null);
        let m = m.as_str().unwrap_or_default().to_string();
        let read = |ids: &str| {
            m.lines()
                .find_map(|l| {
                    l.strip_prefix(&format!("engram_prompt_segments_total{{ids=\"{ids}\"}} "))
                })
                .and_then(|n| n.trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {ids} counter in {m}"))
        };
        (read("tokenized"), read("reused"))
    };
    let turn = |i: usize| {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/s/turns",
            Some(&key),
            json!({"message": format!("Question number {i}: name a colour."), "max_tokens": 6}),
        );
        assert_eq!(s, 200, "{v}");
    };
    for i in 0..5 {
        turn(i);
    }
    let (tokenized, reused) = counts();
    turn(5);
    let (t, r) = counts();
    // New this turn: its message as the prompt shows it, then the message and the reply as the
    // conversation shows them in the prefix warmed for the next turn.
    assert!(
        t - tokenized <= 4,
        "turn 6 tokenized {} segments",
        t - tokenized
    );
    // Reused: the layers and the ten earlier turns, at least once each.
    assert!(r - reused >= 11, "turn 6 reused {} segments", r - reused);
}

/// DESIGN §2's expanded budgets are used when they fit in half the context and the tiered
/// cache has room for what they add (the tier bridge's last cycle saw enough free cold blocks);
/// otherwise the standard ones. The turn's answer says which.
#[test]
fn expanded_budgets_are_used_when_the_tiered_cache_has_room() {
    // Axioms 200 + system state 2,000 + awareness 1,200 + memories 300 (its own budget):
    // 3,700 expanded tokens, within half of SmolLM2's 8,192.
    let set = |tiers: bool, cold_mib: u64| {
        let mut c = crate::harness::test_config(&sqlite_url(), 1 << 20);
        c.memory.enabled = false;
        c.tiers.enabled = tiers;
        c.model.cold_mib = Some(cold_mib);
        let srv = Server::start_with(c);
        let (key, _) = srv.tenant_with_bot("t", "Answer in one short sentence.");
        for (kind, content, budget) in [
            ("system_state", "Load is normal.", None),
            ("awareness", "The user is at work.", None),
            ("memories", "The user likes tea.", Some(300)),
        ] {
            let mut body = json!({ "content": content });
            if let Some(b) = budget {
                body["budget"] = json!(b);
            }
            let (s, v) = srv.call(
                "PUT",
                &format!("/v1/agents/bot/layers/{kind}"),
                Some(&key),
                body,
            );
            assert_eq!(s, 200, "{v}");
        }
        if tiers {
            let (s, v) = srv.call("POST", "/v1/admin/tiers/cycle", Some(ADMIN), json!(null));
            assert_eq!(s, 200, "{v}");
        }
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/s/turns",
            Some(&key),
            json!({"message": "Hello.", "max_tokens": 2}),
        );
        assert_eq!(s, 200, "{v}");
        srv.stop();
        v["budgets"]["set"].as_str().unwrap().to_string()
    };
    assert_eq!(set(true, 256), "expanded");
    // No tier bridge: nothing says the cache has room.
    assert_eq!(set(false, 256), "standard");
    // A cold tier too small for the 2,000 tokens they add.
    assert_eq!(set(true, 1), "standard");
}

/// `model.relocate_segments`: two agents of one tenant share their axioms, rules and
/// capabilities around identities of different lengths. With the flag on, the second agent's
/// first turn copies the shared layers from the first agent's blocks (the metrics count the
/// run, the admin block listing shows the reuse on the first agent's blocks); with it off,
/// nothing is relocated. Another tenant never reuses them.
#[test]
fn shared_layers_after_another_identity_are_relocated_only_when_enabled() {
    let relocated = |srv: &Server| {
        let (_, m) = srv.raw("GET", "/metrics", Some(ADMIN), b"");
        let m = String::from_utf8(m).unwrap();
        let value = |name: &str| {
            m.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("{name} missing from /metrics"))
        };
        (
            value("engram_relocated_runs_total "),
            value("engram_relocated_blocks_total "),
        )
    };
    for on in [true, false] {
        let mut config = crate::harness::test_config(&sqlite_url(), 1 << 20);
        config.model.relocate_segments = on;
        let srv = Server::start_with(config);
        let mut keys = Vec::new();
        for (tenant, agents) in [("acme", ["alpha", "beta"]), ("other", ["gamma", "delta"])] {
            let (s, t) = srv.call(
                "POST",
                "/v1/admin/tenants",
                Some(ADMIN),
                json!({ "name": tenant }),
            );
            assert_eq!(s, 201, "{t}");
            let tenant_id = t["tenant"]["id"].as_str().unwrap().to_string();
            let key = t["api_key"].as_str().unwrap().to_string();
            for (i, name) in agents.iter().enumerate() {
                let layers = json!([
                    {"kind": "axioms", "content": long_text("honesty", 4)},
                    {"kind": "identity", "content": long_text(name, 2 + 3 * i)},
                    {"kind": "rules", "content": long_text("billing", 40)},
                    {"kind": "capabilities", "content": long_text("tools", 30)}
                ]);
                let (s, v) = srv.call(
                    "POST",
                    "/v1/agents",
                    Some(&key),
                    json!({"name": name, "layers": layers}),
                );
                assert_eq!(s, 201, "{v}");
            }
            keys.push((tenant_id, key, agents));
        }
        let turn = |key: &str, agent: &str| {
            let (s, v) = srv.call(
                "POST",
                &format!("/v1/agents/{agent}/sessions/s1/turns"),
                Some(key),
                json!({"message": format!("Which invoices are overdue, {agent}?"), "max_tokens": 2}),
            );
            assert_eq!(s, 200, "{v}");
        };
        let (acme, acme_key, [alpha, beta]) = &keys[0];
        // Relocation counts on acme's blocks, once the background work of its turns (the
        // canonical prefix warmed after each turn) has settled.
        let acme_counts = || {
            let (_, page) = srv.call(
                "GET",
                &format!("/v1/admin/blocks?tenant={acme}&limit=1000"),
                Some(ADMIN),
                serde_json::Value::Null,
            );
            page["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| {
                    (
                        b["id"].as_u64().unwrap(),
                        b["relocations"].as_u64().unwrap(),
                    )
                })
                .collect::<Vec<_>>()
        };
        let settled = || {
            let mut last = (relocated(&srv), acme_counts());
            for _ in 0..50 {
                std::thread::sleep(std::time::Duration::from_millis(300));
                let now = (relocated(&srv), acme_counts());
                if now == last {
                    return now;
                }
                last = now;
            }
            panic!("the background work did not settle");
        };
        turn(acme_key, alpha);
        let (first, _) = settled();
        assert_eq!(first, (0, 0), "nothing to relocate from yet");
        turn(acme_key, beta);
        let ((runs, blocks), _) = settled();
        if !on {
            assert_eq!((runs, blocks), (0, 0), "relocation is off by default");
            continue;
        }
        // ~70 lines of shared layers: well over a hundred tokens copied.
        assert!(runs >= 1 && blocks >= 8, "runs {runs}, blocks {blocks}");
        let (s, page) = srv.call(
            "GET",
            &format!("/v1/admin/blocks?tenant={acme}&limit=1000"),
            Some(ADMIN),
            serde_json::Value::Null,
        );
        assert_eq!(s, 200, "{page}");
        let reused: Vec<&serde_json::Value> = page["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["relocations"].as_u64().unwrap() > 0)
            .collect();
        // Each run copies from the same blocks of alpha's prompt.
        assert!(
            reused.len() as u64 >= blocks / runs,
            "{} blocks show reuse",
            reused.len()
        );
        assert!(
            reused
                .iter()
                .all(|b| !["axioms", "identity"].contains(&b["source"].as_str().unwrap())),
            "what differs, or precedes what differs, is never reused"
        );
        // The other tenant's agents share the same texts but never acme's blocks.
        let (_, other_key, [gamma, _]) = &keys[1];
        let (_, before) = settled();
        turn(other_key, gamma);
        let (_, after) = settled();
        let reused = |c: &[(u64, u64)]| c.iter().map(|&(_, r)| r).sum::<u64>();
        assert_eq!(
            reused(&after),
            reused(&before),
            "never across tenants: acme's blocks were not read for the other tenant"
        );
    }
}
