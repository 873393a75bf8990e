//! The matrix product: weight rows split over threads, each thread's rows expanded once per group
//! of activation rows, and the kernels per ISA and form.
#![allow(unsafe_code)]

use crate::{Form, Isa, QMatrix, Row};

/// Multiply-adds below which one thread does the whole product (a spawn costs more).
const PAR_MIN_MACS: usize = 1 << 16;
/// Thread shares start on a multiple of this many rows.
const ROW_ALIGN: usize = 16;
/// Most activation rows a kernel call carries (its accumulators stay in registers).
const MAX_M: usize = 8;
/// From this many activation rows on (prefill), with AVX-512, a thread expands its weight rows
/// into an f32 tile once and multiplies it with every activation row: every expanded weight
/// then serves all rows, against at most `MAX_M` in registers. The sums are the same either way.
pub const PANEL_MIN_M: usize = 16;
/// Weight rows expanded at a time for many activation rows (an L1 tile per thread, reused).
const TILE_ROWS: usize = 4;
/// Activation rows the tile kernel carries.
const TILE_M: usize = 2;

/// Where outputs go: `y[i·ld + r]`.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    ptr: *mut f32,
    ld: usize,
    len: usize,
}

// SAFETY: the units of one product write disjoint column ranges (their own weight rows) of `y`,
// whose exclusive borrow outlives the scope the units run in.
unsafe impl Send for Out {}
// SAFETY: as above; no unit reads through the pointer.
unsafe impl Sync for Out {}

impl Out {
    /// Outputs into `y`, `ld` columns per activation row.
    pub(crate) fn new(y: &mut [f32], ld: usize) -> Self {
        Self {
            ptr: y.as_mut_ptr(),
            ld,
            len: y.len(),
        }
    }

    /// `y[i·ld + r + j] = v[j]`.
    pub(crate) fn put_run(self, i: usize, r: usize, v: &[f32]) {
        for (j, &x) in v.iter().enumerate() {
            self.put(i, r + j, x);
        }
    }

    pub(crate) fn put(self, i: usize, r: usize, v: f32) {
        let at = i * self.ld + r;
        if at < self.len {
            // SAFETY: `at` is inside the `y` this was made from (checked above), and only the
            // unit owning row `r` writes column `r`.
            unsafe { *self.ptr.add(at) = v };
        }
    }
}

/// `y = x · Wᵀ` (the caller checked the lengths and that the CPU runs `isa`).
pub(crate) fn product(isa: Isa, mat: &QMatrix, x: &[f32], m: usize, y: &mut [f32], threads: usize) {
    let rows = mat.rows();
    let macs = rows * mat.cols() * m;
    let units = if macs < PAR_MIN_MACS {
        1
    } else {
        threads.min(rows.div_ceil(ROW_ALIGN)).max(1)
    };
    let share = rows.div_ceil(units).next_multiple_of(ROW_ALIGN);
    let out = Out::new(y, rows);
    if units == 1 {
        span(isa, mat, 0, rows, x, m, out);
        return;
    }
    engram_kvcore::team::run(units, &|u| {
        let (a, b) = ((u * share).min(rows), ((u + 1) * share).min(rows));
        if a < b {
            span(isa, mat, a, b, x, m, out);
        }
    });
}

/// Weight rows `r0..r1` against every activation row.
fn span(isa: Isa, mat: &QMatrix, r0: usize, r1: usize, x: &[f32], m: usize, out: Out) {
    if isa == Isa::Avx512 && m >= PANEL_MIN_M {
        span_panels(isa, mat, r0, r1, x, m, out);
        return;
    }
    let cols = mat.cols();
    let max_m = match isa {
        Isa::Avx512 => MAX_M,
        Isa::Avx2 => 4,
        Isa::Scalar => 1,
    };
    let mut buf = Vec::new();
    let mut g = 0;
    while g < m {
        let mm = (m - g).min(max_m);
        let xs = &x[g * cols..(g + mm) * cols];
        for r in r0..r1 {
            let mut acc = [0f32; MAX_M];
            rows_of(
                isa,
                mat.form(),
                mat.row_in(r, &mut buf),
                xs,
                mm,
                cols,
                &mut acc,
            );
            for (i, v) in acc[..mm].iter().enumerate() {
                out.put(g + i, r, *v);
            }
        }
        g += mm;
    }
}

