//! The tenant salt reaches every tier (issue 64, item 4): two tenants send the same text, and
//! the keys each tier files their blocks under — the hot and cold tiers' chained hashes, the
//! shadow's manifests on disk or in S3, the archive's markers — have nothing in common. Read
//! from each tier's own keys, not inferred from timing or `cached_tokens`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, sqlite_url};
use crate::shadow::{AXIOMS, Backend, config_with, fresh_dir, turn};

/// Every `hash` string under `v`.
fn hashes_in(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("hash", Value::String(h)) => {
                        out.insert(h.clone());
                    }
                    ("hashes", Value::Array(hs)) => {
                        out.extend(hs.iter().filter_map(|h| h.as_str().map(String::from)));
                    }
                    _ => hashes_in(x, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| hashes_in(x, out)),
        _ => {}
    }
}

/// The first `tenant` number under `v`.
fn tenant_in(v: &Value) -> Option<u64> {
    match v {
        Value::Object(m) => m
            .get("tenant")
            .and_then(Value::as_u64)
            .or_else(|| m.values().find_map(tenant_in)),
        Value::Array(a) => a.iter().find_map(tenant_in),
        _ => None,
    }
}

/// The hashes the JSON files under `dir` (whose path holds `part`) name, by the tenant salt
/// each file names.
fn file_keys(dir: &Path, part: &str) -> BTreeMap<u64, BTreeSet<String>> {
    let mut out: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.to_string_lossy().contains(part)
                && p.extension().is_some_and(|x| x == "json")
                && let Ok(text) = std::fs::read_to_string(&p)
                // A checksum line may come before the JSON.
                && let Some(at) = text.find('{')
                && let Ok(v) = serde_json::from_str::<Value>(&text[at..])
                && let Some(t) = tenant_in(&v)
            {
                hashes_in(&v, out.entry(t).or_default());
            }
        }
    }
    out
}

fn disjoint(tier: &str, a: &BTreeSet<String>, b: &BTreeSet<String>) {
    assert!(
        !a.is_empty() && !b.is_empty(),
        "{tier}: {} and {} keys",
        a.len(),
        b.len()
    );
    let shared: Vec<&String> = a.intersection(b).collect();
    assert!(
        shared.is_empty(),
        "{tier}: {} keys shared: {shared:?}",
        shared.len()
    );
}

fn same_text_two_tenants(backend: Backend) {
    let mut c = config_with(&sqlite_url(), Some(&backend));
    c.limits.requests_per_sec = 0;
    let srv = Server::start_with(c);
    let mut tenants = Vec::new();
    for name in ["alpha", "beta"] {
        let (id, key) = srv.tenant(name, Value::Null);
        let (s, v) = srv.call(
            "POST",
            "/v1/agents",
            Some(&key),
            json!({"name": "bot", "layers": [{"kind": "axioms", "content": AXIOMS}]}),
        );
        assert_eq!(s, 201, "{v}");
        turn(&srv, &key, "s", "What is the capital of France?");
        turn(&srv, &key, "s", "And of Italy?");
        tenants.push((id, key));
    }
    let (_, list) = srv.call("GET", "/v1/admin/tenants", Some(ADMIN), Value::Null);
    let salt = |id: &str| -> u64 {
        list["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["id"] == id)
            .unwrap()["cache_salt"]
            .as_u64()
            .unwrap()
    };
    let salts: Vec<u64> = tenants.iter().map(|(id, _)| salt(id)).collect();
    // Hot and cold tiers: the prefix cache's chained hash of every block.
    let blocks = |id: &str| -> BTreeSet<String> {
        let (s, page) = srv.call(
            "GET",
            &format!("/v1/admin/blocks?tenant={id}&limit=1000"),
            Some(ADMIN),
            Value::Null,
        );
        assert_eq!(s, 200, "{page}");
        page["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|b| b["hash"].as_str().map(String::from))
            .collect()
    };
    disjoint(
        "hot and cold tiers",
        &blocks(&tenants[0].0),
        &blocks(&tenants[1].0),
    );
    // The shadow: every manifest's block hashes, by the tenant it names.
    let (s, v) = srv.call("POST", "/v1/admin/shadow/flush", Some(ADMIN), Value::Null);
    assert_eq!(s, 200, "{v}");
    let shadow = file_keys(&backend.files(), "entries");
    let of =
        |keys: &BTreeMap<u64, BTreeSet<String>>, t: u64| keys.get(&t).cloned().unwrap_or_default();
    disjoint("shadow", &of(&shadow, salts[0]), &of(&shadow, salts[1]));
    // The archive: each archived session's marker.
    for (_, key) in &tenants {
        let (s, v) = srv.call(
            "POST",
            "/v1/agents/bot/sessions/s/cache/archive",
            Some(key),
            Value::Null,
        );
        assert_eq!(s, 200, "{v}");
    }
    let archive = file_keys(&backend.files(), "archive");
    disjoint("archive", &of(&archive, salts[0]), &of(&archive, salts[1]));
    srv.stop();
}

#[test]
fn the_same_text_under_two_tenants_shares_no_key_in_any_tier_on_disk() {
    same_text_two_tenants(Backend::Local(fresh_dir("salt")));
}

#[cfg(feature = "s3")]
#[test]
fn the_same_text_under_two_tenants_shares_no_key_in_any_tier_on_s3() {
    same_text_two_tenants(Backend::S3(crate::storage::S3Server::start(
        "engram-shadow",
    )));
}
