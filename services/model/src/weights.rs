//! Reading Llama-family weights: GGUF (dequantized to f32) or a Hugging Face safetensors
//! directory, into one layout (Hugging Face names and q/k row order).
//!
//! llama.cpp's converter permutes the rows of `attn_q`/`attn_k` so that RoPE rotates adjacent
//! pairs; the engine uses the half-split rotation of the Hugging Face layout, so GGUF q/k rows are
//! un-permuted here: per head, row `2i + j` of the GGUF block becomes row `j·d/2 + i`.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use engram_qmatmul::{Activations, GgufBlock, QMatrix};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::arch::{Arch, Norm};
use crate::error::{ModelError, ModelResult, io_error, metadata};
use crate::gguf::{md_f64, md_string, md_usize};
use crate::held::{Embedding, Linear};
#[cfg(test)]
use crate::rope_scaling::llama3_factors;
use crate::rope_scaling::{gguf_rope_scaling, hf_rope_scaling};

/// A Llama model's hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Context length the model was trained for.
    pub context_length: usize,
    /// Per RoPE frequency (`head_dim / 2` values), the divisor of its plain inverse frequency:
    /// how linear and Llama 3-style scalings reach the forward (`None`: plain RoPE).
    #[serde(default)]
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Positions a sliding-window layer sees, itself included (`None`: none has a window; which
    /// layers do is the family's [`Arch::sliding`]).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// RoPE base of the sliding-window layers.
    #[serde(default)]
    pub rope_local_theta: Option<f64>,
}

/// One layer's weights.
#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub attn_norm: Tensor,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    pub ffn_norm: Tensor,
    pub w_gate: Linear,
    pub w_up: Linear,
    pub w_down: Linear,
    /// What a family adds to Llama's layer ([`Arch`]); all `None` for Llama.
    pub extra: LayerExtra,
}

/// The weights and settings of a layer beyond Llama's.
#[derive(Debug, Clone, Default)]
pub(crate) struct LayerExtra {
    /// q, k, v biases (`[heads·d]`, `[kv_heads·d]`, `[kv_heads·d]`).
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    /// Per-head RMSNorm weights of q and k (`[d]` each).
    pub qk_norm: Option<[Vec<f32>; 2]>,
    /// Norms of the attention's and the MLP's outputs before their residuals (`[hidden]`).
    pub post_norms: Option<[Vec<f32>; 2]>,
    /// Positions this layer's queries see, themselves included (`None`: all before them).
    pub window: Option<usize>,
}

/// How GGUF weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightFormat {
    /// Dequantized to f32 at load (a device takes this form; also the reference the block
    /// kernels are tested against).
    F32,
    /// Kept in the file's blocks (`Q4_0`, `Q4_1`, `Q4_K` as 4-bit codes, `Q8_0`, `Q6_K` as
    /// bytes) and multiplied by `engram-qmatmul`'s W4A32/W8A32 kernels: the same weights as
    /// `F32`, expanded in registers, activations in f32. Other block types, the embedding
    /// lookup and the norms are f32.
    Quantized,
    /// As `Quantized`, with the projections multiplied by int16 activations (W4A16 and, for
    /// byte blocks `Q8_0`, `Q6_K`, `Q5_0` of whole 256-column widths, W8A16; quantized per 32
    /// columns to 1/65,534 of the group's largest magnitude, integer dot products; other byte
    /// matrices stay W8A32). Faster prefill and decode at the f32 activations' answers
    /// (`engram eval kv --also-weights` measures it). The default.
    #[default]
    Int16,
    /// As `Int16` with int8 activations (W4A8, llama.cpp's numerics for these blocks): the
    /// fastest prefill, and it moves answers (`engram eval kv` shows by how much).
    Int8,
}

