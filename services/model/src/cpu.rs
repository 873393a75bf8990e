//! The CPU forward pass on plain row-major `f32` buffers: RMSNorm, the projections (block
//! kernels or dense), RoPE, KV write and attention over the codes, SwiGLU and the residuals, with
//! no tensor per operation. Only the dense fallbacks (safetensors weights, the dense attention of
//! codecs without a tiled kernel) go through candle.

use std::sync::Mutex;

use super::{KvTransform, Llama, SeqInput, dense_attention};
use crate::arch::Activation;
use crate::error::ModelResult;
use crate::held::block_product as matmul;
use candle_core::{Device, Tensor};
use engram_kvcore::{AttentionParams, BlockStore, Isa, Rows};

/// Weight of a decode step's attention mass in a block's decayed average.
pub const MASS_WEIGHT: f32 = 0.1;

/// A block counts as attended in a step (its `mass_at`) when it gets at least this share of
/// a uniform split of the step's mass over the sequence's blocks.
pub const MASS_SHARE: f32 = 0.5;

/// Elements below which an elementwise pass stays on the calling thread.
const PAR_MIN: usize = 1 << 16;

/// `x[r] · w / rms(x[r])` per row of `x: [rows, w.len()]`.
fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let h = w.len();
    let mut out = vec![0f32; x.len()];
    for (o, x) in out.chunks_exact_mut(h).zip(x.chunks_exact(h)) {
        let ss: f32 = x.iter().map(|v| v * v).sum();
        let r = 1.0 / (ss / h as f32 + eps).sqrt();
        for ((o, x), w) in o.iter_mut().zip(x).zip(w) {
            *o = x * r * w;
        }
    }
    out
}

/// Half-split RoPE in place on `x: [rows, heads, d]`, row `i` at the angles `cos[i]`, `sin[i]`
/// (`d / 2` each).
fn rope(x: &mut [f32], heads: usize, d: usize, cos: &[f32], sin: &[f32]) {
    let half = d / 2;
    for (i, row) in x.chunks_exact_mut(heads * d).enumerate() {
        let (c, s) = (
            &cos[i * half..(i + 1) * half],
            &sin[i * half..(i + 1) * half],
        );
        for head in row.chunks_exact_mut(d) {
            let (a, b) = head.split_at_mut(half);
            for j in 0..half {
                let (x0, x1) = (a[j], b[j]);
                a[j] = x0 * c[j] - x1 * s[j];
                b[j] = x0 * s[j] + x1 * c[j];
            }
        }
    }
}

/// Keys `[rows, kv_heads, d]` divided by the layer's key scales `[kv_heads, d]`, queries
/// `[rows, heads, d]` multiplied by their KV head's: every score is unchanged.
fn scale_keys_and_queries(
    k: &mut [f32],
    q: &mut [f32],
    scales: &[f32],
    heads: usize,
    kv_heads: usize,
    d: usize,
) {
    for row in k.chunks_exact_mut(kv_heads * d) {
        row.iter_mut().zip(scales).for_each(|(x, s)| *x /= s);
    }
    let group = (heads / kv_heads.max(1)).max(1);
    for row in q.chunks_exact_mut(heads * d) {
        for (h, qh) in row.chunks_exact_mut(d).enumerate() {
            let s = &scales[(h / group) * d..][..d];
            qh.iter_mut().zip(s).for_each(|(x, s)| *x *= s);
        }
    }
}

/// `gate ← silu(gate) · up`, on up to `threads` threads above [`PAR_MIN`] elements (each element
/// is computed alike on any thread).
#[cfg(test)]
fn swiglu(gate: &mut [f32], up: &[f32], threads: usize) {
    gated(gate, up, threads, Activation::Silu);
}

/// GELU, tanh approximation: `x/2 · (1 + tanh(√(2/π) · x · (1 + 0.044715 x²)))`.
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_TWO_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_TWO_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
}

/// `gate ← act(gate) · up` (see [`swiglu`]).
fn gated(gate: &mut [f32], up: &[f32], threads: usize, act: Activation) {
    let f = move |(g, u): (&mut f32, &f32)| {
        *g = match act {
            Activation::Silu => *g / (1.0 + (-*g).exp()) * u,
            Activation::GeluTanh => gelu_tanh(*g) * u,
        }
    };
    if gate.len() < PAR_MIN || threads < 2 {
        gate.iter_mut().zip(up).for_each(f);
        return;
    }
    let share = gate.len().div_ceil(threads);
    let parts: Vec<Mutex<&mut [f32]>> = gate.chunks_mut(share).map(Mutex::new).collect();
    engram_kvcore::team::run(parts.len(), &|i| {
        let mut g = parts[i].lock().unwrap_or_else(|e| e.into_inner());
        g.iter_mut().zip(&up[i * share..]).for_each(f);
    });
}

