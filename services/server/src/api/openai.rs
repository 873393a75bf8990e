//! OpenAI-compatible endpoints, so agent frameworks work unchanged.
//!
//! How the official SDK names an agent and a session:
//! - `model` is the **agent** (its name or id; `GET /v1/models` lists the caller's agents);
//! - `user` (a standard request field) is the **session**: with it, the conversation comes from
//!   the session's durable turn log and the turn is appended to it; the request's earlier
//!   messages are ignored. Without it, the request is stateless: the earlier `user`/`assistant`
//!   messages are the conversation and nothing is stored in the turn log. Its KV is still
//!   cached, and shadowed under a key of the agent and the conversation's first user message,
//!   so that a restart keeps a stateless conversation warm too.
//!
//! Both kinds of request take the native route's steps (`crate::turn`): a session's lost turns
//! are replayed before its prompt is built, exactly as on `POST …/turns`.
//!
//! The last message must be the user's or a tool's result (which the model then answers).
//! `system` and `developer` messages are added to the agent's `rules` layer for the request (a
//! stable layer: cached and pinned with the stable prefix, so a request that repeats them
//! reuses them). In a stateless request, `tool` messages stay in the conversation with the
//! `tool` role and an assistant's `tool_calls` follow its text as `<tool_call>{json}</tool_call>`
//! lines. In a session, the tool results that end the request (after its last other message)
//! are logged with the turn in the `tool` role, before its reply, and replayed like any turn.
//! `n` other than 1, `logprobs`, `top_logprobs` and a non-empty `tools` answer 400
//! `unsupported_parameter` instead of being ignored. `usage.prompt_tokens_details.cached_tokens`
//! reports the prompt tokens reused from the KV cache. `stream: true` answers `chat.completion.chunk` events and
//! `data: [DONE]`; a failure, or a turn that could not be recorded (its session deleted
//! meanwhile), ends the stream with `data: {"error": …}` instead.

use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::{HttpResponse, get, post, web};
use engram_context::{Speaker, Turn as Said};
use engram_engine::{FinishReason, SamplingParams, Usage};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::api::stream::{self, Framing};
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{Generated, Log, Turn, generate, said_of, session_key};
use engram_store::Role;

/// One chat message.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Text (string content only).
    pub content: Option<String>,
    /// An assistant message's tool calls (rendered into the conversation as
    /// `<tool_call>{json}</tool_call>` lines).
    #[schema(value_type = Option<Object>)]
    pub tool_calls: Option<Value>,
    /// A tool message's call id.
    pub tool_call_id: Option<String>,
}

/// Body of `POST /v1/chat/completions` (unknown OpenAI fields are accepted and ignored).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct ChatRequest {
    /// The agent.
    pub model: String,
    /// The conversation; the last message is the new user message.
    pub messages: Vec<Message>,
    /// The session (optional).
    pub user: Option<String>,
    /// Streaming.
    #[serde(default)]
    pub stream: bool,
    /// Tokens to generate at most (`max_completion_tokens` is accepted too).
    pub max_tokens: Option<usize>,
    /// Alias of `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    /// Temperature (OpenAI's default is 1; Engram's is greedy when absent).
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Seed.
    pub seed: Option<u64>,
    /// Stop: a string or a list.
    #[schema(value_type = Option<Object>)]
    pub stop: Option<Value>,
    /// Choices to generate: only 1 (more answers 400 `unsupported_parameter`).
    pub n: Option<u32>,
    /// Log probabilities are not returned: `true` answers 400 `unsupported_parameter`.
    pub logprobs: Option<bool>,
    /// Likewise (any value).
    pub top_logprobs: Option<u32>,
    /// Tools: the model's chat template has no tool format, so a non-empty list answers 400
    /// `unsupported_parameter`.
    #[schema(value_type = Option<Object>)]
    pub tools: Option<Value>,
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn finish(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn usage_of(u: &Usage) -> ChatUsage {
    ChatUsage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        total_tokens: u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details: CachedTokens {
            cached_tokens: u.cached_tokens,
        },
    }
}

