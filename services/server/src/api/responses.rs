//! OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, over
//! the chat turn of `api/chat.rs`.
//!
//! A chain of responses is a session: a response created with `store` (the default) and no
//! `previous_response_id` starts one (`resp-…`, of the agent `model` selects); a response that
//! names a `previous_response_id` continues that response's session, so the chain's earlier
//! turns come from its durable log and their KV is reused, and its new `input` items (a user
//! message, the outputs of the calls the previous response made) are the turn. `store: false`
//! without a previous response is a stateless turn, and nothing is stored.
//!
//! Input is a string or items: messages (`input_text` / `output_text` parts; images answer 400
//! `unsupported_content`), `function_call` and `function_call_output`. `instructions` is the
//! system text of this response only. Tools are function tools (`{type: "function", name,
//! description, parameters}`; built-in tools answer 400 `unsupported_parameter`), with
//! `tool_choice` as in `api/tools.rs`; `text.format` is `text`, `json_object` or
//! `json_schema`. `stream: true` answers the Responses events (`response.created`,
//! `response.output_item.added`, `response.output_text.delta`, …,
//! `response.function_call_arguments.done`, `response.completed`), each with its
//! `sequence_number`.

use actix_web::{HttpResponse, delete, get, post, web};
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

/// Body of `POST /v1/responses` (unknown fields are ignored).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct ResponsesRequest {
    /// An agent's name or id, or any other name (the tenant's default agent); a continued chain
    /// keeps its agent.
    pub model: String,
    /// A string (the user's message) or a list of items.
    #[schema(value_type = Object)]
    pub input: Value,
    /// System text for this response.
    pub instructions: Option<String>,
    /// The response this one continues.
    pub previous_response_id: Option<String>,
    /// Keep the response (and its chain's session); default true.
    pub store: Option<bool>,
    /// Server-sent Responses events.
    #[serde(default)]
    pub stream: bool,
    /// Function tools.
    #[schema(value_type = Option<Object>)]
    pub tools: Option<Value>,
    /// `auto`, `none`, `required` or `{"type": "function", "name": …}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Several calls in one response (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Tokens to generate at most (default 256).
    pub max_output_tokens: Option<usize>,
    /// Default 1.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", "schema": …}}`.
    #[schema(value_type = Option<Object>)]
    pub text: Option<Value>,
    /// Kept with the response.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
}

fn unsupported(what: impl Into<String>) -> ApiError {
    ApiError::new(
        actix_web::http::StatusCode::BAD_REQUEST,
        "unsupported_parameter",
        what,
    )
}

/// The text of a message's content: a string, or `input_text` / `output_text` parts.
fn content_text(v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = Vec::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str).unwrap_or_default() {
                    "input_text" | "output_text" | "text" => out.push(
                        p.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| ApiError::invalid("a text part needs `text`"))?,
                    ),
                    k @ ("input_image" | "input_file" | "input_audio") => {
                        return Err(ApiError::new(
                            actix_web::http::StatusCode::BAD_REQUEST,
                            "unsupported_content",
                            format!(
                                "`{k}` parts are not supported: the served model reads text only"
                            ),
                        ));
                    }
                    k => return Err(ApiError::invalid(format!("unknown content part `{k}`"))),
                }
            }
            Ok(out.join("\n"))
        }
        _ => Err(ApiError::invalid(
            "`content` must be a string or content parts",
        )),
    }
}

