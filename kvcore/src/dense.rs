//! Causal attention over decoded (f32) keys and values, tiled, for the codecs and CPUs that have
//! no kernel over the codes ([`crate::BlockStore::attend_causal`] decodes the prefix once into a
//! reused scratch and runs this).
//!
//! Every query vector (one query row, one head) walks the keys `0..=its position` in tiles of
//! [`KEY_TILE`] keys aligned to position 0, with an online softmax (one rescale per tile), its
//! scores and its value sum each one fixed chain of fused multiply-adds. Nothing it computes
//! depends on the other rows of the call: a row's result is the same bits whether it comes in a
//! chunk of one row or of hundreds, which makes a prompt resumed from a cached prefix compute
//! what a whole prefill computes. Query rows are taken [`ROW_TILE`] at a time per KV head so
//! that a key tile is loaded (and transposed) once for all of them; no score-sized tensor or
//! mask is ever built.
//!
//! The arithmetic is written once, with `mul_add` and an `exp` built from it, and compiled per
//! instruction set (AVX-512, AVX2 + FMA, portable): IEEE operations in one order, so every tier
//! gives the same bits (tested), and the compiler vectorizes the loops over keys and over the
//! head dimension.

use crate::simd::{EXP_MAX, EXP_MIN, EXP_P, Isa, LN2_HI, LN2_LO, LOG2E};

/// Keys per tile (the softmax rescales once per tile).
pub const KEY_TILE: usize = 32;
/// Query rows per unit of work (they share each key tile).
pub const ROW_TILE: usize = 16;

/// Head dims the kernel is compiled for.
pub(crate) fn supports(head_dim: usize) -> bool {
    matches!(head_dim, 32 | 64 | 96 | 128 | 256)
}

/// One unit: the query vectors of rows `r0..r1` and the `group` heads of KV head `g`.
pub(crate) struct Unit<'a> {
    /// Decoded keys, `[total, kv_heads, d]`.
    pub k: &'a [f32],
    /// Decoded values, `[total, kv_heads, d]`.
    pub v: &'a [f32],
    /// Queries, `[new, heads, d]`, the score scale not applied.
    pub q: &'a [f32],
    pub kv_heads: usize,
    pub group: usize,
    pub scale: f32,
    /// Position of query row 0.
    pub start: usize,
    pub g: usize,
    pub r0: usize,
    pub r1: usize,
}

/// Runs one unit on `isa` (lowered to what the CPU runs); returns `[r1 − r0, group, d]`.
pub(crate) fn run(isa: Isa, d: usize, unit: &Unit<'_>) -> Vec<f32> {
    let isa = isa.min(Isa::detected());
    match d {
        32 => dispatch::<32>(isa, unit),
        64 => dispatch::<64>(isa, unit),
        96 => dispatch::<96>(isa, unit),
        128 => dispatch::<128>(isa, unit),
        _ => dispatch::<256>(isa, unit),
    }
}

