//! The memory graph of an agent: nodes and edges (CRUD), hybrid recall, and the cold-tier
//! reservations of recalled neighbourhoods. Everything is scoped to the caller's tenant and the
//! agent in the path; the database is written first, then the graph and the vector index.

use actix_web::{HttpResponse, delete, get, patch, post, web};
use engram_engine::ReservationId;
use engram_graph::{EdgeKind, NodeId, NodeKind};
use engram_kvcore::TenantId;
use engram_store::{Agent, NewMemoryEdge, NewMemoryNode};
use serde::Deserialize;

use crate::auth::{ReadCaller, TenantCaller};
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{Answer, Turn, check_name, recall_scope};
use engram_context::TokenCounter;
use engram_memory::{RecallQuery, now_ms, render};

const MAX_TEXT_BYTES: usize = 16 * 1024;
const MAX_K: usize = 256;
const MAX_HOPS: u32 = 8;

/// Body of `POST /v1/agents/{agent}/memory/nodes`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewNode {
    /// `fact`, `entity`, `concept` or `episode`.
    pub kind: String,
    /// What is remembered (1 byte to 16 KiB).
    pub text: String,
    /// 0..=1 (default 0.5).
    pub importance: Option<f64>,
    /// The session of an episode.
    pub session: Option<String>,
}

/// Body of `PATCH /v1/agents/{agent}/memory/nodes/{id}`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NodePatch {
    /// New text (re-embedded).
    pub text: Option<String>,
    /// New importance.
    pub importance: Option<f64>,
}

/// Body of `POST /v1/agents/{agent}/memory/edges`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEdge {
    /// Source node id.
    pub from: i64,
    /// Target node id.
    pub to: i64,
    /// `mentions`, `relates_to`, `derived_from`, `follows` or `supersedes` (`new → old`).
    pub kind: String,
    /// 0..=1 (default 1).
    pub weight: Option<f64>,
    /// Start of validity, ms since the epoch (inclusive).
    pub valid_from_ms: Option<i64>,
    /// End of validity, ms since the epoch (exclusive).
    pub valid_to_ms: Option<i64>,
}

/// Body of `POST /v1/agents/{agent}/memory/query`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QueryRequest {
    /// The query text.
    pub text: String,
    /// Results at most (default `memory.recall_k`, at most 256).
    pub k: Option<usize>,
    /// Hops of graph expansion (default `memory.hops`, at most 8).
    pub hops: Option<u32>,
    /// Only these kinds.
    pub kinds: Option<Vec<String>>,
    /// Leave this session's episodes out.
    pub exclude_session: Option<String>,
    /// Recall as a turn of this session would: with the agent's memory scoped to sessions,
    /// only this session's nodes and the agent's own (default: every session's, the tenant's
    /// own view of its agent).
    pub session: Option<String>,
    /// Evaluate recency at this time (ms since the epoch; default now).
    pub at_ms: Option<i64>,
    /// Also reserve cold-tier blocks for the neighbourhood as the memories layer would show it
    /// (needs the model).
    #[serde(default)]
    pub reserve: bool,
}

fn check_text(text: &str) -> Result<(), ApiError> {
    if text.trim().is_empty() || text.len() > MAX_TEXT_BYTES {
        return Err(ApiError::invalid("text must be 1 byte to 16 KiB"));
    }
    Ok(())
}

fn check_unit(field: &str, v: f64) -> Result<(), ApiError> {
    if !(0.0..=1.0).contains(&v) {
        return Err(ApiError::invalid(format!("{field} must be within 0..=1")));
    }
    Ok(())
}

fn node_kind(s: &str) -> Result<NodeKind, ApiError> {
    NodeKind::parse(s).ok_or_else(|| {
        ApiError::invalid(format!(
            "unknown node kind `{s}` (episode, fact, entity, concept)"
        ))
    })
}

/// The agent and the memory service, or 404 / 503.
async fn scope<'a>(
    state: &'a AppState,
    tenant: &engram_store::Tenant,
    agent: &str,
) -> Result<(Agent, &'a engram_memory::MemoryService), ApiError> {
    let memory = state.memory()?;
    let agent = state.store.agent(&tenant.id, agent).await?;
    Ok((agent, memory))
}

