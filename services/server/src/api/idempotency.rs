//! The `Idempotency-Key` header of the routes that append to a session's log (a turn, an
//! injection): read once, and a retried request answered with what was stored under it.

use actix_web::{HttpRequest, HttpResponse};
use serde_json::json;

use crate::api::stream;
use crate::error::ApiError;

/// The `Idempotency-Key` header: 1 to 255 visible ASCII characters.
pub(super) fn idempotency_key(req: &HttpRequest) -> Result<Option<String>, ApiError> {
    let Some(v) = req.headers().get("idempotency-key") else {
        return Ok(None);
    };
    match v.to_str() {
        Ok(k) if (1..=255).contains(&k.len()) && k.bytes().all(|b| b.is_ascii_graphic()) => {
            Ok(Some(k.to_string()))
        }
        _ => Err(ApiError::invalid(
            "Idempotency-Key must be 1 to 255 visible ASCII characters",
        )),
    }
}

/// The answer stored with an earlier run of the turn, as JSON or as the events it streamed.
pub(super) fn answer_again(stored: &str, stream: bool) -> HttpResponse {
    if !stream {
        return HttpResponse::Ok()
            .content_type("application/json")
            .body(stored.to_string());
    }
    let (text, done) = done_event(serde_json::from_str(stored).unwrap_or_default());
    stream::replayed(vec![stream::event(&json!({"delta": text})), done])
}

/// A turn's answer (a `TurnResponse` as JSON) split into its text and the stream's last
/// event: the rest of the answer with `"done": true`.
pub(super) fn done_event(
    mut answer: serde_json::Map<String, serde_json::Value>,
) -> (serde_json::Value, String) {
    let text = answer.remove("text").unwrap_or_default();
    answer.insert("done".into(), json!(true));
    (text, stream::event(&serde_json::Value::Object(answer)))
}