impl WeightFormat {
    /// The numerics id hashed into the KV fingerprint (the weights' summation order moves K/V).
    pub fn numerics(self) -> &'static str {
        match self {
            Self::F32 => "weights=f32-gemm/v1",
            Self::Quantized => "weights=gguf-blocks-w4a32-w8a32/v1",
            Self::Int16 => "weights=gguf-blocks-w4a16-w8a16/v1",
            Self::Int8 => "weights=gguf-blocks-w4a8-w8a32/v1",
        }
    }

    /// `f32`, `quantized`, `int16` or `int8`.
    pub fn parse(name: &str) -> Option<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "f32" => Some(Self::F32),
            "quantized" => Some(Self::Quantized),
            "int16" => Some(Self::Int16),
            "int8" => Some(Self::Int8),
            _ => None,
        }
    }

    /// What the block products multiply their activations as.
    pub fn activations(self) -> Activations {
        match self {
            Self::F32 | Self::Quantized => Activations::F32,
            Self::Int16 => Activations::Int16,
            Self::Int8 => Activations::Int8,
        }
    }
}

impl ModelConfig {
    /// SmolLM2-135M's shape (30 layers, 9 query and 3 KV heads of 64, hidden 576).
    pub fn smollm2_135m() -> Self {
        Self {
            vocab_size: 49_152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_layers: 30,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            rope_theta: 100_000.0,
            rms_eps: 1e-5,
            context_length: 8192,
            rope_freq_factors: None,
            sliding_window: None,
            rope_local_theta: None,
        }
    }

    /// Llama-3.1-8B's shape (32 layers, 32 query and 8 KV heads of 128, hidden 4096), with the
    /// context capped at 32K (the RoPE tables are precomputed for it).
    pub fn llama3_8b() -> Self {
        Self {
            vocab_size: 128_256,
            hidden_size: 4096,
            intermediate_size: 14_336,
            num_layers: 32,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            rope_theta: 500_000.0,
            rms_eps: 1e-5,
            context_length: 32_768,
            rope_freq_factors: None,
            sliding_window: None,
            rope_local_theta: None,
        }
    }

    /// A known shape by name: `smollm2-135m` or `llama3-8b` (random-weight speed runs and the
    /// device checks).
    pub fn named(name: &str) -> ModelResult<Self> {
        match name.trim() {
            "smollm2-135m" => Ok(Self::smollm2_135m()),
            "llama3-8b" => Ok(Self::llama3_8b()),
            other => Err(ModelError::InvalidConfig {
                field: "shape",
                reason: format!("unknown shape `{other}` (smollm2-135m, llama3-8b)"),
            }),
        }
    }
}

/// Weights as loaded, before the model builds its RoPE tables.
pub(crate) struct Weights {
    pub arch: &'static Arch,
    pub config: ModelConfig,
    pub embed: Embedding,
    pub layers: Vec<Layer>,
    pub norm: Tensor,
    pub lm_head: Linear,
    pub fingerprint: [u8; 32],
}

/// `n` draws from a normal of standard deviation `sigma`, two per 64 random bits (Box–Muller
/// in f32 on two 32-bit uniforms: both branches, so an 8B-shape model's 8·10⁹ values take
/// seconds, not minutes).
fn normal_f32(rng: &mut engram_kvcore::SplitMix64, n: usize, sigma: f32) -> Vec<f32> {
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let bits = rng.next_u64();
        // Uniforms in (0, 1]: the logarithm stays finite.
        let u1 = ((bits >> 40) as f32 + 1.0) / (1u64 << 24) as f32;
        let u2 = ((bits >> 8) & 0xff_ffff) as f32 / (1u64 << 24) as f32;
        let r = sigma * (-2.0 * u1.ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * u2).sin_cos();
        v.push(r * c);
        v.push(r * s);
    }
    v.truncate(n);
    v
}

