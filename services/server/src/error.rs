//! The one place errors become HTTP: `{code, message}` bodies with stable codes; a 5xx never
//! carries internal text (it is logged instead). Each domain error (store, engine, context,
//! memory graph, shadow, turn) maps here by an exhaustive `match`: a new variant does not
//! compile until it has a status and a code.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use engram_context::ContextError;
use engram_engine::EngineError;
use engram_shadow::ShadowError;
use engram_store::StoreError;
use serde::Serialize;

use crate::limits::LimitError;
use crate::state::Unavailable;
use crate::turn::TurnError;
use engram_memory::MemoryError;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable machine-readable code.
    pub code: &'static str,
    /// Human-readable explanation (generic for 5xx).
    pub message: String,
    /// Seconds a client should wait before it retries (`Retry-After`), for 429s.
    pub retry_after: Option<u64>,
}

/// The error body, as documented in the OpenAPI spec.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ErrorSchema {
    /// Stable machine-readable code (`unauthorized`, `not_found`, `invalid_request`, …).
    pub code: String,
    /// Explanation.
    pub message: String,
}

/// The JSON body of every error.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    /// Stable code.
    pub code: &'a str,
    /// Explanation.
    pub message: &'a str,
}

impl ApiError {
    /// A 4xx (or 503) with its message shown to the client.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    /// 429 `rate_limited` with `Retry-After: secs`.
    pub fn rate_limited(message: impl Into<String>, secs: u64) -> Self {
        Self {
            retry_after: Some(secs.max(1)),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message)
        }
    }

    /// A 500: the detail goes to the log, the client sees a generic text.
    pub fn internal(detail: impl std::fmt::Display) -> Self {
        log_detail("internal error", &detail);
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error; the server log has the detail under this response's x-request-id",
        )
    }

    /// A 503 whose detail (a path, a backend's text) goes to the log, not to the client.
    pub fn unavailable(code: &'static str, message: &str, detail: impl std::fmt::Display) -> Self {
        log_detail(code, &detail);
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
    }

    /// 400 `invalid_request`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }
}

/// Logs a failure's detail in the current request's span (its line names the request id).
fn log_detail(what: &str, detail: &dyn std::fmt::Display) {
    tracing::error!(error = what, detail = %detail, "request failed");
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status);
        if let Some(secs) = self.retry_after {
            r.insert_header((actix_web::http::header::RETRY_AFTER, secs.to_string()));
        }
        r.json(ErrorBody {
            code: self.code,
            message: &self.message,
        })
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound { entity, id } => {
                Self::not_found(format!("{entity} `{id}` not found"))
            }
            StoreError::Conflict { entity, id } => Self::new(
                StatusCode::CONFLICT,
                "conflict",
                format!("{entity} `{id}` already exists"),
            ),
            // A row this request writes refers to one deleted meanwhile (a turn whose session
            // or agent another request deleted): the request lost a race, the data is intact.
            StoreError::Database(sqlx_error)
                if sqlx_error
                    .as_database_error()
                    .is_some_and(|d| d.is_foreign_key_violation()) =>
            {
                Self::new(
                    StatusCode::CONFLICT,
                    "conflict",
                    "what this request writes to was deleted meanwhile",
                )
            }
            StoreError::UnsupportedUrl { .. }
            | StoreError::Database(_)
            | StoreError::Migration(_)
            | StoreError::Corrupt { .. }
            | StoreError::Random(_) => Self::internal(e),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match &e {
            EngineError::Overloaded { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                "the engine queue is full; retry later",
            ),
            EngineError::InvalidSampling { .. } => Self::invalid(e.to_string()),
            EngineError::Constraint { .. } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "constraint_failed",
                e.to_string(),
            ),
            EngineError::ContextOverflow { .. } => {
                Self::new(StatusCode::BAD_REQUEST, "context_overflow", e.to_string())
            }
            EngineError::EmptyPrompt | EngineError::TokenOutOfRange { .. } => {
                Self::invalid(e.to_string())
            }
            EngineError::QuotaExceeded { .. } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "quota_exceeded",
                e.to_string(),
            ),
            EngineError::NoColdRoom { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no_cold_room",
                e.to_string(),
            ),
            EngineError::NoHotRoom { .. } => Self {
                retry_after: Some(1),
                ..Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no_hot_room",
                    "the cache is full of other tenants' work; retry later",
                )
            },
            EngineError::UnknownReservation { .. } => Self::not_found(e.to_string()),
            EngineError::ShadowMismatch { .. } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "cache_mismatch",
                e.to_string(),
            ),
            EngineError::Stopped => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "model_unavailable",
                "the engine has stopped; see the server log",
            ),
            EngineError::Panicked(_) => Self::internal(e),
            EngineError::Io { .. }
            | EngineError::Candle(_)
            | EngineError::Kv(_)
            | EngineError::Model(_)
            | EngineError::InvalidConfig { .. } => Self::internal(e),
        }
    }
}

