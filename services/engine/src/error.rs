//! The engine's error type: one enum, fields not formatted strings.

use std::path::PathBuf;

use engram_kvcore::KvError;

/// Errors of the inference core.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
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
    /// A model file lacks a required metadata key or config field.
    #[error("model metadata: missing or invalid `{key}`")]
    Metadata {
        /// The key (GGUF metadata key or config.json field).
        key: String,
    },
    /// A model file lacks a tensor.
    #[error("model weights: missing tensor `{name}`")]
    MissingTensor {
        /// The tensor's name in the file.
        name: String,
    },
    /// A tensor's blocks do not fit its shape (a truncated or corrupt file).
    #[error("model weights `{name}`: {source}")]
    Blocks {
        /// The tensor's name in the file.
        name: String,
        /// What did not fit.
        source: engram_qmatmul::QError,
    },
    /// The file holds an architecture the engine does not run.
    #[error("unsupported architecture `{arch}` (the engine runs Llama-family models)")]
    UnsupportedArchitecture {
        /// `general.architecture` or `model_type`.
        arch: String,
    },
    /// The model asks for a RoPE scaling the engine does not implement: running it with plain
    /// RoPE would load without error and answer wrongly past its original context.
    #[error(
        "unsupported RoPE scaling `{kind}` (the engine runs plain RoPE; Llama 3.1/3.2-style \
         scaled checkpoints are refused rather than run with the wrong positions)"
    )]
    UnsupportedRopeScaling {
        /// `rope_scaling.rope_type`/`type`, `llama.rope.scaling.type`, or `rope_freqs` (the
        /// per-frequency factors a GGUF conversion of a scaled model carries).
        kind: String,
    },
    /// The tokenizer could not be built or failed on input.
    #[error("tokenizer: {reason}")]
    Tokenizer {
        /// What went wrong, from the tokenizers crate.
        reason: String,
    },
    /// A device kernel or driver call failed (CUDA builds).
    #[error("device: {0}")]
    Device(String),
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

pub(crate) fn io_error(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> EngineError + '_ {
    move |source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn metadata(key: &str) -> EngineError {
    EngineError::Metadata {
        key: key.to_string(),
    }
}