impl Weights {
    /// Random weights of `config`'s shape on `device`: normal with σ 0.02, norms 1, the same
    /// values for the same `seed` in every run (on the CPU from one SplitMix64 stream, layer by
    /// layer, then the embedding and the LM head; on a CUDA device from its seeded generator).
    /// candle's CPU `randn` cannot be seeded, so it is not used there.
    pub fn random(config: ModelConfig, device: &Device, seed: u64) -> ModelResult<Self> {
        if !device.is_cpu() {
            device.set_seed(seed)?;
        }
        let c = &config;
        let (h, kv, ff) = (
            c.hidden_size,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        );
        let q = c.num_heads * c.head_dim;
        let mut rng = engram_kvcore::SplitMix64::new(seed);
        let mut randn = |rows: usize, cols: usize| {
            if device.is_cpu() {
                Tensor::from_vec(
                    normal_f32(&mut rng, rows * cols, 0.02),
                    (rows, cols),
                    device,
                )
            } else {
                Tensor::randn(0f32, 0.02, (rows, cols), device)
            }
        };
        let ones = || Tensor::ones(h, DType::F32, device);
        let layers = (0..c.num_layers)
            .map(|_| {
                Ok(Layer {
                    attn_norm: ones()?,
                    wq: Linear::Dense(randn(q, h)?),
                    wk: Linear::Dense(randn(kv, h)?),
                    wv: Linear::Dense(randn(kv, h)?),
                    wo: Linear::Dense(randn(h, q)?),
                    ffn_norm: ones()?,
                    w_gate: Linear::Dense(randn(ff, h)?),
                    w_up: Linear::Dense(randn(ff, h)?),
                    w_down: Linear::Dense(randn(h, ff)?),
                    extra: LayerExtra::default(),
                })
            })
            .collect::<ModelResult<Vec<_>>>()?;
        let mut hash = Sha256::new();
        hash.update(serde_json::to_vec(&config).unwrap_or_default());
        hash.update(seed.to_le_bytes());
        // The CPU's stream and a device's generator give different values for one seed.
        hash.update(if device.is_cpu() {
            b"splitmix64-box-muller-f32".as_slice()
        } else {
            b"device-randn".as_slice()
        });
        Ok(Self {
            arch: &crate::arch::LLAMA,
            embed: Embedding::Dense(randn(c.vocab_size, h)?),
            lm_head: Linear::Dense(randn(c.vocab_size, h)?),
            norm: ones()?,
            layers,
            fingerprint: hash.finalize().into(),
            config,
        })
    }

    /// Reads a GGUF file; any error but the file's own I/O names the file
    /// ([`ModelError::InFile`]).
    pub fn from_gguf(path: &Path, format: WeightFormat) -> ModelResult<Self> {
        Self::read_gguf(path, format).map_err(|e| in_file(path, e))
    }

