//! A session's persisted cache (save, load, export, import), and the operator's view of the
//! shadow and the tier bridge.

use std::collections::HashMap;
use std::time::Instant;

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, get, post, web};
use engram_engine::{ChainKey, CollectRequest, CollectedBytes, RestoreChain};
use engram_kvcore::TenantId;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::json;
use utoipa::ToSchema;

use crate::api::Answer;
use crate::api::turns::session_key;
use crate::auth::{AdminCaller, TenantCaller};
use crate::error::ApiError;
use crate::shadow::{ChainBlocks, ShadowError, engine_restore, export_file, import_file};
use crate::state::AppState;

/// Largest exported session accepted by import.
const IMPORT_LIMIT: usize = 1 << 30;

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
            ShadowError::Store { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shadow_unavailable",
                e.to_string(),
            ),
            ShadowError::Io { .. } | ShadowError::Kv(_) => Self::internal(e),
        }
    }
}

/// What a save, load or import did.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CacheOpResponse {
    /// Blocks of the session's chain the operation covered.
    pub blocks: usize,
    /// Blocks loaded into the cold tier (load, import) or written (save).
    pub moved: usize,
    /// Bytes written (save).
    pub bytes: u64,
    /// Tokens the chain covers.
    pub tokens: usize,
    /// Wall time, ms.
    pub ms: f64,
}

async fn key_of(
    state: &AppState,
    caller: &TenantCaller,
    agent: &str,
    session: &str,
) -> Result<ChainKey, ApiError> {
    let agent = state.store.agent(&caller.0.id, agent).await?;
    Ok((TenantId(caller.0.cache_salt), session_key(&agent, session)))
}

/// Writes the session's cache to the shadow now.
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "What was written", body = CacheOpResponse),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 503, description = "No model, the shadow is off, or its object store cannot be reached", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/cache/save")]
pub async fn save(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let key = key_of(&state, &caller, &agent, &session).await?;
    let engine = state.engine()?;
    let r = state.shadow()?.flush(engine, Some(key)).await?;
    let (blocks, tokens) = engine
        .shadow_collect(CollectRequest {
            only: Some(key),
            ..CollectRequest::default()
        })?
        .answer()
        .await??
        .first()
        .map_or((0, 0), |c| {
            (
                c.blocks.len(),
                c.blocks.iter().map(|b| b.tokens.len()).sum(),
            )
        });
    Ok(HttpResponse::Ok().json(CacheOpResponse {
        blocks,
        moved: r.blocks,
        bytes: r.bytes,
        tokens,
        ms: r.ms,
    }))
}

