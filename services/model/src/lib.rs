//! # engram-model
//!
//! The decoder and everything a model is: weights ([`weights`]: GGUF kept in its blocks or
//! dequantized, safetensors), the tokenizer and chat template, the sentence embedder, and the
//! forward passes — on the CPU over plain f32 buffers, on a CUDA device over candle tensors and
//! Engram's kernels (a stand-in without the `cuda` feature). Attention reads and writes
//! [`engram_kvcore::BlockStore`] blocks; the serving engine (`engram-engine`) decides which.
//!
//! - [`Arch`] is what differs between families, one row each ([`ARCHES`]);
//! - [`Llama`] loads a checkpoint and runs ragged batches ([`Llama::forward`]);
//! - [`KvTap`] is the instrument hook on new K/V rows (the fidelity harness implements it).

#![forbid(unsafe_code)]

mod arch;
pub mod chat_template;
pub mod embed;
mod error;
mod gguf;
mod held;
mod llama;
mod rope_scaling;
mod tap;
mod tokenizer;
mod weights;

pub use arch::{
    ARCHES, Activation, Arch, GEMMA3, LLAMA, Norm, QWEN2, Rope, RopeScaling, Sliding, Tied,
};
pub use error::{ModelError, ModelResult};
pub use held::{DEVICE_WEIGHTS, DeviceWeights};
pub use llama::{
    ForwardTimes, KvTransform, Llama, LogitRows, SeqInput, add_forward_times, log_softmax_rows,
    take_forward_times,
};
pub use tap::KvTap;
pub use tokenizer::{ChatMessage, Role, StreamDecoder, TextTokenizer, chatml};
pub use weights::{ModelConfig, WeightFormat};