    fn read_gguf(path: &Path, format: WeightFormat) -> ModelResult<Self> {
        let fingerprint = hash_files(&[path.to_path_buf()])?;
        let mut f = BufReader::new(File::open(path).map_err(io_error(path))?);
        let ct = Content::read(&mut f)?;
        let arch = Arch::by_gguf(&md_string(&ct, "general.architecture")?)?;
        let key = |suffix: &str| arch.key(suffix);
        let heads = md_usize(&ct, &key("attention.head_count"))?;
        let hidden = md_usize(&ct, &key("embedding_length"))?;
        let head_dim = md_usize(&ct, &key("attention.key_length"))
            .or_else(|_| md_usize(&ct, &key("rope.dimension_count")))
            .unwrap_or(hidden / heads.max(1));
        let rope_freq_factors = gguf_rope_scaling(&ct, arch, head_dim, &mut f)?;
        let num_layers = md_usize(&ct, &key("block_count"))?;
        let kv_heads = md_usize(&ct, &key("attention.head_count_kv")).unwrap_or(heads);
        let ff = md_usize(&ct, &key("feed_forward_length"))?;
        let (q_rows, kv_rows) = (heads * head_dim, kv_heads * head_dim);
        let dev = Device::Cpu;
        // A tensor read with its shape checked (`None`: any length on that axis).
        let mut raw = |name: &str, want: &[Option<usize>]| -> ModelResult<QTensor> {
            let Some(info) = ct.tensor_infos.get(name) else {
                return Err(ModelError::MissingTensor {
                    name: name.to_string(),
                });
            };
            check_shape(name, info.shape.dims(), want)?;
            Ok(ct.tensor(&mut f, name, &dev)?)
        };
        // The embedding stays in its blocks where the kernels read them (one matrix with the
        // output projection when tied).
        let embed_weights = linear(
            "token_embd.weight",
            raw("token_embd.weight", &[None, Some(hidden)])?,
            format,
            None,
        )?;
        let embed = match &embed_weights {
            Linear::Blocks(q) => Embedding::Blocks(q.clone()),
            Linear::Dense(t) => Embedding::Dense(t.clone()),
            Linear::Part { .. } => return Err(metadata("token_embd.weight")),
        };
        let vocab = embed.rows()?;
        let norm = raw("output_norm.weight", &[Some(hidden)])?.dequantize(&dev)?;
        let lm_head = match raw("output.weight", &[Some(vocab), Some(hidden)]) {
            Ok(t) => linear("output.weight", t, format, None)?,
            Err(ModelError::MissingTensor { .. }) => embed_weights,
            Err(e) => return Err(e),
        };
        let permuted = |heads: usize| arch.gguf_qk_interleaved.then_some((heads, head_dim));
        let window = arch
            .sliding
            .map(|s| md_usize(&ct, &key("attention.sliding_window")).unwrap_or(s.default_window));
        let mut layers = Vec::with_capacity(num_layers);
        for i in 0..num_layers {
            let name = |suffix: &str| format!("blk.{i}.{suffix}");
            let w = |suffix: &str| format!("blk.{i}.{suffix}.weight");
            let vector =
                |q: QTensor| -> ModelResult<Vec<f32>> { Ok(q.dequantize(&dev)?.to_vec1::<f32>()?) };
            let (h, q, kv, ffs) = (Some(hidden), Some(q_rows), Some(kv_rows), Some(ff));
            let attn_norm = raw(&w("attn_norm"), &[h])?.dequantize(&dev)?;
            let wq = linear(
                &name("attn_q"),
                raw(&w("attn_q"), &[q, h])?,
                format,
                permuted(heads),
            )?;
            let wk = linear(
                &name("attn_k"),
                raw(&w("attn_k"), &[kv, h])?,
                format,
                permuted(kv_heads),
            )?;
            let wv = linear(&name("attn_v"), raw(&w("attn_v"), &[kv, h])?, format, None)?;
            let wo = linear(
                &name("attn_output"),
                raw(&w("attn_output"), &[h, q])?,
                format,
                None,
            )?;
            let ffn_norm = raw(&w("ffn_norm"), &[h])?.dequantize(&dev)?;
            let w_gate = linear(
                &name("ffn_gate"),
                raw(&w("ffn_gate"), &[ffs, h])?,
                format,
                None,
            )?;
            let w_up = linear(&name("ffn_up"), raw(&w("ffn_up"), &[ffs, h])?, format, None)?;
            let w_down = linear(
                &name("ffn_down"),
                raw(&w("ffn_down"), &[h, ffs])?,
                format,
                None,
            )?;
            let mut extra = LayerExtra {
                window: window.filter(|_| arch.is_window_layer(i)),
                ..LayerExtra::default()
            };
            if arch.qkv_bias {
                let b = |p: &str| format!("blk.{i}.{p}.bias");
                extra.qkv_bias = Some([
                    vector(raw(&b("attn_q"), &[q])?)?,
                    vector(raw(&b("attn_k"), &[kv])?)?,
                    vector(raw(&b("attn_v"), &[kv])?)?,
                ]);
            }
            if arch.qk_norm {
                let d = Some(head_dim);
                extra.qk_norm = Some([
                    vector(raw(&w("attn_q_norm"), &[d])?)?,
                    vector(raw(&w("attn_k_norm"), &[d])?)?,
                ]);
            }
            if arch.post_norms {
                extra.post_norms = Some([
                    vector(raw(&w("post_attention_norm"), &[h])?)?,
                    vector(raw(&w("post_ffw_norm"), &[h])?)?,
                ]);
            }
            layers.push(Layer {
                attn_norm,
                wq,
                wk,
                wv,
                wo,
                ffn_norm,
                w_gate,
                w_up,
                w_down,
                extra,
            });
        }
        let config = ModelConfig {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: ff,
            num_layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            rope_theta: md_f64(&ct, &key("rope.freq_base")).unwrap_or(10_000.0),
            rms_eps: md_f64(&ct, &key("attention.layer_norm_rms_epsilon"))?,
            context_length: md_usize(&ct, &key("context_length"))?,
            rope_freq_factors,
            sliding_window: window,
            rope_local_theta: arch.sliding.map(|s| s.local_theta),
        };
        validate(&config)?;
        Ok(Self {
            arch,
            config,
            embed,
            layers,
            norm,
            lm_head,
            fingerprint,
        })
    }

