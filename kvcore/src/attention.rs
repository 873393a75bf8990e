//! Single-query attention over a list of blocks, read straight from the packed codes.
//!
//! Per query head `h` (KV head `g = h / (heads / kv_heads)`, grouped-query attention):
//! 1. the query is prepared once: `q' = Πq` (TurboQuant; F16/Q8 use `q` as is);
//! 2. each key's score is `scale · ‖k‖ · ⟨q', codebook[idx_k]⟩` — no key is ever decoded;
//! 3. softmax is online, one rescale per block: running max `m`, normalizer `l` and
//!    accumulator are corrected by `exp(m_old − m_new)` when a block raises the max;
//! 4. values are summed in the rotated space, `Σ p_i · ‖v_i‖ · codebook[idx_v,i]`, and the sum is
//!    rotated back once (`Πᵀ`) at the end.
//!
//! Cost per query head: O(tokens · head_dim) code reads and multiply-adds, plus two rotations of
//! O(d log d); the dequantize-then-attend reference pays one inverse rotation per key and value.
//! [`attend_dense`] is the plain f32/f64 reference the codes path and the CUDA kernel are
//! checked against.

use std::sync::Mutex;

use crate::block::BlockId;
use crate::block::Tier;
use crate::codec::{Codec, CodecKind, dot};
use crate::error::{KvError, KvResult};
use crate::simd::{CodesJob, Isa, KeyRange, Partial, Tq4Rows, tq4_attend, tq4_supports};
use crate::store::BlockStore;
use crate::store::host::LayerBytes;

/// Query geometry and softmax scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Query heads (a positive multiple of the KV heads).
    pub num_heads: usize,
    /// Score scale, usually `1/√head_dim`.
    pub scale: f32,
    /// Threads a long key range is split over (1: the calling thread only). The split, not
    /// the scheduling, decides the summation order, so a result is the same for a given value.
    pub threads: usize,
}

impl AttentionParams {
    /// `num_heads` query heads with the standard scale `1/√head_dim`, on one thread.
    pub fn new(num_heads: usize, head_dim: usize) -> Self {
        Self {
            num_heads,
            scale: 1.0 / (head_dim as f32).sqrt(),
            threads: 1,
        }
    }

    /// The same, split over `threads` threads (at least 1).
    pub fn with_threads(self, threads: usize) -> Self {
        Self {
            threads: threads.max(1),
            ..self
        }
    }
}

/// Query rows one unit of [`BlockStore::attend_causal`]'s tiled kernel takes: they share each
/// key's expansion.
const CAUSAL_ROWS: usize = 16;

/// Keys each thread takes at least before a range is split ([`AttentionParams::threads`]):
/// below it, waking a second thread costs more than it saves (measured with
/// `make bench-attention`: at 1K keys a split is slower, at 4K 1.4× faster on two cores).
pub const MIN_KEYS_PER_THREAD: usize = 1024;

/// Geometry of one attention call, validated.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) block_size: usize,
    pub(crate) tokens: usize,
}

