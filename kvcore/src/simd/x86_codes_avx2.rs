//! The AVX2 decode kernel for every codec pair: keys and values each expanded from their own
//! codes into 8-lane registers, then the 4-bit AVX2 kernel's loop (one horizontal sum per key
//! and head, online softmax per tile of 16 keys, one FMA per register and head for values).
//!
//! Expansion per 8 coordinates:
//! - TurboQuant at 4 bits: 8 bytes give 16 coordinates (low nibbles, then high), each half
//!   looked up as two 8-entry `vpermps` halves blended on bit 3 (the kernels' coordinate order
//!   for 8 lanes, see [`super::super::to_kernel_order`]);
//! - TurboQuant at 2, 3, 5 and 6 bits: 8 codes are `bits` bytes, LSB first, read as two dwords;
//!   lane `i`'s code is `(dword[k] >> s | dword[k + 1] << (32 − s)) & mask` with the dwords
//!   placed by `vpermd`; up to 8 centroids are one `vpermps`, 32 or 64 a gather from the codebook;
//! - Q8: 8 signed bytes widened and converted; F16: `vcvtph2ps`; F32: a load.

use std::arch::x86_64::*;

use super::prefetch_layer;
use super::{MAX_D, MAX_GROUP, TILE, exp256, hsum256, load256, lookup256, norm_at, store256};
use crate::codec::{Codec, CodecKind};
use crate::simd::CodesJob;
use crate::simd::{Partial, to_kernel_order};

const W: usize = 8;

/// How one stream's code bytes become 8-lane registers of values.
#[derive(Clone, Copy)]
enum Expander {
    /// TurboQuant at 4 bits: the 16 centroids as two halves.
    Nibbles(__m256, __m256),
    /// TurboQuant at 2 or 3 bits: up to 8 centroids in one register.
    Small(__m256, Packing),
    /// TurboQuant at 5 or 6 bits: centroids gathered from the codebook.
    Gathered(Packing),
    /// Signed 8-bit codes.
    Q8,
    /// IEEE halves (needs F16C, checked by [`supports`]).
    F16,
    /// IEEE singles.
    F32,
}

/// The per-lane constants that unpack 8 codes of `bits` bits.
#[derive(Clone, Copy)]
struct Packing {
    bits: usize,
    first: __m256i,
    second: __m256i,
    shift: __m256i,
    back: __m256i,
    mask: __m256i,
}

impl Packing {
    #[target_feature(enable = "avx2,fma")]
    fn new(bits: usize) -> Self {
        let lanes = |f: &dyn Fn(usize) -> usize| {
            let v: [i32; 8] = std::array::from_fn(|i| f(i) as i32);
            // SAFETY: `v` holds 8 i32 (32 bytes); the load is unaligned.
            unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
        };
        Self {
            bits,
            first: lanes(&|i| i * bits / 32),
            second: lanes(&|i| i * bits / 32 + 1),
            shift: lanes(&|i| i * bits % 32),
            back: lanes(&|i| 32 - i * bits % 32),
            mask: _mm256_set1_epi32((1 << bits) - 1),
        }
    }

    /// The 8 indices of the codes at `rest[at..at + bits]` (zero past the end of `rest`).
    ///
    /// # Safety
    /// The CPU has AVX2 (see [`Expander::expand`]).
    #[inline(always)]
    unsafe fn indices(&self, rest: &[u8], at: usize) -> __m256i {
        // Eight bytes hold the `bits` bytes of 8 codes; the rest of them are masked out below.
        let word = match rest.get(at..at + 8) {
            Some(b) => u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            None => {
                let mut w = [0u8; 8];
                let src = rest.get(at..).unwrap_or_default();
                let n = src.len().min(8);
                w[..n].copy_from_slice(&src[..n]);
                u64::from_le_bytes(w)
            }
        };
        // SAFETY: the caller guarantees AVX2.
        unsafe {
            let v = _mm256_castsi128_si256(_mm_cvtsi64_si128(word as i64));
            // The upper lanes of `v` are undefined: the dword indices are at most 2, in the
            // lower 128 bits.
            let lo = _mm256_srlv_epi32(_mm256_permutevar8x32_epi32(v, self.first), self.shift);
            let hi = _mm256_sllv_epi32(_mm256_permutevar8x32_epi32(v, self.second), self.back);
            _mm256_and_si256(_mm256_or_si256(lo, hi), self.mask)
        }
    }
}

