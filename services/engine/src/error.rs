//! The engine's error type: one enum, fields not formatted strings. What the model refuses
//! arrives as [`EngineError::Model`], except a request's own mistakes (an empty prompt, a token
//! outside the vocabulary, a prompt past the context) and tensor or KV failures, which keep
//! their variants here: a caller tells a bad request from a broken model by variant alone.

use std::path::PathBuf;

use engram_kvcore::KvError;
use engram_model::ModelError;

/// Errors of the inference core.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model could not be loaded or refused to run (see [`ModelError`]).
    #[error(transparent)]
    Model(ModelError),
    /// A model or tokenizer file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A tensor operation or a GGUF/safetensors parse failed.
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// The KV store refused an operation.
    #[error("kv store: {0}")]
    Kv(#[from] KvError),
    /// An engine option is out of range.
    #[error("invalid engine config `{field}`: {reason}")]
    InvalidConfig {
        /// The option.
        field: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// A sampling parameter is out of range.
    #[error("invalid sampling parameter `{field}`: {reason}")]
    InvalidSampling {
        /// The parameter.
        field: &'static str,
        /// Why it is rejected.
        reason: String,
    },
    /// A sequence's constraint (its grammar) failed or allowed no token.
    #[error("constrained decoding failed: {reason}")]
    Constraint {
        /// Why.
        reason: String,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A token id is outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// Prompt plus generation would exceed the model's context.
    #[error("{requested} tokens exceed the context of {context} tokens")]
    ContextOverflow {
        /// Prompt tokens plus `max_tokens`.
        requested: usize,
        /// The model's context length.
        context: usize,
    },
    /// The request queue is full; retry later.
    #[error("the engine is overloaded: {queued} requests queued (capacity {capacity})")]
    Overloaded {
        /// Requests waiting.
        queued: usize,
        /// The queue's bound.
        capacity: usize,
    },
    /// A tenant's quota would be exceeded.
    #[error("quota `{resource}` exceeded: {requested} requested, {quota} allowed")]
    QuotaExceeded {
        /// Which quota.
        resource: &'static str,
        /// What the request would bring the tenant to.
        requested: usize,
        /// The limit.
        quota: usize,
    },
    /// A reservation does not fit in the cold tier.
    #[error("the cold tier cannot hold {needed} more blocks ({available} free or reclaimable)")]
    NoColdRoom {
        /// Blocks needed.
        needed: usize,
        /// Free or reclaimable cold blocks.
        available: usize,
    },
    /// The hot tier cannot free enough slots without dropping blocks of a tenant the work is
    /// not for (which are only spilled, never dropped, while the tenant is within its quota).
    #[error("the hot tier cannot free {needed} blocks ({available} free or reclaimable)")]
    NoHotRoom {
        /// Blocks needed.
        needed: usize,
        /// Free or reclaimable hot blocks.
        available: usize,
    },
    /// No live reservation has this id.
    #[error("no live reservation {id}")]
    UnknownReservation {
        /// The id asked for.
        id: u64,
    },
    /// A shadowed or imported chain does not match this engine (model, format, hashes).
    #[error("shadowed block {index}: {reason}")]
    ShadowMismatch {
        /// Position of the block in its chain.
        index: usize,
        /// What does not match.
        reason: &'static str,
    },
    /// The engine thread is gone.
    #[error("the engine has stopped")]
    Stopped,
    /// The engine panicked while serving this request (it goes on serving the others).
    #[error("the engine failed while serving this request: {0}")]
    Panicked(String),
}

/// The engine's result type.
pub type EngineResult<T> = Result<T, EngineError>;

impl From<ModelError> for EngineError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::EmptyPrompt => Self::EmptyPrompt,
            ModelError::TokenOutOfRange { id, vocab } => Self::TokenOutOfRange { id, vocab },
            ModelError::ContextOverflow { requested, context } => {
                Self::ContextOverflow { requested, context }
            }
            ModelError::Kv(e) => Self::Kv(e),
            ModelError::Candle(e) => Self::Candle(e),
            other => Self::Model(other),
        }
    }
}

/// `std::fs` errors of `path` as [`EngineError::Io`] (for `map_err`).
pub fn io_error(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    }
}
