//! Liveness and readiness.

use actix_web::{HttpResponse, get, web};

use crate::state::AppState;

/// The liveness answer.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct Alive {
    /// `ok`.
    pub status: &'static str,
}

/// The readiness answer.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct Readiness {
    /// The database answers.
    pub database: bool,
    /// A model is loaded.
    pub model: bool,
    /// The engine: `absent` (no model), `running` or `stopped`.
    pub engine: &'static str,
}

/// Liveness: the process answers.
#[utoipa::path(
    tag = "health",
    responses(
        (status = 200, description = "Alive", body = Alive),
    ),
)]
#[get("/healthz")]
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(Alive { status: "ok" })
}

/// Readiness: the database answers (asked at most once a second, whatever the request rate);
/// says whether a model is loaded.
#[utoipa::path(
    tag = "health",
    responses(
        (status = 200, description = "Ready: the database answers and the engine, if a model is loaded, runs", body = Readiness),
        (status = 503, description = "Not ready: the database does not answer, or the engine thread has ended", body = Readiness),
    ),
)]
#[get("/readyz")]
pub async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let db = state
        .ready
        .database(&state.store, state.started.elapsed().as_millis() as u64)
        .await;
    let engine = state.engine_ready();
    let body = Readiness {
        database: db,
        model: state.engine.is_some(),
        engine: if state.engine.is_none() {
            "absent"
        } else if engine {
            "running"
        } else {
            "stopped"
        },
    };
    // Without a model the service is still ready for what it serves (prompts, memory); a model
    // whose engine thread has ended is not.
    if db && (state.engine.is_none() || engine) {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}
