//! What the anchor tests share: the checkpoints, a forward of engram-model over a block store,
//! the teacher-forced text, and the KL of two logit rows.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use engram_kvcore::{
    BlockId, BlockStore, BlockTags, CodecKind, LayerCodecs, SourceLayer, StoreConfig, TenantId,
    Tier, TokenRange,
};
use engram_model::{KvTransform, Llama, LogitRows, SeqInput, TextTokenizer};

/// A checkpoint in `models/` (`make models-extra`); missing, the test fails.
pub fn checkpoint(file: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(file);
    assert!(
        p.is_file(),
        "{} is missing: run `make models-extra`",
        p.display()
    );
    p
}

pub const QWEN_05B: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
pub const QWEN_15B: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";
pub const GEMMA3_270M: &str = "gemma-3-270m-q4_k_m.gguf";

/// The teacher-forced text: the Apache License 2.0 as Debian ships it (the eval corpus).
pub fn corpus() -> String {
    let p = "/usr/share/common-licenses/Apache-2.0";
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{p}: {e}"))
}

/// Engram's forward over a fresh block store per sequence.
pub struct Ours {
    pub model: Llama,
    pub tokenizer: TextTokenizer,
    codec: CodecKind,
    /// The values' codec, when not `codec`.
    value_codec: Option<CodecKind>,
    /// Key means (and scales) the keys are stored relative to; none by default.
    means: Option<Vec<f32>>,
    scales: Option<Vec<f32>>,
}

impl Ours {
    pub fn load(path: &std::path::Path, codec: CodecKind) -> Self {
        let (model, tokenizer) = Llama::load_named(path, "int16").unwrap();
        Self {
            model: model.with_threads(engram_kvcore::team::default_threads()),
            tokenizer,
            codec,
            value_codec: None,
            means: None,
            scales: None,
        }
    }

    /// The same model storing keys in `codec` and values in `value_codec`, keys centered on the calibrated means and, if
    /// `scaled`, divided by the calibrated key scales.
    pub fn relative(&self, codec: CodecKind, value_codec: CodecKind, scaled: bool) -> Self {
        Self {
            model: self.model.clone(),
            tokenizer: self.tokenizer.clone(),
            codec,
            value_codec: Some(value_codec),
            means: Some(self.model.key_means(&self.tokenizer).unwrap().to_vec()),
            scales: scaled.then(|| self.model.key_scales(&self.tokenizer).unwrap().to_vec()),
        }
    }

    fn transform(&self) -> KvTransform<'_> {
        KvTransform {
            key_means: self.means.as_deref(),
            key_scales: self.scales.as_deref(),
            probe: None,
        }
    }

    fn store(&self, tokens: usize) -> (BlockStore, Vec<BlockId>) {
        let shape = self
            .model
            .kv_shape(engram_kvcore::DEFAULT_BLOCK_SIZE)
            .unwrap();
        let n = tokens.div_ceil(shape.block_size);
        let mut config = StoreConfig::new(shape, self.codec, n as u32, 0);
        if let Some(v) = self.value_codec {
            config.codecs = LayerCodecs::streams(&shape, self.codec, v);
        }
        let mut store = BlockStore::new(config).unwrap();
        let tags = BlockTags {
            source: SourceLayer::SystemState,
            importance: 0.0,
            tenant: TenantId(1),
            session: None,
            tokens: TokenRange::new(0, shape.block_size as u32),
        };
        let blocks = store.allocate(Tier::Hot, &vec![tags; n]).unwrap();
        (store, blocks)
    }

    /// Logits of every position of `tokens`, prefilled in chunks of `chunk`.
    pub fn teacher_forced(&self, tokens: &[u32], chunk: usize) -> Vec<Vec<f32>> {
        let (mut store, blocks) = self.store(tokens.len());
        let mut out = Vec::with_capacity(tokens.len());
        let mut start = 0;
        while start < tokens.len() {
            let end = (start + chunk).min(tokens.len());
            let logits = self
                .model
                .forward_with(
                    &mut store,
                    &[SeqInput {
                        tokens: &tokens[start..end],
                        start,
                        blocks: &blocks,
                        logits: LogitRows::All,
                        prompt: true,
                        relocated: &[],
                    }],
                    self.transform(),
                )
                .unwrap();
            out.extend(logits.to_vec2::<f32>().unwrap());
            start = end;
        }
        out
    }

    /// `n` greedy tokens after `prompt` (prefill, then single-token decode steps).
    pub fn greedy(&self, prompt: &[u32], n: usize) -> Vec<u32> {
        let (mut store, blocks) = self.store(prompt.len() + n);
        let mut step = |tokens: &[u32], start: usize, prompt: bool| -> u32 {
            let logits = self
                .model
                .forward_with(
                    &mut store,
                    &[SeqInput {
                        tokens,
                        start,
                        blocks: &blocks,
                        logits: LogitRows::Last,
                        prompt,
                        relocated: &[],
                    }],
                    self.transform(),
                )
                .unwrap();
            argmax(&logits.squeeze(0).unwrap().to_vec1::<f32>().unwrap())
        };
        let mut out = vec![step(prompt, 0, true)];
        while out.len() < n {
            let pos = prompt.len() + out.len() - 1;
            let next = step(&[*out.last().unwrap()], pos, false);
            out.push(next);
        }
        out
    }
}

pub fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| {
            if x > bv { (i, x) } else { (bi, bv) }
        })
        .0 as u32
}

/// `KL(p ‖ q)` in nats of the distributions of two logits rows (normalized in f64: over a
/// vocabulary of 262K, f32 log-probabilities carry errors of the size being measured).
pub fn kl(logits_p: &[f32], logits_q: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(logits_p), log_softmax(logits_q));
    lp.iter().zip(&lq).map(|(&a, &b)| a.exp() * (a - b)).sum()
}

/// Log-softmax of one logits row, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let lse = row
        .iter()
        .map(|&x| (f64::from(x) - f64::from(max)).exp())
        .sum::<f64>()
        .ln();
    row.iter()
        .map(|&x| f64::from(x) - f64::from(max) - lse)
        .collect()
}

/// The bound of the issue: mean KL over the teacher-forced positions, and greedy agreement.
pub const MEAN_KL_BOUND: f64 = 0.005;

/// Prints and checks the figures of one anchor.
pub fn report(name: &str, kls: &[f64], greedy_equal: usize, prompts: usize) {
    let mean = kls.iter().sum::<f64>() / kls.len() as f64;
    let max = kls.iter().fold(0f64, |a, &b| a.max(b));
    println!(
        "{name}: mean KL {mean:.2e} nats over {} teacher-forced tokens (max {max:.2e}); greedy \
         equal for 32 tokens on {greedy_equal} of {prompts} prompts",
        kls.len()
    );
    assert!(kls.len() >= 512, "{} positions", kls.len());
    assert!(
        mean <= MEAN_KL_BOUND,
        "{name}: mean KL {mean} > {MEAN_KL_BOUND}"
    );
    assert!(
        greedy_equal >= 4,
        "{name}: greedy equal on {greedy_equal} of {prompts}"
    );
}
