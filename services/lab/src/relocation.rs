//! `engram eval kv --relocate` (issue 26): what reusing a segment's KV after a *different*
//! prefix costs, against recomputing it there.
//!
//! Each case cuts four runs of real text from the corpus: a prefix `A`, the segment `S` that
//! follows it in the corpus, the continuation `C` after `S`, and an unrelated prefix `B` of
//! another length. The reference computes `B + S + C` from scratch. The relocated runs compute
//! `A + S` once, then `B` alone, and read `S`'s blocks from the `A + S` run in place (shifted
//! by `|B| − |A|` positions with the query-side RoPE shift and the key-mean correction of
//! [`engram_kvcore::Relocation`]) while `C` is prefilled after them. Variants:
//! - `shifted`: every block of `S` reused;
//! - `shifted, first block recomputed`: `S`'s first block computed after `B`, the rest reused;
//! - `not shifted`: every block of `S` reused with its keys where they were computed (the
//!   control: what a shift buys).
//!
//! Per codec and variant, over `C`'s predictions of its own next tokens: mean KL(reference ‖
//! relocated) in nats, top-1 agreement, and the share of `greedy_tokens` tokens generated
//! greedily after `C` that equal the reference's, position by position; and the share of the
//! prompt's tokens (and bytes) reused. Both sides of a row use the row's codec, so the figure
//! is relocation's own cost.

use std::path::PathBuf;

use candle_core::{D, Tensor};
use engram_kvcore::{
    BlockId, BlockStore, BlockTags, LayerCodecs, Relocated, SourceLayer, StoreConfig, TenantId,
    Tier, TokenRange,
};
use serde::{Deserialize, Serialize};

use crate::eval::{DEFAULT_CORPUS, Sums, read_corpus, score};
use engram_engine::StreamCodecs;
use engram_engine::TextTokenizer;
use engram_engine::{EngineError, EngineResult};
use engram_engine::{KeyCentering, KvTransform, Llama, LogitRows, SeqInput};

/// Prefill chunk of every run.
pub(crate) const CHUNK: usize = 256;

/// Harness options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RelocateOptions {
    /// A text file, or a directory whose files are read in name order.
    pub corpus: PathBuf,
    /// Cases, cut evenly from the corpus.
    pub cases: usize,
    /// Tokens of the prefix the segment was computed after (a multiple of the block size).
    pub prefix_a: usize,
    /// Tokens of the prefix it is reused after (a multiple of the block size, not `prefix_a`).
    pub prefix_b: usize,
    /// Tokens of the segment (a multiple of the block size).
    pub segment: usize,
    /// Tokens of the continuation prefilled after the segment (its predictions are scored).
    pub tail: usize,
    /// Tokens generated greedily after the continuation.
    pub greedy_tokens: usize,
    /// Codecs of the rows.
    pub codecs: Vec<StreamCodecs>,
    /// How keys are stored relative to their calibrated basis (the engine's default: centered
    /// and scaled).
    pub key_centering: KeyCentering,
}

impl Default for RelocateOptions {
    fn default() -> Self {
        Self {
            corpus: PathBuf::from(DEFAULT_CORPUS),
            cases: 16,
            prefix_a: 128,
            prefix_b: 320,
            segment: 512,
            tail: 128,
            greedy_tokens: 32,
            codecs: vec![
                StreamCodecs::both(engram_kvcore::CodecKind::F32),
                StreamCodecs::CPU_DEFAULT,
            ],
            key_centering: KeyCentering::default(),
        }
    }
}

/// How the segment is reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Variant {
    /// Every block reused, shifted.
    Shifted,
    /// The first block recomputed after the new prefix, the rest reused, shifted.
    FirstBlockRecomputed,
    /// Every block reused where its keys were computed (no shift): the control.
    NotShifted,
}