fn usage_json(u: &Usage) -> Value {
    json!(usage_of(u))
}

/// A `chat.completion` (the schema of the JSON answer).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ChatCompletion {
    /// `chatcmpl-…`, unique.
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Creation time, s since the epoch.
    pub created: u64,
    /// The agent's name.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: ChatUsage,
}

/// A choice of a `chat.completion`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ChatChoice {
    /// 0.
    pub index: u32,
    /// The reply.
    pub message: ChatReply,
    /// `stop` or `length`.
    pub finish_reason: String,
}

/// The assistant's reply.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ChatReply {
    /// `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// OpenAI's usage block.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ChatUsage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// `cached_tokens`: prompt tokens reused from the KV cache.
    pub prompt_tokens_details: CachedTokens,
}

/// Prompt tokens reused from the KV cache.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct CachedTokens {
    /// Tokens.
    pub cached_tokens: usize,
}

/// The caller's agents, as models.
/// OpenAI's model list: the caller's agents.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// One per agent.
    pub data: Vec<ModelEntry>,
    /// The `cursor` of the next page (null on the last).
    pub next_cursor: Option<String>,
}

/// One agent as an OpenAI model.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ModelEntry {
    /// The agent's name (the `model` of a chat request).
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Creation time, s since the epoch.
    pub created: i64,
    /// `engram`.
    pub owned_by: &'static str,
    /// The checkpoint every agent is served by: its file (or directory) name, as `model.path`
    /// names it (vLLM's field for the underlying model).
    pub root: String,
}

/// The caller's agents as models, oldest first: the first 1,000 unless `limit` says otherwise,
/// the rest through `cursor` (the answer's `next_cursor`).
#[utoipa::path(
    tag = "openai",
    params(crate::pages::ListPage),
    responses(
        (status = 200, description = "The caller's agents as models", body = ModelList),
        (status = 400, description = "Invalid paging", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/models")]
pub async fn list_models(
    caller: TenantCaller,
    state: web::Data<AppState>,
    page: web::Query<crate::pages::ListPage>,
) -> Result<HttpResponse, ApiError> {
    let mut page = page.into_inner();
    page.limit = page.limit.or(Some(crate::pages::MAX_LIMIT));
    let (agents, next_cursor) = crate::pages::agents(&state.store, &caller.0.id, &page).await?;
    let root = state
        .config
        .model
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let data: Vec<ModelEntry> = agents
        .into_iter()
        .map(|a| ModelEntry {
            id: a.name,
            object: "model",
            created: a.created_at / 1000,
            owned_by: "engram",
            root: root.clone(),
        })
        .collect();
    Ok(HttpResponse::Ok().json(ModelList {
        object: "list",
        data,
        next_cursor,
    }))
}

/// Messages a chat request may carry at most.
pub const MAX_MESSAGES: usize = 1024;
/// Bytes of text one message may carry at most (a system prompt included).
pub const MAX_MESSAGE_BYTES: usize = 256 * 1024;

/// 400 unless `messages` has at most [`MAX_MESSAGES`] messages of at most
/// [`MAX_MESSAGE_BYTES`] each: what one request may ask the service to tokenize and hold.
fn check_messages(messages: &[Message]) -> Result<(), ApiError> {
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::invalid(format!(
            "`messages` may hold at most {MAX_MESSAGES} messages"
        )));
    }
    if messages.iter().any(|m| {
        m.content
            .as_ref()
            .is_some_and(|c| c.len() > MAX_MESSAGE_BYTES)
    }) {
        return Err(ApiError::invalid(format!(
            "a message may hold at most {} KiB of text",
            MAX_MESSAGE_BYTES / 1024
        )));
    }
    Ok(())
}

