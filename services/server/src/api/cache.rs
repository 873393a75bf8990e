//! A session's persisted cache (save, load, export, import), and the operator's view of the
//! shadow and the tier bridge.

use std::collections::HashMap;
use std::time::Instant;

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, get, post, web};
use engram_engine::{ChainKey, CollectRequest, CollectedBytes, RestoreChain};
use engram_kvcore::TenantId;
use engram_shadow::{
    AgentExportWriter, ChainBlocks, ShadowError, engine_restore, export_file, import_file,
    open_agent_import,
};
use futures_util::StreamExt;
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::{AdminCaller, ReadCaller, TenantCaller};
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{Answer, TurnError, build_context, check_name, pin_key, session_key};

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
    crate::turn::check_name("session", session)?;
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
            make_room: true,
            tenant: key.0,
            session: Some(key.1),
            stable_blocks: manifest.stable_blocks,
            pin_key: manifest.pin_key,
            public_pin_key: manifest.public_pin_key,
            cold_quota: usize::try_from(caller.0.quotas.cold_blocks).ok(),
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

/// What an eviction did.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EvictResponse {
    /// Blocks the flush before the eviction wrote to the shadow (0 with the shadow off).
    pub saved: usize,
    /// The session's blocks dropped from the hot and cold tiers.
    pub dropped: usize,
    /// Its pinned blocks (the stable prefix, shared with the agent's other sessions), kept.
    pub pinned: usize,
    /// Its blocks a running turn attends, kept.
    pub busy: usize,
    /// Wall time, ms.
    pub ms: f64,
}

/// Moves the session's cache out of memory: written to the shadow first (when it is on), then
/// the session's own blocks are dropped from the hot and cold tiers (pinned stable-prefix
/// blocks stay). Its next turn reads the blocks back from the shadow on the miss (counted as
/// `disk_hit` in `/metrics`) instead of recomputing them; with the shadow off it recomputes.
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "What was saved and dropped", body = EvictResponse),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 503, description = "No model, or the shadow's object store cannot be reached", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/cache/evict")]
pub async fn evict(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let key = key_of(&state, &caller, &agent, &session).await?;
    let engine = state.engine()?;
    let started = Instant::now();
    // Saved first: a block the shadow does not hold is never dropped by an eviction that
    // could have kept it on disk (a failed flush fails the eviction, nothing dropped).
    let saved = match &state.shadow {
        Some(shadow) => shadow.flush(engine, Some(key)).await?.blocks,
        None => 0,
    };
    let r = engine.evict_session(key)?.answer().await??;
    Ok(HttpResponse::Ok().json(EvictResponse {
        saved,
        dropped: r.dropped,
        pinned: r.pinned,
        busy: r.busy,
        ms: started.elapsed().as_secs_f64() * 1e3,
    }))
}

/// What archiving a session did.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ArchiveResponse {
    /// Whether the shadow held the session (an entry archived, a marker written).
    pub archived: bool,
    /// Blocks of the session's entry whose KV bytes were deleted (their hashes kept).
    pub blocks: usize,
    /// Tokens those blocks covered.
    pub tokens: usize,
    /// Bytes of the entry's segments deleted.
    pub entry_bytes: u64,
    /// Bytes of the marker kept in their place.
    pub marker_bytes: u64,
    /// The session's blocks dropped from the hot and cold tiers.
    pub dropped: usize,
    /// Wall time, ms.
    pub ms: f64,
}

/// Moves a session to the tokens-only archive (see [`archive`]); the shadow must be on.
pub async fn archive_session(
    state: &AppState,
    key: ChainKey,
    flush_first: bool,
) -> Result<ArchiveResponse, ApiError> {
    let started = Instant::now();
    let shadow = state.shadow()?;
    let engine = state.engine()?;
    if flush_first {
        shadow.flush(engine, Some(key)).await?;
    }
    // Memory first: once the engine holds neither its blocks nor its chain, no flush writes
    // the session again.
    let dropped = engine.archive_session(key)?.answer().await??.dropped;
    let archived = shadow.archive(key).await?;
    if archived.is_some() {
        state.metrics.count_archive(false);
    }
    let (blocks, tokens, entry_bytes, marker_bytes) =
        archived.as_ref().map_or((0, 0, 0, 0), |(m, size)| {
            (m.hashes.len(), m.tokens, m.entry_bytes, *size)
        });
    Ok(ArchiveResponse {
        archived: archived.is_some(),
        blocks,
        tokens,
        entry_bytes,
        marker_bytes,
        dropped,
        ms: started.elapsed().as_secs_f64() * 1e3,
    })
}