impl Variant {
    /// Every variant, in report order.
    pub const ALL: [Variant; 3] = [
        Variant::Shifted,
        Variant::FirstBlockRecomputed,
        Variant::NotShifted,
    ];
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RelocateReport {
    /// The codec of both sides.
    pub codec: String,
    /// How the segment was reused.
    pub variant: Variant,
    /// Mean KL(reference ‖ relocated) over the continuation's predictions, nats.
    pub kl_nats: f64,
    /// Share of those predictions whose argmax agrees.
    pub top1_agreement: f64,
    /// Share of greedily generated tokens equal to the reference's, position by position.
    pub greedy_agreement: f64,
    /// Predictions scored.
    pub tokens: usize,
    /// Share of the prompt's tokens (`B + S + C`) read from the reused blocks.
    pub reused_share: f64,
    /// KV bytes reused per case instead of computed.
    pub reused_bytes: u64,
    /// Cases run.
    pub cases: usize,
}

/// Runs the harness; `progress` hears one line per case.
pub fn evaluate_relocation(
    model: &Llama,
    tokenizer: &TextTokenizer,
    opts: &RelocateOptions,
    mut progress: impl FnMut(&str),
) -> EngineResult<Vec<RelocateReport>> {
    let shape = model.kv_shape(engram_kvcore::DEFAULT_BLOCK_SIZE)?;
    let bs = shape.block_size;
    let bad = |reason: String| EngineError::InvalidConfig {
        field: "relocate",
        reason,
    };
    let (la, lb, ls, lc) = (opts.prefix_a, opts.prefix_b, opts.segment, opts.tail);
    if [la, lb, ls].iter().any(|n| n % bs != 0) || lb < bs || ls < 2 * bs {
        return Err(bad(format!(
            "prefixes and the segment must be multiples of {bs} tokens (prefix B at least one \
             block, the segment at least two)"
        )));
    }
    if !(2..=CHUNK).contains(&lc) {
        return Err(bad(format!("the tail must be 2 to {CHUNK} tokens")));
    }
    if la == lb {
        return Err(bad("the two prefixes must differ in length".into()));
    }
    let longest = la.max(lb) + ls + lc + opts.greedy_tokens;
    if longest > model.config().context_length {
        return Err(bad(format!(
            "a case needs {longest} tokens; the model's context is {}",
            model.config().context_length
        )));
    }
    let tokens = tokenizer.encode(&read_corpus(&opts.corpus)?)?;
    let span = la + ls + lc;
    if opts.cases == 0 || tokens.len() < span + lb + 1 {
        return Err(bad(format!(
            "the corpus has {} tokens; {} cases need at least {}",
            tokens.len(),
            opts.cases,
            span + lb + 1
        )));
    }
    let means = match opts.key_centering {
        KeyCentering::Off => None,
        KeyCentering::Calibrated | KeyCentering::Scaled => {
            Some(model.key_means(tokenizer)?.to_vec())
        }
    };
    let scales = match opts.key_centering {
        KeyCentering::Scaled => Some(model.key_scales(tokenizer)?.to_vec()),
        KeyCentering::Off | KeyCentering::Calibrated => None,
    };
    let transform = KvTransform {
        key_means: means.as_deref(),
        key_scales: scales.as_deref(),
        probe: None,
    };
    // The threads an engine would run with.
    let threads = engram_kvcore::team::default_threads();
    let model = &model.clone().with_threads(threads);
    let stride = ((tokens.len() - span) / opts.cases).max(1);
    let mut rows = Vec::new();
    for k in &opts.codecs {
        let codecs = LayerCodecs::streams(&shape, k.key, k.value);
        let mut sums = vec![Sums::default(); 1 + Variant::ALL.len()];
        let mut greedy = vec![0usize; Variant::ALL.len()];
        let mut generated = 0usize;
        for case in 0..opts.cases {
            let at = (case * stride).min(tokens.len() - span);
            let a = &tokens[at..at + la];
            let s = &tokens[at + la..at + la + ls];
            let c = &tokens[at + la + ls..at + span];
            // B: from the other half of the corpus, so it is not the text before S.
            let b_at = (at + tokens.len() / 2) % (tokens.len() - lb);
            if b_at < at + span && at < b_at + lb {
                return Err(bad(format!(
                    "the corpus ({} tokens) is too short for prefix B to miss case {case}'s text",
                    tokens.len()
                )));
            }
            let b = &tokens[b_at..b_at + lb];
            let run = Run {
                model,
                codecs: &codecs,
                transform,
                greedy: opts.greedy_tokens,
            };
            let reference = run.reference(b, s, c)?;
            let mut logs = vec![reference.0];
            let mut outs = Vec::new();
            for v in Variant::ALL {
                let (l, g) = run.relocated(a, b, s, c, v)?;
                logs.push(l);
                outs.push(g);
            }
            let targets = Tensor::new(&c[1..], &candle_core::Device::Cpu)?;
            score(&logs, lc - 1, &targets, &mut sums)?;
            for (e, g) in greedy.iter_mut().zip(&outs) {
                *e += g.iter().zip(&reference.1).filter(|(x, y)| x == y).count();
            }
            generated += reference.1.len();
            progress(&format!("{k}: case {} of {}", case + 1, opts.cases));
        }
        let token_bytes = codecs.token_bytes(&shape) as u64;
        for (i, v) in Variant::ALL.into_iter().enumerate() {
            let s = &sums[i + 1];
            let reused = match v {
                Variant::FirstBlockRecomputed => ls - bs,
                _ => ls,
            };
            rows.push(RelocateReport {
                codec: k.to_string(),
                variant: v,
                kl_nats: s.kl_nats(),
                top1_agreement: s.agree as f64 / s.n.max(1) as f64,
                greedy_agreement: greedy[i] as f64 / generated.max(1) as f64,
                tokens: s.n,
                reused_share: reused as f64 / (lb + ls + lc) as f64,
                reused_bytes: reused as u64 * token_bytes,
                cases: opts.cases,
            });
        }
    }
    Ok(rows)
}

/// One codec's runs.
struct Run<'a> {
    model: &'a Llama,
    codecs: &'a LayerCodecs,
    transform: KvTransform<'a>,
    greedy: usize,
}