    /// Reads a Hugging Face directory; errors but I/O name the directory.
    pub fn from_safetensors_dir(dir: &Path) -> ModelResult<Self> {
        Self::read_safetensors_dir(dir).map_err(|e| in_file(dir, e))
    }

    fn read_safetensors_dir(dir: &Path) -> ModelResult<Self> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(io_error(&config_path))?;
        let hf: HfConfig = serde_json::from_str(&text).map_err(|_| metadata("config.json"))?;
        let arch = Arch::by_hf(hf.model_type.as_deref())?;
        let heads = hf.num_attention_heads;
        let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / heads.max(1));
        let rope_freq_factors =
            hf_rope_scaling(hf.rope_scaling.as_ref(), arch, head_dim, hf.rope_theta)?;
        let kv_heads = hf.num_key_value_heads.unwrap_or(heads);
        let files = safetensors_files(dir)?;
        let mut all = HashMap::new();
        for f in &files {
            all.extend(candle_core::safetensors::load(f, &Device::Cpu)?);
        }
        let (hidden, ff) = (hf.hidden_size, hf.intermediate_size);
        let (q_rows, kv_rows) = (heads * head_dim, kv_heads * head_dim);
        // A tensor with its shape checked, as f32 (norm weights with Gemma's one added).
        let mut take = |name: &str, want: &[Option<usize>]| -> ModelResult<Tensor> {
            let t = all.remove(name).ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
            check_shape(name, t.dims(), want)?;
            Ok(t.to_dtype(DType::F32)?)
        };
        let plus_one = |t: Tensor| -> ModelResult<Tensor> {
            Ok(match arch.norm {
                Norm::Rms => t,
                Norm::RmsPlusOne => (t + 1.0)?,
            })
        };
        let vector = |t: Tensor| -> ModelResult<Vec<f32>> { Ok(t.to_vec1::<f32>()?) };
        let (h, q, kv, ffs) = (Some(hidden), Some(q_rows), Some(kv_rows), Some(ff));
        let embed = take("model.embed_tokens.weight", &[None, h])?;
        let vocab = embed.dim(0)?;
        let norm = plus_one(take("model.norm.weight", &[h])?)?;
        let tied = hf
            .tie_word_embeddings
            .unwrap_or(arch.tied == crate::arch::Tied::ByDefault);
        let lm_head = Linear::Dense(if tied {
            embed.clone()
        } else {
            take("lm_head.weight", &[Some(vocab), h])?
        });
        let window = arch
            .sliding
            .map(|s| hf.sliding_window.unwrap_or(s.default_window));
        let mut layers = Vec::with_capacity(hf.num_hidden_layers);
        for i in 0..hf.num_hidden_layers {
            let w = |suffix: &str| format!("model.layers.{i}.{suffix}.weight");
            let b = |suffix: &str| format!("model.layers.{i}.{suffix}.bias");
            // Gemma names the MLP's pre-norm `pre_feedforward_layernorm` and uses
            // `post_attention_layernorm` for the attention's output; Llama's MLP pre-norm is
            // `post_attention_layernorm`.
            let (ffn_norm_name, post_attn_name) = if arch.post_norms {
                (
                    "pre_feedforward_layernorm",
                    Some("post_attention_layernorm"),
                )
            } else {
                ("post_attention_layernorm", None)
            };
            let mut extra = LayerExtra {
                window: window.filter(|_| arch.is_window_layer(i)),
                ..LayerExtra::default()
            };
            if arch.qkv_bias {
                extra.qkv_bias = Some([
                    vector(take(&b("self_attn.q_proj"), &[q])?)?,
                    vector(take(&b("self_attn.k_proj"), &[kv])?)?,
                    vector(take(&b("self_attn.v_proj"), &[kv])?)?,
                ]);
            }
            if arch.qk_norm {
                let d = Some(head_dim);
                extra.qk_norm = Some([
                    vector(plus_one(take(&w("self_attn.q_norm"), &[d])?)?)?,
                    vector(plus_one(take(&w("self_attn.k_norm"), &[d])?)?)?,
                ]);
            }
            if let Some(post_attn) = post_attn_name {
                extra.post_norms = Some([
                    vector(plus_one(take(&w(post_attn), &[h])?)?)?,
                    vector(plus_one(take(&w("post_feedforward_layernorm"), &[h])?)?)?,
                ]);
            }
            layers.push(Layer {
                attn_norm: plus_one(take(&w("input_layernorm"), &[h])?)?,
                wq: Linear::Dense(take(&w("self_attn.q_proj"), &[q, h])?),
                wk: Linear::Dense(take(&w("self_attn.k_proj"), &[kv, h])?),
                wv: Linear::Dense(take(&w("self_attn.v_proj"), &[kv, h])?),
                wo: Linear::Dense(take(&w("self_attn.o_proj"), &[h, q])?),
                ffn_norm: plus_one(take(&w(ffn_norm_name), &[h])?)?,
                w_gate: Linear::Dense(take(&w("mlp.gate_proj"), &[ffs, h])?),
                w_up: Linear::Dense(take(&w("mlp.up_proj"), &[ffs, h])?),
                w_down: Linear::Dense(take(&w("mlp.down_proj"), &[h, ffs])?),
                extra,
            });
        }
        let config = ModelConfig {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: ff,
            num_layers: hf.num_hidden_layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            rope_theta: hf.rope_theta,
            rms_eps: hf.rms_norm_eps,
            context_length: hf.max_position_embeddings,
            rope_freq_factors,
            sliding_window: window,
            rope_local_theta: arch
                .sliding
                .map(|s| hf.rope_local_base_freq.unwrap_or(s.local_theta)),
        };
        validate(&config)?;
        Ok(Self {
            arch,
            fingerprint: hash_files(&files)?,
            config,
            embed: Embedding::Dense(embed),
            layers,
            norm,
            lm_head,
        })
    }
}

