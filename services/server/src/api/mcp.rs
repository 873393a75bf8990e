//! A memory MCP server at `/mcp` (streamable HTTP, the official `rmcp` crate), so any
//! MCP-speaking agent can use an agent's memory graph and run its turns without a client of
//! its own. Its tools are the memory routes and a chat turn, scoped by the caller's tenant key
//! (`Authorization: Bearer <key>`) exactly as those routes are:
//! - `add_memory` — a node (fact, entity, concept or episode) in an agent's memory;
//! - `query_memories` — hybrid recall (vector, keyword and graph);
//! - `link_memories` — a typed edge between two of its nodes;
//! - `forget_memory` — deletes a node and its edges;
//! - `run_turn` — a turn of an agent in a session (its log, its memories, its KV reuse).
//!
//! The server is stateless (each POST carries its own JSON-RPC exchange, answered as JSON), so
//! it holds nothing between requests and any node of a fleet answers. The key, not the Host
//! header, guards it: rmcp's DNS-rebinding check (meant for unauthenticated local servers) is
//! off.

use std::sync::Arc;

use actix_web::{HttpRequest, HttpResponse, post, web};
use engram_store::Tenant;
use http_body_util::BodyExt;
use rmcp::handler::server::tool::Extension;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, schemars, tool, tool_router};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::chat;
use crate::api::memory::{self, NewEdge, NewNode, QueryRequest};
use crate::api::tools::Tools;
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;

/// Bytes an MCP request may carry at most.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// The tools, over the server's state.
#[derive(Clone)]
pub struct MemoryTools {
    state: Arc<AppState>,
}

impl std::fmt::Debug for MemoryTools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryTools").finish_non_exhaustive()
    }
}

/// `add_memory`'s arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct AddMemory {
    /// The agent (its name or id).
    pub agent: String,
    /// What to remember (1 byte to 16 KiB).
    pub text: String,
    /// `fact` (the default), `entity`, `concept` or `episode`.
    pub kind: Option<String>,
    /// 0 to 1 (default 0.5).
    pub importance: Option<f64>,
    /// The session it belongs to, if any.
    pub session: Option<String>,
}

/// `query_memories`' arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct QueryMemories {
    /// The agent.
    pub agent: String,
    /// What to recall.
    pub text: String,
    /// Results at most (default the server's `memory.recall_k`).
    pub k: Option<usize>,
    /// Recall as this session's turns would.
    pub session: Option<String>,
}

/// `link_memories`' arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct LinkMemories {
    /// The agent.
    pub agent: String,
    /// The source node's id.
    pub from: i64,
    /// The target node's id.
    pub to: i64,
    /// `mentions`, `relates_to` (the default), `derived_from`, `follows` or `supersedes`.
    pub kind: Option<String>,
}

/// `forget_memory`'s arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ForgetMemory {
    /// The agent.
    pub agent: String,
    /// The node's id.
    pub id: i64,
}

/// `run_turn`'s arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RunTurn {
    /// The agent.
    pub agent: String,
    /// The session (its log continues; created on first use).
    pub session: String,
    /// The user's message.
    pub message: String,
    /// Tokens to generate at most (default 256).
    pub max_tokens: Option<usize>,
}

/// The caller the bridge put into the request.
fn tenant_of(parts: &http::request::Parts) -> Result<Tenant, ErrorData> {
    parts
        .extensions
        .get::<Tenant>()
        .cloned()
        .ok_or_else(|| ErrorData::internal_error("no authenticated tenant", None))
}

/// A refusal of the route as the tool's own error result (the model sees the code and why).
fn refused(e: ApiError) -> CallToolResult {
    CallToolResult::structured_error(json!({"code": e.code, "message": e.message}))
}

fn answer(v: Result<Value, ApiError>) -> Result<CallToolResult, ErrorData> {
    Ok(match v {
        Ok(v) => CallToolResult::structured(v),
        Err(e) => refused(e),
    })
}

fn to_json(v: impl serde::Serialize) -> Result<Value, ApiError> {
    serde_json::to_value(v).map_err(|e| ApiError::internal(e.to_string()))
}