impl Geometry {
    pub(crate) fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Threads a decode pass over these keys takes (none shorter than
    /// [`MIN_KEYS_PER_THREAD`] keys, at most `params.threads`).
    pub(crate) fn threads(&self, params: &AttentionParams) -> usize {
        (self.tokens / MIN_KEYS_PER_THREAD).clamp(1, params.threads.max(1))
    }
}

impl BlockStore {
    /// Attention of one query token (`q`: `[num_heads, head_dim]`) over the first `num_tokens`
    /// positions of the hot blocks `blocks` of `layer`, read from the codes; writes `out`
    /// (`[num_heads, head_dim]`). `blocks` must be exactly `⌈num_tokens / block_size⌉` long.
    pub fn attend(
        &self,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<()> {
        self.attend_on(Isa::active(), layer, blocks, num_tokens, q, params, out)
    }

    /// [`Self::attend`] on the kernels of `isa` (lowered to what this CPU runs; the scalar path
    /// for what `isa`'s kernels do not cover): the SIMD paths are tested against the scalar one
    /// through this.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_on(
        &self,
        isa: Isa,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<()> {
        let (geo, slots, bytes) = self.hot_read(layer, blocks, num_tokens, q, params)?;
        check_len(out.len(), geo.heads * geo.head_dim)?;
        let (kc, vc) = self.layer_codecs(layer);
        attend_codes(
            kc,
            vc,
            &bytes,
            &slots,
            geo,
            q,
            params,
            isa.min(Isa::detected()),
            out,
            false,
        );
        Ok(())
    }

    /// The softmax mass one query token (`q`, as in [`Self::attend`]) gives each of the hot
    /// `blocks` of `layer` over its first `num_tokens` positions: per block, the share of the
    /// attention probability its positions receive, averaged over the query heads — the masses
    /// sum to 1. Computed block by block with the decode kernels of [`Self::attend`].
    pub fn attention_mass(
        &self,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        params: &AttentionParams,
    ) -> KvResult<Vec<f32>> {
        self.attention_mass_on(Isa::active(), layer, blocks, num_tokens, q, params)
    }

    /// [`Self::attention_mass`] on the kernels of `isa` (see [`Self::attend_on`]).
    pub fn attention_mass_on(
        &self,
        isa: Isa,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        params: &AttentionParams,
    ) -> KvResult<Vec<f32>> {
        let (geo, slots, bytes) = self.hot_read(layer, blocks, num_tokens, q, params)?;
        let codecs = self.layer_codecs(layer);
        let prepared = Prepared::new(codecs, &bytes, geo, q, params, isa.min(Isa::detected()));
        Ok(block_mass(&prepared, &slots, geo))
    }

    /// [`Self::attend`] and [`Self::attention_mass`] in one pass over the keys: the decode
    /// kernels run exactly as for [`Self::attend`] (`out` is its bits) and record, per softmax
    /// tile of 16 keys, the running max and what the tile added to the normalizer; a block's
    /// mass is its tiles' shares carried to the final max. The masses equal
    /// [`Self::attention_mass`]'s up to rounding. With a block size the 16-key tiles straddle
    /// (not a multiple of 16), the mass takes a second pass.
    pub fn attend_with_mass(
        &self,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<Vec<f32>> {
        self.attend_with_mass_on(Isa::active(), layer, blocks, num_tokens, q, params, out)
    }

    /// [`Self::attend_with_mass`] on the kernels of `isa` (see [`Self::attend_on`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_with_mass_on(
        &self,
        isa: Isa,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<Vec<f32>> {
        let (geo, slots, bytes) = self.hot_read(layer, blocks, num_tokens, q, params)?;
        check_len(out.len(), geo.heads * geo.head_dim)?;
        let (kc, vc) = self.layer_codecs(layer);
        let isa = isa.min(Isa::detected());
        if geo.block_size % crate::simd::SIMD_TILE == 0 {
            return Ok(attend_codes(
                kc, vc, &bytes, &slots, geo, q, params, isa, out, true,
            ));
        }
        // Blocks the SIMD kernels' 16-key tiles straddle: the mass in a second pass.
        attend_codes(kc, vc, &bytes, &slots, geo, q, params, isa, out, false);
        let prepared = Prepared::new((kc, vc), &bytes, geo, q, params, isa);
        Ok(block_mass(&prepared, &slots, geo))
    }

    /// Causal attention of `new` query tokens at positions `start..start + new` (`q`:
    /// `[new, num_heads, head_dim]`) over the hot `blocks` of `layer`, read from the codes: row
    /// `r` attends positions `0..=start + r`. Writes `out` (`[new, num_heads, head_dim]`).
    /// `blocks` must be exactly `⌈(start + new) / block_size⌉` long.
    ///
    /// Where [`Self::causal_is_tiled`] holds, a tile of rows shares each key's expansion;
    /// otherwise, for the head dims [`Self::causal_is_fast`] names, the prefix is decoded once
    /// and tiles of rows share each decoded key tile, each row's bits independent of the other
    /// rows of the call; otherwise each row runs [`Self::attend`]'s path. Row `r` equals
    /// [`Self::attend`] over `start + r + 1` tokens up to summation order.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_causal(
        &self,
        layer: usize,
        blocks: &[BlockId],
        start: usize,
        new: usize,
        q: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<()> {
        self.attend_causal_on(Isa::active(), layer, blocks, start, new, q, params, out)
    }

    /// Whether [`Self::attend_causal`] runs a tiled kernel over the codes for `layer` on `isa`
    /// (AVX-512: the 4-bit TurboQuant kernel for TQ4 keys and values, one that expands each
    /// stream by its own codec for any other pair): the case where it beats dequantizing the
    /// prefix for a dense attention.
    pub fn causal_is_tiled(&self, isa: Isa, layer: usize, num_heads: usize) -> bool {
        let shape = self.shape();
        layer < shape.layers
            && num_heads.is_multiple_of(shape.kv_heads.max(1))
            && crate::simd::tq4_causal_supports(
                isa,
                shape.head_dim,
                num_heads / shape.kv_heads.max(1),
            )
    }

    /// Whether [`Self::attend_causal`] runs a tiled kernel for `layer` on `isa`: over the codes
    /// ([`Self::causal_is_tiled`]) or over the prefix decoded once (the head dims
    /// [`crate::dense`] is compiled for). Otherwise it attends row by row.
    pub fn causal_is_fast(&self, isa: Isa, layer: usize, num_heads: usize) -> bool {
        self.causal_is_tiled(isa, layer, num_heads) || crate::dense::supports(self.shape().head_dim)
    }

    /// [`Self::attend_causal`] on the kernels of `isa` (lowered to what this CPU runs).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_causal_on(
        &self,
        isa: Isa,
        layer: usize,
        blocks: &[BlockId],
        start: usize,
        new: usize,
        q: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<()> {
        let isa = isa.min(Isa::detected());
        let width = params.num_heads * self.shape().head_dim;
        check_len(q.len(), new * width)?;
        check_len(out.len(), new * width)?;
        if new == 0 {
            return Ok(());
        }
        let total = start + new;
        let (geo, slots, bytes) = self.hot_read(layer, blocks, total, &q[..width], params)?;
        let (kc, vc) = self.layer_codecs(layer);
        let (d, group, bs) = (geo.head_dim, geo.group(), geo.block_size);
        if !crate::simd::tq4_causal_supports(isa, d, group) {
            if crate::dense::supports(d) {
                return self
                    .attend_causal_decoded(isa, layer, blocks, geo, start, new, q, params, out);
            }
            // Row by row: each row is a decode over its own prefix.
            for r in 0..new {
                let n = start + r + 1;
                let row_geo = Geometry { tokens: n, ..geo };
                attend_codes(
                    kc,
                    vc,
                    &bytes,
                    &slots[..n.div_ceil(bs)],
                    row_geo,
                    &q[r * width..][..width],
                    params,
                    isa,
                    &mut out[r * width..][..width],
                    false,
                );
            }
            return Ok(());
        }
        // TQ4 keys and values take the 4-bit kernel (codebook in a register); any other pair
        // the kernel that expands each stream by its own codec.
        let rows = tq4_codebook((kc, vc)).map(|cb| tq4_rows(cb, &bytes));
        // Units: (KV head, tile of query rows), each wholly on one thread: it rotates its
        // queries (scale folded in), runs the kernel, and rotates its outputs back.
        let units: Vec<(usize, usize, usize)> = (0..geo.kv_heads)
            .flat_map(|g| {
                (0..new)
                    .step_by(CAUSAL_ROWS)
                    .map(move |r0| (g, r0, (r0 + CAUSAL_ROWS).min(new)))
            })
            .collect();
        let run = |&(g, r0, r1): &(usize, usize, usize)| -> Option<Vec<f32>> {
            // [rows][group][d]
            let mut qs = vec![0.0f32; (r1 - r0) * group * d];
            // Keys with an outlier split also score their stored-apart coordinates against the
            // unrotated queries.
            let split = kc.outliers() > 0;
            let mut q_apart = vec![0.0f32; if split { qs.len() } else { 0 }];
            for (k, r) in (r0..r1).enumerate() {
                for j in 0..group {
                    let h = g * group + j;
                    let src = &q[r * width + h * d..][..d];
                    let dst = &mut qs[(k * group + j) * d..][..d];
                    kc.prepare_query(src, dst);
                    dst.iter_mut().for_each(|x| *x *= params.scale);
                    if split {
                        let apart = &mut q_apart[(k * group + j) * d..][..d];
                        for (a, &x) in apart.iter_mut().zip(src) {
                            *a = x * params.scale;
                        }
                    }
                }
            }
            let limits: Vec<usize> = (r0..r1).map(|r| start + r + 1).collect();
            let keys = KeyRange {
                slots: &slots,
                block_size: bs,
                kv_heads: geo.kv_heads,
                g,
                start: 0,
                end: start + r1,
                trace: false,
            };
            let mut part = match &rows {
                Some(rows) => crate::simd::tq4_causal(isa, rows, &keys, &qs, &limits, group, d)?,
                None => crate::simd::codes_causal(
                    isa,
                    &crate::simd::CausalCodes {
                        codecs: (kc, vc),
                        bytes: &bytes,
                        keys: &keys,
                        q: &qs,
                        q_apart: &q_apart,
                        limits: &limits,
                        group,
                        d,
                    },
                )?,
            };
            let mut done = vec![0.0f32; (r1 - r0) * group * d];
            for (p, o) in done.chunks_exact_mut(d).enumerate() {
                let inv = 1.0 / part.sum[p];
                let acc = &mut part.acc[p * d..][..d];
                acc.iter_mut().for_each(|a| *a *= inv);
                vc.finish(acc, o);
            }
            Some(done)
        };
        let results = run_units(&units, params.threads, run);
        for (&(g, r0, r1), done) in units.iter().zip(results) {
            let Some(done) = done else {
                return Err(KvError::RowWidth {
                    expected: d,
                    got: 0,
                });
            };
            scatter_rows(&done, g, r0..r1, group * d, width, out);
        }
        Ok(())
    }

    /// [`Self::attend_causal`] over the prefix decoded once (into a scratch each thread keeps
    /// for its next call) with the tiled f32 kernel of [`crate::dense`]: a row's result does
    /// not depend on the other rows of the call.
    #[allow(clippy::too_many_arguments)]
    fn attend_causal_decoded(
        &self,
        isa: Isa,
        layer: usize,
        blocks: &[BlockId],
        geo: Geometry,
        start: usize,
        new: usize,
        q: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<()> {
        thread_local! {
            static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
                const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
        }
        let (d, group) = (geo.head_dim, geo.group());
        let total = start + new;
        let n = total * geo.kv_heads * d;
        SCRATCH.with(|cell| {
            let mut scratch = cell.borrow_mut();
            let (k, v) = &mut *scratch;
            k.resize(n, 0.0);
            v.resize(n, 0.0);
            self.read(layer, blocks, 0, &mut k[..n], &mut v[..n])?;
            let units: Vec<crate::dense::Unit<'_>> = (0..geo.kv_heads)
                .flat_map(|g| {
                    let (k, v) = (&k[..n], &v[..n]);
                    (0..new)
                        .step_by(crate::dense::ROW_TILE)
                        .map(move |r0| crate::dense::Unit {
                            k,
                            v,
                            q,
                            kv_heads: geo.kv_heads,
                            group,
                            scale: params.scale,
                            start,
                            g,
                            r0,
                            r1: (r0 + crate::dense::ROW_TILE).min(new),
                        })
                })
                .collect();
            let results = run_units(&units, params.threads, |u| crate::dense::run(isa, d, u));
            let width = params.num_heads * d;
            for (u, done) in units.iter().zip(results) {
                scatter_rows(&done, u.g, u.r0..u.r1, group * d, width, out);
            }
            Ok(())
        })
    }

    /// Pre-softmax scores `scale·⟨q_h, k̂_t⟩` of every query head against the first `num_tokens`
    /// positions, read from the codes, into `out` (`[num_heads, num_tokens]`).
    pub fn scores(
        &self,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<()> {
        let (geo, slots, bytes) = self.hot_read(layer, blocks, num_tokens, q, params)?;
        check_len(out.len(), geo.heads * num_tokens)?;
        let (codec, _) = self.layer_codecs(layer);
        let (d, bs) = (geo.head_dim, geo.block_size);
        let (cr, nr) = (bytes.k_code_row, bytes.k_norm_row);
        let (mut qp, mut row) = (vec![0.0f32; d], vec![0.0f32; d]);
        for h in 0..geo.heads {
            codec.prepare_query(&q[h * d..][..d], &mut qp);
            let g = h / geo.group();
            for (t, o) in out[h * num_tokens..][..num_tokens].iter_mut().enumerate() {
                let r = self.shape().row(slots[t / bs], t % bs, g);
                let code = &bytes.k_codes[r * cr..][..cr];
                codec.expand(code, &mut row);
                let k_scale = params.scale * codec.row_scale(&bytes.k_norms[r * nr..][..nr]);
                *o = k_scale * dot(&qp, &row)
                    + params.scale * codec.apart_dot(code, &q[h * d..][..d]);
            }
        }
        Ok(())
    }

    /// The dequantize-then-attend reference of [`Self::attend`]: decodes every key and value to
    /// f32 (inverse rotation included), then runs [`attend_dense`].
    pub fn attend_dequantized(
        &self,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        params: &AttentionParams,
        out: &mut [f32],
    ) -> KvResult<()> {
        let (geo, _, _) = self.hot_read(layer, blocks, num_tokens, q, params)?;
        check_len(out.len(), geo.heads * geo.head_dim)?;
        let n = num_tokens * geo.kv_heads * geo.head_dim;
        let (mut k, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        self.read(layer, blocks, 0, &mut k, &mut v)?;
        attend_dense(&k, &v, geo.kv_heads, q, params, out)
    }

    /// Validates a read of `num_tokens` positions of hot `blocks` by query `q`, and resolves the
    /// blocks' slots and the layer's bytes.
    pub(crate) fn hot_read(
        &self,
        layer: usize,
        blocks: &[BlockId],
        num_tokens: usize,
        q: &[f32],
        params: &AttentionParams,
    ) -> KvResult<(Geometry, Vec<u32>, LayerBytes<'_>)> {
        let shape = self.shape();
        if layer >= shape.layers {
            return Err(KvError::UnknownLayer {
                layer,
                layers: shape.layers,
            });
        }
        let geo = Geometry {
            heads: params.num_heads,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            block_size: shape.block_size,
            tokens: num_tokens,
        };
        check_heads(geo.heads, geo.kv_heads)?;
        check_len(q.len(), geo.heads * geo.head_dim)?;
        if num_tokens == 0 || blocks.len() != num_tokens.div_ceil(shape.block_size) {
            return Err(KvError::TokenRange {
                start: 0,
                end: num_tokens,
                capacity: blocks.len() * shape.block_size,
            });
        }
        let slots = self.slots_in(blocks, Tier::Hot)?;
        Ok((geo, slots, self.hot_layer(layer)?))
    }
}

/// The 4-bit codebook the SIMD kernels hold in a register, when a layer's keys and values are
/// both TurboQuant-4 (they then share the rotation and the codebook).
fn tq4_codebook<'a>((kc, vc): (&'a Codec, &Codec)) -> Option<&'a [f32; 16]> {
    let tq4 = CodecKind::TurboQuant { bits: 4 };
    if kc.kind() == tq4 && vc.kind() == tq4 {
        kc.codebook().try_into().ok()
    } else {
        None
    }
}

/// A TurboQuant-4 layer's bytes as the SIMD kernels read them (keys' and values' row widths are
/// then equal).
fn tq4_rows<'a>(codebook: &'a [f32; 16], bytes: &LayerBytes<'a>) -> Tq4Rows<'a> {
    Tq4Rows {
        codebook,
        k_codes: bytes.k_codes,
        k_norms: bytes.k_norms,
        v_codes: bytes.v_codes,
        v_norms: bytes.v_norms,
        code_row: bytes.k_code_row,
        norm_row: bytes.k_norm_row,
    }
}

/// Copies a causal unit's output (`[rows, group, d]` of KV head `g`, `span` = `group·d`) into
/// rows `rows` of `out` (`[new, heads·d]`, `width` = `heads·d`).
fn scatter_rows(
    done: &[f32],
    g: usize,
    rows: std::ops::Range<usize>,
    span: usize,
    width: usize,
    out: &mut [f32],
) {
    for (k, r) in rows.enumerate() {
        out[r * width + g * span..][..span].copy_from_slice(&done[k * span..][..span]);
    }
}

fn check_heads(heads: usize, kv_heads: usize) -> KvResult<()> {
    if heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(KvError::HeadGrouping {
            num_heads: heads,
            kv_heads,
        });
    }
    Ok(())
}

pub(crate) fn check_len(got: usize, expected: usize) -> KvResult<()> {
    if got != expected {
        return Err(KvError::RowWidth { expected, got });
    }
    Ok(())
}

/// The codes path; inputs are validated.
///
/// Per KV head, the key range is split into at most `params.threads` consecutive parts (none
/// shorter than [`MIN_KEYS_PER_THREAD`]); each (KV head, part) is one unit of work computed
/// wholly on one thread, and the parts' softmax states are merged in key order.
/// Queries prepared for one call of the codes path: rotated (`qp`), and scaled for the SIMD
/// kernels when they take this layer's codecs and geometry.
pub(crate) struct Prepared<'a> {
    kc: &'a Codec,
    vc: &'a Codec,
    bytes: &'a LayerBytes<'a>,
    q: &'a [f32],
    qp: Vec<f32>,
    scaled: Vec<f32>,
    fast: Option<&'a [f32; 16]>,
    scale: f32,
    isa: Isa,
    group: usize,
    d: usize,
}

impl<'a> Prepared<'a> {
    pub(crate) fn new(
        (kc, vc): (&'a Codec, &'a Codec),
        bytes: &'a LayerBytes<'a>,
        geo: Geometry,
        q: &'a [f32],
        params: &AttentionParams,
        isa: Isa,
    ) -> Self {
        let (d, group) = (geo.head_dim, geo.group());
        let mut qp = vec![0.0f32; geo.heads * d];
        for (src, dst) in q.chunks_exact(d).zip(qp.chunks_exact_mut(d)) {
            kc.prepare_query(src, dst);
        }
        let fast = tq4_codebook((kc, vc)).filter(|_| tq4_supports(isa, d, group));
        // The SIMD kernels take the scale folded into the queries.
        let scaled: Vec<f32> = match fast {
            Some(_) => qp.iter().map(|&x| x * params.scale).collect(),
            None => Vec::new(),
        };
        Self {
            kc,
            vc,
            bytes,
            q,
            qp,
            scaled,
            fast,
            scale: params.scale,
            isa,
            group,
            d,
        }
    }

