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
