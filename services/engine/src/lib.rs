//! # engram-engine
//!
//! Engram's inference core: a candle Llama whose KV cache lives in kvcore blocks.
//!
//! - [`Llama`] loads GGUF (dequantized to f32) or safetensors and runs ragged batches whose
//!   attention writes and reads [`engram_kvcore::BlockStore`] blocks;
//! - [`EngineCore`] adds the prefix cache (chained block hashes), semantic eviction and pins;
//! - [`Engine`] runs an `EngineCore` on its own thread with continuous batching, a bounded queue
//!   and token streams;
//! - [`eval`] and [`bench`] are the fidelity harness and the TTFT/decode benchmark.

#![forbid(unsafe_code)]

pub mod bench;
mod bridge;
pub mod calibrate;
pub mod chat_template;
mod core;
pub mod embed;
mod error;
pub mod eval;
pub mod fusion;
mod gguf;
mod hex;
mod model;
mod prefix;
mod probe;
pub mod profile;
pub mod relocation;
mod sampling;
mod scheduler;
mod tokenizer;
mod weights;

pub use crate::core::{
    Admission, CacheCounters, ChunkOutput, DownTier, EngineConfig, EngineCore, EngineDevice,
    EngineFault, EvictReport, FaultKind, ForgetReport, KeyCentering, NUMERICS, Occupancy,
    PUBLIC_TENANT, PrefillStep, PrefixLookup, PrefixReuse, PromptSegment, ReservationCounters,
    ReservationId, ReservationInfo, ReservationState, ReserveRequest, SeqId, SequenceSpec,
    StepOutput,
};
pub use crate::core::{
    CHAINS_PER_TENANT, ChainKey, CollectedBytes, Hex32, MAX_CHAINS, RestoreChain, RestoreReport,
    ShadowBlock, ShadowChain,
};
pub use crate::core::{CycleReport, TierCosts, TierObservation, TierPolicy};
pub use crate::core::{EvictionMode, EvictionPolicy};
pub use crate::core::{FusionPolicy, FusionStatus, MAX_PARTNERS};
pub use crate::core::{MAX_SEGMENTS, RelocationPolicy};
pub use bridge::{CycleRecord, TIER_HISTORY, TierBridge, tier_cycle};
pub use error::{EngineError, EngineResult};
pub use model::{
    ForwardTimes, KvTransform, Llama, LogitRows, SeqInput, log_softmax_rows, take_forward_times,
};
pub use prefix::{BlockHash, PrefixCache, chain_hash};
pub use probe::{CODEC_NAMES, KvProbe, StreamCodecs, parse_codec};
pub use sampling::{Sampler, SamplingParams, argmax};
pub use scheduler::{
    BlockInfo, BlockPage, BlockQuery, CollectRequest, Engine, EngineSnapshot, FinishReason,
    GenerateRequest, KvFormat, StreamEvent, Usage,
};
pub use tokenizer::{ChatMessage, Role, StreamDecoder, TextTokenizer, chatml};
pub use weights::{DeviceWeights, ModelConfig, WeightFormat};
