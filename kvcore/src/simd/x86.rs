//! The x86-64 kernels: AVX-512 F (the 16 centroids in one register, looked up with
//! `vpermps`) and AVX2 + FMA (two 8-entry halves, blended on the index's high bit).
//!
//! Both read a row's code bytes once, expand them to centroids in registers in the kernels'
//! coordinate order (see [`super::to_kernel_order`]), and let every query head of the KV head's
//! group use that one expansion: a score is one chain of FMAs and a horizontal sum, a value is
//! one FMA per register and head. Softmax is online per tile of 16 keys with a vectorized `exp`.

use std::arch::x86_64::*;

use half::f16;

use super::{Isa, KeyRange, Partial, Tq4Rows, from_kernel_order, to_kernel_order};

/// Keys per softmax tile.
const TILE: usize = 16;
/// Most query heads per KV head the kernels take.
const MAX_GROUP: usize = 8;
/// Largest head_dim the kernels take.
const MAX_D: usize = 256;

// exp(x) = 2^n · e^r with r = x − n·ln2 (ln2 split in two for precision) and e^r from a degree-7
// polynomial (Cephes' expf coefficients): relative error about 1e-7 on the reduced range.
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// Scores are relative to the running max (≤ 0); below this `exp` is 0 for softmax purposes
/// and the clamp keeps `2^n` a normal number.
const EXP_MIN: f32 = -87.0;
const EXP_MAX: f32 = 88.0;

/// Dispatches to `isa`'s kernel (the caller checked the geometry and that the CPU has `isa`).
pub(super) fn tq4_attend(
    isa: Isa,
    rows: &Tq4Rows<'_>,
    keys: &KeyRange<'_>,
    q: &[f32],
    group: usize,
    d: usize,
) -> Option<Partial> {
    if rows.code_row != d / 2 || q.len() != group * d || group > MAX_GROUP || d > MAX_D {
        return None;
    }
    match isa {
        // SAFETY: `super::tq4_attend` calls this only for a tier at most `Isa::detected()`,
        // which is `Avx512` only when the CPU reports AVX-512 F.
        Isa::Avx512 => Some(unsafe { tq4_avx512(rows, keys, q, group, d) }),
        // SAFETY: as above; `Avx2` (or higher) is detected only with AVX2 and FMA.
        Isa::Avx2 => Some(unsafe { tq4_avx2(rows, keys, q, group, d) }),
        Isa::Scalar => None,
    }
}

#[inline]
fn norm_at(norms: &[u8], row: usize, norm_row: usize) -> f32 {
    let n = &norms[row * norm_row..][..2];
    f16::from_le_bytes([n[0], n[1]]).to_f32()
}

// ---------------------------------------------------------------------------------------------
// AVX-512

#[target_feature(enable = "avx512f")]
fn load512(v: &[f32]) -> __m512 {
    let v = &v[..16];
    // SAFETY: `v` has 16 floats (the slice above is bounds-checked).
    unsafe { _mm512_loadu_ps(v.as_ptr()) }
}

#[target_feature(enable = "avx512f")]
fn store512(v: &mut [f32], x: __m512) {
    let v = &mut v[..16];
    // SAFETY: `v` has room for 16 floats (bounds-checked above).
    unsafe { _mm512_storeu_ps(v.as_mut_ptr(), x) }
}

/// Expands a row's `16·loads` code bytes into `2·loads` registers of centroids.
#[target_feature(enable = "avx512f")]
fn expand512(code: &[u8], loads: usize, cb: __m512, e: &mut [__m512; MAX_D / 16]) {
    let low = _mm512_set1_epi32(0x0F);
    for c in 0..loads {
        let bytes = &code[16 * c..][..16];
        // SAFETY: `bytes` is 16 bytes long (bounds-checked above); the load is unaligned.
        let b = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
        let a = _mm512_cvtepu8_epi32(b);
        e[2 * c] = _mm512_permutexvar_ps(_mm512_and_si512(a, low), cb);
        e[2 * c + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(a), cb);
    }
}