    /// The softmax state of one KV head's key range.
    pub(crate) fn partial(&self, keys: &KeyRange<'_>) -> Partial {
        let (group, d) = (self.group, self.d);
        let heads = keys.g * group * d..(keys.g + 1) * group * d;
        if let Some(cb) = self.fast {
            let rows = tq4_rows(cb, self.bytes);
            if let Some(p) =
                tq4_attend(self.isa, &rows, keys, &self.scaled[heads.clone()], group, d)
            {
                return p;
            }
        }
        let job = CodesJob {
            codecs: (self.kc, self.vc),
            bytes: self.bytes,
            keys,
            q: &self.q[heads.clone()],
            qp: &self.qp[heads],
            scale: self.scale,
            group,
            d,
        };
        crate::simd::codes_partial(self.isa, &job)
    }
}

/// The codes path; inputs are validated.
///
/// Per KV head, the key range is split into at most `params.threads` consecutive parts (none
/// shorter than [`MIN_KEYS_PER_THREAD`]); each (KV head, part) is one unit of work computed
/// wholly on one thread, and the parts' softmax states are merged in key order.
#[allow(clippy::too_many_arguments)]
fn attend_codes(
    kc: &Codec,
    vc: &Codec,
    bytes: &LayerBytes<'_>,
    slots: &[u32],
    geo: Geometry,
    q: &[f32],
    params: &AttentionParams,
    isa: Isa,
    out: &mut [f32],
    trace: bool,
) -> Vec<f32> {
    let (d, group, bs) = (geo.head_dim, geo.group(), geo.block_size);
    let prepared = Prepared::new((kc, vc), bytes, geo, q, params, isa);
    // Parts end on block boundaries (the scalar path's softmax tiles are blocks).
    let parts = geo.threads(params);
    let blocks = geo.tokens.div_ceil(bs);
    let bounds: Vec<usize> = (0..=parts)
        .map(|p| ((blocks * p / parts) * bs).min(geo.tokens))
        .collect();
    let units: Vec<KeyRange<'_>> = (0..geo.kv_heads)
        .flat_map(|g| {
            bounds.windows(2).map(move |w| KeyRange {
                slots,
                block_size: bs,
                kv_heads: geo.kv_heads,
                g,
                start: w[0],
                end: w[1],
                trace,
            })
        })
        .collect();
    let partials = run_units(&units, parts, |keys| prepared.partial(keys));
    let mut mass = vec![0.0f64; if trace { blocks } else { 0 }];
    for (g, per_part) in partials.chunks(parts).enumerate() {
        let Some(mut total) = merged(per_part) else {
            continue;
        };
        if trace {
            // Each tile's share of the head's normalizer, carried to the final max.
            for tile in per_part.iter().flat_map(|p| p.tiles.chunks_exact(group)) {
                for (j, t) in tile.iter().enumerate() {
                    let carried = f64::from(t.added) * f64::from(t.max - total.max[j]).exp();
                    if let Some(m) = mass.get_mut(t.start as usize / bs) {
                        *m += carried / f64::from(total.sum[j]);
                    }
                }
            }
        }
        finish_heads(&mut total, vc, g, d, out);
    }
    mass.iter()
        .map(|&m| (m / geo.heads as f64) as f32)
        .collect()
}

/// The softmax mass of each block, averaged over the query heads (see
/// [`BlockStore::attention_mass`]): per KV head, one softmax state per block from the decode
/// kernels, merged in key order; a block's mass for head `j` is its normalizer carried to the
/// final maximum over the final normalizer.
fn block_mass(prepared: &Prepared<'_>, slots: &[u32], geo: Geometry) -> Vec<f32> {
    let blocks = geo.tokens.div_ceil(geo.block_size);
    let mut mass = vec![0.0f64; blocks];
    for g in 0..geo.kv_heads {
        let per_block: Vec<Partial> = (0..blocks)
            .map(|b| prepared.partial(&block_keys(slots, geo, g, b)))
            .collect();
        if let Some(total) = merged(&per_block) {
            add_mass(&per_block, &total, geo.group(), &mut mass);
        }
    }
    mass.iter()
        .map(|&m| (m / geo.heads as f64) as f32)
        .collect()
}

/// KV head `g`'s keys of block `b` (the last block may be partial).
fn block_keys<'a>(slots: &'a [u32], geo: Geometry, g: usize, b: usize) -> KeyRange<'a> {
    let bs = geo.block_size;
    KeyRange {
        slots,
        block_size: bs,
        kv_heads: geo.kv_heads,
        g,
        start: b * bs,
        end: ((b + 1) * bs).min(geo.tokens),
        trace: false,
    }
}

