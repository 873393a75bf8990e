//! OpenAI-compatible endpoints, so agent frameworks work unchanged.
//!
//! How the official SDK names an agent and a session:
//! - `model` is the **agent** when it names one of the caller's agents (by name or id); any
//!   other name — the served model's, which `GET /v1/models` lists first, or whatever a
//!   framework sends — selects the tenant's default agent, `default`, created with no layers
//!   on first use;
//! - `user` (a standard request field) is the **session**: with it, the conversation comes from
//!   the session's durable turn log and the turn is appended to it; the request's earlier
//!   messages are ignored. Any string of up to 256 bytes: one that is not a session name is
//!   hashed into one (`u-…`) and kept as the session's label. Without it, the request is
//!   stateless: the earlier `user`/`assistant` messages are the conversation and nothing is
//!   stored in the turn log. Its KV is still cached, and shadowed under a key of the agent and
//!   the conversation's first user message, so that a restart keeps a stateless conversation
//!   warm too.
//!
//! Both kinds of request take the native route's steps (`crate::turn`): a session's lost turns
//! are replayed before its prompt is built, exactly as on `POST …/turns`.
//!
//! The last message must be the user's or a tool's result (which the model then answers).
//! `system` and `developer` messages, and the tool definitions, are the request's own system
//! text: one stable segment after the agent's stable layers, as written (never cut to a layer's
//! budget; a prompt that cannot hold it answers 400 with the sizes), cached and pinned with the
//! stable prefix so a request that repeats them reuses them. In a stateless request, `tool`
//! messages stay in the conversation with the `tool` role and an assistant's `tool_calls`
//! follow its text as `<tool_call>{json}</tool_call>` blocks, as the model wrote them. In a
//! session, the tool results that end the request (after its last other message) are logged
//! with the turn in the `tool` role, before its reply, and replayed like any turn.
//!
//! Tools, `tool_choice` and `response_format` are described in `api/tools.rs`: the reply's
//! calls come back as `tool_calls` (and `finish_reason: "tool_calls"`), in the JSON answer and
//! the stream alike; a forced call or a JSON answer is constrained by a grammar.
//!
//! A message's content is a string or an array of text parts (image, audio and file parts
//! answer 400 `unsupported_content`). `temperature` defaults to OpenAI's 1. `logprobs` and
//! `top_logprobs` (≤ 20), `presence_penalty`, `frequency_penalty`, `logit_bias`, `min_p`,
//! `seed` (same seed, same text) and `stop` (≤ 4) apply. Unknown fields are ignored, as OpenAI
//! does; `n` other than 1 answers 400 `unsupported_parameter` instead of being ignored.
//! `usage.prompt_tokens_details.cached_tokens` reports the prompt tokens reused from the KV
//! cache. `stream: true` answers `chat.completion.chunk` events and `data: [DONE]`; a failure,
//! or a turn that could not be recorded (its session deleted meanwhile), ends the stream with
//! `data: {"error": …}` instead.

use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::{HttpResponse, get, post, web};
use engram_engine::{FinishReason, SamplingParams, Usage};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::chat;
use crate::api::stream::{self, Framing};
use crate::api::tools::{self, Tools};
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::Generated;

/// One chat message, as a client sends it.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct Message {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// A string, or an array of content parts: `{"type": "text", "text": …}` parts are joined
    /// by newlines; image, audio and file parts answer 400 `unsupported_content` (the served
    /// model reads text only).
    #[schema(value_type = Option<Object>)]
    pub content: Option<Value>,
    /// An assistant message's tool calls (rendered into the conversation as
    /// `<tool_call>{json}</tool_call>` lines).
    #[schema(value_type = Option<Object>)]
    pub tool_calls: Option<Value>,
    /// A tool message's call id.
    pub tool_call_id: Option<String>,
}

/// The text of a message's `content`: a string as is; an array's text parts joined by
/// newlines. Any other part is refused: an image or audio part with `unsupported_content`, a
/// part of no known type as invalid.
fn text_of(content: &Option<Value>) -> Result<Option<String>, ApiError> {
    let parts = match content {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => return Ok(Some(s.clone())),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            return Err(ApiError::invalid(
                "a message's `content` must be a string or an array of content parts",
            ));
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
        match kind {
            "text" | "input_text" | "output_text" => match part.get("text") {
                Some(Value::String(t)) => texts.push(t.as_str()),
                _ => return Err(ApiError::invalid("a text part needs a string `text`")),
            },
            "image_url" | "input_image" | "image" | "input_audio" | "audio" | "file"
            | "input_file" => {
                return Err(ApiError::new(
                    actix_web::http::StatusCode::BAD_REQUEST,
                    "unsupported_content",
                    format!(
                        "`{kind}` content parts are not supported: the served model reads text only"
                    ),
                ));
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "unknown content part type `{kind}` (text parts only)"
                )));
            }
        }
    }
    Ok(Some(texts.join("\n")))
}

