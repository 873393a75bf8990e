//! Anthropic's Messages API, `POST /v1/messages` and `POST /v1/messages/count_tokens`, over the
//! same chat turn as the OpenAI route (`api/chat.rs`), so Claude-style harnesses and the
//! official `anthropic` SDK work unchanged (the SDK's `x-api-key` header is the tenant key).
//!
//! `model` selects an agent as on the OpenAI route (any other name: the default agent);
//! `system` (a string or text blocks) is the request's system text; content blocks are `text`,
//! `tool_use` (an assistant's call) and `tool_result` (its result, in the next user message);
//! image and document blocks answer 400 `unsupported_content`. `tools` (`name`, `description`,
//! `input_schema`) and `tool_choice` (`auto`, `any` — a call is forced, constrained to the
//! schema —, `tool` with a `name`, `none`) as in `api/tools.rs`. A conversation is stateless
//! (the harness resends it; its KV is reused by content). `stream: true` answers Anthropic's
//! events: `message_start`, `content_block_start` / `_delta` / `_stop` per block (a tool call
//! is one `input_json_delta`), `message_delta` with the stop reason and `message_stop`.

use actix_web::{HttpResponse, post, web};
use engram_engine::{FinishReason, SamplingParams};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::chat::{self, Msg};
use crate::api::stream::{self, Framing};
use crate::api::tools::{self, Tools};
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::Generated;

/// One message of a Messages request.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct AnthropicMessage {
    /// `user` or `assistant`.
    pub role: String,
    /// A string or content blocks.
    #[schema(value_type = Object)]
    pub content: Value,
}

/// Body of `POST /v1/messages` (unknown fields are ignored).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct MessagesRequest {
    /// An agent's name or id, or any other name (the tenant's default agent).
    pub model: String,
    /// Tokens to generate at most (required, as Anthropic's API has it).
    pub max_tokens: usize,
    /// The conversation.
    pub messages: Vec<AnthropicMessage>,
    /// System text: a string or text blocks.
    #[schema(value_type = Option<Object>)]
    pub system: Option<Value>,
    /// Up to four stop sequences.
    pub stop_sequences: Option<Vec<String>>,
    /// Default 1.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens.
    pub top_k: Option<usize>,
    /// Anthropic's server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Tools: `{name, description, input_schema}`.
    #[schema(value_type = Option<Object>)]
    pub tools: Option<Value>,
    /// `{"type": "auto" | "any" | "tool" | "none", "name": …, "disable_parallel_tool_use": …}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
}

/// Body of `POST /v1/messages/count_tokens`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct CountTokensRequest {
    /// As in a Messages request.
    pub model: String,
    /// As in a Messages request.
    pub messages: Vec<AnthropicMessage>,
    /// As in a Messages request.
    #[schema(value_type = Option<Object>)]
    pub system: Option<Value>,
    /// As in a Messages request.
    #[schema(value_type = Option<Object>)]
    pub tools: Option<Value>,
    /// As in a Messages request.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
}

fn unsupported_content(kind: &str) -> ApiError {
    ApiError::new(
        actix_web::http::StatusCode::BAD_REQUEST,
        "unsupported_content",
        format!("`{kind}` blocks are not supported: the served model reads text only"),
    )
}

/// The text of a string or of text blocks.
fn text_of(v: &Value, what: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = Vec::new();
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => out.push(
                        b.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| ApiError::invalid("a text block needs `text`"))?,
                    ),
                    Some(k @ ("image" | "document")) => return Err(unsupported_content(k)),
                    _ => return Err(ApiError::invalid(format!("{what}: text blocks only"))),
                }
            }
            Ok(out.join("\n"))
        }
        Value::Null => Ok(String::new()),
        _ => Err(ApiError::invalid(format!(
            "{what} must be a string or content blocks"
        ))),
    }
}