impl Run<'_> {
    fn store(&self, blocks: usize) -> EngineResult<BlockStore> {
        let shape = self.model.kv_shape(engram_kvcore::DEFAULT_BLOCK_SIZE)?;
        Ok(BlockStore::new(StoreConfig {
            codecs: self.codecs.clone(),
            ..StoreConfig::new(
                shape,
                engram_kvcore::CodecKind::F32,
                u32::try_from(blocks).unwrap_or(u32::MAX),
                0,
            )
        })?)
    }

    fn prefill(
        &self,
        store: &mut BlockStore,
        tokens: &[u32],
        start: usize,
        blocks: &[BlockId],
        relocated: &[Relocated],
        rows: LogitRows,
    ) -> EngineResult<Tensor> {
        let at = Placement {
            start,
            blocks,
            relocated,
        };
        prefill_chunks(self.model, self.transform, store, tokens, at, rows)
    }

    fn generate(
        &self,
        store: &mut BlockStore,
        logits: &Tensor,
        len: usize,
        blocks: &[BlockId],
        relocated: &[Relocated],
    ) -> EngineResult<Vec<u32>> {
        let at = Placement {
            start: len,
            blocks,
            relocated,
        };
        greedy_after(self.model, self.transform, store, logits, at, self.greedy)
    }

    /// `B + S + C` from scratch: log-probabilities of `C`'s rows, greedy tokens after.
    fn reference(&self, b: &[u32], s: &[u32], c: &[u32]) -> EngineResult<(Tensor, Vec<u32>)> {
        let bs = engram_kvcore::DEFAULT_BLOCK_SIZE;
        let len = b.len() + s.len() + c.len();
        let n = (len + self.greedy).div_ceil(bs);
        let mut store = self.store(n)?;
        let blocks = allocate(&mut store, n)?;
        let prompt: Vec<u32> = b.iter().chain(s).copied().collect();
        self.prefill(&mut store, &prompt, 0, &blocks, &[], LogitRows::Last)?;
        let logits = self.prefill(&mut store, c, prompt.len(), &blocks, &[], LogitRows::All)?;
        let g = self.generate(&mut store, &logits, len, &blocks, &[])?;
        Ok((candle_nn::ops::log_softmax(&logits, D::Minus1)?, g))
    }

    /// `A + S` computed, then `B` (and `S`'s first block, as `v` says) after it, `S`'s blocks
    /// read from the first run, `C` prefilled after them.
    fn relocated(
        &self,
        a: &[u32],
        b: &[u32],
        s: &[u32],
        c: &[u32],
        v: Variant,
    ) -> EngineResult<(Tensor, Vec<u32>)> {
        let bs = engram_kvcore::DEFAULT_BLOCK_SIZE;
        let (la, lb, ls) = (a.len(), b.len(), s.len());
        let len = lb + ls + c.len();
        let first = a.len().div_ceil(bs) + ls / bs;
        let rest = (len + self.greedy).div_ceil(bs);
        let mut store = self.store(first + rest)?;
        let source = allocate(&mut store, first)?;
        let computed: Vec<u32> = a.iter().chain(s).copied().collect();
        self.prefill(&mut store, &computed, 0, &source, &[], LogitRows::Last)?;
        // The blocks computed after B: B's, and S's first when it is recomputed.
        let fresh_tokens: Vec<u32> = match v {
            Variant::FirstBlockRecomputed => b.iter().chain(&s[..bs]).copied().collect(),
            _ => b.to_vec(),
        };
        let fresh = allocate(&mut store, fresh_tokens.len() / bs)?;
        self.prefill(&mut store, &fresh_tokens, 0, &fresh, &[], LogitRows::Last)?;
        let reused = &source[(la + fresh_tokens.len() - lb) / bs..];
        let tail = allocate(&mut store, rest - fresh.len() - reused.len())?;
        let table: Vec<BlockId> = fresh.iter().chain(reused).chain(&tail).copied().collect();
        let shift = match v {
            Variant::NotShifted => 0,
            _ => lb as i64 - la as i64,
        };
        let runs = [Relocated {
            start: fresh_tokens.len(),
            end: lb + ls,
            shift,
        }];
        let logits = self.prefill(&mut store, c, lb + ls, &table, &runs, LogitRows::All)?;
        let g = self.generate(&mut store, &logits, len, &table, &runs)?;
        Ok((candle_nn::ops::log_softmax(&logits, D::Minus1)?, g))
    }
}

