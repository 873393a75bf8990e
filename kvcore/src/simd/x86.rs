//! The x86-64 kernels: AVX-512 F (the 16 centroids in one register, looked up with
//! `vpermps`) and AVX2 + FMA (two 8-entry halves, blended on the index's high bit).
//!
//! Both read a row's code bytes once, expand them to centroids in registers in the kernels'
//! coordinate order (see [`super::to_kernel_order`]), and let every query head of the KV head's
//! group use that one expansion: a score is one chain of FMAs and a horizontal sum, a value is
//! one FMA per register and head. Softmax is online per tile of 16 keys with a vectorized `exp`.

use std::arch::x86_64::*;

use half::f16;

use super::CodesJob;
use super::scalar_codes::codes_partial as reference;
use super::{CausalCodes, Isa, KeyRange, Partial, Tq4Rows, to_kernel_order};

/// Keys per softmax tile.
const TILE: usize = super::SIMD_TILE;
/// Most query heads per KV head the kernels take.
const MAX_GROUP: usize = 8;
/// Largest head_dim the kernels take.
const MAX_D: usize = 256;

use super::{EXP_MAX, EXP_MIN, EXP_P, LN2_HI, LN2_LO, LOG2E};

#[path = "x86_codes.rs"]
mod codes;
#[path = "x86_codes_avx2.rs"]
mod codes_avx2;
#[path = "x86_tile.rs"]
mod tile;

use tile::{add_tile_values, prefetch_layer, prefetch_tq4};

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

/// Attention over the codes of any codec pair for `isa` (the caller lowered it to what this CPU
/// runs): the kernel of [`codes`] (AVX-512) or [`codes_avx2`] where it takes the geometry;
/// otherwise [`super::scalar_codes::codes_partial`] compiled for the tier.
pub(super) fn codes_partial(isa: Isa, job: &CodesJob<'_>) -> Partial {
    #[target_feature(enable = "avx512f")]
    fn on_avx512(job: &CodesJob<'_>) -> Partial {
        reference(job)
    }
    #[target_feature(enable = "avx2,fma")]
    fn on_avx2(job: &CodesJob<'_>) -> Partial {
        reference(job)
    }
    match isa {
        // SAFETY: the caller lowered `isa` to `Isa::detected()`, which is `Avx512` only when
        // the CPU reports AVX-512 F.
        Isa::Avx512 if codes::supports(job) => unsafe { codes::attend(job) },
        // SAFETY: as above.
        Isa::Avx512 => unsafe { on_avx512(job) },
        // SAFETY: as above; `Avx2` is detected only with AVX2 and FMA, and `supports` checked
        // F16C.
        Isa::Avx2 if codes_avx2::supports(job) => unsafe { codes_avx2::attend(job) },
        // SAFETY: as above; `Avx2` is detected only with AVX2 and FMA.
        Isa::Avx2 => unsafe { on_avx2(job) },
        Isa::Scalar => reference(job),
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

/// An outlier split's stored-apart pairs of one tile of keys, read once for every query head:
/// per pair slot, the 16 keys' coordinate indices and values (lanes past the tile's keys, and
/// slots past `per_key`, hold index 0 and value 0).
#[derive(Clone, Copy)]
pub(super) struct TileApart {
    idx: [__m512i; crate::codec::MAX_OUTLIERS as usize],
    val: [__m512; crate::codec::MAX_OUTLIERS as usize],
    per_key: usize,
}

impl TileApart {
    /// Reads the pairs of `rows` (the tile's keys) from `codes` (rows of `code_row` bytes, the
    /// pairs at `offset`), `per_key` of them per row (at most [`crate::codec::MAX_OUTLIERS`]).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn read(
        codes: &[u8],
        rows: &[usize],
        code_row: usize,
        offset: usize,
        per_key: usize,
    ) -> Self {
        const SLOTS: usize = crate::codec::MAX_OUTLIERS as usize;
        let per_key = per_key.min(SLOTS);
        let mut idx = [[0i32; TILE]; SLOTS];
        let mut halves = [[0u16; TILE]; SLOTS];
        for (i, &r) in rows.iter().enumerate().take(TILE) {
            let pairs = &codes[r * code_row + offset..][..3 * per_key];
            for (k, pair) in pairs.chunks_exact(3).enumerate() {
                idx[k][i] = i32::from(pair[0]);
                halves[k][i] = u16::from_le_bytes([pair[1], pair[2]]);
            }
        }
        Self {
            idx: std::array::from_fn(|k| {
                // SAFETY: `idx[k]` is 16 i32 (64 bytes); the load is unaligned.
                unsafe { _mm512_loadu_si512(idx[k].as_ptr().cast()) }
            }),
            val: std::array::from_fn(|k| {
                // SAFETY: `halves[k]` is 16 u16 (32 bytes); the load is unaligned.
                let h = unsafe { _mm256_loadu_si256(halves[k].as_ptr().cast()) };
                _mm512_cvtph_ps(h)
            }),
            per_key,
        }
    }

    /// The 16 keys' stored-apart terms for query `q` (`d` coordinates, natural order):
    /// `Σ_k q[idx_k]·val_k` per lane; an index past `q` counts 0.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) fn scores(&self, q: &[f32]) -> __m512 {
        let d = _mm512_set1_epi32(q.len() as i32);
        let mut b = _mm512_setzero_ps();
        for k in 0..self.per_key {
            let live = _mm512_cmplt_epi32_mask(self.idx[k], d);
            // SAFETY: only lanes whose index is below `q.len()` read, at `q[idx]`.
            let g = unsafe {
                _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), live, self.idx[k], q.as_ptr())
            };
            b = _mm512_fmadd_ps(g, self.val[k], b);
        }
        b
    }
}

