//! The memory graph on a remote vector index: `memory.vector_url` through `qdrant-client`,
//! against a server speaking Qdrant's gRPC protocol backed by qdrant-edge (started here; it is
//! not a Qdrant server — no registry ships one). Tenant-scoped recall, deletes, a restart that
//! finds the index current, and one that finds it empty and re-indexes from the database.

#![cfg(feature = "qdrant")]

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, sqlite_url, test_config};
use engram_vector::grpc_server::TestServer;

fn fresh_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("engram-qdrant-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn ids(v: &Value) -> Vec<i64> {
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect()
}

#[test]
fn memory_on_a_remote_index_is_tenant_scoped_and_reindexed_when_the_server_comes_back_empty() {
    let qdrant = TestServer::start(&fresh_dir("a"), "127.0.0.1:0".parse().unwrap()).unwrap();
    let url = sqlite_url();
    let config = |vector_url: &str| {
        let mut c = test_config(&url, 1 << 20);
        c.memory.vector_url = vector_url.to_string();
        c.memory.vector_collection = "engram_test".into();
        c
    };
    let srv = Server::start_with(config(&qdrant.url()));
    let (ka, _) = srv.tenant_with_bot("alpha", "Be brief.");
    let (kb, _) = srv.tenant_with_bot("beta", "Be brief.");
    let add = |key: &str, text: &str| {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/memory/nodes",
            Some(key),
            json!({"kind": "fact", "text": text}),
        );
        assert_eq!(s, 201, "{v}");
        v["id"].as_i64().unwrap()
    };
    let a1 = add(&ka, "The vault opens on Tuesdays at noon.");
    let a2 = add(&ka, "The garden is watered every morning.");
    let b1 = add(&kb, "The vault opens on Tuesdays at noon.");
    let query = |srv: &Server, key: &str| {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/memory/query",
            Some(key),
            json!({"text": "When does the vault open?", "k": 5, "hops": 0}),
        );
        assert_eq!(s, 200, "{v}");
        v
    };
    // Each tenant finds only its own copy of the same text.
    let qa = ids(&query(&srv, &ka));
    assert_eq!(qa.first(), Some(&a1), "{qa:?}");
    assert!(!qa.contains(&b1), "{qa:?}");
    assert_eq!(ids(&query(&srv, &kb)), vec![b1]);
    // A deleted node leaves the remote index.
    let (s, _) = srv.call(
        "DELETE",
        &format!("/v1/agents/bot/memory/nodes/{a1}"),
        Some(&ka),
        Value::Null,
    );
    assert_eq!(s, 204);
    assert_eq!(ids(&query(&srv, &ka)), vec![a2]);
    srv.stop();

    // A restart against the same index: nothing to re-embed.
    let srv = Server::start_with(config(&qdrant.url()));
    let (_, m) = srv.call("GET", "/v1/admin/memory", Some(ADMIN), Value::Null);
    assert_eq!(
        (m["vectors"].as_u64(), m["startup"]["reembedded"].as_u64()),
        (Some(2), Some(0)),
        "{m}"
    );
    srv.stop();

    // The vector server comes back empty (a new volume): the start re-indexes from the database.
    qdrant.stop();
    let empty = TestServer::start(&fresh_dir("b"), "127.0.0.1:0".parse().unwrap()).unwrap();
    let srv = Server::start_with(config(&empty.url()));
    let (_, m) = srv.call("GET", "/v1/admin/memory", Some(ADMIN), Value::Null);
    assert_eq!(
        (m["vectors"].as_u64(), m["startup"]["reembedded"].as_u64()),
        (Some(2), Some(2)),
        "{m}"
    );
    assert_eq!(ids(&query(&srv, &ka)), vec![a2]);
    assert_eq!(ids(&query(&srv, &kb)), vec![b1]);
    srv.stop();
    empty.stop();
}