/// Where a run's tokens go: the first position, the block table and its relocated runs.
#[derive(Clone, Copy)]
pub(crate) struct Placement<'a> {
    pub(crate) start: usize,
    pub(crate) blocks: &'a [BlockId],
    pub(crate) relocated: &'a [Relocated],
}

/// Prefills `tokens` at `at.start` in chunks of [`CHUNK`]; the last chunk's logits (`rows`).
/// The relocation harness's.
pub(crate) fn prefill_chunks(
    model: &Llama,
    transform: KvTransform<'_>,
    store: &mut BlockStore,
    tokens: &[u32],
    at: Placement<'_>,
    rows: LogitRows,
) -> EngineResult<Tensor> {
    let mut last = None;
    for (i, chunk) in tokens.chunks(CHUNK).enumerate() {
        let is_last = (i + 1) * CHUNK >= tokens.len();
        last = Some(model.forward_with(
            store,
            &[SeqInput {
                tokens: chunk,
                start: at.start + i * CHUNK,
                blocks: at.blocks,
                logits: if is_last { rows } else { LogitRows::Last },
                prompt: true,
                relocated: at.relocated,
            }],
            transform,
        )?);
    }
    last.ok_or(EngineError::EmptyPrompt)
}

/// `n` greedy tokens after a prompt of `at.start` tokens whose last logits are `logits`.
pub(crate) fn greedy_after(
    model: &Llama,
    transform: KvTransform<'_>,
    store: &mut BlockStore,
    logits: &Tensor,
    at: Placement<'_>,
    n: usize,
) -> EngineResult<Vec<u32>> {
    let last = logits.dim(0)?.saturating_sub(1);
    let row: Vec<f32> = logits.get(last)?.to_vec1()?;
    let mut next = engram_engine::argmax(&row);
    let mut out = vec![next];
    while out.len() < n {
        let l = model.forward_with(
            store,
            &[SeqInput {
                tokens: &[next],
                start: at.start + out.len() - 1,
                blocks: at.blocks,
                logits: LogitRows::Last,
                prompt: false,
                relocated: at.relocated,
            }],
            transform,
        )?;
        next = engram_engine::argmax(&l.flatten_all()?.to_vec1::<f32>()?);
        out.push(next);
    }
    out.truncate(n);
    Ok(out)
}

fn allocate(store: &mut BlockStore, n: usize) -> EngineResult<Vec<BlockId>> {
    let tags = BlockTags {
        source: SourceLayer::Rules,
        importance: 0.5,
        tenant: TenantId(0),
        session: None,
        tokens: TokenRange::new(0, engram_kvcore::DEFAULT_BLOCK_SIZE as u32),
    };
    Ok(store.allocate(Tier::Hot, &vec![tags; n])?)
}
