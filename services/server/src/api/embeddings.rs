//! `/v1/embeddings` (the memory graph's embedder, as OpenAI serves it) and `/tokenize`,
//! `/detokenize` (the served model's tokenizer, as llama.cpp's and vLLM's servers answer).

use actix_web::{HttpResponse, post, web};
use base64::Engine as _;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;

/// Texts one embeddings request may carry at most.
pub const MAX_INPUTS: usize = 256;
/// Bytes of one text at most.
pub const MAX_INPUT_BYTES: usize = 64 * 1024;

/// Body of `POST /v1/embeddings`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct EmbeddingsRequest {
    /// A string or a list of 1–256 strings (token-id inputs are refused: the embedder has its
    /// own vocabulary).
    #[schema(value_type = Object)]
    pub input: Value,
    /// Any name: the memory graph's embedder answers.
    pub model: Option<String>,
    /// `float` (the default) or `base64` (little-endian f32s).
    pub encoding_format: Option<String>,
    /// Refused unless it is the embedder's width.
    pub dimensions: Option<usize>,
}

fn inputs(input: &Value) -> Result<Vec<String>, ApiError> {
    let texts: Vec<String> = match input {
        Value::String(s) => vec![s.clone()],
        Value::Array(a) if !a.is_empty() => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                ApiError::new(
                    actix_web::http::StatusCode::BAD_REQUEST,
                    "unsupported_parameter",
                    "`input` must be strings: token ids of another vocabulary are not embedded",
                )
            })?,
        _ => {
            return Err(ApiError::invalid(
                "`input` must be a string or a list of strings",
            ));
        }
    };
    if texts.len() > MAX_INPUTS {
        return Err(ApiError::invalid(format!(
            "`input` may hold at most {MAX_INPUTS} texts"
        )));
    }
    if texts
        .iter()
        .any(|t| t.is_empty() || t.len() > MAX_INPUT_BYTES)
    {
        return Err(ApiError::invalid(format!(
            "each input must be 1 byte to {} KiB",
            MAX_INPUT_BYTES / 1024
        )));
    }
    Ok(texts)
}

/// Embeds texts with the memory graph's embedder (unit vectors; a text past the embedder's 256
/// tokens is cut there). Nothing is stored.
#[utoipa::path(
    tag = "openai",
    request_body = EmbeddingsRequest,
    responses(
        (status = 200, description = "OpenAI's embedding list: one per input, in order, and the tokens read"),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 503, description = "No embedder (the memory graph is off)", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/embeddings")]
pub async fn embeddings(
    _caller: TenantCaller,
    state: web::Data<AppState>,
    body: web::Json<EmbeddingsRequest>,
) -> Result<HttpResponse, ApiError> {
    let texts = inputs(&body.input)?;
    let base64 = match body.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "`encoding_format` `{other}`: float or base64"
            )));
        }
    };
    let memory = state.memory()?;
    let (vectors, tokens) = memory.embed_counted(texts).await?;
    if let Some(d) = body.dimensions
        && vectors.first().is_some_and(|v| v.len() != d)
    {
        return Err(ApiError::new(
            actix_web::http::StatusCode::BAD_REQUEST,
            "unsupported_parameter",
            format!(
                "`dimensions`: the embedder's vectors have {} dimensions",
                vectors[0].len()
            ),
        ));
    }
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(HttpResponse::Ok().json(json!({
        "object": "list",
        "data": data,
        "model": memory.embedder_name(),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })))
}

/// Body of `POST /tokenize`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct TokenizeRequest {
    /// The text (llama.cpp's name).
    pub content: Option<String>,
    /// The text (vLLM's name).
    pub prompt: Option<String>,
    /// With each token's text too.
    #[serde(default)]
    pub with_pieces: bool,
}

/// Bytes a text to tokenize may hold at most.
pub const MAX_TOKENIZE_BYTES: usize = 1024 * 1024;

/// The served model's tokens of a text (special tokens written in it are recognized).
#[utoipa::path(
    tag = "openai",
    request_body = TokenizeRequest,
    responses(
        (status = 200, description = "`{tokens, count, max_model_len}` (with `with_pieces`, each token `{id, piece}`)"),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 503, description = "No model is loaded", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/tokenize")]
pub async fn tokenize(
    _caller: TenantCaller,
    state: web::Data<AppState>,
    body: web::Json<TokenizeRequest>,
) -> Result<HttpResponse, ApiError> {
    let text = match (&body.content, &body.prompt) {
        (Some(t), None) | (None, Some(t)) => t,
        _ => {
            return Err(ApiError::invalid(
                "give the text as `content` (or `prompt`)",
            ));
        }
    };
    if text.len() > MAX_TOKENIZE_BYTES {
        return Err(ApiError::invalid("the text may hold at most 1 MiB"));
    }
    let engine = state.engine()?;
    let tok = engine.tokenizer();
    let ids = tok.encode(text).map_err(crate::turn::TurnError::from)?;
    let tokens: Vec<Value> = if body.with_pieces {
        ids.iter()
            .map(|&id| json!({"id": id, "piece": tok.decode(&[id]).unwrap_or_default()}))
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(HttpResponse::Ok().json(json!({
        "tokens": tokens,
        "count": ids.len(),
        "max_model_len": engine.model_config().context_length,
    })))
}

/// Body of `POST /detokenize`.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct DetokenizeRequest {
    /// Token ids of the served model.
    pub tokens: Vec<u32>,
}

/// Token ids a detokenize request may carry at most.
pub const MAX_DETOKENIZE: usize = 256 * 1024;

/// The text of the served model's token ids.
#[utoipa::path(
    tag = "openai",
    request_body = DetokenizeRequest,
    responses(
        (status = 200, description = "`{content, prompt}`: the text (both names)"),
        (status = 400, description = "Invalid input (an id outside the vocabulary)", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 503, description = "No model is loaded", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/detokenize")]
pub async fn detokenize(
    _caller: TenantCaller,
    state: web::Data<AppState>,
    body: web::Json<DetokenizeRequest>,
) -> Result<HttpResponse, ApiError> {
    if body.tokens.len() > MAX_DETOKENIZE {
        return Err(ApiError::invalid("at most 262,144 tokens"));
    }
    let engine = state.engine()?;
    let tok = engine.tokenizer();
    let vocab = tok.vocab_size();
    if let Some(bad) = body.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid(format!(
            "token {bad} is outside the vocabulary ({vocab} tokens)"
        )));
    }
    let text = tok
        .decode(&body.tokens)
        .map_err(crate::turn::TurnError::from)?;
    Ok(HttpResponse::Ok().json(json!({"content": text, "prompt": text})))
}
