//! Operator endpoints: tenants and their API keys.

use actix_web::{HttpResponse, delete, get, post, web};
use engram_store::Quotas;
use serde::Deserialize;
use serde_json::json;

use crate::auth::AdminCaller;
use crate::error::ApiError;
use crate::state::AppState;

/// Body of `POST /v1/admin/tenants`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewTenant {
    /// Unique name (1–64 characters of letters, digits, `-`, `_`).
    pub name: String,
    /// Quotas `{hot_blocks, cold_blocks, sessions}` (defaults from config).
    #[schema(value_type = Option<Object>)]
    pub quotas: Option<Quotas>,
}

pub(crate) fn check_name(what: &str, name: &str) -> Result<(), ApiError> {
    let ok = (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(format!(
            "{what} must be 1–64 characters of letters, digits, `-` or `_`"
        )))
    }
}

/// Creates a tenant and its first API key (the secret is shown once).
#[utoipa::path(
    tag = "admin",
    request_body = NewTenant,
    responses(
        (status = 201, description = "Tenant created; `api_key` is shown once", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/admin/tenants")]
pub async fn create_tenant(
    _: AdminCaller,
    state: web::Data<AppState>,
    body: web::Json<NewTenant>,
) -> Result<HttpResponse, ApiError> {
    check_name("name", &body.name)?;
    let d = &state.config.tenants;
    let quotas = body.quotas.unwrap_or(Quotas {
        hot_blocks: d.hot_blocks,
        cold_blocks: d.cold_blocks,
        sessions: d.sessions,
    });
    let tenant = state.store.create_tenant(&body.name, quotas).await?;
    let (key, secret) = state.store.create_key(&tenant.id).await?;
    Ok(HttpResponse::Created().json(json!({"tenant": tenant, "key": key, "api_key": secret})))
}

/// Lists tenants.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "Every tenant", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/tenants")]
pub async fn list_tenants(
    _: AdminCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(json!({"tenants": state.store.tenants().await?})))
}

/// Issues another API key for a tenant.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 201, description = "The new key; `api_key` is shown once", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/admin/tenants/{tenant}/keys")]
pub async fn create_key(
    _: AdminCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let (key, secret) = state.store.create_key(&path).await?;
    Ok(HttpResponse::Created().json(json!({"key": key, "api_key": secret})))
}

/// Revokes an API key.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 204, description = "Revoked", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[delete("/v1/admin/tenants/{tenant}/keys/{key}")]
pub async fn revoke_key(
    _: AdminCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (tenant, key) = path.into_inner();
    state.store.revoke_key(&tenant, &key).await?;
    Ok(HttpResponse::NoContent().finish())
}
