//! Fairness between tenants: per-tenant request rates and generation slots (429
//! `rate_limited` with `Retry-After`), and fair admission to the engine's running slots.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{Server, sqlite_url, test_config};

#[test]
fn a_flooding_tenant_gets_its_share_of_the_engine_not_all_of_it() {
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    // One running slot: every generation waits for the one before it.
    config.model.max_running = 1;
    config.limits.concurrent_generations = 3;
    config.memory.enabled = false;
    let srv = std::sync::Arc::new(Server::start_with(config));
    let (ka, _) = srv.tenant_with_bot("flooder", "Be thorough.");
    let (kb, _) = srv.tenant_with_bot("neighbour", "Be brief.");
    let t0 = Instant::now();
    let turn = |srv: std::sync::Arc<Server>, key: String, session: String| {
        std::thread::spawn(move || {
            let (s, v) = srv.call(
                "POST",
                &format!("/v1/agents/bot/sessions/{session}/turns"),
                Some(&key),
                json!({"message": "Write a long story about a dragon and a castle.", "max_tokens": 24}),
            );
            (s, v, t0.elapsed())
        })
    };
    // The flooder sends four at once: three get a slot, the fourth is refused at once.
    let flood: Vec<_> = (0..4)
        .map(|i| turn(srv.clone(), ka.clone(), format!("f{i}")))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let neighbour = turn(srv.clone(), kb.clone(), "n".into()).join().unwrap();
    let flood: Vec<(u16, Value, Duration)> = flood.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(neighbour.0, 200, "{}", neighbour.1);
    let refused: Vec<_> = flood.iter().filter(|(s, _, _)| *s == 429).collect();
    assert_eq!(refused.len(), 1, "{flood:?}");
    assert_eq!(refused[0].1["code"], "rate_limited", "{flood:?}");
    let served: Vec<Duration> = flood
        .iter()
        .filter(|(s, _, _)| *s == 200)
        .map(|(_, _, t)| *t)
        .collect();
    assert_eq!(served.len(), 3, "{flood:?}");
    // Admitted first-come-first-served, the neighbour would finish after all three; fairly, it
    // goes before the flooder's waiting ones.
    let after = served.iter().filter(|&&t| t > neighbour.2).count();
    println!(
        "neighbour finished at {:?}; flooder's at {served:?}",
        neighbour.2
    );
    assert!(after >= 1, "the neighbour waited for the whole flood");
}

#[test]
fn a_tenant_over_its_request_rate_gets_429_with_retry_after_and_others_do_not() {
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    config.limits.requests_per_sec = 1;
    config.limits.burst = 3;
    config.memory.enabled = false;
    let srv = Server::start_with(config);
    let (ka, _) = srv.tenant_with_bot("a", "Be kind.");
    let (kb, _) = srv.tenant_with_bot("b", "Be kind.");
    // tenant_with_bot spent one of each tenant's requests.
    let get = |key: &str| srv.raw_full("GET", "/v1/agents", Some(key), b"");
    let statuses: Vec<u16> = (0..3).map(|_| get(&ka).0).collect();
    assert_eq!(
        statuses.iter().filter(|&&s| s == 429).count(),
        1,
        "{statuses:?}"
    );
    let (s, head, body) = get(&ka);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((s, v["code"].as_str()), (429, Some("rate_limited")), "{v}");
    let retry: u64 = head
        .lines()
        .find_map(|l| l.strip_prefix("retry-after: "))
        .unwrap_or_else(|| panic!("no retry-after in {head}"))
        .trim()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&retry), "{retry}");
    // The neighbour is not slowed down, and the operator is not limited.
    assert_eq!(get(&kb).0, 200);
    std::thread::sleep(Duration::from_secs(retry));
    assert_eq!(
        get(&ka).0,
        200,
        "after Retry-After the tenant is served again"
    );
}
