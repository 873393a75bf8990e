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

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{EngineError, EngineResult, io_error, metadata};
use crate::model::Layer;

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

/// How GGUF weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightFormat {
    /// Dequantized to f32 at load (the default: candle 0.11 has no SIMD kernel for Q4_1, and its
    /// quantized matmul also quantizes activations, which garbles small models).
    #[default]
    F32,
    /// Kept quantized; candle's quantized matmul (for files too large to dequantize). q/k
    /// projections and the embedding are still dequantized (they are permuted or gathered).
    Quantized,
}

/// A projection: a dense `[out, in]` matrix or a quantized one.
#[derive(Debug, Clone)]
pub(crate) enum Linear {
    Dense(Tensor),
    Quant(QMatMul),
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
}

impl Linear {
    /// The projection on `device` (dense weights only: candle's quantized matmul here is the
    /// CPU path).
    pub fn to_device(&self, device: &Device) -> EngineResult<Self> {
        match self {
            Self::Dense(w) => Ok(Self::Dense(w.to_device(device)?)),
            Self::Quant(_) if device.is_cpu() => Ok(self.clone()),
            Self::Quant(_) => Err(EngineError::InvalidConfig {
                field: "weights",
                reason: "quantized weights run on the CPU only; use weights = \"f32\" on a device"
                    .into(),
            }),
        }
    }

    /// `x · wᵀ` for `x: [rows, in]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => x.matmul(&w.t()?),
            Self::Quant(q) => q.forward(x),
        }
    }
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

impl Weights {
    /// Random weights of `config`'s shape on `device`: normal with σ 0.02, norms 1.
    pub fn random(config: ModelConfig, device: &Device, seed: u64) -> EngineResult<Self> {
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
        let randn = |rows: usize, cols: usize| Tensor::randn(0f32, 0.02, (rows, cols), device);
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
            .collect::<EngineResult<Vec<_>>>()?;
        let mut hash = Sha256::new();
        hash.update(serde_json::to_vec(&config).unwrap_or_default());
        hash.update(seed.to_le_bytes());
        Ok(Self {
            embed: randn(c.vocab_size, h)?,
            lm_head: Linear::Dense(randn(c.vocab_size, h)?),
            norm: ones()?,
            layers,
            fingerprint: hash.finalize().into(),
            config,
        })
    }