/// The fields of a Hugging Face `config.json` the engine reads.
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_theta")]
    rope_theta: f64,
    rms_norm_eps: f64,
    max_position_embeddings: usize,
    /// Absent: the family's default (Gemma ties, Llama and Qwen2 export `false`).
    #[serde(default)]
    tie_word_embeddings: Option<bool>,
    /// Absent or `null` for plain RoPE.
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    /// Positions a window layer sees (families with [`Arch::sliding`]).
    #[serde(default)]
    sliding_window: Option<usize>,
    /// RoPE base of the window layers (Gemma 3).
    #[serde(default)]
    rope_local_base_freq: Option<f64>,
}

/// `TensorShape` unless `got` matches `want` (`None`: any length on that axis).
fn check_shape(name: &str, got: &[usize], want: &[Option<usize>]) -> ModelResult<()> {
    let fits =
        got.len() == want.len() && got.iter().zip(want).all(|(g, w)| w.is_none_or(|w| w == *g));
    if fits {
        return Ok(());
    }
    Err(ModelError::TensorShape {
        name: name.to_string(),
        expected: want
            .iter()
            .map(|w| w.map_or_else(|| "*".to_string(), |w| w.to_string()))
            .collect::<Vec<_>>()
            .join(" × "),
        got: got.to_vec(),
    })
}

/// `e` with the file it came from, unless it already names it.
fn in_file(path: &Path, e: ModelError) -> ModelError {
    match e {
        ModelError::Io { .. } | ModelError::InFile { .. } => e,
        other => ModelError::InFile {
            path: path.to_path_buf(),
            source: Box::new(other),
        },
    }
}

fn default_theta() -> f64 {
    10_000.0
}

