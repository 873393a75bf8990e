//! `POST /v1/completions`: OpenAI's (legacy) text completion — a raw prompt, no chat template,
//! no agent, nothing stored. The prompt's KV is cached under the tenant's salt like any
//! other prompt's, so a repeated prefix is reused (`usage.prompt_tokens_details.cached_tokens`).
//!
//! `prompt` is a string or token ids (one prompt: a list of several answers 400
//! `unsupported_parameter`, as `n` ≠ 1, `best_of` ≠ 1 and `suffix` do). `echo` prepends the
//! prompt to the text. `logprobs: k` (0–5, OpenAI's bound) answers the legacy form per
//! generated token (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`); with `echo` it
//! is refused (the prompt's log probabilities are not computed). `max_tokens` defaults to 16
//! and `temperature` to 1, as OpenAI's.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use actix_web::web::Bytes;
use actix_web::{HttpResponse, post, web};
use engram_engine::{
    FinishReason, GenerateRequest, PromptSegment, SamplingParams, SequenceSpec, TokenLogprob,
};
use engram_kvcore::{SourceLayer, TenantId};
use serde::Deserialize;
use serde_json::{Value, json};

use super::stream::event;
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{Generated, Step};

/// Bytes a prompt may hold at most.
pub const MAX_PROMPT_BYTES: usize = 1024 * 1024;

/// Body of `POST /v1/completions` (unknown fields are ignored, as OpenAI does).
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct CompletionRequest {
    /// Any name (the served model answers).
    pub model: Option<String>,
    /// A string, a list of one string, token ids, or a list of one list of token ids.
    #[schema(value_type = Object)]
    pub prompt: Value,
    /// Tokens to generate at most (default 16).
    pub max_tokens: Option<usize>,
    /// Default 1; 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Same seed, same text.
    pub seed: Option<u64>,
    /// A string or up to four.
    #[schema(value_type = Option<Object>)]
    pub stop: Option<Value>,
    /// The prompt before the text.
    #[serde(default)]
    pub echo: bool,
    /// 0–5: the log probability of each generated token and of this many alternatives.
    pub logprobs: Option<u32>,
    /// −2 to 2.
    pub presence_penalty: Option<f32>,
    /// −2 to 2.
    pub frequency_penalty: Option<f32>,
    /// Token id (a decimal string) → bias, −100 to 100.
    #[schema(value_type = Option<Object>)]
    pub logit_bias: Option<Value>,
    /// Only 1.
    pub n: Option<u32>,
    /// Only 1.
    pub best_of: Option<u32>,
    /// Refused (no fill-in-the-middle).
    pub suffix: Option<String>,
    /// Server-sent `text_completion` events, then `data: [DONE]`.
    #[serde(default)]
    pub stream: bool,
}

fn unsupported(what: &str) -> ApiError {
    ApiError::new(
        actix_web::http::StatusCode::BAD_REQUEST,
        "unsupported_parameter",
        what.to_string(),
    )
}

/// The prompt's token ids (checked against the vocabulary) and its text.
fn prompt_of(prompt: &Value, tok: &engram_engine::TextTokenizer) -> Result<Vec<u32>, ApiError> {
    let one = match prompt {
        Value::Array(a) if a.len() == 1 && (a[0].is_string() || a[0].is_array()) => &a[0],
        Value::Array(a) if a.iter().all(|v| v.is_string() || v.is_array()) && a.len() > 1 => {
            return Err(unsupported("one prompt per request"));
        }
        other => other,
    };
    let ids = match one {
        Value::String(s) => {
            if s.len() > MAX_PROMPT_BYTES {
                return Err(ApiError::invalid("`prompt` may hold at most 1 MiB"));
            }
            tok.encode(s).map_err(crate::turn::TurnError::from)?
        }
        Value::Array(ids) => {
            let vocab = tok.vocab_size();
            ids.iter()
                .map(|v| {
                    v.as_u64()
                        .filter(|&t| (t as usize) < vocab)
                        .map(|t| t as u32)
                        .ok_or_else(|| {
                            ApiError::invalid(format!(
                                "`prompt` token ids must be integers below {vocab}"
                            ))
                        })
                })
                .collect::<Result<_, _>>()?
        }
        _ => {
            return Err(ApiError::invalid(
                "`prompt` must be a string or a list of token ids",
            ));
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("`prompt` is empty"));
    }
    Ok(ids)
}

fn completion_id() -> String {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("cmpl-{nanos:x}{seq:04x}{:04x}", std::process::id() & 0xffff)
}

/// The legacy `logprobs` object for generated tokens starting at byte `offset` of the text.
fn legacy_logprobs(
    lps: &[TokenLogprob],
    tok: &engram_engine::TextTokenizer,
    mut offset: usize,
) -> Value {
    let piece = |t: u32| tok.decode(&[t]).unwrap_or_default();
    let (mut tokens, mut lp, mut top, mut offsets) = (vec![], vec![], vec![], vec![]);
    for l in lps {
        let p = piece(l.token);
        offsets.push(offset);
        offset += p.len();
        tokens.push(p);
        lp.push(l.logprob);
        let alts: serde_json::Map<String, Value> =
            l.top.iter().map(|&(t, p)| (piece(t), json!(p))).collect();
        top.push(Value::Object(alts));
    }
    json!({"tokens": tokens, "token_logprobs": lp, "top_logprobs": top, "text_offset": offsets})
}

