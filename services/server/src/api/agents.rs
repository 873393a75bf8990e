//! Agents, their layers and the context preview.

use actix_web::{HttpResponse, get, post, put, web};
use engram_context::{
    Budgets, BuiltContext, ContextRequest, Layer, LayerKind, Speaker, TokenCounter, Turn,
    Volatility, build,
};
use engram_store::{Agent, LayerRow, Role, Tenant};
use serde::Deserialize;
use serde_json::json;

use crate::api::Answer;
use crate::api::admin::check_name;
use crate::api::turns::{pin_key, public_pin_key, session_key, spec_of};
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::memory::{Neighbourhood, RecallQuery, now_ms, render};
use crate::state::AppState;

/// Body of `POST /v1/agents`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewAgent {
    /// Name, unique per tenant.
    pub name: String,
    /// Initial layers.
    #[serde(default)]
    pub layers: Vec<LayerInput>,
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

pub(crate) fn kind_name(kind: LayerKind) -> String {
    serde_json::to_value(kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

pub(crate) fn parse_kind(s: &str) -> Result<LayerKind, ApiError> {
    serde_json::from_value(json!(s)).map_err(|_| {
        ApiError::invalid(format!(
            "unknown layer kind `{s}` (axioms, identity, rules, capabilities, soul, partner, \
             neurons, memories, system_state, current_time, affect, awareness)"
        ))
    })
}

async fn store_layer(
    state: &AppState,
    agent: &Agent,
    kind: LayerKind,
    input: &LayerInput,
) -> Result<LayerRow, ApiError> {
    let (budget, stable, importance) = check_layer(kind, input)?;
    Ok(state
        .store
        .put_layer(
            &agent.id,
            &kind_name(kind),
            &input.content,
            budget,
            stable,
            importance,
        )
        .await?)
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
#[utoipa::path(
    tag = "agents",
    request_body = NewAgent,
    responses(
        (status = 201, description = "The agent and its layers", body = serde_json::Value),
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
                kind_name(kind)
            )));
        }
        check_layer(kind, l)?;
        kinds.push(kind);
    }
    // Every layer is checked before anything is stored: a refused request leaves no agent.
    let agent = state.store.create_agent(&caller.0.id, &body.name).await?;
    let mut layers = Vec::new();
    for (l, kind) in body.layers.iter().zip(kinds) {
        layers.push(store_layer(&state, &agent, kind, l).await?);
    }
    Ok(HttpResponse::Created().json(json!({"agent": agent, "layers": layers})))
}