/// The input as chat messages.
fn messages_of(instructions: &Option<String>, input: &Value) -> Result<Vec<Msg>, ApiError> {
    let mut out = Vec::new();
    if let Some(i) = instructions.as_ref().filter(|i| !i.trim().is_empty()) {
        out.push(Msg {
            role: "system".into(),
            content: Some(i.clone()),
            tool_calls: None,
        });
    }
    let items = match input {
        Value::String(s) => {
            out.push(Msg {
                role: "user".into(),
                content: Some(s.clone()),
                tool_calls: None,
            });
            return Ok(out);
        }
        Value::Array(items) if !items.is_empty() => items,
        _ => {
            return Err(ApiError::invalid(
                "`input` must be a string or a list of items",
            ));
        }
    };
    for item in items {
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
                if !["user", "assistant", "system", "developer"].contains(&role) {
                    return Err(ApiError::invalid(format!("message role `{role}`")));
                }
                let text = content_text(item.get("content").unwrap_or(&Value::Null))?;
                // Consecutive assistant output (text, then calls) is one message.
                out.push(Msg {
                    role: role.into(),
                    content: Some(text),
                    tool_calls: None,
                });
            }
            "function_call" => {
                let name = item
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| ApiError::invalid("a `function_call` item needs a `name`"))?;
                let call = json!({
                    "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments").cloned().unwrap_or(json!("{}"))},
                });
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => match &mut m.tool_calls {
                        Some(Value::Array(calls)) => calls.push(call),
                        _ => m.tool_calls = Some(json!([call])),
                    },
                    _ => out.push(Msg {
                        role: "assistant".into(),
                        content: Some(String::new()),
                        tool_calls: Some(json!([call])),
                    }),
                }
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Array(_)) => content_text(v)?,
                    _ => {
                        return Err(ApiError::invalid(
                            "a `function_call_output` item needs an `output`",
                        ));
                    }
                };
                out.push(Msg {
                    role: "tool".into(),
                    content: Some(output),
                    tool_calls: None,
                });
            }
            // A reasoning model's summary: nothing the served model reads.
            "reasoning" => {}
            other => return Err(unsupported(format!("input items of type `{other}`"))),
        }
    }
    Ok(out)
}

/// Function tools in the chat form; built-in tools are refused.
fn tools_of(req: &ResponsesRequest) -> Result<Tools, ApiError> {
    let defs = match &req.tools {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => Some(Value::Array(
            list.iter()
                .map(|t| match t.get("type").and_then(Value::as_str) {
                    Some("function") => Ok(json!({"type": "function", "function": {
                        "name": t.get("name").cloned().unwrap_or(Value::Null),
                        "description": t.get("description").cloned().unwrap_or(Value::Null),
                        "parameters": t.get("parameters").cloned().unwrap_or(Value::Null),
                    }})),
                    other => Err(unsupported(format!(
                        "tools of type `{}`: function tools only",
                        other.unwrap_or("?")
                    ))),
                })
                .collect::<Result<_, _>>()?,
        )),
        Some(_) => return Err(ApiError::invalid("`tools` must be a list")),
    };
    let choice = match &req.tool_choice {
        Some(c @ Value::Object(_)) if c.get("type").and_then(Value::as_str) == Some("function") => {
            Some(
                json!({"type": "function", "function": {"name": c.get("name").cloned().unwrap_or(Value::Null)}}),
            )
        }
        other => other.clone(),
    };
    Tools::parse(defs.as_ref(), choice.as_ref(), req.parallel_tool_calls)
}

/// `text.format` as a chat `response_format`.
fn format_of(text: &Option<Value>) -> Option<Value> {
    let f = text.as_ref()?.get("format")?;
    match f.get("type").and_then(Value::as_str) {
        Some("json_schema") => Some(json!({
            "type": "json_schema",
            "json_schema": {"name": f.get("name").cloned().unwrap_or(Value::Null),
                            "schema": f.get("schema").cloned().unwrap_or(Value::Null)},
        })),
        _ => Some(f.clone()),
    }
}

/// What is known of a response before it is generated.
#[derive(Debug, Clone)]
struct Head {
    id: String,
    created_at: u64,
    model: String,
    previous: Option<String>,
    instructions: Option<String>,
    metadata: Value,
    tools: Value,
    tool_choice: Value,
    temperature: f32,
    top_p: f32,
    text: Value,
}