/// Folds one step's per-block attention `mass` into the blocks' metadata (decayed average,
/// reads above half a uniform share).
pub(super) fn fold_mass(
    store: &mut BlockStore,
    blocks: &[engram_kvcore::BlockId],
    mass: &[f32],
) -> ModelResult<()> {
    let threshold = MASS_SHARE / blocks.len() as f32;
    store.record_mass(blocks, mass, MASS_WEIGHT, threshold)?;
    Ok(())
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
}

/// Adds `bias` to every row of `x: [rows, bias.len()]`.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add(row, bias);
    }
}

/// Causal attention over a sliding window: query row `r` (position `start + r`) sees the
/// `window` positions ending at its own. Reads only the positions the chunk's rows see, decoded
/// once, and attends densely with the window's mask. Returns `[new, heads·d]`.
#[allow(clippy::too_many_arguments)]
fn window_attention(
    store: &BlockStore,
    l: usize,
    blocks: &[engram_kvcore::BlockId],
    start: usize,
    qs: &[f32],
    window: usize,
    cfg: &crate::weights::ModelConfig,
) -> ModelResult<Vec<f32>> {
    let (heads, kv_heads, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let new = qs.len() / (heads * d);
    let total = start + new;
    let lo = (start + 1).saturating_sub(window);
    let n = total - lo;
    let (mut kb, mut vb) = (vec![0f32; n * kv_heads * d], vec![0f32; n * kv_heads * d]);
    store.read(l, blocks, lo, &mut kb, &mut vb)?;
    let dev = Device::Cpu;
    let mut mask = vec![f32::NEG_INFINITY; new * n];
    for r in 0..new {
        let p = start + r;
        let first = (p + 1).saturating_sub(window).max(lo);
        mask[r * n + (first - lo)..r * n + (p - lo) + 1].fill(0.0);
    }
    let mask = Some(Tensor::from_vec(mask, (new, n), &dev)?);
    let k = Tensor::from_vec(kb, (n, kv_heads, d), &dev)?;
    let v = Tensor::from_vec(vb, (n, kv_heads, d), &dev)?;
    let q = Tensor::from_slice(qs, (new, heads, d), &dev)?;
    let out = super::attend_rows(&k, &v, &q, &mask, cfg)?;
    Ok(out.flatten_all()?.to_vec1()?)
}

impl Llama {
    /// In the middle layer, the attention mass a prompt chunk's last row gives each block
    /// (prefill contributes from its last rows only), folded into the blocks' metadata — one
    /// more pass over one layer's keys for that row. Decode steps take theirs from the
    /// attention kernels' own states instead ([`BlockStore::attend_with_mass`]).
    fn sample_mass(
        &self,
        store: &mut BlockStore,
        l: usize,
        blocks: &[engram_kvcore::BlockId],
        total: usize,
        q: &[f32],
        params: &AttentionParams,
    ) -> ModelResult<()> {
        if !self.samples_mass(l, blocks) {
            return Ok(());
        }
        let mass = store.attention_mass(l, blocks, total, q, params)?;
        fold_mass(store, blocks, &mass)
    }

    /// Causal attention of a sequence with relocated runs, one query row at a time: row `r`
    /// (position `s.start + r`) reads the positions up to its own (`check_batch` holds the
    /// runs to positions before `s.start`, so every row reads them whole).
    #[allow(clippy::too_many_arguments)]
    fn attend_relocated(
        &self,
        store: &BlockStore,
        l: usize,
        s: &SeqInput<'_>,
        key_mean: Option<&[f32]>,
        qs: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> ModelResult<()> {
        let width = self.config.num_heads * self.config.head_dim;
        let bs = store.shape().block_size;
        let rope = engram_kvcore::Rope {
            theta: self.config.rope_theta,
        };
        let relocation = engram_kvcore::Relocation {
            runs: s.relocated,
            rope,
            key_mean,
        };
        let rows = qs.len() / width;
        let parts = params.threads.clamp(1, rows.max(1));
        if parts < 2 {
            for (r, (q, o)) in qs
                .chunks_exact(width)
                .zip(out.chunks_exact_mut(width))
                .enumerate()
            {
                let total = s.start + r + 1;
                let blocks = &s.blocks[..total.div_ceil(bs)];
                store.attend_relocated(l, blocks, total, q, &relocation, params, o)?;
            }
            return Ok(());
        }
        // A prompt chunk: its rows on the threads, each row on one (a row's key pieces are
        // too small to split well).
        let single = params.with_threads(1);
        let share = rows.div_ceil(parts);
        let outs: Vec<std::sync::Mutex<&mut [f32]>> = out
            .chunks_mut(share * width)
            .map(std::sync::Mutex::new)
            .collect();
        let failed = std::sync::Mutex::new(None);
        engram_kvcore::team::run(outs.len(), &|p| {
            let mut o = outs[p].lock().unwrap_or_else(|e| e.into_inner());
            for (k, o) in o.chunks_exact_mut(width).enumerate() {
                let r = p * share + k;
                let total = s.start + r + 1;
                let blocks = &s.blocks[..total.div_ceil(bs)];
                let q = &qs[r * width..(r + 1) * width];
                if let Err(e) = store.attend_relocated(l, blocks, total, q, &relocation, &single, o)
                {
                    *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                }
            }
        });
        match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Whether layer `l` samples the attention mass over `blocks`: the middle layer, or where
    /// the middle is a window layer, the first global layer after it (one that sees every
    /// block).
    fn samples_mass(&self, l: usize, blocks: &[engram_kvcore::BlockId]) -> bool {
        let middle = self.layers.len() / 2;
        let layer = (middle..self.layers.len())
            .chain(0..middle)
            .find(|&i| self.layers[i].extra.window.is_none())
            .unwrap_or(middle);
        l == layer && !blocks.is_empty()
    }

    /// The CPU layers for a validated batch: `ids` and `positions` of its concatenated new
    /// tokens. Returns the logits of the rows the batch asks for.
    pub(super) fn forward_cpu_layers(
        &self,
        store: &mut BlockStore,
        batch: &[SeqInput<'_>],
        transform: KvTransform<'_>,
        ids: Vec<u32>,
        positions: Vec<u32>,
    ) -> ModelResult<Tensor> {
        let cfg = &self.config;
        let (heads, kv_heads, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let (hidden, half) = (cfg.hidden_size, d / 2);
        let bs = store.shape().block_size;
        let n = ids.len();
        let dev = Device::Cpu;
        let t = self.threads;
        let eps = cfg.rms_eps as f32;
        let pos_list: Vec<usize> = positions.iter().map(|&p| p as usize).collect();
        // The RoPE angles of the batch's positions, as the model's tables hold them.
        let pos = Tensor::from_vec(positions, n, &dev)?;
        let angles = |table: &Tensor| -> ModelResult<Vec<f32>> {
            Ok(table.index_select(&pos, 0)?.flatten_all()?.to_vec1()?)
        };
        let (cos, sin) = (angles(&self.cos)?, angles(&self.sin)?);
        // The window layers' own RoPE base (Gemma 3).
        let local = match &self.local_rope {
            Some((c, s)) => Some((angles(c)?, angles(s)?)),
            None => None,
        };
        let params = AttentionParams::new(heads, d).with_threads(t);
        let mut x: Vec<f32> = self.embed.lookup(&ids)?;
        if self.arch.embed_scale {
            let scale = (hidden as f64).sqrt() as f32;
            x.iter_mut().for_each(|v| *v *= scale);
        }
        debug_assert_eq!(cos.len(), n * half);

        for (l, layer) in self.layers.iter().enumerate() {
            let extra = &layer.extra;
            let norm: Vec<f32> = layer.attn_norm.to_vec1()?;
            let h = rms_norm(&x, &norm, eps);
            let stacked = self.stacked.get(l).and_then(Option::as_ref);
            let (mut q, mut k, mut v) = match stacked {
                Some(s) => {
                    let (qw, kw) = (heads * d, kv_heads * d);
                    let y = matmul(&s.qkv, &h, n, t)?;
                    let part = |a: usize, w: usize| -> Vec<f32> {
                        y.chunks_exact(qw + 2 * kw)
                            .flat_map(|r| r[a..a + w].iter().copied())
                            .collect()
                    };
                    (part(0, qw), part(qw, kw), part(qw + kw, kw))
                }
                None => (
                    layer.wq.apply(&h, n, t)?,
                    layer.wk.apply(&h, n, t)?,
                    layer.wv.apply(&h, n, t)?,
                ),
            };
            if let Some([bq, bk, bv]) = &extra.qkv_bias {
                add_rows(&mut q, bq);
                add_rows(&mut k, bk);
                add_rows(&mut v, bv);
            }
            if let Some([qn, kn]) = &extra.qk_norm {
                q = rms_norm(&q, qn, eps);
                k = rms_norm(&k, kn, eps);
            }
            let (c, sn) = match (&local, extra.window) {
                (Some((c, s)), Some(_)) => (c, s),
                _ => (&cos, &sin),
            };
            rope(&mut q, heads, d, c, sn);
            rope(&mut k, kv_heads, d, c, sn);
            if let Some(p) = transform.probe {
                p.queries(l, &pos_list, &q)?;
            }
            if let Some(means) = transform.key_means {
                let m = &means[l * kv_heads * d..(l + 1) * kv_heads * d];
                for row in k.chunks_exact_mut(kv_heads * d) {
                    row.iter_mut().zip(m).for_each(|(x, c)| *x -= c);
                }
            }
            let scales = transform
                .key_scales
                .map(|s| &s[l * kv_heads * d..(l + 1) * kv_heads * d]);
            if let Some(s) = scales {
                scale_keys_and_queries(&mut k, &mut q, s, heads, kv_heads, d);
            }
            if let Some(p) = transform.probe {
                p.apply(l, &pos_list, d, &mut k, &mut v)?;
            }
            let width = kv_heads * d;
            let mut off = 0;
            for s in batch {
                let r = off * width..(off + s.tokens.len()) * width;
                store.write(
                    l,
                    s.blocks,
                    s.start,
                    Rows::F32(&k[r.clone()]),
                    Rows::F32(&v[r]),
                )?;
                off += s.tokens.len();
            }
            let mut attn = vec![0f32; n * heads * d];
            let mut off = 0;
            for s in batch {
                let m = s.tokens.len();
                let total = s.start + m;
                let blocks = &s.blocks[..total.div_ceil(bs)];
                let qs = &q[off * heads * d..(off + m) * heads * d];
                let o = &mut attn[off * heads * d..(off + m) * heads * d];
                if let Some(w) = extra.window.filter(|&w| total > w) {
                    // Past the window, a window layer reads only the positions its rows see.
                    o.copy_from_slice(&window_attention(store, l, blocks, s.start, qs, w, cfg)?);
                } else if !s.relocated.is_empty() {
                    // Relocated runs (issue 26): row by row, each run read with the query
                    // turned back by its shift and the key-mean correction.
                    // With key scales the stored mean is the mean over the scales (the
                    // queries carry the scales).
                    let mean = transform.key_means.map(|m| {
                        let m = &m[l * kv_heads * d..(l + 1) * kv_heads * d];
                        match scales {
                            Some(sc) => m.iter().zip(sc).map(|(m, s)| m / s).collect(),
                            None => m.to_vec(),
                        }
                    });
                    self.attend_relocated(store, l, s, mean.as_deref(), qs, &params, o)?;
                } else if m == 1 && !s.prompt && self.samples_mass(l, blocks) {
                    // A decode step's mass comes from the attention kernels' own per-block
                    // softmax states: no second pass over the keys.
                    let mass = store.attend_with_mass(l, blocks, total, qs, &params, o)?;
                    fold_mass(store, blocks, &mass)?;
                } else if m == 1 && !s.prompt {
                    store.attend(l, blocks, total, qs, &params, o)?;
                } else if store.causal_is_fast(Isa::active(), l, heads) {
                    // Tiles of query rows share each key tile (read from the codes, or from
                    // the prefix decoded once): no score-sized tensors, no mask, and a row's
                    // bits do not depend on the chunk it comes in.
                    store.attend_causal(l, blocks, s.start, m, qs, &params, o)?;
                    if s.prompt {
                        let last = &qs[(m - 1) * heads * d..];
                        self.sample_mass(store, l, blocks, total, last, &params)?;
                    }
                } else {
                    let mask = super::causal_mask(s.start, m)?;
                    let q_seq = Tensor::from_slice(qs, (m, heads, d), &dev)?;
                    let out = dense_attention(store, l, blocks, total, &q_seq, &mask, cfg)?;
                    o.copy_from_slice(&out.flatten_all()?.to_vec1::<f32>()?);
                    if s.prompt {
                        let last = &qs[(m - 1) * heads * d..];
                        self.sample_mass(store, l, blocks, total, last, &params)?;
                    }
                }
                off += m;
            }
            let mut o = layer.wo.apply(&attn, n, t)?;
            if let Some([post_attn, _]) = &extra.post_norms {
                o = rms_norm(&o, post_attn, eps);
            }
            add(&mut x, &o);
            let norm: Vec<f32> = layer.ffn_norm.to_vec1()?;
            let h = rms_norm(&x, &norm, eps);
            let ff = cfg.intermediate_size;
            let gate = match stacked {
                Some(s) => {
                    let y = matmul(&s.gate_up, &h, n, t)?;
                    let mut gate = Vec::with_capacity(n * ff);
                    let mut up = Vec::with_capacity(n * ff);
                    for r in y.chunks_exact(2 * ff) {
                        gate.extend_from_slice(&r[..ff]);
                        up.extend_from_slice(&r[ff..]);
                    }
                    gated(&mut gate, &up, t, self.arch.activation);
                    gate
                }
                None => {
                    let mut gate = layer.w_gate.apply(&h, n, t)?;
                    gated(
                        &mut gate,
                        &layer.w_up.apply(&h, n, t)?,
                        t,
                        self.arch.activation,
                    );
                    gate
                }
            };
            let mut down = layer.w_down.apply(&gate, n, t)?;
            if let Some([_, post_ffn]) = &extra.post_norms {
                down = rms_norm(&down, post_ffn, eps);
            }
            add(&mut x, &down);
        }
        let rows = Self::logit_rows(batch);
        let mut last = Vec::with_capacity(rows.len() * hidden);
        for &r in &rows {
            let r = r as usize;
            last.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
        let norm: Vec<f32> = self.norm.to_vec1()?;
        let h = rms_norm(&last, &norm, eps);
        let logits = self.lm_head.apply(&h, rows.len(), t)?;
        Ok(Tensor::from_vec(
            logits,
            (rows.len(), cfg.vocab_size),
            &dev,
        )?)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn floats(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) as f32 / u32::MAX as f32 - 0.5)
            .collect()
    }

    #[test]
    fn rope_and_rms_norm_match_candle() {
        let (rows, heads, d) = (5, 3, 8);
        let x = floats(rows * heads * d, 7);
        let angles: Vec<f32> = floats(rows * d / 2, 3).iter().map(|a| a * 6.0).collect();
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let dev = Device::Cpu;
        let t = |v: &[f32], s: (usize, usize)| Tensor::from_slice(v, s, &dev).unwrap();
        // candle's half-split rotation over `[1, heads, rows, d]`, back to `[rows, heads, d]`.
        let xt = t(&x, (rows, heads * d))
            .reshape((1, rows, heads, d))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap();
        let want: Vec<f32> =
            candle_nn::rotary_emb::rope(&xt, &t(&cos, (rows, d / 2)), &t(&sin, (rows, d / 2)))
                .unwrap()
                .squeeze(0)
                .unwrap()
                .transpose(0, 1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
        let mut ours = x.clone();
        rope(&mut ours, heads, d, &cos, &sin);
        for (a, b) in ours.iter().zip(&want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }

        let w = floats(heads * d, 9);
        let want: Vec<f32> = candle_nn::ops::rms_norm(
            &t(&x, (rows, heads * d)),
            &Tensor::from_slice(&w, heads * d, &dev).unwrap(),
            1e-5,
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
        for (a, b) in rms_norm(&x, &w, 1e-5).iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn swiglu_is_silu_of_the_gate_times_up_on_both_sides_of_the_split() {
        for n in [10, PAR_MIN + 10] {
            let (mut g, u) = (floats(n, 1), floats(n, 2));
            let want: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            swiglu(&mut g, &u, 2);
            assert_eq!(g, want);
        }
    }

    #[test]
    fn a_window_layer_sees_exactly_the_window_ending_at_each_row() {
        use engram_kvcore::{BlockTags, CodecKind, KvShape, StoreConfig, Tier};
        let (heads, d, bs, window) = (2, 8, 4, 5);
        let shape = KvShape::with_block_size(1, 1, d, bs).unwrap();
        let total = 20;
        let mut store = BlockStore::new(StoreConfig::new(
            shape,
            CodecKind::F32,
            (total / bs) as u32,
            0,
        ))
        .unwrap();
        let tags = BlockTags {
            source: engram_kvcore::SourceLayer::SystemState,
            importance: 0.0,
            tenant: engram_kvcore::TenantId(0),
            session: None,
            tokens: engram_kvcore::TokenRange::new(0, bs as u32),
        };
        let blocks = store.allocate(Tier::Hot, &vec![tags; total / bs]).unwrap();
        let (k, v) = (floats(total * d, 21), floats(total * d, 22));
        store
            .write(0, &blocks, 0, Rows::F32(&k), Rows::F32(&v))
            .unwrap();
        let mut cfg = crate::weights::ModelConfig::smollm2_135m();
        (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) = (heads, 1, d);
        // Rows at positions 12..20 (a chunk), then one decode row at 19.
        for (start, new) in [(12, 8), (19, 1), (2, 3)] {
            let q = floats(new * heads * d, 23 + start as u32);
            let ours = window_attention(&store, 0, &blocks, start, &q, window, &cfg).unwrap();
            for r in 0..new {
                let p = start + r;
                let seen = p.saturating_sub(window - 1)..=p;
                for h in 0..heads {
                    let q = &q[(r * heads + h) * d..][..d];
                    let scores: Vec<f64> = seen
                        .clone()
                        .map(|j| {
                            let kj = &k[j * d..][..d];
                            q.iter().zip(kj).map(|(a, b)| f64::from(a * b)).sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let max = scores.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                    let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = w.iter().sum();
                    for c in 0..d {
                        let want: f64 = seen
                            .clone()
                            .zip(&w)
                            .map(|(j, w)| w / sum * f64::from(v[j * d + c]))
                            .sum();
                        let got = f64::from(ours[(r * heads + h) * d + c]);
                        assert!(
                            (got - want).abs() < 1e-5,
                            "row {p} head {h}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn gelu_tanh_is_candles() {
        let x: Vec<f32> = floats(64, 31).iter().map(|v| v * 8.0).collect();
        let want: Vec<f32> = Tensor::from_slice(&x, 64, &Device::Cpu)
            .unwrap()
            .gelu()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (a, b) in x.iter().map(|&v| gelu_tanh(v)).zip(want) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    /// The CUDA glue is checked on the GPU against `engram_kernels::glue`; this pins those
    /// references to the CPU engine's own RoPE (bitwise, key centering included), SwiGLU
    /// (bitwise) and RMSNorm.
    #[test]
    fn the_cuda_glue_references_are_this_engines_arithmetic() {
        use engram_kernels::glue;
        let (rows, heads, d) = (4, 3, 16);
        let x = floats(rows * heads * d, 11);
        let angles: Vec<f32> = floats(rows * d / 2, 5).iter().map(|a| a * 6.0).collect();
        let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
        let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
        let mean = floats(heads * d, 13);
        let mut ours = x.clone();
        rope(&mut ours, heads, d, &cos, &sin);
        for row in ours.chunks_exact_mut(heads * d) {
            row.iter_mut().zip(&mean).for_each(|(v, m)| *v -= m);
        }
        let mut theirs = x.clone();
        for (r, row) in theirs.chunks_exact_mut(heads * d).enumerate() {
            let (c, s) = (&cos[r * d / 2..][..d / 2], &sin[r * d / 2..][..d / 2]);
            for (h, head) in row.chunks_exact_mut(d).enumerate() {
                glue::rope_half(head, c, s, Some(&mean[h * d..][..d]));
            }
        }
        assert_eq!(
            ours.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            theirs.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );

        let (mut g, u) = (floats(64, 1), floats(64, 2));
        let gu: Vec<f32> = g.iter().chain(&u).copied().collect();
        swiglu(&mut g, &u, 1);
        assert_eq!(g, glue::swiglu(&gu, 64));

        let w = floats(heads * d, 9);
        let mut xr = x.clone();
        let theirs = glue::add_rms_norm(&mut xr, heads * d, None, Some(&w), 1e-5).unwrap();
        for (a, b) in rms_norm(&x, &w, 1e-5).iter().zip(&theirs) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
        }
    }
}