/// Moves the session to the tokens-only archive: written to the shadow first, then its KV
/// leaves memory (hot and cold tiers, and its chain record) and disk (its shadow entry); a
/// marker keeps its chain (block hashes and token count). Its next turn replays it from the
/// turn log (the thaw) and answers as a session that was never archived. What the shadow's
/// byte budget (`shadow.budget_mib`) does to the least recently written sessions, on demand.
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "What was archived", body = ArchiveResponse),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 503, description = "No model, the shadow is off, or its object store cannot be reached", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/cache/archive")]
pub async fn archive(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let key = key_of(&state, &caller, &agent, &session).await?;
    Ok(HttpResponse::Ok().json(archive_session(&state, key, true).await?))
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
/// chain is re-hashed for the caller's tenant (never public, whatever the file says); its
/// stable blocks are pinned under the caller's own prefix key; the model and KV format must
/// match. The body streams to a temporary file (at most `server.import_limit_mib`); one import
/// per tenant runs at a time.
#[utoipa::path(
    tag = "sessions",
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 200, description = "What was loaded", body = CacheOpResponse),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 413, description = "Over `server.import_limit_mib` (256 MiB by default)", body = crate::error::ErrorSchema),
        (status = 422, description = "Not an exported session of this model and KV format", body = crate::error::ErrorSchema),
        (status = 429, description = "Another import of this tenant is running", body = crate::error::ErrorSchema),
        (status = 503, description = "No model", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/cache/import")]
pub async fn import(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    req: actix_web::HttpRequest,
    body: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let (agent_name, session) = path.into_inner();
    check_name("session", &session)?;
    let agent = state.store.agent(&caller.0.id, &agent_name).await?;
    let key = (TenantId(caller.0.cache_salt), session_key(&agent, &session));
    let engine = state.engine()?;
    let started = Instant::now();
    let (_slot, file) = receive(&state, &caller, &req, body).await?;
    // An imported session is a session: it counts against the quota like one a turn made.
    room_for(&state, &caller, &agent, std::slice::from_ref(&session)).await?;
    // Pins go under the caller's own key for the agent's stable prefix as it is now, so the
    // agent's next layer edit releases them like any pin its turns made.
    let built = build_context(&state, &agent, None, ".").await?;
    let pin_key = pin_key(&caller.0, &built);
    let kv = engine.kv_format().clone();
    let tenant = key.0;
    let context = engine.model_config().context_length;
    let (stable_blocks, blocks) = web::block(move || {
        let (file, len) = rewound(file)?;
        import_file(&kv, tenant, file, len, context)
    })
    .await
    .map_err(ApiError::internal)??;
    let n = blocks.len();
    let report = engine_restore(
        engine,
        RestoreChain {
            make_room: true,
            tenant: key.0,
            session: Some(key.1),
            stable_blocks,
            pin_key: Some(engram_engine::Hex32(pin_key)),
            public_pin_key: None,
            cold_quota: usize::try_from(caller.0.quotas.cold_blocks).ok(),
            blocks,
        },
    )
    .await?;
    state
        .store
        .ensure_session(&caller.0.id, &agent.id, &session)
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

/// What an agent import did.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AgentImportResponse {
    /// Sessions in the file, each loaded under its name.
    pub sessions: usize,
    /// Blocks of all the sessions' chains.
    pub blocks: usize,
    /// Blocks loaded into the cold tier.
    pub moved: usize,
    /// Tokens the loaded chains cover.
    pub tokens: usize,
    /// Wall time, ms.
    pub ms: f64,
}

/// Every cached session of the agent as one safetensors file: each distinct block once (the
/// sessions share their stable prefix), each session's chain as rows of the file, with the
/// sessions' names and the KV format in its header. A session is taken as its per-session
/// export is (resident blocks, the rest from the shadow); sessions with no cache are left out.
/// The file is built through a temporary file a session at a time and streamed, so an export
/// takes the memory of one session whatever the agent holds; one agent export per tenant runs
/// at a time.
#[utoipa::path(
    tag = "agents",
    responses(
        (status = 200, description = "A safetensors file", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent, or no session of it has a cache", body = crate::error::ErrorSchema),
        (status = 429, description = "Another agent export of this tenant is running", body = crate::error::ErrorSchema),
        (status = 503, description = "No model", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/cache/export")]
pub async fn export_agent(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let agent = state.store.agent(&caller.0.id, &path.into_inner()).await?;
    let engine = state.engine()?;
    let slot = state.exports.begin(&caller.0.id).ok_or_else(|| {
        ApiError::rate_limited("another agent export of this tenant is running", 1)
    })?;
    // A session at a time: its blocks are read, the new ones spooled to a temporary file, and
    // dropped before the next session is read.
    let spool = web::block(tempfile::tempfile)
        .await
        .map_err(ApiError::internal)?
        .map_err(|e| ApiError::internal(format!("export: temporary file: {e}")))?;
    let mut writer = AgentExportWriter::new(engine.kv_format(), spool);
    for name in state.store.sessions(&agent.id).await? {
        let key = (TenantId(caller.0.cache_salt), session_key(&agent, &name));
        match session_blocks(&state, key).await {
            Ok((stable, blocks)) => {
                writer = web::block(move || {
                    writer.add_session(name, stable, &blocks)?;
                    Ok::<_, ShadowError>(writer)
                })
                .await
                .map_err(ApiError::internal)??;
            }
            Err(e) if e.status == StatusCode::NOT_FOUND => {}
            Err(e) => return Err(e),
        }
    }
    if writer.sessions() == 0 {
        return Err(ApiError::not_found("no session of this agent has a cache"));
    }
    let file = web::block(move || writer.finish())
        .await
        .map_err(ApiError::internal)??;
    let len = file.len();
    Ok(HttpResponse::Ok()
        .content_type("application/octet-stream")
        .insert_header((
            "Content-Disposition",
            format!("attachment; filename=\"{}.safetensors\"", agent.name),
        ))
        .no_chunking(len)
        .streaming(stream_reader(file, slot)))
}

/// Loads an exported agent file into this agent's sessions (cold tier and shadow), each under
/// its name, with the per-session import's checks: model and KV format, every block's CRC,
/// every chain re-hashed for the caller's tenant (never public), stable blocks pinned under
/// the caller's own prefix key, the tenant's cold quota. Nothing is loaded unless the whole
/// file checks. The body streams to a temporary file (at most `server.import_limit_mib`); one
/// import per tenant runs at a time.
#[utoipa::path(
    tag = "agents",
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 200, description = "What was loaded", body = AgentImportResponse),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 413, description = "Over `server.import_limit_mib` (256 MiB by default)", body = crate::error::ErrorSchema),
        (status = 422, description = "Not an exported agent of this model and KV format", body = crate::error::ErrorSchema),
        (status = 429, description = "Another import of this tenant is running", body = crate::error::ErrorSchema),
        (status = 503, description = "No model", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/cache/import")]
pub async fn import_agent(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
    req: actix_web::HttpRequest,
    body: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let agent = state.store.agent(&caller.0.id, &path.into_inner()).await?;
    let engine = state.engine()?;
    let started = Instant::now();
    let (_slot, file) = receive(&state, &caller, &req, body).await?;
    let built = build_context(&state, &agent, None, ".").await?;
    let pin_key = pin_key(&caller.0, &built);
    let kv = engine.kv_format().clone();
    let tenant = TenantId(caller.0.cache_salt);
    let context = engine.model_config().context_length;
    // Every block's CRC is checked, a block at a time, before anything is loaded; then each
    // session is read from the spool and loaded in turn (the memory of one session).
    let mut opened = web::block(move || {
        let (file, len) = rewound(file)?;
        open_agent_import(&kv, file, len, context, |n| {
            check_name("session", n).is_ok()
        })
    })
    .await
    .map_err(ApiError::internal)??;
    let names = opened.names();
    room_for(&state, &caller, &agent, &names).await?;
    let mut out = AgentImportResponse {
        sessions: names.len(),
        blocks: 0,
        moved: 0,
        tokens: 0,
        ms: 0.0,
    };
    for i in 0..names.len() {
        let kv = engine.kv_format().clone();
        let (file, session) = web::block(move || {
            let s = opened.session(&kv, tenant, i);
            (opened, s)
        })
        .await
        .map_err(ApiError::internal)?;
        opened = file;
        let (name, stable_blocks, blocks) = session?;
        let key = (tenant, session_key(&agent, &name));
        out.blocks += blocks.len();
        let report = engine_restore(
            engine,
            RestoreChain {
                make_room: true,
                tenant,
                session: Some(key.1),
                stable_blocks,
                pin_key: Some(engram_engine::Hex32(pin_key)),
                public_pin_key: None,
                cold_quota: usize::try_from(caller.0.quotas.cold_blocks).ok(),
                blocks,
            },
        )
        .await?;
        out.moved += report.loaded;
        out.tokens += report.tokens;
        state
            .store
            .ensure_session(&caller.0.id, &agent.id, &name)
            .await?;
        if let Some(shadow) = &state.shadow {
            shadow.flush(engine, Some(key)).await?;
        }
    }
    out.ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(HttpResponse::Ok().json(out))
}

/// [`TurnError::SessionQuota`] unless the tenant's session quota has room for those of `names`
/// the agent does not have yet (nothing is loaded then).
async fn room_for(
    state: &AppState,
    caller: &TenantCaller,
    agent: &engram_store::Agent,
    names: &[String],
) -> Result<(), ApiError> {
    let mut new = 0u64;
    for n in names {
        if !state.store.session_exists(&agent.id, n).await? {
            new += 1;
        }
    }
    let limit = caller.0.quotas.sessions;
    if new > 0 && state.store.session_count(&caller.0.id).await? + new > limit {
        return Err(TurnError::SessionQuota { limit }.into());
    }
    Ok(())
}

/// An import's body: refused over `server.import_limit_mib` (declared or streamed) and while
/// another import of the tenant runs (the slot is held until it drops), else spooled to a
/// temporary file.
async fn receive(
    state: &AppState,
    caller: &TenantCaller,
    req: &actix_web::HttpRequest,
    body: web::Payload,
) -> Result<(crate::state::ImportSlot, std::fs::File), ApiError> {
    let limit = state.config.server.import_limit_mib << 20;
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!(
                "an imported cache may be at most {} MiB",
                state.config.server.import_limit_mib
            ),
        )
    };
    let declared = req
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large());
    }
    let slot = state.imports.begin(&caller.0.id).ok_or_else(|| {
        ApiError::rate_limited("another cache import of this tenant is running", 1)
    })?;
    let file = spool(body, limit).await?.ok_or_else(too_large)?;
    Ok((slot, file))
}