/// The request's messages with their contents as text.
fn texts_of(messages: &[Message]) -> Result<Vec<chat::Msg>, ApiError> {
    messages
        .iter()
        .map(|m| {
            Ok(chat::Msg {
                role: m.role.clone(),
                content: text_of(&m.content)?,
                tool_calls: m.tool_calls.clone(),
            })
        })
        .collect()
}

/// Body of `POST /v1/chat/completions` (unknown OpenAI fields are accepted and ignored).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct ChatRequest {
    /// An agent's name or id, or any other name (the served model's, say): the tenant's
    /// default agent, `default`, created with no layers on first use.
    pub model: String,
    /// The conversation; the last message is the new user message.
    pub messages: Vec<Message>,
    /// The session (optional): any string of 1–256 bytes. A valid session name (1–64 letters,
    /// digits, `-`, `_`) is the session's name; any other string names the session
    /// `u-{first 40 hex digits of its SHA-256}`, with the string kept as the session's label.
    pub user: Option<String>,
    /// Streaming.
    #[serde(default)]
    pub stream: bool,
    /// Tokens to generate at most (`max_completion_tokens` is accepted too).
    pub max_tokens: Option<usize>,
    /// Alias of `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    /// Temperature: OpenAI's default, 1, when absent (0 is greedy).
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Seed.
    pub seed: Option<u64>,
    /// Stop: a string or a list.
    #[schema(value_type = Option<Object>)]
    pub stop: Option<Value>,
    /// Choices to generate, 1 to 8 (default 1): each with its own seed (`seed` plus its index),
    /// over one prefill of the prompt; the first is the session's reply. Not streamed (`n` > 1
    /// with `stream` answers 400 `unsupported_parameter`).
    pub n: Option<u32>,
    /// Each generated token's log probability (the model's own, before sampling's changes).
    pub logprobs: Option<bool>,
    /// With `logprobs`, the 0–20 most likely alternatives at each token.
    pub top_logprobs: Option<u32>,
    /// Functions the model may call (`{"type": "function", "function": {name, description,
    /// parameters}}`), written into the system message by the model's own template.
    #[schema(value_type = Option<Object>)]
    pub tools: Option<Value>,
    /// `auto` (the default with tools), `none`, `required`, or `{"type": "function",
    /// "function": {"name": …}}`; `required` and a named function constrain the reply to calls
    /// whose arguments validate against the function's `parameters`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// With `required`, whether one reply may hold several calls (default true).
    pub parallel_tool_calls: Option<bool>,
    /// `{"type": "text"}`, `{"type": "json_object"}` (any JSON object) or `{"type":
    /// "json_schema", "json_schema": {"name": …, "schema": {…}}}`: the answer is constrained to
    /// JSON that validates against the schema.
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    /// −2 to 2: subtracted once from the logit of every token generated so far.
    pub presence_penalty: Option<f32>,
    /// −2 to 2: subtracted from a token's logit times its count so far.
    pub frequency_penalty: Option<f32>,
    /// Token id (a decimal string) → bias, −100 to 100, added to its logit.
    #[schema(value_type = Option<Object>)]
    pub logit_bias: Option<Value>,
    /// 0 to 1: drop tokens less likely than this fraction of the most likely one.
    pub min_p: Option<f32>,
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
    /// With `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs}]}`, else null.
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<Value>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: String,
}

/// The assistant's reply.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ChatReply {
    /// `assistant`.
    pub role: String,
    /// The text (null when the reply is only tool calls).
    pub content: Option<String>,
    /// The calls the reply makes: `{id, type: "function", function: {name, arguments}}`, the
    /// arguments a JSON text.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Vec<Value>>,
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

/// OpenAI's model list: the served model, then the caller's agents.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ModelList {
    /// `list`.
    pub object: &'static str,
    /// The served model (first page only), then one per agent.
    pub data: Vec<ModelEntry>,
    /// The `cursor` of the next page (null on the last).
    pub next_cursor: Option<String>,
}

/// The served model, or one agent, as an OpenAI model.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ModelEntry {
    /// The served model's file name, or an agent's name (the `model` of a chat request).
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Creation time, s since the epoch (0 for the served model).
    pub created: i64,
    /// `engram`.
    pub owned_by: &'static str,
    /// The checkpoint every agent is served by: its file (or directory) name, as `model.path`
    /// names it (vLLM's field for the underlying model).
    pub root: String,
}

