//! # engram-kernels
//!
//! CUDA kernels for the TurboQuant-4 KV cache, compiled by NVRTC at run time:
//! - `tq4_encode`: rotate (random signs + Walsh–Hadamard), scale to the unit sphere, quantize
//!   against the Lloyd–Max thresholds, pack two codes per byte, store the f16 norm — the same
//!   bytes as [`engram_kvcore::Codec::encode`], written straight into a layer's code plane;
//! - `tq4_decode_mma` + `tq4_combine_items`: paged decode attention on tensor cores
//!   (`mma.m16n8k16`, the GQA group's query heads as the N dimension, codes turned into f16
//!   operands through a shared-memory pair table, lazy log2-domain softmax), cut into work items
//!   by a host plan ([`ItemPlan`]) and merged by a combine; the engine's decode path on
//!   16-position blocks. [`mma`] emulates its fragment arithmetic on the CPU (tested in CI);
//! - `tq4_prefill_mma`: causal prefill attention of a chunk's queries over the codes on tensor
//!   cores, flash-attention style: each 64-position tile dequantized once into shared memory
//!   (swizzled for `ldmatrix`) and shared by the CTA's 96–128 query rows; no f32 expansion of
//!   the prefix. [`prefill`] emulates its tile formulation on the CPU (tested in CI);
//! - `tq4_decode_attention` + `tq4_combine`: the FP32 CUDA-core form of the same attention, the
//!   reference path (and the path for other block sizes), the GPU form of
//!   [`engram_kvcore::BlockStore::attend`] step for step ([`reference`]).
//!
//! Without the `cuda` feature the crate holds the kernel source, the plans and the CPU
//! references only, so CI builds and tests it with no CUDA anywhere; [`gpu`] (feature `cuda`)
//! launches the kernels, and the `engram-gpu-check` binary compares every kernel with its CPU
//! reference on random inputs (`engram-gpu-bench` times them).

#![cfg_attr(not(feature = "cuda"), forbid(unsafe_code))]

pub mod glue;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod mma;
pub mod prefill;
pub mod reference;

/// The CUDA C source of the TurboQuant-4 kernels and the fused layer glue (`glue.cu`, which
/// uses tq4.cu's encode), one NVRTC module.
pub const TQ4_SOURCE: &str = concat!(include_str!("tq4.cu"), "\n", include_str!("glue.cu"));

/// Positions one attention CTA scores (the split-K chunk); a compile-time constant of the kernel.
pub const DEFAULT_CHUNK: usize = 512;

/// Errors of the kernels.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The shape or codec has no kernel.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An argument does not fit the others.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// NVRTC refused the source.
    #[error("NVRTC: {0}")]
    Compile(String),
    /// The driver failed.
    #[error("CUDA: {0}")]
    Driver(String),
    /// The codec or the dense reference refused its input.
    #[error(transparent)]
    Kv(#[from] engram_kvcore::KvError),
}

/// How a batch of decode attention is cut: `splits` CTAs of `chunk` positions per
/// (sequence, KV head), enough for the longest sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    /// Positions per CTA.
    pub chunk: usize,
    /// CTAs per (sequence, KV head).
    pub splits: usize,
}

impl SplitPlan {
    /// The plan for sequences of at most `max_len` positions.
    pub fn new(max_len: usize, chunk: usize) -> Result<Self, KernelError> {
        if max_len == 0 || chunk == 0 {
            return Err(KernelError::Invalid(
                "sequences and chunks need at least one position".into(),
            ));
        }
        Ok(Self {
            chunk,
            splits: max_len.div_ceil(chunk),
        })
    }
}

/// Positions of one KV page: the tensor-core kernel's tile (kvcore's default block size).
pub const PAGE: usize = 16;

/// The smallest and largest chunk the work-item plan picks on its own.
pub const MIN_CHUNK: usize = 64;
/// See [`MIN_CHUNK`].
pub const MAX_CHUNK: usize = 2048;