/// One head's online-softmax step over a tile: the scores are the lane sums of `lane_sums`
/// (one register of partials per key) times the keys' norms `norm_v`, plus `bias` (an outlier
/// split's stored-apart terms, 0 otherwise); lanes outside `lanes`
/// (past the tile's last key, holding stale partials) are masked out. Rescales `acc` and `sum`
/// when the tile raises `max`, and leaves the tile's weights in `s`. Returns what the tile added
/// to `sum` (at the new max).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f")]
fn tile_softmax(
    lane_sums: &[__m512; TILE],
    norm_v: __m512,
    bias: __m512,
    lanes: __mmask16,
    stages: &[(__m512i, __m512i); 4],
    max: &mut f32,
    sum: &mut f32,
    acc: &mut [__m512],
    s: &mut [f32; TILE],
) -> f32 {
    // `bias` (an outlier split's terms, else 0) adds after one rounding of the product, so a
    // zero bias gives the product's bits.
    let sv = _mm512_fmadd_ps(hsum16(lane_sums, stages), norm_v, bias);
    let tile_max = _mm512_mask_reduce_max_ps(lanes, sv);
    let new_max = max.max(tile_max);
    let correction = if new_max == *max {
        1.0
    } else {
        (*max - new_max).exp()
    };
    if correction != 1.0 {
        *sum *= correction;
        let c = _mm512_set1_ps(correction);
        for a in acc.iter_mut() {
            *a = _mm512_mul_ps(*a, c);
        }
    }
    let x = _mm512_sub_ps(sv, _mm512_set1_ps(new_max));
    let p = _mm512_maskz_mov_ps(lanes, exp512(x));
    let added = _mm512_reduce_add_ps(p);
    *sum += added;
    store512(s, p);
    *max = new_max;
    added
}