fn validate(c: &ModelConfig) -> ModelResult<()> {
    let bad = |key: &str| Err(metadata(key));
    if c.num_heads == 0 || c.num_kv_heads == 0 || !c.num_heads.is_multiple_of(c.num_kv_heads) {
        return bad("num_kv_heads");
    }
    // `head_dim` need not be `hidden / heads` (Gemma 3): the projections' shapes are checked
    // against it as they load.
    if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) {
        return bad("head_dim");
    }
    if let Some(f) = &c.rope_freq_factors
        && (f.len() != c.head_dim / 2 || f.iter().any(|x| !x.is_finite() || *x <= 0.0))
    {
        return bad("rope_freq_factors");
    }
    if c.sliding_window == Some(0) {
        return bad("sliding_window");
    }
    if c.num_layers == 0 || c.context_length == 0 || c.vocab_size == 0 {
        return bad("num_layers");
    }
    Ok(())
}

/// `model.safetensors`, or every file named by `model.safetensors.index.json`, sorted.
fn safetensors_files(dir: &Path) -> ModelResult<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).map_err(io_error(&index))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|_| metadata("weight_map"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| metadata("weight_map"))?;
    let mut files: Vec<PathBuf> = map
        .values()
        .filter_map(|f| f.as_str())
        .map(|f| dir.join(f))
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// A projection in the requested format; `unpermute: Some((heads, head_dim))` for `attn_q` and
/// `attn_k` (see the module note).
fn linear(
    name: &str,
    q: QTensor,
    format: WeightFormat,
    unpermute: Option<(usize, usize)>,
) -> ModelResult<Linear> {
    let block = match q.dtype() {
        GgmlDType::Q4_0 => Some(GgufBlock::Q4_0),
        GgmlDType::Q4_1 => Some(GgufBlock::Q4_1),
        GgmlDType::Q8_0 => Some(GgufBlock::Q8_0),
        GgmlDType::Q5_0 => Some(GgufBlock::Q5_0),
        GgmlDType::Q4K => Some(GgufBlock::Q4K),
        GgmlDType::Q6K => Some(GgufBlock::Q6K),
        _ => None,
    };
    let (rows, cols) = q.shape().dims2()?;
    if let (WeightFormat::Quantized | WeightFormat::Int16 | WeightFormat::Int8, Some(block)) =
        (format, block)
    {
        let m = QMatrix::from_gguf(block, rows, cols, &q.data()?).map_err(|source| {
            ModelError::Blocks {
                name: name.to_string(),
                source,
            }
        })?;
        let m = match unpermute {
            Some((heads, d)) => m
                .permute_rows(&unpermuted_order(heads, d))
                .map_err(|source| ModelError::Blocks {
                    name: name.to_string(),
                    source,
                })?,
            None => m,
        };
        // Integer activations are set up by the model, on the matrices its forward reads.
        return Ok(Linear::Blocks(Arc::new(m)));
    }
    let w = q.dequantize(&Device::Cpu)?;
    Ok(Linear::Dense(match unpermute {
        Some((heads, d)) => unpermute_dense(&w, heads, d)?,
        None => w,
    }))
}

/// The source row of each un-permuted q/k row: per head, row `j·d/2 + i` comes from `2i + j`.
fn unpermuted_order(heads: usize, d: usize) -> Vec<usize> {
    (0..heads)
        .flat_map(|h| (0..2).flat_map(move |j| (0..d / 2).map(move |i| h * d + 2 * i + j)))
        .collect()
}

/// Inverts llama.cpp's q/k row permutation: `[heads, 2, d/2]` rows from `[heads, d/2, 2]`.
fn unpermute_dense(w: &Tensor, heads: usize, head_dim: usize) -> ModelResult<Tensor> {
    let (out, inp) = w.dims2()?;
    Ok(w.reshape((heads, head_dim / 2, 2, inp))?
        .transpose(1, 2)?
        .reshape((out, inp))?
        .contiguous()?)
}

/// SHA-256 over the files' bytes, in order.
fn hash_files(files: &[PathBuf]) -> ModelResult<[u8; 32]> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        let mut f = File::open(path).map_err(io_error(path))?;
        loop {
            let n = f.read(&mut buf).map_err(io_error(path))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(h.finalize().into())
}

#[cfg(test)]
#[path = "weights_tests.rs"]
mod tests;
