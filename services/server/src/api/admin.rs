//! Operator endpoints: tenants and their API keys, and the operator keys with their scopes.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, delete, get, post, put, web};
use engram_store::{AdminKey, AdminScope, Quotas};
use serde::Deserialize;

use crate::auth::{AdminCaller, ReadCaller};
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{build_context, check_name, parse_kind, pin_key, public_pin_key, unpin};

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

/// A new tenant and its first key.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct CreatedTenant {
    /// The tenant.
    pub tenant: engram_store::Tenant,
    /// The key's public part.
    pub key: engram_store::ApiKey,
    /// The key's secret, shown once: `Authorization: Bearer <api_key>`.
    pub api_key: String,
}

/// A new key.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct CreatedKey {
    /// The key's public part.
    pub key: engram_store::ApiKey,
    /// The key's secret, shown once.
    pub api_key: String,
}

/// A page of the tenants.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct TenantList {
    /// Tenants, oldest first.
    pub tenants: Vec<engram_store::Tenant>,
    /// The `cursor` of the next page (null on the last).
    pub next_cursor: Option<String>,
}

/// A layer version and the KV blocks a change released.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct LayerVersion {
    /// The version.
    #[serde(flatten)]
    pub layer: engram_store::LayerRow,
    /// Pinned blocks the change released (the old prefix's).
    pub unpinned_blocks: usize,
}

/// Creates a tenant and its first API key (the secret is shown once).
#[utoipa::path(
    tag = "admin",
    request_body = NewTenant,
    responses(
        (status = 201, description = "Tenant created; `api_key` is shown once", body = CreatedTenant),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 409, description = "A tenant of that name exists", body = crate::error::ErrorSchema),
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
        shadow_mib: d.shadow_mib,
    });
    let tenant = state.store.create_tenant(&body.name, quotas).await?;
    let (key, secret) = state.store.create_key(&tenant.id).await?;
    Ok(HttpResponse::Created().json(CreatedTenant {
        tenant,
        key,
        api_key: secret,
    }))
}

/// Lists tenants, a page at a time (`limit`, `cursor`).
#[utoipa::path(
    tag = "admin",
    params(crate::pages::ListPage),
    responses(
        (status = 200, description = "A page of the tenants", body = TenantList),
        (status = 400, description = "Invalid paging", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 403, description = "The key lacks the `read` scope", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/tenants")]
pub async fn list_tenants(
    _: ReadCaller,
    state: web::Data<AppState>,
    page: web::Query<crate::pages::ListPage>,
) -> Result<HttpResponse, ApiError> {
    let (after, limit) = page.bounds()?;
    let rows = state
        .store
        .tenants_page(after.as_ref().map(|(t, id)| (*t, id.as_str())), limit + 1)
        .await?;
    let (tenants, next_cursor) = crate::pages::cut(rows, limit, |t| (t.created_at, &t.id));
    Ok(HttpResponse::Ok().json(TenantList {
        tenants,
        next_cursor,
    }))
}

/// Issues another API key for a tenant.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 201, description = "The new key; `api_key` is shown once", body = CreatedKey),
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
    Ok(HttpResponse::Created().json(CreatedKey {
        key,
        api_key: secret,
    }))
}

/// Revokes an API key.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 204, description = "Revoked"),
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
    state.keys.clear();
    Ok(HttpResponse::NoContent().finish())
}

/// Body of the public mark.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PublicMark {
    /// Share this layer's KV blocks across tenants.
    pub public: bool,
}