/// KV head `g`'s merged state normalized into its query heads' rows of `out`, back in model
/// space (the values' codec undoes its rotation).
pub(crate) fn finish_heads(total: &mut Partial, vc: &Codec, g: usize, d: usize, out: &mut [f32]) {
    let group = total.sum.len();
    for j in 0..group {
        let h = g * group + j;
        let inv = 1.0 / total.sum[j];
        let acc = &mut total.acc[j * d..][..d];
        acc.iter_mut().for_each(|a| *a *= inv);
        vc.finish(acc, &mut out[h * d..][..d]);
    }
}

/// The softmax states of consecutive key ranges merged in key order (`None` for none).
pub(crate) fn merged(states: &[Partial]) -> Option<Partial> {
    let (first, rest) = states.split_first()?;
    let mut total = first.clone();
    for p in rest {
        total.merge(p);
    }
    Some(total)
}

/// Adds to `mass[b]`, for each of the `group` heads, the share of `total`'s normalizer that
/// block `b`'s state carries (its normalizer rescaled to the final max).
fn add_mass(per_block: &[Partial], total: &Partial, group: usize, mass: &mut [f64]) {
    for (b, p) in per_block.iter().enumerate() {
        for j in 0..group {
            let carried = f64::from(p.sum[j]) * f64::from(p.max[j] - total.max[j]).exp();
            mass[b] += carried / f64::from(total.sum[j]);
        }
    }
}