/// Streams a request body into an anonymous temporary file (deleted when dropped); `None` when
/// it grows past `limit` bytes.
async fn spool(mut body: web::Payload, limit: u64) -> Result<Option<std::fs::File>, ApiError> {
    use tokio::io::AsyncWriteExt;
    let file = web::block(tempfile::tempfile)
        .await
        .map_err(ApiError::internal)?
        .map_err(|e| ApiError::internal(format!("import: temporary file: {e}")))?;
    let mut out = tokio::fs::File::from_std(file);
    let mut written = 0u64;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| ApiError::invalid(format!("body: {e}")))?;
        written += chunk.len() as u64;
        if written > limit {
            return Ok(None);
        }
        out.write_all(&chunk)
            .await
            .map_err(|e| ApiError::internal(format!("import: temporary file: {e}")))?;
    }
    out.flush()
        .await
        .map_err(|e| ApiError::internal(format!("import: temporary file: {e}")))?;
    Ok(Some(out.into_std().await))
}

/// A spooled body from its start, and its length.
fn rewound(mut file: std::fs::File) -> Result<(std::fs::File, u64), ShadowError> {
    use std::io::Seek;
    let io = |source| ShadowError::Io {
        path: "import spool".into(),
        source,
    };
    let len = file.seek(std::io::SeekFrom::End(0)).map_err(io)?;
    file.rewind().map_err(io)?;
    Ok((file, len))
}

