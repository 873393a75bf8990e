//! Cache files: a session's cache saved to and loaded from the shadow, exported as one file and
//! imported on another node (in another KV format it is skipped, never misread); an agent's
//! sessions as one file, with their shared prefix stored once, refused whole when broken.

use std::path::Path;
use std::time::Instant;

use serde_json::Value;

use crate::harness::{ADMIN, Server, sqlite_url};
use crate::shadow::{AXIOMS, config, export_crcs, fresh_dir, message, shadow_status, turn};

#[test]
fn a_session_cache_saves_loads_exports_and_imports() {
    let url = sqlite_url();
    let dir = fresh_dir("shadow-io");
    // Keys and values in different codecs: every byte path below carries both row widths.
    let config = |url: &str, dir: Option<&Path>| {
        let mut c = config(url, dir);
        c.model.codec = "q8/tq4".into();
        c
    };
    let srv = Server::start_with(config(&url, Some(&dir)));
    let (key, _) = srv.tenant_with_bot("t", AXIOMS);
    let long = "Summarise the following notes. ".repeat(40);
    turn(&srv, &key, "a", &long);
    let (s, saved) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/a/cache/save",
        Some(&key),
        Value::Null,
    );
    assert_eq!(s, 200, "{saved}");
    assert!(
        saved["moved"].as_u64().unwrap() > 0 && saved["tokens"].as_u64().unwrap() > 200,
        "{saved}"
    );
    // Saving again writes nothing new.
    let (_, again) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/a/cache/save",
        Some(&key),
        Value::Null,
    );
    assert_eq!(again["moved"], 0);
    let (s, file) = srv.raw(
        "GET",
        "/v1/agents/bot/sessions/a/cache/export",
        Some(&key),
        b"",
    );
    assert_eq!(s, 200);
    // Unknown session, another tenant's view, a broken file.
    let (s, e) = srv.call(
        "GET",
        "/v1/agents/bot/sessions/none/cache/export",
        Some(&key),
        Value::Null,
    );
    assert_eq!((s, e["code"].as_str()), (404, Some("not_found")), "{e}");
    let (s, e) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/none/cache/load",
        Some(&key),
        Value::Null,
    );
    assert_eq!(s, 404, "{e}");
    let (s, e) = {
        let (s, b) = srv.raw(
            "POST",
            "/v1/agents/bot/sessions/b/cache/import",
            Some(&key),
            &file[..file.len() / 2],
        );
        (s, serde_json::from_slice::<Value>(&b).unwrap())
    };
    assert_eq!(
        (s, e["code"].as_str()),
        (422, Some("invalid_cache_file")),
        "{e}"
    );
    // The tier bridge: a cycle on request, visible in the admin view and in /metrics.
    let (s, c) = srv.call("POST", "/v1/admin/tiers/cycle", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{c}");
    assert!(c["observed"]["hot_used"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(
        c["observed"]["active_sessions"], 1,
        "session a had a turn: {c}"
    );
    let (_, t) = srv.call("GET", "/v1/admin/tiers", Some(ADMIN), Value::Null);
    assert!(t["totals"]["cycles"].as_u64().unwrap() >= 1, "{t}");
    assert_eq!(
        t["cycles"].as_array().unwrap().len() as u64,
        t["totals"]["cycles"].as_u64().unwrap()
    );
    let (_, m) = srv.call("GET", "/metrics", Some(ADMIN), Value::Null);
    let m = m.as_str().unwrap_or_default().to_string();
    assert!(m.contains("engram_tier_cycles_total "), "{m}");
    // Turns moved blocks (the load above warmed and spilled): every tier move is counted.
    assert!(c["observed"]["tier_moves"].is_u64(), "{c}");
    assert!(
        c["review"].is_object() && c["suggestions"].is_array(),
        "{c}"
    );
    assert!(m.contains("engram_tier_moves_total "), "{m}");
    assert!(m.contains("engram_admission_evictions_total "), "{m}");
    assert!(m.contains("engram_admission_staged_spills_total "), "{m}");
    for staged in [
        "engram_tier_staged_spills_total ",
        "engram_tier_staged_dropped_total ",
        "engram_tier_staged_blocks ",
    ] {
        assert!(m.contains(staged), "{m}");
    }
    assert!(
        m.contains("engram_shadow_writes_total{result=\"ok\"}"),
        "{m}"
    );
    srv.stop();

    // Another node: same database, an empty shadow. Import the file, and the session's next
    // turn reuses the imported blocks.
    let other = fresh_dir("shadow-io-other");
    let srv = Server::start_with(config(&url, Some(&other)));
    let started = Instant::now();
    let (s, b) = srv.raw(
        "POST",
        "/v1/agents/bot/sessions/a/cache/import",
        Some(&key),
        &file,
    );
    let imported: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(s, 200, "{imported}");
    assert_eq!(imported["moved"], saved["blocks"]);
    println!(
        "import of {} tokens: {:.1} ms in the engine, {:.1} ms over HTTP",
        imported["tokens"],
        imported["ms"].as_f64().unwrap(),
        started.elapsed().as_secs_f64() * 1e3
    );
    let (_, cached) = turn(&srv, &key, "a", "And in one word?");
    assert!(
        cached + 32 >= imported["tokens"].as_u64().unwrap(),
        "{cached}"
    );
    // The import was written to this node's shadow: a restart loads it again.
    srv.stop();
    let srv = Server::start_with(config(&url, Some(&other)));
    let status = shadow_status(&srv);
    assert!(
        status["recovery_counts"]["recovered"].as_u64().unwrap() >= 1,
        "{status}"
    );
    let (s, loaded) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/a/cache/load",
        Some(&key),
        Value::Null,
    );
    assert_eq!(s, 200, "{loaded}");
    assert_eq!(loaded["moved"], 0, "already recovered at start: {loaded}");
    srv.stop();

    // The same shadow under another KV format (one codec for keys and values): its entries are
    // skipped for the named reason, never read as this format's bytes, and the session's
    // next turn recomputes what it needs.
    let srv = Server::start_with(self::config(&url, Some(&other)));
    let status = shadow_status(&srv);
    assert!(
        status["recovery_counts"]["codec_mismatch"]
            .as_u64()
            .unwrap_or(0)
            >= 1
            && status["recovery_counts"]["recovered"].is_null(),
        "{status}"
    );
    turn(&srv, &key, "a", "And in one word?");
    srv.stop();
}

/// The JSON header of a safetensors file under `key`.
fn file_header(file: &[u8], key: &str) -> Value {
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&file[8..8 + n]).unwrap();
    serde_json::from_str(header["__metadata__"][key].as_str().unwrap()).unwrap()
}

