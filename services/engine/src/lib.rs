//! # engram-engine
//!
//! Engram's serving engine: the model (`engram-model`) over a KV cache in kvcore blocks.
//!
//! - [`EngineCore`] holds the model, the prefix cache (chained block hashes), semantic
//!   eviction, pins, the tiers and the shadow's records;
//! - [`Engine`] runs an `EngineCore` on its own thread with continuous batching, a bounded queue
//!   and token streams.
//!
//! The model's types are re-exported here ([`Llama`], [`TextTokenizer`], …) so that a caller
//! of the engine needs one crate. The fidelity harness and benchmarks are `engram-lab`.

#![forbid(unsafe_code)]

mod bridge;
mod codecs;
mod core;
mod error;
mod hex;
mod prefix;
pub mod profile;
mod sampling;
mod scheduler;

pub use crate::core::{
    Admission, CacheCounters, ChunkOutput, DownTier, EngineConfig, EngineCore, EngineDevice,
    EngineFault, EvictReport, FaultKind, ForgetReport, KeyCentering, NUMERICS, Occupancy,
    PUBLIC_TENANT, PrefillStep, PrefixLookup, PrefixReuse, PromptSegment, ReservationCounters,
    ReservationId, ReservationInfo, ReservationState, ReserveRequest, SeqId, SequenceSpec,
    StepOutput, Tap, open_on,
};
pub use crate::core::{
    CHAINS_PER_TENANT, ChainKey, CollectedBytes, Hex32, MAX_CHAINS, RestoreChain, RestoreReport,
    ShadowBlock, ShadowChain,
};
pub use crate::core::{CycleReport, TierCosts, TierObservation, TierPolicy};
pub use crate::core::{EvictionMode, EvictionPolicy};
pub use crate::core::{MAX_SEGMENTS, RelocationPolicy};
pub use bridge::{CycleRecord, TIER_HISTORY, TierBridge, tier_cycle};
pub use codecs::{CODEC_NAMES, StreamCodecs, parse_codec};
pub use engram_model::{
    ChatMessage, DeviceWeights, ForwardTimes, KvTap, KvTransform, Llama, LogitRows, ModelConfig,
    ModelError, Role, SeqInput, StreamDecoder, TextTokenizer, WeightFormat, chat_template, chatml,
    embed, log_softmax_rows, take_forward_times,
};
pub use error::{EngineError, EngineResult, io_error};
pub use prefix::{BlockHash, PrefixCache, chain_hash};
pub use sampling::{
    Constraint, MAX_TOP_LOGPROBS, Sampler, SamplingParams, TokenLogprob, argmax, logprobs_of,
};
pub use scheduler::{
    BlockInfo, BlockPage, BlockQuery, CollectRequest, Engine, EngineSnapshot, FinishReason,
    GenerateRequest, KvFormat, StreamEvent, Usage,
};