/// Chunks a response streams at most at once (each is at most this many bytes).
const STREAM_CHUNKS: usize = 4;
const CHUNK_BYTES: usize = 256 * 1024;

/// `reader`'s bytes as a response body, read on a blocking thread [`STREAM_CHUNKS`] chunks
/// ahead of the client at most (constant memory, whatever the size), holding `slot` until the
/// last chunk is sent or the client goes.
fn stream_reader<R: std::io::Read + Send + 'static>(
    mut reader: R,
    slot: crate::state::ImportSlot,
) -> impl futures_util::Stream<Item = Result<web::Bytes, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<web::Bytes, std::io::Error>>(STREAM_CHUNKS);
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        loop {
            let mut buf = vec![0u8; CHUNK_BYTES];
            let mut filled = 0;
            let mut failed = None;
            while filled < buf.len() {
                match reader.read(&mut buf[filled..]) {
                    Ok(0) => break,
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            if let Some(e) = failed {
                let _ = tx.blocking_send(Err(e));
                return;
            }
            if filled == 0 {
                return;
            }
            buf.truncate(filled);
            // The client went away: stop reading.
            if tx.blocking_send(Ok(web::Bytes::from(buf))).is_err() {
                return;
            }
        }
    });
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) })
}

/// The shadow's status: last write, bytes, entries, failures, and what the recovery at start
/// did for each entry.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "Shadow status", body = engram_shadow::ShadowStatus),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 503, description = "The shadow is off", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/shadow")]
pub async fn admin_shadow(
    _: ReadCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(state.shadow()?.status()))
}

