//! `engram-bench workload` against the real service: a short smoke run of the load driver
//! (setup, probe, interleaved sessions, a restart hook, usage), and the report it feeds.

use engram_benches::workload::{RunOptions, Workload, report, run};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::harness::{ADMIN, Server};
use crate::shadow::fresh_dir;

fn tiny() -> Workload {
    serde_json::from_value(json!({
        "name": "smoke",
        "description": "Two agents, two sessions each, interleaved, a restart hook halfway.",
        "max_tokens": 4,
        "concurrency": 2,
        "restart_after": 4,
        "agents": [
            {"name": "alpha", "layers": [
                {"kind": "axioms", "content": "Be brief."},
                {"kind": "rules", "content": "Answer in one sentence.", "lines": 12, "seed": 1}
            ]},
            {"name": "beta", "layers": [
                {"kind": "identity", "content": "You are Beta.", "lines": 12, "seed": 2},
                {"kind": "soul", "content": "Friendly."}
            ]}
        ],
        "sessions": [
            {"agent": "alpha", "count": 2, "generated_turns": 2, "seed": 5},
            {"agent": "beta", "count": 2, "turns": ["Who are you?", "And what do you do?"]}
        ]
    }))
    .unwrap()
}

#[test]
fn the_driver_measures_engram_and_the_report_compares_runs() {
    let mut c = engram_server::Config::default();
    c.database.url = crate::harness::sqlite_url();
    c.auth.admin_key.0 = ADMIN.into();
    c.model.path = crate::harness::model_path();
    c.memory.enabled = false;
    c.shadow.enabled = false;
    let srv = Server::start_with(c);
    let w = tiny();
    let plan = w.plan().unwrap();
    let opts = RunOptions {
        endpoint: format!("http://{}/v1", srv.addr),
        label: "engram".into(),
        rep: 1,
        engram_admin_key: Some(ADMIN.into()),
        api_key: None,
        restart_cmd: Some("true".into()),
        progress: false,
    };
    let r = run(&w, &opts).unwrap();
    assert_eq!(r.requests.len(), 8);
    for q in &r.requests {
        assert!(q.error.is_none(), "{q:?}");
        assert!(q.ttft_ms.unwrap() > 0.0 && q.total_ms >= q.ttft_ms.unwrap());
        assert!(
            q.completion_tokens >= 1 && q.completion_tokens <= 4,
            "{q:?}"
        );
        assert!(q.prompt_tokens.unwrap() > 100, "{q:?}");
        // Second turns reuse at least the first turn's prompt.
        if q.turn == 1 {
            assert!(q.cached_tokens.unwrap() >= 100, "{q:?}");
        }
    }
    // Requests in schedule order; the first four before the restart hook, the rest after.
    let idx: Vec<usize> = r.requests.iter().map(|q| q.index).collect();
    assert_eq!(idx, (0..8).collect::<Vec<_>>());
    assert!(r.requests[..4].iter().all(|q| !q.after_restart));
    assert!(r.requests[4..].iter().all(|q| q.after_restart));
    assert!(r.restart_ms.is_some());
    assert!(r.probe_prompt_tokens.unwrap() > 20);

    // The system text every endpoint gets is Engram's own rendering of the agent's layers.
    let (s, key) = srv.call(
        "POST",
        "/v1/admin/tenants",
        Some(ADMIN),
        json!({"name": "check"}),
    );
    assert_eq!(s, 201, "{key}");
    let key = key["api_key"].as_str().unwrap().to_string();
    for a in &plan.agents {
        let layers: Vec<Value> = a
            .layers
            .iter()
            .map(|(k, t)| json!({"kind": k, "content": t, "budget": 65_536}))
            .collect();
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(&key),
            json!({"name": a.name, "layers": layers}),
        );
        assert_eq!(s, 201, "{v}");
        let (s, v) = srv.call(
            "POST",
            &format!("/v1/agents/{}/context", a.name),
            Some(&key),
            json!({"message": "hi"}),
        );
        assert_eq!(s, 200, "{v}");
        let ours: String = Sha256::digest(format!("<|im_start|>system\n{}", a.system))
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(v["stable_prefix_hash"], ours.as_str(), "{}", a.name);
    }
    srv.stop();

    // A peer that answered every request twice as slowly: the report says so.
    let mut peer = r.clone();
    peer.label = "peer".into();
    for q in &mut peer.requests {
        q.ttft_ms = q.ttft_ms.map(|t| t * 2.0);
        q.cached_tokens = None;
    }
    peer.wall_ms *= 2.0;
    let dir = fresh_dir("workload-report");
    let rep = report::write(&[r, peer], "engram", "smoke", &dir).unwrap();
    let ratio = rep.scenarios[0].ratios[0].ttft_p50.unwrap();
    assert!((ratio.mean - 2.0).abs() < 1e-9, "{ratio:?}");
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.contains("## smoke") && md.contains("| peer | 1 | 0 |"),
        "{md}"
    );
    assert!(dir.join("smoke-ttft-cdf.svg").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_workload_file_with_a_mistake_is_refused_before_any_request() {
    let dir = fresh_dir("workload-bad");
    let f = dir.join("w.json");
    std::fs::write(
        &f,
        r#"{"name": "x", "agents": [{"name": "a", "layers": [{"kind": "axioms", "content": "A."}]}],
            "sessions": [{"agent": "b", "turns": ["hi"]}]}"#,
    )
    .unwrap();
    let e = Workload::load(f.to_str().unwrap()).unwrap_err().to_string();
    assert!(e.contains("no agent \"b\""), "{e}");
    let opts = RunOptions {
        endpoint: "http://127.0.0.1:9/v1".into(),
        label: "x".into(),
        rep: 1,
        engram_admin_key: None,
        api_key: None,
        restart_cmd: None,
        progress: false,
    };
    // Nothing listens on port 9: a clear error, not a hang.
    let w = Workload::load("b").unwrap();
    assert!(run(&w, &opts).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}