/// Loads the session's shadowed cache into the cold tier (its next turn warms it).
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "What was loaded", body = CacheOpResponse),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent, or nothing shadowed", body = crate::error::ErrorSchema),
        (status = 422, description = "The shadowed cache is damaged", body = crate::error::ErrorSchema),
        (status = 503, description = "No model, the shadow is off, or its object store cannot be reached", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/cache/load")]
pub async fn load(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let key = key_of(&state, &caller, &agent, &session).await?;
    let engine = state.engine()?;
    let started = Instant::now();
    let (manifest, blocks) = state
        .shadow()?
        .read_session(engine.kv_format(), key)
        .await?;
    let n = blocks.len();
    let report = engine_restore(
        engine,
        RestoreChain {
            tenant: key.0,
            session: Some(key.1),
            stable_blocks: manifest.stable_blocks,
            pin_key: manifest.pin_key,
            public_pin_key: manifest.public_pin_key,
            blocks,
        },
    )
    .await?;
    Ok(HttpResponse::Ok().json(CacheOpResponse {
        blocks: n,
        moved: report.loaded,
        bytes: 0,
        tokens: report.tokens,
        ms: started.elapsed().as_secs_f64() * 1e3,
    }))
}

/// The session's blocks: resident ones from memory, the rest from the shadow, up to the first
/// block found nowhere.
async fn session_blocks(state: &AppState, key: ChainKey) -> Result<(usize, ChainBlocks), ApiError> {
    let engine = state.engine()?;
    let chains = engine
        .shadow_collect(CollectRequest {
            only: Some(key),
            ..CollectRequest::default()
        })?
        .answer()
        .await??;
    let from_shadow = match &state.shadow {
        Some(s) => match s.read_session(engine.kv_format(), key).await {
            Ok((m, blocks)) => Some((m.stable_blocks, blocks)),
            Err(ShadowError::NotFound) => None,
            Err(e) => return Err(e.into()),
        },
        None => None,
    };
    let Some(chain) = chains.into_iter().next() else {
        return from_shadow.ok_or_else(|| ApiError::not_found("no cache for this session"));
    };
    let shadowed: HashMap<[u8; 32], Vec<u8>> = from_shadow
        .map(|(_, b)| b.into_iter().map(|(b, bytes)| (b.hash.0, bytes)).collect())
        .unwrap_or_default();
    let mut out = Vec::with_capacity(chain.blocks.len());
    for (block, bytes) in chain.blocks.into_iter().zip(chain.bytes) {
        let bytes = match bytes {
            CollectedBytes::New(b) => b,
            _ => match shadowed.get(&block.hash.0) {
                Some(b) => b.clone(),
                None => break,
            },
        };
        out.push((block, bytes));
    }
    if out.is_empty() {
        return Err(ApiError::not_found("no cache for this session"));
    }
    Ok((chain.stable_blocks, out))
}

/// The session's cache as one safetensors file (block bytes in the tiers' layout, the chain
/// and the KV format in its header).
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "A safetensors file", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent, or no cache", body = crate::error::ErrorSchema),
        (status = 503, description = "No model", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/sessions/{session}/cache/export")]
pub async fn export(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let key = key_of(&state, &caller, &agent, &session).await?;
    let (stable, blocks) = session_blocks(&state, key).await?;
    let bytes = export_file(state.engine()?.kv_format(), stable, &blocks)?;
    Ok(HttpResponse::Ok()
        .content_type("application/octet-stream")
        .insert_header((
            "Content-Disposition",
            format!("attachment; filename=\"{session}.safetensors\""),
        ))
        .body(bytes))
}

/// Loads an exported session file into this session's cache (cold tier and shadow). The
/// chain is re-hashed for the caller's tenant; the model and KV format must match.
#[utoipa::path(
    tag = "sessions",
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 200, description = "What was loaded", body = CacheOpResponse),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 413, description = "Over 1 GiB", body = crate::error::ErrorSchema),
        (status = 422, description = "Not an exported session of this model and KV format", body = crate::error::ErrorSchema),
        (status = 503, description = "No model", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/cache/import")]
pub async fn import(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    mut body: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let key = key_of(&state, &caller, &agent, &session).await?;
    let engine = state.engine()?;
    let started = Instant::now();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| ApiError::invalid(format!("body: {e}")))?;
        if bytes.len() + chunk.len() > IMPORT_LIMIT {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "an imported cache may be at most 1 GiB",
            ));
        }
        bytes.extend_from_slice(&chunk);
    }
    let kv = engine.kv_format().clone();
    let tenant = key.0;
    let (stable_blocks, blocks) = web::block(move || import_file(&kv, tenant, &bytes))
        .await
        .map_err(ApiError::internal)??;
    let n = blocks.len();
    let report = engine_restore(
        engine,
        RestoreChain {
            tenant: key.0,
            session: Some(key.1),
            stable_blocks,
            pin_key: None,
            public_pin_key: None,
            blocks,
        },
    )
    .await?;
    if let Some(shadow) = &state.shadow {
        shadow.flush(engine, Some(key)).await?;
    }
    Ok(HttpResponse::Ok().json(CacheOpResponse {
        blocks: n,
        moved: report.loaded,
        bytes: 0,
        tokens: report.tokens,
        ms: started.elapsed().as_secs_f64() * 1e3,
    }))
}

/// The shadow's status: last write, bytes, entries, failures, and what the recovery at start
/// did for each entry.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "Shadow status", body = crate::shadow::ShadowStatus),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 503, description = "The shadow is off", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/shadow")]
pub async fn admin_shadow(
    _: AdminCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(state.shadow()?.status()))
}

/// Writes every changed session to the shadow now.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "What the flush wrote", body = crate::shadow::FlushReport),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 503, description = "The shadow is off", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/admin/shadow/flush")]
pub async fn admin_flush(
    _: AdminCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let r = state.shadow()?.flush(state.engine()?, None).await?;
    Ok(HttpResponse::Ok().json(r))
}

/// The tier bridge: its policy now, totals, and the last cycles (observation, suggestion,
/// actions).
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "`{policy, totals, cycles}`", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/tiers")]
pub async fn admin_tiers(
    _: AdminCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let t = &state.tiers;
    let policy = t.policy.lock().map(|p| p.clone()).unwrap_or_default();
    let totals = t.totals.lock().map(|t| *t).unwrap_or_default();
    let cycles: Vec<_> = t
        .history
        .lock()
        .map(|h| h.iter().cloned().collect())
        .unwrap_or_default();
    Ok(HttpResponse::Ok().json(json!({
        "enabled": state.config.tiers.enabled,
        "interval_ms": state.config.tiers.interval_ms,
        "policy": policy,
        "totals": {"cycles": totals[0], "spilled": totals[1], "warmed": totals[2], "removed": totals[3]},
        "cycles": cycles,
    })))
}

/// Runs one tier-bridge cycle now and answers its report.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "The cycle's report", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 503, description = "No model", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/admin/tiers/cycle")]
pub async fn admin_tier_cycle(
    _: AdminCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let window = std::time::Duration::from_secs(state.config.tiers.active_window_secs);
    let report = crate::tier_cycle(&state, window).await?;
    Ok(HttpResponse::Ok().json(report))
}