#[allow(unsafe_code)]
fn dispatch<const D: usize>(isa: Isa, unit: &Unit<'_>) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            // SAFETY: `run` lowers `isa` to `Isa::detected()`, which is `Avx512` only when the
            // CPU reports AVX-512 F (and FMA), `Avx2` only with AVX2 and FMA.
            Isa::Avx512 => return unsafe { unit_avx512::<D>(unit) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { unit_avx2::<D>(unit) },
            Isa::Scalar => {}
        }
    }
    let _ = isa;
    unit_body::<D>(unit)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn unit_avx512<const D: usize>(unit: &Unit<'_>) -> Vec<f32> {
    unit_body::<D>(unit)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn unit_avx2<const D: usize>(unit: &Unit<'_>) -> Vec<f32> {
    unit_body::<D>(unit)
}

/// Online softmax state of one query vector.
struct State<const D: usize> {
    max: f32,
    sum: f32,
    acc: [f32; D],
}

#[inline(always)]
fn unit_body<const D: usize>(u: &Unit<'_>) -> Vec<f32> {
    let (group, kvh) = (u.group, u.kv_heads);
    let width = kvh * group * D;
    let rows = u.r1 - u.r0;
    let vectors = rows * group;
    // Queries of the unit, scaled: [rows, group, D].
    let mut q = vec![0.0f32; vectors * D];
    for (k, r) in (u.r0..u.r1).enumerate() {
        let src = &u.q[r * width + u.g * group * D..][..group * D];
        for (dst, &x) in q[k * group * D..][..group * D].iter_mut().zip(src) {
            *dst = x * u.scale;
        }
    }
    let mut states: Vec<State<D>> = (0..vectors)
        .map(|_| State {
            max: f32::NEG_INFINITY,
            sum: 0.0,
            acc: [0.0; D],
        })
        .collect();
    // The key tile, transposed: kt[i][j] = key j's component i.
    let mut kt = vec![0.0f32; D * KEY_TILE];
    let end = u.start + u.r1; // keys 0..end are read by some row
    let mut t0 = 0;
    while t0 < end {
        let t1 = (t0 + KEY_TILE).min(end);
        let n = t1 - t0;
        for j in 0..n {
            let key = &u.k[((t0 + j) * kvh + u.g) * D..][..D];
            for (i, &x) in key.iter().enumerate() {
                kt[i * KEY_TILE + j] = x;
            }
        }
        for j in n..KEY_TILE {
            for i in 0..D {
                kt[i * KEY_TILE + j] = 0.0;
            }
        }
        for (k, r) in (u.r0..u.r1).enumerate() {
            // Row r sees positions 0..=start + r.
            let limit = u.start + r + 1;
            if limit <= t0 {
                continue;
            }
            let live = (limit - t0).min(n);
            for h in 0..group {
                let vec = k * group + h;
                let qv = &q[vec * D..][..D];
                tile(qv, &kt, u.v, t0, live, kvh, u.g, &mut states[vec]);
            }
        }
        t0 = t1;
    }
    let mut out = vec![0.0f32; vectors * D];
    for (s, o) in states.iter().zip(out.chunks_exact_mut(D)) {
        let inv = 1.0 / s.sum;
        for (o, &a) in o.iter_mut().zip(&s.acc) {
            *o = a * inv;
        }
    }
    out
}

/// One query vector over one key tile: `live` keys from position `t0`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile<const D: usize>(
    q: &[f32],
    kt: &[f32],
    v: &[f32],
    t0: usize,
    live: usize,
    kvh: usize,
    g: usize,
    st: &mut State<D>,
) {
    let mut s = [0.0f32; KEY_TILE];
    for (i, &qi) in q.iter().enumerate().take(D) {
        let row = &kt[i * KEY_TILE..][..KEY_TILE];
        for (sj, &kj) in s.iter_mut().zip(row) {
            *sj = qi.mul_add(kj, *sj);
        }
    }
    let mut tmax = f32::NEG_INFINITY;
    for &x in &s[..live] {
        tmax = tmax.max(x);
    }
    let new_max = st.max.max(tmax);
    if new_max > st.max {
        let c = exp(st.max - new_max);
        st.sum *= c;
        for a in st.acc.iter_mut() {
            *a *= c;
        }
        st.max = new_max;
    }
    let mut p = [0.0f32; KEY_TILE];
    for (pj, &x) in p.iter_mut().zip(&s) {
        *pj = exp(x - new_max);
    }
    for pj in p.iter_mut().skip(live) {
        *pj = 0.0;
    }
    // The tile's sum in eight lanes, then the lanes in a fixed order.
    let mut lanes = [0.0f32; 8];
    for chunk in p.chunks_exact(8) {
        for (l, &x) in lanes.iter_mut().zip(chunk) {
            *l += x;
        }
    }
    let tsum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
        + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    st.sum += tsum;
    for (j, &pj) in p.iter().enumerate().take(live) {
        let val = &v[((t0 + j) * kvh + g) * D..][..D];
        for (a, &x) in st.acc.iter_mut().zip(val) {
            *a = pj.mul_add(x, *a);
        }
    }
}

/// `e^x` for softmax (`x ≤ 0`; −∞ and anything below −87 give about 1.6e-38, never NaN): the
/// SIMD kernels' `exp` (same constants and steps, `crate::simd`), one lane at a time.
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r + 1.0);
    let pow = f32::from_bits(((n as i32 + 127) as u32) << 23);
    y * pow
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_close_to_std() {
        for i in 0..2000 {
            let x = -87.0 + i as f32 * 0.0437;
            let (a, b) = (exp(x), x.exp());
            assert!((a - b).abs() <= 3e-7 * b, "{x}: {a} vs {b}");
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1e-37);
    }
}