/// [`tq4_avx512_n`] for the geometry's register counts (`d / 16` registers per row, `group`
/// heads), so every loop below has a constant trip count and the accumulators stay in
/// registers.
#[target_feature(enable = "avx512f")]
fn tq4_avx512(
    rows: &Tq4Rows<'_>,
    keys: &KeyRange<'_>,
    q: &[f32],
    group: usize,
    d: usize,
) -> Partial {
    #[target_feature(enable = "avx512f")]
    fn by_group<const NZ: usize>(
        rows: &Tq4Rows<'_>,
        keys: &KeyRange<'_>,
        q: &[f32],
        group: usize,
    ) -> Partial {
        match group {
            1 => tq4_avx512_n::<NZ, 1>(rows, keys, q),
            2 => tq4_avx512_n::<NZ, 2>(rows, keys, q),
            3 => tq4_avx512_n::<NZ, 3>(rows, keys, q),
            4 => tq4_avx512_n::<NZ, 4>(rows, keys, q),
            5 => tq4_avx512_n::<NZ, 5>(rows, keys, q),
            6 => tq4_avx512_n::<NZ, 6>(rows, keys, q),
            7 => tq4_avx512_n::<NZ, 7>(rows, keys, q),
            _ => tq4_avx512_n::<NZ, 8>(rows, keys, q),
        }
    }
    // `tq4_attend` checked: d is a multiple of 32 up to 256, group 1..=8.
    match d / 16 {
        2 => by_group::<2>(rows, keys, q, group),
        4 => by_group::<4>(rows, keys, q, group),
        6 => by_group::<6>(rows, keys, q, group),
        8 => by_group::<8>(rows, keys, q, group),
        10 => by_group::<10>(rows, keys, q, group),
        12 => by_group::<12>(rows, keys, q, group),
        14 => by_group::<14>(rows, keys, q, group),
        _ => by_group::<16>(rows, keys, q, group),
    }
}

/// Expands a row's `8·NZ` code bytes into `NZ` registers of centroids.
#[inline]
#[target_feature(enable = "avx512f")]
fn expand512n<const NZ: usize>(code: &[u8], cb: __m512) -> [__m512; NZ] {
    let low = _mm512_set1_epi32(0x0F);
    let mut e = [_mm512_setzero_ps(); NZ];
    for c in 0..NZ / 2 {
        let bytes = &code[16 * c..][..16];
        // SAFETY: `bytes` is 16 bytes long (bounds-checked above); the load is unaligned.
        let b = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
        let a = _mm512_cvtepu8_epi32(b);
        e[2 * c] = _mm512_permutexvar_ps(_mm512_and_si512(a, low), cb);
        e[2 * c + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(a), cb);
    }
    e
}

