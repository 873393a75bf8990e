//! Operator-marked public layers (the one way tenants share KV) and per-tenant quotas.

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, sqlite_url};
use crate::service::{long_text, usage};

#[test]
fn public_layers_are_shared_only_when_the_operator_marks_them_and_quotas_answer_429() {
    let url = sqlite_url();
    let srv = Server::start(&url, 64 * 1024);
    let tenant = |name: &str, quotas: Value| srv.tenant(name, quotas);
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
    let axioms_tokens = axioms_tokens(&srv, &kb) as u64;
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
    // Public prefixes are reference-counted by their users: alpha editing its own (public)
    // axioms, or being unmarked, leaves the pins beta still uses alone.
    let pinned_public = || {
        let (s, page) = srv.call(
            "GET",
            "/v1/admin/blocks?tenant=public&pinned=true",
            Some(ADMIN),
            Value::Null,
        );
        assert_eq!(s, 200, "{page}");
        page["total"].as_u64().unwrap()
    };
    let shared_pins = pinned_public();
    assert!(shared_pins >= 1);
    let (s, v) = srv.call(
        "PUT",
        "/v1/agents/bot/layers/axioms",
        Some(&ka),
        json!({"content": long_text("alpha's own charter", 10)}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        pinned_public(),
        shared_pins,
        "alpha's edit unpinned beta's prefix"
    );
    let (s, v) = mark(&ta, "axioms", false);
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        pinned_public(),
        shared_pins,
        "alpha's unmark unpinned beta's prefix"
    );
    // The last user gone, the public pins are released (they leave by eviction like any block).
    let (s, v) = mark(&tb, "axioms", false);
    assert_eq!(s, 200, "{v}");
    assert!(v["unpinned_blocks"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(pinned_public(), 0);

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

/// Tokens of the axioms layer in the agent `bot`'s prompt (the context preview).
fn axioms_tokens(srv: &Server, key: &str) -> usize {
    let (_, preview) = srv.call(
        "POST",
        "/v1/agents/bot/context",
        Some(key),
        json!({"message": "Hello?"}),
    );
    preview["layers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["kind"] == "axioms")
        .unwrap()["tokens"]
        .as_u64()
        .unwrap() as usize
}

/// An exported session's file with its header's `engram.session` entry edited by `edit` (no
/// byte of a block changes, so every CRC still holds): a crafted file.
fn edit_header(file: &[u8], edit: impl FnOnce(&mut Vec<Value>)) -> Vec<u8> {
    let len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&file[8..8 + len]).unwrap();
    let mut meta: Value =
        serde_json::from_str(header["__metadata__"]["engram.session"].as_str().unwrap()).unwrap();
    edit(meta["blocks"].as_array_mut().unwrap());
    header["__metadata__"]["engram.session"] = json!(meta.to_string());
    let mut text = header.to_string();
    while !text.len().is_multiple_of(8) {
        text.push(' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&file[8 + len..]);
    out
}

/// Flips `public` on the first `n` blocks of an exported session's header: the crafted file of
/// a tenant trying to write KV under the public hash of an operator-marked prefix.
fn flip_public(file: &[u8], n: usize) -> Vec<u8> {
    edit_header(file, |blocks| {
        assert!(blocks.len() >= n, "{} blocks", blocks.len());
        for b in blocks.iter_mut().take(n) {
            b["public"] = json!(true);
        }
    })
}

#[test]
fn a_crafted_import_never_reaches_another_tenant_and_imports_are_bounded() {
    let url = sqlite_url();
    let mut config = crate::harness::test_config(&url, 64 * 1024);
    config.server.import_limit_mib = 16;
    let srv = Server::start_with(config);
    let tenant = |name: &str| {
        srv.tenant(
            name,
            json!({"hot_blocks": 4096, "cold_blocks": 4096, "sessions": 10}),
        )
    };
    let (ta, ka) = tenant("victim");
    let (tx, kx) = tenant("attacker");
    let shared = long_text("the shared charter", 10);
    for (key, who) in [(&ka, "Victim"), (&kx, "Attacker")] {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(key),
            json!({"name": "bot", "layers": [
                {"kind": "axioms", "content": shared},
                {"kind": "identity", "content": format!("I am the {who} assistant.")}
            ]}),
        );
        assert_eq!(s, 201, "{v}");
    }
    // The operator marks the victim's axioms public; nobody has computed them yet.
    let (s, v) = srv.call(
        "PUT",
        &format!("/v1/admin/tenants/{ta}/agents/bot/layers/axioms/public"),
        Some(ADMIN),
        json!({"public": true}),
    );
    assert_eq!(s, 200, "{v}");
    let public_blocks = || {
        let (s, page) = srv.call(
            "GET",
            "/v1/admin/blocks?tenant=public&limit=1000",
            Some(ADMIN),
            Value::Null,
        );
        assert_eq!(s, 200, "{page}");
        page["total"].as_u64().unwrap()
    };
    // The attacker computes the same text under its own salt, exports it, marks every axioms
    // block public in the header and imports the file.
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s/turns",
        Some(&kx),
        json!({"message": "Hello?", "max_tokens": 2}),
    );
    assert_eq!(s, 200, "{v}");
    let (s, file) = srv.raw(
        "GET",
        "/v1/agents/bot/sessions/s/cache/export",
        Some(&kx),
        b"",
    );
    assert_eq!(s, 200);
    let crafted = flip_public(&file, axioms_tokens(&srv, &ka) / 32);
    assert_ne!(crafted, file);
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/t/cache/import",
        Some(&kx),
        &crafted,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(public_blocks(), 0, "an import created public blocks");
    // The victim's first-ever turn reuses nothing the attacker supplied.
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/first/turns",
        Some(&ka),
        json!({"message": "Hello?", "max_tokens": 2}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(usage(&v).1, 0, "the victim attended to imported KV: {v}");
    assert!(public_blocks() > 0, "the victim's own turn computes them");

    // An import over the limit is refused before it is read (413), and so is one that only
    // grows past it while streaming (no Content-Length to go by is not needed: the spool counts).
    let big = vec![0u8; (16 << 20) + 1];
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/u/cache/import",
        Some(&kx),
        &big,
    );
    let e: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(
        (s, e["code"].as_str()),
        (413, Some("payload_too_large")),
        "{e}"
    );

    // One import per tenant at a time: while one streams slowly, a second answers 429.
    let mut slow = std::net::TcpStream::connect(srv.addr).unwrap();
    {
        use std::io::Write;
        write!(
            slow,
            "POST /v1/agents/bot/sessions/v/cache/import HTTP/1.1\r\nhost: localhost\r\n\
             authorization: Bearer {kx}\r\ncontent-type: application/octet-stream\r\n\
             content-length: 100000\r\n\r\n0123456789"
        )
        .unwrap();
        slow.flush().unwrap();
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/w/cache/import",
        Some(&kx),
        &file,
    );
    let e: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!((s, e["code"].as_str()), (429, Some("rate_limited")), "{e}");
    // Another tenant is not held up by it.
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/w/cache/import",
        Some(&ka),
        &file,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    drop(slow);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/w/cache/import",
        Some(&kx),
        &file,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    // An imported session is a session: it counts against the quota, and an import past it
    // is refused with nothing stored (the attacker holds s, t, w; its quota is 10).
    for i in 3..10 {
        let (s, b) = srv.raw(
            "POST",
            &format!("/v1/agents/bot/sessions/fill{i}/cache/import"),
            Some(&kx),
            &file,
        );
        assert_eq!(s, 200, "{i}: {}", String::from_utf8_lossy(&b));
    }
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/one-too-many/cache/import",
        Some(&kx),
        &file,
    );
    let e: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(
        (s, e["code"].as_str()),
        (429, Some("quota_exceeded")),
        "{e}"
    );
    // No session row was stored: a turn there is still a new session, over the quota.
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/one-too-many/turns",
        Some(&kx),
        json!({"message": "Hello?", "max_tokens": 2}),
    );
    assert_eq!(
        (s, v["code"].as_str()),
        (429, Some("quota_exceeded")),
        "{v}"
    );
    // Re-importing a session it holds needs no room.
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/w/cache/import",
        Some(&kx),
        &file,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    // A chain longer than the model's context is refused (422) before a block is read: its
    // last block claims 100,000 tokens.
    let endless = edit_header(&file, |blocks| {
        let last = blocks.last_mut().unwrap();
        let token = last["tokens"][0].clone();
        last["tokens"] = json!(vec![token; 100_000]);
    });
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/w/cache/import",
        Some(&kx),
        &endless,
    );
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(
        (s, v["code"].as_str()),
        (422, Some("invalid_cache_file")),
        "{v}"
    );
    assert!(
        v["message"]
            .as_str()
            .unwrap_or_default()
            .contains("longer than the model's context"),
        "{v}"
    );
    srv.stop();

    // Imported pins are filed under the importer's own prefix key: on a node with an empty
    // cache, an import pins the attacker's stable blocks, and its next edit of the prefix
    // releases them (before, imported pins had no key and stayed forever).
    let mut config = crate::harness::test_config(&url, 64 * 1024);
    config.shadow.enabled = false;
    let srv = Server::start_with(config);
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/s/cache/import",
        Some(&kx),
        &file,
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let pinned_of = |tenant: &str| {
        let (s, page) = srv.call(
            "GET",
            &format!("/v1/admin/blocks?tenant={tenant}&pinned=true"),
            Some(ADMIN),
            Value::Null,
        );
        assert_eq!(s, 200, "{page}");
        page["total"].as_u64().unwrap()
    };
    assert!(pinned_of(&tx) > 0, "the import pinned nothing");
    let (s, v) = srv.call(
        "PUT",
        "/v1/agents/bot/layers/axioms",
        Some(&kx),
        json!({"content": "A different charter."}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(pinned_of(&tx), 0, "imported pins outlived the prefix: {v}");
    srv.stop();
}
