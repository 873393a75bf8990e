//! The memory graph through the API, on both backends: a fixed fixture recalled with the
//! expected neighbours, superseded facts hidden, tenants isolated (graph and vector index),
//! answers equal across a restart, turns ingested as linked episodes (kept out of other
//! sessions' prompts), and a neighbourhood reserved in the cold tier and used by a turn.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use engram_server::Config;
use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, database_urls, embedder_path, model_path, vector_dir};

fn config(url: &str, vectors: &std::path::Path) -> Config {
    let mut c = Config::default();
    c.database.url = url.to_string();
    c.auth.admin_key.0 = ADMIN.into();
    c.model.path = model_path();
    c.model.hot_mib = Some(256);
    c.model.cold_mib = Some(256);
    c.memory.embedder_path = embedder_path();
    c.memory.vector_dir = vectors.to_path_buf();
    c
}

fn node(srv: &Server, key: &str, kind: &str, text: &str) -> i64 {
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/memory/nodes",
        Some(key),
        json!({"kind": kind, "text": text}),
    );
    assert_eq!(s, 201, "{v}");
    v["id"].as_i64().unwrap()
}

fn edge(srv: &Server, key: &str, from: i64, to: i64, kind: &str) -> i64 {
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/memory/edges",
        Some(key),
        json!({"from": from, "to": to, "kind": kind}),
    );
    assert_eq!(s, 201, "{v}");
    v["id"].as_i64().unwrap()
}

fn query(srv: &Server, key: &str, body: Value) -> Value {
    let (s, v) = srv.call("POST", "/v1/agents/bot/memory/query", Some(key), body);
    assert_eq!(s, 200, "{v}");
    v
}

fn ids(v: &Value) -> Vec<i64> {
    v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_i64().unwrap())
        .collect()
}

struct Fixture {
    paris: i64,
    berlin: i64,
    alice: i64,
    housing: i64,
    coffee: i64,
}

/// Alice moved from Paris to Berlin (the Berlin fact supersedes the Paris one); Berlin relates
/// to housing; an unrelated fact about the office coffee machine.
fn fixture(srv: &Server, key: &str) -> Fixture {
    let f = Fixture {
        paris: node(srv, key, "fact", "Alice lives in Paris."),
        berlin: node(srv, key, "fact", "Alice lives in Berlin."),
        alice: node(srv, key, "entity", "Alice, the user's sister."),
        housing: node(srv, key, "concept", "Renting a flat near the river."),
        coffee: node(srv, key, "fact", "The office coffee machine is broken."),
    };
    edge(srv, key, f.paris, f.alice, "mentions");
    edge(srv, key, f.berlin, f.alice, "mentions");
    edge(srv, key, f.berlin, f.housing, "relates_to");
    edge(srv, key, f.berlin, f.paris, "supersedes");
    f
}

const AT: i64 = 1_800_000_000_000;

fn ask(srv: &Server, key: &str) -> Value {
    query(
        srv,
        key,
        json!({"text": "Where does Alice live?", "k": 4, "hops": 2, "at_ms": AT}),
    )
}

