//! The tokens-only archive: a session archived (its KV deleted from memory and disk, a marker
//! keeping its chain) thaws by replay and answers like one never archived; a shadow over its
//! byte budget archives sessions until it fits.

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, embedder_path, sqlite_url};
use crate::shadow::{AXIOMS, config, fresh_dir, message, metric, session_of, shadow_status, turn};

/// Archive → restart → thaw: an archived session (its KV deleted from memory and disk, a
/// marker keeping its chain) replays from the turn log on its next turn after a restart and
/// answers exactly as a session that was never archived — with the memory graph off and on (its
/// turns log the memories layer their prompts showed).
#[test]
fn an_archived_session_thaws_by_replay_after_a_restart_and_answers_like_one_never_archived() {
    for memory in [false, true] {
        archive_restart_thaw(memory);
    }
}

fn archive_restart_thaw(memory: bool) {
    let dir = fresh_dir("archive");
    let mut c = config(&sqlite_url(), Some(&dir));
    if memory {
        c.memory.enabled = true;
        c.memory.embedder_path = embedder_path();
        c.memory.vector_dir = fresh_dir("archive-vectors");
    }
    let srv = Server::start_with(c.clone());
    let (kept, _) = srv.tenant_with_bot("kept", AXIOMS);
    let (archived, _) = srv.tenant_with_bot("archived", AXIOMS);
    if memory {
        for key in [&kept, &archived] {
            for fact in [
                "The sky looks blue because air scatters blue light most.",
                "Yeast makes bread rise by releasing carbon dioxide.",
                "Paris is the capital of France.",
            ] {
                let (s, v) = srv.call(
                    "POST",
                    "/v1/agents/bot/memory/nodes",
                    Some(key),
                    json!({"kind": "fact", "text": fact}),
                );
                assert_eq!(s, 201, "{v}");
            }
        }
    }
    for i in 0..3 {
        assert_eq!(
            turn(&srv, &kept, "s", &message(i)),
            turn(&srv, &archived, "s", &message(i)),
            "memory {memory}"
        );
    }
    let (s, a) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s/cache/archive",
        Some(&archived),
        Value::Null,
    );
    assert_eq!(s, 200, "{a}");
    assert_eq!(a["archived"], true, "{a}");
    let entry = a["entry_bytes"].as_u64().unwrap();
    let marker = a["marker_bytes"].as_u64().unwrap();
    assert!(
        a["blocks"].as_u64().unwrap() > 0 && a["dropped"].as_u64().unwrap() > 0,
        "{a}"
    );
    // What an archived session keeps: at most 0.1 % of the entry it replaces.
    assert!(
        marker > 0 && marker * 1000 <= entry,
        "{marker} bytes for {entry}: {a}"
    );
    // The next flush writes the other session, never the archived one again.
    let (s, f) = srv.call("POST", "/v1/admin/shadow/flush", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{f}");
    let st = shadow_status(&srv);
    assert_eq!(
        (st["archived_sessions"].as_u64(), st["sessions"].as_u64()),
        (Some(1), Some(1)),
        "{st}"
    );
    assert_eq!(
        metric(&srv, "engram_archive_sessions_total{event=\"archived\"}"),
        1
    );
    if memory {
        // A memory the archived turns never showed: a replay that recalled again instead of
        // using the logged memories layers would compute other KV.
        for key in [&kept, &archived] {
            let (s, v) = srv.call(
                "POST",
                "/v1/agents/bot/memory/nodes",
                Some(key),
                json!({"kind": "fact", "text": "At sunset the sky turns red and orange."}),
            );
            assert_eq!(s, 201, "{v}");
        }
    }
    srv.stop();

    let srv = Server::start_with(c);
    assert_eq!(shadow_status(&srv)["archived_sessions"], 1);
    let replayed = metric(&srv, "engram_replayed_turns_total");
    let want = turn(&srv, &kept, "s", &message(3));
    let got = turn(&srv, &archived, "s", &message(3));
    assert_eq!(got, want, "memory {memory}");
    assert!(
        metric(&srv, "engram_replayed_turns_total") > replayed,
        "memory {memory}"
    );
    assert_eq!(
        metric(&srv, "engram_archive_sessions_total{event=\"thawed\"}"),
        1
    );
    assert_eq!(metric(&srv, "engram_shadow_archived_sessions"), 0);
    // Thawed, it is an ordinary session again: the next turn reuses what the replay computed.
    assert_eq!(
        turn(&srv, &archived, "s", &message(4)),
        turn(&srv, &kept, "s", &message(4))
    );
    srv.stop();
}