impl Expander {
    #[target_feature(enable = "avx2,fma")]
    fn new(codec: &Codec) -> Self {
        match codec.kind() {
            CodecKind::F32 => Self::F32,
            CodecKind::F16 => Self::F16,
            CodecKind::Q8 => Self::Q8,
            CodecKind::TurboQuant { bits } | CodecKind::TurboQuantSplit { bits, .. } => {
                let mut table = [0.0f32; 16];
                let book = codec.codebook();
                let n = book.len().min(16);
                table[..n].copy_from_slice(&book[..n]);
                let (lo, hi) = (load256(&table[..8]), load256(&table[8..]));
                match bits {
                    4 => Self::Nibbles(lo, hi),
                    2 | 3 => Self::Small(lo, Packing::new(usize::from(bits))),
                    _ => Self::Gathered(Packing::new(usize::from(bits))),
                }
            }
        }
    }

    /// Whether coordinates come out in the kernels' order rather than the natural one.
    fn kernel_order(&self) -> bool {
        matches!(self, Self::Nibbles(..))
    }

    /// Expands one row's codes (`rest` starts at the row) into `nz` registers.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C. Not a `target_feature` function: always inlined into the
    /// kernel, whose features its intrinsics then take (a `target_feature` function may not be
    /// `inline(always)`, and one kept out of line passes its registers through memory).
    #[inline(always)]
    unsafe fn expand(&self, rest: &[u8], book: &[f32], nz: usize, e: &mut [__m256; MAX_D / W]) {
        // SAFETY: the caller guarantees AVX2, FMA and F16C; every load below is of a slice
        // bounds-checked to the bytes it reads, and a gather's indices are masked below
        // `2^bits`, the codebook's length (checked by `supports`).
        unsafe {
            match *self {
                Self::Nibbles(lo, hi) => {
                    let low = _mm256_set1_epi32(0x0F);
                    for c in 0..nz / 2 {
                        let b = &rest[8 * c..][..8];
                        let a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.as_ptr().cast()));
                        e[2 * c] = lookup256(_mm256_and_si256(a, low), lo, hi);
                        e[2 * c + 1] = lookup256(_mm256_srli_epi32::<4>(a), lo, hi);
                    }
                }
                Self::Small(cb, p) => {
                    for (c, ec) in e.iter_mut().enumerate().take(nz) {
                        *ec = _mm256_permutevar8x32_ps(cb, p.indices(rest, p.bits * c));
                    }
                }
                Self::Gathered(p) => {
                    for (c, ec) in e.iter_mut().enumerate().take(nz) {
                        let idx = p.indices(rest, p.bits * c);
                        *ec = _mm256_i32gather_ps::<4>(book.as_ptr(), idx);
                    }
                }
                Self::Q8 => {
                    for (c, ec) in e.iter_mut().enumerate().take(nz) {
                        let b = &rest[8 * c..][..8];
                        let v = _mm_loadl_epi64(b.as_ptr().cast());
                        *ec = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                    }
                }
                Self::F16 => {
                    for (c, ec) in e.iter_mut().enumerate().take(nz) {
                        let h = &rest[16 * c..][..16];
                        *ec = _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast()));
                    }
                }
                Self::F32 => {
                    for (c, ec) in e.iter_mut().enumerate().take(nz) {
                        let f = &rest[32 * c..][..32];
                        *ec = _mm256_loadu_ps(f.as_ptr().cast());
                    }
                }
            }
        }
    }
}

