//! `engram eval kv --fuse` (issue 26): what fusing similar KV blocks across the sessions of a
//! tenant costs, against keeping every block.
//!
//! Each of `sessions` sessions is a window of real text from the corpus: a prompt of `prompt`
//! tokens whose blocks are candidates, then a continuation of `tail` tokens scored after it.
//! The reference prefills every prompt into its own blocks and the continuation after it. Then,
//! for each similarity threshold, in every layer, blocks at the same position (the same block
//! index, so their keys carry the same rotary phases) are fused across sessions, greedily in
//! session order: a block joins the first kept block (its *representative*) whose rows it
//! matches within the threshold — the mean cosine similarity of its key rows and of its value
//! rows to the representative's, each at least the threshold (the keys centered by the
//! calibrated means, as the engine stores them) — and is then stored as the representative's
//! row directions times its own row norms (one norm per row for keys and values); otherwise it
//! becomes a representative. The continuation is prefilled again over the fused prompt blocks.
//!
//! Per codec and threshold, over the continuations' predictions of their own next tokens: mean
//! KL(reference ‖ fused) in nats, top-1 agreement, the share of `greedy_tokens` tokens generated
//! greedily after the continuation that equal the reference's; the share of (layer, block)
//! pairs fused and the compression in bytes: every block's bytes against the representatives'
//! plus the members' norms (2 bytes a row for keys and values) and a 4-byte reference. The
//! issue's kill criterion: fusion ships on only if compression ≥ 1.3× at ΔKL ≤ 0.01 nats and
//! top-1 ≥ 98 % at 64 sessions.

use std::path::PathBuf;

use candle_core::{D, Tensor};
use engram_kvcore::{
    BlockId, BlockStore, BlockTags, LayerCodecs, Rows, SourceLayer, StoreConfig, TenantId, Tier,
    TokenRange,
};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, EngineResult};
use crate::eval::{DEFAULT_CORPUS, Sums, read_corpus, score};
use crate::model::{KvTransform, Llama, LogitRows};
use crate::probe::StreamCodecs;
use crate::relocation::{Placement, greedy_after, prefill_chunks};
use crate::tokenizer::TextTokenizer;

/// Harness options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FuseOptions {
    /// A text file, or a directory whose files are read in name order.
    pub corpus: PathBuf,
    /// Sessions, cut evenly from the corpus.
    pub sessions: usize,
    /// Tokens of each session's prompt (a multiple of the block size): the fusion candidates.
    pub prompt: usize,
    /// Tokens of the continuation prefilled after the prompt (its predictions are scored).
    pub tail: usize,
    /// Tokens generated greedily after the continuation.
    pub greedy_tokens: usize,
    /// Similarity thresholds, one row each.
    pub thresholds: Vec<f32>,
    /// Codecs of the rows.
    pub codecs: Vec<StreamCodecs>,
    /// Whether keys are centered by the calibrated means (the engine's default).
    pub key_centering: bool,
}

