//! Liveness and readiness.

use actix_web::{HttpResponse, get, web};
use serde_json::json;

use crate::state::AppState;

/// Liveness: the process answers.
#[utoipa::path(
    tag = "health",
    responses(
        (status = 200, description = "Alive", body = serde_json::Value),
    ),
)]
#[get("/healthz")]
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(json!({"status": "ok"}))
}

/// Readiness: the database answers; says whether a model is loaded.
#[utoipa::path(
    tag = "health",
    responses(
        (status = 200, description = "Ready: the database answers and the engine, if a model is loaded, runs", body = serde_json::Value),
        (status = 503, description = "Not ready: the database does not answer, or the engine thread has ended", body = serde_json::Value),
    ),
)]
#[get("/readyz")]
pub async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let db = state.store.ping().await;
    let engine = state.engine_ready();
    let body = json!({
        "database": db,
        "model": state.engine.is_some(),
        "engine": if state.engine.is_none() { "absent" } else if engine { "running" } else { "stopped" },
    });
    // Without a model the service is still ready for what it serves (prompts, memory); a model
    // whose engine thread has ended is not.
    if db && (state.engine.is_none() || engine) {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}
