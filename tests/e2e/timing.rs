//! The timing side channel (issue 64, item 3): an attacker tenant times guessed texts, half of
//! which a victim tenant sent just before, on every route that takes text — a native turn, an
//! OpenAI chat completion, a memory query — and its best classifier (the latency itself, in
//! whichever direction separates better) is scored by ROC AUC over 300 trials per route. Every
//! cache a text can land in is keyed by tenant, so the AUC stays near 0.5; before the fix the
//! query-embedding cache, keyed by text alone, answered the victim's texts faster (AUC ≈ 1).

use std::time::Instant;

use serde_json::json;

use crate::harness::{Server, sqlite_url, test_config};

/// Texts per class (sent by the victim, or not): 2 × 150 = 300 trials per route.
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
    config.memory.reserve = false;
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
