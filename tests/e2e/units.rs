//! The server's pieces through their public API, without a running server: the committed
//! OpenAPI document, the per-tenant limits and the mapping of errors to HTTP.

use actix_web::ResponseError;
use actix_web::http::StatusCode;
use engram_config::{AuthSection, LimitsSection};
use engram_engine::EngineError;
use engram_server::ApiError;
use engram_server::limits::Limits;

/// Fails when the code's spec drifts from the committed file; `UPDATE_OPENAPI=1` rewrites it
/// (`make openapi`).
#[test]
fn the_committed_openapi_spec_matches_the_code() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../openapi/openapi.json");
    let spec = engram_server::openapi::spec_json() + "\n";
    if std::env::var_os("UPDATE_OPENAPI").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &spec).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == spec,
        "openapi/openapi.json is out of date: run `make openapi` and commit it"
    );
    // Every route is documented.
    for route in [
        "/v1/agents",
        "/v1/chat/completions",
        "/v1/admin/blocks",
        "/v1/agents/{agent}/memory/query",
        "/v1/agents/{agent}/memory/reservations",
        "/healthz",
    ] {
        assert!(spec.contains(&format!("\"{route}\"")), "{route}");
    }
}

/// Every OpenAPI link names an operation that exists, fills some of that operation's path
/// parameters and nothing else (the others, a new session's name, are generated), and reads its values from the request's path parameters or from a field the
/// linked answer's schema has — so schemathesis's stateful phase can follow every one.
#[test]
fn every_openapi_link_reaches_its_operation_with_its_parameters() {
    use serde_json::Value;
    let spec: Value = serde_json::from_str(&engram_server::openapi::spec_json()).unwrap();
    let schemas = &spec["components"]["schemas"];
    let resolve = |s: &Value| -> Value {
        match s["$ref"].as_str() {
            Some(r) => schemas[r.rsplit('/').next().unwrap()].clone(),
            None => s.clone(),
        }
    };
    let path_params = |op: &Value| -> Vec<String> {
        let mut p: Vec<String> = op["parameters"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["in"] == "path")
            .map(|p| p["name"].as_str().unwrap().to_string())
            .collect();
        p.sort();
        p
    };
    let mut ops = std::collections::HashMap::new();
    for (_, item) in spec["paths"].as_object().unwrap() {
        for (_, op) in item.as_object().unwrap() {
            if let Some(id) = op["operationId"].as_str() {
                ops.insert(id.to_string(), op.clone());
            }
        }
    }
    let mut links = 0;
    for (path, item) in spec["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            for (status, response) in op["responses"].as_object().unwrap() {
                let Some(ls) = response["links"].as_object() else {
                    continue;
                };
                let body = resolve(&response["content"]["application/json"]["schema"]);
                for (name, link) in ls {
                    links += 1;
                    let at = format!("{method} {path} {status} {name}");
                    let target = &ops[link["operationId"].as_str().unwrap()];
                    let mut filled: Vec<String> = link["parameters"]
                        .as_object()
                        .unwrap()
                        .keys()
                        .cloned()
                        .collect();
                    filled.sort();
                    let wanted = path_params(target);
                    assert!(
                        !filled.is_empty() && filled.iter().all(|p| wanted.contains(p)),
                        "{at}: {filled:?} of {wanted:?}"
                    );
                    for (_, expr) in link["parameters"].as_object().unwrap() {
                        let expr = expr.as_str().unwrap();
                        if let Some(p) = expr.strip_prefix("$request.path.") {
                            assert!(path_params(op).iter().any(|x| x == p), "{at}: {expr}");
                        } else {
                            let pointer = expr.strip_prefix("$response.body#").unwrap();
                            let mut schema = body.clone();
                            for field in pointer.trim_start_matches('/').split('/') {
                                let next = resolve(&schema["properties"][field]);
                                assert!(!next.is_null(), "{at}: {expr} names no field");
                                schema = next;
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(links >= 30, "{links} links");
}

#[test]
fn a_tenant_over_its_rate_or_slots_is_refused_and_others_are_not() {
    let l = Limits::new(
        &LimitsSection {
            requests_per_sec: 1,
            burst: 3,
            concurrent_generations: 2,
            session_wait_ms: 0,
        },
        &AuthSection::default(),
    );
    for _ in 0..3 {
        l.check_rate("a").unwrap();
    }
    let e = ApiError::from(l.check_rate("a").unwrap_err());
    assert_eq!((e.status.as_u16(), e.code), (429, "rate_limited"));
    assert!(e.retry_after.is_some_and(|s| (1..=2).contains(&s)), "{e:?}");
    l.check_rate("b").unwrap();
    let s1 = l.begin_generation("a").unwrap();
    let _s2 = l.begin_generation("a").unwrap();
    let busy = ApiError::from(l.begin_generation("a").unwrap_err());
    assert_eq!(busy.code, "rate_limited");
    let _b = l.begin_generation("b").unwrap();
    drop(s1);
    let _s3 = l.begin_generation("a").unwrap();
    let off = Limits::new(
        &LimitsSection {
            requests_per_sec: 0,
            burst: 0,
            concurrent_generations: 0,
            session_wait_ms: 0,
        },
        &AuthSection::default(),
    );
    for _ in 0..1000 {
        off.check_rate("a").unwrap();
    }
    let _slots: Vec<_> = (0..100)
        .map(|_| off.begin_generation("a").unwrap())
        .collect();
}

#[test]
fn key_lookups_are_throttled_per_client_ip_and_not_without_one() {
    let auth = AuthSection {
        lookups_per_ip_per_sec: 1,
        lookup_burst: 4,
        ..AuthSection::default()
    };
    let l = Limits::new(&LimitsSection::default(), &auth);
    let (a, b): (std::net::IpAddr, std::net::IpAddr) =
        ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
    for _ in 0..4 {
        l.check_lookup(Some(a)).unwrap();
    }
    let e = ApiError::from(l.check_lookup(Some(a)).unwrap_err());
    assert_eq!((e.status.as_u16(), e.code), (429, "rate_limited"));
    assert!(e.retry_after.is_some_and(|s| (1..=2).contains(&s)), "{e:?}");
    l.check_lookup(Some(b)).unwrap();
    l.check_lookup(None).unwrap();
    let off = Limits::new(
        &LimitsSection::default(),
        &AuthSection {
            lookups_per_ip_per_sec: 0,
            ..AuthSection::default()
        },
    );
    for _ in 0..1000 {
        off.check_lookup(Some(a)).unwrap();
    }
}

#[test]
fn no_hot_room_is_a_503_with_retry_after_and_no_engine_detail() {
    let e = ApiError::from(EngineError::NoHotRoom {
        needed: 11,
        available: 5,
    });
    assert_eq!(
        (e.status, e.code),
        (StatusCode::SERVICE_UNAVAILABLE, "no_hot_room")
    );
    assert!(!e.message.contains("11"), "{}", e.message);
    let r = e.error_response();
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok());
    assert_eq!(retry, Some("1"));
}