fn wait_for(mut done: impl FnMut() -> bool, what: &str) {
    let t = Instant::now();
    while !done() {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn reservations(srv: &Server, key: &str) -> Vec<Value> {
    let (s, v) = srv.call(
        "GET",
        "/v1/agents/bot/memory/reservations",
        Some(key),
        Value::Null,
    );
    assert_eq!(s, 200, "{v}");
    v["reservations"].as_array().unwrap().clone()
}

#[test]
fn recall_supersession_isolation_restart_ingest_and_reservation() {
    for url in database_urls() {
        let vectors = vector_dir();
        let srv = Server::start_with(config(&url, &vectors));
        let (key_a, _) = srv.tenant_with_bot("tenant-a", "Be brief.");
        let (key_b, _) = srv.tenant_with_bot("tenant-b", "Be brief.");
        let f = fixture(&srv, &key_a);

        // The expected neighbours: Berlin first (the closest text), Alice and housing through
        // edges; Paris is superseded and never surfaces; the coffee machine ranks below them.
        let r = ask(&srv, &key_a);
        let got = ids(&r);
        assert_eq!(got[0], f.berlin, "{url}: {r}");
        assert!(got.contains(&f.alice) && got.contains(&f.housing), "{r}");
        assert!(!got.contains(&f.paris), "superseded fact surfaced: {r}");
        let pos = |id: i64| got.iter().position(|&x| x == id).unwrap_or(usize::MAX);
        assert!(pos(f.coffee) > pos(f.alice), "{r}");
        let housing = &r["results"][pos(f.housing)];
        assert_eq!(housing["hops"], 1, "{housing}");
        // Canonical order is creation order (ids are random); the token estimate is there.
        let canon: Vec<i64> = r["canonical_order"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        let created = [f.paris, f.berlin, f.alice, f.housing, f.coffee];
        let in_creation_order: Vec<i64> =
            created.into_iter().filter(|id| got.contains(id)).collect();
        assert_eq!(canon, in_creation_order, "{r}");
        assert!(r["tokens"].as_u64().unwrap() > 10);
        // Without the supersedes edge, Paris comes back.
        let (_, e) = srv.call(
            "GET",
            "/v1/agents/bot/memory/edges",
            Some(&key_a),
            Value::Null,
        );
        let sup = e["edges"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["kind"] == "supersedes")
            .unwrap()["id"]
            .as_i64()
            .unwrap();
        let (s, _) = srv.raw(
            "DELETE",
            &format!("/v1/agents/bot/memory/edges/{sup}"),
            Some(&key_a),
            b"",
        );
        assert_eq!(s, 204);
        assert!(ids(&ask(&srv, &key_a)).contains(&f.paris));
        edge(&srv, &key_a, f.berlin, f.paris, "supersedes");
        assert_eq!(
            ids(&ask(&srv, &key_a)),
            got,
            "the same answer with the edge back"
        );

        // Tenant B stores the same text; neither tenant ever sees the other's nodes, even with
        // the vector search asked for many seeds.
        let b_paris = node(&srv, &key_b, "fact", "Alice lives in Paris.");
        let rb = query(
            &srv,
            &key_b,
            json!({"text": "Alice lives in Paris.", "k": 50, "hops": 8}),
        );
        assert_eq!(ids(&rb), vec![b_paris], "{rb}");
        let ra = query(
            &srv,
            &key_a,
            json!({"text": "Alice lives in Paris.", "k": 50, "hops": 8}),
        );
        assert!(!ids(&ra).contains(&b_paris), "{ra}");
        // B cannot read, link or delete A's nodes.
        let (s, _) = srv.call(
            "GET",
            &format!("/v1/agents/bot/memory/nodes/{}", f.berlin),
            Some(&key_b),
            Value::Null,
        );
        assert_eq!(s, 404);
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/memory/edges",
            Some(&key_b),
            json!({"from": b_paris, "to": f.alice, "kind": "mentions"}),
        );
        assert_eq!((s, v["code"].as_str()), (404, Some("not_found")), "{v}");
        // Bad input: clear codes, nothing stored.
        for body in [
            json!({"kind": "rumour", "text": "x"}),
            json!({"kind": "fact", "text": " "}),
            json!({"kind": "fact", "text": "x", "importance": 2.0}),
        ] {
            let (s, v) = srv.call("POST", "/v1/agents/bot/memory/nodes", Some(&key_b), body);
            assert_eq!(
                (s, v["code"].as_str()),
                (400, Some("invalid_request")),
                "{v}"
            );
        }
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/memory/query",
            Some(&key_b),
            json!({"text": "x", "k": 0}),
        );
        assert_eq!(s, 400, "{v}");
        let (_, listed) = srv.call(
            "GET",
            "/v1/agents/bot/memory/nodes",
            Some(&key_b),
            Value::Null,
        );
        assert_eq!(listed["nodes"].as_array().unwrap().len(), 1);

        // Restart: the graph comes back from the database and the persisted index is reused
        // (nothing re-embedded); the answers are equal, scores included.
        let before_a = ask(&srv, &key_a);
        srv.stop();
        let srv = Server::start_with(config(&url, &vectors));
        let (_, m) = srv.call("GET", "/v1/admin/memory", Some(ADMIN), Value::Null);
        assert_eq!(m["startup"]["nodes"], 6, "{m}");
        assert_eq!(m["startup"]["edges"], 4, "{m}");
        assert_eq!(m["startup"]["reembedded"], 0, "{m}");
        assert_eq!(m["vectors"], 6, "{m}");
        assert_eq!(ask(&srv, &key_a), before_a, "{url}");
        // A fresh index directory: every vector is embedded again from the database, and the
        // answers are still equal.
        srv.stop();
        let srv = Server::start_with(config(&url, &vector_dir()));
        let (_, m) = srv.call("GET", "/v1/admin/memory", Some(ADMIN), Value::Null);
        assert_eq!(m["startup"]["reembedded"], 6, "{m}");
        let after = ask(&srv, &key_a);
        assert_eq!(ids(&after), ids(&before_a));
        for (x, y) in after["results"]
            .as_array()
            .unwrap()
            .iter()
            .zip(before_a["results"].as_array().unwrap())
        {
            let (x, y) = (x["score"].as_f64().unwrap(), y["score"].as_f64().unwrap());
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }

        // Turns become episodes linked `follows` to their predecessor.
        let turn = |session: &str, msg: &str| {
            let (s, v) = srv.call(
                "POST",
                &format!("/v1/agents/bot/sessions/{session}/turns"),
                Some(&key_a),
                json!({"message": msg, "max_tokens": 3}),
            );
            assert_eq!(s, 200, "{v}");
            v
        };
        turn("s1", "My sister Alice just moved.");
        let t2 = turn("s1", "She found a flat near the river.");
        let (_, nodes) = srv.call(
            "GET",
            "/v1/agents/bot/memory/nodes",
            Some(&key_a),
            Value::Null,
        );
        // Ids are random: the order of creation is `created_at`.
        let mut episodes: Vec<(i64, i64)> = nodes["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["kind"] == "episode" && n["session_id"] == "s1")
            .map(|n| (n["created_at"].as_i64().unwrap(), n["id"].as_i64().unwrap()))
            .collect();
        episodes.sort_unstable();
        let episodes: Vec<i64> = episodes.into_iter().map(|(_, id)| id).collect();
        assert_eq!(episodes.len(), 2, "{nodes}");
        let (_, e) = srv.call(
            "GET",
            &format!("/v1/agents/bot/memory/nodes/{}", episodes[1]),
            Some(&key_a),
            Value::Null,
        );
        assert!(
            e["edges"]
                .as_array()
                .unwrap()
                .iter()
                .any(|x| x["kind"] == "follows"
                    && x["from_id"] == episodes[1]
                    && x["to_id"] == episodes[0]),
            "{e}"
        );
        // The session's own episodes stay out of its memories layer; the facts come in.
        let shown: BTreeSet<i64> = t2["memories"]["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert!(!shown.contains(&episodes[0]), "{t2}");
        assert!(!shown.contains(&f.paris), "{t2}");

        // Another session does not recall the first session's episodes (the agent's memory is
        // session-scoped by default; `privacy.rs` tests the agent-wide scope).
        let (_, p) = srv.call(
            "POST",
            "/v1/agents/bot/context",
            Some(&key_a),
            json!({"message": "Where did my sister move to?", "session": "s2"}),
        );
        let recalled: Vec<i64> = p["memories"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert!(recalled.iter().all(|id| !episodes.contains(id)), "{p}");
        assert!(
            recalled.contains(&f.berlin),
            "the agent's own facts still come: {p}"
        );

        // Reservation: wait until the turns' background reservations settled, then reserve the
        // neighbourhood of a question explicitly and ask it in a new session.
        wait_for(
            || {
                reservations(&srv, &key_a)
                    .iter()
                    .all(|r| r["state"] != "pending")
            },
            "background reservations",
        );
        let q = "Which city does Alice live in now?";
        let r = query(&srv, &key_a, json!({"text": q, "reserve": true}));
        let id = r["reservation"].as_u64().unwrap();
        wait_for(
            || {
                reservations(&srv, &key_a)
                    .iter()
                    .any(|r| r["id"] == id && r["state"] == "ready")
            },
            "the reservation",
        );
        let ready = reservations(&srv, &key_a)
            .into_iter()
            .find(|r| r["id"] == id)
            .unwrap();
        assert_eq!(ready["source"], "memories");
        assert!(ready["held"].as_u64().unwrap() > 0, "{ready}");
        // Tenant B does not see it.
        assert!(reservations(&srv, &key_b).iter().all(|r| r["id"] != id));
        let t = turn("s3", q);
        let m = &t["memories"];
        assert!(m["reserved_tokens"].as_u64().unwrap() > 0, "{t}");
        assert!(m["reserved_tokens"].as_u64() <= m["tokens"].as_u64(), "{t}");
        let used = reservations(&srv, &key_a)
            .into_iter()
            .find(|r| r["id"] == id)
            .unwrap();
        assert_eq!(used["state"], "warmed", "{used}");
        // Metrics and the operator view count it.
        let (_, metrics) = srv.raw("GET", "/metrics", Some(ADMIN), b"");
        let metrics = String::from_utf8_lossy(&metrics).to_string();
        let made: u64 = metrics
            .lines()
            .find(|l| l.starts_with("engram_reservations_total{result=\"made\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap()
            .parse()
            .unwrap();
        assert!(made >= 1, "{metrics}");
        assert!(metrics.contains("engram_reservation_hit_rate"), "{metrics}");
        let (s, all) = srv.call("GET", "/v1/admin/reservations", Some(ADMIN), Value::Null);
        assert_eq!(s, 200);
        assert!(all["counters"]["warmed"].as_u64().unwrap() >= 1, "{all}");
        srv.stop();
    }
}

/// The node `id` of the tenant of `key`.
fn node_of(srv: &Server, key: &str, id: i64) -> Value {
    let (s, v) = srv.call(
        "GET",
        &format!("/v1/agents/bot/memory/nodes/{id}"),
        Some(key),
        Value::Null,
    );
    assert_eq!(s, 200, "{v}");
    v["node"].clone()
}

/// A session's own turns are never recalled while its conversation shows them; once the window
/// has left a turn out, its episode can be recalled into the session's own prompt.
#[test]
fn a_turn_the_window_left_out_is_recalled_into_its_own_session() {
    let vectors = vector_dir();
    let mut c = config(&crate::harness::sqlite_url(), &vectors);
    c.model.context_tokens = 1024;
    let srv = Server::start_with(c);
    let (key, _) = srv.tenant_with_bot("t", "Answer in one short sentence.");
    let turn = |msg: &str| {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/s/turns",
            Some(&key),
            json!({"message": msg, "max_tokens": 8}),
        );
        assert_eq!(s, 200, "{v}");
        v
    };
    let recalled = |v: &Value| -> Vec<Value> {
        v["memories"]["nodes"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|id| node_of(&srv, &key, id.as_i64().unwrap()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let question = "What is my locker code in hall B?";
    turn("Remember this: my locker code is 4417 and my locker is in hall B.");
    // While the conversation shows it, the locker turn is not recalled (nor any other turn of
    // this session).
    let v = turn(question);
    assert!(
        recalled(&v).iter().all(|n| n["session_id"] != "s"),
        "{:?}",
        recalled(&v)
    );
    let topics = [
        "the weather in spring",
        "baking sourdough bread",
        "repairing a bicycle chain",
        "planting tomatoes",
        "learning the violin",
        "painting a fence",
        "training a puppy",
        "brewing green tea",
        "tiling a bathroom",
        "knitting a scarf",
        "sailing a dinghy",
        "building a birdhouse",
        "cleaning a fish tank",
        "restoring old chairs",
    ];
    let mut dropped = 0;
    for t in topics {
        let v = turn(&format!(
            "Tell me one practical tip about {t}, in plain words, for a complete beginner."
        ));
        dropped = v["budgets"]["dropped_turns"].as_u64().unwrap();
        // Only turns the window left out may come back.
        for n in recalled(&v) {
            if n["session_id"] == "s" {
                assert!(dropped > 0, "{n} recalled while the conversation shows it");
            }
        }
        if dropped >= 4 {
            break;
        }
    }
    assert!(dropped >= 4, "the window never left the locker turn out");
    let v = turn(question);
    let nodes = recalled(&v);
    assert!(
        nodes
            .iter()
            .any(|n| n["session_id"] == "s" && n["text"].as_str().unwrap().contains("4417")),
        "{nodes:?}"
    );
    srv.stop();
}

/// Lines a layer spilled over its budget become facts of the agent, once each, and are
/// recalled when a message is about them.
#[test]
fn spilled_lines_become_recallable_facts_once() {
    let vectors = vector_dir();
    let srv = Server::start_with(config(&crate::harness::sqlite_url(), &vectors));
    let (key, _) = srv.tenant_with_bot("t", "Answer in one short sentence.");
    let facts: Vec<String> = [
        "The server room door code is 5521.",
        "The coffee beans come from a farm in Huila.",
        "Invoices are sent on the first Monday of the month.",
        "The backup tapes are stored in the basement safe.",
        "The office plants are watered on Thursdays.",
        "The guest wifi password changes every quarter.",
        "Parking spaces 12 to 18 belong to the design team.",
        "The fire drill is held every March.",
    ]
    .map(String::from)
    .to_vec();
    let (s, v) = srv.call(
        "PUT",
        "/v1/agents/bot/layers/neurons",
        Some(&key),
        json!({"content": facts.join("\n"), "budget": 40}),
    );
    assert_eq!(s, 200, "{v}");
    let turn = |session: &str, msg: &str| {
        let (s, v) = srv.call(
            "POST",
            &format!("/v1/agents/bot/sessions/{session}/turns"),
            Some(&key),
            json!({"message": msg, "max_tokens": 6}),
        );
        assert_eq!(s, 200, "{v}");
        v
    };
    let fact_nodes = || -> Vec<String> {
        let (s, v) = srv.call(
            "GET",
            "/v1/agents/bot/memory/nodes?limit=1000",
            Some(&key),
            Value::Null,
        );
        assert_eq!(s, 200, "{v}");
        let mut out: Vec<String> = v["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|n| n["kind"] == "fact")
            .map(|n| n["text"].as_str().unwrap().to_string())
            .collect();
        out.sort();
        out
    };
    turn("a", "Hello there.");
    let (s, wm) = srv.call(
        "GET",
        "/v1/agents/bot/sessions/a/working-memory",
        Some(&key),
        Value::Null,
    );
    assert_eq!(s, 200, "{wm}");
    let mut spilled: Vec<String> = wm["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["line"].as_str().unwrap().trim().to_string())
        .collect();
    spilled.sort();
    assert!(spilled.len() >= 3, "{wm}");
    assert_eq!(fact_nodes(), spilled);
    // The same spill again, in this session and another: no second copy.
    turn("a", "How are you?");
    turn("b", "Good morning.");
    assert_eq!(fact_nodes(), spilled);
    // A message about a spilled fact recalls it.
    let target = spilled
        .iter()
        .find(|l| l.contains("door code"))
        .or(spilled.first())
        .unwrap();
    let v = turn("c", &format!("Tell me about this: {target}"));
    let texts: Vec<String> = v["memories"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| {
            node_of(&srv, &key, id.as_i64().unwrap())["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(texts.contains(target), "{target} not in {texts:?}");
    srv.stop();
}

/// Query-time prefetch: the neighbourhood of what the user is typing is reserved as the
/// session's next turn will show it; the turn then finds its memories cached from the
/// reservation; asking again for the same neighbourhood reserves nothing; the hit is counted in
/// the operator view and `/metrics`; bad input is refused.
#[test]
fn a_prefetch_stages_the_memories_the_next_turn_shows() {
    let vectors = vector_dir();
    let mut c = config(&crate::harness::sqlite_url(), &vectors);
    // Only the prefetch reserves: no reservation after turns, no episodes from them.
    c.memory.reserve = false;
    c.memory.ingest_turns = false;
    let srv = Server::start_with(c);
    let (key, _) = srv.tenant_with_bot("t", "Answer in one short sentence.");
    fixture(&srv, &key);
    let prefetch = |session: &str, text: &str| {
        srv.call(
            "POST",
            &format!("/v1/agents/bot/sessions/{session}/prefetch"),
            Some(&key),
            json!({"text": text}),
        )
    };
    let turn = |session: &str, msg: &str| {
        let (s, v) = srv.call(
            "POST",
            &format!("/v1/agents/bot/sessions/{session}/turns"),
            Some(&key),
            json!({"message": msg, "max_tokens": 4}),
        );
        assert_eq!(s, 200, "{v}");
        v
    };
    // A first turn in each session, so the prefetch has a conversation to build on.
    turn("typed", "Hello, I have a question about my family.");
    turn("plain", "Hello, I have a question about my family.");
    let q = "Which city does my sister Alice live in now?";
    let (s, p) = prefetch("typed", q);
    assert_eq!(s, 200, "{p}");
    assert_eq!(p["outcome"], "reserved", "{p}");
    let id = p["reservation"].as_u64().unwrap();
    assert!(!p["memories"].as_array().unwrap().is_empty(), "{p}");
    // The same neighbourhood again (the user typed on): nothing new to reserve.
    let (s, again) = prefetch("typed", q);
    assert_eq!(s, 200);
    assert_eq!(again["outcome"], "unchanged", "{again}");
    assert_eq!(again["memories"], p["memories"]);
    wait_for(
        || {
            reservations(&srv, &key)
                .iter()
                .any(|r| r["id"] == id && r["state"] == "ready")
        },
        "the prefetch's reservation",
    );
    let with = turn("typed", q);
    assert_eq!(with["memories"]["nodes"], p["memories"], "{with}");
    let m = &with["memories"];
    assert!(m["reserved_tokens"].as_u64().unwrap() > 0, "{with}");
    assert!(
        m["reserved_tokens"].as_u64() <= m["tokens"].as_u64(),
        "{with}"
    );
    // Counted once: the prefetched session's turn was a hit.
    let (s, all) = srv.call("GET", "/v1/admin/reservations", Some(ADMIN), Value::Null);
    assert_eq!(s, 200);
    let f = &all["prefetch"];
    assert_eq!(
        (&f["reserved"], &f["unchanged"], &f["hits"], &f["misses"]),
        (&json!(1), &json!(1), &json!(1), &json!(0)),
        "{all}"
    );
    assert_eq!(f["hit_rate"], 1.0);
    let (_, metrics) = srv.raw("GET", "/metrics", Some(ADMIN), b"");
    let metrics = String::from_utf8_lossy(&metrics).to_string();
    assert!(
        metrics.contains("engram_prefetch_turns_total{result=\"hit\"} 1"),
        "{metrics}"
    );
    // A prefetch whose memories the turn does not show is a miss: a fact added between the
    // prefetch and the turn joins the turn's neighbourhood.
    let w = "Where does my sister Alice work?";
    let (_, p2) = prefetch("typed", w);
    assert_eq!(p2["outcome"], "reserved", "{p2}");
    node(
        &srv,
        &key,
        "fact",
        "Alice works as a nurse at a hospital in Berlin.",
    );
    let t = turn("typed", w);
    assert_ne!(t["memories"]["nodes"], p2["memories"], "{t}");
    let (_, all) = srv.call("GET", "/v1/admin/reservations", Some(ADMIN), Value::Null);
    assert_eq!(all["prefetch"]["misses"], 1, "{all}");
    // Bad input: 400 with the stable code, an unknown agent 404.
    for body in [
        json!({"text": "   "}),
        json!({"text": "x".repeat(64 * 1024 + 1)}),
        json!({"text": "hi", "extra": 1}),
        json!({}),
    ] {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/typed/prefetch",
            Some(&key),
            body,
        );
        assert_eq!(s, 400, "{v}");
        assert_eq!(v["code"], "invalid_request", "{v}");
    }
    let (s, _) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/bad.name/prefetch",
        Some(&key),
        json!({"text": "hi"}),
    );
    assert_eq!(s, 400);
    let (s, _) = srv.call(
        "POST",
        "/v1/agents/nobody/sessions/typed/prefetch",
        Some(&key),
        json!({"text": "hi"}),
    );
    assert_eq!(s, 404);
    srv.stop();
}