impl Default for FuseOptions {
    fn default() -> Self {
        Self {
            corpus: PathBuf::from(DEFAULT_CORPUS),
            sessions: 64,
            prompt: 256,
            tail: 64,
            greedy_tokens: 16,
            thresholds: vec![0.99, 0.95, 0.9, 0.8, 0.6],
            codecs: vec![StreamCodecs::both(engram_kvcore::CodecKind::F32)],
            key_centering: true,
        }
    }
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FuseReport {
    /// The codec of both sides.
    pub codec: String,
    /// Similarity threshold of the row.
    pub threshold: f32,
    /// Share of (layer, block) pairs stored as a member of another session's block.
    pub fused_share: f64,
    /// Prompt KV bytes unfused over fused.
    pub compression: f64,
    /// Mean KL(reference ‖ fused) over the continuations' predictions, nats.
    pub kl_nats: f64,
    /// Share of those predictions whose argmax agrees.
    pub top1_agreement: f64,
    /// Share of greedily generated tokens equal to the reference's, position by position.
    pub greedy_agreement: f64,
    /// Predictions scored.
    pub tokens: usize,
    /// Sessions.
    pub sessions: usize,
    /// Whether the row meets the bar (compression ≥ 1.3×, KL ≤ 0.01, top-1 ≥ 98 %).
    pub meets_bar: bool,
}

/// Runs the harness; `progress` hears one line per stage.
pub fn evaluate_fusion(
    model: &Llama,
    tokenizer: &TextTokenizer,
    opts: &FuseOptions,
    mut progress: impl FnMut(&str),
) -> EngineResult<Vec<FuseReport>> {
    let shape = model.kv_shape(engram_kvcore::DEFAULT_BLOCK_SIZE)?;
    let bs = shape.block_size;
    let bad = |reason: String| EngineError::InvalidConfig {
        field: "fuse",
        reason,
    };
    let (lp, lt) = (opts.prompt, opts.tail);
    if lp % bs != 0 || lp < bs {
        return Err(bad(format!(
            "the prompt must be a positive multiple of {bs} tokens"
        )));
    }
    if !(2..=crate::relocation::CHUNK).contains(&lt) {
        return Err(bad(format!(
            "the tail must be 2 to {} tokens",
            crate::relocation::CHUNK
        )));
    }
    if opts.sessions < 2 {
        return Err(bad("fusion needs at least two sessions".into()));
    }
    if opts
        .thresholds
        .iter()
        .any(|t| !t.is_finite() || !(-1.0..=1.0).contains(t))
    {
        return Err(bad("thresholds are cosine similarities in [-1, 1]".into()));
    }
    let longest = lp + lt + opts.greedy_tokens;
    if longest > model.config().context_length {
        return Err(bad(format!(
            "a session needs {longest} tokens; the model's context is {}",
            model.config().context_length
        )));
    }
    let tokens = tokenizer.encode(&read_corpus(&opts.corpus)?)?;
    let span = lp + lt;
    if tokens.len() < span * opts.sessions {
        return Err(bad(format!(
            "the corpus has {} tokens; {} sessions of {span} distinct tokens need {}",
            tokens.len(),
            opts.sessions,
            span * opts.sessions
        )));
    }
    let means = if opts.key_centering {
        Some(model.key_means(tokenizer)?.to_vec())
    } else {
        None
    };
    let transform = KvTransform {
        key_means: means.as_deref(),
        probe: None,
    };
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let model = &model.clone().with_threads(threads);
    let stride = tokens.len() / opts.sessions;
    let sessions: Vec<(&[u32], &[u32])> = (0..opts.sessions)
        .map(|i| {
            let at = i * stride;
            (&tokens[at..at + lp], &tokens[at + lp..at + span])
        })
        .collect();
    let prompt_blocks = lp / bs;
    let per_session = (span + opts.greedy_tokens).div_ceil(bs);
    let mut rows = Vec::new();
    for k in &opts.codecs {
        let codecs = LayerCodecs::streams(&shape, k.key, k.value);
        let run = Run {
            model,
            transform,
            greedy: opts.greedy_tokens,
        };
        let mut store = BlockStore::new(StoreConfig {
            codecs: codecs.clone(),
            ..StoreConfig::new(
                shape,
                engram_kvcore::CodecKind::F32,
                u32::try_from(opts.sessions * per_session).unwrap_or(u32::MAX),
                u32::try_from(opts.sessions * prompt_blocks).unwrap_or(u32::MAX),
            )
        })?;
        let tables: Vec<Vec<BlockId>> = (0..opts.sessions)
            .map(|_| allocate(&mut store, per_session))
            .collect::<EngineResult<_>>()?;
        // The reference: every prompt in its own blocks, the continuation after it.
        let mut reference = Vec::with_capacity(opts.sessions);
        for (i, ((p, c), table)) in sessions.iter().zip(&tables).enumerate() {
            run.prefill(&mut store, p, 0, table, LogitRows::Last)?;
            reference.push(run.continuation(&mut store, p.len(), c, table)?);
            progress(&format!(
                "{k}: reference, session {} of {}",
                i + 1,
                opts.sessions
            ));
        }
        // The prompts' rows as computed, per layer and session: [prompt, kv_heads, head_dim].
        let width = lp * shape.kv_heads * shape.head_dim;
        let mut original = Vec::with_capacity(shape.layers);
        for l in 0..shape.layers {
            let mut layer = Vec::with_capacity(opts.sessions);
            for table in &tables {
                let (mut kr, mut vr) = (vec![0f32; width], vec![0f32; width]);
                store.read(l, &table[..prompt_blocks], 0, &mut kr, &mut vr)?;
                layer.push((kr, vr));
            }
            original.push(layer);
        }
        // Bytes of one block in one layer (the codecs are the same in every layer), and of a
        // member's norms and reference.
        // Every prompt block's bytes as computed, to put fused blocks back between thresholds.
        let saved: Vec<Vec<Vec<u8>>> = tables
            .iter()
            .map(|t| {
                t[..prompt_blocks]
                    .iter()
                    .map(|&id| store.block_bytes_of(id))
                    .collect()
            })
            .collect::<Result<_, _>>()?;
        let block_bytes = (codecs.token_bytes(&shape) * bs) as f64 / shape.layers as f64;
        let member_bytes = (2 * 2 * bs * shape.kv_heads + 4) as f64;
        let pairs = shape.layers * opts.sessions * prompt_blocks;
        for &threshold in &opts.thresholds {
            let mut fused = 0usize;
            let mut touched = std::collections::BTreeSet::new();
            for (l, layer) in original.iter().enumerate() {
                let geometry = (bs, shape.kv_heads, shape.head_dim);
                for m in fuse_layer(layer, prompt_blocks, geometry, threshold) {
                    let id = tables[m.session][m.block];
                    store.write(l, &[id], 0, Rows::F32(&m.keys), Rows::F32(&m.values))?;
                    touched.insert((m.session, m.block));
                    fused += 1;
                }
            }
            let mut sums = vec![Sums::default(); 2];
            let (mut same, mut generated) = (0usize, 0usize);
            for (((p, c), table), (ref_logs, ref_greedy)) in
                sessions.iter().zip(&tables).zip(&reference)
            {
                let (logs, greedy) = run.continuation(&mut store, p.len(), c, table)?;
                let targets = Tensor::new(&c[1..], &candle_core::Device::Cpu)?;
                score(&[ref_logs.clone(), logs], lt - 1, &targets, &mut sums)?;
                same += greedy
                    .iter()
                    .zip(ref_greedy)
                    .filter(|(x, y)| x == y)
                    .count();
                generated += ref_greedy.len();
            }
            // The fused blocks back to their bytes as computed, for the next threshold: through
            // the cold tier, where a block's bytes can be written whole.
            let ids: Vec<BlockId> = touched.iter().map(|&(s, j)| tables[s][j]).collect();
            store.spill(&ids)?;
            for &(s, j) in &touched {
                store.write_block_bytes(tables[s][j], &saved[s][j])?;
            }
            store.warm(&ids)?;
            let unfused = pairs as f64 * block_bytes;
            let stored = (pairs - fused) as f64 * block_bytes + fused as f64 * member_bytes;
            let s = &sums[1];
            let (kl, top1) = (s.kl_nats(), s.agree as f64 / s.n.max(1) as f64);
            let compression = unfused / stored;
            rows.push(FuseReport {
                codec: k.to_string(),
                threshold,
                fused_share: fused as f64 / pairs as f64,
                compression,
                kl_nats: kl,
                top1_agreement: top1,
                greedy_agreement: same as f64 / generated.max(1) as f64,
                tokens: s.n,
                sessions: opts.sessions,
                meets_bar: compression >= 1.3 && kl <= 0.01 && top1 >= 0.98,
            });
            progress(&format!(
                "{k}: threshold {threshold}: {:.1} % fused, KL {kl:.4}",
                100.0 * fused as f64 / pairs as f64
            ));
        }
    }
    Ok(rows)
}

/// Fuses one layer's prompt rows across sessions at `threshold` (module docs): returns every
/// session's key and value rows as stored after fusion and the number of (session, block) pairs
/// fused.
fn fuse_layer(
    layer: &[(Vec<f32>, Vec<f32>)],
    blocks: usize,
    (bs, kv_heads, d): (usize, usize, usize),
    threshold: f32,
) -> Vec<Member> {
    let block = bs * kv_heads * d;
    let mut members = Vec::new();
    for j in 0..blocks {
        let span = j * block..(j + 1) * block;
        let mut reps: Vec<usize> = Vec::new();
        for s in 0..layer.len() {
            let (k, v) = (&layer[s].0[span.clone()], &layer[s].1[span.clone()]);
            let found = reps.iter().copied().find(|&r| {
                let (rk, rv) = (&layer[r].0[span.clone()], &layer[r].1[span.clone()]);
                mean_cosine(k, rk, d) >= threshold && mean_cosine(v, rv, d) >= threshold
            });
            match found {
                Some(r) => {
                    let (rk, rv) = (&layer[r].0[span.clone()], &layer[r].1[span.clone()]);
                    let (mut k, mut v) = (k.to_vec(), v.to_vec());
                    redirect(&mut k, rk, d);
                    redirect(&mut v, rv, d);
                    members.push(Member {
                        session: s,
                        block: j,
                        keys: k,
                        values: v,
                    });
                }
                None => reps.push(s),
            }
        }
    }
    members
}

/// A block stored as a member of another session's: its rows as fusion leaves them.
#[derive(Debug)]
struct Member {
    session: usize,
    block: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// Mean cosine similarity of the `d`-element rows of `a` and `b` (a zero row counts as 0).
fn mean_cosine(a: &[f32], b: &[f32], d: usize) -> f32 {
    let (mut sum, mut n) = (0.0f64, 0usize);
    for (x, y) in a.chunks_exact(d).zip(b.chunks_exact(d)) {
        let (mut xy, mut xx, mut yy) = (0.0f64, 0.0f64, 0.0f64);
        for (&p, &q) in x.iter().zip(y) {
            xy += f64::from(p) * f64::from(q);
            xx += f64::from(p) * f64::from(p);
            yy += f64::from(q) * f64::from(q);
        }
        if xx > 0.0 && yy > 0.0 {
            sum += xy / (xx * yy).sqrt();
        }
        n += 1;
    }
    (sum / n.max(1) as f64) as f32
}

/// Each `d`-element row of `member` becomes the direction of `rep`'s row times its own norm.
fn redirect(member: &mut [f32], rep: &[f32], d: usize) {
    for (m, r) in member.chunks_exact_mut(d).zip(rep.chunks_exact(d)) {
        let norm = m.iter().map(|x| x * x).sum::<f32>().sqrt();
        let rn = r.iter().map(|x| x * x).sum::<f32>().sqrt();
        let f = if rn > 0.0 { norm / rn } else { 0.0 };
        m.iter_mut().zip(r).for_each(|(m, r)| *m = r * f);
    }
}

/// The harness's runs over one codec's store.
struct Run<'a> {
    model: &'a Llama,
    transform: KvTransform<'a>,
    greedy: usize,
}

impl Run<'_> {
    fn prefill(
        &self,
        store: &mut BlockStore,
        tokens: &[u32],
        start: usize,
        blocks: &[BlockId],
        rows: LogitRows,
    ) -> EngineResult<Tensor> {
        let at = Placement {
            start,
            blocks,
            relocated: &[],
        };
        prefill_chunks(self.model, self.transform, store, tokens, at, rows)
    }

