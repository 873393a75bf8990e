//! The server-sent-events pump, written once: a task folds the engine's events into the turn's
//! [`Generated`], records the turn at the end, and frames each step for its route (the native
//! `{"delta": …}` events or OpenAI's `chat.completion.chunk`s).

use std::time::Instant;

use actix_web::HttpResponse;
use actix_web::web::Bytes;
use engram_engine::{Constraint, GenerateRequest, SamplingParams, SequenceSpec, TokenLogprob};

use crate::error::ApiError;
use crate::turn::{Generated, Step, Turn, Turned};

/// How a route writes its events.
pub(crate) trait Framing: 'static {
    /// Sent before the first token, if anything.
    fn start(&mut self) -> Option<String> {
        None
    }
    /// A piece of text and its tokens' log probabilities (empty unless the request asked);
    /// empty when nothing is to be sent yet.
    fn delta(&mut self, text: &str, logprobs: &[TokenLogprob]) -> String;
    /// The answer as stored with the turn (for a retry with the same `Idempotency-Key`).
    fn reply(&self, g: &Generated) -> String;
    /// The end, once the turn is recorded (`Err`: its record failed).
    fn done(&mut self, g: &Generated, recorded: Result<(), ApiError>) -> Vec<String>;
    /// A failure of the generation.
    fn error(&mut self, e: &ApiError) -> String {
        error_event(e)
    }
    /// Work to finish once the turn is recorded and before the end is sent (a stored answer
    /// written), if any.
    fn after(
        &mut self,
        _: &Generated,
    ) -> Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>> {
        None
    }
}

/// One event: `data: {json}`.
pub(crate) fn event(value: &serde_json::Value) -> String {
    format!("data: {value}\n\n")
}

/// An answer already made, as one response of events.
pub(crate) fn replayed(frames: Vec<String>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .body(frames.concat())
}

/// `data: {"error": {code, message}}`.
pub(crate) fn error_event(e: &ApiError) -> String {
    event(&serde_json::json!({"error": {"code": e.code, "message": e.message}}))
}

/// What to generate: the prompt, the sampling and the constraint on the tokens, if any.
pub(crate) struct Job {
    /// The prompt.
    pub spec: SequenceSpec,
    /// Sampling and stopping.
    pub sampling: SamplingParams,
    /// The grammar the tokens must follow.
    pub constraint: Option<Box<dyn Constraint>>,
}

/// Submits the job and answers the event stream; the turn is recorded when generation ends,
/// and `held` (the generation slot, the session's slot) is kept until then. A client that
/// leaves cancels the sequence.
pub(crate) fn pump(
    turn: Turn,
    message: String,
    turned: Turned,
    job: Job,
    held: impl Sized + 'static,
    mut framing: impl Framing,
) -> Result<HttpResponse, ApiError> {
    let rx = turn.state.engine()?.submit_constrained(
        GenerateRequest {
            spec: job.spec,
            sampling: job.sampling,
        },
        job.constraint,
    )?;
    let (tx, out) = flume::unbounded::<Result<Bytes, actix_web::Error>>();
    let send = move |frame: String| tx.send(Ok(Bytes::from(frame))).is_ok();
    actix_web::rt::spawn(async move {
        let _held = held;
        let t = Instant::now();
        let mut g = Generated::default();
        if let Some(first) = framing.start()
            && !send(first)
        {
            return;
        }
        while let Ok(ev) = rx.recv_async().await {
            match g.absorb(ev, t) {
                Step::Wait => {}
                Step::Delta(text, logprobs) => {
                    let frame = framing.delta(&text, &logprobs);
                    if !frame.is_empty() && !send(frame) {
                        return; // the client left; dropping `rx` cancels the sequence
                    }
                }
                Step::Done => {
                    turn.observe(&g);
                    turn.span.in_scope(|| {
                        tracing::info!(target: "engram::http", "stream finished");
                    });
                    let reply = framing.reply(&g);
                    let recorded = turn.record(&message, &turned, &g, &reply).await;
                    if recorded.is_ok()
                        && let Some(work) = framing.after(&g)
                    {
                        work.await;
                    }
                    for frame in framing.done(&g, recorded.map_err(ApiError::from)) {
                        send(frame);
                    }
                    return;
                }
                Step::Failed(e) => {
                    send(framing.error(&ApiError::from(e)));
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
