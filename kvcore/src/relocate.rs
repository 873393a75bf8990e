//! Relocated segments (issue 26): attention over a sequence some of whose block runs were
//! computed at other positions — a shared segment reused after a different prefix — without
//! re-encoding their keys.
//!
//! A key stored at position `p` is `R(p)·k − μ` (half-split RoPE, then the layer's per-KV-head
//! key mean `μ` subtracted by the engine's key centering). Standing at `p + δ`, its key would be
//! `R(δ)·(stored + μ)`. The score of a query `q` against it is then
//! `q · R(δ)(stored + μ) = q′ · stored + q′ · μ` with `q′ = R(−δ)·q`: the query is rotated
//! back instead of the key forward (no codec error is added: the codes are read as stored), and
//! the run's scores move by `(q′ − q) · μ` against the other keys', whose `q · μ` every score
//! shares and the softmax drops. Leaving that correction out skews the run's scores.

use crate::attention::{AttentionParams, Prepared, check_len, finish_heads, merged, run_units};
use crate::simd::{KeyRange, Partial};
use crate::{BlockId, BlockStore, Isa, KvError, KvResult};

/// A run of a sequence's positions whose keys were computed `shift` positions before where they
/// stand now (`shift` > 0: the run moved right). Runs start and end on block boundaries (or at
/// the sequence's end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Relocated {
    /// First position of the run.
    pub start: usize,
    /// One past its last position.
    pub end: usize,
    /// Where the run stands now minus where its keys were computed.
    pub shift: i64,
}

/// The model's rotary embedding as relocation needs it: half-split pairs `(j, j + d/2)` turned
/// by `position · θ^(−2j/d)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    /// The base `θ` (`rope_theta`, `llama.rope.freq_base`).
    pub theta: f64,
}

impl Rope {
    /// Turns every head of `x` (`[heads, d]`, half-split) by `delta` positions: `R(delta)·x`.
    pub fn shift(&self, x: &mut [f32], d: usize, delta: i64) {
        let half = d / 2;
        let turns: Vec<(f64, f64)> = (0..half)
            .map(|j| {
                let inv = self.theta.powf(-2.0 * j as f64 / d as f64);
                let a = delta as f64 * inv;
                (a.cos(), a.sin())
            })
            .collect();
        for head in x.chunks_exact_mut(d) {
            let (a, b) = head.split_at_mut(half);
            for (j, &(c, s)) in turns.iter().enumerate() {
                let (x0, x1) = (f64::from(a[j]), f64::from(b[j]));
                a[j] = (x0 * c - x1 * s) as f32;
                b[j] = (x0 * s + x1 * c) as f32;
            }
        }
    }
}

/// What [`BlockStore::attend_relocated`] needs beyond [`BlockStore::attend`]'s arguments.
#[derive(Debug, Clone, Copy)]
pub struct Relocation<'a> {
    /// The relocated runs, in order, not overlapping.
    pub runs: &'a [Relocated],
    /// The model's rotary embedding.
    pub rope: Rope,
    /// The layer's key means (`[kv_heads, head_dim]`) the stored keys had subtracted; `None`
    /// when keys are stored as computed.
    pub key_mean: Option<&'a [f32]>,
}

impl BlockStore {
    /// [`Self::attend`] for a sequence with relocated runs: each run's keys are read with the
    /// query turned back by the run's shift and its scores corrected for the key mean (see the
    /// module's note), which equals attending over keys rotated to where they stand now. Runs
    /// with shift 0 read as [`Self::attend`] does.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_relocated(
        &self,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        relocation: &Relocation<'_>,
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<()> {
        self.attend_relocated_on(
            Isa::active(),
            layer,
            blocks,
            num_tokens,
            q,
            relocation,
            params,
            out,
        )
    }

