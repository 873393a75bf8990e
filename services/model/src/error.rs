//! The model's error type: one enum, fields not formatted strings.

use std::path::PathBuf;

use engram_kvcore::KvError;

/// Errors of loading and running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
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
    /// A tensor whose shape is not the one the model's metadata implies.
    #[error("model weights: tensor `{name}` has shape {got:?}, expected {expected}")]
    TensorShape {
        /// The tensor's name in the file.
        name: String,
        /// The shape the metadata implies (`*`: any length).
        expected: String,
        /// The file's shape.
        got: Vec<usize>,
    },
    /// A model file that cannot be run, with the file named.
    #[error("{}: {source}", path.display())]
    InFile {
        /// The model file.
        path: PathBuf,
        /// Why.
        #[source]
        source: Box<ModelError>,
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
    #[error(
        "unsupported architecture `{arch}` (the families this build runs: `engram_model::ARCHES`)"
    )]
    UnsupportedArchitecture {
        /// `general.architecture` or `model_type`.
        arch: String,
    },
    /// The model asks for a RoPE scaling the engine does not implement: running it with plain
    /// RoPE would load without error and answer wrongly past its original context.
    #[error(
        "unsupported RoPE scaling `{kind}` (the engine runs plain, linear and Llama 3-style \
         RoPE, each where its family uses it; others are refused rather than run with the wrong \
         positions)"
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
    /// A model option or an input of the forward is out of range.
    #[error("invalid model option `{field}`: {reason}")]
    InvalidConfig {
        /// The option.
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
}

/// The model's result type.
pub type ModelResult<T> = Result<T, ModelError>;

pub(crate) fn io_error(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

pub(crate) fn metadata(key: &str) -> ModelError {
    ModelError::Metadata {
        key: key.to_string(),
    }
}
