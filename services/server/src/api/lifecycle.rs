//! Deleting what a tenant stored: a session, an agent, a whole tenant (admin).
//!
//! A delete reaches every place the data lives, in an order that lets nothing come back: the
//! engine first (its cached blocks in every tier, their pins, the sessions' chain records, the
//! tenant's ready reservations), then the shadow (the sessions' entries on disk or in the
//! object store, and prefix entries no session names any more: a restart recovers nothing of
//! them), then the database (turn log, working memory, layers, memory nodes and edges, keys, in
//! one transaction), then the memory graph and its vector index, and the texts cached from them
//! (token ids of the prompts only they used, the embeddings of their messages, the read
//! counts their dropped blocks left behind). Each step is idempotent, so a
//! delete that failed half-way can be repeated. Public blocks belong to no tenant and stay; a
//! public prefix the deleted agents used is released (its pins go when no other tenant uses it).

use actix_web::{HttpResponse, delete, web};
use engram_kvcore::TenantId;
use engram_store::{Agent, Tenant};
use serde::Serialize;
use utoipa::ToSchema;

use crate::auth::{AdminCaller, TenantCaller};
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{AGENT_MASK, Answer, agent_bits, build_context, pin_key, session_key, unpin};

/// What a delete removed.
#[derive(Debug, Clone, Copy, Default, Serialize, ToSchema)]
pub struct Deleted {
    /// Cached KV blocks dropped (hot and cold tiers).
    pub blocks: usize,
    /// Shadow entries deleted.
    pub shadow_entries: usize,
    /// Memory nodes deleted (their edges and vectors with them).
    pub memory_nodes: usize,
}

/// Forgets cached sessions of `tenant` matching `session & mask == value` in the engine, then
/// in the shadow.
async fn forget_cache(
    state: &AppState,
    tenant: &Tenant,
    mask: u64,
    value: u64,
) -> Result<Deleted, ApiError> {
    let mut out = Deleted::default();
    let salt = TenantId(tenant.cache_salt);
    if let Some(engine) = &state.engine
        && engine.is_alive()
    {
        out.blocks = engine.forget(salt, mask, value)?.answer().await??.blocks;
    }
    if let Some(shadow) = &state.shadow {
        out.shadow_entries = shadow.forget(salt, mask, value).await?;
    }
    state.tiers.forget(|k| k.0 == salt && k.1.0 & mask == value);
    state.tokens.forget(salt, mask, value);
    Ok(out)
}

/// Releases an agent's use of its stable (and public) prefix pins.
async fn release_prefix(state: &AppState, tenant: &Tenant, agent: &Agent) -> Result<(), ApiError> {
    if state.engine_ready() {
        let built = build_context(state, agent, None, ".").await?;
        unpin(state, Some(pin_key(tenant, &built))).await?;
    }
    Ok(())
}

/// Deletes a session: its turn log, working memory, cached KV (every tier), shadow entry, and
/// its episodic memory nodes with their edges and vectors.
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "What was deleted", body = Deleted),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent or session", body = crate::error::ErrorSchema),
        (status = 429, description = "Over the tenant's request rate", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[delete("/v1/agents/{agent}/sessions/{session}")]
pub async fn delete_session(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    crate::turn::check_name("session", &session)?;
    let tenant = caller.0;
    let agent = state.store.agent(&tenant.id, &agent).await?;
    let key = session_key(&agent, &session).0;
    let _deleting = state
        .deletions
        .begin(TenantId(tenant.cache_salt), u64::MAX, key)
        .await;
    let mut out = forget_cache(&state, &tenant, u64::MAX, key).await?;
    state.prefetched.forget(TenantId(tenant.cache_salt), key);
    let nodes = state.store.delete_session(&agent.id, &session).await?;
    out.memory_nodes = nodes.len();
    if let Some(memory) = &state.memory {
        memory.forget(&nodes, Some(&agent.id), Some(&session))?;
        // Every text its requests embedded: messages, prefetches, session memory queries.
        memory.forget_queries(&tenant.id, Some(&agent.id), Some(&session));
    }
    Ok(HttpResponse::Ok().json(out))
}

/// Deletes an agent and all it holds: its layers, every session (as a session delete does), its
/// memory graph, and its cached prefix.
#[utoipa::path(
    tag = "agents",
    responses(
        (status = 200, description = "What was deleted", body = Deleted),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 429, description = "Over the tenant's request rate", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[delete("/v1/agents/{agent}")]
pub async fn delete_agent(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let tenant = caller.0;
    let agent = state.store.agent(&tenant.id, &path.into_inner()).await?;
    let out = delete_agent_data(&state, &tenant, &agent).await?;
    Ok(HttpResponse::Ok().json(out))
}

async fn delete_agent_data(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
) -> Result<Deleted, ApiError> {
    let _deleting = state
        .deletions
        .begin(TenantId(tenant.cache_salt), AGENT_MASK, agent_bits(agent))
        .await;
    release_prefix(state, tenant, agent).await?;
    let mut out = forget_cache(state, tenant, AGENT_MASK, agent_bits(agent)).await?;
    let nodes = state.store.delete_agent(&tenant.id, &agent.id).await;
    state.agents.invalidate();
    let nodes = nodes?;
    out.memory_nodes = nodes.len();
    if let Some(memory) = &state.memory {
        memory.forget(&nodes, Some(&agent.id), None)?;
        memory.forget_queries(&tenant.id, Some(&agent.id), None);
    }
    Ok(out)
}

/// Deletes a tenant and everything it holds: its agents (as an agent delete does), every cached
/// block and shadow entry under its salt, and its API keys (they stop working at once).
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "What was deleted", body = Deleted),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown tenant", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[delete("/v1/admin/tenants/{tenant}")]
pub async fn delete_tenant(
    _: AdminCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let tenant = state.store.tenant(&path.into_inner()).await?;
    let _deleting = state
        .deletions
        .begin(TenantId(tenant.cache_salt), 0, 0)
        .await;
    for agent in state.store.agents(&tenant.id).await? {
        release_prefix(&state, &tenant, &agent).await?;
    }
    let mut out = forget_cache(&state, &tenant, 0, 0).await?;
    let nodes = state.store.delete_tenant(&tenant.id).await;
    state.keys.clear();
    state.agents.invalidate();
    let nodes = nodes?;
    out.memory_nodes = nodes.len();
    if let Some(memory) = &state.memory {
        memory.forget(&nodes, None, None)?;
        memory.forget_queries(&tenant.id, None, None);
    }
    Ok(HttpResponse::Ok().json(out))
}
