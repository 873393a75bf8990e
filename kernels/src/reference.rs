//! The decode-attention kernel's algorithm on the CPU, step for step: the query rotated into the
//! codebook's space, scores straight from the key codes, one online-softmax partial
//! `(max, normalizer, accumulator)` per split of `chunk` positions, then the merge and the
//! inverse rotation of `tq4_combine`. CI runs it against kvcore's dense reference, so the
//! algorithm the GPU runs is checked on every commit, not only on the GPU machine.

use engram_kvcore::{AttentionParams, Codec, Rows, SplitMix64, TurboQuantTables, attend_dense};

use crate::{KernelError, SplitPlan};

/// Row of position `p` (KV head `g`) in planes of kvcore's layout (`engram_kvcore::LAYOUT`:
/// `[slot, kv_head, pos, …]`), through `block_table`: what the kernels and references address.
pub fn plane_row(
    block_table: &[u32],
    block_size: usize,
    kv_heads: usize,
    p: usize,
    g: usize,
) -> usize {
    (block_table[p / block_size] as usize * kv_heads + g) * block_size + p % block_size
}

/// One layer's planes in the shared layout (kvcore's `[slot, kv_head, pos, …]`).
#[derive(Debug, Clone, Copy)]
pub struct Planes<'a> {
    /// Key codes, `head_dim / 2` bytes a row.
    pub k_codes: &'a [u8],
    /// Key norms, f16 little-endian.
    pub k_norms: &'a [u8],
    /// Value codes.
    pub v_codes: &'a [u8],
    /// Value norms.
    pub v_norms: &'a [u8],
    /// KV heads.
    pub kv_heads: usize,
    /// Positions per block.
    pub block_size: usize,
}

impl Planes<'static> {
    /// Planes with no rows (the refusal tests' input).
    pub fn empty(kv_heads: usize, block_size: usize) -> Self {
        Self {
            k_codes: &[],
            k_norms: &[],
            v_codes: &[],
            v_norms: &[],
            kv_heads,
            block_size,
        }
    }
}

/// A layer's planes (kvcore's head-major layout) encoded from Gaussian rows, with the rows the
/// CPU decodes them back to: the test data of the kernel checks (CI tests and
/// `engram-gpu-check`).
#[derive(Debug, Clone)]
pub struct EncodedPlanes {
    /// Key codes.
    pub k_codes: Vec<u8>,
    /// Key norms (f16 little-endian).
    pub k_norms: Vec<u8>,
    /// Value codes.
    pub v_codes: Vec<u8>,
    /// Value norms.
    pub v_norms: Vec<u8>,
    /// The keys as `Codec::decode` returns them, `[row, head_dim]`.
    pub k_rows: Vec<f32>,
    /// The values, likewise.
    pub v_rows: Vec<f32>,
    /// KV heads.
    pub kv_heads: usize,
    /// Positions per block.
    pub block_size: usize,
    head_dim: usize,
}

impl EncodedPlanes {
    /// `slots` blocks of `block_size` positions × `kv_heads` rows: keys N(0, 1), then values
    /// N(0, 1) × `value_scale`, drawn from `rng` in that order.
    pub fn random(
        codec: &Codec,
        slots: usize,
        kv_heads: usize,
        block_size: usize,
        rng: &mut SplitMix64,
        value_scale: f32,
    ) -> Result<Self, KernelError> {
        let d = codec.head_dim();
        let rows = slots * block_size * kv_heads;
        let kx = rng.gaussian_vec(rows * d);
        let mut vx = rng.gaussian_vec(rows * d);
        vx.iter_mut().for_each(|v| *v *= value_scale);
        let (mut k_codes, mut k_norms) = (vec![0u8; rows * d / 2], vec![0u8; rows * 2]);
        let (mut v_codes, mut v_norms) = (vec![0u8; rows * d / 2], vec![0u8; rows * 2]);
        codec.encode(Rows::F32(&kx), &mut k_codes, &mut k_norms)?;
        codec.encode(Rows::F32(&vx), &mut v_codes, &mut v_norms)?;
        let (mut k_rows, mut v_rows) = (vec![0f32; rows * d], vec![0f32; rows * d]);
        codec.decode(&k_codes, &k_norms, &mut k_rows)?;
        codec.decode(&v_codes, &v_norms, &mut v_rows)?;
        Ok(Self {
            k_codes,
            k_norms,
            v_codes,
            v_norms,
            k_rows,
            v_rows,
            kv_heads,
            block_size,
            head_dim: d,
        })
    }

