//! Sessions as workflows (seed 002): context injected between phases is prefilled once and
//! reused by the next turn; injected entries are logged and replayed like turns; a fork shares
//! its parent's blocks.

use std::path::{Path, PathBuf};

use engram_server::Config;
use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, sqlite_url, test_config};

const AGENTS: [&str; 3] = ["planner", "researcher", "writer"];
const PHASES: usize = 4;

/// A capabilities layer of about 1,000 tokens: a prompt long enough that a turn's own message
/// is under 5 % of it.
fn capabilities(agent: &str) -> String {
    (0..40)
        .map(|i| {
            format!(
                "- Tool {i} of the {agent}: `{agent}_tool_{i}` reads a project record, \
                 checks it against the plan and reports what changed since the last phase."
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn config(url: &str, shadow: Option<&Path>) -> Config {
    let mut c = test_config(url, 1 << 20);
    // Replay rebuilds a session's prompts from its log, which past recalls are not part of.
    c.memory.enabled = false;
    c.tiers.enabled = false;
    match shadow {
        Some(dir) => {
            c.shadow.dir = dir.to_path_buf();
            c.shadow.interval_ms = 3_600_000;
        }
        None => c.shadow.enabled = false,
    }
    c
}

fn shadow_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "engram-e2e-phases-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tenant and its three agents; answers the tenant's key.
fn setup(srv: &Server) -> String {
    let (s, t) = srv.call(
        "POST",
        "/v1/admin/tenants",
        Some(ADMIN),
        json!({"name": "flow"}),
    );
    assert_eq!(s, 201, "{t}");
    let key = t["api_key"].as_str().unwrap().to_string();
    for agent in AGENTS {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(&key),
            json!({"name": agent, "layers": [
                {"kind": "axioms", "content": "Answer in one short sentence."},
                {"kind": "identity", "content": format!("You are the {agent} of a three-agent team.")},
                {"kind": "capabilities", "content": capabilities(agent)},
            ]}),
        );
        assert_eq!(s, 201, "{v}");
    }
    key
}

/// What one phase measured.
#[derive(Debug, Clone, PartialEq)]
struct Phase {
    answer: String,
    injected_tokens: u64,
    prefilled_tokens: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
}

fn turn(srv: &Server, key: &str, agent: &str, msg: &str) -> Value {
    turn_in(srv, key, agent, "job", msg)
}

fn inject(srv: &Server, key: &str, agent: &str, entries: Value) -> Value {
    let (s, v) = srv.call(
        "POST",
        &format!("/v1/agents/{agent}/sessions/job/context"),
        Some(key),
        json!({ "entries": entries }),
    );
    assert_eq!(s, 200, "{v}");
    v
}

/// Phase `p` of `agent`: a tool result injected, then a turn.
fn phase(srv: &Server, key: &str, agent: &str, p: usize) -> Phase {
    let result = format!(
        "Phase {p}: the search found {} records; the newest says the {agent} milestone {p} \
         is done and milestone {} starts on day {}.",
        p * 7 + 3,
        p + 1,
        p * 4 + 2
    );
    let inj = inject(
        srv,
        key,
        agent,
        json!([{"role": "tool", "name": "search", "content": result}]),
    );
    let v = turn(
        srv,
        key,
        agent,
        &format!("Phase {p}: what is the next step?"),
    );
    Phase {
        answer: v["text"].as_str().unwrap().to_string(),
        injected_tokens: inj["injected_tokens"].as_u64().unwrap(),
        prefilled_tokens: inj["prefilled_tokens"].as_u64().unwrap(),
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap(),
        cached_tokens: v["usage"]["cached_tokens"].as_u64().unwrap(),
    }
}

/// Every agent's kickoff turn.
fn kickoff(srv: &Server, key: &str) {
    for agent in AGENTS {
        turn(
            srv,
            key,
            agent,
            "The project is a report on river water quality. Ready?",
        );
    }
}

/// Phases `range` of every agent, agent after agent within a phase.
fn phases(srv: &Server, key: &str, range: std::ops::Range<usize>) -> Vec<Phase> {
    let mut out = Vec::new();
    for p in range {
        for agent in AGENTS {
            out.push(phase(srv, key, agent, p));
        }
    }
    out
}

/// 3 agents × 4 phases (a tool result injected, then a turn): every phase turn reuses ≥ 95 %
/// of its prompt, every injection prefills at most its own tokens + 16, and the final answers
/// are the same without a restart, after a restart that restores the cache from the shadow, and
/// after a restart whose cache was cleared (the shadow removed: every lost prefill, injections
/// included, is replayed from the log).
#[test]
fn three_agents_four_phases_reuse_their_cache_and_answer_alike_after_restarts() {
    let reference = {
        let srv = Server::start_with(config(&sqlite_url(), None));
        let key = setup(&srv);
        kickoff(&srv, &key);
        let out = phases(&srv, &key, 1..PHASES + 1);
        srv.stop();
        out
    };
    for (i, p) in reference.iter().enumerate() {
        let share = p.cached_tokens as f64 / p.prompt_tokens as f64;
        assert!(
            share >= 0.95,
            "phase turn {i}: reused {share:.3} of its prompt: {p:?}"
        );
        assert!(
            p.prefilled_tokens <= p.injected_tokens + 16,
            "injection {i} prefilled {} for {} injected tokens",
            p.prefilled_tokens,
            p.injected_tokens
        );
        assert!(p.injected_tokens > 20, "{p:?}");
    }
    let min_share = reference
        .iter()
        .map(|p| p.cached_tokens as f64 / p.prompt_tokens as f64)
        .fold(1.0, f64::min);
    let overhead = reference
        .iter()
        .map(|p| p.prefilled_tokens as i64 - p.injected_tokens as i64)
        .max()
        .unwrap_or(0);
    eprintln!(
        "phases: {} phase turns, least reuse {min_share:.3}; injections prefilled at most {overhead} \
         tokens over their own",
        reference.len()
    );
    // The injected results reach the model: each agent's next phase turn reads a context grown
    // by at least that phase's injection. (Whether a 135M model's short greedy answer changes
    // with them is not asserted: with f16 KV each agent answers alike in every phase, and only
    // codec noise made the answers differ before.)
    for (i, pair) in reference.windows(AGENTS.len() + 1).enumerate() {
        let (before, after) = (&pair[0], &pair[AGENTS.len()]);
        assert!(
            after.prompt_tokens >= before.prompt_tokens + after.injected_tokens,
            "phase turn {}: {before:?} then {after:?}",
            i + AGENTS.len()
        );
    }
    // Answers depend on the agent: not all alike. (Not one per agent: a 135M model's short
    // greedy answers of two agents can coincide, and which do depends on the kernel tier's
    // summation order — on an AVX2-only Zen 3, two of the three agents answered alike.)
    let distinct: std::collections::HashSet<_> = reference.iter().map(|p| &p.answer).collect();
    assert!(distinct.len() >= 2, "{reference:?}");
    let last = |v: &[Phase]| -> Vec<String> {
        v[v.len() - AGENTS.len()..]
            .iter()
            .map(|p| p.answer.clone())
            .collect()
    };
    for clear in [false, true] {
        let url = sqlite_url();
        let dir = shadow_dir();
        let srv = Server::start_with(config(&url, Some(&dir)));
        let key = setup(&srv);
        kickoff(&srv, &key);
        let mut run = phases(&srv, &key, 1..4);
        let (s, v) = srv.call("POST", "/v1/admin/shadow/flush", Some(ADMIN), Value::Null);
        assert_eq!(s, 200, "{v}");
        srv.stop();
        if clear {
            std::fs::remove_dir_all(&dir).unwrap();
            std::fs::create_dir_all(&dir).unwrap();
        }
        let srv = Server::start_with(config(&url, Some(&dir)));
        run.extend(phases(&srv, &key, 4..PHASES + 1));
        let (_, m) = srv.call("GET", "/metrics", Some(ADMIN), Value::Null);
        let m = m.as_str().unwrap_or_default().to_string();
        let replayed = m
            .lines()
            .find_map(|l| l.strip_prefix("engram_replayed_turns_total "))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if clear {
            // Each agent: the kickoff turn (prompt and warm-up), then phases 1–3 (injection,
            // prompt, warm-up): 2 + 3 × 3 prefills.
            assert_eq!(replayed, 3 * 11, "{m}");
        } else {
            assert_eq!(replayed, 0, "{m}");
        }
        assert_eq!(
            last(&run),
            last(&reference),
            "final answers (cache cleared: {clear})"
        );
        srv.stop();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Bad injections answer 400 and append nothing; a retried injection with its
/// `Idempotency-Key` answers the stored answer and appends nothing.
#[test]
fn bad_injections_are_refused_and_a_retried_one_is_not_appended_twice() {
    let url = sqlite_url();
    let srv = Server::start_with(config(&url, None));
    let key = setup(&srv);
    turn(&srv, &key, "planner", "Hello.");
    let path = "/v1/agents/planner/sessions/job/context";
    for body in [
        json!({"entries": []}),
        json!({"entries": [{"role": "user", "content": "a turn in disguise"}]}),
        json!({"entries": [{"role": "assistant", "content": "words in its mouth"}]}),
        json!({"entries": [{"role": "tool", "content": "no name"}]}),
        json!({"entries": [{"role": "event", "name": "", "content": "empty name"}]}),
        json!({"entries": [{"role": "tool", "name": "a\nb", "content": "newline"}]}),
        json!({"entries": [{"role": "system", "content": "  "}]}),
        json!({"entries": [{"role": "system", "content": "x".repeat(64 * 1024 + 1)}]}),
        json!({"entries": (0..33).map(|_| json!({"role": "system", "content": "x"})).collect::<Vec<_>>()}),
        json!({"entries": [{"role": "system", "content": "x", "extra": 1}]}),
        json!({"messages": []}),
    ] {
        let (s, v) = srv.call("POST", path, Some(&key), body.clone());
        assert_eq!(s, 400, "{body}: {v}");
        assert_eq!(v["code"], "invalid_request", "{v}");
    }
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/planner/sessions/bad%20name/context",
        Some(&key),
        json!({"entries": [{"role": "system", "content": "x"}]}),
    );
    assert_eq!(s, 400, "{v}");
    let (s, _) = srv.call(
        "POST",
        "/v1/agents/nobody/sessions/job/context",
        Some(&key),
        json!({"entries": [{"role": "system", "content": "x"}]}),
    );
    assert_eq!(s, 404);
    let body = json!({"entries": [
        {"role": "event", "name": "researcher", "content": "The data set arrived."},
        {"role": "system", "content": "From now on, cite the data set."},
    ]})
    .to_string();
    let send = || {
        let (s, _, b) = srv.raw_with(
            "POST",
            path,
            Some(&key),
            &[("Idempotency-Key", "inject-7")],
            body.as_bytes(),
        );
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
        serde_json::from_slice::<Value>(&b).unwrap()
    };
    let first = send();
    let again = send();
    assert_eq!(first, again);
    assert_eq!(first["entries"], 2);
    assert_eq!(first["seq"], 4);
    let log = read_log(&url, "job");
    assert_eq!(
        log,
        [
            ("user".into(), None, "Hello.".into()),
            ("assistant".into(), None, log[1].2.clone()),
            (
                "event".into(),
                Some("researcher".into()),
                "The data set arrived.".into()
            ),
            (
                "system".into(),
                None,
                "From now on, cite the data set.".into()
            ),
        ]
    );
    // The next turn shows them: its prompt is longer by their tokens, all reused.
    let v = turn(&srv, &key, "planner", "What arrived?");
    let share = v["usage"]["cached_tokens"].as_f64().unwrap()
        / v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(share > 0.9, "{v}");
    srv.stop();
}

/// The session's log as `(role, name, text)`, read from the database.
fn read_log(url: &str, session: &str) -> Vec<(String, Option<String>, String)> {
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let store = engram_store::Store::connect(url).await.unwrap();
        let mut out = Vec::new();
        for t in store.tenants().await.unwrap() {
            for a in store.agents(&t.id).await.unwrap() {
                for e in store.turns(&a.id, session).await.unwrap() {
                    out.push((e.role.as_str().to_string(), e.name, e.text));
                }
            }
        }
        store.close().await;
        out
    })
}

/// A fork starts with its parent's log and reuses its parent's blocks (its first turn computes
/// little more than its own message); the two then go their own ways, each seeing only its own
/// turns; a fork answers like a session that had the same turns itself; deleting the parent
/// leaves the fork whole (it recomputes what it shared from its own log and answers the same).
#[test]
fn a_fork_shares_its_parents_blocks_and_then_goes_its_own_way() {
    let url = sqlite_url();
    let srv = Server::start_with(config(&url, None));
    let key = setup(&srv);
    let say = |session: &str, msg: &str| turn_in(&srv, &key, "writer", session, msg);
    say("main", "We write a report on river water quality.");
    say("main", "The first chapter covers nitrate levels.");
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/writer/sessions/main/fork",
        Some(&key),
        json!({"session": "draft-b"}),
    );
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["entries"], 4);
    assert_eq!(v["parent"], "main");
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/writer/sessions/main/fork",
        Some(&key),
        json!({"session": "draft-b"}),
    );
    assert_eq!((s, v["code"].as_str()), (409, Some("conflict")), "{v}");
    for (session, body, status) in [
        ("nope", json!({"session": "x"}), 404),
        ("main", json!({"session": "bad name"}), 400),
        ("main", json!({"session": "x", "extra": 1}), 400),
    ] {
        let (s, v) = srv.call(
            "POST",
            &format!("/v1/agents/writer/sessions/{session}/fork"),
            Some(&key),
            body,
        );
        assert_eq!(s, status, "{v}");
    }
    let question = "Which chapter comes next?";
    let b = say("draft-b", question);
    let share = b["usage"]["cached_tokens"].as_f64().unwrap()
        / b["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(
        share >= 0.95,
        "the fork's first turn reused {share:.3}: {b}"
    );
    // The parent goes on without the fork's turn; the fork's log has it.
    let a = say("main", "Add a chapter on phosphates.");
    assert_eq!(read_log(&url, "main").len(), 6);
    assert_eq!(read_log(&url, "draft-b").len(), 6);
    assert_eq!(read_log(&url, "draft-b")[4].2, question);
    assert!(a["usage"]["cached_tokens"].as_u64().unwrap() > 0);
    // The fork answers like a session that had the parent's turns itself.
    let twin = {
        let srv = Server::start_with(config(&sqlite_url(), None));
        let key = setup(&srv);
        for msg in [
            "We write a report on river water quality.",
            "The first chapter covers nitrate levels.",
        ] {
            turn_in(&srv, &key, "writer", "twin", msg);
        }
        let v = turn_in(&srv, &key, "writer", "twin", question);
        srv.stop();
        v["text"].clone()
    };
    assert_eq!(b["text"], twin);
    // Deleting the parent leaves the fork's log, and its next answer equals a run that never
    // deleted it.
    let next = "And after that one?";
    let expected = {
        let srv = Server::start_with(config(&sqlite_url(), None));
        let key = setup(&srv);
        for msg in [
            "We write a report on river water quality.",
            "The first chapter covers nitrate levels.",
            question,
        ] {
            turn_in(&srv, &key, "writer", "twin", msg);
        }
        let v = turn_in(&srv, &key, "writer", "twin", next);
        srv.stop();
        v["text"].clone()
    };
    let (s, v) = srv.call(
        "DELETE",
        "/v1/agents/writer/sessions/main",
        Some(&key),
        Value::Null,
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(say("draft-b", next)["text"], expected);
    srv.stop();
}

fn turn_in(srv: &Server, key: &str, agent: &str, session: &str, msg: &str) -> Value {
    let (s, v) = srv.call(
        "POST",
        &format!("/v1/agents/{agent}/sessions/{session}/turns"),
        Some(key),
        json!({"message": msg, "max_tokens": 12}),
    );
    assert_eq!(s, 200, "{v}");
    v
}
