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
    /// RMSNorm whose Hugging Face weights store `w − 1` (Gemma: `x / rms(x) · (1 + w)`); GGUF
    /// conversions store `w`, so only the safetensors loader adds the one.
    RmsPlusOne,
}

/// How positions rotate queries and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rope {
    /// Half-split rotation (Hugging Face's layout: pair `i` with `i + d/2`), every dimension.
    HalfSplit,
}

/// A RoPE frequency scaling a checkpoint may ask for. The forward runs every kind as
/// per-frequency divisors of the plain inverse frequencies
/// ([`crate::ModelConfig::rope_freq_factors`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeScaling {
    /// Plain RoPE: `θ^(-2i/d)`.
    None,
    /// Positions divided by a factor (`rope_scaling.type = linear`).
    Linear,
    /// Llama 3.1's: long wavelengths divided by a factor, short ones kept, a smooth ramp
    /// between (`rope_type = llama3`; GGUF carries the divisors as `rope_freqs.weight`).
    Llama3,
}

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    Silu,
    /// GeGLU with the tanh approximation of GELU: `gelu_tanh(gate) · up`.
    GeluTanh,
}

/// Whether the output projection may be the embedding's matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tied {
    /// Tied when the checkpoint has no output matrix (GGUF) or says so (`tie_word_embeddings`).
    WhenAbsent,
    /// As `WhenAbsent`, and a `config.json` that does not say is tied (Gemma's default).
    ByDefault,
}

/// Layers that attend to a sliding window of recent positions: every layer but each
/// `period`-th (layer `i` is global when `(i + 1) % period == 0`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sliding {
    /// Global layers come every `period` layers.
    pub period: usize,
    /// Positions a window layer sees (itself included) when the checkpoint does not say
    /// (`<arch>.attention.sliding_window`, `sliding_window`).
    pub default_window: usize,
    /// RoPE base of the window layers (the global layers take the checkpoint's).
    pub local_theta: f64,
}

/// One model family (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arch {
    /// GGUF's `general.architecture`, and the prefix of the family's metadata keys
    /// (`llama.block_count`).
    pub gguf: &'static str,
    /// Hugging Face `config.json` `model_type` values of the family.
    pub hf_model_types: &'static [&'static str],
    /// Whether the q, k and v projections carry a bias.
    pub qkv_bias: bool,
    /// Whether each query and key head is RMS-normalized (its own weight over `head_dim`)
    /// before RoPE.
    pub qk_norm: bool,
    /// Whether the attention's and the MLP's outputs are normalized again before their
    /// residual adds ("sandwich" norms).
    pub post_norms: bool,
    /// Whether the embeddings are multiplied by `√hidden`.
    pub embed_scale: bool,
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
    /// Sliding-window layers (`None`: every layer attends to the whole context).
    pub sliding: Option<Sliding>,
    /// llama.cpp's converter permutes this family's q/k rows for its interleaved RoPE: the
    /// loader un-permutes them.
    pub gguf_qk_interleaved: bool,
    /// The family's turn format as a chat template (Jinja), for checkpoints that ship none
    /// (Gemma's base models); `None`: such a checkpoint is framed with ChatML.
    pub fallback_template: Option<&'static str>,
}

/// Gemma's turns: `<start_of_turn>user|model\n…<end_of_turn>\n` after `<bos>`. Gemma has no
/// system role; a system message is a user turn of its own.
const GEMMA_TURNS: &str = "{{ bos_token }}{% for m in messages %}\
{% if m.role == 'assistant' %}<start_of_turn>model\n{% else %}<start_of_turn>user\n{% endif %}\
{{ m.content }}<end_of_turn>\n{% endfor %}\
{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";

