//! The timing side channel (issue 64, item 3): an attacker tenant times guessed texts, half of
//! which a victim tenant sent just before, on every route that takes text — a native turn, an
//! OpenAI chat completion, a memory query — and its best classifier (the latency itself, in
//! whichever direction separates better) is scored by ROC AUC over 300 trials per route. Every
//! cache a text can land in is keyed by tenant, so the AUC stays near 0.5; before the fix the
//! query-embedding cache, keyed by text alone, answered the victim's texts faster (AUC ≈ 1 on
//! a Xeon; 0.715 on a Zen 2 with that cache's key reverted, 2026-12-03).
//! A public layer (operator-marked) is shared on purpose: the second test measures what it
//! reveals.

use std::time::Instant;

use serde_json::json;

use crate::harness::{ADMIN, Server, sqlite_url, test_config};

/// Texts per class (sent by the victim, or not): 2 × 150 = 300 trials per route. Not fewer: with
/// 200, a useless classifier's best AUC passes 0.6 on one of the three routes about once in 20
/// runs (σ ≈ 0.041 per route); with 300 about once in 100 (σ ≈ 0.033).
const PER_CLASS: usize = 150;
/// The bound on the attacker's best AUC.
const BOUND: f64 = 0.6;

/// A private sentence no other test or layer holds.
fn secret(i: usize) -> String {
    const A: [&str; 8] = [
        "amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "harbor",
    ];
    const B: [&str; 8] = [
        "lantern", "meadow", "nickel", "orchid", "pepper", "quartz", "raven", "saffron",
    ];
    format!(
        "Private note {i}: the {} {} locker code is {}-{}.",
        A[i % 8],
        B[(i / 8) % 8],
        1000 + (i * 7919) % 9000,
        (i * 104_729) % 97
    )
}

/// ROC AUC of `scores` separating `positive` from the rest (ties count half), and its best
/// direction: max(AUC, 1 − AUC).
fn best_auc(scores: &[(f64, bool)]) -> f64 {
    let (mut wins, mut pairs) = (0.0f64, 0.0f64);
    for &(p, _) in scores.iter().filter(|s| s.1) {
        for &(n, _) in scores.iter().filter(|s| !s.1) {
            pairs += 1.0;
            wins += if p > n {
                1.0
            } else if p == n {
                0.5
            } else {
                0.0
            };
        }
    }
    let auc = wins / pairs;
    auc.max(1.0 - auc)
}

/// A fixed shuffle (a linear congruential generator's order), so runs are comparable.
fn shuffled(n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in (1..n).rev() {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        order.swap(i, (x >> 33) as usize % (i + 1));
    }
    order
}