/// The conversation as chat messages: the system text first, each user message's tool results
/// as `tool` messages before its text, an assistant's `tool_use` blocks as its calls.
fn messages_of(
    system: &Option<Value>,
    messages: &[AnthropicMessage],
) -> Result<Vec<Msg>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = system {
        let text = text_of(s, "`system`")?;
        if !text.is_empty() {
            out.push(Msg {
                role: "system".into(),
                content: Some(text),
                tool_calls: None,
            });
        }
    }
    for m in messages {
        let blocks: Vec<Value> = match &m.content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            _ => {
                return Err(ApiError::invalid(
                    "`content` must be a string or content blocks",
                ));
            }
        };
        let mut texts = Vec::new();
        let mut calls = Vec::new();
        for b in &blocks {
            match b.get("type").and_then(Value::as_str).unwrap_or_default() {
                "text" => texts.push(
                    b.get("text")
                        .and_then(Value::as_str)
                        .ok_or_else(|| ApiError::invalid("a text block needs `text`"))?
                        .to_string(),
                ),
                "tool_use" if m.role == "assistant" => {
                    let name = b
                        .get("name")
                        .and_then(Value::as_str)
                        .ok_or_else(|| ApiError::invalid("a `tool_use` block needs a `name`"))?;
                    let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                    calls.push(json!({
                        "id": b.get("id").cloned().unwrap_or(Value::Null),
                        "type": "function",
                        "function": {"name": name, "arguments": input.to_string()},
                    }));
                }
                "tool_result" if m.role == "user" => {
                    let mut text =
                        text_of(b.get("content").unwrap_or(&Value::Null), "a tool result")?;
                    if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                        text = format!("Error: {text}");
                    }
                    out.push(Msg {
                        role: "tool".into(),
                        content: Some(text),
                        tool_calls: None,
                    });
                }
                k @ ("image" | "document") => return Err(unsupported_content(k)),
                k => {
                    return Err(ApiError::invalid(format!(
                        "a `{}` message cannot hold a `{k}` block",
                        m.role
                    )));
                }
            }
        }
        match m.role.as_str() {
            "user" => {
                if !texts.is_empty() {
                    out.push(Msg {
                        role: "user".into(),
                        content: Some(texts.join("\n")),
                        tool_calls: None,
                    });
                }
            }
            "assistant" => out.push(Msg {
                role: "assistant".into(),
                content: Some(texts.join("\n")),
                tool_calls: (!calls.is_empty()).then(|| Value::Array(calls)),
            }),
            other => {
                return Err(ApiError::invalid(format!(
                    "role `{other}`: user or assistant"
                )));
            }
        }
    }
    Ok(out)
}

/// Anthropic's tools and choice in OpenAI's form.
fn tools_of(tools: &Option<Value>, choice: &Option<Value>) -> Result<Tools, ApiError> {
    let defs: Option<Value> = match tools {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => Some(Value::Array(
            list.iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t.get("name").cloned().unwrap_or(Value::Null),
                        "description": t.get("description").cloned().unwrap_or(Value::Null),
                        "parameters": t.get("input_schema").cloned().unwrap_or(Value::Null),
                    }})
                })
                .collect(),
        )),
        Some(_) => return Err(ApiError::invalid("`tools` must be a list")),
    };
    let (openai_choice, parallel) = match choice {
        None | Some(Value::Null) => (None, None),
        Some(c) => {
            let parallel = c
                .get("disable_parallel_tool_use")
                .and_then(Value::as_bool)
                .map(|d| !d);
            let mapped = match c.get("type").and_then(Value::as_str) {
                Some("auto") => json!("auto"),
                Some("any") => json!("required"),
                Some("none") => json!("none"),
                Some("tool") => {
                    json!({"type": "function", "function": {"name": c.get("name").cloned().unwrap_or(Value::Null)}})
                }
                _ => {
                    return Err(ApiError::invalid(
                        "`tool_choice.type`: auto, any, tool or none",
                    ));
                }
            };
            (Some(mapped), parallel)
        }
    };
    Tools::parse(defs.as_ref(), openai_choice.as_ref(), parallel)
}

fn message_id() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("msg_{nanos:x}{seq:04x}{:04x}", std::process::id() & 0xffff)
}

fn usage_of(g: &Generated) -> Value {
    let u = &g.usage;
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

fn stop_reason(g: &Generated, calls: usize) -> &'static str {
    if calls > 0 {
        "tool_use"
    } else if g.stop_sequence.is_some() {
        "stop_sequence"
    } else {
        match g.reason {
            FinishReason::Stop => "end_turn",
            FinishReason::Length => "max_tokens",
        }
    }
}

fn tool_use_block(id: &str, i: usize, c: &tools::Call, input: bool) -> Value {
    let tail = id.trim_start_matches("msg_");
    let args: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({
        "type": "tool_use",
        "id": format!("toolu_{tail}_{i}"),
        "name": c.name,
        "input": if input { args } else { json!({}) },
    })
}

fn chat_input(req: &MessagesRequest, state: &AppState) -> Result<chat::ChatInput, ApiError> {
    if req.max_tokens == 0 {
        return Err(ApiError::invalid("`max_tokens` must be at least 1"));
    }
    let tools = tools_of(&req.tools, &req.tool_choice)?;
    state.engine()?;
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        top_k: req.top_k.unwrap_or(0),
        max_tokens: req.max_tokens,
        stop: match &req.stop_sequences {
            Some(s) => chat::stop_of(&Some(json!(s)))?,
            None => Vec::new(),
        },
        ..SamplingParams::default()
    };
    Ok(chat::ChatInput {
        model: req.model.clone(),
        messages: messages_of(&req.system, &req.messages)?,
        user: None,
        appends: false,
        tools,
        response_format: None,
        sampling,
        n: 1,
    })
}