impl Head {
    /// The response object with `output`, `status` and `usage`.
    fn body(&self, status: &str, output: Vec<Value>, g: Option<&Generated>) -> Value {
        let usage = g.map(|g| {
            let u = &g.usage;
            json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            })
        });
        let incomplete = g
            .filter(|g| g.reason == FinishReason::Length)
            .map(|_| json!({"reason": "max_output_tokens"}));
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": if incomplete.is_some() && status == "completed" { "incomplete" } else { status },
            "error": null,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": true,
            "previous_response_id": self.previous,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "text": self.text,
            "metadata": self.metadata,
            "usage": usage,
        })
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        json!({
            "type": "message",
            "id": format!("msg_{}", self.id.trim_start_matches("resp_")),
            "status": status,
            "role": "assistant",
            "content": if status == "in_progress" { json!([]) } else {
                json!([{"type": "output_text", "text": text, "annotations": []}])
            },
        })
    }

    fn call_item(&self, n: usize, c: &tools::Call, status: &str) -> Value {
        let tail = self.id.trim_start_matches("resp_");
        json!({
            "type": "function_call",
            "id": format!("fc_{tail}_{n}"),
            "call_id": format!("call_{tail}_{n}"),
            "name": c.name,
            "arguments": if status == "in_progress" { "" } else { c.arguments.as_str() },
            "status": status,
        })
    }

    /// The output items of a whole reply.
    fn output(&self, text: &str, calls: &[tools::Call]) -> Vec<Value> {
        let mut out = Vec::new();
        if !text.is_empty() || calls.is_empty() {
            out.push(self.message_item(text, "completed"));
        }
        out.extend(
            calls
                .iter()
                .enumerate()
                .map(|(i, c)| self.call_item(i, c, "completed")),
        );
        out
    }
}

/// Creates a response (see the module docs).
#[utoipa::path(
    tag = "openai",
    request_body = ResponsesRequest,
    responses(
        (status = 200, description = "A `response`, or with `\"stream\": true` the Responses events"),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "No stored response of that `previous_response_id`", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/responses")]
pub async fn create_response(
    caller: TenantCaller,
    state: web::Data<AppState>,
    body: web::Json<ResponsesRequest>,
) -> Result<HttpResponse, ApiError> {
    let req = body.into_inner();
    let tools = tools_of(&req)?;
    let offered = tools.offered();
    let names = tools.names();
    let messages = messages_of(&req.instructions, &req.input)?;
    let store = req.store.unwrap_or(true);
    let tenant = caller.0;
    // The chain: the previous response's agent and session, or a new session when stored.
    let (model, session) = match &req.previous_response_id {
        Some(prev) => {
            let Some((agent, session, _)) = state.store.response(&tenant.id, prev).await? else {
                return Err(ApiError::not_found(format!("no stored response `{prev}`")));
            };
            (agent, Some(session))
        }
        None if store => (
            req.model.clone(),
            Some(format!("resp-{}", engram_store::random_hex(12)?)),
        ),
        None => (req.model.clone(), None),
    };
    state.engine()?;
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        max_tokens: req.max_output_tokens.unwrap_or(256),
        ..SamplingParams::default()
    };
    let head = Head {
        id: format!("resp_{}", engram_store::random_hex(16)?),
        created_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: String::new(),
        previous: req.previous_response_id.clone(),
        instructions: req.instructions.clone(),
        metadata: req.metadata.clone().unwrap_or_else(|| json!({})),
        tools: req.tools.clone().unwrap_or_else(|| json!([])),
        tool_choice: req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        temperature: sampling.temperature,
        top_p: sampling.top_p,
        text: req
            .text
            .clone()
            .unwrap_or_else(|| json!({"format": {"type": "text"}})),
    };
    let input = chat::ChatInput {
        model,
        messages,
        user: session.clone(),
        appends: true,
        tools,
        response_format: format_of(&req.text),
        sampling,
        n: 1,
    };
    let p = chat::prepare(state.clone().into_inner(), tenant.clone(), input).await?;
    let head = Head {
        model: p.turn.agent.name.clone(),
        ..head
    };
    let stored = store.then(|| (p.turn.agent.id.clone(), session.clone().unwrap_or_default()));
    if req.stream {
        // The chain is findable from the start: the stored body is written when it ends.
        if let Some((agent, session)) = &stored {
            let body = head.body("in_progress", Vec::new(), None).to_string();
            state
                .store
                .put_response(&head.id, &tenant.id, agent, session, &body)
                .await?;
        }
        let events = Events {
            head,
            seq: 0,
            tools: offered,
            scanner: tools::Scanner::for_tools(names.clone()),
            text: String::new(),
            text_open: false,
            items: Vec::new(),
            store: stored.map(|_| (state.clone(), tenant.id.clone())),
            pending_tail: String::new(),
        };
        return stream::pump(p.turn, p.message, p.turned, p.job, p.held, events);
    }
    let (_, g) = chat::run(p).await?;
    let (text, calls) = if offered {
        tools::parse_reply(&g.text, &names)
    } else {
        (g.text.clone(), Vec::new())
    };
    let body = head.body("completed", head.output(&text, &calls), Some(&g));
    if let Some((agent, session)) = &stored {
        state
            .store
            .put_response(&head.id, &tenant.id, agent, session, &body.to_string())
            .await?;
    }
    Ok(HttpResponse::Ok().json(body))
}