/// How a ragged batch of decode attention is cut into work items for the tensor-core kernel
/// (`tq4_decode_mma`): every item is `(sequence, start, end)`, `chunk` positions of one sequence
/// (the last one shorter), so that variable lengths balance; the items of sequence `b` are
/// `seq_first[b] .. seq_first[b + 1]`, and the combine merges exactly those.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemPlan {
    /// Positions per item, a multiple of [`PAGE`].
    pub chunk: usize,
    /// `(sequence, start, end)` triples, flattened for the kernel.
    pub items: Vec<i32>,
    /// Prefix sums of items per sequence (`batch + 1` entries).
    pub seq_first: Vec<i32>,
}

impl ItemPlan {
    /// The plan for sequences of `lens` positions on a card that runs `slots` CTAs' items at
    /// once: the chunk is the power of two nearest above `Σ len / slots`, clamped to
    /// [`MIN_CHUNK`] (256 once the batch holds more than 8K positions) .. [`MAX_CHUNK`]; `chunk`
    /// overrides it (a multiple of [`PAGE`]). Sequences of length 0 get no items (their output
    /// is zeros).
    pub fn new(lens: &[usize], slots: usize, chunk: Option<usize>) -> Result<Self, KernelError> {
        let total: usize = lens.iter().sum();
        let chunk = match chunk {
            Some(c) if c == 0 || !c.is_multiple_of(PAGE) => {
                return Err(KernelError::Invalid(format!(
                    "chunk {c} is not a positive multiple of {PAGE}"
                )));
            }
            Some(c) => c,
            None => {
                let lo = if total <= 8192 { MIN_CHUNK } else { 256 };
                (total / slots.max(1))
                    .next_power_of_two()
                    .clamp(lo, MAX_CHUNK)
            }
        };
        let int = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| KernelError::Invalid(format!("{what} {v} over i32")))
        };
        let mut items = Vec::new();
        let mut seq_first = Vec::with_capacity(lens.len() + 1);
        seq_first.push(0);
        for (b, &len) in lens.iter().enumerate() {
            for start in (0..len).step_by(chunk) {
                let end = (start + chunk).min(len);
                items.extend_from_slice(&[
                    int(b, "sequence")?,
                    int(start, "start")?,
                    int(end, "end")?,
                ]);
            }
            seq_first.push(int(items.len() / 3, "items")?);
        }
        Ok(Self {
            chunk,
            items,
            seq_first,
        })
    }

    /// Work items.
    pub fn len(&self) -> usize {
        self.items.len() / 3
    }

    /// Whether the batch has no positions at all.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// `(sequence, start, end)` of item `i`.
    pub fn item(&self, i: usize) -> (usize, usize, usize) {
        let at = |k: usize| self.items[3 * i + k] as usize;
        (at(0), at(1), at(2))
    }
}

/// How a page orders its rows: `[kv_head][pos]` (head-major: a head's 16 rows contiguous,
/// kvcore's layout, `engram_kvcore::LAYOUT`) or `[pos][kv_head]` (token-major, kvcore's layout
/// until head-major pages measured faster). The tensor-core kernels read either; the bench
/// measures both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageLayout {
    /// Row of (pos, head) = pos · kv_heads + head.
    TokenMajor,
    /// Row of (pos, head) = head · 16 + pos (kvcore's layout).
    HeadMajor,
}

impl PageLayout {
    /// `(pos_stride, head_stride)` in rows, for `kv_heads` KV heads.
    pub fn strides(self, kv_heads: usize) -> (usize, usize) {
        match self {
            Self::TokenMajor => (kv_heads, 1),
            Self::HeadMajor => (1, PAGE),
        }
    }
}

/// A layer's plane in kvcore's head-major pages (`[slot][head][pos]` rows of `row_bytes`)
/// rewritten token-major (`[slot][pos][head]`): what [`PageLayout::TokenMajor`] reads (the
/// checks and the bench lay data out this way to compare the two).
pub fn to_token_major(bytes: &[u8], row_bytes: usize, kv_heads: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    let page = PAGE * kv_heads;
    for (i, src) in bytes.chunks_exact(row_bytes).enumerate() {
        let (slot, rest) = (i / page, i % page);
        let (head, pos) = (rest / PAGE, rest % PAGE);
        let to = slot * page + pos * kv_heads + head;
        out[to * row_bytes..][..row_bytes].copy_from_slice(src);
    }
    out
}

