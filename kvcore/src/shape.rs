//! The geometry of a model's KV cache and the codec chosen for each layer.
//!
//! Invariant: a validated [`KvShape`] has non-zero layers, KV heads and block size, and a head
//! dimension that is a multiple of 8 in `8..=1024` — every codec then packs a row into a whole
//! number of bytes, and no row is ever split across a byte.

use serde::{Deserialize, Serialize};

use crate::codec::CodecKind;
use crate::error::{KvError, KvResult};

/// Tokens per block unless configured otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// The shape of one model's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvShape {
    /// Transformer layers.
    pub layers: usize,
    /// Key/value heads per layer (after GQA grouping).
    pub kv_heads: usize,
    /// Elements per head row.
    pub head_dim: usize,
    /// Token positions per block.
    pub block_size: usize,
}

impl KvShape {
    /// A shape with the default block size of 16 tokens, validated.
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize) -> KvResult<Self> {
        Self::with_block_size(layers, kv_heads, head_dim, DEFAULT_BLOCK_SIZE)
    }

    /// A shape with an explicit block size, validated.
    pub fn with_block_size(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        block_size: usize,
    ) -> KvResult<Self> {
        let shape = Self {
            layers,
            kv_heads,
            head_dim,
            block_size,
        };
        shape.validate()?;
        Ok(shape)
    }

    /// SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, blocks of 16.
    pub const SMOLLM2_135M: Self = Self {
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
        block_size: DEFAULT_BLOCK_SIZE,
    };

    /// Checks the invariant stated in the module docs.
    pub fn validate(&self) -> KvResult<()> {
        let positive = |field: &'static str, value: usize, max: usize| {
            if value == 0 || value > max {
                Err(KvError::InvalidConfig {
                    field,
                    value: value as f64,
                    reason: "must be positive and within the supported range",
                })
            } else {
                Ok(())
            }
        };
        positive("layers", self.layers, 1024)?;
        positive("kv_heads", self.kv_heads, 1024)?;
        positive("block_size", self.block_size, 4096)?;
        crate::codec::check_head_dim(self.head_dim)
    }

    /// Elements in one token's row of one layer (all KV heads).
    pub fn token_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// The row of (position `pos` within its block, KV head `head`) among a block's rows:
    /// blocks are head-major ([`LAYOUT`]), so one head's rows of a block are contiguous.
    #[inline]
    pub fn row_in_block(&self, pos: usize, head: usize) -> usize {
        head * self.block_size + pos
    }

    /// The row of (position `pos` within block slot `slot`, KV head `head`) in a layer's plane.
    #[inline]
    pub fn row(&self, slot: u32, pos: usize, head: usize) -> usize {
        slot as usize * self.block_size * self.kv_heads + self.row_in_block(pos, head)
    }
}

/// The order of a block's rows in every tier, on disk and on the wire (hashed into an engine's
/// KV fingerprint, so bytes written in another order are recomputed, never misread): per layer,
/// codes `[layer, block, kv_head, pos, packed]` and norms `[layer, block, kv_head, pos]`. A
/// head's 16 rows of a block are one contiguous run, which the GPU decode kernel reads in whole
/// 128-byte lines and the CPU kernels walk in order.
pub const LAYOUT: &str = "kv-layout/2: [layer, block, kv_head, pos, packed], head-major blocks";

/// One codec per (layer, stream), as configured (the built codecs live in the store): keys and
/// values of a layer may use different codecs, since keys carry most of a codec's damage.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerCodecs {
    keys: Vec<CodecKind>,
    values: Vec<CodecKind>,
}

impl LayerCodecs {
    /// The same codec for keys and values in every layer.
    pub fn uniform(shape: &KvShape, kind: CodecKind) -> Self {
        Self::streams(shape, kind, kind)
    }

    /// One codec for the keys and one for the values, in every layer.
    pub fn streams(shape: &KvShape, key: CodecKind, value: CodecKind) -> Self {
        Self {
            keys: vec![key; shape.layers],
            values: vec![value; shape.layers],
        }
    }

    /// An explicit codec per layer, for keys and values alike; the length must equal the
    /// shape's layer count.
    pub fn per_layer(shape: &KvShape, kinds: Vec<CodecKind>) -> KvResult<Self> {
        Self::per_stream(shape, kinds.clone(), kinds)
    }

    /// An explicit codec per layer and stream; both lengths must equal the shape's layer count.
    pub fn per_stream(
        shape: &KvShape,
        keys: Vec<CodecKind>,
        values: Vec<CodecKind>,
    ) -> KvResult<Self> {
        for got in [keys.len(), values.len()] {
            if got != shape.layers {
                return Err(KvError::CodecCount {
                    expected: shape.layers,
                    got,
                });
            }
        }
        Ok(Self { keys, values })
    }

    /// Layers described.
    pub fn layers(&self) -> usize {
        self.keys.len()
    }

    /// The key codec of each layer, in layer order.
    pub fn keys(&self) -> &[CodecKind] {
        &self.keys
    }

    /// The value codec of each layer, in layer order.
    pub fn values(&self) -> &[CodecKind] {
        &self.values
    }

    /// Stored bits per element over every layer and both streams, norms included.
    pub fn bits_per_element(&self, head_dim: usize) -> f64 {
        let n = (self.keys.len() + self.values.len()).max(1) as f64;
        self.keys
            .iter()
            .chain(&self.values)
            .map(|k| k.bits_per_element(head_dim))
            .sum::<f64>()
            / n
    }

    /// Bytes of one token position of every layer and both streams (norms included).
    pub fn token_bytes(&self, shape: &KvShape) -> usize {
        self.keys
            .iter()
            .chain(&self.values)
            .map(|k| shape.kv_heads * (k.code_bytes(shape.head_dim) + k.norm_bytes()))
            .sum()
    }

    /// One codec for everything, when there is one.
    pub fn single(&self) -> Option<CodecKind> {
        let first = *self.keys.first()?;
        self.keys
            .iter()
            .chain(&self.values)
            .all(|&k| k == first)
            .then_some(first)
    }
}

impl std::fmt::Display for LayerCodecs {
    /// `tq4` for one codec everywhere; `q8/tq4` for one per stream (keys/values); otherwise the
    /// layers' key codecs, a slash, the layers' value codecs: `q8,tq6,…/tq4,…`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(one) = self.single() {
            return write!(f, "{one}");
        }
        let uniform = |v: &[CodecKind]| v.iter().all(|&k| Some(&k) == v.first());
        if uniform(&self.keys) && uniform(&self.values) && !self.keys.is_empty() {
            return write!(f, "{}/{}", self.keys[0], self.values[0]);
        }
        let list = |v: &[CodecKind]| {
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(",")
        };
        write!(f, "{}/{}", list(&self.keys), list(&self.values))
    }
}