/// A node of this agent, or 404.
fn own_node(
    memory: &engram_memory::MemoryService,
    tenant: &str,
    agent: &Agent,
    id: i64,
) -> Result<engram_graph::Node, ApiError> {
    memory
        .node(tenant, NodeId(id as u64))?
        .filter(|n| n.agent == agent.id && id >= 0)
        .ok_or_else(|| ApiError::not_found(format!("memory node `{id}` not found")))
}

/// Adds a node to `agent`'s memory (what `POST …/memory/nodes` and the MCP server's
/// `add_memory` do).
pub(crate) async fn add_node(
    state: &AppState,
    tenant: &engram_store::Tenant,
    agent: &str,
    body: &NewNode,
) -> Result<engram_store::MemoryNodeRow, ApiError> {
    let (agent, memory) = scope(state, tenant, agent).await?;
    let kind = node_kind(&body.kind)?;
    check_text(&body.text)?;
    let importance = body.importance.unwrap_or(0.5);
    check_unit("importance", importance)?;
    if let Some(s) = &body.session {
        check_name("session", s)?;
    }
    let row = state
        .store
        .insert_memory_node(&NewMemoryNode {
            tenant_id: tenant.id.clone(),
            agent_id: agent.id.clone(),
            session_id: body.session.clone(),
            kind: kind.as_str().to_string(),
            text: body.text.clone(),
            importance,
            tokens: state.counter().count(&body.text) as i64,
        })
        .await?;
    memory.add(&row).await?;
    Ok(row)
}

/// Deletes a node of `agent`'s memory (`DELETE …/memory/nodes/{id}`, MCP `forget_memory`).
pub(crate) async fn forget_node(
    state: &AppState,
    tenant: &engram_store::Tenant,
    agent: &str,
    id: i64,
) -> Result<(), ApiError> {
    let (agent, memory) = scope(state, tenant, agent).await?;
    own_node(memory, &tenant.id, &agent, id)?;
    state.store.delete_memory_node(&tenant.id, id).await?;
    memory.remove(NodeId(id as u64))?;
    Ok(())
}

/// Adds an edge between two nodes of `agent`'s memory (`POST …/memory/edges`, MCP
/// `link_memories`).
pub(crate) async fn add_edge(
    state: &AppState,
    tenant: &engram_store::Tenant,
    agent: &str,
    body: &NewEdge,
) -> Result<engram_store::MemoryEdgeRow, ApiError> {
    let (agent, memory) = scope(state, tenant, agent).await?;
    let kind = EdgeKind::parse(&body.kind).ok_or_else(|| {
        ApiError::invalid(format!(
            "unknown edge kind `{}` (mentions, relates_to, derived_from, follows, supersedes)",
            body.kind
        ))
    })?;
    let weight = body.weight.unwrap_or(1.0);
    check_unit("weight", weight)?;
    if body.from == body.to {
        return Err(ApiError::invalid("an edge cannot join a node to itself"));
    }
    if let (Some(f), Some(t)) = (body.valid_from_ms, body.valid_to_ms)
        && f >= t
    {
        return Err(ApiError::invalid(
            "valid_from_ms must be before valid_to_ms",
        ));
    }
    own_node(memory, &tenant.id, &agent, body.from)?;
    own_node(memory, &tenant.id, &agent, body.to)?;
    let row = state
        .store
        .insert_memory_edge(&NewMemoryEdge {
            tenant_id: tenant.id.clone(),
            from_id: body.from,
            to_id: body.to,
            kind: kind.as_str().to_string(),
            weight,
            valid_from: body.valid_from_ms,
            valid_to: body.valid_to_ms,
        })
        .await?;
    memory.add_edge(&row)?;
    Ok(row)
}