/// Whether the kernel takes `job` on this CPU: the AVX-512 kernel's geometry, a codebook of
/// `2^bits` centroids for gathered TurboQuant streams, and F16C (which every AVX2 CPU we know of
/// has; the kernel is compiled with it).
pub(super) fn supports(job: &CodesJob<'_>) -> bool {
    let (kc, vc) = job.codecs;
    let book_ok = |c: &Codec| match c.kind() {
        CodecKind::TurboQuant { bits } | CodecKind::TurboQuantSplit { bits, .. } => {
            c.codebook().len() >= 1 << bits
        }
        _ => true,
    };
    super::codes::supports(job)
        && book_ok(kc)
        && book_ok(vc)
        && std::arch::is_x86_feature_detected!("f16c")
}

/// The kernel (the caller checked [`supports`] and that the CPU has AVX2 and FMA).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn attend(job: &CodesJob<'_>) -> Partial {
    let &CodesJob {
        codecs: (kc, vc),
        bytes,
        keys,
        q,
        qp,
        scale,
        group,
        d,
    } = job;
    let nz = d / W;
    let split = kc.outliers() > 0;
    let (kx, vx) = (Expander::new(kc), Expander::new(vc));
    let (kbook, vbook) = (kc.codebook(), vc.codebook());
    let (kcr, knr) = (bytes.k_code_row, bytes.k_norm_row);
    let (vcr, vnr) = (bytes.v_code_row, bytes.v_norm_row);
    let zero = _mm256_setzero_ps();
    let mut perm = [0.0f32; MAX_D];
    let mut scaled = [0.0f32; MAX_D];
    let mut qz = [zero; MAX_GROUP * MAX_D / W];
    for j in 0..group {
        for (s, &x) in scaled[..d].iter_mut().zip(&qp[j * d..][..d]) {
            *s = x * scale;
        }
        if kx.kernel_order() {
            to_kernel_order(&scaled[..d], W, &mut perm[..d]);
        } else {
            perm[..d].copy_from_slice(&scaled[..d]);
        }
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
        // The next tile's rows, fetched while this one computes (`prefetch_tile`).
        prefetch_layer(bytes, keys, (t + n)..keys.end.min(t + n + TILE));
        for i in 0..n {
            let r = tile_rows[i];
            // SAFETY: this kernel runs only with AVX2, FMA and F16C (see `supports`).
            unsafe { kx.expand(&bytes.k_codes[r * kcr..], kbook, nz, &mut e) };
            let norm = if knr == 0 {
                1.0
            } else {
                norm_at(bytes.k_norms, r, knr)
            };
            // An outlier split's pairs, read once for every head.
            let mut pairs = [(0usize, 0.0f32); crate::codec::MAX_OUTLIERS as usize];
            if split {
                for (slot, pair) in pairs
                    .iter_mut()
                    .zip(kc.apart(&bytes.k_codes[r * kcr..][..kcr]))
                {
                    *slot = pair;
                }
            }
            for (j, sj) in s.iter_mut().enumerate().take(group) {
                let qj = &qz[j * nz..][..nz];
                let mut v = _mm256_mul_ps(qj[0], e[0]);
                for z in 1..nz {
                    v = _mm256_fmadd_ps(qj[z], e[z], v);
                }
                sj[i] = norm * hsum256(v);
                // An outlier split's stored-apart coordinates.
                if split {
                    let qj = &q[j * d..][..d];
                    let apart: f32 = pairs[..kc.outliers()]
                        .iter()
                        .map(|&(c, v)| qj.get(c).copied().unwrap_or(0.0) * v)
                        .sum();
                    sj[i] += scale * apart;
                }
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
                tiles.push(crate::simd::TileMass {
                    start: t as u32,
                    max: new_max,
                    added,
                });
            }
        }
        for i in 0..n {
            let r = tile_rows[i];
            // SAFETY: as above.
            unsafe { vx.expand(&bytes.v_codes[r * vcr..], vbook, nz, &mut e) };
            let norm = if vnr == 0 {
                1.0
            } else {
                norm_at(bytes.v_norms, r, vnr)
            };
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
    let order = vx.kernel_order().then_some(W);
    for j in 0..group {
        for z in 0..nz {
            store256(&mut perm[z * W..], acc[j * nz + z]);
        }
        part.set_head(j, (max[j], sum[j]), &perm[..d], order);
    }
    part.tiles = tiles;
    part
}