/// A chat completion through an agent (see the module docs).
#[utoipa::path(
    tag = "openai",
    request_body = ChatRequest,
    responses(
        (status = 200, description = "A chat.completion, or with `\"stream\": true` chat.completion.chunk server-sent events ending in `data: [DONE]`", content(
            (ChatCompletion = "application/json"),
            (crate::openapi::SseEvent = "text/event-stream"),
        )),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "No agent of that name (`model`)", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/chat/completions")]
pub async fn chat_completions(
    caller: TenantCaller,
    state: web::Data<AppState>,
    body: web::Json<ChatRequest>,
) -> Result<HttpResponse, ApiError> {
    let req = body.into_inner();
    check_messages(&req.messages)?;
    let mut turn = Turn::open(
        state.into_inner(),
        caller.0,
        &req.model,
        req.user.as_deref(),
    )
    .await?;
    unsupported(&req)?;
    let system: Vec<&str> = req
        .messages
        .iter()
        .filter(|m| m.role == "system" || m.role == "developer")
        .filter_map(|m| m.content.as_deref())
        .collect();
    turn.add_system_text(&system.join("\n"));
    let Some((last, earlier)) = req.messages.split_last() else {
        return Err(ApiError::invalid("`messages` is empty"));
    };
    let message = match (last.role.as_str(), &last.content) {
        ("user", Some(text)) => text.clone(),
        // A tool's result, which the model answers next. In a session, the tool results after
        // the request's last other message are logged with the turn (the log holds the rest
        // of the conversation).
        ("tool", Some(text)) => {
            turn.message_speaker = Speaker::Tool;
            if req.user.is_some() {
                let results: Vec<&Message> = earlier
                    .iter()
                    .rev()
                    .take_while(|m| m.role == "tool")
                    .collect();
                turn.preface = results
                    .into_iter()
                    .rev()
                    .map(|m| m.content.clone().unwrap_or_default())
                    .collect();
            }
            text.clone()
        }
        _ => {
            return Err(ApiError::invalid(
                "the last message must be the user's or a tool's, with text content",
            ));
        }
    };
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(0.0),
        top_p: req.top_p.unwrap_or(1.0),
        seed: req.seed.unwrap_or(0),
        max_tokens: req.max_completion_tokens.or(req.max_tokens).unwrap_or(256),
        stop: stop_of(&req.stop)?,
        ..SamplingParams::default()
    };
    sampling.validate().map_err(ApiError::from)?;
    turn.reply = sampling.max_tokens;
    // A `user` session runs one turn at a time, as on the native route.
    let session_slot = turn.hold_session().await?;
    let slot = turn.state.limits.begin_generation(&turn.tenant.id)?;
    let turned = if turn.session.is_some() {
        turn.admit(&message).await?;
        let stored = turn.history().await?;
        // Tool results before the message: in the prompt now, logged with the turn.
        let now = engram_memory::now_ms();
        let mut log = stored.clone();
        for t in &turn.preface {
            log.said.push(said_of(Role::Tool, None, t));
            log.created.push(now);
        }
        // What the cache lost (of the stored log) is replayed while the memories are
        // recalled.
        turn.prepare(Some(&stored), log, &message).await?
    } else {
        turn.state.engine()?;
        // A stateless conversation's KV is filed under a key of its first user message.
        turn.kv_session = Some(conversation_key(&turn, &req.messages));
        let log = Log::unstored(earlier.iter().filter_map(said).collect());
        let started = std::time::Instant::now();
        let turned = turn.context(log, &message).await?;
        turn.prepare_ms = started.elapsed().as_secs_f64() * 1e3;
        turned
    };
    let spec = turn.spec(&turned.built, |_| true)?;
    let chunks = Chunks {
        id: completion_id(),
        created: now_s(),
        model: turn.agent.name.clone(),
    };
    if req.stream {
        let held = (slot, session_slot);
        return stream::pump(turn, message, turned, spec, sampling, held, chunks);
    }
    let g = generate(&turn.state, spec, sampling).await?;
    turn.observe(&g);
    // No `Idempotency-Key` here (the native route has it): nothing is stored with the turn.
    turn.record(&message, &turned, &g, "").await?;
    Ok(HttpResponse::Ok().json(ChatCompletion {
        id: chunks.id,
        object: "chat.completion".into(),
        created: chunks.created,
        model: chunks.model,
        choices: vec![ChatChoice {
            index: 0,
            message: ChatReply {
                role: "assistant".into(),
                content: g.text,
            },
            finish_reason: finish(g.reason).into(),
        }],
        usage: usage_of(&g.usage),
    }))
}