/// The decode kernel: `G` query heads sharing each key's expansion, head_dim `16·NZ`. Scores of
/// a tile of 16 keys come out of one transpose-reduce per head; the online softmax runs per
/// tile; values are one FMA per register and head.
#[target_feature(enable = "avx512f")]
fn tq4_avx512_n<const NZ: usize, const G: usize>(
    rows: &Tq4Rows<'_>,
    keys: &KeyRange<'_>,
    q: &[f32],
) -> Partial {
    const W: usize = 16;
    let d = NZ * W;
    let (cr, nr) = (rows.code_row, rows.norm_row);
    let code_len = NZ * 8;
    let cb = load512(rows.codebook);
    let zero = _mm512_setzero_ps();
    let mut perm = [0.0f32; MAX_D];
    let mut qz = [[zero; NZ]; G];
    for (j, qj) in qz.iter_mut().enumerate() {
        to_kernel_order(&q[j * d..][..d], W, &mut perm[..d]);
        for (z, r) in qj.iter_mut().enumerate() {
            *r = load512(&perm[z * W..]);
        }
    }
    let mut acc = [[zero; NZ]; G];
    let mut max = [f32::NEG_INFINITY; G];
    let mut sum = [0.0f32; G];
    let mut s = [[0.0f32; TILE]; G];
    // Per head, each key's 16 lane partials of its score; summed across lanes for a whole tile
    // at once (a transpose-reduce), so a score costs no horizontal sum of its own.
    let mut lane_sums = [[zero; TILE]; G];
    let mut norms = [0.0f32; TILE];
    let mut ve = [[zero; NZ]; TILE];
    let stages = [
        transpose_stage(8),
        transpose_stage(4),
        transpose_stage(2),
        transpose_stage(1),
    ];
    let mut tiles = Vec::new();
    let mut t = keys.start;
    while t < keys.end {
        let n = TILE.min(keys.end - t);
        let mut tile_rows = [0usize; TILE];
        keys.rows_into(t, &mut tile_rows[..n]);
        prefetch_tq4(rows, keys, (t + n)..keys.end.min(t + n + TILE));
        for i in 0..n {
            let r = tile_rows[i];
            let e = expand512n::<NZ>(&rows.k_codes[r * cr..][..code_len], cb);
            norms[i] = norm_at(rows.k_norms, r, nr);
            for (ls, qj) in lane_sums.iter_mut().zip(&qz) {
                let mut v = _mm512_mul_ps(qj[0], e[0]);
                for z in 1..NZ {
                    v = _mm512_fmadd_ps(qj[z], e[z], v);
                }
                ls[i] = v;
            }
        }
        let lanes: __mmask16 = if n == TILE { 0xFFFF } else { (1u16 << n) - 1 };
        let norm_v = load512(&norms);
        for j in 0..G {
            let added = tile_softmax(
                &lane_sums[j],
                norm_v,
                _mm512_setzero_ps(),
                lanes,
                &stages,
                &mut max[j],
                &mut sum[j],
                &mut acc[j],
                &mut s[j],
            );
            if keys.trace {
                tiles.push(super::TileMass {
                    start: t as u32,
                    max: max[j],
                    added,
                });
            }
        }
        // Values expanded once, then added head by head with its accumulators in registers
        // (as in the codes kernel, `x86_codes.rs`): same order per accumulator, same bits.
        for i in 0..n {
            let r = tile_rows[i];
            ve[i] = expand512n::<NZ>(&rows.v_codes[r * cr..][..code_len], cb);
            norms[i] = norm_at(rows.v_norms, r, nr);
        }
        // SAFETY: this kernel runs only where the CPU has AVX-512 F.
        unsafe { add_tile_values(&mut acc, &mut s, &ve[..n], load512(&norms)) };
        t += n;
    }
    let mut part = Partial::empty(G, d);
    for j in 0..G {
        for z in 0..NZ {
            store512(&mut perm[z * W..], acc[j][z]);
        }
        part.set_head(j, (max[j], sum[j]), &perm[..d], Some(W));
    }
    part.tiles = tiles;
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
    let mut tiles = Vec::new();
    let mut t = keys.start;
    while t < keys.end {
        let n = TILE.min(keys.end - t);
        let mut tile_rows = [0usize; TILE];
        keys.rows_into(t, &mut tile_rows[..n]);
        prefetch_tq4(rows, keys, (t + n)..keys.end.min(t + n + TILE));
        for i in 0..n {
            let r = tile_rows[i];
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
            let correction = if new_max == max[j] {
                1.0
            } else {
                (max[j] - new_max).exp()
            };
            if correction != 1.0 {
                sum[j] *= correction;
                let c = _mm256_set1_ps(correction);
                for a in &mut acc[j * nz..][..nz] {
                    *a = _mm256_mul_ps(*a, c);
                }
            }
            let mut added = 0.0f32;
            for half in 0..TILE / W {
                let base = half * W;
                let x = _mm256_sub_ps(load256(&s[j][base..]), _mm256_set1_ps(new_max));
                // Lanes past the tile's last key count as 0.
                let live =
                    _mm256_cmpgt_epi32(_mm256_set1_epi32((n - base.min(n)) as i32), lane_index);
                let p = _mm256_and_ps(exp256(x), _mm256_castsi256_ps(live));
                let h = hsum256(p);
                sum[j] += h;
                added += h;
                store256(&mut s[j][base..], p);
            }
            max[j] = new_max;
            if keys.trace {
                tiles.push(super::TileMass {
                    start: t as u32,
                    max: new_max,
                    added,
                });
            }
        }
        for i in 0..n {
            let r = tile_rows[i];
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
        for z in 0..nz {
            store256(&mut perm[z * W..], acc[j * nz + z]);
        }
        part.set_head(j, (max[j], sum[j]), &perm[..d], Some(W));
    }
    part.tiles = tiles;
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
    if isa != Isa::Avx512
        || rows.code_row != d / 2
        || q.len() != limits.len() * group * d
        || !limits.is_sorted()
    {
        return None;
    }
    // SAFETY: called only for a tier at most `Isa::detected()` (see `super::tq4_causal`), and
    // `Avx512` is detected only when the CPU reports AVX-512 F.
    Some(unsafe { tq4_causal_avx512(rows, keys, q, limits, group, d) })
}

/// The causal kernel over the codes of any codec pair ([`codes::causal`]); `None` unless `isa`
/// is AVX-512 and the kernel takes the geometry.
pub(super) fn codes_causal(isa: Isa, job: &CausalCodes<'_>) -> Option<Partial> {
    if isa != Isa::Avx512
        || !codes::geometry_fits(job.codecs, job.bytes, job.d, job.group)
        || job.q.len() != job.limits.len() * job.group * job.d
        || !job.limits.is_sorted()
    {
        return None;
    }
    // SAFETY: called only for a tier at most `Isa::detected()` (see `super::codes_causal`), and
    // `Avx512` is detected only when the CPU reports AVX-512 F.
    Some(unsafe { codes::causal(job) })
}

/// Query heads (rows of `q`) per register block of the causal kernel: one score register and,
/// per 16 coordinates, one accumulator each.
const CAUSAL_BLOCK: usize = 8;

/// Lane permutations of one stage of a 16×16 transpose: with blocks of `b` lanes, the `lo`
/// output of rows `(i, i + b)` takes `a`'s even blocks and `b`'s even blocks interleaved, `hi`
/// the odd ones.
#[target_feature(enable = "avx512f")]
fn transpose_stage(b: usize) -> (__m512i, __m512i) {
    let mut lo = [0i32; 16];
    let mut hi = [0i32; 16];
    for l in 0..16 {
        let (lo_src, hi_src) = if l & b == 0 {
            (l, l + b)
        } else {
            (16 + l - b, 16 + l)
        };
        lo[l] = lo_src as i32;
        hi[l] = hi_src as i32;
    }
    // SAFETY: both arrays hold 16 i32 (64 bytes); the loads are unaligned.
    unsafe {
        (
            _mm512_loadu_si512(lo.as_ptr().cast()),
            _mm512_loadu_si512(hi.as_ptr().cast()),
        )
    }
}

/// Transposes the 16×16 matrix whose rows are `m` in place (four stages of two-source lane
/// permutations).
#[target_feature(enable = "avx512f")]
fn transpose16(m: &mut [__m512; 16], stages: &[(__m512i, __m512i); 4]) {
    for (k, &(lo, hi)) in stages.iter().enumerate() {
        let b = 8 >> k;
        for i in 0..16 {
            if i & b == 0 {
                let (x, y) = (m[i], m[i + b]);
                m[i] = _mm512_permutex2var_ps(x, lo, y);
                m[i + b] = _mm512_permutex2var_ps(x, hi, y);
            }
        }
    }
}

/// Lane `i` of the result is the sum of the 16 lanes of `v[i]`: four stages of pairwise
/// two-source permutations and adds (15 pairs in all), in place of 16 horizontal sums.
#[target_feature(enable = "avx512f")]
fn hsum16(v: &[__m512; 16], stages: &[(__m512i, __m512i); 4]) -> __m512 {
    let mut m = *v;
    let mut count = 16;
    for &(lo, hi) in stages {
        count /= 2;
        for i in 0..count {
            let (a, b) = (m[i], m[i + count]);
            m[i] = _mm512_add_ps(
                _mm512_permutex2var_ps(a, lo, b),
                _mm512_permutex2var_ps(a, hi, b),
            );
        }
    }
    m[0]
}

/// The per-tile state the causal kernel's register blocks read.
struct CausalTile<'a> {
    /// The tile's keys transposed: coordinate-major (kernel order), one lane per key.
    kt: &'a [f32],
    /// Each key's norm, one lane per key.
    k_norm: __m512,
    /// The tile's values, centroids times norm: key-major, `nz` registers per key.
    vt: &'a [__m512],
    /// First key of the tile and its length.
    t: usize,
    n: usize,
    /// An outlier split's stored-apart pairs of the tile's keys (None: no split), and the
    /// queries they multiply: unrotated, scale folded in, `[heads, d]` in natural order.
    apart: Option<TileApart>,
    q_apart: &'a [f32],
}