impl From<ContextError> for ApiError {
    fn from(e: ContextError) -> Self {
        match e {
            ContextError::Overflow { .. } => {
                Self::new(StatusCode::BAD_REQUEST, "context_overflow", e.to_string())
            }
            ContextError::DuplicateLayer { .. }
            | ContextError::InvalidImportance { .. }
            | ContextError::EmptyMessage => Self::invalid(e.to_string()),
        }
    }
}

impl From<MemoryError> for ApiError {
    fn from(e: MemoryError) -> Self {
        match e {
            MemoryError::Embedder { .. }
            | MemoryError::Io { .. }
            | MemoryError::Vector(_)
            | MemoryError::Store(_)
            | MemoryError::Graph(_)
            | MemoryError::Embed(_)
            | MemoryError::Poisoned
            | MemoryError::NoVector
            | MemoryError::Corrupt { .. } => Self::internal(e),
        }
    }
}

impl From<ShadowError> for ApiError {
    fn from(e: ShadowError) -> Self {
        match e {
            ShadowError::NotFound => Self::not_found(e.to_string()),
            ShadowError::Engine(e) => e.into(),
            ShadowError::Invalid { .. } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_cache_file",
                e.to_string(),
            ),
            // The object store is down or refuses the credentials: retry later.
            ShadowError::Store { .. } => Self::unavailable(
                "shadow_unavailable",
                "the shadow's store cannot be reached; retry later",
                e,
            ),
            ShadowError::Io { .. } | ShadowError::Kv(_) => Self::internal(e),
        }
    }
}

impl From<Unavailable> for ApiError {
    fn from(e: Unavailable) -> Self {
        let code = match e {
            Unavailable::Model { .. } => "model_unavailable",
            Unavailable::Memory { .. } => "memory_unavailable",
            Unavailable::Shadow { .. } => "shadow_unavailable",
        };
        Self::new(StatusCode::SERVICE_UNAVAILABLE, code, e.to_string())
    }
}

impl From<LimitError> for ApiError {
    fn from(e: LimitError) -> Self {
        match e {
            LimitError::Rate { retry_after_secs } => {
                Self::rate_limited(e.to_string(), retry_after_secs)
            }
            LimitError::Generations => Self::rate_limited(e.to_string(), 1),
        }
    }
}

impl From<TurnError> for ApiError {
    fn from(e: TurnError) -> Self {
        match e {
            TurnError::Store(e) => e.into(),
            TurnError::Engine(e) => e.into(),
            TurnError::Context(e) => e.into(),
            TurnError::Memory(e) => e.into(),
            TurnError::InvalidName { .. }
            | TurnError::UnknownLayerKind(_)
            | TurnError::InvalidMessage
            | TurnError::InvalidEntries { .. } => Self::invalid(e.to_string()),
            TurnError::SessionQuota { .. } => Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "quota_exceeded",
                e.to_string(),
            ),
            TurnError::SessionDeleted => {
                Self::new(StatusCode::CONFLICT, "session_deleted", e.to_string())
            }
            TurnError::SessionBusy => {
                Self::new(StatusCode::CONFLICT, "session_busy", e.to_string())
            }
            TurnError::Unavailable(e) => e.into(),
            TurnError::StoredLayerKind(_) | TurnError::NoAnswer | TurnError::StreamClosed => {
                Self::internal(e)
            }
        }
    }
}