/// Over `shadow.budget_mib`, a flush archives the least recently written sessions until the
/// shadow fits; they answer like never-archived ones afterwards.
#[test]
fn a_shadow_over_its_byte_budget_archives_sessions_until_it_fits() {
    let dir = fresh_dir("budget");
    let mut c = config(&sqlite_url(), Some(&dir));
    c.shadow.budget_mib = 1;
    // No session counts as active: every one may be archived.
    c.tiers.active_window_secs = 0;
    let srv = Server::start_with(c);
    let (key, _) = srv.tenant_with_bot("t", AXIOMS);
    let (reference, _) = srv.tenant_with_bot("r", AXIOMS);
    for i in 0..6 {
        assert_eq!(
            turn(&srv, &key, session_of(i), &message(i)),
            turn(&srv, &reference, session_of(i), &message(i))
        );
    }
    let (s, f) = srv.call("POST", "/v1/admin/shadow/flush", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{f}");
    let st = shadow_status(&srv);
    assert!(st["bytes_on_disk"].as_u64().unwrap() <= 1 << 20, "{st}");
    let archived = st["archived_sessions"].as_u64().unwrap();
    assert!(archived >= 1, "{st}");
    assert_eq!(
        metric(&srv, "engram_archive_sessions_total{event=\"archived\"}"),
        archived
    );
    // Every session answers as before; the archived ones thaw.
    for i in 6..9 {
        assert_eq!(
            turn(&srv, &key, session_of(i), &message(i)),
            turn(&srv, &reference, session_of(i), &message(i))
        );
    }
    assert!(metric(&srv, "engram_archive_sessions_total{event=\"thawed\"}") >= 1);
    srv.stop();
}

/// A tenant over its own shadow quota (`quotas.shadow_mib`) has its least recently written
/// sessions archived, and only its own: a tenant with no quota of its own keeps every session.
#[test]
fn a_tenant_over_its_shadow_quota_loses_its_own_oldest_sessions_only() {
    let dir = fresh_dir("tenant-quota");
    let mut c = config(&sqlite_url(), Some(&dir));
    c.tiers.active_window_secs = 0;
    let srv = Server::start_with(c);
    let (_, tight) = srv.tenant(
        "tight",
        json!({"hot_blocks": 4096, "cold_blocks": 16384, "sessions": 100, "shadow_mib": 1}),
    );
    let (_, free) = srv.tenant("free", Value::Null);
    for key in [&tight, &free] {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(key),
            json!({"name": "bot", "layers": [{"kind": "axioms", "content": AXIOMS}]}),
        );
        assert_eq!(s, 201, "{v}");
    }
    let sessions = ["q0", "q1", "q2", "q3", "q4", "q5"];
    for (i, s) in sessions.iter().enumerate() {
        for key in [&tight, &free] {
            turn(&srv, key, s, &message(i));
        }
    }
    let (s, f) = srv.call("POST", "/v1/admin/shadow/flush", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{f}");
    let (_, list) = srv.call("GET", "/v1/admin/tenants", Some(ADMIN), Value::Null);
    let salt = |name: &str| {
        list["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == name)
            .unwrap()["cache_salt"]
            .as_u64()
            .unwrap()
    };
    // The archive's markers, by tenant salt.
    let marked = |salt: u64| -> usize {
        std::fs::read_dir(dir.join("archive"))
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                        text.contains(&format!("\"tenant\":{salt},"))
                    })
                    .count()
            })
            .unwrap_or(0)
    };
    let (tight_archived, free_archived) = (marked(salt("tight")), marked(salt("free")));
    assert!(
        tight_archived >= 1,
        "nothing of the tight tenant was archived"
    );
    assert!(tight_archived < sessions.len(), "all of it was");
    assert_eq!(free_archived, 0, "another tenant paid for it");
    // The tight tenant's sessions still answer (the archived ones replay).
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/q0/turns",
        Some(&tight),
        json!({"message": message(9), "max_tokens": 4}),
    );
    assert_eq!(s, 200, "{v}");
    srv.stop();
}
