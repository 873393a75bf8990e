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

use crate::arch::Arch;
use crate::error::{ModelError, ModelResult, io_error, metadata};
use crate::gguf::{md_f64, md_string, md_usize};

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
    /// As `Quantized`, with the 4-bit projections multiplied by int16 activations (W4A16,
    /// quantized per 32 columns to 1/65,534 of the group's largest magnitude, integer dot
    /// products); byte blocks (`Q8_0`, `Q6_K`) stay W8A32. Faster prefill at the f32
    /// activations' answers (`engram eval kv --also-weights` measures it). The default.
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
            Self::Int16 => "weights=gguf-blocks-w4a16-w8a32/v1",
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

/// The dtype a CUDA device holds the projections in by default: half the bytes of f32 per
/// decode step (an 8B model reads 16 GB instead of 32), tensor-core products.
pub const DEVICE_WEIGHTS: DType = DType::BF16;

/// How a CUDA device holds and multiplies the projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceWeights {
    /// bf16 weights and matmul operands, f32 accumulation, products rounded to bf16 (cuBLAS
    /// through candle): the serving default.
    #[default]
    Bf16,
    /// f32 weights and products, the CPU engine's numerics (twice the bytes per step): the
    /// reference for checks.
    F32,
}

impl DeviceWeights {
    /// The dtype of the weights on the device.
    pub fn dtype(self) -> DType {
        match self {
            Self::Bf16 => DEVICE_WEIGHTS,
            Self::F32 => DType::F32,
        }
    }

    /// `bf16` or `f32`.
    pub fn parse(name: &str) -> Option<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "bf16" => Some(Self::Bf16),
            "f32" => Some(Self::F32),
            _ => None,
        }
    }
}

/// A projection: a dense `[out, in]` matrix or one kept in its GGUF blocks.
#[derive(Debug, Clone)]
pub(crate) enum Linear {
    Dense(Tensor),
    Blocks(Arc<QMatrix>),
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

impl Linear {
    /// The projection on `device`. A CUDA device holds it as `held` says (bf16 by default: GGUF
    /// blocks and f32 matrices alike are dequantized and rounded once, at load), multiplied by
    /// cuBLAS with f32 accumulation; the CPU keeps blocks as they are and dense matrices in f32.
    pub fn to_device(&self, device: &Device, held: DeviceWeights) -> ModelResult<Self> {
        let dense = match self {
            Self::Blocks(_) if device.is_cpu() => return Ok(self.clone()),
            Self::Blocks(q) => {
                Tensor::from_vec(q.dequantize(), (q.rows(), q.cols()), &Device::Cpu)?
            }
            Self::Dense(w) => w.clone(),
        };
        let dtype = if device.is_cpu() {
            DType::F32
        } else {
            held.dtype()
        };
        // Converted where it lands: a device rounds in parallel, the CPU keeps f32 as is.
        Ok(Self::Dense(dense.to_device(device)?.to_dtype(dtype)?))
    }

    /// The projection held as a device holds it, on the CPU: dense weights in
    /// [`DEVICE_WEIGHTS`], multiplied as a device multiplies them (activations rounded to bf16,
    /// f32 accumulation, products rounded to bf16): the CPU reference of `engram check device`
    /// computes what the device computes. Blocks unchanged.
    pub fn rounded_for_device(&self, held: DeviceWeights) -> ModelResult<Self> {
        match self {
            Self::Dense(w) => Ok(Self::Dense(w.to_dtype(held.dtype())?)),
            Self::Blocks(_) => Ok(self.clone()),
        }
    }

    /// Whether the matrix is held in [`DEVICE_WEIGHTS`].
    pub fn is_device_dtype(&self) -> bool {
        matches!(self, Self::Dense(w) if w.dtype() == DEVICE_WEIGHTS)
    }

    /// `x · wᵀ` for `x: [m, in]` row-major on the CPU, as a row-major `[m, out]` buffer.
    pub fn apply(&self, x: &[f32], m: usize, threads: usize) -> candle_core::Result<Vec<f32>> {
        match self {
            Self::Blocks(q) => block_product(q, x, m, threads),
            Self::Dense(w) => {
                let x = Tensor::from_slice(x, (m, w.dim(1)?), &Device::Cpu)?;
                self.forward(&x, threads)?.flatten_all()?.to_vec1()
            }
        }
    }

