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
//! The last message must be the user's; `system` messages are ignored (the agent's layers are
//! the system prompt). `usage.prompt_tokens_details.cached_tokens` reports the prompt tokens
//! reused from the KV cache. `stream: true` answers `chat.completion.chunk` events and
//! `data: [DONE]`.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use actix_web::web::Bytes;
use actix_web::{HttpResponse, get, post, web};
use engram_context::{Speaker, Turn};
use engram_engine::{FinishReason, GenerateRequest, SamplingParams, Usage};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::api::agents::turn_context;
use crate::api::turns::{Generated, Step, generate, open_session, record, session_key, spec_of};
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;

/// One chat message.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// Text (string content only).
    pub content: Option<String>,
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

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// The caller's agents, as models.
#[utoipa::path(
    tag = "openai",
    responses(
        (status = 200, description = "The caller's agents as models", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/models")]
pub async fn list_models(
    caller: TenantCaller,
    state: web::Data<AppState>,
) -> Result<HttpResponse, ApiError> {
    let data: Vec<Value> = state
        .store
        .agents(&caller.0.id)
        .await?
        .into_iter()
        .map(|a| json!({"id": a.name, "object": "model", "created": a.created_at / 1000, "owned_by": "engram"}))
        .collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

/// A chat completion through an agent (see the module docs).
#[utoipa::path(
    tag = "openai",
    request_body = ChatRequest,
    responses(
        (status = 200, description = "A chat.completion, or with `\"stream\": true` chat.completion.chunk server-sent events ending in `data: [DONE]`", content(
            (serde_json::Value = "application/json"),
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
    let tenant = caller.0;
    let req = body.into_inner();
    let agent = state.store.agent(&tenant.id, &req.model).await?;
    let Some((last, earlier)) = req.messages.split_last() else {
        return Err(ApiError::invalid("`messages` is empty"));
    };
    let message = match (last.role.as_str(), &last.content) {
        ("user", Some(text)) => text.clone(),
        _ => {
            return Err(ApiError::invalid(
                "the last message must be the user's, with text content",
            ));
        }
    };
    let stop = match &req.stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::invalid("`stop` must be a string or a list of strings"))?,
        Some(_) => {
            return Err(ApiError::invalid(
                "`stop` must be a string or a list of strings",
            ));
        }
    };
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(0.0),
        top_p: req.top_p.unwrap_or(1.0),
        seed: req.seed.unwrap_or(0),
        max_tokens: req.max_completion_tokens.or(req.max_tokens).unwrap_or(256),
        stop,
        ..SamplingParams::default()
    };
    sampling.validate().map_err(ApiError::from)?;
    let slot = state.limits.begin_generation(&tenant.id)?;
    let session = req.user.clone();
    let turned = match &session {
        Some(s) => {
            open_session(&state, &tenant, &agent, s, &message).await?;
            turn_context(&state, &tenant, &agent, Some(s), None, &message).await?
        }
        None => {
            state.engine()?;
            let history: Vec<Turn> = earlier
                .iter()
                .filter_map(|m| {
                    let speaker = match m.role.as_str() {
                        "user" => Speaker::User,
                        "assistant" => Speaker::Assistant,
                        _ => return None,
                    };
                    Some(Turn {
                        speaker,
                        text: m.content.clone().unwrap_or_default(),
                    })
                })
                .collect();
            turn_context(&state, &tenant, &agent, None, Some(&history), &message).await?
        }
    };
    let session_id = Some(match session.as_deref() {
        Some(s) => session_key(&agent, s),
        None => {
            let first = req
                .messages
                .iter()
                .find(|m| m.role == "user")
                .and_then(|m| m.content.as_deref())
                .unwrap_or_default();
            let h = Sha256::digest(first.as_bytes());
            let hex: String = h[..16].iter().map(|b| format!("{b:02x}")).collect();
            // A client session of the same name would only share the shadow's chain record:
            // blocks are found by their content hash, never by this key.
            session_key(&agent, &format!("\0conversation/{hex}"))
        }
    });
    let spec = spec_of(&state, &turned.built, &tenant, session_id, |_| true)?;
    let id = format!("chatcmpl-{}", now_s());
    let created = now_s();
    let model = agent.name.clone();
    if !req.stream {
        let g = generate(&state, spec, sampling).await?;
        if let Some(s) = &session {
            record(&state, &tenant, &agent, s, &message, &turned, &g).await?;
        }
        return Ok(HttpResponse::Ok().json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": g.text},
                "finish_reason": finish(g.reason),
            }],
            "usage": usage_json(&g.usage),
        })));
    }
    let rx = state.engine()?.submit(GenerateRequest { spec, sampling })?;
    let (tx, out) = flume::unbounded::<Result<Bytes, actix_web::Error>>();
    let chunk = move |delta: Value, reason: Option<&str>, usage: Option<Value>| {
        let mut v = json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
        });
        if let Some(u) = usage {
            v["usage"] = u;
        }
        Bytes::from(format!("data: {v}\n\n"))
    };
    actix_web::rt::spawn(async move {
        let _slot = slot;
        let t = Instant::now();
        let mut g = Generated::new();
        let _ = tx.send(Ok(chunk(
            json!({"role": "assistant", "content": ""}),
            None,
            None,
        )));
        while let Ok(ev) = rx.recv_async().await {
            match g.absorb(ev, t) {
                Step::Wait => {}
                Step::Delta(text) => {
                    if tx
                        .send(Ok(chunk(json!({"content": text}), None, None)))
                        .is_err()
                    {
                        return;
                    }
                }
                Step::Done => {
                    if let Some(s) = &session {
                        let _ = record(&state, &tenant, &agent, s, &message, &turned, &g).await;
                    }
                    let _ = tx.send(Ok(chunk(
                        json!({}),
                        Some(finish(g.reason)),
                        Some(usage_json(&g.usage)),
                    )));
                    let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
                    return;
                }
                Step::Failed(e) => {
                    let body = json!({"error": {"code": e.code, "message": e.message}});
                    let _ = tx.send(Ok(Bytes::from(format!("data: {body}\n\n"))));
                    return;
                }
            }
        }
    });
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .streaming(out.into_stream()))
}