/// A message through an agent (see the module docs).
#[utoipa::path(
    tag = "anthropic",
    request_body = MessagesRequest,
    responses(
        (status = 200, description = "An Anthropic `message`, or with `\"stream\": true` its server-sent events"),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/messages")]
pub async fn create_message(
    caller: TenantCaller,
    state: web::Data<AppState>,
    body: web::Json<MessagesRequest>,
) -> Result<HttpResponse, ApiError> {
    let req = body.into_inner();
    let input = chat_input(&req, &state)?;
    let offered = input.tools.offered();
    let names = input.tools.names();
    let p = chat::prepare(state.into_inner(), caller.0, input).await?;
    let id = message_id();
    let model = p.turn.agent.name.clone();
    if req.stream {
        let events = Events {
            id,
            model,
            tools: offered,
            scanner: tools::Scanner::for_tools(names.clone()),
            open: None,
            blocks: 0,
        };
        return stream::pump(p.turn, p.message, p.turned, p.job, p.held, events);
    }
    let (_, g) = chat::run(p).await?;
    let (text, calls) = if offered {
        tools::parse_reply(&g.text, &names)
    } else {
        (g.text.clone(), Vec::new())
    };
    let mut content = Vec::new();
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    for (i, c) in calls.iter().enumerate() {
        content.push(tool_use_block(&id, i, c, true));
    }
    Ok(HttpResponse::Ok().json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(&g, calls.len()),
        "stop_sequence": g.stop_sequence,
        "usage": usage_of(&g),
    })))
}

/// The tokens a Messages request's prompt would take, as the agent builds it.
#[utoipa::path(
    tag = "anthropic",
    request_body = CountTokensRequest,
    responses(
        (status = 200, description = "`{\"input_tokens\": n}`"),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/messages/count_tokens")]
pub async fn count_tokens(
    caller: TenantCaller,
    state: web::Data<AppState>,
    body: web::Json<CountTokensRequest>,
) -> Result<HttpResponse, ApiError> {
    let b = body.into_inner();
    let req = MessagesRequest {
        model: b.model,
        max_tokens: 1,
        messages: b.messages,
        system: b.system,
        stop_sequences: None,
        temperature: None,
        top_p: None,
        top_k: None,
        stream: false,
        tools: b.tools,
        tool_choice: b.tool_choice,
    };
    let mut input = chat_input(&req, &state)?;
    // Counting compiles no grammar: the prompt is the same with or without one.
    if input.tools.constraint_needed() {
        input.tools.choice = tools::Choice::Auto;
    }
    input.user = None;
    let p = chat::prepare(state.into_inner(), caller.0, input).await?;
    let n: usize = p.job.spec.segments.iter().map(|s| s.tokens.len()).sum();
    Ok(HttpResponse::Ok().json(json!({"input_tokens": n})))
}

/// Anthropic's streaming framing (see the module docs).
struct Events {
    id: String,
    model: String,
    tools: bool,
    scanner: tools::Scanner,
    /// The index of the text block open, if one is.
    open: Option<usize>,
    /// Blocks started so far.
    blocks: usize,
}

fn event(kind: &str, data: Value) -> String {
    format!("event: {kind}\ndata: {data}\n\n")
}

impl Events {
    fn text(&mut self, t: &str) -> String {
        let mut out = String::new();
        let index = match self.open {
            Some(i) => i,
            None => {
                let i = self.blocks;
                self.blocks += 1;
                self.open = Some(i);
                out.push_str(&event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}),
                ));
                i
            }
        };
        out.push_str(&event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}}),
        ));
        out
    }

    fn close_text(&mut self) -> String {
        match self.open.take() {
            Some(i) => event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            ),
            None => String::new(),
        }
    }

    fn call(&mut self, n: usize, c: &tools::Call) -> String {
        let mut out = self.close_text();
        let i = self.blocks;
        self.blocks += 1;
        out.push_str(&event(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": tool_use_block(&self.id, n, c, false)}),
        ));
        out.push_str(&event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": c.arguments}}),
        ));
        out.push_str(&event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        ));
        out
    }

    fn pieces(&mut self, text: &str, end: bool) -> String {
        if !self.tools {
            return if text.is_empty() {
                String::new()
            } else {
                self.text(text)
            };
        }
        let mut out = String::new();
        for p in self.scanner.feed(text, end) {
            match p {
                tools::Piece::Text(t) => out.push_str(&self.text(&t)),
                tools::Piece::Call(n, c) => out.push_str(&self.call(n, &c)),
            }
        }
        out
    }
}

impl Framing for Events {
    fn start(&mut self) -> Option<String> {
        Some(event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }}),
        ))
    }

    fn delta(&mut self, text: &str, _: &[engram_engine::TokenLogprob]) -> String {
        self.pieces(text, false)
    }

    fn reply(&self, _: &Generated) -> String {
        String::new()
    }

    fn done(&mut self, g: &Generated, recorded: Result<(), ApiError>) -> Vec<String> {
        if let Err(e) = recorded {
            return vec![self.error(&e)];
        }
        let mut out = self.pieces("", true);
        out.push_str(&self.close_text());
        out.push_str(&event(
            "message_delta",
            json!({"type": "message_delta",
                   "delta": {"stop_reason": stop_reason(g, self.scanner.calls), "stop_sequence": g.stop_sequence},
                   "usage": usage_of(g)}),
        ));
        out.push_str(&event("message_stop", json!({"type": "message_stop"})));
        vec![out]
    }

    fn error(&mut self, e: &ApiError) -> String {
        event(
            "error",
            json!({"type": "error", "error": {"type": e.code, "message": e.message}}),
        )
    }
}