    /// `x · wᵀ` for `x: [rows, in]` (f32 in and out; bf16 weights multiply bf16-rounded
    /// activations), block kernels on up to `threads` threads.
    pub fn forward(&self, x: &Tensor, threads: usize) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) if w.dtype() == x.dtype() => x.matmul(&w.t()?),
            // bf16 operands, f32 accumulation (candle's cuBLAS default), the product rounded to
            // bf16, f32 out.
            Self::Dense(w) if !x.device().is_cpu() => {
                x.to_dtype(w.dtype())?.matmul(&w.t()?)?.to_dtype(x.dtype())
            }
            // The same numerics on the CPU, spelled out (an f32 product of the rounded operands,
            // rounded once): the CPU's bf16 kernels round partial sums of long rows.
            Self::Dense(w) => {
                let xr = x.to_dtype(w.dtype())?.to_dtype(DType::F32)?;
                xr.matmul(&w.to_dtype(DType::F32)?.t()?)?
                    .to_dtype(w.dtype())?
                    .to_dtype(DType::F32)
            }
            Self::Blocks(q) => {
                let m = x.dim(0)?;
                let y = block_product(q, &x.flatten_all()?.to_vec1()?, m, threads)?;
                Tensor::from_vec(y, (m, q.rows()), x.device())
            }
        }
    }
}

/// `x · wᵀ` for `x: [m, in]` through a block matrix, as a row-major `[m, out]` buffer.
pub(crate) fn block_product(
    w: &QMatrix,
    x: &[f32],
    m: usize,
    threads: usize,
) -> candle_core::Result<Vec<f32>> {
    let mut y = vec![0f32; m * w.rows()];
    w.matmul(x, m, &mut y, threads)
        .map_err(candle_core::Error::wrap)?;
    Ok(y)
}

