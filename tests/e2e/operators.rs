//! Scoped operator keys (issue 64, item 8): besides the bootstrap key of the configuration,
//! keys with the scopes `metrics`, `read` or `admin` are issued, listed and revoked through the
//! API, several at once, with no restart; each opens what its scope allows and no more.

use serde_json::{Value, json};

use crate::harness::{ADMIN, Server, sqlite_url, test_config};

#[test]
fn operator_keys_open_what_their_scope_allows_and_stop_when_revoked() {
    let mut config = test_config(&sqlite_url(), 64 * 1024);
    config.limits.requests_per_sec = 0;
    let srv = Server::start_with(config);
    let issue = |key: &str, name: &str, scopes: Value| {
        let (s, v) = srv.call(
            "POST",
            "/v1/admin/keys",
            Some(key),
            json!({"name": name, "scopes": scopes}),
        );
        (s, v)
    };
    let secret = |v: &Value| v["admin_key"].as_str().unwrap().to_string();
    let (s, m) = issue(ADMIN, "prometheus", json!(["metrics"]));
    assert_eq!(s, 201, "{m}");
    let metrics = secret(&m);
    let (s, r) = issue(ADMIN, "dashboard", json!(["read"]));
    assert_eq!(s, 201, "{r}");
    let read = secret(&r);
    let (s, a) = issue(ADMIN, "ops", json!(["admin"]));
    assert_eq!(s, 201, "{a}");
    let admin = secret(&a);
    let status =
        |method: &str, path: &str, key: &str, body: Value| srv.call(method, path, Some(key), body);
    let code = |v: &Value| v["code"].as_str().unwrap_or_default().to_string();

    // Prometheus scrapes with the metrics key, and nothing more.
    let (s, _) = srv.raw("GET", "/metrics", Some(&metrics), b"");
    assert_eq!(s, 200);
    let (s, v) = status("GET", "/v1/admin/tenants", &metrics, Value::Null);
    assert_eq!((s, code(&v)), (403, "forbidden".into()), "{v}");
    // The read key sees the views but changes nothing.
    for path in ["/v1/admin/tenants", "/v1/admin/cache", "/v1/admin/blocks"] {
        let (s, v) = status("GET", path, &read, Value::Null);
        assert_eq!(s, 200, "{path}: {v}");
    }
    let (s, _) = srv.raw("GET", "/metrics", Some(&read), b"");
    assert_eq!(s, 200);
    let (s, v) = status("POST", "/v1/admin/tenants", &read, json!({"name": "nope"}));
    assert_eq!((s, code(&v)), (403, "forbidden".into()), "{v}");
    let (s, v) = issue(&read, "escalate", json!(["admin"]));
    assert_eq!((s, code(&v)), (403, "forbidden".into()), "{v}");
    // The admin key does what the bootstrap key does, issuing keys included.
    let (s, v) = status(
        "POST",
        "/v1/admin/tenants",
        &admin,
        json!({"name": "made-by-ops"}),
    );
    assert_eq!(s, 201, "{v}");
    let tenant_key = v["api_key"].as_str().unwrap().to_string();
    let (s, v) = issue(&admin, "second", json!(["metrics", "read"]));
    assert_eq!(s, 201, "{v}");
    // A tenant key is not an operator key; a made-up key is not either.
    for key in [tenant_key.as_str(), "eka_made_up_0123456789"] {
        let (s, v) = status("GET", "/v1/admin/tenants", key, Value::Null);
        assert_eq!((s, code(&v)), (401, "unauthorized".into()), "{v}");
    }
    // Listed (no secrets), a page at a time.
    let (s, list) = status("GET", "/v1/admin/keys?limit=10", &admin, Value::Null);
    assert_eq!(s, 200, "{list}");
    let keys = list["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 4, "{list}");
    assert!(
        !list.to_string().contains(&metrics),
        "a secret in the listing"
    );
    let (s, page) = status("GET", "/v1/admin/keys?limit=3", &admin, Value::Null);
    assert_eq!((s, page["keys"].as_array().unwrap().len()), (200, 3));
    let (_, rest) = status(
        "GET",
        &format!(
            "/v1/admin/keys?cursor={}",
            page["next_cursor"].as_str().unwrap()
        ),
        &admin,
        Value::Null,
    );
    assert_eq!(rest["keys"][0]["name"], "second", "{rest}");
    // Revoked: it stops at once, the others go on; no restart.
    let id = m["key"]["id"].as_str().unwrap();
    let (s, _) = srv.raw("DELETE", &format!("/v1/admin/keys/{id}"), Some(&admin), b"");
    assert_eq!(s, 204);
    let (s, _) = srv.raw("GET", "/metrics", Some(&metrics), b"");
    assert_eq!(s, 401);
    let (s, _) = srv.raw("GET", "/metrics", Some(&read), b"");
    assert_eq!(s, 200);
    let (s, v) = status(
        "DELETE",
        &format!("/v1/admin/keys/{id}"),
        &admin,
        Value::Null,
    );
    assert_eq!((s, code(&v)), (404, "not_found".into()), "{v}");
    // Bad input: no scope, an unknown scope.
    for body in [
        json!({"name": "x", "scopes": []}),
        json!({"name": "x", "scopes": ["root"]}),
    ] {
        let (s, v) = status("POST", "/v1/admin/keys", &admin, body);
        assert_eq!((s, code(&v)), (400, "invalid_request".into()), "{v}");
    }
    // The bootstrap key from the configuration still opens everything.
    let (s, _) = status("GET", "/v1/admin/keys", ADMIN, Value::Null);
    assert_eq!(s, 200);
    srv.stop();
}
