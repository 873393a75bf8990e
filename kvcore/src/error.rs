//! The one error type of the crate. Every fallible operation returns [`KvResult`]; every variant
//! carries the values that explain it, never a preformatted string. An operation that returns an
//! error has changed nothing (the store validates before it mutates).

use crate::block::{BlockId, Tier};

/// Result alias of the crate.
pub type KvResult<T> = Result<T, KvError>;

/// Everything that can go wrong in kvcore.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvError {
    /// A shape or configuration value is outside what the crate supports.
    #[error("invalid {field} = {value}: {reason}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// Its value (as a float so that shares and counts fit).
        value: f64,
        /// What the field must satisfy.
        reason: &'static str,
    },
    /// TurboQuant supports 2 to 6 bits per coordinate.
    #[error("TurboQuant supports 2 to 6 bits, got {bits}")]
    UnsupportedBits {
        /// The requested bit width.
        bits: u8,
    },
    /// The codec list does not have one codec per layer.
    #[error("expected {expected} layer codecs, got {got}")]
    CodecCount {
        /// Number of layers in the shape.
        expected: usize,
        /// Number of codecs given.
        got: usize,
    },
    /// A row buffer has the wrong number of elements.
    #[error("row buffer has {got} elements, expected {expected}")]
    RowWidth {
        /// Elements the operation needs.
        expected: usize,
        /// Elements it was given.
        got: usize,
    },
    /// Tokens do not fit the blocks they are written to or read from.
    #[error("tokens {start}..{end} do not fit in {capacity} token slots")]
    TokenRange {
        /// First token.
        start: usize,
        /// One past the last token.
        end: usize,
        /// Token slots the blocks offer.
        capacity: usize,
    },
    /// The layer index is out of range.
    #[error("layer {layer} out of range (the shape has {layers} layers)")]
    UnknownLayer {
        /// The requested layer.
        layer: usize,
        /// Layers in the shape.
        layers: usize,
    },
    /// The query head count is not a positive multiple of the KV head count.
    #[error("{num_heads} query heads cannot share {kv_heads} KV heads")]
    HeadGrouping {
        /// Query heads.
        num_heads: usize,
        /// KV heads.
        kv_heads: usize,
    },
    /// The row's values are not finite, or its norm overflows the stored f16.
    #[error("row is not encodable: norm {norm} is not a finite f16")]
    NotEncodable {
        /// The row's norm (or absmax for Q8).
        norm: f32,
    },
    /// An importance outside 0..=1.
    #[error("importance {value} is outside 0..=1")]
    InvalidImportance {
        /// The rejected value.
        value: f32,
    },
    /// No block has this id (it was never allocated).
    #[error("unknown block {id}")]
    UnknownBlock {
        /// The id.
        id: BlockId,
    },
    /// The block existed and has been freed: a double free or a use after free.
    #[error("block {id} was already freed")]
    AlreadyFreed {
        /// The id.
        id: BlockId,
    },
    /// The same block appears twice in one call.
    #[error("block {id} is listed twice")]
    DuplicateBlock {
        /// The id.
        id: BlockId,
    },
    /// The block is not in the tier the operation needs.
    #[error("block {id} is in the {actual} tier, the operation needs {expected}")]
    WrongTier {
        /// The id.
        id: BlockId,
        /// The tier the operation needs.
        expected: Tier,
        /// The tier it is in.
        actual: Tier,
    },
    /// A tier has fewer free blocks than requested.
    #[error("{tier} tier exhausted: {requested} blocks requested, {available} available")]
    TierExhausted {
        /// The tier.
        tier: Tier,
        /// Blocks the operation needs.
        requested: usize,
        /// Blocks it could get.
        available: usize,
    },
    /// The block is in the reduced cold pool, and the operation needs it in the layer's codec
    /// (warm it first).
    #[error("block {id} is down-tiered to the reduced pool; warm it first")]
    Reduced {
        /// The id.
        id: BlockId,
    },
    /// Down-tiering was asked of a store built without a reduced pool.
    #[error("the store has no reduced pool (down-tiering is off)")]
    NoReducedPool,
    /// The block's reference count would overflow.
    #[error("block {id} reference count overflow")]
    RefCountOverflow {
        /// The id.
        id: BlockId,
    },
    /// A block's bytes have the wrong length for this store.
    #[error("block bytes have length {got}, the store's blocks have {expected}")]
    BlockBytesLength {
        /// Bytes of one block in this store.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// A shadow segment file is not what this store wrote.
    #[error("shadow segment: {reason} ({detail})")]
    Segment {
        /// What is wrong.
        reason: &'static str,
        /// The tensor or the parser's message.
        detail: String,
    },
    /// The operation needs bytes the CPU can read, but the block lives in device memory.
    #[error("the hot tier is on a device; the operation needs host memory")]
    HostAccessRequired,
    /// The CUDA hot tier was requested but the crate was built without the `cuda` feature.
    #[error("the CUDA hot tier needs engram-kvcore built with the `cuda` feature")]
    CudaNotCompiled,
    /// A CUDA driver call failed (device memory, copies, the copy kernel).
    #[error("CUDA: {0}")]
    Cuda(String),
    /// A relocated run ([`crate::Relocated`]) is empty, out of order, past the sequence or off
    /// block boundaries.
    #[error("relocated run {run} ({start}..{end}) {reason}")]
    BadRelocation {
        /// Its index.
        run: usize,
        /// Its first position.
        start: usize,
        /// One past its last.
        end: usize,
        /// What it breaks.
        reason: &'static str,
    },
}