/// [`span`] for many activation rows (AVX-512): four weight rows at a time are expanded into an
/// L1 tile once and multiplied with every activation row, two at a time, by a register-blocked
/// kernel that adds in exactly the order of the in-register kernel (two 16-lane chains per
/// output over the 32-weight groups, then one horizontal sum). So an output does not depend on
/// how many rows share the product, or where they sit: a prefix reused from the cache gives the
/// bits that computing it again gives.
fn span_panels(isa: Isa, mat: &QMatrix, r0: usize, r1: usize, x: &[f32], m: usize, out: Out) {
    let cols = mat.cols();
    let mut tile = vec![0f32; TILE_ROWS * cols];
    let mut buf = Vec::new();
    let mut r = r0;
    while r < r1 {
        let n = TILE_ROWS.min(r1 - r);
        for (i, w) in tile.chunks_exact_mut(cols).take(n).enumerate() {
            dequant_row(isa, mat.form(), mat.row_in(r + i, &mut buf), w);
        }
        let mut g = 0;
        while g < m {
            let mm = TILE_M.min(m - g);
            let xs = &x[g * cols..(g + mm) * cols];
            let mut acc = [[0f32; TILE_ROWS]; TILE_M];
            #[cfg(target_arch = "x86_64")]
            {
                macro_rules! by_shape {
                    ($(($mm:literal, $n:literal)),*) => {
                        match (mm, n) {
                            $(($mm, $n) => {
                                // SAFETY: `span` takes this path only for `Isa::Avx512`, which
                                // `matmul_on` checked against the CPU; `tile` holds `n` rows and
                                // `xs` `mm` rows of `cols`.
                                unsafe { x86::tile512::<$mm, $n>(&tile, xs, cols, &mut acc) }
                            })*
                            _ => {}
                        }
                    };
                }
                by_shape!(
                    (1, 1),
                    (1, 2),
                    (1, 3),
                    (1, 4),
                    (2, 1),
                    (2, 2),
                    (2, 3),
                    (2, 4)
                );
            }
            for (i, row) in acc[..mm].iter().enumerate() {
                for (j, v) in row[..n].iter().enumerate() {
                    out.put(g + i, r + j, *v);
                }
            }
            g += mm;
        }
        r += n;
    }
}

/// One weight row's weights as f32 into `out` (`cols` long).
pub(crate) fn dequant_row(isa: Isa, form: Form, row: Row<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: callers pass an `isa` at most `Isa::detected()`, so the CPU has its features;
        // `out` is `cols` long and the row's groups cover `cols`.
        let done = unsafe {
            match (isa, form) {
                (Isa::Avx512, Form::Nibbles) => x86::nib512_row(row, out),
                (Isa::Avx512, Form::Bytes) => x86::byte512_row(row, out),
                (Isa::Avx2, Form::Nibbles) => x86::nib256_row(row, out),
                (Isa::Avx2, Form::Bytes) => x86::byte256_row(row, out),
                (Isa::Scalar, _) => {}
            }
            isa != Isa::Scalar
        };
        if done {
            return;
        }
    }
    let _ = isa;
    match form {
        Form::Nibbles => {
            let groups = row.codes.chunks_exact(16).zip(row.scales).zip(row.offsets);
            for (o, ((q, s), b)) in out.chunks_exact_mut(32).zip(groups) {
                for i in 0..16 {
                    o[i] = f32::from(q[i] & 0xF) * s + b;
                    o[i + 16] = f32::from(q[i] >> 4) * s + b;
                }
            }
        }
        Form::Bytes => {
            let groups = row.codes.chunks_exact(16).zip(row.scales);
            for (o, (q, s)) in out.chunks_exact_mut(16).zip(groups) {
                o.iter_mut()
                    .zip(q)
                    .for_each(|(o, q)| *o = f32::from(*q as i8) * s);
            }
        }
    }
}

