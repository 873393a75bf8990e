//! # engram-kvcore
//!
//! Engram's KV cache as a structure whose bytes are the same in every tier and whose meaning is
//! known: packed K/V codes in a `[layer, block, kv_head, pos, packed]` layout, codecs that
//! attention reads without decoding (TurboQuant 2/3/4-bit, Q8, F16), a hot and a cold tier with
//! bulk spill and warm, a metadata table tagging each block with its prompt layer, tenant,
//! session and importance, soft-capped prefix pins, and eviction by semantic priority.
//!
//! The crate is synchronous and knows nothing of HTTP, SQL or async runtimes.

// Unsafe code lives in three places only: the CUDA tiers (feature `cuda`), the x86 SIMD
// kernels (`simd::x86`) and the worker team's job hand-off (`team`); each allows it locally and
// every block states its safety argument.
#![deny(unsafe_code)]

/// The README's example compiles and runs as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeExample;

mod attention;
mod block;
mod codec;
mod dense;
mod error;
mod evict;
mod metadata;
mod pin;
mod relocate;
pub mod shadow;
mod shape;
mod simd;
mod store;
#[allow(unsafe_code)]
pub mod team;

pub use attention::MIN_KEYS_PER_THREAD;
pub use attention::{AttentionParams, attend_dense};
pub use block::{BlockId, BlockTags, SessionId, SourceLayer, TenantId, Tier, TokenRange};
pub use codec::rng::SplitMix64;
pub use codec::{
    CODEC_NAMES, Codec, CodecKind, DEFAULT_ROTATION_SEED, MAX_OUTLIERS, MAX_SPLIT_HEAD_DIM, Rows,
    TurboQuantTables, UnknownCodec,
};
pub use error::{KvError, KvResult};
pub use evict::Eviction;
pub use metadata::{
    BlockFilter, BlockMeta, BlockMetadataTable, DEGRADED_PIN_PRIORITY, PINNED_PRIORITY, PinState,
    Precision, PriorityTable,
};
pub use pin::{PinPolicy, PinReport, PrefixPinManager, UnpinReport};
pub use relocate::{Relocated, Relocation, Rope};
pub use shape::{DEFAULT_BLOCK_SIZE, KvShape, LAYOUT, LayerCodecs};
pub use simd::Isa;
pub use store::host::HostTier;
#[cfg(feature = "cuda")]
pub use store::hot::CudaLayer;
pub use store::hot::{CudaTier, HotStorage, HotTier, HotTierKind};
pub use store::{BlockPart, BlockStore, BlockStream, StageStats, StoreConfig};