/// Marks (or unmarks) the current version of a stable layer public.
///
/// A public layer's KV blocks are hashed without the tenant's salt, so every tenant whose
/// prompt starts with the same public text reuses them. Only a leading run counts: the
/// stable layers in prompt order up to the first one that is not public. The mark belongs to
/// this version; the tenant's next edit is private until marked again. Unmarking releases the
/// public blocks' pins.
#[utoipa::path(
    tag = "admin",
    request_body = PublicMark,
    responses(
        (status = 200, description = "The layer version, with `unpinned_blocks`", body = LayerVersion),
        (status = 400, description = "Invalid input, or `layer_not_stable`", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown tenant, agent or layer", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[put("/v1/admin/tenants/{tenant}/agents/{agent}/layers/{kind}/public")]
pub async fn mark_layer_public(
    _: AdminCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String, String)>,
    body: web::Json<PublicMark>,
) -> Result<HttpResponse, ApiError> {
    let (tenant, agent, kind) = path.into_inner();
    let kind = parse_kind(&kind)?.as_str();
    let tenant = state.store.tenant(&tenant).await?;
    let agent = state.store.agent(&tenant.id, &agent).await?;
    let current = state.store.layers(&agent.id).await?;
    let layer = current
        .iter()
        .find(|l| l.kind == kind)
        .ok_or_else(|| ApiError::not_found(format!("the agent has no `{kind}` layer")))?;
    if !layer.stable {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "layer_not_stable",
            "only a stable layer can be public",
        ));
    }
    let before = build_context(&state, &agent, None, ".").await?;
    let row = state
        .store
        .set_layer_public(&agent.id, kind, body.public)
        .await;
    state.agents.invalidate();
    let row = row?;
    let after = build_context(&state, &agent, None, ".").await?;
    // The agent stops using the old public prefix: its pins are released only when no other
    // tenant uses it. The tenant's own stable blocks hash differently now, so their pins go too.
    let unpinned = if public_pin_key(&before) != public_pin_key(&after) {
        unpin(&state, Some(pin_key(&tenant, &before))).await?
    } else {
        0
    };
    Ok(HttpResponse::Ok().json(LayerVersion {
        layer: row,
        unpinned_blocks: unpinned,
    }))
}

/// Body of `POST /v1/admin/keys`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewAdminKey {
    /// What the key is for (1–64 characters of letters, digits, `-`, `_`).
    pub name: String,
    /// What it may do: `metrics` (scrape `/metrics`), `read` (the operator views too),
    /// `admin` (everything). At least one.
    pub scopes: Vec<AdminScope>,
}

/// A new operator key.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct CreatedAdminKey {
    /// The key's public part.
    pub key: AdminKey,
    /// The key's secret, shown once: `Authorization: Bearer <admin_key>`.
    pub admin_key: String,
}

/// A page of the stored operator keys (the bootstrap key of the configuration is not among
/// them).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AdminKeyList {
    /// Keys, revoked ones too, oldest first.
    pub keys: Vec<AdminKey>,
    /// The `cursor` of the next page (null on the last).
    pub next_cursor: Option<String>,
}

/// Issues an operator key with scopes; it works at once on every node sharing the database,
/// with no restart. The secret is shown once.
#[utoipa::path(
    tag = "admin",
    request_body = NewAdminKey,
    responses(
        (status = 201, description = "The new key; `admin_key` is shown once", body = CreatedAdminKey),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 403, description = "The key lacks the `admin` scope", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/admin/keys")]
pub async fn create_admin_key(
    _: AdminCaller,
    state: web::Data<AppState>,
    body: web::Json<NewAdminKey>,
) -> Result<HttpResponse, ApiError> {
    check_name("name", &body.name)?;
    if body.scopes.is_empty() {
        return Err(ApiError::invalid(
            "scopes must name at least one of metrics, read, admin",
        ));
    }
    let (key, secret) = state
        .store
        .create_admin_key(&body.name, &body.scopes)
        .await?;
    state.operators.clear();
    Ok(HttpResponse::Created().json(CreatedAdminKey {
        key,
        admin_key: secret,
    }))
}

/// Lists the stored operator keys (no secrets), a page at a time (`limit`, `cursor`).
#[utoipa::path(
    tag = "admin",
    params(crate::pages::ListPage),
    responses(
        (status = 400, description = "Invalid paging", body = crate::error::ErrorSchema),
        (status = 200, description = "The operator keys", body = AdminKeyList),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 403, description = "The key lacks the `admin` scope", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/keys")]
pub async fn list_admin_keys(
    _: AdminCaller,
    state: web::Data<AppState>,
    page: web::Query<crate::pages::ListPage>,
) -> Result<HttpResponse, ApiError> {
    let (after, limit) = page.bounds()?;
    let rows = state
        .store
        .admin_keys(after.as_ref().map(|(t, id)| (*t, id.as_str())), limit + 1)
        .await?;
    let (keys, next_cursor) = crate::pages::cut(rows, limit, |k| (k.created_at, &k.id));
    Ok(HttpResponse::Ok().json(AdminKeyList { keys, next_cursor }))
}

/// Revokes an operator key: it stops working on this node at once, on the others within
/// `auth.key_cache_ms`.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 204, description = "Revoked"),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 403, description = "The key lacks the `admin` scope", body = crate::error::ErrorSchema),
        (status = 404, description = "No such key, or revoked already", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[delete("/v1/admin/keys/{key}")]
pub async fn revoke_admin_key(
    _: AdminCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    state.store.revoke_admin_key(&path).await?;
    state.operators.clear();
    Ok(HttpResponse::NoContent().finish())
}