#[target_feature(enable = "avx512f")]
fn exp512(x: __m512) -> __m512 {
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)),
        _mm512_set1_ps(EXP_MAX),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let y = _mm512_fmadd_ps(
        p,
        _mm512_mul_ps(r, r),
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    _mm512_scalef_ps(y, n)
}

#[target_feature(enable = "avx512f")]
fn tq4_avx512(
    rows: &Tq4Rows<'_>,
    keys: &KeyRange<'_>,
    q: &[f32],
    group: usize,
    d: usize,
) -> Partial {
    const W: usize = 16;
    let (nz, loads) = (d / W, d / (2 * W));
    let (cr, nr) = (rows.code_row, rows.norm_row);
    let cb = load512(rows.codebook);
    let zero = _mm512_setzero_ps();
    let mut perm = [0.0f32; MAX_D];
    let mut qz = [zero; MAX_GROUP * MAX_D / W];
    for j in 0..group {
        to_kernel_order(&q[j * d..][..d], W, &mut perm[..d]);
        for z in 0..nz {
            qz[j * nz + z] = load512(&perm[z * W..]);
        }
    }
    let mut acc = [zero; MAX_GROUP * MAX_D / W];
    let mut max = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0.0f32; MAX_GROUP];
    let mut s = [[0.0f32; TILE]; MAX_GROUP];
    let mut e = [zero; MAX_D / W];
    let mut t = keys.start;
    while t < keys.end {
        let n = TILE.min(keys.end - t);
        for i in 0..n {
            let r = keys.row(t + i);
            expand512(&rows.k_codes[r * cr..][..cr], loads, cb, &mut e);
            let norm = norm_at(rows.k_norms, r, nr);
            for (j, sj) in s.iter_mut().enumerate().take(group) {
                let qj = &qz[j * nz..][..nz];
                let mut v = _mm512_mul_ps(qj[0], e[0]);
                for z in 1..nz {
                    v = _mm512_fmadd_ps(qj[z], e[z], v);
                }
                sj[i] = norm * _mm512_reduce_add_ps(v);
            }
        }
        let lanes: __mmask16 = if n == TILE { 0xFFFF } else { (1u16 << n) - 1 };
        for j in 0..group {
            let tile_max = s[j][..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = max[j].max(tile_max);
            let correction = (max[j] - new_max).exp();
            if correction != 1.0 {
                sum[j] *= correction;
                let c = _mm512_set1_ps(correction);
                for a in &mut acc[j * nz..][..nz] {
                    *a = _mm512_mul_ps(*a, c);
                }
            }
            let x = _mm512_sub_ps(load512(&s[j]), _mm512_set1_ps(new_max));
            let p = _mm512_maskz_mov_ps(lanes, exp512(x));
            sum[j] += _mm512_reduce_add_ps(p);
            store512(&mut s[j], p);
            max[j] = new_max;
        }
        for i in 0..n {
            let r = keys.row(t + i);
            expand512(&rows.v_codes[r * cr..][..cr], loads, cb, &mut e);
            let norm = norm_at(rows.v_norms, r, nr);
            for (j, sj) in s.iter().enumerate().take(group) {
                let w = _mm512_set1_ps(sj[i] * norm);
                for (a, &x) in acc[j * nz..][..nz].iter_mut().zip(&e[..nz]) {
                    *a = _mm512_fmadd_ps(w, x, *a);
                }
            }
        }
        t += n;
    }
    let mut part = Partial::empty(group, d);
    for j in 0..group {
        part.max[j] = max[j];
        part.sum[j] = sum[j];
        for z in 0..nz {
            store512(&mut perm[z * W..], acc[j * nz + z]);
        }
        from_kernel_order(&perm[..d], W, &mut part.acc[j * d..][..d]);
    }
    part
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA

#[target_feature(enable = "avx2,fma")]
fn load256(v: &[f32]) -> __m256 {
    let v = &v[..8];
    // SAFETY: `v` has 8 floats (bounds-checked above).
    unsafe { _mm256_loadu_ps(v.as_ptr()) }
}

#[target_feature(enable = "avx2,fma")]
fn store256(v: &mut [f32], x: __m256) {
    let v = &mut v[..8];
    // SAFETY: `v` has room for 8 floats (bounds-checked above).
    unsafe { _mm256_storeu_ps(v.as_mut_ptr(), x) }
}

/// `codebook[idx]` per lane: two 8-entry lookups, the high bit of the index picks one.
#[target_feature(enable = "avx2,fma")]
fn lookup256(idx: __m256i, lo: __m256, hi: __m256) -> __m256 {
    let a = _mm256_permutevar8x32_ps(lo, idx);
    let b = _mm256_permutevar8x32_ps(hi, idx);
    _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32::<28>(idx)))
}