#[tool_router(server_handler)]
impl MemoryTools {
    /// Adds a memory to an agent's memory graph.
    #[tool(
        description = "Add a memory (a fact, entity, concept or episode) to an agent's memory graph; answers the stored node with its id."
    )]
    async fn add_memory(
        &self,
        Extension(parts): Extension<http::request::Parts>,
        Parameters(a): Parameters<AddMemory>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let node = NewNode {
            kind: a.kind.unwrap_or_else(|| "fact".into()),
            text: a.text,
            importance: a.importance,
            session: a.session,
        };
        let state = self.state.clone();
        answer(
            async move { to_json(memory::add_node(&state, &tenant, &a.agent, &node).await?) }.await,
        )
    }

    /// Recalls an agent's memories about a text.
    #[tool(
        description = "Query an agent's memories: hybrid recall (vector, keyword and graph) of the nodes most relevant to a text, best first, with scores (`results`)."
    )]
    async fn query_memories(
        &self,
        Extension(parts): Extension<http::request::Parts>,
        Parameters(q): Parameters<QueryMemories>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let body = QueryRequest {
            text: q.text,
            k: q.k,
            hops: None,
            kinds: None,
            exclude_session: None,
            session: q.session,
            at_ms: None,
            reserve: false,
        };
        let state = self.state.clone();
        answer(
            async move {
                let r = memory::run_query(state, tenant, &q.agent, &body).await?;
                Ok(json!({"results": to_json(r.results)?}))
            }
            .await,
        )
    }

    /// Links two memories.
    #[tool(
        description = "Link two memories of an agent with a typed edge (mentions, relates_to, derived_from, follows, supersedes)."
    )]
    async fn link_memories(
        &self,
        Extension(parts): Extension<http::request::Parts>,
        Parameters(l): Parameters<LinkMemories>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let edge = NewEdge {
            from: l.from,
            to: l.to,
            kind: l.kind.unwrap_or_else(|| "relates_to".into()),
            weight: None,
            valid_from_ms: None,
            valid_to_ms: None,
        };
        let state = self.state.clone();
        answer(
            async move { to_json(memory::add_edge(&state, &tenant, &l.agent, &edge).await?) }.await,
        )
    }

    /// Forgets a memory.
    #[tool(
        description = "Forget a memory: delete a node of an agent's memory graph and its edges."
    )]
    async fn forget_memory(
        &self,
        Extension(parts): Extension<http::request::Parts>,
        Parameters(f): Parameters<ForgetMemory>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let state = self.state.clone();
        answer(
            async move {
                memory::forget_node(&state, &tenant, &f.agent, f.id).await?;
                Ok(json!({"deleted": f.id}))
            }
            .await,
        )
    }

    /// Runs a turn of an agent.
    #[tool(
        description = "Run a turn of an agent in a session: the agent answers the message with its layered prompt, its memories and the session's history; answers the text and token usage."
    )]
    async fn run_turn(
        &self,
        Extension(parts): Extension<http::request::Parts>,
        Parameters(t): Parameters<RunTurn>,
    ) -> Result<CallToolResult, ErrorData> {
        let tenant = tenant_of(&parts)?;
        let state = self.state.clone();
        answer(
            async move {
                let input = chat::ChatInput {
                    model: t.agent,
                    messages: vec![chat::Msg {
                        role: "user".into(),
                        content: Some(t.message),
                        tool_calls: None,
                    }],
                    user: Some(t.session),
                    appends: false,
                    tools: Tools::parse(None, None, None)?,
                    response_format: None,
                    sampling: engram_engine::SamplingParams {
                        max_tokens: t.max_tokens.unwrap_or(256),
                        ..engram_engine::SamplingParams::default()
                    },
                    n: 1,
                };
                let p = chat::prepare(state, tenant, input).await?;
                let (turn, g) = chat::run(p).await?;
                Ok(json!({
                    "agent": turn.agent.name,
                    "text": g.text,
                    "usage": g.usage,
                }))
            }
            .await,
        )
    }
}

/// The MCP service over `state` (built once, at start).
pub fn service(state: Arc<AppState>) -> McpService {
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_max_request_body_bytes(MAX_BODY_BYTES);
    McpService(StreamableHttpService::new(
        move || {
            Ok(MemoryTools {
                state: state.clone(),
            })
        },
        Arc::new(NeverSessionManager::default()),
        config,
    ))
}

/// The service the route hands requests to.
#[derive(Clone)]
pub struct McpService(StreamableHttpService<MemoryTools, NeverSessionManager>);

impl std::fmt::Debug for McpService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpService").finish_non_exhaustive()
    }
}

/// The MCP endpoint (streamable HTTP: JSON-RPC requests by POST; the server is stateless, so
/// there is no GET stream and no session to DELETE).
#[utoipa::path(
    tag = "memory",
    request_body(content = Object, description = "A JSON-RPC message of the Model Context Protocol (send `Accept: application/json, text/event-stream`)"),
    responses(
        (status = 200, description = "The JSON-RPC answer (tools: add_memory, query_memories, link_memories, forget_memory, run_turn)"),
        (status = 202, description = "A notification or a response, accepted"),
        (status = 400, description = "Not a JSON-RPC message, or a protocol version the server does not speak"),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 406, description = "The `Accept` header does not take JSON and event streams"),
        (status = 415, description = "Not `application/json`"),
        (status = 422, description = "A JSON-RPC request whose parameters are invalid"),
    ),
    security(("bearer" = []))
)]
#[post("/mcp")]
pub async fn mcp(
    caller: TenantCaller,
    req: HttpRequest,
    body: web::Bytes,
    service: web::Data<McpService>,
) -> Result<HttpResponse, ApiError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(ApiError::new(
            actix_web::http::StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            "an MCP request may hold at most 1 MiB",
        ));
    }
    let mut forward = http::Request::builder()
        .method(req.method().as_str())
        .uri(req.uri().to_string());
    for (name, value) in req.headers() {
        forward = forward.header(name.as_str(), value.as_bytes());
    }
    let mut forward = forward
        .body(http_body_util::Full::new(body))
        .map_err(|e| ApiError::invalid(format!("the request cannot be forwarded: {e}")))?;
    forward.extensions_mut().insert(caller.0);
    let answer = service.0.handle(forward).await;
    let (parts, body) = answer.into_parts();
    let status = actix_web::http::StatusCode::from_u16(parts.status.as_u16())
        .unwrap_or(actix_web::http::StatusCode::INTERNAL_SERVER_ERROR);
    let mut out = HttpResponse::build(status);
    for (name, value) in &parts.headers {
        out.insert_header((name.as_str(), value.as_bytes()));
    }
    let stream = futures_util::StreamExt::map(body.into_data_stream(), |r| {
        r.map_err(|never: std::convert::Infallible| -> actix_web::Error { match never {} })
    });
    Ok(out.streaming(stream))
}
