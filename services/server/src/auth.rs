//! Authentication: `Authorization: Bearer <key>` on every request. A tenant key names its
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
use sha2::{Digest, Sha256};

use crate::error::ApiError;
use crate::state::AppState;

fn bearer(req: &HttpRequest) -> Result<String, ApiError> {
    let header = req
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| unauthorized("missing `Authorization: Bearer <key>`"))?;
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
            match state.keys.authenticate(&state.store, &key, lookup).await? {
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

/// API-key lookups remembered (moka, keyed by the key's SHA-256, so no secret is held): a
/// found key for `auth.key_cache_ms`, so a busy tenant's requests do not each ask the
/// database; an unknown key for `auth.unknown_key_cache_ms`, so a client retrying a wrong key
/// does not either. Revocations and tenant deletions through this node clear both.
#[derive(Debug)]
pub struct KeyCache {
    cache: Option<moka::sync::Cache<[u8; 32], Tenant>>,
    unknown: Option<moka::sync::Cache<[u8; 32], ()>>,
}

fn cache_of<V: Clone + Send + Sync + 'static>(
    ttl_ms: u64,
) -> Option<moka::sync::Cache<[u8; 32], V>> {
    (ttl_ms > 0).then(|| {
        moka::sync::Cache::builder()
            .max_capacity(100_000)
            .time_to_live(std::time::Duration::from_millis(ttl_ms))
            .build()
    })
}

impl KeyCache {
    /// A cache whose found keys live `ttl_ms` and unknown ones `unknown_ms` (none when 0).
    pub fn new(ttl_ms: u64, unknown_ms: u64) -> Self {
        Self {
            cache: cache_of(ttl_ms),
            unknown: cache_of(unknown_ms),
        }
    }

    /// The key's tenant: remembered, or — when `lookup` allows it (the caller's lookup rate) —
    /// asked of the store, and remembered either way.
    pub async fn authenticate<E>(
        &self,
        store: &engram_store::Store,
        key: &str,
        lookup: impl FnOnce() -> Result<(), E>,
    ) -> Result<Option<Tenant>, ApiError>
    where
        ApiError: From<E>,
    {
        let h: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        if let Some(t) = self.cache.as_ref().and_then(|c| c.get(&h)) {
            return Ok(Some(t));
        }
        if self.unknown.as_ref().is_some_and(|c| c.contains_key(&h)) {
            return Ok(None);
        }
        lookup()?;
        let found = store.authenticate(key).await?;
        match (&found, &self.cache, &self.unknown) {
            (Some(t), Some(c), _) => c.insert(h, t.clone()),
            (None, _, Some(u)) => u.insert(h, ()),
            _ => {}
        }
        Ok(found)
    }

    /// Forgets every lookup (a key was revoked or created, or a tenant deleted).
    pub fn clear(&self) {
        if let Some(c) = &self.cache {
            c.invalidate_all();
        }
        if let Some(u) = &self.unknown {
            u.invalidate_all();
        }
    }
}

/// Operator keys remembered like tenant keys ([`KeyCache`]'s two caches): the stored keys of
/// `POST /v1/admin/keys`, keyed by the secret's SHA-256.
#[derive(Debug)]
pub struct OperatorKeys {
    found: Option<moka::sync::Cache<[u8; 32], engram_store::AdminKey>>,
    unknown: Option<moka::sync::Cache<[u8; 32], ()>>,
}

impl OperatorKeys {
    /// Found keys live `ttl_ms`, unknown ones `unknown_ms` (none when 0).
    pub fn new(ttl_ms: u64, unknown_ms: u64) -> Self {
        Self {
            found: cache_of(ttl_ms),
            unknown: cache_of(unknown_ms),
        }
    }

    /// Forgets every lookup (a key was issued or revoked).
    pub fn clear(&self) {
        if let Some(c) = &self.found {
            c.invalidate_all();
        }
        if let Some(u) = &self.unknown {
            u.invalidate_all();
        }
    }

    async fn find(
        &self,
        state: &AppState,
        key: &str,
        ip: Option<std::net::IpAddr>,
    ) -> Result<Option<engram_store::AdminKey>, ApiError> {
        let h: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        if let Some(k) = self.found.as_ref().and_then(|c| c.get(&h)) {
            return Ok(Some(k));
        }
        if self.unknown.as_ref().is_some_and(|c| c.contains_key(&h)) {
            return Ok(None);
        }
        state.limits.check_lookup(ip)?;
        let found = state.store.admin_key_of_secret(key).await?;
        match (&found, &self.found, &self.unknown) {
            (Some(k), Some(c), _) => c.insert(h, k.clone()),
            (None, _, Some(u)) => u.insert(h, ()),
            _ => {}
        }
        Ok(found)
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
            match state.operators.find(&state, &key, ip).await? {
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