#[test]
fn an_attacker_cannot_tell_a_victim_s_texts_by_timing() {
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    config.limits.requests_per_sec = 0;
    config.tiers.enabled = false;
    let srv = Server::start_with(config);
    let quotas = json!({"hot_blocks": 4096, "cold_blocks": 16384, "sessions": 5000});
    let agent = |key: &str| {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(key),
            json!({"name": "bot", "layers": [{"kind": "axioms", "content": "Be brief."}]}),
        );
        assert_eq!(s, 201, "{v}");
    };
    let (_, victim) = srv.tenant("victim", quotas.clone());
    let (_, attacker) = srv.tenant("attacker", quotas);
    agent(&victim);
    agent(&attacker);
    let turn = |key: &str, session: &str, text: &str| {
        let (s, v) = srv.call(
            "POST",
            &format!("/v1/agents/bot/sessions/{session}/turns"),
            Some(key),
            json!({"message": text, "max_tokens": 1}),
        );
        assert_eq!(s, 200, "{v}");
    };
    let chat = |key: &str, user: &str, text: &str| {
        let (s, v) = srv.call(
            "POST",
            "/v1/chat/completions",
            Some(key),
            json!({"model": "bot", "user": user, "max_tokens": 1,
                   "messages": [{"role": "user", "content": text}]}),
        );
        assert_eq!(s, 200, "{v}");
    };
    let query = |key: &str, text: &str| {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/memory/query",
            Some(key),
            json!({"text": text}),
        );
        assert_eq!(s, 200, "{v}");
    };
    // Warm both tenants' paths alike, so the first trials are not slower for another reason.
    for key in [&victim, &attacker] {
        turn(key, "warm", "Hello.");
        chat(key, "warm-chat", "Hello.");
        query(key, "Hello.");
    }
    // The victim sends half of the texts, as a turn and as a memory query (the chat route
    // shares the turn's caches: tokens, embeddings, KV).
    for i in 0..PER_CLASS {
        let text = secret(i);
        turn(&victim, &format!("v{i}"), &text);
        query(&victim, &text);
    }
    // The attacker times every text (sent or not, in a fixed shuffled order) on each route.
    let routes = ["turn", "chat", "query"];
    let mut scores: Vec<Vec<(f64, bool)>> = vec![Vec::new(); routes.len()];
    for (trial, i) in shuffled(2 * PER_CLASS).into_iter().enumerate() {
        let text = secret(i);
        let sent = i < PER_CLASS;
        // The route probed first (the one that embeds the text for the attacker: the others then
        // find its own copy) varies with the text's index in its class, so each class meets
        // each order equally often and the order cannot stand for the class.
        for r in 0..routes.len() {
            let route = (r + i % PER_CLASS) % routes.len();
            let started = Instant::now();
            match route {
                0 => turn(&attacker, &format!("a{trial}"), &text),
                1 => chat(&attacker, &format!("ac{trial}"), &text),
                _ => query(&attacker, &text),
            }
            // Faster means "sent" for the classifier; best_auc takes either direction.
            scores[route].push((-started.elapsed().as_secs_f64(), sent));
        }
    }
    let aucs: Vec<f64> = scores.iter().map(|s| best_auc(s)).collect();
    println!(
        "timing side channel, {} trials per route: ROC AUC turn {:.3}, chat {:.3}, memory query {:.3} (bound {BOUND})",
        2 * PER_CLASS,
        aucs[0],
        aucs[1],
        aucs[2]
    );
    for (route, auc) in routes.iter().zip(&aucs) {
        assert!(*auc <= BOUND, "{route}: AUC {auc:.3}");
    }
    srv.stop();
}

#[test]
fn the_auc_of_a_perfect_and_of_a_useless_classifier() {
    let perfect: Vec<(f64, bool)> = (0..10).map(|i| (f64::from(i), i >= 5)).collect();
    assert_eq!(best_auc(&perfect), 1.0);
    let reversed: Vec<(f64, bool)> = (0..10).map(|i| (f64::from(i), i < 5)).collect();
    assert_eq!(best_auc(&reversed), 1.0);
    let useless: Vec<(f64, bool)> = (0..10).map(|i| (0.0, i % 2 == 0)).collect();
    assert_eq!(best_auc(&useless), 0.5);
}

/// A public charter no other test holds: distinct from its first words, about 90 tokens.
fn charter(i: usize) -> String {
    const W: [&str; 10] = [
        "Arctic",
        "Boreal",
        "Coastal",
        "Desert",
        "Equatorial",
        "Forest",
        "Glacial",
        "Highland",
        "Island",
        "Jungle",
    ];
    let head = format!("{} {} charter {i}.", W[i % 10], W[(i / 10) % 10]);
    let rules = (0..4)
        .map(|r| format!("Clause {r} of charter {i}: answer plainly and cite clause {r}."))
        .collect::<Vec<_>>()
        .join("\n");
    format!("{head}\n{rules}")
}