/// Hybrid recall over `agent`'s memory (`POST …/memory/query`, MCP `query_memories`).
pub(crate) async fn run_query(
    state: std::sync::Arc<AppState>,
    tenant: engram_store::Tenant,
    agent: &str,
    body: &QueryRequest,
) -> Result<QueryResponse, ApiError> {
    let (agent, memory) = scope(&state, &tenant, agent).await?;
    check_text(&body.text)?;
    if let Some(s) = &body.session {
        check_name("session", s)?;
    }
    let k = body.k.unwrap_or(memory.config().recall_k);
    if k == 0 || k > MAX_K {
        return Err(ApiError::invalid(format!("k must be 1 to {MAX_K}")));
    }
    let hops = body.hops.unwrap_or(memory.config().hops);
    if hops > MAX_HOPS {
        return Err(ApiError::invalid(format!(
            "hops must be at most {MAX_HOPS}"
        )));
    }
    let kinds = body
        .kinds
        .as_ref()
        .map(|ks| {
            ks.iter()
                .map(|k| node_kind(k))
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?;
    let results = memory
        .recall(&RecallQuery {
            tenant: &tenant.id,
            agent: &agent.id,
            text: &body.text,
            k,
            hops,
            kinds,
            exclude_session: body.exclude_session.as_deref(),
            exclude_since_ms: None,
            at_ms: body.at_ms.unwrap_or_else(now_ms),
            sessions: match &body.session {
                Some(s) => recall_scope(&agent, Some(s)),
                None => engram_graph::SessionScope::Every,
            },
            asker: body.session.as_deref(),
        })
        .await?;
    let reservation = if body.reserve {
        let turn = Turn::of(
            state.clone(),
            tenant.clone(),
            agent,
            body.session.as_deref(),
        )
        .await?;
        match turn
            .neighbourhood(body.exclude_session.as_deref(), None, &body.text)
            .await?
        {
            Some(n) => turn.reserve(&[], &n).await?,
            None => None,
        }
    } else {
        None
    };
    let shown = render(results.clone(), u32::MAX);
    Ok(QueryResponse {
        results,
        canonical_order: shown.ids(),
        tokens: shown.tokens,
        reservation,
    })
}

/// Adds a node (a fact, an entity, a concept or an episode) to the agent's memory.
#[utoipa::path(
    tag = "memory",
    request_body = NewNode,
    responses(
        (status = 201, description = "The node", body = engram_store::MemoryNodeRow),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 503, description = "The memory graph is off", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/memory/nodes")]
pub async fn create_node(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
    body: web::Json<NewNode>,
) -> Result<HttpResponse, ApiError> {
    let row = add_node(&state, &caller.0, &path, &body).await?;
    Ok(HttpResponse::Created().json(row))
}

/// The agent's memory nodes.
#[utoipa::path(
    tag = "memory",
    params(Page),
    responses(
        (status = 200, description = "A page by id; `next` is the `after` of the next page (null on the last)", body = NodePage),
        (status = 400, description = "Invalid paging", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/memory/nodes")]
pub async fn list_nodes(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
    page: web::Query<Page>,
) -> Result<HttpResponse, ApiError> {
    let (agent, _) = scope(&state, &caller.0, &path).await?;
    let (after, limit) = page.bounds()?;
    let nodes = state
        .store
        .memory_nodes_page(&caller.0.id, &agent.id, after, limit + 1)
        .await?;
    let (nodes, next) = page_of(nodes, limit, |n| n.id);
    Ok(HttpResponse::Ok().json(NodePage { nodes, next }))
}

/// A page of memory nodes.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct NodePage {
    /// Nodes, by id.
    pub nodes: Vec<engram_store::MemoryNodeRow>,
    /// The `after` of the next page (null on the last).
    pub next: Option<i64>,
}

/// A page of memory edges.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct EdgePage {
    /// Edges, by id.
    pub edges: Vec<engram_store::MemoryEdgeRow>,
    /// The `after` of the next page (null on the last).
    pub next: Option<i64>,
}

/// A memory node and its edges.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct NodeView {
    /// The node.
    pub node: engram_store::MemoryNodeRow,
    /// Its edges, either way.
    pub edges: Vec<engram_store::MemoryEdgeRow>,
}

/// A page of a listing: `?after=<id>&limit=<n>`.
#[derive(Debug, Clone, Copy, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct Page {
    /// Only ids above this one (the `next` of the previous page).
    pub after: Option<i64>,
    /// Items at most (1–1000, default 100).
    pub limit: Option<i64>,
}

impl Page {
    fn bounds(&self) -> Result<(i64, i64), ApiError> {
        let limit = self.limit.unwrap_or(100);
        if !(1..=1000).contains(&limit) {
            return Err(ApiError::invalid("limit must be 1 to 1000"));
        }
        Ok((self.after.unwrap_or(0), limit))
    }
}

/// Cuts a page fetched with one extra row: the rows, and the cursor of the next page if the
/// extra row was there.
fn page_of<T>(mut rows: Vec<T>, limit: i64, id: impl Fn(&T) -> i64) -> (Vec<T>, Option<i64>) {
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    if rows.len() > limit {
        rows.truncate(limit);
        let next = rows.last().map(id);
        (rows, next)
    } else {
        (rows, None)
    }
}

/// One memory node and its edges.
#[utoipa::path(
    tag = "memory",
    responses(
        (status = 200, description = "The node and its edges", body = NodeView),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent or node", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/memory/nodes/{id}")]
