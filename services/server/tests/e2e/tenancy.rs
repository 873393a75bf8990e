//! Operator-marked public layers (the one way tenants share KV) and per-tenant quotas.

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, sqlite_url};
use crate::service::{long_text, usage};

#[test]
fn public_layers_are_shared_only_when_the_operator_marks_them_and_quotas_answer_429() {
    let url = sqlite_url();
    let srv = Server::start(&url, 64 * 1024);
    let tenant = |name: &str, quotas: Value| {
        let (s, v) = srv.call(
            "POST",
            "/v1/admin/tenants",
            Some(ADMIN),
            json!({"name": name, "quotas": quotas}),
        );
        assert_eq!(s, 201, "{v}");
        (
            v["tenant"]["id"].as_str().unwrap().to_string(),
            v["api_key"].as_str().unwrap().to_string(),
        )
    };
    let roomy = json!({"hot_blocks": 4096, "cold_blocks": 4096, "sessions": 10});
    let (ta, ka) = tenant("alpha", roomy.clone());
    let (tb, kb) = tenant("beta", roomy);
    let shared = long_text("the shared charter", 10);
    for (key, who) in [(&ka, "Alpha"), (&kb, "Beta")] {
        let layers = json!([
            {"kind": "axioms", "content": shared},
            {"kind": "identity", "content": format!("I am the {who} assistant.")},
            {"kind": "memories", "content": "The user likes tea."}
        ]);
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(key),
            json!({"name": "bot", "layers": layers}),
        );
        assert_eq!(s, 201, "{v}");
    }
    let turn = |key: &str, session: &str| {
        let (s, v) = srv.call(
            "POST",
            &format!("/v1/agents/bot/sessions/{session}/turns"),
            Some(key),
            json!({"message": "Hello?", "max_tokens": 2}),
        );
        assert_eq!(s, 200, "{v}");
        usage(&v).1
    };
    let mark = |tenant: &str, kind: &str, public: bool| {
        srv.call(
            "PUT",
            &format!("/v1/admin/tenants/{tenant}/agents/bot/layers/{kind}/public"),
            Some(ADMIN),
            json!({ "public": public }),
        )
    };

    // Unmarked: identical axioms are not shared.
    assert_eq!(turn(&ka, "s1"), 0);
    assert_eq!(turn(&kb, "s1"), 0);

    // The operator marks both tenants' axioms public: the first computes them under the public
    // salt, the second reuses them, and nothing past them (its identity is its own).
    let (s, v) = mark(&ta, "axioms", true);
    assert_eq!((s, v["public"].as_bool()), (200, Some(true)), "{v}");
    let (s, _) = mark(&tb, "axioms", true);
    assert_eq!(s, 200);
    // Blocks hash differently under the public salt: alpha's next turn computes them anew.
    assert_eq!(turn(&ka, "s2"), 0);
    let (_, preview) = srv.call(
        "POST",
        "/v1/agents/bot/context",
        Some(&kb),
        json!({"message": "Hello?"}),
    );
    let axioms_tokens = preview["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "axioms")
        .unwrap()["tokens"]
        .as_u64()
        .unwrap();
    let cached = turn(&kb, "s2");
    assert!(
        cached > 0 && cached + 16 >= axioms_tokens && cached <= axioms_tokens + 8,
        "beta reused {cached} tokens of alpha's public {axioms_tokens}-token axioms"
    );

    // The shared blocks are the operator's: listed as tenant `public`, pinned.
    let (s, page) = srv.call(
        "GET",
        "/v1/admin/blocks?tenant=public&limit=1000",
        Some(ADMIN),
        Value::Null,
    );
    assert_eq!(s, 200, "{page}");
    let blocks = page["blocks"].as_array().unwrap();
    assert!(!blocks.is_empty(), "{page}");
    for b in blocks {
        assert_eq!(b["tenant_id"], "public", "{b}");
        assert_eq!(b["source"], "axioms", "{b}");
        assert!(b["session"].is_null(), "{b}");
        assert_eq!(b["pin"], "pinned", "{b}");
    }
    // Only stable layers can be public; unknown names are 404; tenants cannot mark.
    let (s, v) = mark(&ta, "memories", true);
    assert_eq!((s, v["code"].as_str()), (400, Some("layer_not_stable")));
    let (s, v) = mark(&ta, "soul", true);
    assert_eq!((s, v["code"].as_str()), (404, Some("not_found")));
    let (s, v) = mark("no-such-tenant", "axioms", true);
    assert_eq!((s, v["code"].as_str()), (404, Some("not_found")));
    let (s, _) = srv.call(
        "PUT",
        &format!("/v1/admin/tenants/{ta}/agents/bot/layers/axioms/public"),
        Some(&ka),
        json!({"public": true}),
    );
    assert_eq!(s, 401);
    // Unmarking releases the public pins (they leave by eviction like any block).
    let (s, v) = mark(&ta, "axioms", false);
    assert_eq!(s, 200, "{v}");
    assert!(v["unpinned_blocks"].as_u64().unwrap() >= 1, "{v}");
    let (_, page) = srv.call(
        "GET",
        "/v1/admin/blocks?tenant=public&pinned=true",
        Some(ADMIN),
        Value::Null,
    );
    assert_eq!(page["total"], 0, "{page}");

    // Quotas: sessions, then hot blocks, each a 429 with a code; nothing is stored.
    let (_, kc) = tenant(
        "gamma",
        json!({"hot_blocks": 4096, "cold_blocks": 0, "sessions": 1}),
    );
    let (_, kd) = tenant(
        "delta",
        json!({"hot_blocks": 2, "cold_blocks": 0, "sessions": 10}),
    );
    for key in [&kc, &kd] {
        let (s, _) = srv.call(
            "POST",
            "/v1/agents",
            Some(key),
            json!({"name": "bot", "layers": [{"kind": "axioms", "content": shared}]}),
        );
        assert_eq!(s, 201);
    }
    turn(&kc, "first");
    let over = |key: &str, session: &str| {
        srv.call(
            "POST",
            &format!("/v1/agents/bot/sessions/{session}/turns"),
            Some(key),
            json!({"message": "Hello?", "max_tokens": 2}),
        )
    };
    let (s, v) = over(&kc, "second");
    assert_eq!(
        (s, v["code"].as_str()),
        (429, Some("quota_exceeded")),
        "{v}"
    );
    let (s, v) = over(&kd, "first");
    assert_eq!(
        (s, v["code"].as_str()),
        (429, Some("quota_exceeded")),
        "{v}"
    );
    // The refused turns stored no session: gamma still holds one, delta none.
    let (_, tenants) = srv.call("GET", "/v1/admin/tenants", Some(ADMIN), Value::Null);
    let id_of = |name: &str| {
        tenants["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (gamma, delta) = (id_of("gamma"), id_of("delta"));
    let counts = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = engram_store::Store::connect(&url).await.unwrap();
        let n = (
            store.session_count(&gamma).await.unwrap(),
            store.session_count(&delta).await.unwrap(),
        );
        store.close().await;
        n
    });
    assert_eq!(counts, (1, 0));
}