    /// The continuation `c` prefilled after a prompt of `len` tokens: its rows'
    /// log-probabilities and the greedy tokens after it.
    fn continuation(
        &self,
        store: &mut BlockStore,
        len: usize,
        c: &[u32],
        blocks: &[BlockId],
    ) -> EngineResult<(Tensor, Vec<u32>)> {
        let logits = self.prefill(store, c, len, blocks, LogitRows::All)?;
        let at = Placement {
            start: len + c.len(),
            blocks,
            relocated: &[],
        };
        let out = greedy_after(self.model, self.transform, store, &logits, at, self.greedy)?;
        Ok((candle_nn::ops::log_softmax(&logits, D::Minus1)?, out))
    }
}

fn allocate(store: &mut BlockStore, n: usize) -> EngineResult<Vec<BlockId>> {
    let tags = BlockTags {
        source: SourceLayer::UserTurn,
        importance: 0.5,
        tenant: TenantId(0),
        session: None,
        tokens: TokenRange::new(0, engram_kvcore::DEFAULT_BLOCK_SIZE as u32),
    };
    Ok(store.allocate(Tier::Hot, &vec![tags; n])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_keeps_the_member_norm_and_takes_the_rep_direction() {
        let rep = [3.0f32, 4.0, 0.0, 0.0, 0.0, 2.0];
        let mut member = [0.0f32, 10.0, 0.0, 1.0, 0.0, 0.0];
        redirect(&mut member, &rep, 3);
        assert_eq!(member, [6.0, 8.0, 0.0, 0.0, 0.0, 1.0]);
        assert!((mean_cosine(&[1.0, 0.0, 0.0, 1.0], &[1.0, 0.0, 1.0, 0.0], 2) - 0.5).abs() < 1e-6);
        assert_eq!(mean_cosine(&[0.0, 0.0], &[1.0, 0.0], 2), 0.0);
    }

    /// Blocks fuse with the first kept block of the same index that matches; a threshold of 1
    /// fuses only identical directions; the members keep their norms.
    #[test]
    fn fuse_layer_groups_matching_blocks_of_the_same_index() {
        // Three sessions, two blocks each of two rows of two dims.
        let a = (
            vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0],
            vec![0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0],
        );
        let b = (
            vec![2.0, 0.0, 0.0, 3.0, 0.0, 1.0, 0.0, 1.0],
            vec![0.0, 2.0, 2.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        );
        let c = (
            vec![1.0, 0.1, 0.1, 1.0, -1.0, 0.0, 0.0, -1.0],
            vec![0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0],
        );
        let layer = vec![a, b, c];
        let members = fuse_layer(&layer, 2, (2, 1, 2), 1.0 - 1e-6);
        // Block 0 of session 1 is session 0's directions scaled; nothing else matches exactly.
        assert_eq!(members.len(), 1);
        let m = &members[0];
        assert_eq!((m.session, m.block), (1, 0));
        assert_eq!(m.keys, [2.0, 0.0, 0.0, 3.0]);
        assert_eq!(m.values, [0.0, 2.0, 2.0, 0.0]);
        // At 0.9 session 2's block 0 (cosine 0.995) joins too, and takes session 0's direction.
        let members = fuse_layer(&layer, 2, (2, 1, 2), 0.9);
        assert_eq!(members.len(), 2);
        let m = &members[1];
        assert_eq!((m.session, m.block), (2, 0));
        let norm = (1.0f32 + 0.01).sqrt();
        assert!((m.keys[0] - norm).abs() < 1e-6 && m.keys[1] == 0.0);
        // At −1 every block joins the first session's.
        assert_eq!(fuse_layer(&layer, 2, (2, 1, 2), -1.0).len(), 4);
    }
}
