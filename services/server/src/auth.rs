//! Authentication: `Authorization: Bearer <key>` on every request. A tenant key names its
//! tenant; the admin key (from config) opens the admin endpoints.

use std::future::Future;
use std::pin::Pin;

use actix_web::http::StatusCode;
use actix_web::{FromRequest, HttpRequest, web};
use engram_store::Tenant;
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
        Box::pin(async move {
            let (key, state) = (key?, state?);
            match state.keys.authenticate(&state.store, &key).await? {
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

/// API-key lookups remembered for `auth.key_cache_ms` (moka, keyed by the key's SHA-256, so
/// no secret is held): a busy tenant's requests do not each ask the database. Unknown keys
/// are not remembered (a key created on another node works at once); revocations and tenant
/// deletions through this node clear it.
#[derive(Debug)]
pub struct KeyCache {
    cache: Option<moka::sync::Cache<[u8; 32], Tenant>>,
}

impl KeyCache {
    /// A cache whose entries live `ttl_ms` (none when 0).
    pub fn new(ttl_ms: u64) -> Self {
        Self {
            cache: (ttl_ms > 0).then(|| {
                moka::sync::Cache::builder()
                    .max_capacity(100_000)
                    .time_to_live(std::time::Duration::from_millis(ttl_ms))
                    .build()
            }),
        }
    }

    /// The key's tenant: remembered, or asked of the store (and remembered when found).
    pub async fn authenticate(
        &self,
        store: &engram_store::Store,
        key: &str,
    ) -> Result<Option<Tenant>, engram_store::StoreError> {
        let Some(cache) = &self.cache else {
            return store.authenticate(key).await;
        };
        let h: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        if let Some(t) = cache.get(&h) {
            return Ok(Some(t));
        }
        let found = store.authenticate(key).await?;
        if let Some(t) = &found {
            cache.insert(h, t.clone());
        }
        Ok(found)
    }

    /// Forgets every lookup (a key was revoked or a tenant deleted).
    pub fn clear(&self) {
        if let Some(c) = &self.cache {
            c.invalidate_all();
        }
    }
}

/// The operator.
#[derive(Debug, Clone, Copy)]
pub struct AdminCaller;

impl FromRequest for AdminCaller {
    type Error = ApiError;
    type Future = std::future::Ready<Result<Self, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut actix_web::dev::Payload) -> Self::Future {
        let check = || {
            let key = bearer(req)?;
            let state = state(req)?;
            let expected = state.admin_key_hash.ok_or_else(|| {
                ApiError::new(
                    StatusCode::FORBIDDEN,
                    "admin_disabled",
                    "no admin key is configured (auth.admin_key)",
                )
            })?;
            let given: [u8; 32] = Sha256::digest(key.as_bytes()).into();
            if given == expected {
                Ok(Self)
            } else {
                Err(unauthorized("wrong admin key"))
            }
        };
        std::future::ready(check())
    }
}