/// Lists the caller's agents.
#[utoipa::path(
    tag = "agents",
    responses(
        (status = 200, description = "The caller's agents", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents")]
pub async fn list_agents(
    caller: TenantCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(json!({"agents": state.store.agents(&caller.0.id).await?})))
}

/// One agent (by id or name) and its current layers.
#[utoipa::path(
    tag = "agents",
    responses(
        (status = 200, description = "The agent and its current layers", body = serde_json::Value),
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
    Ok(HttpResponse::Ok().json(json!({"agent": agent, "layers": layers})))
}

/// Writes a new version of a layer.
#[utoipa::path(
    tag = "agents",
    request_body = LayerInput,
    responses(
        (status = 200, description = "The new version, with `unpinned_blocks`", body = serde_json::Value),
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
    let mut v = json!(row);
    v["unpinned_blocks"] = json!(unpinned);
    Ok(HttpResponse::Ok().json(v))
}

/// Releases the pins filed under `key` (nothing without a model or a key); returns how many.
pub(crate) async fn unpin(state: &AppState, key: Option<[u8; 32]>) -> Result<usize, ApiError> {
    let (Some(engine), Some(key)) = (&state.engine, key) else {
        return Ok(0);
    };
    engine
        .unpin_prefix(key)?
        .answer()
        .await?
        .map_err(ApiError::from)
}

/// The current version of every layer.
#[utoipa::path(
    tag = "agents",
    responses(
        (status = 200, description = "Current layers", body = serde_json::Value),
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
    Ok(HttpResponse::Ok().json(json!({"layers": state.store.layers(&agent.id).await?})))
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

/// The agent's layers as the pipeline sees them; a recalled neighbourhood is appended to the
/// memories layer (which is created with its standard budget when the agent has none).
pub(crate) fn pipeline_layers(
    rows: &[LayerRow],
    memories: Option<&Neighbourhood>,
) -> Result<Vec<Layer>, ApiError> {
    let mut layers = rows
        .iter()
        .map(|r| {
            let kind = parse_kind(&r.kind).map_err(|_| ApiError::internal("stored layer kind"))?;
            Ok(Layer {
                kind,
                content: r.content.clone(),
                budget: r.budget as usize,
                volatility: if r.stable {
                    Volatility::Stable
                } else {
                    match kind.default_volatility() {
                        Volatility::Stable => Volatility::Slow,
                        v => v,
                    }
                },
                importance: r.importance as f32,
                public: r.public && r.stable,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    if let Some(m) = memories.filter(|m| !m.text.is_empty()) {
        match layers.iter_mut().find(|l| l.kind == LayerKind::Memories) {
            Some(l) if l.content.trim().is_empty() => l.content = m.text.clone(),
            Some(l) => l.content = format!("{}\n{}", l.content.trim_end(), m.text),
            None => layers.push(Layer::new(LayerKind::Memories, m.text.clone())),
        }
    }
    Ok(layers)
}

/// A session's conversation so far.
pub(crate) async fn history_of(
    state: &AppState,
    agent: &Agent,
    session: &str,
) -> Result<Vec<Turn>, ApiError> {
    Ok(state
        .store
        .turns(&agent.id, session)
        .await?
        .into_iter()
        .map(|t| Turn {
            speaker: match t.role {
                Role::User => Speaker::User,
                Role::Assistant => Speaker::Assistant,
            },
            text: t.text,
        })
        .collect())
}

/// Builds an agent's prompt for `message` (and the session's conversation), without recalled
/// memories: what the stable prefix and layer edits are judged on.
pub(crate) async fn build_context(
    state: &AppState,
    agent: &Agent,
    session: Option<&str>,
    message: &str,
) -> Result<BuiltContext, ApiError> {
    let history = match session {
        Some(s) => history_of(state, agent, s).await?,
        None => Vec::new(),
    };
    build_with_history(state, agent, &history, message, None).await
}

/// Builds an agent's prompt over a conversation the caller supplies, with `memories` in the
/// memories layer.
pub(crate) async fn build_with_history(
    state: &AppState,
    agent: &Agent,
    history: &[Turn],
    message: &str,
    memories: Option<&Neighbourhood>,
) -> Result<BuiltContext, ApiError> {
    let layers = pipeline_layers(&state.store.layers(&agent.id).await?, memories)?;
    let req = ContextRequest {
        layers: &layers,
        history,
        user_message: message,
    };
    Ok(build(&req, &state.counter())?)
}

/// A turn's prompt and the neighbourhood recalled into it.
#[derive(Debug, Clone)]
pub(crate) struct Turned {
    /// The prompt.
    pub built: BuiltContext,
    /// The recalled memories (none without the memory service or when nothing was recalled).
    pub memories: Option<Neighbourhood>,
    /// When the turn began (before its history was read): a delete of its session after this
    /// keeps the turn from being recorded.
    pub started: std::time::Instant,
}

/// Tokens the memories layer leaves for recalled nodes: its budget less its own text.
fn recall_budget(state: &AppState, rows: &[LayerRow]) -> u32 {
    let (budget, own) = match rows.iter().find(|r| r.kind == "memories") {
        Some(r) => (r.budget as usize, state.counter().count(&r.content)),
        None => (Budgets::standard().get(LayerKind::Memories), 0),
    };
    u32::try_from(budget.saturating_sub(own + 4)).unwrap_or(u32::MAX)
}

/// The neighbourhood the memories layer shows for `text`: recalled for the agent (without the
/// session's own episodes), fitted to the layer's budget, in canonical order.
pub(crate) async fn neighbourhood(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
    session: Option<&str>,
    text: &str,
) -> Result<Option<Neighbourhood>, ApiError> {
    let Some(memory) = &state.memory else {
        return Ok(None);
    };
    let rows = state.store.layers(&agent.id).await?;
    let cfg = memory.config();
    let recalled = memory
        .recall(&RecallQuery {
            tenant: &tenant.id,
            agent: &agent.id,
            text,
            k: cfg.recall_k,
            hops: cfg.hops,
            kinds: None,
            exclude_session: session,
            at_ms: now_ms(),
        })
        .await?;
    let n = render(recalled, recall_budget(state, &rows));
    Ok((!n.nodes.is_empty()).then_some(n))
}

/// Builds a turn's prompt: the conversation (the session's, or `history` when given), the
/// neighbourhood recalled for the user's message, and the message.
pub(crate) async fn turn_context(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
    session: Option<&str>,
    history: Option<&[Turn]>,
    message: &str,
) -> Result<Turned, ApiError> {
    let started = std::time::Instant::now();
    let memories = neighbourhood(state, tenant, agent, session, message).await?;
    let owned;
    let history = match (history, session) {
        (Some(h), _) => h,
        (None, Some(s)) => {
            owned = history_of(state, agent, s).await?;
            &owned
        }
        (None, None) => &[],
    };
    let built = build_with_history(state, agent, history, message, memories.as_ref()).await?;
    Ok(Turned {
        built,
        memories,
        started,
    })
}

/// Previews a prompt build: layers, tokens per layer, spilled lines, the stable prefix hash.
#[utoipa::path(
    tag = "agents",
    request_body = PreviewRequest,
    responses(
        (status = 200, description = "The build: layers, tokens, spilled lines, prefix hash", body = serde_json::Value),
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
    let agent = state.store.agent(&caller.0.id, &path).await?;
    let turned = turn_context(
        &state,
        &caller.0,
        &agent,
        body.session.as_deref(),
        None,
        &body.message,
    )
    .await?;
    let built = &turned.built;
    let counter = state.counter();
    let prompt_tokens: usize = built.segments.iter().map(|s| counter.count(&s.text)).sum();
    // With a model: which blocks of this prompt the cache would reuse (hot, or warmed from cold).
    let blocks = match &state.engine {
        Some(engine) => {
            let session = body.session.as_deref().map(|s| session_key(&agent, s));
            let spec = spec_of(&state, built, &caller.0, session, |_| true)?;
            let l = engine.lookup(spec)?.answer().await?;
            json!({"reused_hot": l.hot, "reused_cold": l.cold, "new": l.blocks - l.hot - l.cold})
        }
        None => serde_json::Value::Null,
    };
    Ok(HttpResponse::Ok().json(json!({
        "stable_prefix_hash": built.stable_prefix_hex(),
        "prompt_tokens": prompt_tokens,
        "layers": built.layers,
        "segments": built.segments.len(),
        "blocks": blocks,
        "memories": turned.memories.as_ref().map(|m| m.ids()),
    })))
}
