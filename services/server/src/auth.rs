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
            match state.store.authenticate(&key).await? {
                Some(t) => {
                    state.limits.check_rate(&t.id)?;
                    Ok(Self(t))
                }
                None => Err(unauthorized("unknown or revoked API key")),
            }
        })
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