/// What an operator-marked public layer reveals (issue 64, item 3): a victim tenant uses half of
/// 24 public charters (marked public by the operator, one turn each); the attacker, whose agent
/// carries the same charter marked public, learns from `cached_tokens` exactly which ones some
/// tenant computed (AUC 1, printed with the latency's AUC), and nothing of the private message
/// that followed it: the victim's own long message, sent again by the attacker, is never found.
#[test]
fn a_public_layer_reveals_one_bit_per_prefix_and_no_private_text() {
    const CHARTERS: usize = 12;
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    config.limits.requests_per_sec = 0;
    config.tiers.enabled = false;
    let srv = Server::start_with(config);
    let quotas = json!({"hot_blocks": 4096, "cold_blocks": 16384, "sessions": 5000});
    let (victim_id, victim) = srv.tenant("victim", quotas.clone());
    let (attacker_id, attacker) = srv.tenant("attacker", quotas);
    for key in [&victim, &attacker] {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(key),
            json!({"name": "bot", "layers": [{"kind": "axioms", "content": charter(9999)}]}),
        );
        assert_eq!(s, 201, "{v}");
    }
    // The private message after the charter: long enough (~150 tokens) that a shared block of
    // it would show in `cached_tokens`.
    let message = |i: usize| {
        format!(
            "Private request {i}: {}",
            (0..10)
                .map(|k| format!("detail {k} of my account {i} is confidential."))
                .collect::<Vec<_>>()
                .join(" ")
        )
    };
    // One charter: the tenant's axioms become it, the operator marks that version public, and
    // a turn of the tenant's own session runs over it: (prompt tokens, cached tokens, seconds).
    let probe = |tenant: &str, key: &str, session: &str, i: usize| {
        let (s, v) = srv.call(
            "PUT",
            "/v1/agents/bot/layers/axioms",
            Some(key),
            json!({"content": charter(i)}),
        );
        assert_eq!(s, 200, "{v}");
        let (s, v) = srv.call(
            "PUT",
            &format!("/v1/admin/tenants/{tenant}/agents/bot/layers/axioms/public"),
            Some(ADMIN),
            json!({"public": true}),
        );
        assert_eq!(s, 200, "{v}");
        let started = Instant::now();
        let (s, v) = srv.call(
            "POST",
            &format!("/v1/agents/bot/sessions/{session}/turns"),
            Some(key),
            json!({"message": message(i), "max_tokens": 1}),
        );
        let seconds = started.elapsed().as_secs_f64();
        assert_eq!(s, 200, "{v}");
        let (prompt, cached) = (
            v["usage"]["prompt_tokens"].as_u64().unwrap(),
            v["usage"]["cached_tokens"].as_u64().unwrap(),
        );
        (prompt, cached, seconds)
    };
    probe(&victim_id, &victim, "warm", 9998);
    probe(&attacker_id, &attacker, "warm", 9997);
    for i in 0..CHARTERS {
        probe(&victim_id, &victim, &format!("v{i}"), i);
    }
    let (mut by_cached, mut by_time) = (Vec::new(), Vec::new());
    let mut most_found_of_sent = 0u64;
    for (trial, i) in shuffled(2 * CHARTERS).into_iter().enumerate() {
        let sent = i < CHARTERS;
        let (prompt, cached, seconds) = probe(&attacker_id, &attacker, &format!("a{trial}"), i);
        // The message is over 100 of the prompt's tokens: a cached block of it would leave
        // fewer than 100 computed.
        assert!(
            prompt - cached >= 100,
            "charter {i}: {cached} of {prompt} prompt tokens cached: private text was shared"
        );
        if sent {
            most_found_of_sent = most_found_of_sent.max(cached);
        }
        by_cached.push((cached as f64, sent));
        by_time.push((-seconds, sent));
    }
    let (auc_cached, auc_time) = (best_auc(&by_cached), best_auc(&by_time));
    println!(
        "public layer, {} trials: ROC AUC by cached_tokens {auc_cached:.3}, by latency {auc_time:.3} \
         (the bit it reveals: whether any tenant computed the public prefix); at most \
         {most_found_of_sent} cached tokens on a charter the victim used (the charter's blocks)",
        2 * CHARTERS
    );
    assert_eq!(
        auc_cached, 1.0,
        "a public prefix is shared: its use shows in cached_tokens"
    );
    srv.stop();
}
