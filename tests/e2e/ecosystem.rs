//! The ecosystem around the service: `/metrics` parsed by the Prometheus project's own
//! OpenMetrics parser (every family documented, today's names kept, HTTP requests by route and
//! status, per-tenant turns and tokens that match what the turns answered), a Python client
//! generated from the committed OpenAPI document driving the real service, and the API-key
//! cache (from `.venv-test`: `make sdk-venv`).

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, sqlite_url, test_config};

/// The families of `text` as `tests/metrics_parse.py` reads them.
fn parse(text: &str) -> Value {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv-test/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: `make sdk-venv` installs the parser there",
        python.display()
    );
    let mut child = Command::new(&python)
        .arg(root.join("tests/metrics_parse.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the parser refused /metrics: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn sample<'a>(families: &'a Value, family: &str, name: &str, labels: &[(&str, &str)]) -> &'a Value {
    families[family]["samples"]
        .as_array()
        .unwrap_or_else(|| panic!("no family {family}"))
        .iter()
        .find(|s| s["name"] == name && labels.iter().all(|(k, v)| s["labels"][*k] == *v))
        .map(|s| &s["value"])
        .unwrap_or_else(|| panic!("no {name} {labels:?} in {}", families[family]))
}

#[test]
fn metrics_parse_as_openmetrics_with_help_http_histograms_and_bounded_tenant_labels() {
    let mut config = test_config(&sqlite_url(), 1 << 20);
    // Two tenants get their own label; the third is counted as `other`.
    config.metrics.tenant_labels = 2;
    let srv = Server::start_with(config);
    let mut tenants = Vec::new();
    let mut ttft_ms = 0.0;
    for name in ["a", "b", "c"] {
        let (key, agent) = srv.tenant_with_bot(name, "Answer briefly.");
        let id = agent["agent"]["tenant_id"].as_str().unwrap().to_string();
        let (s, turn) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/s/turns",
            Some(&key),
            json!({"message": "Name a colour.", "max_tokens": 4}),
        );
        assert_eq!(s, 200, "{turn}");
        ttft_ms += turn["ttft_ms"].as_f64().unwrap();
        tenants.push((id, turn["usage"].clone()));
    }
    // A request that fails authentication is counted under its route and status.
    let (s, _) = srv.call("GET", "/v1/agents/nobody", Some("no-such-key"), Value::Null);
    assert_eq!(s, 401);

    let (status, body) = srv.raw("GET", "/metrics", Some(ADMIN), b"");
    assert_eq!(status, 200);
    let text = String::from_utf8(body).unwrap();
    let families = parse(&text);
    let map = families.as_object().unwrap();
    // Every family documented.
    for (name, f) in map {
        assert!(
            f["help"].as_str().is_some_and(|h| !h.is_empty()),
            "{name} has no HELP"
        );
    }
    // Today's names, as samples.
    for (family, sample_name) in [
        ("engram_cache_blocks", "engram_cache_blocks_total"),
        ("engram_ttft_seconds", "engram_ttft_seconds_count"),
        ("engram_tier_moves", "engram_tier_moves_total"),
        ("engram_replayed_turns", "engram_replayed_turns_total"),
        ("engram_prompt_segments", "engram_prompt_segments_total"),
        ("engram_tier_blocks", "engram_tier_blocks"),
        ("engram_queue_depth", "engram_queue_depth"),
    ] {
        assert!(
            map[family]["samples"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["name"] == sample_name),
            "{family}: {}",
            map[family]
        );
    }
    assert_eq!(map["engram_ttft_seconds"]["type"], "histogram");
    assert_eq!(
        sample(
            &families,
            "engram_ttft_seconds",
            "engram_ttft_seconds_count",
            &[]
        ),
        3.0
    );
    // The histogram times what the responses report: the turn's preparation (replay and
    // recall with the prompt's build) and the engine's time to the first token.
    let sum = sample(
        &families,
        "engram_ttft_seconds",
        "engram_ttft_seconds_sum",
        &[],
    )
    .as_f64()
    .unwrap();
    assert!(
        (sum - ttft_ms / 1e3).abs() < 1e-5,
        "{sum} s vs {ttft_ms} ms"
    );
    // HTTP: the turns by route pattern and status, with a latency histogram.
    let turns = "/v1/agents/{agent}/sessions/{session}/turns";
    let l = [("method", "POST"), ("route", turns), ("status", "200")];
    assert_eq!(
        sample(
            &families,
            "engram_http_requests",
            "engram_http_requests_total",
            &l
        ),
        3.0
    );
    assert_eq!(
        map["engram_http_request_duration_seconds"]["type"],
        "histogram"
    );
    assert_eq!(
        sample(
            &families,
            "engram_http_request_duration_seconds",
            "engram_http_request_duration_seconds_count",
            &l
        ),
        3.0
    );
    let unauthorized = [
        ("method", "GET"),
        ("route", "/v1/agents/{agent}"),
        ("status", "401"),
    ];
    assert_eq!(
        sample(
            &families,
            "engram_http_requests",
            "engram_http_requests_total",
            &unauthorized
        ),
        1.0
    );
    // Per tenant: two labelled, the third under `other`; tokens match the turns' usage.
    for (i, (id, usage)) in tenants.iter().enumerate() {
        let label = if i < 2 { id.as_str() } else { "other" };
        assert_eq!(
            sample(
                &families,
                "engram_tenant_turns",
                "engram_tenant_turns_total",
                &[("tenant", label)]
            ),
            1.0
        );
        let cached = usage["cached_tokens"].as_f64().unwrap();
        let prefilled = usage["prompt_tokens"].as_f64().unwrap() - cached;
        for (kind, want) in [
            ("cached", cached),
            ("prefilled", prefilled),
            ("completion", usage["completion_tokens"].as_f64().unwrap()),
        ] {
            assert_eq!(
                sample(
                    &families,
                    "engram_tenant_tokens",
                    "engram_tenant_tokens_total",
                    &[("tenant", label), ("kind", kind)]
                )
                .as_f64(),
                Some(want),
                "{kind}"
            );
        }
    }
    let tenant_labels: std::collections::HashSet<&str> = map["engram_tenant_turns"]["samples"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["labels"]["tenant"].as_str())
        .collect();
    assert_eq!(tenant_labels.len(), 3, "{tenant_labels:?}");
    srv.stop();
}