#[test]
fn an_agents_sessions_export_as_one_file_and_import_on_another_node() {
    let url = sqlite_url();
    let dir = fresh_dir("agent-io");
    let srv = Server::start_with(config(&url, Some(&dir)));
    let (key, _) = srv.tenant_with_bot("t", AXIOMS);
    let (s, e) = srv.call(
        "GET",
        "/v1/agents/bot/cache/export",
        Some(&key),
        Value::Null,
    );
    assert_eq!((s, e["code"].as_str()), (404, Some("not_found")), "{e}");
    let names = ["a", "b", "c"];
    for (i, name) in names.iter().enumerate() {
        turn(&srv, &key, name, &message(i));
    }
    let (s, file) = srv.raw("GET", "/v1/agents/bot/cache/export", Some(&key), b"");
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&file));
    let header = file_header(&file, "engram.agent");
    let sessions = header["sessions"].as_array().unwrap();
    let blocks = header["blocks"].as_array().unwrap();
    assert_eq!(
        sessions
            .iter()
            .map(|s| s["name"].as_str().unwrap())
            .collect::<Vec<_>>(),
        names
    );
    // The stable prefix the sessions share is stored once.
    let rows: usize = sessions
        .iter()
        .map(|s| s["rows"].as_array().unwrap().len())
        .sum();
    assert!(blocks.len() < rows, "{} distinct of {rows}", blocks.len());
    // Each session's chain is its per-session export, block for block.
    for s in sessions {
        let crcs: Vec<u32> = s["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                blocks[r.as_u64().unwrap() as usize]["crc32c"]
                    .as_u64()
                    .unwrap() as u32
            })
            .collect();
        assert_eq!(crcs, export_crcs(&srv, &key, s["name"].as_str().unwrap()));
    }
    let (_, session_file) = srv.raw(
        "GET",
        "/v1/agents/bot/sessions/a/cache/export",
        Some(&key),
        b"",
    );
    srv.stop();

    // Another node: same database, an empty shadow.
    let other = fresh_dir("agent-io-other");
    let srv = Server::start_with(config(&url, Some(&other)));
    // A broken file, and a per-session file, are refused whole: nothing is loaded.
    let post = |body: &[u8]| {
        let (s, b) = srv.raw("POST", "/v1/agents/bot/cache/import", Some(&key), body);
        (s, serde_json::from_slice::<Value>(&b).unwrap())
    };
    let mut flipped = file.clone();
    let at = flipped.len() - 3;
    flipped[at] ^= 0x01;
    for bad in [&file[..file.len() / 2], &flipped[..], &session_file[..]] {
        let (s, e) = post(bad);
        assert_eq!(
            (s, e["code"].as_str()),
            (422, Some("invalid_cache_file")),
            "{e}"
        );
    }
    let (s, _) = srv.raw(
        "GET",
        "/v1/agents/bot/sessions/a/cache/export",
        Some(&key),
        b"",
    );
    assert_eq!(s, 404, "nothing was loaded");
    let (s, imported) = post(&file);
    assert_eq!(s, 200, "{imported}");
    assert_eq!(imported["sessions"], 3);
    assert_eq!(imported["blocks"].as_u64().unwrap() as usize, rows);
    // Each session's next turn reuses what the file carried.
    let mut cached = 0;
    for (i, name) in names.iter().enumerate() {
        cached += turn(&srv, &key, name, &message(i + 3)).1;
    }
    assert!(
        cached + 3 * 32 >= imported["tokens"].as_u64().unwrap(),
        "{cached} of {imported}"
    );
    srv.stop();
    // The import was written to this node's shadow.
    let srv = Server::start_with(config(&url, Some(&other)));
    let status = shadow_status(&srv);
    assert!(
        status["recovery_counts"]["recovered"].as_u64().unwrap() >= 3,
        "{status}"
    );
    srv.stop();
}