/// Weights as loaded, before the model builds its RoPE tables.
pub(crate) struct Weights {
    pub config: ModelConfig,
    pub embed: Tensor,
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
            embed: randn(c.vocab_size, h)?,
            lm_head: Linear::Dense(randn(c.vocab_size, h)?),
            norm: ones()?,
            layers,
            fingerprint: hash.finalize().into(),
            config,
        })
    }

    pub fn from_gguf(path: &Path, format: WeightFormat) -> ModelResult<Self> {
        let fingerprint = hash_files(&[path.to_path_buf()])?;
        let mut f = BufReader::new(File::open(path).map_err(io_error(path))?);
        let ct = Content::read(&mut f)?;
        let arch = Arch::by_gguf(&md_string(&ct, "general.architecture")?)?;
        arch.check()?;
        let key = |suffix: &str| arch.key(suffix);
        gguf_rope_scaling(&ct, arch)?;
        let heads = md_usize(&ct, &key("attention.head_count"))?;
        let hidden = md_usize(&ct, &key("embedding_length"))?;
        let head_dim = match md_usize(&ct, &key("rope.dimension_count")) {
            Ok(d) => d,
            Err(_) => hidden / heads.max(1),
        };
        let dev = Device::Cpu;
        let mut raw = |name: &str| -> ModelResult<QTensor> {
            if !ct.tensor_infos.contains_key(name) {
                return Err(ModelError::MissingTensor {
                    name: name.to_string(),
                });
            }
            Ok(ct.tensor(&mut f, name, &dev)?)
        };
        let mut load = |name: &str| -> ModelResult<Tensor> { Ok(raw(name)?.dequantize(&dev)?) };
        let embed = load("token_embd.weight")?;
        let norm = load("output_norm.weight")?;
        let lm_head = match raw("output.weight") {
            Ok(t) => linear("output.weight", t, format, None)?,
            Err(ModelError::MissingTensor { .. }) => {
                linear("token_embd.weight", raw("token_embd.weight")?, format, None)?
            }
            Err(e) => return Err(e),
        };
        let num_layers = md_usize(&ct, &key("block_count"))?;
        let kv_heads = md_usize(&ct, &key("attention.head_count_kv")).unwrap_or(heads);
        let permuted = |heads: usize| arch.gguf_qk_interleaved.then_some((heads, head_dim));
        let mut layers = Vec::with_capacity(num_layers);
        for i in 0..num_layers {
            let mut t = |suffix: &str| raw(&format!("blk.{i}.{suffix}.weight"));
            let dense = |q: QTensor| -> ModelResult<Tensor> { Ok(q.dequantize(&dev)?) };
            layers.push(Layer {
                attn_norm: dense(t("attn_norm")?)?,
                wq: linear(
                    &format!("blk.{i}.attn_q"),
                    t("attn_q")?,
                    format,
                    permuted(heads),
                )?,
                wk: linear(
                    &format!("blk.{i}.attn_k"),
                    t("attn_k")?,
                    format,
                    permuted(kv_heads),
                )?,
                wv: linear(&format!("blk.{i}.attn_v"), t("attn_v")?, format, None)?,
                wo: linear(
                    &format!("blk.{i}.attn_output"),
                    t("attn_output")?,
                    format,
                    None,
                )?,
                ffn_norm: dense(t("ffn_norm")?)?,
                w_gate: linear(&format!("blk.{i}.ffn_gate"), t("ffn_gate")?, format, None)?,
                w_up: linear(&format!("blk.{i}.ffn_up"), t("ffn_up")?, format, None)?,
                w_down: linear(&format!("blk.{i}.ffn_down"), t("ffn_down")?, format, None)?,
            });
        }
        let config = ModelConfig {
            vocab_size: embed.dim(0)?,
            hidden_size: hidden,
            intermediate_size: md_usize(&ct, &key("feed_forward_length"))?,
            num_layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            rope_theta: md_f64(&ct, &key("rope.freq_base")).unwrap_or(10_000.0),
            rms_eps: md_f64(&ct, &key("attention.layer_norm_rms_epsilon"))?,
            context_length: md_usize(&ct, &key("context_length"))?,
        };
        validate(&config)?;
        Ok(Self {
            config,
            embed,
            layers,
            norm,
            lm_head,
            fingerprint,
        })
    }

    pub fn from_safetensors_dir(dir: &Path) -> ModelResult<Self> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(io_error(&config_path))?;
        let hf: HfConfig = serde_json::from_str(&text).map_err(|_| metadata("config.json"))?;
        Arch::by_hf(hf.model_type.as_deref())?.check()?;
        hf_rope_scaling(hf.rope_scaling.as_ref())?;
        let files = safetensors_files(dir)?;
        let mut all = HashMap::new();
        for f in &files {
            all.extend(candle_core::safetensors::load(f, &Device::Cpu)?);
        }
        let mut take = |name: &str| -> ModelResult<Tensor> {
            let t = all.remove(name).ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
            Ok(t.to_dtype(DType::F32)?)
        };
        let embed = take("model.embed_tokens.weight")?;
        let norm = take("model.norm.weight")?;
        let lm_head = Linear::Dense(if hf.tie_word_embeddings {
            embed.clone()
        } else {
            take("lm_head.weight")?
        });
        let mut layers = Vec::with_capacity(hf.num_hidden_layers);
        for i in 0..hf.num_hidden_layers {
            let mut t = |suffix: &str| take(&format!("model.layers.{i}.{suffix}.weight"));
            layers.push(Layer {
                attn_norm: t("input_layernorm")?,
                wq: Linear::Dense(t("self_attn.q_proj")?),
                wk: Linear::Dense(t("self_attn.k_proj")?),
                wv: Linear::Dense(t("self_attn.v_proj")?),
                wo: Linear::Dense(t("self_attn.o_proj")?),
                ffn_norm: t("post_attention_layernorm")?,
                w_gate: Linear::Dense(t("mlp.gate_proj")?),
                w_up: Linear::Dense(t("mlp.up_proj")?),
                w_down: Linear::Dense(t("mlp.down_proj")?),
            });
        }
        let heads = hf.num_attention_heads;
        let config = ModelConfig {
            vocab_size: embed.dim(0)?,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: heads,
            num_kv_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size / heads.max(1)),
            rope_theta: hf.rope_theta,
            rms_eps: hf.rms_norm_eps,
            context_length: hf.max_position_embeddings,
        };
        validate(&config)?;
        Ok(Self {
            fingerprint: hash_files(&files)?,
            config,
            embed,
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
    #[serde(default)]
    tie_word_embeddings: bool,
    /// Absent or `null` for plain RoPE.
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
}

/// Refuses a `config.json` `rope_scaling` other than none (`null`, absent, or a type of
/// `default`).
fn hf_rope_scaling(scaling: Option<&serde_json::Value>) -> ModelResult<()> {
    let Some(v) = scaling.filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let kind = ["rope_type", "type"]
        .iter()
        .find_map(|k| v.get(k).and_then(|t| t.as_str()))
        .unwrap_or("unknown");
    if kind == "default" {
        return Ok(());
    }
    Err(ModelError::UnsupportedRopeScaling {
        kind: kind.to_string(),
    })
}

/// Refuses a GGUF whose `<arch>.rope.scaling.type` is set to anything but `none`, or that
/// carries `rope_freqs.weight` (how llama.cpp stores Llama 3.1-style frequency factors).
fn gguf_rope_scaling(ct: &Content, arch: &Arch) -> ModelResult<()> {
    if let Ok(kind) = md_string(ct, &arch.key("rope.scaling.type"))
        && kind != "none"
    {
        return Err(ModelError::UnsupportedRopeScaling { kind });
    }
    if ct.tensor_infos.contains_key("rope_freqs.weight") {
        return Err(ModelError::UnsupportedRopeScaling {
            kind: "rope_freqs".into(),
        });
    }
    Ok(())
}

fn default_theta() -> f64 {
    10_000.0
}

fn validate(c: &ModelConfig) -> ModelResult<()> {
    let bad = |key: &str| Err(metadata(key));
    if c.num_heads == 0 || c.num_kv_heads == 0 || !c.num_heads.is_multiple_of(c.num_kv_heads) {
        return bad("num_kv_heads");
    }
    if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) || c.num_heads * c.head_dim != c.hidden_size
    {
        return bad("head_dim");
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
mod tests {
    use super::*;

    #[test]
    fn a_scaled_rope_is_refused_not_run_as_plain_rope() {
        let dir = std::env::temp_dir().join(format!("engram-rope-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = |scaling: &str| {
            format!(
                r#"{{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
                "num_hidden_layers": 1, "num_attention_heads": 2, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 64, "rope_scaling": {scaling}}}"#
            )
        };
        // Llama 3.1's own config: refused before any weight is read.
        std::fs::write(
            dir.join("config.json"),
            config(
                r#"{"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
            ),
        )
        .unwrap();
        match Weights::from_safetensors_dir(&dir) {
            Err(ModelError::UnsupportedRopeScaling { kind }) => assert_eq!(kind, "llama3"),
            other => panic!("{:?}", other.map(|_| ())),
        }
        // Plain RoPE passes the check (and stops at the missing weights).
        for plain in ["null", r#"{"rope_type": "default"}"#] {
            std::fs::write(dir.join("config.json"), config(plain)).unwrap();
            assert!(matches!(
                Weights::from_safetensors_dir(&dir),
                Err(ModelError::Io { .. })
            ));
        }
        // GGUF: a scaling type, or the frequency factors' tensor.
        use candle_core::quantized::gguf_file::{self, Value};
        let gguf = |scaling: Option<&str>, freqs: bool| {
            let path = dir.join("m.gguf");
            let mut md = vec![("general.architecture", Value::String("llama".into()))];
            if let Some(s) = scaling {
                md.push(("llama.rope.scaling.type", Value::String(s.into())));
            }
            let t = QTensor::quantize(
                &Tensor::ones(32, DType::F32, &Device::Cpu).unwrap(),
                candle_core::quantized::GgmlDType::F32,
            )
            .unwrap();
            let tensors: Vec<(&str, &QTensor)> = if freqs {
                vec![("rope_freqs.weight", &t)]
            } else {
                vec![("output_norm.weight", &t)]
            };
            let mdr: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
            let mut f = File::create(&path).unwrap();
            gguf_file::write(&mut f, &mdr, &tensors).unwrap();
            Weights::from_gguf(&path, WeightFormat::default())
        };
        for (scaling, freqs, want) in [
            (Some("linear"), false, Some("linear")),
            (Some("yarn"), false, Some("yarn")),
            (None, true, Some("rope_freqs")),
            (Some("none"), false, None),
            (None, false, None),
        ] {
            match (gguf(scaling, freqs), want) {
                (Err(ModelError::UnsupportedRopeScaling { kind }), Some(w)) => assert_eq!(kind, w),
                // Plain: refused later, for the head count it lacks.
                (Err(ModelError::Metadata { .. }), None) => {}
                (other, _) => panic!("{scaling:?} {freqs}: {:?}", other.map(|_| ())),
            }
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn random_weights_are_the_seeds_in_every_run() {
        let c = ModelConfig {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 24,
            num_layers: 2,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
            ..ModelConfig::smollm2_135m()
        };
        let values = |seed: u64| -> Vec<f32> {
            let w = Weights::random(c.clone(), &Device::Cpu, seed).unwrap();
            let Linear::Dense(wq) = &w.layers[1].wq else {
                panic!("random weights are dense")
            };
            [wq, &w.embed]
                .iter()
                .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect()
        };
        let (a, b, other) = (values(7), values(7), values(8));
        assert_eq!(a, b, "the same seed gives the same weights, bit for bit");
        assert_ne!(a, other);
        // σ 0.02: the sample's spread is near it.
        let var = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / a.len() as f64;
        assert!((var.sqrt() - 0.02).abs() < 0.004, "σ {}", var.sqrt());
    }

    fn randn(rows: usize, cols: usize) -> Tensor {
        Tensor::randn(0f32, 0.5, (rows, cols), &Device::Cpu).unwrap()
    }

    #[test]
    fn device_weights_are_rounded_once_and_multiplied_with_f32_results() {
        let w = randn(24, 64);
        let dense = Linear::Dense(w.clone());
        // The CPU keeps f32: moving there changes nothing.
        let on_cpu = dense.to_device(&Device::Cpu, DeviceWeights::Bf16).unwrap();
        assert!(!on_cpu.is_device_dtype());
        let Linear::Dense(same) = &on_cpu else {
            panic!("dense stays dense")
        };
        let d = (same - &w).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);

        // Rounded for a device: held in bf16, every value within its half-ulp.
        let rounded = dense.rounded_for_device(DeviceWeights::Bf16).unwrap();
        assert!(
            !dense
                .rounded_for_device(DeviceWeights::F32)
                .unwrap()
                .is_device_dtype()
        );
        assert_eq!(DeviceWeights::parse(" BF16"), Some(DeviceWeights::Bf16));
        assert_eq!(DeviceWeights::parse("f32"), Some(DeviceWeights::F32));
        assert_eq!(DeviceWeights::parse("f16"), None);
        assert!(rounded.is_device_dtype());
        let Linear::Dense(rb) = &rounded else {
            panic!("dense stays dense")
        };
        let r = rb.to_dtype(DType::F32).unwrap();
        let (wv, rv): (Vec<f32>, Vec<f32>) = (
            w.flatten_all().unwrap().to_vec1().unwrap(),
            r.flatten_all().unwrap().to_vec1().unwrap(),
        );
        assert!(
            wv.iter().zip(&rv).any(|(a, b)| a != b),
            "nothing was rounded"
        );
        for (a, b) in wv.iter().zip(&rv) {
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "{a} → {b}");
        }
        // The CPU slice path multiplies it as the tensor path does.
        let xs: Vec<f32> = randn(2, 64).flatten_all().unwrap().to_vec1().unwrap();
        let via_apply = rounded.apply(&xs, 2, 1).unwrap();
        let x2 = Tensor::from_slice(&xs, (2, 64), &Device::Cpu).unwrap();
        let via_forward: Vec<f32> = rounded
            .forward(&x2, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(via_apply, via_forward);

        // Held in bf16 (as on a device; candle multiplies bf16 on the CPU too): an f32 input
        // gives an f32 output close to the product with the rounded weights.
        let held = Linear::Dense(w.to_dtype(DEVICE_WEIGHTS).unwrap());
        assert!(held.is_device_dtype());
        let x = randn(3, 64);
        let y = held.forward(&x, 1).unwrap();
        assert_eq!(y.dtype(), DType::F32);
        assert_eq!(y.dims(), &[3, 24]);
        // Exactly the f32 product of the rounded operands, rounded once to bf16.
        let xr = x
            .to_dtype(DEVICE_WEIGHTS)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let exact = xr.matmul(&r.t().unwrap()).unwrap();
        let exact = exact
            .to_dtype(DEVICE_WEIGHTS)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let d = (&y - &exact).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
        let want = x.matmul(&r.t().unwrap()).unwrap();
        let err = (&y - &want).unwrap().sqr().unwrap().sum_all().unwrap();
        let norm = want.sqr().unwrap().sum_all().unwrap();
        let rel = (err.to_scalar::<f32>().unwrap() / norm.to_scalar::<f32>().unwrap()).sqrt();
        // Only the activations' rounding to bf16 is left (≤ 2^-8 per value).
        assert!(rel < 1e-2, "relative error {rel}");
        assert!(
            rel > 0.0,
            "the activations were not rounded: is the product f32?"
        );
    }
}