/// One weight row against the `mm` activation rows of `xs` (`mm·cols` floats).
fn rows_of(
    isa: Isa,
    form: Form,
    row: Row<'_>,
    xs: &[f32],
    mm: usize,
    cols: usize,
    acc: &mut [f32; MAX_M],
) {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! by_m {
            ($f:ident, $($n:literal)*) => {
                match mm {
                    $($n => {
                        // SAFETY: `isa` is at most `Isa::detected()` (checked by `matmul_on`),
                        // so the CPU has the kernel's features.
                        unsafe { x86::$f::<$n>(row, xs, cols, acc) }
                        return;
                    })*
                    _ => {}
                }
            };
        }
        match (isa, form) {
            (Isa::Avx512, Form::Nibbles) => by_m!(nib512, 1 2 3 4 5 6 7 8),
            (Isa::Avx512, Form::Bytes) => by_m!(byte512, 1 2 3 4 5 6 7 8),
            (Isa::Avx2, Form::Nibbles) => by_m!(nib256, 1 2 3 4),
            (Isa::Avx2, Form::Bytes) => by_m!(byte256, 1 2 3 4),
            (Isa::Scalar, _) => {}
        }
    }
    let _ = isa;
    for (i, a) in acc[..mm].iter_mut().enumerate() {
        *a = scalar(form, row, &xs[i * cols..(i + 1) * cols]);
    }
}