/// One register block of `R` query heads (rows `p0..p0 + R` of the kernel-order queries `qk`)
/// over one tile: scores in one chain per head, the online-softmax update, and `P·V` with `R`
/// accumulators per 16 coordinates. A head's arithmetic is the same whatever block it sits in.
// `needless_range_loop`: the key index addresses `tile.vt` (key-major) and `prob` (head-major).
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx512f")]
fn causal_block<const R: usize>(
    tile: &CausalTile<'_>,
    qk: &[f32],
    p0: usize,
    lims: [usize; R],
    d: usize,
    acc: &mut [f32],
    max: &mut [f32],
    sumv: &mut [__m512],
) {
    const W: usize = 16;
    let zero = _mm512_setzero_ps();
    let q: [&[f32]; R] = std::array::from_fn(|j| &qk[(p0 + j) * d..][..d]);
    let mut s = [zero; R];
    for (c, kc) in tile.kt.chunks_exact(W).take(d).enumerate() {
        let k = load512(kc);
        for j in 0..R {
            // SAFETY: `c < d` (at most `d` chunks are taken) and every `q[j]` is `d` long.
            let qc = unsafe { *q[j].get_unchecked(c) };
            s[j] = _mm512_fmadd_ps(_mm512_set1_ps(qc), k, s[j]);
        }
    }
    let mut prob = [[0.0f32; W]; R];
    for j in 0..R {
        let p = p0 + j;
        let live = lims[j].saturating_sub(tile.t).min(tile.n);
        let lanes: __mmask16 = if live >= W {
            0xFFFF
        } else {
            (1u16 << live) - 1
        };
        let sv = match &tile.apart {
            None => _mm512_mul_ps(s[j], tile.k_norm),
            Some(apart) => {
                let bias = apart.scores(&tile.q_apart[p * d..][..d]);
                _mm512_fmadd_ps(s[j], tile.k_norm, bias)
            }
        };
        let tile_max = _mm512_mask_reduce_max_ps(lanes, sv);
        let new_max = max[p].max(tile_max);
        let correction = if new_max == max[p] {
            1.0
        } else {
            (max[p] - new_max).exp()
        };
        if correction != 1.0 {
            let c = _mm512_set1_ps(correction);
            sumv[p] = _mm512_mul_ps(sumv[p], c);
            for a in acc[p * d..][..d].chunks_exact_mut(W) {
                store512(a, _mm512_mul_ps(load512(a), c));
            }
        }
        let w = _mm512_maskz_mov_ps(lanes, exp512(_mm512_sub_ps(sv, _mm512_set1_ps(new_max))));
        sumv[p] = _mm512_add_ps(sumv[p], w);
        store512(&mut prob[j], w);
        max[p] = new_max;
    }
    let nz = d / W;
    for z in 0..nz {
        let mut a: [__m512; R] = std::array::from_fn(|j| load512(&acc[(p0 + j) * d + z * W..]));
        for i in 0..tile.n {
            let v = tile.vt[i * nz + z];
            for j in 0..R {
                a[j] = _mm512_fmadd_ps(_mm512_set1_ps(prob[j][i]), v, a[j]);
            }
        }
        for (j, a) in a.iter().enumerate() {
            store512(&mut acc[(p0 + j) * d + z * W..], *a);
        }
    }
}