/// The served model, then the caller's agents as models, oldest first: the first 1,000 agents
/// unless `limit` says otherwise, the rest through `cursor` (the answer's `next_cursor`).
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
    let root = state
        .config
        .model
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // The served model is the list's first row (the name a client that knows no agent sends,
    // which selects the tenant's default agent): the first page holds it and `limit - 1`
    // agents, so every page holds `limit` rows at most.
    let first = page.cursor.is_none() && !root.is_empty();
    let (agents, next_cursor) = match (first, page.limit) {
        (true, Some(1)) => {
            // Only the served model fits: the next page starts before the first agent.
            page.bounds()?;
            let any = state.store.agents_page(&caller.0.id, None, 1).await?;
            let next = (!any.is_empty()).then(|| crate::pages::cursor(i64::MIN, "0"));
            (Vec::new(), next)
        }
        (true, limit) => {
            page.bounds()?;
            let rest = crate::pages::ListPage {
                limit: limit.map(|l| l - 1),
                cursor: None,
            };
            crate::pages::agents(&state.store, &caller.0.id, &rest).await?
        }
        (false, _) => crate::pages::agents(&state.store, &caller.0.id, &page).await?,
    };
    let served = first.then(|| ModelEntry {
        id: root.clone(),
        object: "model",
        created: 0,
        owned_by: "engram",
        root: root.clone(),
    });
    let data: Vec<ModelEntry> = served
        .into_iter()
        .chain(agents.into_iter().map(|a| ModelEntry {
            id: a.name,
            object: "model",
            created: a.created_at / 1000,
            owned_by: "engram",
            root: root.clone(),
        }))
        .collect();
    Ok(HttpResponse::Ok().json(ModelList {
        object: "list",
        data,
        next_cursor,
    }))
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
    let messages = texts_of(&req.messages)?;
    unsupported(&req)?;
    let tools = Tools::parse(
        req.tools.as_ref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
    )?;
    let logprobs = logprobs_of_request(&req)?;
    let vocab = state.engine()?.model_config().vocab_size;
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        min_p: req.min_p.unwrap_or(0.0),
        presence_penalty: req.presence_penalty.unwrap_or(0.0),
        frequency_penalty: req.frequency_penalty.unwrap_or(0.0),
        logit_bias: chat::logit_bias_of(&req.logit_bias, vocab)?,
        logprobs,
        seed: req.seed.unwrap_or(0),
        max_tokens: req.max_completion_tokens.or(req.max_tokens).unwrap_or(256),
        stop: chat::stop_of(&req.stop)?,
        ..SamplingParams::default()
    };
    let offered = tools.offered();
    let names = tools.names();
    let n = req.n.unwrap_or(1) as usize;
    let input = chat::ChatInput {
        model: req.model,
        messages,
        user: req.user,
        appends: false,
        tools,
        response_format: req.response_format,
        sampling,
        n,
    };
    let p = chat::prepare(state.into_inner(), caller.0, input).await?;
    let chunks = Chunks {
        id: completion_id(),
        created: now_s(),
        model: p.turn.agent.name.clone(),
        tokenizer: p.turn.state.engine()?.tokenizer().clone(),
        tools: offered,
        scanner: tools::Scanner::for_tools(names.clone()),
    };
    if req.stream {
        return stream::pump(p.turn, p.message, p.turned, p.job, p.held, chunks);
    }
    let (_, all) = chat::run_choices(p).await?;
    let choices = all
        .iter()
        .enumerate()
        .map(|(index, g)| {
            let (content, calls) = if offered {
                tools::parse_reply(&g.text, &names)
            } else {
                (g.text.clone(), Vec::new())
            };
            let finish_reason = if calls.is_empty() {
                finish(g.reason)
            } else {
                "tool_calls"
            };
            // Call ids are unique to the completion: the choice's index is in them.
            let tool_calls = (!calls.is_empty()).then(|| {
                calls
                    .iter()
                    .enumerate()
                    .map(|(i, c)| tool_call_json(&chunks.id, index * 100 + i, c))
                    .collect()
            });
            ChatChoice {
                index: index as u32,
                message: ChatReply {
                    role: "assistant".into(),
                    content: (tool_calls.is_none() || !content.is_empty()).then_some(content),
                    tool_calls,
                },
                logprobs: logprobs.map(|_| json!({"content": chunks.logprobs_json(&g.logprobs)})),
                finish_reason: finish_reason.into(),
            }
        })
        .collect();
    // The prompt once; the completions of every choice.
    let mut usage = all[0].usage;
    usage.completion_tokens = all.iter().map(|g| g.usage.completion_tokens).sum();
    Ok(HttpResponse::Ok().json(ChatCompletion {
        id: chunks.id,
        object: "chat.completion".into(),
        created: chunks.created,
        model: chunks.model,
        choices,
        usage: usage_of(&usage),
    }))
}

/// A call as OpenAI writes it: an id unique to the completion, the function, its arguments as
/// a JSON text.
fn tool_call_json(completion: &str, index: usize, c: &tools::Call) -> Value {
    let tail = completion.trim_start_matches("chatcmpl-");
    json!({
        "id": format!("call_{tail}_{index}"),
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    })
}

