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
}

/// One codec per layer, as configured (the built codecs live in the store).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerCodecs(Vec<CodecKind>);

impl LayerCodecs {
    /// The same codec in every layer.
    pub fn uniform(shape: &KvShape, kind: CodecKind) -> Self {
        Self(vec![kind; shape.layers])
    }

    /// An explicit codec per layer; the length must equal the shape's layer count.
    pub fn per_layer(shape: &KvShape, kinds: Vec<CodecKind>) -> KvResult<Self> {
        if kinds.len() != shape.layers {
            return Err(KvError::CodecCount {
                expected: shape.layers,
                got: kinds.len(),
            });
        }
        Ok(Self(kinds))
    }

    /// The codec of each layer, in layer order.
    pub fn kinds(&self) -> &[CodecKind] {
        &self.0
    }
}
