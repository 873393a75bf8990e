//! What a client can cost (issue 64, items 5 and 7): unknown keys are remembered as unknown,
//! the lookups of the others are throttled per client IP before the database is asked,
//! `/readyz` pings the database at most once a second whatever its request rate, and listings
//! come a page at a time.

use std::time::Instant;

use serde_json::Value;

use crate::harness::{ADMIN, Server, sqlite_url, test_config};

fn metric(srv: &Server, name: &str) -> f64 {
    let (s, body) = srv.raw("GET", "/metrics", Some(ADMIN), b"");
    assert_eq!(s, 200);
    let text = String::from_utf8_lossy(&body).to_string();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} not in {text}"))
}

#[test]
fn made_up_keys_are_answered_from_memory_and_throttled_per_ip() {
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    config.auth.lookups_per_ip_per_sec = 1;
    config.auth.lookup_burst = 5;
    config.auth.unknown_key_cache_ms = 60_000;
    let srv = Server::start_with(config);
    let (_, key) = srv.tenant("t", Value::Null);
    let get = |key: &str| {
        let (s, v) = srv.call("GET", "/v1/agents", Some(key), Value::Null);
        (s, v["code"].as_str().unwrap_or_default().to_string())
    };
    // The tenant's key is looked up once, then remembered.
    assert_eq!(get(&key).0, 200);
    // Four made-up keys use up the rest of the burst; each is looked up and refused.
    for i in 0..4 {
        assert_eq!(get(&format!("made-up-{i}")), (401, "unauthorized".into()));
    }
    // The next new key is refused before any lookup.
    let (s, code) = get("made-up-new");
    assert_eq!((s, code.as_str()), (429, "rate_limited"));
    // A key already found unknown is answered from memory (401, not 429: no lookup), and the
    // tenant's remembered key still works.
    assert_eq!(get("made-up-0"), (401, "unauthorized".into()));
    assert_eq!(get(&key).0, 200);
    srv.stop();
}

#[test]
fn readiness_pings_the_database_at_most_once_a_second() {
    let srv = Server::start_with(test_config(&sqlite_url(), 64 * 1024));
    let before = metric(&srv, "engram_readiness_pings_total");
    let started = Instant::now();
    for _ in 0..200 {
        let (s, v) = srv.call("GET", "/readyz", None, Value::Null);
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["database"], true, "{v}");
    }
    let secs = started.elapsed().as_secs_f64();
    let pings = metric(&srv, "engram_readiness_pings_total") - before;
    assert!(pings >= 1.0, "{pings}");
    assert!(
        pings <= secs.ceil() + 1.0,
        "{pings} pings for 200 probes in {secs:.2} s"
    );
    srv.stop();
}

#[test]
fn listings_come_a_page_at_a_time_through_cursors() {
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    config.limits.requests_per_sec = 0;
    let served = config
        .model
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let srv = Server::start_with(config);
    let (_, key) = srv.tenant("t", Value::Null);
    let mut made = Vec::new();
    for i in 0..5 {
        let name = format!("agent-{i}");
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(&key),
            serde_json::json!({"name": name}),
        );
        assert_eq!(s, 201, "{v}");
        made.push(name);
    }
    // The model list is the served model, then the agents: six rows, three pages of two.
    let models: Vec<String> = std::iter::once(served).chain(made.clone()).collect();
    for (route, list, name, want) in [
        ("/v1/agents", "agents", "name", made.clone()),
        ("/v1/models", "data", "id", models),
    ] {
        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        let mut pages = 0;
        loop {
            let path = match &cursor {
                Some(c) => format!("{route}?limit=2&cursor={c}"),
                None => format!("{route}?limit=2"),
            };
            let (s, v) = srv.call("GET", &path, Some(&key), Value::Null);
            assert_eq!(s, 200, "{v}");
            let rows = v[list].as_array().unwrap();
            assert!(rows.len() <= 2, "{v}");
            seen.extend(rows.iter().map(|r| r[name].as_str().unwrap().to_string()));
            pages += 1;
            match v["next_cursor"].as_str() {
                Some(c) => cursor = Some(c.to_string()),
                None => break,
            }
        }
        assert_eq!((seen.clone(), pages), (want, 3), "{route}");
    }
    // A page of one model holds the served model alone; the next starts at the first agent.
    let (s, v) = srv.call("GET", "/v1/models?limit=1", Some(&key), Value::Null);
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["data"].as_array().map(Vec::len), Some(1), "{v}");
    let next = v["next_cursor"].as_str().unwrap().to_string();
    let (s, v) = srv.call(
        "GET",
        &format!("/v1/models?limit=1&cursor={next}"),
        Some(&key),
        Value::Null,
    );
    assert_eq!(
        (s, v["data"][0]["id"].as_str()),
        (200, Some("agent-0")),
        "{v}"
    );
    // Tenants page the same way for the operator.
    let (s, v) = srv.call("GET", "/v1/admin/tenants?limit=1", Some(ADMIN), Value::Null);
    assert_eq!((s, v["tenants"].as_array().unwrap().len()), (200, 1), "{v}");
    // Bad paging is a 400 with the stable code.
    for bad in ["?limit=0", "?limit=1001", "?cursor=nope", "?page=2"] {
        let (s, v) = srv.call("GET", &format!("/v1/agents{bad}"), Some(&key), Value::Null);
        assert_eq!(
            (s, v["code"].as_str()),
            (400, Some("invalid_request")),
            "{bad}: {v}"
        );
    }
    srv.stop();
}
