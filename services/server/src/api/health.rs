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

/// How long a database ping's answer serves `/readyz`, ms.
pub const READY_TTL_MS: u64 = 1_000;

/// The last database ping's answer, shared by `/readyz` callers: at most one ping runs per
/// [`READY_TTL_MS`] whatever the request rate (the others answer from the last result), so the
/// probe cannot be turned into database load.
#[derive(Debug, Default)]
pub struct ReadyCache {
    /// 0: never asked; 1: the database answered; 2: it did not.
    state: std::sync::atomic::AtomicU8,
    /// When it was asked, ms on the process' clock.
    at_ms: std::sync::atomic::AtomicU64,
    /// A ping is running.
    asking: std::sync::atomic::AtomicBool,
    /// Pings sent (tests read it).
    pings: std::sync::atomic::AtomicU64,
}

impl ReadyCache {
    /// Whether the database answers: the last answer while it is fresh (or while another
    /// caller asks again), else a ping now.
    pub async fn database(&self, store: &engram_store::Store, now_ms: u64) -> bool {
        use std::sync::atomic::Ordering::{AcqRel, Acquire, Release};
        let state = self.state.load(Acquire);
        let fresh = now_ms.saturating_sub(self.at_ms.load(Acquire)) < READY_TTL_MS;
        if state != 0 && fresh {
            return state == 1;
        }
        if self
            .asking
            .compare_exchange(false, true, AcqRel, Acquire)
            .is_err()
            && state != 0
        {
            return state == 1;
        }
        self.pings.fetch_add(1, AcqRel);
        let ok = store.ping().await;
        self.state.store(if ok { 1 } else { 2 }, Release);
        self.at_ms.store(now_ms, Release);
        self.asking.store(false, Release);
        ok
    }

    /// Database pings sent since the start.
    pub fn pings(&self) -> u64 {
        self.pings.load(std::sync::atomic::Ordering::Acquire)
    }
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