    pub fn from_gguf(path: &Path, format: WeightFormat) -> EngineResult<Self> {
        let fingerprint = hash_files(&[path.to_path_buf()])?;
        let mut f = BufReader::new(File::open(path).map_err(io_error(path))?);
        let ct = Content::read(&mut f)?;
        let arch = md_string(&ct, "general.architecture")?;
        if arch != "llama" {
            return Err(EngineError::UnsupportedArchitecture { arch });
        }
        let heads = md_usize(&ct, "llama.attention.head_count")?;
        let hidden = md_usize(&ct, "llama.embedding_length")?;
        let head_dim = match md_usize(&ct, "llama.rope.dimension_count") {
            Ok(d) => d,
            Err(_) => hidden / heads.max(1),
        };
        let dev = Device::Cpu;
        let mut raw = |name: &str| -> EngineResult<QTensor> {
            if !ct.tensor_infos.contains_key(name) {
                return Err(EngineError::MissingTensor {
                    name: name.to_string(),
                });
            }
            Ok(ct.tensor(&mut f, name, &dev)?)
        };
        let mut load = |name: &str| -> EngineResult<Tensor> { Ok(raw(name)?.dequantize(&dev)?) };
        let embed = load("token_embd.weight")?;
        let norm = load("output_norm.weight")?;
        let lm_head = match raw("output.weight") {
            Ok(t) => linear(t, format)?,
            Err(EngineError::MissingTensor { .. }) => Linear::Dense(embed.clone()),
            Err(e) => return Err(e),
        };
        let num_layers = md_usize(&ct, "llama.block_count")?;
        let kv_heads = md_usize(&ct, "llama.attention.head_count_kv").unwrap_or(heads);
        let mut layers = Vec::with_capacity(num_layers);
        for i in 0..num_layers {
            let mut t = |suffix: &str| raw(&format!("blk.{i}.{suffix}.weight"));
            let dense = |q: QTensor| -> EngineResult<Tensor> { Ok(q.dequantize(&dev)?) };
            layers.push(Layer {
                attn_norm: dense(t("attn_norm")?)?,
                wq: Linear::Dense(unpermute(&dense(t("attn_q")?)?, heads, head_dim)?),
                wk: Linear::Dense(unpermute(&dense(t("attn_k")?)?, kv_heads, head_dim)?),
                wv: linear(t("attn_v")?, format)?,
                wo: linear(t("attn_output")?, format)?,
                ffn_norm: dense(t("ffn_norm")?)?,
                w_gate: linear(t("ffn_gate")?, format)?,
                w_up: linear(t("ffn_up")?, format)?,
                w_down: linear(t("ffn_down")?, format)?,
            });
        }
        let config = ModelConfig {
            vocab_size: embed.dim(0)?,
            hidden_size: hidden,
            intermediate_size: md_usize(&ct, "llama.feed_forward_length")?,
            num_layers,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            rope_theta: md_f64(&ct, "llama.rope.freq_base").unwrap_or(10_000.0),
            rms_eps: md_f64(&ct, "llama.attention.layer_norm_rms_epsilon")?,
            context_length: md_usize(&ct, "llama.context_length")?,
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

    pub fn from_safetensors_dir(dir: &Path) -> EngineResult<Self> {
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(io_error(&config_path))?;
        let hf: HfConfig = serde_json::from_str(&text).map_err(|_| metadata("config.json"))?;
        if hf.model_type.as_deref().is_some_and(|t| t != "llama") {
            return Err(EngineError::UnsupportedArchitecture {
                arch: hf.model_type.unwrap_or_default(),
            });
        }
        let files = safetensors_files(dir)?;
        let mut all = HashMap::new();
        for f in &files {
            all.extend(candle_core::safetensors::load(f, &Device::Cpu)?);
        }
        let mut take = |name: &str| -> EngineResult<Tensor> {
            let t = all.remove(name).ok_or_else(|| EngineError::MissingTensor {
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
}

fn default_theta() -> f64 {
    10_000.0
}

fn validate(c: &ModelConfig) -> EngineResult<()> {
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
fn safetensors_files(dir: &Path) -> EngineResult<Vec<PathBuf>> {
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

/// A projection in the requested format.
fn linear(q: QTensor, format: WeightFormat) -> EngineResult<Linear> {
    Ok(match format {
        WeightFormat::F32 => Linear::Dense(q.dequantize(&Device::Cpu)?),
        WeightFormat::Quantized => Linear::Quant(QMatMul::QTensor(std::sync::Arc::new(q))),
    })
}

/// Inverts llama.cpp's q/k row permutation: `[heads, 2, d/2]` rows from `[heads, d/2, 2]`.
fn unpermute(w: &Tensor, heads: usize, head_dim: usize) -> EngineResult<Tensor> {
    let (out, inp) = w.dims2()?;
    Ok(w.reshape((heads, head_dim / 2, 2, inp))?
        .transpose(1, 2)?
        .reshape((out, inp))?
        .contiguous()?)
}

/// SHA-256 over the files' bytes, in order.
fn hash_files(files: &[PathBuf]) -> EngineResult<[u8; 32]> {
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

pub(crate) fn md_string(ct: &Content, key: &str) -> EngineResult<String> {
    match ct.metadata.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(metadata(key)),
    }
}

pub(crate) fn md_usize(ct: &Content, key: &str) -> EngineResult<usize> {
    let v = match ct.metadata.get(key) {
        Some(Value::U8(v)) => u64::from(*v),
        Some(Value::U16(v)) => u64::from(*v),
        Some(Value::U32(v)) => u64::from(*v),
        Some(Value::U64(v)) => *v,
        Some(Value::I32(v)) => u64::try_from(*v).map_err(|_| metadata(key))?,
        Some(Value::I64(v)) => u64::try_from(*v).map_err(|_| metadata(key))?,
        _ => return Err(metadata(key)),
    };
    usize::try_from(v).map_err(|_| metadata(key))
}

fn md_f64(ct: &Content, key: &str) -> EngineResult<f64> {
    match ct.metadata.get(key) {
        Some(Value::F32(v)) => Ok(f64::from(*v)),
        Some(Value::F64(v)) => Ok(*v),
        _ => Err(metadata(key)),
    }
}