pub async fn get_node(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, i64)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, id) = path.into_inner();
    let (agent, memory) = scope(&state, &caller.0, &agent).await?;
    own_node(memory, &caller.0.id, &agent, id)?;
    let row = state.store.memory_node(&caller.0.id, id).await?;
    let edges: Vec<_> = state
        .store
        .memory_edges(Some(&caller.0.id))
        .await?
        .into_iter()
        .filter(|e| e.from_id == id || e.to_id == id)
        .collect();
    Ok(HttpResponse::Ok().json(NodeView { node: row, edges }))
}

/// Changes a node's text (re-embedded) or importance.
#[utoipa::path(
    tag = "memory",
    request_body = NodePatch,
    responses(
        (status = 200, description = "The node", body = engram_store::MemoryNodeRow),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent or node", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[patch("/v1/agents/{agent}/memory/nodes/{id}")]
pub async fn update_node(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, i64)>,
    body: web::Json<NodePatch>,
) -> Result<HttpResponse, ApiError> {
    let (agent, id) = path.into_inner();
    let (agent, memory) = scope(&state, &caller.0, &agent).await?;
    let node = own_node(memory, &caller.0.id, &agent, id)?;
    if body.text.is_none() && body.importance.is_none() {
        return Err(ApiError::invalid(
            "nothing to change: give `text` or `importance`",
        ));
    }
    let text = body.text.clone().unwrap_or(node.text);
    check_text(&text)?;
    let importance = body.importance.unwrap_or(f64::from(node.importance));
    check_unit("importance", importance)?;
    let tokens = state.counter().count(&text) as i64;
    let row = state
        .store
        .update_memory_node(&caller.0.id, id, &text, importance, tokens)
        .await?;
    memory.update(&row).await?;
    Ok(HttpResponse::Ok().json(row))
}

/// Deletes a node and its edges.
#[utoipa::path(
    tag = "memory",
    responses(
        (status = 204, description = "Deleted"),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent or node", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[delete("/v1/agents/{agent}/memory/nodes/{id}")]
pub async fn delete_node(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, i64)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, id) = path.into_inner();
    forget_node(&state, &caller.0, &agent, id).await?;
    Ok(HttpResponse::NoContent().finish())
}

/// Links two of the agent's nodes.
#[utoipa::path(
    tag = "memory",
    request_body = NewEdge,
    responses(
        (status = 201, description = "The edge", body = engram_store::MemoryEdgeRow),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent or node", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/memory/edges")]
pub async fn create_edge(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
    body: web::Json<NewEdge>,
) -> Result<HttpResponse, ApiError> {
    let row = add_edge(&state, &caller.0, &path, &body).await?;
    Ok(HttpResponse::Created().json(row))
}

