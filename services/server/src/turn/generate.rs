//! A generation: the engine's events folded into the reply, for a JSON answer or a stream.

use std::time::Instant;

use engram_engine::{
    Admission, Constraint, FinishReason, GenerateRequest, SamplingParams, SequenceSpec,
    StreamEvent, TokenLogprob, Usage,
};

use super::TurnError;
use crate::state::AppState;

/// Collected output of one generation.
#[derive(Debug, Clone)]
pub struct Generated {
    /// What the engine admitted (prompt and cached tokens, warmed and reserved blocks).
    pub admission: Option<Admission>,
    /// Text so far.
    pub text: String,
    /// Tokens so far.
    pub tokens: Vec<u32>,
    /// Their log probabilities, when the request asked.
    pub logprobs: Vec<TokenLogprob>,
    /// Why it ended.
    pub reason: FinishReason,
    /// The stop sequence that ended it, if one did.
    pub stop_sequence: Option<String>,
    /// Token counts.
    pub usage: Usage,
    /// Milliseconds from submission to the first token.
    pub ttft_ms: f64,
}

/// What one engine event meant for a generation being collected.
#[derive(Debug)]
pub enum Step {
    /// Nothing to pass on.
    Wait,
    /// New text, and its tokens' log probabilities when the request asked.
    Delta(String, Vec<TokenLogprob>),
    /// The end (the reason and usage are in the `Generated`).
    Done,
    /// The request failed.
    Failed(TurnError),
}

impl Default for Generated {
    fn default() -> Self {
        Self {
            admission: None,
            text: String::new(),
            tokens: Vec::new(),
            logprobs: Vec::new(),
            reason: FinishReason::Stop,
            stop_sequence: None,
            usage: Usage {
                prompt_tokens: 0,
                cached_tokens: 0,
                completion_tokens: 0,
            },
            ttft_ms: 0.0,
        }
    }
}

impl Generated {
    /// Folds one engine event in; `submitted` is when the request went to the engine.
    pub fn absorb(&mut self, ev: StreamEvent, submitted: Instant) -> Step {
        match ev {
            StreamEvent::Started(a) => {
                self.admission = Some(a);
                Step::Wait
            }
            StreamEvent::Delta {
                tokens,
                text,
                logprobs,
            } => {
                if self.tokens.is_empty() {
                    self.ttft_ms = submitted.elapsed().as_secs_f64() * 1e3;
                }
                self.tokens.extend(tokens);
                self.text.push_str(&text);
                self.logprobs.extend(logprobs.iter().cloned());
                Step::Delta(text, logprobs)
            }
            StreamEvent::Done {
                reason,
                stop_sequence,
                usage,
            } => {
                self.reason = reason;
                self.stop_sequence = stop_sequence;
                self.usage = usage;
                Step::Done
            }
            StreamEvent::Failed(e) => Step::Failed(e.into()),
        }
    }
}

/// Runs one generation to the end, its tokens constrained by `constraint` when given.
pub async fn generate(
    state: &AppState,
    spec: SequenceSpec,
    sampling: SamplingParams,
    constraint: Option<Box<dyn Constraint>>,
) -> Result<Generated, TurnError> {
    let rx = state
        .engine()?
        .submit_constrained(GenerateRequest { spec, sampling }, constraint)?;
    let t = Instant::now();
    let mut out = Generated::default();
    while let Ok(ev) = rx.recv_async().await {
        match out.absorb(ev, t) {
            Step::Wait | Step::Delta(..) => {}
            Step::Done => return Ok(out),
            Step::Failed(e) => return Err(e),
        }
    }
    Err(TurnError::StreamClosed)
}

/// Prefills `spec` (one greedy token, discarded) and waits for the end: what replay, the
/// canonical-prefix warm and an injection do. Answers the prompt's token counts.
pub async fn prefill(state: &AppState, spec: SequenceSpec) -> Result<Usage, TurnError> {
    let rx = state.engine()?.submit(GenerateRequest {
        spec,
        sampling: SamplingParams::greedy(1),
    })?;
    while let Ok(ev) = rx.recv_async().await {
        match ev {
            StreamEvent::Done { usage, .. } => return Ok(usage),
            StreamEvent::Failed(e) => return Err(e.into()),
            _ => {}
        }
    }
    Err(TurnError::StreamClosed)
}