    /// [`Self::attend_relocated`] on the kernels of `isa` (see [`Self::attend_on`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_relocated_on(
        &self,
        isa: Isa,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        relocation: &Relocation<'_>,
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<()> {
        let (geo, slots, bytes) = self.hot_read(layer, blocks, num_tokens, q, params)?;
        check_len(out.len(), geo.heads * geo.head_dim)?;
        let (d, group, bs) = (geo.head_dim, geo.group(), geo.block_size);
        let pieces = pieces(relocation.runs, geo.tokens, bs)?;
        if let Some(m) = relocation.key_mean {
            check_len(m.len(), geo.kv_heads * d)?;
        }
        // Per moved run: the query turned back by its shift, and per head the score correction
        // (a run with shift 0 reads with the call's query: its piece carries no run).
        let turned: Vec<Option<(Vec<f32>, Vec<f32>)>> = relocation
            .runs
            .iter()
            .map(|r| {
                if r.shift == 0 {
                    return None;
                }
                let mut qr = q.to_vec();
                relocation.rope.shift(&mut qr, d, -r.shift);
                let bias = (0..geo.heads)
                    .map(|h| {
                        relocation.key_mean.map_or(0.0, |m| {
                            let mu = &m[(h / group) * d..][..d];
                            let dot: f64 = qr[h * d..][..d]
                                .iter()
                                .zip(&q[h * d..][..d])
                                .zip(mu)
                                .map(|((a, b), c)| (f64::from(*a) - f64::from(*b)) * f64::from(*c))
                                .sum();
                            (dot * f64::from(params.scale)) as f32
                        })
                    })
                    .collect();
                Some((qr, bias))
            })
            .collect();
        let (kc, vc) = self.layer_codecs(layer);
        let isa = isa.min(Isa::detected());
        let base = Prepared::new((kc, vc), &bytes, geo, q, params, isa);
        let moved: Vec<Option<(Prepared<'_>, &[f32])>> = turned
            .iter()
            .map(|t| {
                t.as_ref().map(|(qr, bias)| {
                    let p = Prepared::new((kc, vc), &bytes, geo, qr, params, isa);
                    (p, &bias[..])
                })
            })
            .collect();
        let slots = &slots[..];
        let units: Vec<(KeyRange<'_>, Option<usize>)> = (0..geo.kv_heads)
            .flat_map(|g| {
                pieces.iter().map(move |&(start, end, run)| {
                    let keys = KeyRange {
                        slots,
                        block_size: bs,
                        kv_heads: geo.kv_heads,
                        g,
                        start,
                        end,
                        trace: false,
                    };
                    (keys, run)
                })
            })
            .collect();
        let states: Vec<Partial> = run_units(&units, geo.threads(params), |(keys, run)| match run
            .and_then(|r| moved[r].as_ref())
        {
            None => base.partial(keys),
            Some((prepared, bias)) => {
                let mut p = prepared.partial(keys);
                for j in 0..group {
                    p.max[j] += bias[keys.g * group + j];
                }
                p
            }
        });
        for (g, per_piece) in states.chunks(pieces.len().max(1)).enumerate() {
            if let Some(mut total) = merged(per_piece) {
                finish_heads(&mut total, vc, g, d, out);
            }
        }
        Ok(())
    }
}

/// `0..tokens` cut at the runs' edges: `(start, end, the run's index)`, in order; runs must be
/// ordered, disjoint, within `tokens`, non-empty and on block boundaries.
fn pieces(
    runs: &[Relocated],
    tokens: usize,
    bs: usize,
) -> KvResult<Vec<(usize, usize, Option<usize>)>> {
    let mut out = Vec::new();
    let mut at = 0;
    for (run, r) in runs.iter().enumerate() {
        let bad = |reason| KvError::BadRelocation {
            run,
            start: r.start,
            end: r.end,
            reason,
        };
        if r.start >= r.end {
            return Err(bad("is empty"));
        }
        if r.start < at {
            return Err(bad("overlaps or precedes the run before"));
        }
        if r.end > tokens {
            return Err(bad("ends past the sequence"));
        }
        if r.start % bs != 0 || (r.end % bs != 0 && r.end != tokens) {
            return Err(bad("is not on block boundaries"));
        }
        if r.start > at {
            out.push((at, r.start, None));
        }
        // A run with no shift reads as the rest.
        out.push((r.start, r.end, (r.shift != 0).then_some(run)));
        at = r.end;
    }
    if at < tokens {
        out.push((at, tokens, None));
    }
    Ok(out)
}
