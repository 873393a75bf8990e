//! # engram-benches
//!
//! The benchmark drivers behind `engram-bench` (and `make bench-*`): the agent workload driver
//! and its report (against llama.cpp's `llama-server` and Engram over the same OpenAI route),
//! hybrid recall at scale, a conversation with and without neighbourhood reservation, the
//! shadow's restart figures, and the TTFT/decode run. Figures are printed, never asserted:
//! speed targets live here, not in timed unit tests.
//!
//! The criterion micro-benchmarks are in `benches/kvcore.rs` (`make bench`).

#![forbid(unsafe_code)]

/// The admin key of the in-process apps the benches drive.
pub const BENCH_ADMIN: &str = "bench-admin-key-0123456789";

/// One JSON request to an in-process app (benches): `(status, body)`.
macro_rules! app_call {
    ($app:expr, $method:expr, $path:expr, $key:expr, $body:expr $(,)?) => {{
        let body: serde_json::Value = $body;
        let mut req = match $method {
            "GET" => actix_web::test::TestRequest::get(),
            "DELETE" => actix_web::test::TestRequest::delete(),
            _ => actix_web::test::TestRequest::post(),
        }
        .uri($path)
        .insert_header(("authorization", format!("Bearer {}", $key)));
        if !body.is_null() {
            req = req.set_json(body);
        }
        let resp = actix_web::test::call_service($app, req.to_request()).await;
        let status = resp.status().as_u16();
        let bytes = actix_web::test::read_body(resp).await;
        (
            status,
            serde_json::from_slice::<serde_json::Value>(&bytes).unwrap_or(serde_json::Value::Null),
        )
    }};
}

/// Creates a tenant with an agent `bot`; evaluates to its API key.
macro_rules! tenant {
    ($app:expr, $name:expr) => {{
        let (s, t) = app_call!($app, "POST", "/v1/admin/tenants", crate::BENCH_ADMIN, serde_json::json!({"name": $name}));
        anyhow::ensure!(s == 201, "tenant: {t}");
        let key = t["api_key"].as_str().unwrap_or_default().to_string();
        let (s, a) = app_call!(
            $app,
            "POST",
            "/v1/agents",
            &key,
            serde_json::json!({"name": "bot", "layers": [{"kind": "axioms", "content": "Be brief and exact."}]}),
        );
        anyhow::ensure!(s == 201, "agent: {a}");
        key
    }};
}

pub mod agentic;
pub mod conversation;
pub mod eviction;
pub mod memory;
pub mod shadow;
pub mod tiers;
pub mod workload;
