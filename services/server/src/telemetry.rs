//! Logs: `tracing` events on stderr, as text or one JSON object per line (`[log]`), and one
//! line per HTTP request from `tracing-actix-web` with the request id, the tenant, the route,
//! the status, the latency and — for a turn — its cached and prefilled prompt tokens and its
//! time to first token.

use std::time::Instant;

use actix_web::Error;
use actix_web::HttpMessage;
use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use tracing::Span;
use tracing_actix_web::{RootSpanBuilder, TracingLogger};
use tracing_subscriber::EnvFilter;

/// Why logging could not start.
#[derive(Debug, thiserror::Error)]
pub enum LogInitError {
    /// `log.level` (or `RUST_LOG`) is not a filter.
    #[error("log.level / RUST_LOG: {0}")]
    Filter(String),
    /// A global subscriber was already set.
    #[error("a log subscriber is already installed")]
    AlreadySet,
}

/// The filter: `RUST_LOG` when set, else `level`.
pub fn filter(level: &str) -> Result<EnvFilter, LogInitError> {
    match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => EnvFilter::try_new(v),
        _ => EnvFilter::try_new(level),
    }
    .map_err(|e| LogInitError::Filter(e.to_string()))
}

/// Installs the global subscriber: `format` `json` (one object per line, the span's fields
/// under `span`) or `text`; events go to stderr.
pub fn init(level: &str, format: &str) -> Result<(), LogInitError> {
    let filter = filter(level)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(true);
    let set = if format == "json" {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .try_init()
    } else {
        builder.with_ansi(false).try_init()
    };
    set.map_err(|_| LogInitError::AlreadySet)
}

/// The middleware: `TracingLogger` with Engram's root span.
pub fn logger() -> TracingLogger<EngramSpan> {
    TracingLogger::<EngramSpan>::new()
}

/// The request's root span: fields known at the start, and those the handlers fill in
/// (`tenant`, `cached_tokens`, `prefilled_tokens`, `completion_tokens`, `ttft_ms`).
#[derive(Debug, Clone, Copy)]
pub struct EngramSpan;

/// When the request started and the route it matched (in the request's extensions), for the
/// latency and the HTTP metrics.
#[derive(Debug, Clone)]
struct Started {
    at: Instant,
    route: String,
}

impl RootSpanBuilder for EngramSpan {
    fn on_request_start(request: &ServiceRequest) -> Span {
        let route = request
            .match_pattern()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "unmatched".to_string());
        request.extensions_mut().insert(Started {
            at: Instant::now(),
            route: route.clone(),
        });
        let id = crate::request_id::of(request);
        tracing::info_span!(
            "request",
            request_id = %id,
            method = %request.method(),
            route = %route,
            tenant = tracing::field::Empty,
            status = tracing::field::Empty,
            latency_ms = tracing::field::Empty,
            cached_tokens = tracing::field::Empty,
            prefilled_tokens = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
            ttft_ms = tracing::field::Empty,
        )
    }

    fn on_request_end<B: MessageBody>(span: Span, outcome: &Result<ServiceResponse<B>, Error>) {
        let (status, started) = match outcome {
            Ok(res) => (
                res.status(),
                res.request().extensions().get::<Started>().cloned(),
            ),
            Err(e) => (e.as_response_error().status_code(), None),
        };
        let latency_ms = started
            .as_ref()
            .map_or(0.0, |s| s.at.elapsed().as_secs_f64() * 1e3);
        if let (Ok(res), Some(started)) = (outcome, &started)
            && let Some(state) = res
                .request()
                .app_data::<actix_web::web::Data<crate::state::AppState>>()
        {
            state.metrics.observe_http(
                res.request().method().as_str(),
                &started.route,
                status.as_u16(),
                latency_ms / 1e3,
            );
        }
        span.record("status", status.as_u16());
        span.record("latency_ms", (latency_ms * 1e3).round() / 1e3);
        let _in = span.enter();
        if status.is_server_error() {
            tracing::error!(target: "engram::http", "request answered");
        } else if status.is_client_error() {
            tracing::warn!(target: "engram::http", "request answered");
        } else {
            tracing::info!(target: "engram::http", "request answered");
        }
    }
}

/// Names the authenticated tenant on the current request's line.
pub fn record_tenant(tenant: &str) {
    Span::current().record("tenant", tenant);
}

/// A turn's figures on the current request's line (for a stream, `span` is the request's span
/// captured by the handler, and the line is the stream's end).
pub fn record_turn(span: &Span, cached: usize, prefilled: usize, completion: usize, ttft_ms: f64) {
    span.record("cached_tokens", cached);
    span.record("prefilled_tokens", prefilled);
    span.record("completion_tokens", completion);
    span.record("ttft_ms", (ttft_ms * 1e3).round() / 1e3);
}