/// The reference: one running sum over the row, weights expanded as [`QMatrix::dequantize_row`]
/// would round them on a machine without FMA.
pub(crate) fn scalar(form: Form, row: Row<'_>, x: &[f32]) -> f32 {
    let mut acc = 0f32;
    match form {
        Form::Nibbles => {
            for (((q, s), o), x) in row
                .codes
                .chunks_exact(16)
                .zip(row.scales)
                .zip(row.offsets)
                .zip(x.chunks_exact(32))
            {
                for (i, q) in q.iter().enumerate() {
                    acc += (f32::from(q & 0xF) * s + o) * x[i];
                }
                for (i, q) in q.iter().enumerate() {
                    acc += (f32::from(q >> 4) * s + o) * x[i + 16];
                }
            }
        }
        Form::Bytes => {
            for ((q, s), x) in row
                .codes
                .chunks_exact(16)
                .zip(row.scales)
                .zip(x.chunks_exact(16))
            {
                for (q, x) in q.iter().zip(x) {
                    acc += (f32::from(*q as i8) * s) * x;
                }
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::Row;

    // Every kernel: `xs` holds `M` rows of `cols` floats and the row's groups cover `cols`
    // (`span` and `QMatrix` guarantee both), so each load below is in bounds.

    /// One 32-weight group (`w0`, `w1`) into the two chains of each of `M` activation rows.
    ///
    /// # Safety
    /// `x` points at the group's first column of row 0, and `M` rows `cols` apart each have 32
    /// floats from there.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn group512<const M: usize>(
        w0: __m512,
        w1: __m512,
        x: *const f32,
        cols: usize,
        a0: &mut [__m512; M],
        a1: &mut [__m512; M],
    ) {
        for i in 0..M {
            // SAFETY: the caller's promise for row `i < M`.
            let (x0, x1) = unsafe {
                let p = x.add(i * cols);
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
            };
            a0[i] = _mm512_fmadd_ps(w0, x0, a0[i]);
            a1[i] = _mm512_fmadd_ps(w1, x1, a1[i]);
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn nib512<const M: usize>(
        row: Row<'_>,
        xs: &[f32],
        cols: usize,
        acc: &mut [f32; 8],
    ) {
        let mask = _mm512_set1_epi32(0xF);
        let mut a0 = [_mm512_setzero_ps(); M];
        let mut a1 = [_mm512_setzero_ps(); M];
        let xp = xs.as_ptr();
        let groups = row.codes.chunks_exact(16).zip(row.scales).zip(row.offsets);
        for (b, ((q, s), o)) in groups.enumerate() {
            // SAFETY: `q` is 16 bytes.
            let v = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(q.as_ptr().cast()) });
            let (s, o) = (_mm512_set1_ps(*s), _mm512_set1_ps(*o));
            let w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, mask)), s, o);
            let w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v)), s, o);
            // SAFETY: `xs` holds `M` rows of `cols`, and `32b + 32 ≤ cols`.
            unsafe { group512(w0, w1, xp.add(b * 32), cols, &mut a0, &mut a1) };
        }
        for i in 0..M {
            acc[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
        }
    }

    /// `acc[i][j] = xs[i] · tile[j]` for `M` activation rows and `R` expanded weight rows, with
    /// the chains and the final sum of [`nib512`] and [`byte512`].
    #[target_feature(enable = "avx512f")]
    pub(super) fn tile512<const M: usize, const R: usize>(
        tile: &[f32],
        xs: &[f32],
        cols: usize,
        acc: &mut [[f32; 4]; 2],
    ) {
        let mut a0 = [[_mm512_setzero_ps(); R]; M];
        let mut a1 = [[_mm512_setzero_ps(); R]; M];
        let (wp, xp) = (tile.as_ptr(), xs.as_ptr());
        for b in 0..cols / 32 {
            // SAFETY: rows `i < M` of `xs` and `j < R` of `tile` hold `cols` floats each, and
            // columns `32b..32b + 32 ≤ cols`.
            unsafe {
                let mut x = [[_mm512_setzero_ps(); 2]; M];
                for (i, x) in x.iter_mut().enumerate() {
                    let p = xp.add(i * cols + b * 32);
                    *x = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
                }
                for j in 0..R {
                    let p = wp.add(j * cols + b * 32);
                    let (w0, w1) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                    for i in 0..M {
                        a0[i][j] = _mm512_fmadd_ps(w0, x[i][0], a0[i][j]);
                        a1[i][j] = _mm512_fmadd_ps(w1, x[i][1], a1[i][j]);
                    }
                }
            }
        }
        for i in 0..M {
            for j in 0..R {
                acc[i][j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i][j], a1[i][j]));
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn byte512<const M: usize>(
        row: Row<'_>,
        xs: &[f32],
        cols: usize,
        acc: &mut [f32; 8],
    ) {
        let mut a0 = [_mm512_setzero_ps(); M];
        let mut a1 = [_mm512_setzero_ps(); M];
        let xp = xs.as_ptr();
        let groups = row.codes.chunks_exact(32).zip(row.scales.chunks_exact(2));
        for (b, (q, s)) in groups.enumerate() {
            // SAFETY: `q` is 32 bytes.
            let (v0, v1) = unsafe {
                (
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(q.as_ptr().cast())),
                    _mm512_cvtepi8_epi32(_mm_loadu_si128(q.as_ptr().add(16).cast())),
                )
            };
            let w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(v0), _mm512_set1_ps(s[0]));
            let w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(v1), _mm512_set1_ps(s[1]));
            // SAFETY: `xs` holds `M` rows of `cols`, and `32b + 32 ≤ cols`.
            unsafe { group512(w0, w1, xp.add(b * 32), cols, &mut a0, &mut a1) };
        }
        for i in 0..M {
            acc[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn nib512_row(row: Row<'_>, out: &mut [f32]) {
        let mask = _mm512_set1_epi32(0xF);
        let groups = row.codes.chunks_exact(16).zip(row.scales).zip(row.offsets);
        for (o, ((q, s), b)) in out.chunks_exact_mut(32).zip(groups) {
            // SAFETY: `q` is 16 bytes, `o` 32 floats.
            unsafe {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.as_ptr().cast()));
                let (s, b) = (_mm512_set1_ps(*s), _mm512_set1_ps(*b));
                let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
                let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_fmadd_ps(lo, s, b));
                _mm512_storeu_ps(o.as_mut_ptr().add(16), _mm512_fmadd_ps(hi, s, b));
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn byte512_row(row: Row<'_>, out: &mut [f32]) {
        for (o, (q, s)) in out
            .chunks_exact_mut(16)
            .zip(row.codes.chunks_exact(16).zip(row.scales))
        {
            // SAFETY: `q` is 16 bytes, `o` 16 floats.
            unsafe {
                let v = _mm512_cvtepi8_epi32(_mm_loadu_si128(q.as_ptr().cast()));
                let w = _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(*s));
                _mm512_storeu_ps(o.as_mut_ptr(), w);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn nib256_row(row: Row<'_>, out: &mut [f32]) {
        let mask = _mm256_set1_epi32(0xF);
        let groups = row.codes.chunks_exact(16).zip(row.scales).zip(row.offsets);
        for (o, ((q, s), b)) in out.chunks_exact_mut(32).zip(groups) {
            let (s, b) = (_mm256_set1_ps(*s), _mm256_set1_ps(*b));
            for h in 0..2 {
                // SAFETY: `q` is 16 bytes (two halves of 8), `o` 32 floats.
                unsafe {
                    let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q.as_ptr().add(8 * h).cast()));
                    let lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
                    let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v));
                    _mm256_storeu_ps(o.as_mut_ptr().add(8 * h), _mm256_fmadd_ps(lo, s, b));
                    _mm256_storeu_ps(o.as_mut_ptr().add(16 + 8 * h), _mm256_fmadd_ps(hi, s, b));
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn byte256_row(row: Row<'_>, out: &mut [f32]) {
        for (o, (q, s)) in out
            .chunks_exact_mut(16)
            .zip(row.codes.chunks_exact(16).zip(row.scales))
        {
            let s = _mm256_set1_ps(*s);
            for h in 0..2 {
                // SAFETY: `q` is 16 bytes (two halves of 8), `o` 16 floats.
                unsafe {
                    let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(q.as_ptr().add(8 * h).cast()));
                    let w = _mm256_mul_ps(_mm256_cvtepi32_ps(v), s);
                    _mm256_storeu_ps(o.as_mut_ptr().add(8 * h), w);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn nib256<const M: usize>(
        row: Row<'_>,
        xs: &[f32],
        cols: usize,
        acc: &mut [f32; 8],
    ) {
        let mask = _mm256_set1_epi32(0xF);
        let mut a0 = [_mm256_setzero_ps(); M];
        let mut a1 = [_mm256_setzero_ps(); M];
        let xp = xs.as_ptr();
        let groups = row.codes.chunks_exact(16).zip(row.scales).zip(row.offsets);
        for (b, ((q, s), o)) in groups.enumerate() {
            // SAFETY: `q` is 16 bytes: two loads of 8.
            let (v0, v1) = unsafe {
                (
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(q.as_ptr().cast())),
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(q.as_ptr().add(8).cast())),
                )
            };
            let (s, o) = (_mm256_set1_ps(*s), _mm256_set1_ps(*o));
            let w = |v: __m256i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, o);
            let (lo0, lo1) = (w(_mm256_and_si256(v0, mask)), w(_mm256_and_si256(v1, mask)));
            let (hi0, hi1) = (w(_mm256_srli_epi32::<4>(v0)), w(_mm256_srli_epi32::<4>(v1)));
            for i in 0..M {
                // SAFETY: row `i < M` of `xs`, columns `32b..32b + 32 ≤ cols`.
                unsafe {
                    let p = xp.add(i * cols + b * 32);
                    a0[i] = _mm256_fmadd_ps(lo0, _mm256_loadu_ps(p), a0[i]);
                    a1[i] = _mm256_fmadd_ps(lo1, _mm256_loadu_ps(p.add(8)), a1[i]);
                    a0[i] = _mm256_fmadd_ps(hi0, _mm256_loadu_ps(p.add(16)), a0[i]);
                    a1[i] = _mm256_fmadd_ps(hi1, _mm256_loadu_ps(p.add(24)), a1[i]);
                }
            }
        }
        for i in 0..M {
            acc[i] = hsum256(_mm256_add_ps(a0[i], a1[i]));
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn byte256<const M: usize>(
        row: Row<'_>,
        xs: &[f32],
        cols: usize,
        acc: &mut [f32; 8],
    ) {
        let mut a0 = [_mm256_setzero_ps(); M];
        let mut a1 = [_mm256_setzero_ps(); M];
        let xp = xs.as_ptr();
        let groups = row.codes.chunks_exact(32).zip(row.scales.chunks_exact(2));
        for (b, (q, s)) in groups.enumerate() {
            // SAFETY: `q` is 32 bytes: four loads of 8.
            let w = |k: usize, s: f32| unsafe {
                let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(q.as_ptr().add(8 * k).cast()));
                _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s))
            };
            let (w0, w1, w2, w3) = (w(0, s[0]), w(1, s[0]), w(2, s[1]), w(3, s[1]));
            for i in 0..M {
                // SAFETY: row `i < M` of `xs`, columns `32b..32b + 32 ≤ cols`.
                unsafe {
                    let p = xp.add(i * cols + b * 32);
                    a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(p), a0[i]);
                    a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(p.add(8)), a1[i]);
                    a0[i] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(p.add(16)), a0[i]);
                    a1[i] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(p.add(24)), a1[i]);
                }
            }
        }
        for i in 0..M {
            acc[i] = hsum256(_mm256_add_ps(a0[i], a1[i]));
        }
    }
}
