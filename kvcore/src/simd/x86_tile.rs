//! What the decode kernels do with a tile of keys besides its arithmetic: fetching the next
//! tile's rows ahead of it, and adding a tile's values to the heads' accumulators.

use std::arch::x86_64::*;

use super::TILE;
use crate::simd::{KeyRange, Tq4Rows};
use crate::store::host::LayerBytes;

/// Adds a tile's values to every head's accumulators: head `j`'s probabilities `s[j]` are
/// scaled by the values' norms `vn` (left in `s[j]`), then each of its `NZ` accumulators adds
/// the expanded values `ve` (one row of `NZ` registers a key) in key order. Head by head, so
/// the head's accumulators stay in registers: `G·NZ` of them (48 for Qwen2.5-1.5B) do not fit
/// the 32 registers, and a key-major loop kept them in memory, a load and a store per
/// multiply-add. The same sums in the same order as the key-major loop: the same bits.
///
/// # Safety
/// The CPU has AVX-512 F. Not a `target_feature` function: always inlined into the kernels
/// compiled for it (see `x86_codes::packed` on why).
#[inline(always)]
pub(super) unsafe fn add_tile_values<const NZ: usize, const G: usize>(
    acc: &mut [[__m512; NZ]; G],
    s: &mut [[f32; TILE]; G],
    ve: &[[__m512; NZ]],
    vn: __m512,
) {
    // SAFETY: the caller guarantees AVX-512 F.
    unsafe {
        for (aj, sj) in acc.iter_mut().zip(s.iter_mut()) {
            let weights = _mm512_mul_ps(_mm512_loadu_ps(sj.as_ptr()), vn);
            _mm512_storeu_ps(sj.as_mut_ptr(), weights);
            let mut a = *aj;
            for (&w, e) in sj.iter().zip(ve) {
                let w = _mm512_set1_ps(w);
                for (a, &x) in a.iter_mut().zip(e) {
                    *a = _mm512_fmadd_ps(w, x, *a);
                }
            }
            *aj = a;
        }
    }
}

/// Asks for the cache lines of the rows of positions `next` (at most a tile) in each of
/// `arrays` (its bytes and the bytes of a row; a row of 0 bytes skips it): a hint with no effect
/// on any result; lines outside an array are not asked for. The decode kernels call it for the
/// next tile of keys while they compute one: a tile is one block, whose rows are consecutive,
/// but the blocks lie anywhere in the tier, and the hardware prefetcher does not reach the next
/// one in time (on Zen 5, Qwen2.5-1.5B at 4K context: 42.3 → 37.3 ms a decoded token,
/// `docs/models.md`). The rows come from [`KeyRange::rows_into`], once for the four arrays.
#[inline]
fn prefetch_next(arrays: [(&[u8], usize); 4], keys: &KeyRange<'_>, next: std::ops::Range<usize>) {
    let mut rows = [0usize; TILE];
    let rows = &mut rows[..next.len().min(TILE)];
    keys.rows_into(next.start, rows);
    for (bytes, row) in arrays.into_iter().filter(|&(_, row)| row > 0) {
        let mut line = usize::MAX;
        for &r in rows.iter() {
            let start = r * row;
            let end = (start + row).min(bytes.len());
            let mut at = start & !63;
            while at < end {
                if at != line {
                    // SAFETY: `at < bytes.len()`, so the pointer is inside the slice; a
                    // prefetch reads nothing the program sees, and SSE is part of x86_64.
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(at).cast()) };
                    line = at;
                }
                at += 64;
            }
        }
    }
}

/// [`prefetch_next`] over a layer's key and value codes and norms.
#[inline]
pub(super) fn prefetch_layer(
    bytes: &LayerBytes<'_>,
    keys: &KeyRange<'_>,
    next: std::ops::Range<usize>,
) {
    let arrays = [
        (bytes.k_codes, bytes.k_code_row),
        (bytes.v_codes, bytes.v_code_row),
        (bytes.k_norms, bytes.k_norm_row),
        (bytes.v_norms, bytes.v_norm_row),
    ];
    prefetch_next(arrays, keys, next);
}

/// [`prefetch_next`] over a layer's TQ4 codes and norms.
#[inline]
pub(super) fn prefetch_tq4(rows: &Tq4Rows<'_>, keys: &KeyRange<'_>, next: std::ops::Range<usize>) {
    let (cr, nr) = (rows.code_row, rows.norm_row);
    let arrays = [
        (rows.k_codes, cr),
        (rows.v_codes, cr),
        (rows.k_norms, nr),
        (rows.v_norms, nr),
    ];
    prefetch_next(arrays, keys, next);
}