/// Parameters the route cannot honour: 400 `unsupported_parameter` rather than ignored.
fn unsupported(req: &ChatRequest) -> Result<(), ApiError> {
    if req.stream && req.n.is_some_and(|n| n > 1) {
        return Err(ApiError::new(
            actix_web::http::StatusCode::BAD_REQUEST,
            "unsupported_parameter",
            "`n` > 1 is answered whole: streamed, a request has one choice",
        ));
    }
    Ok(())
}

/// What the request asks of `logprobs` / `top_logprobs`.
fn logprobs_of_request(req: &ChatRequest) -> Result<Option<usize>, ApiError> {
    match (req.logprobs, req.top_logprobs) {
        (Some(true), top) => Ok(Some(top.unwrap_or(0) as usize)),
        (_, Some(_)) => Err(ApiError::invalid("`top_logprobs` needs `logprobs: true`")),
        _ => Ok(None),
    }
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

/// OpenAI's streaming framing: `chat.completion.chunk`s, then `data: [DONE]`. With tools
/// offered, text that may begin a tool call is held back until it is known: a complete call is
/// sent as one `tool_calls` delta (id, name and the whole arguments), anything else as content.
struct Chunks {
    id: String,
    created: u64,
    model: String,
    tokenizer: engram_engine::TextTokenizer,
    /// Tools were offered: the reply is parsed for calls.
    tools: bool,
    /// The reply split into content and calls.
    scanner: tools::Scanner,
}

impl Chunks {
    fn chunk(&self, delta: Value, reason: Option<&str>, usage: Option<Value>) -> String {
        self.chunk_with(delta, reason, usage, None)
    }

    fn chunk_with(
        &self,
        delta: Value,
        reason: Option<&str>,
        usage: Option<Value>,
        logprobs: Option<Value>,
    ) -> String {
        let mut choice = json!({"index": 0, "delta": delta, "finish_reason": reason});
        if let Some(l) = logprobs {
            choice["logprobs"] = l;
        }
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        stream::event(&v)
    }

    /// OpenAI's entry for one token: its text, log probability, bytes and alternatives.
    fn logprobs_json(&self, lps: &[engram_engine::TokenLogprob]) -> Vec<Value> {
        let piece = |t: u32| self.tokenizer.decode(&[t]).unwrap_or_default();
        let entry = |t: u32, lp: f32| {
            let text = piece(t);
            json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
        };
        lps.iter()
            .map(|l| {
                let mut e = entry(l.token, l.logprob);
                e["top_logprobs"] = Value::Array(l.top.iter().map(|&(t, p)| entry(t, p)).collect());
                e
            })
            .collect()
    }

    /// The deltas for what of the reply is known (`end`: all of it): content, and each
    /// complete call.
    fn release(&mut self, text: &str, end: bool) -> Vec<Value> {
        self.scanner
            .feed(text, end)
            .into_iter()
            .map(|p| match p {
                tools::Piece::Text(t) => json!({"content": t}),
                tools::Piece::Call(n, call) => {
                    let mut c = tool_call_json(&self.id, n, &call);
                    c["index"] = json!(n);
                    json!({"tool_calls": [c]})
                }
            })
            .collect()
    }
}

impl Framing for Chunks {
    fn start(&mut self) -> Option<String> {
        Some(self.chunk(json!({"role": "assistant", "content": ""}), None, None))
    }

    fn delta(&mut self, text: &str, logprobs: &[engram_engine::TokenLogprob]) -> String {
        let lp = (!logprobs.is_empty()).then(|| json!({"content": self.logprobs_json(logprobs)}));
        if !self.tools {
            return self.chunk_with(json!({"content": text}), None, None, lp);
        }
        let deltas = self.release(text, false);
        let mut frames: String = deltas
            .into_iter()
            .map(|d| self.chunk(d, None, None))
            .collect();
        if let Some(lp) = lp {
            frames.push_str(&self.chunk_with(json!({}), None, None, Some(lp)));
        }
        frames
    }

    fn reply(&self, _: &Generated) -> String {
        String::new()
    }

    fn done(&mut self, g: &Generated, recorded: Result<(), ApiError>) -> Vec<String> {
        match recorded {
            Ok(()) => {
                let mut frames: Vec<String> = self
                    .release("", true)
                    .into_iter()
                    .map(|d| self.chunk(d, None, None))
                    .collect();
                let reason = if self.scanner.calls > 0 {
                    "tool_calls"
                } else {
                    finish(g.reason)
                };
                frames.push(self.chunk(json!({}), Some(reason), Some(usage_json(&g.usage))));
                frames.push("data: [DONE]\n\n".to_string());
                frames
            }
            Err(e) => vec![stream::error_event(&e)],
        }
    }
}