/// The edges between the agent's nodes.
#[utoipa::path(
    tag = "memory",
    params(Page),
    responses(
        (status = 200, description = "A page by id; `next` is the `after` of the next page (null on the last)", body = EdgePage),
        (status = 400, description = "Invalid paging", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/memory/edges")]
pub async fn list_edges(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
    page: web::Query<Page>,
) -> Result<HttpResponse, ApiError> {
    let (agent, _) = scope(&state, &caller.0, &path).await?;
    let (after, limit) = page.bounds()?;
    let edges = state
        .store
        .memory_edges_page(&caller.0.id, &agent.id, after, limit + 1)
        .await?;
    let (edges, next) = page_of(edges, limit, |e| e.id);
    Ok(HttpResponse::Ok().json(EdgePage { edges, next }))
}

/// Deletes an edge.
#[utoipa::path(
    tag = "memory",
    responses(
        (status = 204, description = "Deleted"),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent or edge", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[delete("/v1/agents/{agent}/memory/edges/{id}")]
pub async fn delete_edge(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, i64)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, id) = path.into_inner();
    let (agent, memory) = scope(&state, &caller.0, &agent).await?;
    let edge = state
        .store
        .memory_edges(Some(&caller.0.id))
        .await?
        .into_iter()
        .find(|e| e.id == id)
        .filter(|e| own_node(memory, &caller.0.id, &agent, e.from_id).is_ok())
        .ok_or_else(|| ApiError::not_found(format!("memory edge `{id}` not found")))?;
    state
        .store
        .delete_memory_edge(&caller.0.id, edge.id)
        .await?;
    memory.remove_edge(engram_graph::EdgeId(id as u64))?;
    Ok(HttpResponse::NoContent().finish())
}

/// Hybrid recall: vector seeds expanded through the graph, scored by similarity, proximity,
/// recency and importance (best first, ties by node id). With `reserve`, the neighbourhood as
/// the memories layer would show it is reserved in the cold tier.
#[utoipa::path(
    tag = "memory",
    request_body = QueryRequest,
    responses(
        (status = 200, description = "The recalled nodes, best first; their order in a memories layer and its tokens; the reservation made", body = QueryResponse),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 503, description = "The memory graph is off, or no cold room", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/memory/query")]
pub async fn query(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
    body: web::Json<QueryRequest>,
) -> Result<HttpResponse, ApiError> {
    let answer = run_query(state.into_inner(), caller.0, &path, &body).await?;
    Ok(HttpResponse::Ok().json(answer))
}

/// Filters of the reservation listing.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ReservationParams {
    /// Only reservations holding this node (a node id: 0 to 2^53).
    #[param(minimum = 0, maximum = 9007199254740992_i64)]
    pub node: Option<i64>,
}

/// The tenant's cold-tier reservations (live first, then the most recent finished ones).
#[utoipa::path(
    tag = "memory",
    params(ReservationParams),
    responses(
        (status = 200, description = "The agent's reservations", body = ReservationList),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 503, description = "No model or memory graph", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/memory/reservations")]
pub async fn list_reservations(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
    params: web::Query<ReservationParams>,
) -> Result<HttpResponse, ApiError> {
    if params.node.is_some_and(|n| !(0..=1 << 53).contains(&n)) {
        return Err(ApiError::invalid("node must be 0 to 2^53"));
    }
    let (agent, memory) = scope(&state, &caller.0, &path).await?;
    let list = state
        .engine()?
        .reservations(Some(TenantId(caller.0.cache_salt)))?
        .answer()
        .await?;
    // Reservations are per tenant in the engine; keep those whose nodes are this agent's.
    let list: Vec<_> = list
        .into_iter()
        .filter(|r| {
            r.labels
                .iter()
                .all(|&n| own_node(memory, &caller.0.id, &agent, n as i64).is_ok())
        })
        .filter(|r| {
            params
                .node
                .is_none_or(|n| r.labels.contains(&n.unsigned_abs()))
        })
        .collect();
    Ok(HttpResponse::Ok().json(ReservationList { reservations: list }))
}

/// Promotes a ready reservation's blocks to the hot tier (a turn that uses them is coming).
#[utoipa::path(
    tag = "memory",
    responses(
        (status = 200, description = "Blocks warmed into the hot tier", body = Warmed),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent or reservation", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/memory/reservations/{id}/warm")]
pub async fn warm_reservation(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, u64)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, id) = path.into_inner();
    let (agent, memory) = scope(&state, &caller.0, &agent).await?;
    let engine = state.engine()?;
    let mine = engine
        .reservations(Some(TenantId(caller.0.cache_salt)))?
        .answer()
        .await?
        .into_iter()
        .any(|r| {
            r.id.0 == id
                && r.labels
                    .iter()
                    .all(|&n| own_node(memory, &caller.0.id, &agent, n as i64).is_ok())
        });
    if !mine {
        return Err(ApiError::not_found(format!("reservation `{id}` not found")));
    }
    let n = engine
        .warm_reservation(ReservationId(id))?
        .answer()
        .await??;
    Ok(HttpResponse::Ok().json(Warmed { warmed_blocks: n }))
}

