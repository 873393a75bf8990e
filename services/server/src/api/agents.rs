//! Agents, their layers and the context preview.

use actix_web::{HttpResponse, get, post, put, web};
use engram_context::{Budgets, Layer, LayerKind, TokenCounter, Volatility};
use engram_store::{Agent, LayerRow, MemoryScope};
use serde::Deserialize;

use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{
    Answer, Turn, build_context, check_name, parse_kind, pin_key, public_pin_key, unpin,
};

/// Body of `POST /v1/agents`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewAgent {
    /// Name, unique per tenant (1–64 letters, digits, `-`, `_`).
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub name: String,
    /// Initial layers.
    #[serde(default)]
    pub layers: Vec<LayerInput>,
    /// Whose turns recall what a session brought into the agent's memory: `session` (the
    /// default: only that session's own turns) or `agent` (every session of the agent).
    #[serde(default)]
    pub memory_scope: MemoryScope,
}

/// A layer as written by a client.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LayerInput {
    /// Kind (`axioms`, `identity`, `rules`, …); in a path it comes from the URL.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub kind: Option<LayerKind>,
    /// Text, one fact per line (at most 256 KiB).
    pub content: String,
    /// Token budget (default per kind; at most 65,536).
    pub budget: Option<u64>,
    /// Part of the stable prefix (default: axioms … soul).
    pub stable: Option<bool>,
    /// KV importance, 0..=1.
    pub importance: Option<f64>,
}

const MAX_LAYER_BYTES: usize = 256 * 1024;
const MAX_BUDGET: u64 = 65_536;

async fn store_layer(
    state: &AppState,
    agent: &Agent,
    kind: LayerKind,
    input: &LayerInput,
) -> Result<LayerRow, ApiError> {
    let (budget, stable, importance) = check_layer(kind, input)?;
    let row = state
        .store
        .put_layer(
            &agent.id,
            kind.as_str(),
            &input.content,
            budget,
            stable,
            importance,
        )
        .await;
    state.agents.invalidate();
    Ok(row?)
}

/// A layer's budget, stability and importance, or why the input is refused (nothing stored).
fn check_layer(kind: LayerKind, input: &LayerInput) -> Result<(u64, bool, f64), ApiError> {
    if input.content.len() > MAX_LAYER_BYTES {
        return Err(ApiError::invalid("layer content is over 256 KiB"));
    }
    let budget = input.budget.unwrap_or(Budgets::standard().get(kind) as u64);
    if budget > MAX_BUDGET {
        return Err(ApiError::invalid(format!(
            "budget must be at most {MAX_BUDGET} tokens"
        )));
    }
    let defaults = Layer::new(kind, "");
    let importance = input
        .importance
        .unwrap_or((f64::from(defaults.importance) * 1e3).round() / 1e3);
    if !(0.0..=1.0).contains(&importance) {
        return Err(ApiError::invalid("importance must be within 0..=1"));
    }
    let stable = input
        .stable
        .unwrap_or(defaults.volatility == Volatility::Stable);
    Ok((budget, stable, importance))
}

/// Creates an agent with optional initial layers.
/// A prompt as a turn would build it.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct Preview {
    /// SHA-256 of the stable prefix.
    pub stable_prefix_hash: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Each layer: budget, tokens, spilled lines.
    pub layers: Vec<engram_context::LayerReport>,
    /// Cache segments.
    pub segments: usize,
    /// Which blocks the cache would reuse (null without a model).
    pub blocks: Option<PreviewBlocks>,
    /// Recalled memory node ids in the memories layer (null without the memory graph).
    pub memories: Option<Vec<u64>>,
}

/// The cache's view of a preview's prompt.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PreviewBlocks {
    /// Blocks the hot tier holds.
    pub reused_hot: usize,
    /// Blocks the cold tier holds (warmed on a turn).
    pub reused_cold: usize,
    /// Blocks to compute.
    pub new: usize,
}

/// An agent and its current layers.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AgentView {
    /// The agent.
    pub agent: engram_store::Agent,
    /// Its current layers (the latest version of each kind).
    pub layers: Vec<engram_store::LayerRow>,
}

/// A page of the caller's agents.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AgentList {
    /// Agents, oldest first.
    pub agents: Vec<engram_store::Agent>,
    /// The `cursor` of the next page (null on the last).
    pub next_cursor: Option<String>,
}

/// An agent's current layers.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct LayerList {
    /// Layers.
    pub layers: Vec<engram_store::LayerRow>,
}

