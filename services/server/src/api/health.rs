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
        (status = 200, description = "Ready (database answers); 503 otherwise", body = serde_json::Value),
    ),
)]
#[get("/readyz")]
pub async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let db = state.store.ping().await;
    let body = json!({"database": db, "model": state.engine.is_some()});
    if db {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}