/// Every query head of a causal call over one tile: the rows whose limit is past the tile's
/// first key (a suffix, since limits ascend), in register blocks of [`CAUSAL_BLOCK`] heads.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f")]
fn causal_tile(
    tile: &CausalTile<'_>,
    qk: &[f32],
    limits: &[usize],
    group: usize,
    d: usize,
    acc: &mut [f32],
    max: &mut [f32],
    sumv: &mut [__m512],
) {
    let nq = limits.len() * group;
    let first = limits.partition_point(|&lim| lim <= tile.t);
    let mut p = first * group;
    while p < nq {
        let r = (nq - p).min(CAUSAL_BLOCK);
        let lim = |j: usize| limits[(p + j) / group];
        let (a, m, sv) = (&mut *acc, &mut *max, &mut *sumv);
        match r {
            8 => causal_block::<8>(tile, qk, p, std::array::from_fn(lim), d, a, m, sv),
            7 => causal_block::<7>(tile, qk, p, std::array::from_fn(lim), d, a, m, sv),
            6 => causal_block::<6>(tile, qk, p, std::array::from_fn(lim), d, a, m, sv),
            5 => causal_block::<5>(tile, qk, p, std::array::from_fn(lim), d, a, m, sv),
            4 => causal_block::<4>(tile, qk, p, std::array::from_fn(lim), d, a, m, sv),
            3 => causal_block::<3>(tile, qk, p, std::array::from_fn(lim), d, a, m, sv),
            2 => causal_block::<2>(tile, qk, p, std::array::from_fn(lim), d, a, m, sv),
            _ => causal_block::<1>(tile, qk, p, std::array::from_fn(lim), d, a, m, sv),
        }
        p += r;
    }
}

