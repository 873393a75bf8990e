//! The official `openai` Python SDK (installed in `.venv-test` by `make test`) streams and
//! non-streams chat completions against the server.

use std::path::PathBuf;

use serde_json::json;

use crate::harness::{ADMIN, Server, sqlite_url};

#[test]
fn the_official_openai_sdk_works_unchanged() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv-test/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: `make test` installs the openai SDK there",
        python.display()
    );
    // SQLite: the SDK exercises HTTP, not the database.
    let srv = Server::start(&sqlite_url(), 1 << 20);
    let (_, t) = srv.call(
        "POST",
        "/v1/admin/tenants",
        Some(ADMIN),
        json!({"name": "sdk"}),
    );
    let key = t["api_key"].as_str().unwrap().to_string();
    let layers = json!([{"kind": "axioms", "content": "! Answer in one short sentence."}]);
    let (s, _) = srv.call(
        "POST",
        "/v1/agents",
        Some(&key),
        json!({"name": "helper", "layers": layers}),
    );
    assert_eq!(s, 201);
    let out = std::process::Command::new(&python)
        .arg(root.join("tests/openai_sdk.py"))
        .arg(format!("http://{}", srv.addr))
        .arg(&key)
        .arg("helper")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "SDK script failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("openai sdk ok"), "{stdout}");
    println!("{stdout}");
}