/// Expands a row's `8·loads` code bytes into `2·loads` registers of centroids.
#[target_feature(enable = "avx2,fma")]
fn expand256(code: &[u8], loads: usize, lo: __m256, hi: __m256, e: &mut [__m256; MAX_D / 8]) {
    let low = _mm256_set1_epi32(0x0F);
    for c in 0..loads {
        let bytes = &code[8 * c..][..8];
        // SAFETY: `bytes` is 8 bytes long (bounds-checked above); `_mm_loadl_epi64` reads 8.
        let b = unsafe { _mm_loadl_epi64(bytes.as_ptr().cast()) };
        let a = _mm256_cvtepu8_epi32(b);
        e[2 * c] = lookup256(_mm256_and_si256(a, low), lo, hi);
        e[2 * c + 1] = lookup256(_mm256_srli_epi32::<4>(a), lo, hi);
    }
}

#[target_feature(enable = "avx2,fma")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2,fma")]
fn exp256(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
        _mm256_set1_ps(EXP_MAX),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(LOG2E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_P[0]);
    for &c in &EXP_P[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        p,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    // 2^n built in the exponent field: n is in [-126, 127] after the clamp.
    let pow = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_mul_ps(y, pow)
}

#[target_feature(enable = "avx2,fma")]
fn tq4_avx2(rows: &Tq4Rows<'_>, keys: &KeyRange<'_>, q: &[f32], group: usize, d: usize) -> Partial {
    const W: usize = 8;
    let (nz, loads) = (d / W, d / (2 * W));
    let (cr, nr) = (rows.code_row, rows.norm_row);
    let (lo, hi) = (load256(&rows.codebook[..8]), load256(&rows.codebook[8..]));
    let zero = _mm256_setzero_ps();
    let mut perm = [0.0f32; MAX_D];
    let mut qz = [zero; MAX_GROUP * MAX_D / W];
    for j in 0..group {
        to_kernel_order(&q[j * d..][..d], W, &mut perm[..d]);
        for z in 0..nz {
            qz[j * nz + z] = load256(&perm[z * W..]);
        }
    }
    let lane_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mut acc = [zero; MAX_GROUP * MAX_D / W];
    let mut max = [f32::NEG_INFINITY; MAX_GROUP];
    let mut sum = [0.0f32; MAX_GROUP];
    let mut s = [[0.0f32; TILE]; MAX_GROUP];
    let mut e = [zero; MAX_D / W];
    let mut t = keys.start;
    while t < keys.end {
        let n = TILE.min(keys.end - t);
        for i in 0..n {
            let r = keys.row(t + i);
            expand256(&rows.k_codes[r * cr..][..cr], loads, lo, hi, &mut e);
            let norm = norm_at(rows.k_norms, r, nr);
            for (j, sj) in s.iter_mut().enumerate().take(group) {
                let qj = &qz[j * nz..][..nz];
                let mut v = _mm256_mul_ps(qj[0], e[0]);
                for z in 1..nz {
                    v = _mm256_fmadd_ps(qj[z], e[z], v);
                }
                sj[i] = norm * hsum256(v);
            }
        }
        for j in 0..group {
            let tile_max = s[j][..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let new_max = max[j].max(tile_max);
            let correction = (max[j] - new_max).exp();
            if correction != 1.0 {
                sum[j] *= correction;
                let c = _mm256_set1_ps(correction);
                for a in &mut acc[j * nz..][..nz] {
                    *a = _mm256_mul_ps(*a, c);
                }
            }
            for half in 0..TILE / W {
                let base = half * W;
                let x = _mm256_sub_ps(load256(&s[j][base..]), _mm256_set1_ps(new_max));
                // Lanes past the tile's last key count as 0.
                let live =
                    _mm256_cmpgt_epi32(_mm256_set1_epi32((n - base.min(n)) as i32), lane_index);
                let p = _mm256_and_ps(exp256(x), _mm256_castsi256_ps(live));
                sum[j] += hsum256(p);
                store256(&mut s[j][base..], p);
            }
            max[j] = new_max;
        }
        for i in 0..n {
            let r = keys.row(t + i);
            expand256(&rows.v_codes[r * cr..][..cr], loads, lo, hi, &mut e);
            let norm = norm_at(rows.v_norms, r, nr);
            for (j, sj) in s.iter().enumerate().take(group) {
                let w = _mm256_set1_ps(sj[i] * norm);
                for (a, &x) in acc[j * nz..][..nz].iter_mut().zip(&e[..nz]) {
                    *a = _mm256_fmadd_ps(w, x, *a);
                }
            }
        }
        t += n;
    }
    let mut part = Partial::empty(group, d);
    for j in 0..group {
        part.max[j] = max[j];
        part.sum[j] = sum[j];
        for z in 0..nz {
            store256(&mut perm[z * W..], acc[j * nz + z]);
        }
        from_kernel_order(&perm[..d], W, &mut part.acc[j * d..][..d]);
    }
    part
}

/// The causal prefill form of [`tq4_avx512`]: `limits.len()` query rows, row `r` attending the
/// keys before `limits[r]` (ascending), each key's codes expanded once for every row and head
/// of the group. `q` is `[rows, group, head_dim]` (rotated, scale folded in); the result holds
/// one softmax state per (row, head), row-major.
pub(super) fn tq4_causal(
    isa: Isa,
    rows: &Tq4Rows<'_>,
    keys: &KeyRange<'_>,
    q: &[f32],
    limits: &[usize],
    group: usize,
    d: usize,
) -> Option<Partial> {
    if isa != Isa::Avx512 || rows.code_row != d / 2 || q.len() != limits.len() * group * d {
        return None;
    }
    // SAFETY: called only for a tier at most `Isa::detected()` (see `super::tq4_causal`), and
    // `Avx512` is detected only when the CPU reports AVX-512 F.
    Some(unsafe { tq4_causal_avx512(rows, keys, q, limits, group, d) })
}

// `i` (a key of the tile) indexes the key-major scratch of several query rows at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f")]
fn tq4_causal_avx512(
    rows: &Tq4Rows<'_>,
    keys: &KeyRange<'_>,
    q: &[f32],
    limits: &[usize],
    group: usize,
    d: usize,
) -> Partial {
    const W: usize = 16;
    let nq = limits.len() * group;
    let (nz, loads) = (d / W, d / (2 * W));
    let (cr, nr) = (rows.code_row, rows.norm_row);
    let cb = load512(rows.codebook);
    let zero = _mm512_setzero_ps();
    // Queries in the kernels' coordinate order, as scalars to broadcast.
    let mut qk = vec![0.0f32; nq * d];
    for p in 0..nq {
        to_kernel_order(&q[p * d..][..d], W, &mut qk[p * d..][..d]);
    }
    let mut acc = vec![zero; nq * nz];
    let mut max = vec![f32::NEG_INFINITY; nq];
    let mut sum = vec![0.0f32; nq];
    let mut prob = vec![[0.0f32; TILE]; nq];
    let mut e = [zero; MAX_D / W];
    let mut row_buf = [0.0f32; MAX_D];
    // The tile's keys transposed: coordinate-major, one lane per key, so a score row of 16 keys
    // is `d` broadcast FMAs and no horizontal sum.
    let mut kt = vec![0.0f32; d * TILE];
    let mut norms = [0.0f32; TILE];
    let last = limits.iter().copied().max().unwrap_or(0).min(keys.end);
    let mut t = keys.start;
    while t < last {
        let n = TILE.min(last - t);
        for i in 0..n {
            let r = keys.row(t + i);
            expand512(&rows.k_codes[r * cr..][..cr], loads, cb, &mut e);
            for z in 0..nz {
                store512(&mut row_buf[z * W..], e[z]);
            }
            for (c, &x) in row_buf[..d].iter().enumerate() {
                kt[c * TILE + i] = x;
            }
            norms[i] = norm_at(rows.k_norms, r, nr);
        }
        // Lanes past the tile's end hold stale keys: every row masks them out below.
        let norm_v = load512(&norms);
        for (row, &lim) in limits.iter().enumerate() {
            // The keys a row sees in this tile are a prefix of it.
            let live = lim.saturating_sub(t).min(n);
            if live == 0 {
                continue;
            }
            let lanes: __mmask16 = if live == TILE {
                0xFFFF
            } else {
                (1u16 << live) - 1
            };
            for p in row * group..(row + 1) * group {
                let qp = &qk[p * d..][..d];
                // Four independent sums, so the FMAs are not one dependency chain.
                let mut sv = [zero; 4];
                for (c4, q4) in qp.chunks_exact(4).enumerate() {
                    for (k, &qc) in q4.iter().enumerate() {
                        let kc = load512(&kt[(4 * c4 + k) * TILE..]);
                        sv[k] = _mm512_fmadd_ps(_mm512_set1_ps(qc), kc, sv[k]);
                    }
                }
                let sv = _mm512_add_ps(_mm512_add_ps(sv[0], sv[1]), _mm512_add_ps(sv[2], sv[3]));
                let sv = _mm512_mul_ps(sv, norm_v);
                let tile_max = _mm512_mask_reduce_max_ps(lanes, sv);
                let new_max = max[p].max(tile_max);
                let correction = (max[p] - new_max).exp();
                if correction != 1.0 {
                    sum[p] *= correction;
                    let c = _mm512_set1_ps(correction);
                    for a in &mut acc[p * nz..][..nz] {
                        *a = _mm512_mul_ps(*a, c);
                    }
                }
                let x = _mm512_sub_ps(sv, _mm512_set1_ps(new_max));
                let w = _mm512_maskz_mov_ps(lanes, exp512(x));
                sum[p] += _mm512_reduce_add_ps(w);
                store512(&mut prob[p], w);
                max[p] = new_max;
            }
        }
        for i in 0..n {
            let r = keys.row(t + i);
            expand512(&rows.v_codes[r * cr..][..cr], loads, cb, &mut e);
            let norm = norm_at(rows.v_norms, r, nr);
            for (row, &lim) in limits.iter().enumerate() {
                if t + i >= lim {
                    continue;
                }
                for p in row * group..(row + 1) * group {
                    let w = _mm512_set1_ps(prob[p][i] * norm);
                    for (a, &x) in acc[p * nz..][..nz].iter_mut().zip(&e[..nz]) {
                        *a = _mm512_fmadd_ps(w, x, *a);
                    }
                }
            }
        }
        t += n;
    }
    let mut part = Partial::empty(nq, d);
    let mut perm = [0.0f32; MAX_D];
    for p in 0..nq {
        part.max[p] = max[p];
        part.sum[p] = sum[p];
        for z in 0..nz {
            store512(&mut perm[z * W..], acc[p * nz + z]);
        }
        from_kernel_order(&perm[..d], W, &mut part.acc[p * d..][..d]);
    }
    part
}