/// NVRTC defines for one kernel build.
pub fn defines(head_dim: usize, group: usize, chunk: usize) -> Result<Vec<String>, KernelError> {
    if head_dim != 64 && head_dim != 128 {
        return Err(KernelError::Unsupported(format!(
            "head_dim {head_dim} (the kernels take 64 or 128)"
        )));
    }
    if group == 0 || group > 8 {
        return Err(KernelError::Unsupported(format!(
            "{group} query heads per KV head (1..=8)"
        )));
    }
    if chunk == 0 || chunk > 1024 || !chunk.is_multiple_of(128) {
        return Err(KernelError::Unsupported(format!(
            "chunk {chunk} (a multiple of 128 up to 1024)"
        )));
    }
    Ok(vec![
        format!("-DHEAD_DIM={head_dim}"),
        format!("-DGROUP={group}"),
        format!("-DCHUNK={chunk}"),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_holds_every_entry_point_and_plans_cover_the_longest_sequence() {
        for name in ["tq4_encode", "tq4_decode_attention", "tq4_combine"] {
            assert!(TQ4_SOURCE.contains(&format!(" {name}(")), "{name}");
        }
        assert_eq!(SplitPlan::new(32_768, 512).unwrap().splits, 64);
        assert_eq!(SplitPlan::new(513, 512).unwrap().splits, 2);
        assert!(SplitPlan::new(0, 512).is_err());
        assert!(defines(96, 4, 512).is_err());
        assert!(defines(128, 4, 500).is_err());
        assert_eq!(defines(128, 4, 512).unwrap()[1], "-DGROUP=4");
        for name in [
            "tq4_decode_mma",
            "tq4_combine_items",
            "tq4_prefill_mma",
            "glue_add_rms_norm",
            "glue_qkv_rope_encode",
            "glue_swiglu",
        ] {
            assert!(TQ4_SOURCE.contains(&format!(" {name}(")), "{name}");
        }
    }

    #[test]
    fn item_plans_cover_every_position_once_and_balance_the_card() {
        // 4K batch 1 on 132 SMs × 2: 4096 / 264 = 15.5 → the floor of 64.
        let p = ItemPlan::new(&[4096], 264, None).unwrap();
        assert_eq!((p.chunk, p.len()), (64, 64));
        // 32K batch 16: 524,288 / 264 → 2048 (the ceiling).
        let p = ItemPlan::new(&[32_768; 16], 264, None).unwrap();
        assert_eq!((p.chunk, p.len()), (2048, 256));
        // 32K batch 1: 124 → 256 (the floor above 8K positions).
        assert_eq!(ItemPlan::new(&[32_768], 264, None).unwrap().chunk, 256);
        // Ragged: every position of every sequence in exactly one item, in order.
        let lens = [1usize, 0, 700, 2085, 16];
        let p = ItemPlan::new(&lens, 8, Some(128)).unwrap();
        assert_eq!(p.seq_first.len(), lens.len() + 1);
        for (b, &len) in lens.iter().enumerate() {
            let (lo, hi) = (p.seq_first[b] as usize, p.seq_first[b + 1] as usize);
            assert_eq!(hi - lo, len.div_ceil(128), "sequence {b}");
            for (k, it) in (lo..hi).enumerate() {
                assert_eq!(p.item(it), (b, k * 128, ((k + 1) * 128).min(len)));
            }
        }
        assert!(ItemPlan::new(&[100], 8, Some(24)).is_err());
        assert!(ItemPlan::new(&[100], 8, Some(0)).is_err());
        assert!(ItemPlan::new(&[0, 0], 8, None).unwrap().is_empty());
        assert_eq!(PageLayout::TokenMajor.strides(8), (8, 1));
        assert_eq!(PageLayout::HeadMajor.strides(8), (1, 16));
        // Two slots of 2 heads × 16 positions, one byte a row: row (slot, head, pos) moves to
        // (slot, pos, head).
        let plane: Vec<u8> = (0..64).collect();
        let tm = to_token_major(&plane, 1, 2);
        assert_eq!(tm[2 * 3 + 1], plane[16 + 3]); // slot 0, pos 3, head 1
        assert_eq!(tm[32 + 2 * 5], plane[32 + 5]); // slot 1, pos 5, head 0
        let mut sorted = tm.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, plane);
    }
}
