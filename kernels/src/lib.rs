//! # engram-kernels
//!
//! CUDA kernels for the TurboQuant-4 KV cache, compiled by NVRTC at run time:
//! - `tq4_encode`: rotate (random signs + Walsh–Hadamard), scale to the unit sphere, quantize
//!   against the Lloyd–Max thresholds, pack two codes per byte, store the f16 norm — the same
//!   bytes as [`engram_kvcore::Codec::encode`], written straight into a layer's code plane;
//! - `tq4_decode_attention` + `tq4_combine`: fused paged decode attention over the packed codes
//!   (rotated query, online softmax, GQA groups, per-sequence block tables, batched across
//!   sequences, split-K over long contexts), the GPU form of [`engram_kvcore::BlockStore::attend`].
//!
//! Without the `cuda` feature the crate holds the kernel source and the launch plan only, so
//! CI builds it with no CUDA anywhere; [`gpu`] (feature `cuda`) launches the kernels, and the
//! `engram-gpu-check` binary compares every kernel with its CPU reference on random inputs.

#![cfg_attr(not(feature = "cuda"), forbid(unsafe_code))]

#[cfg(feature = "cuda")]
pub mod gpu;
pub mod reference;

/// The CUDA C source of the TurboQuant-4 kernels.
pub const TQ4_SOURCE: &str = include_str!("tq4.cu");

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
    }
}
