//! # engram-context
//!
//! The layered prompt builder of docs/design.md §2 step 2, free of I/O: an agent's layers
//! ([`Layer`]) are fitted to their token budgets by the [`synthesize`] extractive synthesizer and
//! ordered by volatility by [`build`], which returns tagged [`Segment`]s for the engine, the
//! stable prefix's hash, tokens per layer and the lines spilled to working memory.
//!
//! Token counts come from the caller through [`TokenCounter`] (the engine's tokenizer), so this
//! crate knows nothing of models.

#![forbid(unsafe_code)]

mod chat;
mod layers;
mod pipeline;
mod synth;

pub use chat::{CHATML, ChatFormat, FormatSource, FrameRole, Wrap};
pub use layers::{Budgets, Layer, LayerKind, Volatility};
pub use pipeline::{
    BuiltContext, ContextError, ContextRequest, Fit, FitReport, LayerReport, Segment, Speaker,
    Turn, build,
};
pub use synth::{ScoredLine, Synthesis, content_tokens, score_line, synthesize};

/// Counts tokens of a text (the engine's tokenizer, or a stand-in in tests of pure logic).
pub trait TokenCounter {
    /// Tokens of `text`.
    fn count(&self, text: &str) -> usize;
}
