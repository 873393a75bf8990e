//! What differs between model families, as data: one [`Arch`] row per family, found by the name
//! a checkpoint gives (GGUF's `general.architecture`, Hugging Face's `model_type`). The loaders
//! read metadata keys, tensor layout and tied embeddings through the row, and refuse a row the
//! forward does not implement ([`Arch::check`]) with a typed error rather than run it wrongly.
//! A new family is a row in [`ARCHES`] (and, where it needs a new kind of norm, activation or
//! RoPE, a variant here and its arm in the forward): a change inside this crate.

use crate::error::{ModelError, ModelResult};

/// The normalization before attention and before the MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// RMSNorm, `x / rms(x) · w`.
    Rms,
}

/// How positions rotate queries and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rope {
    /// Half-split rotation (Hugging Face's layout: pair `i` with `i + d/2`), every dimension.
    HalfSplit,
}

/// A RoPE frequency scaling a checkpoint may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeScaling {
    /// Plain RoPE: `θ^(-2i/d)`.
    None,
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    Silu,
}

/// Whether the output projection may be the embedding's matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tied {
    /// Tied when the checkpoint has no output matrix (GGUF) or says so (`tie_word_embeddings`).
    WhenAbsent,
}

/// One model family (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arch {
    /// GGUF's `general.architecture`, and the prefix of the family's metadata keys
    /// (`llama.block_count`).
    pub gguf: &'static str,
    /// Hugging Face `config.json` `model_type` values of the family.
    pub hf_model_types: &'static [&'static str],
    /// Whether the q, k and v projections carry a bias.
    pub qkv_bias: bool,
    /// The norms.
    pub norm: Norm,
    /// The rotation.
    pub rope: Rope,
    /// The RoPE scalings this family's checkpoints may carry that the forward runs.
    pub rope_scalings: &'static [RopeScaling],
    /// The MLP's activation.
    pub activation: Activation,
    /// Tied embeddings.
    pub tied: Tied,
    /// Tokens a sliding-window layer sees (`None`: every layer attends to the whole context).
    pub sliding_window: Option<usize>,
    /// llama.cpp's converter permutes this family's q/k rows for its interleaved RoPE: the
    /// loader un-permutes them.
    pub gguf_qk_interleaved: bool,
}

/// Llama and the checkpoints that share its layout (SmolLM2, TinyLlama, Llama 2, Mistral
/// without sliding windows).
pub const LLAMA: Arch = Arch {
    gguf: "llama",
    hf_model_types: &["llama"],
    qkv_bias: false,
    norm: Norm::Rms,
    rope: Rope::HalfSplit,
    rope_scalings: &[RopeScaling::None],
    activation: Activation::Silu,
    tied: Tied::WhenAbsent,
    sliding_window: None,
    gguf_qk_interleaved: true,
};

/// Every family this build runs.
pub const ARCHES: &[&Arch] = &[&LLAMA];

impl Arch {
    /// The family GGUF's `general.architecture` names.
    pub fn by_gguf(name: &str) -> ModelResult<&'static Arch> {
        ARCHES
            .iter()
            .copied()
            .find(|a| a.gguf == name)
            .ok_or_else(|| unsupported(name))
    }

    /// The family a `config.json` `model_type` names (absent: Llama, as older exports omit it).
    pub fn by_hf(model_type: Option<&str>) -> ModelResult<&'static Arch> {
        let Some(t) = model_type else {
            return Ok(&LLAMA);
        };
        ARCHES
            .iter()
            .copied()
            .find(|a| a.hf_model_types.contains(&t))
            .ok_or_else(|| unsupported(t))
    }

    /// A metadata key of the family's GGUF (`block_count` → `llama.block_count`).
    pub fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.gguf)
    }

    /// Refuses what the forward does not implement: q/k/v biases and sliding windows.
    pub fn check(&self) -> ModelResult<()> {
        if self.qkv_bias || self.sliding_window.is_some() {
            return Err(unsupported(self.gguf));
        }
        Ok(())
    }
}

fn unsupported(arch: &str) -> ModelError {
    ModelError::UnsupportedArchitecture {
        arch: arch.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_found_by_either_name_and_others_refused() {
        assert_eq!(Arch::by_gguf("llama").unwrap(), &LLAMA);
        assert_eq!(Arch::by_hf(Some("llama")).unwrap(), &LLAMA);
        assert_eq!(Arch::by_hf(None).unwrap(), &LLAMA);
        for other in ["qwen2", "gemma3", ""] {
            assert!(matches!(
                Arch::by_gguf(other),
                Err(ModelError::UnsupportedArchitecture { arch }) if arch == other
            ));
        }
        assert_eq!(LLAMA.key("block_count"), "llama.block_count");
        for a in ARCHES {
            a.check().unwrap();
        }
        let biased = Arch {
            qkv_bias: true,
            ..LLAMA
        };
        assert!(biased.check().is_err());
    }
}