/// Every tenant's reservations and the totals (operator view).
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "Every reservation, the counters and the hit rate", body = AdminReservations),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/reservations")]
pub async fn admin_reservations(
    _: ReadCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let engine = state.engine()?;
    let list = engine.reservations(None)?.answer().await?;
    let snap = engine.snapshot()?.answer().await?;
    let c = snap.reservations;
    Ok(HttpResponse::Ok().json(AdminReservations {
        reservations: list,
        counters: c,
        hit_rate: c.hit_rate(),
        prefetch: state.metrics.prefetch_figures(),
    }))
}

/// The memory graph's size and how the last start rebuilt it (operator view).
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "The graph's size and its last start", body = MemoryStats),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 503, description = "The memory graph is off", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/memory")]
pub async fn admin_memory(
    _: ReadCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let memory = state.memory()?;
    let (nodes, edges, vectors) = memory.counts()?;
    Ok(HttpResponse::Ok().json(MemoryStats {
        nodes,
        edges,
        vectors,
        cached_queries: memory.cached_queries(),
        startup: memory.startup(),
    }))
}

/// What a hybrid query found.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct QueryResponse {
    /// Recalled nodes, best first.
    pub results: Vec<engram_memory::Recalled>,
    /// Their ids in the order a memories layer shows them (creation order).
    pub canonical_order: Vec<u64>,
    /// Tokens of that layer.
    pub tokens: u32,
    /// The reservation made (`reserve`), if any.
    pub reservation: Option<u64>,
}

/// The memory graph's size and how the last start rebuilt it.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct MemoryStats {
    /// Nodes.
    pub nodes: usize,
    /// Edges.
    pub edges: usize,
    /// Vectors in the index.
    pub vectors: usize,
    /// Query embeddings cached (the texts of recent recalls, each under its tenant, agent and
    /// asking session; a deleted session's go with it).
    pub cached_queries: usize,
    /// The last start.
    pub startup: engram_memory::Startup,
}

/// Reservations.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ReservationList {
    /// Reservations.
    pub reservations: Vec<engram_engine::ReservationInfo>,
}

/// What a warm did.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct Warmed {
    /// Blocks warmed into the hot tier.
    pub warmed_blocks: usize,
}

/// Every reservation with the engine's counters.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AdminReservations {
    /// Reservations.
    pub reservations: Vec<engram_engine::ReservationInfo>,
    /// Made, warmed, expired, refused, failed, blocks served.
    pub counters: engram_engine::ReservationCounters,
    /// Used over used or expired (null before any).
    pub hit_rate: Option<f64>,
    /// Query-time prefetches (`POST …/sessions/{s}/prefetch`): requests by outcome, and the
    /// turns after a reserving prefetch that showed exactly its memories (hits) or not.
    pub prefetch: crate::metrics::PrefetchFigures,
}

/// A memory node with its edges and the nodes they reach.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct Neighbourhood {
    /// The node.
    pub node: engram_store::MemoryNodeRow,
    /// Its edges, either way.
    pub edges: Vec<engram_store::MemoryEdgeRow>,
    /// The nodes at their other ends.
    pub neighbours: Vec<engram_store::MemoryNodeRow>,
}

/// A tenant's memory node, its edges and its neighbours (operator view: the admin page).
#[utoipa::path(
    tag = "admin",
    responses(
        (status = 200, description = "The node, its edges and its neighbours", body = Neighbourhood),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown tenant or node", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/admin/tenants/{tenant}/memory/nodes/{id}")]
pub async fn admin_node(
    _: ReadCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, i64)>,
) -> Result<HttpResponse, ApiError> {
    let (tenant, id) = path.into_inner();
    let tenant = state.store.tenant(&tenant).await?;
    let node = state.store.memory_node(&tenant.id, id).await?;
    let edges: Vec<_> = state
        .store
        .memory_edges(Some(&tenant.id))
        .await?
        .into_iter()
        .filter(|e| e.from_id == id || e.to_id == id)
        .collect();
    let mut others: Vec<i64> = edges
        .iter()
        .map(|e| if e.from_id == id { e.to_id } else { e.from_id })
        .filter(|&o| o != id)
        .collect();
    others.sort_unstable();
    others.dedup();
    let mut neighbours = Vec::with_capacity(others.len());
    for other in others {
        neighbours.push(state.store.memory_node(&tenant.id, other).await?);
    }
    Ok(HttpResponse::Ok().json(Neighbourhood {
        node,
        edges,
        neighbours,
    }))
}
