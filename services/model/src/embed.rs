//! Sentence embeddings for the memory graph: a BERT encoder in candle (all-MiniLM-L6-v2 by
//! default, `make models` puts it in `models/all-MiniLM-L6-v2/`), mean pooling over the real
//! tokens, L2 normalization — the sentence-transformers recipe of that model.
//!
//! Texts are embedded in batches: padded to the batch's longest text (at most
//! [`MAX_TOKENS`] tokens, longer texts are truncated) with an attention mask, so a text's
//! vector does not depend on what it was batched with beyond float summation order.

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};
use sha2::{Digest, Sha256};
use tokenizers::{Tokenizer, TruncationParams};

use crate::error::{ModelError, ModelResult, io_error};

/// Tokens per text at most (all-MiniLM-L6-v2's `max_seq_length`).
pub const MAX_TOKENS: usize = 256;

/// A loaded embedding model.
pub struct Embedder {
    model: BertModel,
    tokenizer: Tokenizer,
    device: Device,
    dim: usize,
    fingerprint: [u8; 32],
}

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder")
            .field("dim", &self.dim)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl Embedder {
    /// Loads `config.json`, `model.safetensors` and `tokenizer.json` from `dir` onto `device`.
    pub fn load(dir: &Path, device: &Device) -> ModelResult<Self> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read(&p).map_err(io_error(&p))
        };
        let (config_bytes, tok_bytes) = (read("config.json")?, read("tokenizer.json")?);
        let config: Config =
            serde_json::from_slice(&config_bytes).map_err(|e| ModelError::Metadata {
                key: format!("config.json: {e}"),
            })?;
        let weights = read("model.safetensors")?;
        let mut h = Sha256::new();
        h.update(&config_bytes);
        h.update(&tok_bytes);
        h.update(&weights);
        // Read into memory, not memory-mapped: no unsafe, and the file is 91 MB.
        let vb = VarBuilder::from_buffered_safetensors(weights, DType::F32, device)?;
        let model = BertModel::load(vb, &config)?;
        let mut tokenizer =
            Tokenizer::from_bytes(&tok_bytes).map_err(|e| ModelError::Tokenizer {
                reason: e.to_string(),
            })?;
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: MAX_TOKENS,
                ..TruncationParams::default()
            }))
            .map_err(|e| ModelError::Tokenizer {
                reason: e.to_string(),
            })?;
        Ok(Self {
            model,
            tokenizer,
            device: device.clone(),
            dim: config.hidden_size,
            fingerprint: h.finalize().into(),
        })
    }

    /// Vector width.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// SHA-256 of the model's files: vectors are re-embedded when it changes.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// Tokens the embedder reads of `text` (at most [`MAX_TOKENS`]: the rest is cut).
    pub fn count_tokens(&self, text: &str) -> ModelResult<usize> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| ModelError::Tokenizer {
                reason: e.to_string(),
            })?;
        Ok(enc.get_ids().len())
    }

    /// Unit vectors of `texts`, in order (an empty slice gives none).
    pub fn embed(&self, texts: &[&str]) -> ModelResult<Vec<Vec<f32>>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let encs = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| ModelError::Tokenizer {
                reason: e.to_string(),
            })?;
        let len = encs
            .iter()
            .map(|e| e.get_ids().len())
            .max()
            .unwrap_or(1)
            .max(1);
        let n = encs.len();
        let (mut ids, mut mask) = (vec![0u32; n * len], vec![0u32; n * len]);
        for (b, e) in encs.iter().enumerate() {
            for (t, &id) in e.get_ids().iter().enumerate() {
                ids[b * len + t] = id;
                mask[b * len + t] = 1;
            }
        }
        let ids = Tensor::from_vec(ids, (n, len), &self.device)?;
        let mask = Tensor::from_vec(mask, (n, len), &self.device)?;
        let types = ids.zeros_like()?;
        let hidden = self.model.forward(&ids, &types, Some(&mask))?;
        // Mean over real tokens, then L2 normalization.
        let m = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
        let summed = hidden.broadcast_mul(&m)?.sum(1)?;
        let counts = m.sum(1)?.clamp(1.0, f64::MAX)?;
        let mean = summed.broadcast_div(&counts)?;
        let norm = mean.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
        Ok(mean
            .broadcast_div(&norm)?
            .to_device(&Device::Cpu)?
            .to_vec2()?)
    }
}

/// Cosine similarity of two vectors (their dot product when both are unit vectors).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(1e-12)
}
