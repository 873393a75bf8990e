//! The admin page at `/admin` in headless Chromium (Debian's, `make browser`; Playwright from
//! `.venv-test`): it signs in, shows the occupancy chart, a session created here as a strip of
//! blocks with its pins, a memory node's neighbourhood, and runs a tier cycle and a shadow flush,
//! with no CSP violation or script error (`tests/admin_page.py`). The screenshot goes to
//! `$ENGRAM_ADMIN_SCREENSHOT` (default: a temporary file); `docs/admin-page.png` is one.

use std::path::PathBuf;
use std::process::Command;

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, sqlite_url, test_config};

#[test]
fn the_admin_page_shows_a_session_its_blocks_and_a_memory_neighbourhood_in_chromium() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv-test/bin/python");
    assert!(python.is_file(), "`make sdk-venv` installs Playwright");
    let chromium = std::env::var("ENGRAM_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(
        std::path::Path::new(&chromium).is_file(),
        "{chromium} is missing: `make browser` installs Debian's chromium"
    );
    let srv = Server::start_with(test_config(&sqlite_url(), 1 << 20));
    // The page is static and carries its policy.
    let (s, page) = srv.raw("GET", "/admin", None, b"");
    assert_eq!(s, 200);
    assert!(String::from_utf8_lossy(&page).contains("/admin/app.js"));

    let (key, agent) = srv.tenant_with_bot("acme", "! Be honest.\nAnswer in one sentence.");
    let tenant = agent["agent"]["tenant_id"].as_str().unwrap().to_string();
    for msg in ["Name a colour.", "Name another one."] {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/s1/turns",
            Some(&key),
            json!({"message": msg, "max_tokens": 8}),
        );
        assert_eq!(s, 200, "{v}");
    }
    let node = |text: &str| {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/memory/nodes",
            Some(&key),
            json!({"kind": "fact", "text": text}),
        );
        assert_eq!(s, 201, "{v}");
        v["id"].as_i64().unwrap()
    };
    let (a, b, c) = (
        node("Lisbon is the capital of Portugal."),
        node("Porto lies on the Douro."),
        node("Both are in Portugal."),
    );
    for (from, to) in [(a, c), (b, c)] {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/memory/edges",
            Some(&key),
            json!({"from": from, "to": to, "kind": "relates_to", "weight": 0.8}),
        );
        assert_eq!(s, 201, "{v}");
    }
    // A query-time prefetch for the session, counted in the reservations view the page shows.
    let (s, v) = srv.call(
        "POST",
        "/v1/agents/bot/sessions/s1/prefetch",
        Some(&key),
        json!({"text": "Which city is the capital of Portugal?"}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["outcome"], "reserved", "{v}");
    // The admin view of the neighbourhood the page draws.
    let (s, hood) = srv.call(
        "GET",
        &format!("/v1/admin/tenants/{tenant}/memory/nodes/{c}"),
        Some(ADMIN),
        Value::Null,
    );
    assert_eq!(s, 200, "{hood}");
    assert_eq!(hood["edges"].as_array().unwrap().len(), 2);
    let mut ids: Vec<i64> = hood["neighbours"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["id"].as_i64().unwrap())
        .collect();
    ids.sort_unstable();
    let mut want = vec![a, b];
    want.sort_unstable();
    assert_eq!(ids, want);

    let shot = std::env::var("ENGRAM_ADMIN_SCREENSHOT").map_or_else(
        |_| std::env::temp_dir().join(format!("engram-admin-{}.png", std::process::id())),
        PathBuf::from,
    );
    let out = Command::new(&python)
        .arg(root.join("tests/admin_page.py"))
        .arg(format!("http://{}", srv.addr))
        .arg(ADMIN)
        .arg(&tenant)
        .arg("bot")
        .arg("s1")
        .arg(c.to_string())
        .arg(&shot)
        .env("ENGRAM_CHROMIUM", &chromium)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "browser run failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("admin page ok"), "{stdout}");
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 20_000,
        "{}",
        png.len()
    );
    srv.stop();
}