/// Writes every changed session to the shadow now; then, over `shadow.budget_mib`, archives
/// the least recently written sessions no turn used within `tiers.active_window_secs` (as the
/// background flush does).
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "What the flush wrote", body = engram_shadow::FlushReport),
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
    let shadow = state.shadow()?;
    let r = shadow.flush(state.engine()?, None).await?;
    crate::enforce_shadow_budget(&state, shadow, 0).await;
    Ok(HttpResponse::Ok().json(r))
}

/// The tier bridge as the operator sees it.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct TiersView {
    /// Background cycles run (`tiers.enabled`).
    pub enabled: bool,
    /// Their interval, ms.
    pub interval_ms: u64,
    /// The policy the next cycle uses.
    pub policy: engram_engine::TierPolicy,
    /// Since the start.
    pub totals: TierTotals,
    /// The last cycles, oldest first.
    pub cycles: Vec<engram_engine::CycleRecord>,
}

/// The tier bridge's totals since the start.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct TierTotals {
    /// Cycles run.
    pub cycles: u64,
    /// Blocks spilled.
    pub spilled: u64,
    /// Blocks warmed.
    pub warmed: u64,
    /// Blocks removed.
    pub removed: u64,
    /// Blocks staged (copied to the cold tier ahead of their spill, left hot).
    pub staged: u64,
}
/// The tier bridge: its policy now, totals, and the last cycles (observation, suggestion,
/// actions).
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "The policy, the totals and the last cycles", body = TiersView),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/tiers")]
pub async fn admin_tiers(
    _: ReadCaller,
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
    Ok(HttpResponse::Ok().json(TiersView {
        enabled: state.config.tiers.enabled,
        interval_ms: state.config.tiers.interval_ms,
        policy,
        totals: TierTotals {
            cycles: totals[0],
            spilled: totals[1],
            warmed: totals[2],
            removed: totals[3],
            staged: totals[4],
        },
        cycles,
    }))
}

/// Runs one tier-bridge cycle now and answers its report.
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "The cycle's report", body = engram_engine::CycleReport),
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
    let report = engram_engine::tier_cycle(state.engine()?, &state.tiers, window).await?;
    Ok(HttpResponse::Ok().json(report))
}