    /// The four planes rewritten token-major ([`crate::to_token_major`]: K codes, K norms,
    /// V codes, V norms), for the checks that compare the two page layouts.
    pub fn token_major(&self) -> [Vec<u8>; 4] {
        let cb = self.head_dim / 2;
        [
            (&self.k_codes, cb),
            (&self.k_norms, 2),
            (&self.v_codes, cb),
            (&self.v_norms, 2),
        ]
        .map(|(p, w)| crate::to_token_major(p, w, self.kv_heads))
    }

    /// The planes as the references read them.
    pub fn planes(&self) -> Planes<'_> {
        Planes {
            k_codes: &self.k_codes,
            k_norms: &self.k_norms,
            v_codes: &self.v_codes,
            v_norms: &self.v_norms,
            kv_heads: self.kv_heads,
            block_size: self.block_size,
        }
    }

    /// kvcore's dense attention (`attend_dense`) of one sequence's queries (`q`: `[heads,
    /// head_dim]`) over the decoded rows of its first `len` positions through `block_table`.
    pub fn attend_dense(
        &self,
        block_table: &[u32],
        len: usize,
        q: &[f32],
        heads: usize,
    ) -> Result<Vec<f32>, KernelError> {
        let (d, bs, kv) = (self.head_dim, self.block_size, self.kv_heads);
        let row = kv * d;
        let (mut keys, mut values) = (Vec::with_capacity(len * row), Vec::with_capacity(len * row));
        for p in 0..len {
            for g in 0..kv {
                let r = plane_row(block_table, bs, kv, p, g);
                keys.extend_from_slice(&self.k_rows[r * d..][..d]);
                values.extend_from_slice(&self.v_rows[r * d..][..d]);
            }
        }
        let mut out = vec![0f32; heads * d];
        attend_dense(
            &keys,
            &values,
            kv,
            q,
            &AttentionParams::new(heads, d),
            &mut out,
        )?;
        Ok(out)
    }

    /// The attention mass one sequence's query (`q`: `[heads, head_dim]`) gives each block of
    /// its first `len` positions through `block_table`, from the dense softmax weights over the
    /// decoded keys in f64 (scale 1/√head_dim), averaged over the heads: `⌈len / block_size⌉`
    /// values summing to 1.
    pub fn mass_dense(&self, block_table: &[u32], len: usize, q: &[f32], heads: usize) -> Vec<f64> {
        let (d, bs, kv) = (self.head_dim, self.block_size, self.kv_heads);
        let group = heads / kv;
        let scale = 1.0 / (d as f64).sqrt();
        let mut mass = vec![0f64; len.div_ceil(bs)];
        for h in 0..heads {
            let qh = &q[h * d..][..d];
            let scores: Vec<f64> = (0..len)
                .map(|p| {
                    let r = plane_row(block_table, bs, kv, p, h / group);
                    let k = &self.k_rows[r * d..][..d];
                    qh.iter()
                        .zip(k)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let total: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
            for (p, s) in scores.iter().enumerate() {
                mass[p / bs] += (s - mx).exp() / total / heads as f64;
            }
        }
        mass
    }
}

/// In-place fast Walsh–Hadamard transform (the butterflies of `fwht_warp`, in its order).
pub(crate) fn fwht(b: &mut [f32]) {
    let n = b.len();
    let mut h = 1;
    while h < n {
        for i in 0..n / 2 {
            let j = (i / h) * 2 * h + (i % h);
            let (a, c) = (b[j], b[j + h]);
            b[j] = a + c;
            b[j + h] = a - c;
        }
        h <<= 1;
    }
}

/// Relative L2 distance `‖a − b‖ / ‖b‖` (f64 sums): the error measure of every kernel check.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += f64::from(x - y).powi(2);
        den += f64::from(y).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

pub(crate) fn norm(bytes: &[u8], row: usize) -> f32 {
    half::f16::from_le_bytes([bytes[2 * row], bytes[2 * row + 1]]).to_f32()
}

/// Decode attention of one sequence (`q`: `[heads, head_dim]`, model space) over its first
/// `len` positions through `block_table`, split into chunks of `chunk` positions; writes
/// `out` (`[heads, head_dim]`).
#[allow(clippy::too_many_arguments)]
pub fn split_k_decode(
    codec: &Codec,
    group: usize,
    chunk: usize,
    q: &[f32],
    planes: &Planes<'_>,
    block_table: &[u32],
    len: usize,
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let t: TurboQuantTables = codec
        .turboquant_tables()
        .ok_or_else(|| KernelError::Unsupported("not a TurboQuant codec".into()))?;
    if t.bits != 4 {
        return Err(KernelError::Unsupported(format!("{}-bit codes", t.bits)));
    }
    let d = codec.head_dim();
    let (kv_heads, bs) = (planes.kv_heads, planes.block_size);
    let heads = kv_heads * group;
    if q.len() != heads * d || out.len() != heads * d || block_table.len() * bs < len {
        return Err(KernelError::Invalid(
            "buffer sizes do not match the shape".into(),
        ));
    }
    let plan = SplitPlan::new(len.max(1), chunk)?;
    let cb = d / 2;
    let code = |codes: &[u8], row: usize, i: usize| -> f32 {
        let byte = codes[row * cb + i / 2];
        t.codebook[usize::from((byte >> (4 * (i % 2))) & 15)]
    };
    for h in 0..heads {
        let g = h / group;
        // Rotate the query: H(signs ⊙ q) · scale.
        let mut qr: Vec<f32> = (0..d).map(|i| q[h * d + i] * t.signs[i]).collect();
        fwht(&mut qr);
        qr.iter_mut().for_each(|x| *x *= t.scale);
        // One partial per split.
        let mut parts: Vec<(f32, f32, Vec<f32>)> = Vec::with_capacity(plan.splits);
        for s in 0..plan.splits {
            let (lo, hi) = (s * plan.chunk, ((s + 1) * plan.chunk).min(len));
            let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0.0f32, vec![0.0f32; d]);
            for p in lo..hi {
                let row = plane_row(block_table, bs, kv_heads, p, g);
                let dot: f32 = (0..d).map(|i| qr[i] * code(planes.k_codes, row, i)).sum();
                let score = dot * norm(planes.k_norms, row) * scale;
                let m_new = m.max(score);
                let (fold, w) = ((m - m_new).exp(), (score - m_new).exp());
                let vn = norm(planes.v_norms, row);
                l = l * fold + w;
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = *a * fold + w * vn * code(planes.v_codes, row, i);
                }
                m = m_new;
            }
            parts.push((m, l, acc));
        }
        // Merge, normalize, rotate back: signs ⊙ H(y) · scale.
        let mx = parts.iter().map(|p| p.0).fold(f32::NEG_INFINITY, f32::max);
        let mut y = vec![0.0f32; d];
        let mut total = 0.0f32;
        for (m, l, acc) in &parts {
            if *l == 0.0 {
                continue;
            }
            let f = (m - mx).exp();
            total += l * f;
            y.iter_mut().zip(acc).for_each(|(y, a)| *y += a * f);
        }
        y.iter_mut().for_each(|v| *v /= total);
        fwht(&mut y);
        for i in 0..d {
            out[h * d + i] = y[i] * t.signs[i] * t.scale;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use engram_kvcore::{CodecKind, DEFAULT_ROTATION_SEED};

    use super::*;

    /// Every length shape the kernel meets: one position, an exact chunk, a ragged tail over
    /// several splits, and a shuffled block table; GQA groups of 3 (SmolLM2) and 4 (8B).
    #[test]
    fn split_k_matches_the_dense_reference_over_decoded_rows() {
        let mut rng = SplitMix64::new(5);
        for (d, group, kv_heads) in [(64usize, 3usize, 3usize), (128, 4, 2)] {
            let codec =
                Codec::new(CodecKind::TurboQuant { bits: 4 }, d, DEFAULT_ROTATION_SEED).unwrap();
            let bs = 16;
            let slots = 50;
            let data = EncodedPlanes::random(&codec, slots, kv_heads, bs, &mut rng, 1.0).unwrap();
            let table: Vec<u32> = (0..slots as u32).map(|s| (s * 17) % slots as u32).collect();
            let planes = data.planes();
            let heads = kv_heads * group;
            for (len, chunk) in [(1usize, 64usize), (64, 64), (700, 64), (777, 512)] {
                let q = rng.gaussian_vec(heads * d);
                let mut got = vec![0f32; heads * d];
                let scale = 1.0 / (d as f32).sqrt();
                split_k_decode(
                    &codec, group, chunk, &q, &planes, &table, len, scale, &mut got,
                )
                .unwrap();
                let want = data.attend_dense(&table, len, &q, heads).unwrap();
                let err = rel_l2(&got, &want);
                assert!(
                    err < 1e-5,
                    "d {d} len {len} chunk {chunk}: rel L2 {err:.3e}"
                );
            }
        }
    }

    #[test]
    fn mismatched_buffers_are_refused() {
        let codec =
            Codec::new(CodecKind::TurboQuant { bits: 4 }, 64, DEFAULT_ROTATION_SEED).unwrap();
        let planes = Planes::empty(1, 16);
        let mut out = vec![0f32; 64];
        let err = split_k_decode(&codec, 1, 64, &[0.0; 64], &planes, &[], 17, 0.125, &mut out);
        assert!(matches!(err, Err(KernelError::Invalid(_))));
    }
}
