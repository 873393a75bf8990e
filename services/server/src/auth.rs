//! Authentication: `Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's SDK
//! sends it) on every request. A tenant key names its
//! tenant; the admin key (from config) opens the admin endpoints.
//!
//! What an unauthenticated request can cost is bounded before the database is asked: keys in
//! use and keys found unknown are remembered for a short time ([`KeyCache`]), and the lookups
//! of the other keys are throttled per client IP (`auth.lookups_per_ip_per_sec`), so a flood
//! of made-up keys answers 401 or 429 from memory.

use std::future::Future;
use std::pin::Pin;

use actix_web::http::StatusCode;
use actix_web::{FromRequest, HttpRequest, web};
use engram_store::{AdminScope, Tenant};

use crate::keys::KeyError;
use crate::limits::LimitError;
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::state::AppState;

fn bearer(req: &HttpRequest) -> Result<String, ApiError> {
    let headers = req.headers();
    let Some(header) = headers
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        // Anthropic's SDK sends its key as `x-api-key`.
        return headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .ok_or_else(|| unauthorized("missing `Authorization: Bearer <key>` (or `x-api-key`)"));
    };
    header
        .strip_prefix("Bearer ")
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
        .ok_or_else(|| unauthorized("the Authorization header must be `Bearer <key>`"))
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
}

fn state(req: &HttpRequest) -> Result<web::Data<AppState>, ApiError> {
    req.app_data::<web::Data<AppState>>()
        .cloned()
        .ok_or_else(|| ApiError::internal("AppState missing"))
}

/// The authenticated tenant.
#[derive(Debug, Clone)]
pub struct TenantCaller(pub Tenant);

impl FromRequest for TenantCaller {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<Self, ApiError>>>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let key = bearer(req);
        let state = state(req);
        let ip = req.peer_addr().map(|a| a.ip());
        Box::pin(async move {
            let (key, state) = (key?, state?);
            let lookup = || state.limits.check_lookup(ip);
            let found = state
                .keys
                .get(&key, lookup, || state.store.authenticate(&key))
                .await;
            match found.map_err(ApiError::from)? {
                Some(t) => {
                    crate::telemetry::record_tenant(&t.id);
                    state.limits.check_rate(&t.id)?;
                    Ok(Self(t))
                }
                None => Err(unauthorized("unknown or revoked API key")),
            }
        })
    }
}

/// The scope an operator extractor demands (see [`Operator`]).
pub trait Demands {
    /// The scope.
    const SCOPE: AdminScope;
}

/// Marker: every operator action.
#[derive(Debug, Clone, Copy)]
pub struct AdminScopeMark;
impl Demands for AdminScopeMark {
    const SCOPE: AdminScope = AdminScope::Admin;
}

/// Marker: the operator's views.
#[derive(Debug, Clone, Copy)]
pub struct ReadScopeMark;
impl Demands for ReadScopeMark {
    const SCOPE: AdminScope = AdminScope::Read;
}

/// Marker: metrics scraping.
#[derive(Debug, Clone, Copy)]
pub struct MetricsScopeMark;
impl Demands for MetricsScopeMark {
    const SCOPE: AdminScope = AdminScope::Metrics;
}

/// An operator whose key allows `N::SCOPE`: the bootstrap key of the configuration
/// (`auth.admin_key`, every scope) or a stored operator key with the scope (or a wider one).
/// A valid key without the scope answers 403 `forbidden`.
#[derive(Debug, Clone, Copy)]
pub struct Operator<N>(std::marker::PhantomData<N>);

/// An operator who may do everything (tenants, keys, public layers, cache operations).
pub type AdminCaller = Operator<AdminScopeMark>;
/// An operator who may read the operator views.
pub type ReadCaller = Operator<ReadScopeMark>;
/// An operator who may scrape metrics.
pub type MetricsCaller = Operator<MetricsScopeMark>;

impl<N: Demands + 'static> FromRequest for Operator<N> {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<Self, ApiError>>>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let key = bearer(req);
        let state = state(req);
        let ip = req.peer_addr().map(|a| a.ip());
        Box::pin(async move {
            let (key, state) = (key?, state?);
            let given: [u8; 32] = Sha256::digest(key.as_bytes()).into();
            if state.admin_key_hash == Some(given) {
                return Ok(Self(std::marker::PhantomData));
            }
            let lookup = || state.limits.check_lookup(ip);
            let found = state
                .operators
                .get(&key, lookup, || state.store.admin_key_of_secret(&key))
                .await;
            match found.map_err(ApiError::from)? {
                Some(k) if k.allows(N::SCOPE) => Ok(Self(std::marker::PhantomData)),
                Some(_) => Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "forbidden",
                    format!("this key's scopes do not include `{}`", N::SCOPE.as_str()),
                )),
                None if state.admin_key_hash.is_none() => Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "admin_disabled",
                    "no admin key is configured (auth.admin_key)",
                )),
                None => Err(unauthorized("wrong admin key")),
            }
        })
    }
}

impl From<KeyError<LimitError>> for ApiError {
    fn from(e: KeyError<LimitError>) -> Self {
        match e {
            KeyError::Throttled(l) => l.into(),
            KeyError::Store(s) => s.into(),
        }
    }
}