/// A stored response.
#[utoipa::path(
    tag = "openai",
    params(("id" = String, Path, description = "The response's id")),
    responses(
        (status = 200, description = "The `response` as it was answered"),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "No stored response of that id", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/responses/{id}")]
pub async fn get_response(
    caller: TenantCaller,
    state: web::Data<AppState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let Some((_, _, body)) = state.store.response(&caller.0.id, &id).await? else {
        return Err(ApiError::not_found(format!("no stored response `{id}`")));
    };
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .body(body))
}

/// Deletes a stored response (its chain's session and turns stay).
#[utoipa::path(
    tag = "openai",
    params(("id" = String, Path, description = "The response's id")),
    responses(
        (status = 200, description = "`{id, object: \"response.deleted\", deleted: true}`"),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "No stored response of that id", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[delete("/v1/responses/{id}")]
pub async fn delete_response(
    caller: TenantCaller,
    state: web::Data<AppState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    if !state.store.delete_response(&caller.0.id, &id).await? {
        return Err(ApiError::not_found(format!("no stored response `{id}`")));
    }
    Ok(HttpResponse::Ok().json(json!({"id": *id, "object": "response.deleted", "deleted": true})))
}

/// The Responses streaming framing.
struct Events {
    head: Head,
    seq: u64,
    tools: bool,
    scanner: tools::Scanner,
    /// The message's text so far.
    text: String,
    /// Whether the message item has been announced.
    text_open: bool,
    /// The output items done, in order.
    items: Vec<Value>,
    /// Where the finished response is stored, if it is.
    store: Option<(web::Data<AppState>, String)>,
    /// Events of the reply's end, made while the stored body was written.
    pending_tail: String,
}

impl Events {
    fn event(&mut self, kind: &str, mut data: Value) -> String {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        format!("event: {kind}\ndata: {data}\n\n")
    }

    fn text_delta(&mut self, t: &str) -> String {
        let mut out = String::new();
        let item_id = format!("msg_{}", self.head.id.trim_start_matches("resp_"));
        if !self.text_open {
            self.text_open = true;
            let item = self.head.message_item("", "in_progress");
            let index = self.items.len();
            out.push_str(&self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            ));
            out.push_str(&self.event(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": index, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}}),
            ));
        }
        self.text.push_str(t);
        let index = self.items.len();
        out.push_str(&self.event(
            "response.output_text.delta",
            json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": t}),
        ));
        out
    }

    fn close_text(&mut self) -> String {
        if !self.text_open {
            return String::new();
        }
        self.text_open = false;
        let item_id = format!("msg_{}", self.head.id.trim_start_matches("resp_"));
        let index = self.items.len();
        let text = std::mem::take(&mut self.text);
        let mut out = self.event(
            "response.output_text.done",
            json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text}),
        );
        out.push_str(&self.event(
            "response.content_part.done",
            json!({"item_id": item_id, "output_index": index, "content_index": 0,
                   "part": {"type": "output_text", "text": text, "annotations": []}}),
        ));
        let item = self.head.message_item(&text, "completed");
        out.push_str(&self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
        self.items.push(item);
        out
    }

    fn call(&mut self, n: usize, c: &tools::Call) -> String {
        let mut out = self.close_text();
        let index = self.items.len();
        let started = self.head.call_item(n, c, "in_progress");
        let item_id = started["id"].clone();
        out.push_str(&self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": started}),
        ));
        out.push_str(&self.event(
            "response.function_call_arguments.delta",
            json!({"item_id": item_id, "output_index": index, "delta": c.arguments}),
        ));
        out.push_str(&self.event(
            "response.function_call_arguments.done",
            json!({"item_id": item_id, "output_index": index, "arguments": c.arguments}),
        ));
        let done = self.head.call_item(n, c, "completed");
        out.push_str(&self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        ));
        self.items.push(done);
        out
    }

    fn pieces(&mut self, text: &str, end: bool) -> String {
        if !self.tools {
            return if text.is_empty() {
                String::new()
            } else {
                self.text_delta(text)
            };
        }
        let mut out = String::new();
        for p in self.scanner.feed(text, end) {
            match p {
                tools::Piece::Text(t) => out.push_str(&self.text_delta(&t)),
                tools::Piece::Call(n, c) => out.push_str(&self.call(n, &c)),
            }
        }
        out
    }

    fn final_body(&self, g: &Generated) -> Value {
        let mut items = self.items.clone();
        if items.is_empty() {
            items.push(self.head.message_item("", "completed"));
        }
        self.head.body("completed", items, Some(g))
    }
}

