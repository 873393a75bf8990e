//! Deleting a session, an agent and a tenant: afterwards the turn log, the cached blocks (every
//! tier), the shadow, and the memory graph hold nothing of it, on SQLite and PostgreSQL, and a
//! restart brings nothing back.

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, database_urls, test_config};
use crate::shadow::fresh_dir;

fn config(url: &str, dir: &std::path::Path) -> engram_server::Config {
    let mut c = test_config(url, 64 * 1024);
    c.shadow.dir = dir.to_path_buf();
    c.shadow.interval_ms = 3_600_000;
    c.tiers.enabled = false;
    c
}

/// Every block listed, with its owner (`null`: a tenant that no longer exists).
fn blocks(srv: &Server) -> Vec<Value> {
    let (s, page) = srv.call(
        "GET",
        "/v1/admin/blocks?limit=1000",
        Some(ADMIN),
        Value::Null,
    );
    assert_eq!(s, 200, "{page}");
    assert!(page["total"].as_u64().unwrap() <= 1000, "{page}");
    page["blocks"].as_array().unwrap().clone()
}

fn session_blocks(srv: &Server, tenant: &str, session: &str) -> u64 {
    let (s, page) = srv.call(
        "GET",
        &format!("/v1/admin/blocks?tenant={tenant}&agent=bot&session={session}&limit=1"),
        Some(ADMIN),
        Value::Null,
    );
    assert_eq!(s, 200, "{page}");
    page["total"].as_u64().unwrap()
}

fn nodes(srv: &Server, key: &str) -> Vec<Value> {
    let (s, v) = srv.call(
        "GET",
        "/v1/agents/bot/memory/nodes?limit=1000",
        Some(key),
        Value::Null,
    );
    assert_eq!(s, 200, "{v}");
    v["nodes"].as_array().unwrap().clone()
}

fn shadow_sessions(srv: &Server) -> u64 {
    let (s, v) = srv.call("POST", "/v1/admin/shadow/flush", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{v}");
    let (_, v) = srv.call("GET", "/v1/admin/shadow", Some(ADMIN), Value::Null);
    v["sessions"].as_u64().unwrap()
}

fn turns_in_db(url: &str, tenant: &str, session: &str) -> usize {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = engram_store::Store::connect(url).await.unwrap();
        let n = match store.agent(tenant, "bot").await {
            Ok(agent) => store.turns(&agent.id, session).await.unwrap().len(),
            Err(_) => 0,
        };
        store.close().await;
        n
    })
}

fn tenant_id(srv: &Server, key: &str) -> String {
    let (_, v) = srv.call("GET", "/v1/agents/bot", Some(key), Value::Null);
    v["agent"]["tenant_id"].as_str().unwrap().to_string()
}