/// `run` on every unit, the units shared out in contiguous runs over at most `threads` threads
/// (the calling thread takes the first run, the team's threads the others, see
/// [`crate::team`]); results in unit order. Each unit is computed wholly by one thread, so
/// results do not depend on scheduling.
pub(crate) fn run_units<U: Sync, R: Send>(
    units: &[U],
    threads: usize,
    run: impl Fn(&U) -> R + Sync,
) -> Vec<R> {
    let threads = threads.clamp(1, units.len().max(1));
    if threads == 1 {
        return units.iter().map(&run).collect();
    }
    let share = units.len().div_ceil(threads);
    let parts: Vec<Mutex<Vec<R>>> = (0..threads).map(|_| Mutex::new(Vec::new())).collect();
    crate::team::run(threads, &|p| {
        let mine: Vec<R> = units.iter().skip(p * share).take(share).map(&run).collect();
        *parts[p].lock().unwrap_or_else(|e| e.into_inner()) = mine;
    });
    parts
        .into_iter()
        .flat_map(|p| p.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect()
}

/// Plain attention of one query over dense keys and values `[tokens, kv_heads, head_dim]`
/// (two-pass softmax, f64 accumulation): the reference for every other path.
pub fn attend_dense(
    keys: &[f32],
    values: &[f32],
    kv_heads: usize,
    q: &[f32],
    params: &AttentionParams,
    out: &mut [f32],
) -> KvResult<()> {
    check_heads(params.num_heads, kv_heads)?;
    let heads = params.num_heads;
    check_len(out.len(), q.len())?;
    if q.is_empty() || !q.len().is_multiple_of(heads) {
        return Err(KvError::RowWidth {
            expected: heads * q.len().div_ceil(heads).max(1),
            got: q.len(),
        });
    }
    let d = q.len() / heads;
    let width = kv_heads * d;
    if keys.is_empty() || !keys.len().is_multiple_of(width) {
        return Err(KvError::RowWidth {
            expected: width * keys.len().div_ceil(width).max(1),
            got: keys.len(),
        });
    }
    check_len(values.len(), keys.len())?;
    let tokens = keys.len() / width;
    let group = heads / kv_heads;
    let mut scores = vec![0.0f64; tokens];
    for h in 0..heads {
        let g = h / group;
        let qh = &q[h * d..][..d];
        for (t, s) in scores.iter_mut().enumerate() {
            let k = &keys[(t * kv_heads + g) * d..][..d];
            let dot: f64 = qh
                .iter()
                .zip(k)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            *s = dot * f64::from(params.scale);
        }
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut total = 0.0f64;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            total += *s;
        }
        let mut acc = vec![0.0f64; d];
        for (t, &p) in scores.iter().enumerate() {
            let v = &values[(t * kv_heads + g) * d..][..d];
            for (a, &x) in acc.iter_mut().zip(v) {
                *a += p * f64::from(x);
            }
        }
        for (o, a) in out[h * d..][..d].iter_mut().zip(&acc) {
            *o = (a / total) as f32;
        }
    }
    Ok(())
}