impl Framing for Events {
    fn start(&mut self) -> Option<String> {
        let body = self.head.body("in_progress", Vec::new(), None);
        let mut out = self.event("response.created", json!({"response": body}));
        out.push_str(&self.event("response.in_progress", json!({"response": body})));
        Some(out)
    }

    fn delta(&mut self, text: &str, _: &[engram_engine::TokenLogprob]) -> String {
        self.pieces(text, false)
    }

    fn reply(&self, _: &Generated) -> String {
        String::new()
    }

    fn after(
        &mut self,
        g: &Generated,
    ) -> Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>> {
        // The rest of the reply, so that the stored body holds every item.
        let tail = self.pieces("", true) + &self.close_text();
        self.pending_tail = tail;
        let (state, tenant) = self.store.clone()?;
        let id = self.head.id.clone();
        let body = self.final_body(g).to_string();
        Some(Box::pin(async move {
            if let Err(e) = state.store.update_response(&tenant, &id, &body).await {
                tracing::warn!("storing response {id}: {e}");
            }
        }))
    }

    fn done(&mut self, g: &Generated, recorded: Result<(), ApiError>) -> Vec<String> {
        if let Err(e) = recorded {
            return vec![self.error(&e)];
        }
        let mut out = std::mem::take(&mut self.pending_tail);
        out.push_str(&self.pieces("", true));
        out.push_str(&self.close_text());
        let body = self.final_body(g);
        out.push_str(&self.event("response.completed", json!({"response": body})));
        vec![out]
    }

    fn error(&mut self, e: &ApiError) -> String {
        self.event(
            "error",
            json!({"code": e.code, "message": e.message, "param": null}),
        )
    }
}