/// Parameters the route cannot honour: 400 `unsupported_parameter` rather than ignored.
fn unsupported(req: &ChatRequest) -> Result<(), ApiError> {
    let refuse = |what: &str| {
        Err(ApiError::new(
            actix_web::http::StatusCode::BAD_REQUEST,
            "unsupported_parameter",
            what.to_string(),
        ))
    };
    if req.n.is_some_and(|n| n != 1) {
        return refuse("`n` must be 1: one choice is generated per request");
    }
    if req.logprobs == Some(true) || req.top_logprobs.is_some() {
        return refuse("log probabilities are not returned (`logprobs`, `top_logprobs`)");
    }
    let no_tools = match &req.tools {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    };
    if !no_tools {
        return refuse("`tools`: the model's chat template has no tool format");
    }
    Ok(())
}

/// A completion id no other completion of this process or another has: the time in
/// nanoseconds and a per-process sequence number.
fn completion_id() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!(
        "chatcmpl-{nanos:x}{seq:04x}{:04x}",
        std::process::id() & 0xffff
    )
}

/// `stop`: absent, a string or a list of strings.
fn stop_of(stop: &Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid("`stop` must be a string or a list of strings");
    match stop {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad),
        Some(_) => Err(bad()),
    }
}

/// An earlier `user`, `assistant` or `tool` message as a turn of the conversation; an
/// assistant's tool calls follow its text as `<tool_call>{json}</tool_call>` lines.
fn said(m: &Message) -> Option<Said> {
    let speaker = match m.role.as_str() {
        "user" => Speaker::User,
        "assistant" => Speaker::Assistant,
        "tool" => Speaker::Tool,
        _ => return None,
    };
    let mut text = m.content.clone().unwrap_or_default();
    if let Some(Value::Array(calls)) = &m.tool_calls {
        for call in calls {
            let f = &call["function"];
            let args = match &f["arguments"] {
                Value::String(s) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
                other => other.clone(),
            };
            let line = json!({"name": f["name"], "arguments": args});
            text.push_str(&format!("\n<tool_call>\n{line}\n</tool_call>"));
        }
    }
    Some(Said {
        speaker,
        text: text.trim_start().to_string(),
    })
}

/// The key a stateless conversation's KV is filed (and shadowed) under: the agent's and the
/// conversation's first user message. A client session of the same name would only share the
/// shadow's chain record: blocks are found by their content hash, never by this key.
fn conversation_key(turn: &Turn, messages: &[Message]) -> engram_kvcore::SessionId {
    let first = messages
        .iter()
        .find(|m| m.role == "user")
        .and_then(|m| m.content.as_deref())
        .unwrap_or_default();
    let h = Sha256::digest(first.as_bytes());
    let hex: String = h[..16].iter().map(|b| format!("{b:02x}")).collect();
    session_key(&turn.agent, &format!("\0conversation/{hex}"))
}

/// OpenAI's streaming framing: `chat.completion.chunk`s, then `data: [DONE]`.
struct Chunks {
    id: String,
    created: u64,
    model: String,
}

impl Chunks {
    fn chunk(&self, delta: Value, reason: Option<&str>, usage: Option<Value>) -> String {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        stream::event(&v)
    }
}

impl Framing for Chunks {
    fn start(&mut self) -> Option<String> {
        Some(self.chunk(json!({"role": "assistant", "content": ""}), None, None))
    }

    fn delta(&mut self, text: &str) -> String {
        self.chunk(json!({"content": text}), None, None)
    }

    fn reply(&self, _: &Generated) -> String {
        String::new()
    }

    fn done(&mut self, g: &Generated, recorded: Result<(), ApiError>) -> Vec<String> {
        match recorded {
            Ok(()) => vec![
                self.chunk(
                    json!({}),
                    Some(finish(g.reason)),
                    Some(usage_json(&g.usage)),
                ),
                "data: [DONE]\n\n".to_string(),
            ],
            Err(e) => vec![stream::error_event(&e)],
        }
    }
}