#[test]
fn deleting_a_session_an_agent_and_a_tenant_leaves_nothing_and_a_restart_brings_nothing_back() {
    for url in database_urls() {
        let dir = fresh_dir("deletion");
        let srv = Server::start_with(config(&url, &dir));
        let (ka, _) = srv.tenant_with_bot("keeper", "Remember what the user says.");
        let (kb, _) = srv.tenant_with_bot("leaver", "Remember what the user says.");
        let (ta, tb) = (tenant_id(&srv, &ka), tenant_id(&srv, &kb));
        let turn = |key: &str, session: &str, msg: &str| {
            let (s, v) = srv.call(
                "POST",
                &format!("/v1/agents/bot/sessions/{session}/turns"),
                Some(key),
                json!({"message": msg, "max_tokens": 2}),
            );
            assert_eq!(s, 200, "{v}");
        };
        let long = |s: &str| {
            format!("In session {s}: my favourite colour is teal and I live near the old harbour. ")
                .repeat(12)
        };
        // Each session says its own text, so each computes (and owns) blocks of its own: with the
        // agent's memory scoped to sessions, two sessions saying the same would share them all.
        for s in ["s1", "s2"] {
            turn(&ka, s, &long(s));
            turn(&ka, s, "What did I just say?");
        }
        turn(&kb, "s1", &long("s1"));
        assert!(session_blocks(&srv, &ta, "s1") > 0);
        assert!(session_blocks(&srv, &ta, "s2") > 0);
        assert!(nodes(&srv, &ka).iter().any(|n| n["session_id"] == "s1"));
        assert_eq!(shadow_sessions(&srv), 3);
        let b_nodes = nodes(&srv, &kb).len();
        assert!(b_nodes > 0);
        // Listings are paginated by id: pages of `limit`, `next` the cursor of the next page,
        // together the whole list.
        for (what, limit) in [("nodes", 3), ("edges", 1)] {
            let (_, all) = srv.call(
                "GET",
                &format!("/v1/agents/bot/memory/{what}?limit=1000"),
                Some(&ka),
                Value::Null,
            );
            let all = all[what].as_array().unwrap().clone();
            assert!(all.len() > limit, "{what}: {all:?}");
            let (mut paged, mut after, mut pages) = (Vec::new(), 0i64, 0);
            loop {
                let (s, page) = srv.call(
                    "GET",
                    &format!("/v1/agents/bot/memory/{what}?limit={limit}&after={after}"),
                    Some(&ka),
                    Value::Null,
                );
                assert_eq!(s, 200, "{page}");
                let items = page[what].as_array().unwrap();
                assert!(items.len() <= limit);
                paged.extend(items.iter().cloned());
                pages += 1;
                match page["next"].as_i64() {
                    Some(n) => after = n,
                    None => break,
                }
            }
            assert_eq!(paged, all, "{what}");
            assert!(pages >= all.len().div_ceil(limit));
        }

        // A session: its turns, blocks, episodes and shadow entry go; the other session stays.
        let (s, v) = srv.call(
            "DELETE",
            "/v1/agents/bot/sessions/s1",
            Some(&ka),
            Value::Null,
        );
        assert_eq!(s, 200, "{v}");
        assert!(v["blocks"].as_u64().unwrap() > 0, "{v}");
        assert!(v["memory_nodes"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(turns_in_db(&url, &ta, "s1"), 0);
        assert_eq!(turns_in_db(&url, &ta, "s2"), 4);
        assert_eq!(session_blocks(&srv, &ta, "s1"), 0);
        assert!(session_blocks(&srv, &ta, "s2") > 0);
        assert!(!nodes(&srv, &ka).iter().any(|n| n["session_id"] == "s1"));
        assert!(nodes(&srv, &ka).iter().any(|n| n["session_id"] == "s2"));
        assert_eq!(shadow_sessions(&srv), 2);
        // Gone is gone: a second delete is a 404; another tenant cannot delete A's sessions.
        let (s, v) = srv.call(
            "DELETE",
            "/v1/agents/bot/sessions/s1",
            Some(&ka),
            Value::Null,
        );
        assert_eq!((s, v["code"].as_str()), (404, Some("not_found")), "{v}");
        let (s, _) = srv.call(
            "DELETE",
            "/v1/agents/bot/sessions/s2",
            Some(&kb),
            Value::Null,
        );
        assert_eq!(s, 404, "B has no session s2 of its own");
        assert_eq!(turns_in_db(&url, &ta, "s2"), 4);

        // An agent: everything of it.
        let (s, v) = srv.call("DELETE", "/v1/agents/bot", Some(&ka), Value::Null);
        assert_eq!(s, 200, "{v}");
        let (s, _) = srv.call("GET", "/v1/agents/bot", Some(&ka), Value::Null);
        assert_eq!(s, 404);
        assert_eq!(turns_in_db(&url, &ta, "s2"), 0);
        assert!(
            !blocks(&srv).iter().any(|b| b["tenant_id"] == ta.as_str()),
            "blocks of the deleted agent remain"
        );
        assert_eq!(shadow_sessions(&srv), 1);

        // A tenant: keys stop working, its blocks, shadow entries and nodes are gone.
        let (s, v) = srv.call(
            "DELETE",
            &format!("/v1/admin/tenants/{tb}"),
            Some(ADMIN),
            Value::Null,
        );
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["memory_nodes"].as_u64().unwrap() as usize, b_nodes, "{v}");
        let (s, _) = srv.call("GET", "/v1/agents", Some(&kb), Value::Null);
        assert_eq!(s, 401);
        let (s, _) = srv.call(
            "DELETE",
            &format!("/v1/admin/tenants/{tb}"),
            Some(ADMIN),
            Value::Null,
        );
        assert_eq!(s, 404);
        let (s, _) = srv.call(
            "DELETE",
            &format!("/v1/admin/tenants/{tb}"),
            Some(&ka),
            Value::Null,
        );
        assert_eq!(s, 401, "a tenant cannot delete tenants");
        let left = blocks(&srv);
        assert!(
            left.iter().all(|b| b["tenant_id"] == "public"),
            "blocks remain: {left:?}"
        );
        assert_eq!(shadow_sessions(&srv), 0);
        let (_, m) = srv.call("GET", "/v1/admin/memory", Some(ADMIN), Value::Null);
        assert_eq!(
            (m["nodes"].as_u64(), m["vectors"].as_u64()),
            (Some(0), Some(0)),
            "{m}"
        );
        srv.stop();

        // A restart (same database, same shadow) brings nothing back.
        let srv = Server::start_with(config(&url, &dir));
        let (_, status) = srv.call("GET", "/v1/admin/shadow", Some(ADMIN), Value::Null);
        assert_eq!(
            status["recovery"].as_array().map(Vec::len),
            Some(0),
            "{status}"
        );
        assert!(blocks(&srv).is_empty());
        let (_, m) = srv.call("GET", "/v1/admin/memory", Some(ADMIN), Value::Null);
        assert_eq!(
            (m["nodes"].as_u64(), m["vectors"].as_u64()),
            (Some(0), Some(0)),
            "{m}"
        );
        let (_, t) = srv.call("GET", "/v1/admin/tenants", Some(ADMIN), Value::Null);
        let names: Vec<&str> = t["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, vec!["keeper"]);
        srv.stop();
    }
}

/// Streams a turn of `session`; once its first token arrives, runs `meanwhile`; returns the
/// stream's events.
fn stream_turn_while(
    srv: &Server,
    key: &str,
    session: &str,
    message: &str,
    meanwhile: impl FnOnce(),
) -> Vec<Value> {
    use std::io::{Read, Write};
    // A hot sampling temperature keeps the answer from ending early (an end-of-text token is one
    // of 49,152), so the stream is still running when `meanwhile` is done.
    let body = json!({
        "message": message,
        "max_tokens": 96,
        "temperature": 1.5,
        "seed": 7,
        "stream": true
    })
    .to_string();
    let mut conn = std::net::TcpStream::connect(srv.addr).unwrap();
    write!(
        conn,
        "POST /v1/agents/bot/sessions/{session}/turns HTTP/1.1\r\nhost: x\r\n\
         connection: close\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: {\"delta\"") {
        let n = conn.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before its first token");
        got.extend_from_slice(&buf[..n]);
    }
    meanwhile();
    conn.read_to_end(&mut got).unwrap();
    String::from_utf8_lossy(&got)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_session_deleted_while_its_turn_runs_stays_deleted() {
    for url in database_urls() {
        let dir = fresh_dir("deletion-race");
        let srv = Server::start_with(config(&url, &dir));
        let (key, _) = srv.tenant_with_bot("racer", "Remember what the user says.");
        let tenant = tenant_id(&srv, &key);
        for s in ["s1", "s2"] {
            // Each session its own text, so each owns blocks (see the test above).
            let long = format!(
                "In session {s}: my favourite colour is teal and I live near the old harbour. "
            )
            .repeat(12);
            let (st, v) = srv.call(
                "POST",
                &format!("/v1/agents/bot/sessions/{s}/turns"),
                Some(&key),
                json!({"message": long, "max_tokens": 2}),
            );
            assert_eq!(st, 200, "{v}");
        }
        assert_eq!(shadow_sessions(&srv), 2);
        // s1 is deleted while its next turn is generating.
        let events = stream_turn_while(
            &srv,
            &key,
            "s1",
            "Count from one to forty in words, one number per line.",
            || {
                let (s, v) = srv.call(
                    "DELETE",
                    "/v1/agents/bot/sessions/s1",
                    Some(&key),
                    Value::Null,
                );
                assert_eq!(s, 200, "{v}");
            },
        );
        let last = events.last().unwrap();
        assert_eq!(last["error"]["code"], "session_deleted", "{events:?}");
        assert!(events.iter().any(|e| e["delta"].is_string()));
        // Nothing of s1 came back: no turns, blocks, episodes or shadow entry; s2 is whole.
        assert_eq!(turns_in_db(&url, &tenant, "s1"), 0);
        assert_eq!(turns_in_db(&url, &tenant, "s2"), 2);
        assert_eq!(session_blocks(&srv, &tenant, "s1"), 0);
        assert!(session_blocks(&srv, &tenant, "s2") > 0);
        assert!(!nodes(&srv, &key).iter().any(|n| n["session_id"] == "s1"));
        assert_eq!(shadow_sessions(&srv), 1);
        srv.stop();
        // Nor after a restart; and the session can be started afresh.
        let srv = Server::start_with(config(&url, &dir));
        assert_eq!(session_blocks(&srv, &tenant, "s1"), 0);
        assert_eq!(shadow_sessions(&srv), 1);
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/s1/turns",
            Some(&key),
            json!({"message": "Hello again.", "max_tokens": 2}),
        );
        assert_eq!(s, 200, "{v}");
        assert_eq!(turns_in_db(&url, &tenant, "s1"), 2);
        srv.stop();
    }
}