#[test]
fn a_key_lookup_is_remembered_briefly_and_a_revocation_here_is_honoured_at_once() {
    let url = sqlite_url();
    let mut config = test_config(&url, 1 << 20);
    config.auth.key_cache_ms = 1_500;
    let srv = Server::start_with(config);
    let (key, agent) = srv.tenant_with_bot("t", "Be brief.");
    let tenant = agent["agent"]["tenant_id"].as_str().unwrap().to_string();
    let mint = || {
        let (s, k) = srv.call(
            "POST",
            &format!("/v1/admin/tenants/{tenant}/keys"),
            Some(ADMIN),
            Value::Null,
        );
        assert_eq!(s, 201, "{k}");
        (
            k["api_key"].as_str().unwrap().to_string(),
            k["key"]["id"].as_str().unwrap().to_string(),
        )
    };
    let get = |k: &str| srv.call("GET", "/v1/agents/bot", Some(k), Value::Null).0;
    // Revoked through this node: refused at once, although it was just looked up.
    let (second, second_id) = mint();
    assert_eq!(get(&second), 200);
    let (s, _) = srv.call(
        "DELETE",
        &format!("/v1/admin/tenants/{tenant}/keys/{second_id}"),
        Some(ADMIN),
        Value::Null,
    );
    assert_eq!(s, 204);
    assert_eq!(get(&second), 401);
    assert_eq!(get(&key), 200, "the tenant's other key still works");
    // Revoked in the database by another node: this node remembers the lookup until its
    // time runs out, then refuses it.
    let (third, third_id) = mint();
    assert_eq!(get(&third), 200);
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = engram_store::Store::connect(&url).await.unwrap();
        store.revoke_key(&tenant, &third_id).await.unwrap();
        store.close().await;
    });
    assert_eq!(get(&third), 200, "remembered for auth.key_cache_ms");
    std::thread::sleep(std::time::Duration::from_millis(1_700));
    assert_eq!(get(&third), 401, "forgotten once the time ran out");
    srv.stop();
}

#[test]
fn a_python_client_generated_from_the_committed_spec_drives_the_service() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv-test/bin/python");
    assert!(
        python.is_file(),
        "`make sdk-venv` installs openapi-python-client"
    );
    let srv = Server::start(&sqlite_url(), 1 << 20);
    let out = Command::new(&python)
        .arg(root.join("tests/openapi_client.py"))
        .arg(root.join("openapi/openapi.json"))
        .arg(format!("http://{}", srv.addr))
        .arg(ADMIN)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "client failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("openapi client ok"), "{stdout}");
    srv.stop();
}

#[test]
fn a_turn_s_agent_and_layers_are_remembered_briefly_and_a_write_here_is_seen_at_once() {
    let url = sqlite_url();
    let mut config = test_config(&url, 1 << 20);
    config.server.agent_cache_ms = 1_500;
    let srv = Server::start_with(config);
    let (key, agent) = srv.tenant_with_bot("t", "Be brief.");
    let agent_id = agent["agent"]["id"].as_str().unwrap().to_string();
    let hash = || {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/context",
            Some(&key),
            json!({"message": "Name a colour."}),
        );
        assert_eq!(s, 200, "{v}");
        v["stable_prefix_hash"].as_str().unwrap().to_string()
    };
    let first = hash();
    // Written through this node: the next build sees it at once.
    let (s, v) = srv.call(
        "PUT",
        "/v1/agents/bot/layers/axioms",
        Some(&key),
        json!({"content": "Be thorough."}),
    );
    assert_eq!(s, 200, "{v}");
    let second = hash();
    assert_ne!(second, first);
    // Written by another node sharing the database: remembered until the time runs out.
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = engram_store::Store::connect(&url).await.unwrap();
        store
            .put_layer(&agent_id, "axioms", "Be kind.", 512, true, 1.0)
            .await
            .unwrap();
        store.close().await;
    });
    assert_eq!(hash(), second, "remembered for server.agent_cache_ms");
    std::thread::sleep(std::time::Duration::from_millis(1_700));
    let third = hash();
    assert_ne!(third, second, "read again once the time ran out");
    srv.stop();
}