/// The causal kernel over tiles of 16 keys: each tile's codes are expanded once (keys
/// transposed, values scaled by their norms) for every query row and head of the call, which
/// then run in register blocks of [`CAUSAL_BLOCK`] heads. Rows are taken in ascending limit
/// order, so the rows a tile reaches are a suffix.
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
    let stages = [
        transpose_stage(8),
        transpose_stage(4),
        transpose_stage(2),
        transpose_stage(1),
    ];
    // Queries in the kernels' coordinate order, as scalars to broadcast.
    let mut qk = vec![0.0f32; nq * d];
    for p in 0..nq {
        to_kernel_order(&q[p * d..][..d], W, &mut qk[p * d..][..d]);
    }
    let mut acc = vec![0.0f32; nq * d];
    let mut max = vec![f32::NEG_INFINITY; nq];
    let mut sumv = vec![zero; nq];
    let mut e = [zero; MAX_D / W];
    // Expanded keys of the tile, key-major, before the transpose.
    let mut ke = vec![zero; TILE * nz];
    let mut kt = vec![0.0f32; d * TILE];
    let mut vt = vec![zero; TILE * nz];
    let mut norms = [0.0f32; TILE];
    let last = limits.iter().copied().max().unwrap_or(0).min(keys.end);
    let mut t = keys.start;
    while t < last {
        let n = TILE.min(last - t);
        let mut tile_rows = [0usize; TILE];
        keys.rows_into(t, &mut tile_rows[..n]);
        for i in 0..n {
            let r = tile_rows[i];
            expand512(&rows.k_codes[r * cr..][..cr], loads, cb, &mut e);
            ke[i * nz..][..nz].copy_from_slice(&e[..nz]);
            norms[i] = norm_at(rows.k_norms, r, nr);
            expand512(&rows.v_codes[r * cr..][..cr], loads, cb, &mut e);
            let vn = _mm512_set1_ps(norm_at(rows.v_norms, r, nr));
            for (o, &x) in vt[i * nz..][..nz].iter_mut().zip(&e[..nz]) {
                *o = _mm512_mul_ps(x, vn);
            }
        }
        // Lanes past the tile's end hold stale (finite) keys: every row masks them out.
        for z in 0..nz {
            let mut m: [__m512; 16] = std::array::from_fn(|i| ke[i * nz + z]);
            transpose16(&mut m, &stages);
            for (c, row) in m.iter().enumerate() {
                store512(&mut kt[(z * W + c) * W..], *row);
            }
        }
        let tile = CausalTile {
            kt: &kt,
            k_norm: load512(&norms),
            vt: &vt,
            t,
            n,
            apart: None,
            q_apart: &[],
        };
        causal_tile(&tile, &qk, limits, group, d, &mut acc, &mut max, &mut sumv);
        t += n;
    }
    let mut part = Partial::empty(nq, d);
    for p in 0..nq {
        let sum = _mm512_reduce_add_ps(sumv[p]);
        part.set_head(p, (max[p], sum), &acc[p * d..][..d], Some(W));
    }
    part
}