#[utoipa::path(
    tag = "agents",
    request_body = NewAgent,
    responses(
        (status = 201, description = "The agent and its layers", body = AgentView),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 409, description = "An agent of that name exists", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents")]
pub async fn create_agent(
    caller: TenantCaller,
    state: web::Data<AppState>,
    body: web::Json<NewAgent>,
) -> Result<HttpResponse, ApiError> {
    check_name("name", &body.name)?;
    let mut kinds = Vec::new();
    for l in &body.layers {
        let kind = l
            .kind
            .ok_or_else(|| ApiError::invalid("every layer needs a `kind`"))?;
        if kinds.contains(&kind) {
            return Err(ApiError::invalid(format!(
                "layer `{}` given twice",
                kind.as_str()
            )));
        }
        check_layer(kind, l)?;
        kinds.push(kind);
    }
    // Every layer is checked before anything is stored: a refused request leaves no agent.
    let agent = state
        .store
        .create_agent(&caller.0.id, &body.name, body.memory_scope)
        .await?;
    let mut layers = Vec::new();
    for (l, kind) in body.layers.iter().zip(kinds) {
        layers.push(store_layer(&state, &agent, kind, l).await?);
    }
    Ok(HttpResponse::Created().json(AgentView { agent, layers }))
}

/// Lists the caller's agents, a page at a time (`limit`, `cursor`).
#[utoipa::path(
    tag = "agents",
    params(crate::pages::ListPage),
    responses(
        (status = 200, description = "A page of the caller's agents", body = AgentList),
        (status = 400, description = "Invalid paging", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents")]
pub async fn list_agents(
    caller: TenantCaller,
    state: web::Data<AppState>,
    page: web::Query<crate::pages::ListPage>,
) -> Result<HttpResponse, ApiError> {
    let (agents, next_cursor) = crate::pages::agents(&state.store, &caller.0.id, &page).await?;
    Ok(HttpResponse::Ok().json(AgentList {
        agents,
        next_cursor,
    }))
}

/// One agent (by id or name) and its current layers.
#[utoipa::path(
    tag = "agents",
    responses(
        (status = 200, description = "The agent and its current layers", body = AgentView),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}")]
pub async fn get_agent(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let agent = state.store.agent(&caller.0.id, &path).await?;
    let layers = state.store.layers(&agent.id).await?;
    Ok(HttpResponse::Ok().json(AgentView { agent, layers }))
}

/// Writes a new version of a layer.
#[utoipa::path(
    tag = "agents",
    request_body = LayerInput,
    responses(
        (status = 200, description = "The new version, with `unpinned_blocks`", body = crate::api::admin::LayerVersion),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[put("/v1/agents/{agent}/layers/{kind}")]
pub async fn put_layer(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    body: web::Json<LayerInput>,
) -> Result<HttpResponse, ApiError> {
    let (agent, kind) = path.into_inner();
    let kind = parse_kind(&kind)?;
    let agent = state.store.agent(&caller.0.id, &agent).await?;
    let before = build_context(&state, &agent, None, ".").await?;
    let row = store_layer(&state, &agent, kind, &body).await?;
    // An edit that changes the stable prefix releases the old prefix's pins.
    let after = build_context(&state, &agent, None, ".").await?;
    // The tenant's prefix key is released: its own pins, and its use of the public prefix it
    // started with (whose pins stay while another tenant still uses it).
    let mut unpinned = 0;
    if before.stable_prefix_hash != after.stable_prefix_hash
        || public_pin_key(&before) != public_pin_key(&after)
    {
        unpinned += unpin(&state, Some(pin_key(&caller.0, &before))).await?;
    }
    Ok(HttpResponse::Ok().json(crate::api::admin::LayerVersion {
        layer: row,
        unpinned_blocks: unpinned,
    }))
}

/// The current version of every layer.
#[utoipa::path(
    tag = "agents",
    responses(
        (status = 200, description = "Current layers", body = LayerList),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/layers")]
pub async fn list_layers(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let agent = state.store.agent(&caller.0.id, &path).await?;
    Ok(HttpResponse::Ok().json(LayerList {
        layers: state.store.layers(&agent.id).await?,
    }))
}

/// Body of the context preview.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PreviewRequest {
    /// The user message the prompt is built for.
    pub message: String,
    /// A session whose conversation is included.
    pub session: Option<String>,
}

/// Previews a prompt build: layers, tokens per layer, spilled lines, the stable prefix hash.
#[utoipa::path(
    tag = "agents",
    request_body = PreviewRequest,
    responses(
        (status = 200, description = "The build: layers, tokens, spilled lines, prefix hash", body = Preview),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/context")]
pub async fn preview_context(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
    body: web::Json<PreviewRequest>,
) -> Result<HttpResponse, ApiError> {
    let session = body.session.as_deref();
    let turn = Turn::open(state.into_inner(), caller.0, &path, session).await?;
    let log = turn.history().await?;
    let turned = turn.context(log, &body.message).await?;
    let built = &turned.built;
    let counter = turn.state.counter();
    let prompt_tokens: usize = built.segments.iter().map(|s| counter.count(&s.text)).sum();
    // With a model: which blocks of this prompt the cache would reuse (hot, or warmed from cold).
    let blocks = match &turn.state.engine {
        Some(engine) => {
            let spec = turn.spec(built, |_| true)?;
            let l = engine.lookup(spec)?.answer().await?;
            Some(PreviewBlocks {
                reused_hot: l.hot,
                reused_cold: l.cold,
                new: l.blocks - l.hot - l.cold,
            })
        }
        None => None,
    };
    Ok(HttpResponse::Ok().json(Preview {
        stable_prefix_hash: built.stable_prefix_hex(),
        prompt_tokens,
        layers: built.layers.clone(),
        segments: built.segments.len(),
        blocks,
        memories: turned.memories.as_ref().map(|m| m.ids()),
    }))
}