/// A text completion of a raw prompt (see the module docs).
#[utoipa::path(
    tag = "openai",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "A text_completion, or with `\"stream\": true` text_completion server-sent events ending in `data: [DONE]`"),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 503, description = "No model is loaded", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/completions")]
pub async fn completions(
    caller: TenantCaller,
    state: web::Data<AppState>,
    body: web::Json<CompletionRequest>,
) -> Result<HttpResponse, ApiError> {
    let req = body.into_inner();
    if req.n.is_some_and(|n| n != 1) || req.best_of.is_some_and(|n| n != 1) {
        return Err(unsupported("`n` and `best_of` must be 1"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("`suffix`: no fill-in-the-middle"));
    }
    if req.logprobs.is_some_and(|k| k > 5) {
        return Err(ApiError::invalid("`logprobs` must be 0 to 5"));
    }
    if req.echo && req.logprobs.is_some() {
        return Err(unsupported(
            "`logprobs` with `echo`: the prompt's log probabilities are not computed",
        ));
    }
    let engine = state.engine()?;
    let tok = engine.tokenizer().clone();
    let ids = prompt_of(&req.prompt, &tok)?;
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        seed: req.seed.unwrap_or(0),
        max_tokens: req.max_tokens.unwrap_or(16),
        stop: super::chat::stop_of(&req.stop)?,
        presence_penalty: req.presence_penalty.unwrap_or(0.0),
        frequency_penalty: req.frequency_penalty.unwrap_or(0.0),
        logit_bias: super::chat::logit_bias_of(&req.logit_bias, engine.model_config().vocab_size)?,
        logprobs: req.logprobs.map(|k| k as usize),
        ..SamplingParams::default()
    };
    sampling.validate().map_err(ApiError::from)?;
    let tenant = caller.0;
    let quotas = &tenant.quotas;
    let spec = SequenceSpec {
        segments: vec![PromptSegment {
            tokens: ids.clone(),
            source: SourceLayer::UserTurn,
            importance: 0.5,
        }],
        tenant: TenantId(tenant.cache_salt),
        session: None,
        reuse: Default::default(),
        hot_block_quota: usize::try_from(quotas.hot_blocks).ok(),
        pin_key: None,
        cold_block_quota: usize::try_from(quotas.cold_blocks).ok(),
        public_tokens: 0,
        public_pin_key: None,
    };
    let slot = state.limits.begin_generation(&tenant.id)?;
    let rx = engine.submit(GenerateRequest { spec, sampling })?;
    let echo = if req.echo {
        tok.decode(&ids).map_err(crate::turn::TurnError::from)?
    } else {
        String::new()
    };
    let id = completion_id();
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let model = state
        .config
        .model
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let with_logprobs = req.logprobs.is_some();
    let finish = |r: FinishReason| match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    };
    if req.stream {
        let (tx, out) = flume::unbounded::<Result<Bytes, actix_web::Error>>();
        let send = move |frame: String| tx.send(Ok(Bytes::from(frame))).is_ok();
        actix_web::rt::spawn(async move {
            let _slot = slot;
            let t = Instant::now();
            let mut g = Generated::default();
            let frame = |text: &str, lp: Value, reason: Option<&str>| {
                json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}],
                })
            };
            if !echo.is_empty() && !send(event(&frame(&echo, Value::Null, None))) {
                return;
            }
            let mut offset = echo.len();
            while let Ok(ev) = rx.recv_async().await {
                match g.absorb(ev, t) {
                    Step::Wait => {}
                    Step::Delta(text, lps) => {
                        let lp = if with_logprobs {
                            legacy_logprobs(&lps, &tok, offset)
                        } else {
                            Value::Null
                        };
                        offset += text.len();
                        if !send(event(&frame(&text, lp, None))) {
                            return;
                        }
                    }
                    Step::Done => {
                        let mut last = frame("", Value::Null, Some(finish(g.reason)));
                        last["usage"] = usage_of(&g);
                        send(event(&last));
                        send("data: [DONE]\n\n".to_string());
                        return;
                    }
                    Step::Failed(e) => {
                        send(super::stream::error_event(&ApiError::from(e)));
                        return;
                    }
                }
            }
        });
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("cache-control", "no-cache"))
            .streaming(out.into_stream()));
    }
    let t = Instant::now();
    let mut g = Generated::default();
    while let Ok(ev) = rx.recv_async().await {
        match g.absorb(ev, t) {
            Step::Wait | Step::Delta(..) => {}
            Step::Done => break,
            Step::Failed(e) => return Err(e.into()),
        }
    }
    drop(slot);
    let logprobs = if with_logprobs {
        legacy_logprobs(&g.logprobs, &tok, echo.len())
    } else {
        Value::Null
    };
    Ok(HttpResponse::Ok().json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "text": format!("{echo}{}", g.text),
            "logprobs": logprobs,
            "finish_reason": finish(g.reason),
        }],
        "usage": usage_of(&g),
    })))
}

fn usage_of(g: &Generated) -> Value {
    let u = &g.usage;
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}