/// Llama and the checkpoints that share its layout (SmolLM2, TinyLlama, Llama 2, Llama 3.x
/// with its scaled RoPE, Mistral without sliding windows).
pub const LLAMA: Arch = Arch {
    gguf: "llama",
    hf_model_types: &["llama"],
    qkv_bias: false,
    qk_norm: false,
    post_norms: false,
    embed_scale: false,
    norm: Norm::Rms,
    rope: Rope::HalfSplit,
    rope_scalings: &[RopeScaling::None, RopeScaling::Linear, RopeScaling::Llama3],
    activation: Activation::Silu,
    tied: Tied::WhenAbsent,
    sliding: None,
    gguf_qk_interleaved: true,
    fallback_template: None,
};

/// Qwen2 and Qwen2.5: Llama's layout with q/k/v biases, and llama.cpp rotates them in the
/// half-split ("NeoX") order, so nothing is un-permuted.
pub const QWEN2: Arch = Arch {
    gguf: "qwen2",
    hf_model_types: &["qwen2"],
    qkv_bias: true,
    rope_scalings: &[RopeScaling::None],
    gguf_qk_interleaved: false,
    ..LLAMA
};

/// Gemma 3 (text): per-head q/k norms, sandwich norms, GeGLU, embeddings × √hidden, five
/// sliding-window layers (RoPE base 10k) to one global layer, tied embeddings; `head_dim` is
/// not `hidden / heads`.
pub const GEMMA3: Arch = Arch {
    gguf: "gemma3",
    hf_model_types: &["gemma3_text"],
    qkv_bias: false,
    qk_norm: true,
    post_norms: true,
    embed_scale: true,
    norm: Norm::RmsPlusOne,
    rope: Rope::HalfSplit,
    rope_scalings: &[RopeScaling::None],
    activation: Activation::GeluTanh,
    tied: Tied::ByDefault,
    sliding: Some(Sliding {
        period: 6,
        default_window: 512,
        local_theta: 10_000.0,
    }),
    gguf_qk_interleaved: false,
    fallback_template: Some(GEMMA_TURNS),
};

/// Every family this build runs.
pub const ARCHES: &[&Arch] = &[&LLAMA, &QWEN2, &GEMMA3];

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

    /// Whether this family's forward runs RoPE scaled as `scaling`.
    pub fn runs(&self, scaling: RopeScaling) -> bool {
        self.rope_scalings.contains(&scaling)
    }

    /// Whether layer `layer` attends to a sliding window (see [`Sliding`]).
    pub fn is_window_layer(&self, layer: usize) -> bool {
        self.sliding
            .is_some_and(|s| s.period > 0 && !(layer + 1).is_multiple_of(s.period))
    }

    /// Whether the forward is Llama's own (no bias, extra norm, GeLU, scale or window): what
    /// the CUDA forward runs.
    pub fn is_plain(&self) -> bool {
        !self.qkv_bias
            && !self.qk_norm
            && !self.post_norms
            && !self.embed_scale
            && self.activation == Activation::Silu
            && self.sliding.is_none()
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
        assert_eq!(Arch::by_gguf("qwen2").unwrap(), &QWEN2);
        assert_eq!(Arch::by_gguf("gemma3").unwrap(), &GEMMA3);
        assert_eq!(Arch::by_hf(Some("llama")).unwrap(), &LLAMA);
        assert_eq!(Arch::by_hf(Some("gemma3_text")).unwrap(), &GEMMA3);
        assert_eq!(Arch::by_hf(None).unwrap(), &LLAMA);
        for other in ["qwen3", "phi3", "gemma2", ""] {
            assert!(matches!(
                Arch::by_gguf(other),
                Err(ModelError::UnsupportedArchitecture { arch }) if arch == other
            ));
        }
        assert_eq!(LLAMA.key("block_count"), "llama.block_count");
        assert!(LLAMA.is_plain() && !QWEN2.is_plain() && !GEMMA3.is_plain());
        assert!(LLAMA.runs(RopeScaling::Llama3) && !QWEN2.runs(RopeScaling::Llama3));
        // Gemma 3: layers 5, 11, 17 of 18 are global.
        let global: Vec<usize> = (0..18).filter(|&l| !GEMMA3.is_window_layer(l)).collect();
        assert_eq!(global, [5, 11, 17]);
        assert!((0..30).all(|l| !LLAMA.is_window_layer(l)));
    }
}
