//! Products of the byte form (`Q6_K`, `Q8_0`, `Q5_0`: a signed byte per weight, a scale per 16)
//! with int16 activations (W8A16).
//!
//! The activations are quantized as the nibble form's int16 ones (per 32 columns, `xq` with
//! `|xq| ≤ 32,767`, see the `intdot` module). A 16-column group's part of an output is
//! `s·dx·Σ w·xq`: the integer sum is exact in 32 bits (`16·128·32,767 < 2³¹`), its conversion to
//! f32 rounds to nearest, and the float terms are added in a fixed order, so every kernel tier
//! gives the same bits for any number of activation rows and any thread count.
//!
//! A row's codes are repacked once, per 256 columns, into four 64-byte vectors whose 32-bit lane
//! `j` holds four columns of group `j` (vector `t` columns `16j + 4t .. 16j + 4t + 4`), each
//! byte stored as `w + 128`; the activations are laid out the same way. So after four vectors
//! each lane holds one group's integer sum, and a lane's float sum runs over the row's 256-column
//! blocks; the row's output is those 16 lane sums added in a fixed tree ([`tree16`]).
//!
//! AVX-512 VNNI forms `Σ w·xq` from unsigned-by-signed byte products (`vpdpbusd`), the
//! activation split into its bytes, `xq = 256·h + l` (`h` signed, `l` unsigned):
//! `Σ w·xq = 256·(Σ (w + 128)·h − 128·Σ h) + Σ l·w`, the `128·Σ h` of each group formed with the
//! activations. AVX2 multiplies 16-bit words (`vpmaddwd`); the scalar tier adds the products
//! one by one. The sums are the same integers.
#![allow(unsafe_code)]

use crate::intdot::{Kernel, kernel_for};
use crate::kernel::Out;
use crate::{Form, Isa, QMatrix};

/// Columns of one repacked block (16 groups of 16).
pub(crate) const BLOCK: usize = 256;
/// Groups (lanes) per block.
const LANES: usize = 16;
/// Quantization group of the activations (two weight groups).
const ACT_GROUP: usize = 32;
/// Multiply-adds below which one thread does the whole product.
const PAR_MIN_MACS: usize = 1 << 16;
/// Thread shares start on a multiple of this many rows.
const ROW_ALIGN: usize = 16;
/// Activation rows a kernel call carries.
const ROWS: usize = 4;
/// Activation rows whose repacked data a thread runs against its weight rows at a time (they
/// stay in cache while each weight row passes).
const CHUNK: usize = 32;
/// Weight rows the VNNI kernel for several activation rows carries at once (each activation
/// vector it loads serves four rows: the activations come from L2, the weights from L1).
const QUAD: usize = 4;
/// Activation rows that kernel carries at once.
const QUAD_ROWS: usize = 2;

/// Where column `c` (0..256) of a block sits in its repacked 256 bytes.
fn slot(c: usize) -> usize {
    let (lane, rest) = (c / LANES, c % LANES);
    64 * (rest / 4) + 4 * lane + rest % 4
}

/// A byte matrix's codes repacked for the integer kernels (its scales stay in the matrix).
#[derive(Clone, PartialEq)]
pub(crate) struct Panels {
    blocks: usize,
    /// `[row][block][256]`, `w + 128` in [`slot`] order.
    codes: Vec<u8>,
}

impl Panels {
    /// The repacked codes of a byte matrix held in rows whose width is whole blocks (`None`
    /// otherwise).
    pub(crate) fn of(m: &QMatrix) -> Option<Self> {
        if m.form() != Form::Bytes || !m.cols().is_multiple_of(BLOCK) || m.codes.is_empty() {
            return None;
        }
        let (rows, cols) = (m.rows(), m.cols());
        let mut codes = vec![0u8; rows * cols];
        for (src, dst) in m.codes.chunks_exact(cols).zip(codes.chunks_exact_mut(cols)) {
            for (s, d) in src.chunks_exact(BLOCK).zip(dst.chunks_exact_mut(BLOCK)) {
                for (c, &w) in s.iter().enumerate() {
                    d[slot(c)] = w ^ 0x80;
                }
            }
        }
        Some(Self {
            blocks: cols / BLOCK,
            codes,
        })
    }

    /// Row `r`'s codes in column order (the byte form's row), appended to `out`.
    pub(crate) fn row_into(&self, r: usize, out: &mut Vec<u8>) {
        let cols = self.blocks * BLOCK;
        for b in self.codes[r * cols..(r + 1) * cols].chunks_exact(BLOCK) {
            out.extend((0..BLOCK).map(|c| b[slot(c)] ^ 0x80));
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.codes.len()
    }
}

/// Activation rows quantized to int16 and laid out as the panels.
pub(crate) struct Acts {
    blocks: usize,
    /// `[m][block][256]`, [`slot`] order: `xq` (the AVX2 and scalar kernels).
    q16: Vec<i16>,
    /// The same: `xq`'s high byte `h`, signed (the VNNI kernel, as `low` and `corr`).
    high: Vec<i8>,
    /// The same: its low byte `l` (unsigned).
    low: Vec<u8>,
    /// `[m][block][16]`: `32,768·Σ h` over the group.
    corr: Vec<i32>,
    /// `[m][block][16]`: the group's `dx` (of its 32-column quantization group).
    dx: Vec<f32>,
}

/// Quantizes `m` rows of `cols` (whole blocks) floats into the arrays `kernel` reads.
pub(crate) fn prepare(x: &[f32], m: usize, cols: usize, kernel: Kernel) -> Acts {
    let q = crate::intdot::quantize(x, m, cols, crate::intdot::Bits::I16);
    let blocks = cols / BLOCK;
    let bytes = kernel == Kernel::Vnni;
    let (n16, n8) = if bytes { (0, m * cols) } else { (m * cols, 0) };
    let mut a = Acts {
        blocks,
        q16: vec![0; n16],
        high: vec![0; n8],
        low: vec![0; n8],
        corr: vec![0; if bytes { m * blocks * LANES } else { 0 }],
        dx: vec![0.0; m * blocks * LANES],
    };
    for i in 0..m {
        for b in 0..blocks {
            let base = (i * blocks + b) * BLOCK;
            for c in 0..BLOCK {
                let v = q.value(i, b * BLOCK + c);
                let at = base + slot(c);
                if bytes {
                    // |v| ≤ 32,767: the high byte is in -128..128 (arithmetic shift).
                    a.high[at] = (v >> 8) as i8;
                    a.low[at] = (v & 0xFF) as u8;
                    a.corr[(i * blocks + b) * LANES + c / LANES] += 32_768 * (v >> 8);
                } else {
                    a.q16[at] = v as i16;
                }
            }
            for j in 0..LANES {
                a.dx[(i * blocks + b) * LANES + j] =
                    q.scale(i, (b * BLOCK + j * LANES) / ACT_GROUP);
            }
        }
    }
    a
}

/// The lane sums of a row added in the kernels' fixed tree: lanes `j + 8`, then `j + 4`,
/// `j + 2`, `j + 1`.
fn tree16(v: &[f32; LANES]) -> f32 {
    let t8: [f32; 8] = std::array::from_fn(|j| v[j] + v[j + 8]);
    let t4: [f32; 4] = std::array::from_fn(|j| t8[j] + t8[j + 4]);
    let t2: [f32; 2] = std::array::from_fn(|j| t4[j] + t4[j + 2]);
    t2[0] + t2[1]
}

/// A row's group scales for block `b`: `Q6_K`'s `d·sc`, else the f32 scale held.
fn scales(mat: &QMatrix, r: usize, b: usize) -> [f32; LANES] {
    let g = mat.cols() / LANES;
    let at = r * g + b * LANES;
    if mat.sc8.is_empty() {
        std::array::from_fn(|j| mat.scales[at + j])
    } else {
        let d = mat.supers[r * (mat.cols() / BLOCK) + b];
        std::array::from_fn(|j| d * f32::from(mat.sc8[at + j]))
    }
}

/// `y = x · Wᵀ` through the panels (the caller checked the lengths and that the CPU runs `isa`).
pub(crate) fn product(
    isa: Isa,
    mat: &QMatrix,
    pan: &Panels,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
) {
    let rows = mat.rows();
    let kernel = kernel_for(isa);
    let a = prepare(x, m, mat.cols(), kernel);
    let units = if rows * mat.cols() * m < PAR_MIN_MACS {
        1
    } else {
        threads.min(rows.div_ceil(ROW_ALIGN)).max(1)
    };
    let share = rows.div_ceil(units).next_multiple_of(ROW_ALIGN);
    let out = Out::new(y, rows);
    let run = |u: usize| {
        let (r0, r1) = ((u * share).min(rows), ((u + 1) * share).min(rows));
        for c0 in (0..m).step_by(CHUNK) {
            let c1 = (c0 + CHUNK).min(m);
            let mut r = r0;
            // Four weight rows at a time where the kernel has that form and several rows share
            // them (the same integers and float order as one row at a time: the same bits).
            if kernel == Kernel::Vnni && c1 - c0 > 1 {
                while r + QUAD <= r1 {
                    quads_of(mat, pan, r, &a, c0, c1, out);
                    r += QUAD;
                }
            }
            for r in r..r1 {
                let mut i = c0;
                while i < c1 {
                    let n = ROWS.min(c1 - i);
                    rows_of(kernel, mat, pan, r, &a, i, n, out);
                    i += n;
                }
            }
        }
    };
    if units == 1 {
        run(0);
    } else {
        engram_kvcore::team::run(units, &run);
    }
}

/// Weight rows `r..r + 4` against activation rows `c0..c1` on the VNNI kernel.
fn quads_of(mat: &QMatrix, pan: &Panels, r: usize, a: &Acts, c0: usize, c1: usize, out: Out) {
    let len = pan.blocks * BLOCK;
    let codes = &pan.codes[r * len..][..QUAD * len];
    let mut i = c0;
    while i < c1 {
        let n = QUAD_ROWS.min(c1 - i);
        let mut y = [[0f32; QUAD]; QUAD_ROWS];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: only `Kernel::Vnni` calls this, which `kernel_for` chose where the CPU reports
        // AVX-512 BW and VNNI; `codes` holds rows `r..r + 4`, rows `i..i + n` exist in `a`,
        // prepared for this kernel.
        unsafe {
            match n {
                1 => x86::quad_vnni::<1>(mat, codes, r, a, i, &mut y),
                _ => x86::quad_vnni::<QUAD_ROWS>(mat, codes, r, a, i, &mut y),
            }
        }
        for (k, row) in y.iter().enumerate().take(n) {
            out.put_run(i + k, r, row);
        }
        i += n;
    }
}

/// Weight row `r` against activation rows `i0..i0 + n` (`n ≤ ROWS`).
#[allow(clippy::too_many_arguments)]
fn rows_of(
    kernel: Kernel,
    mat: &QMatrix,
    pan: &Panels,
    r: usize,
    a: &Acts,
    i0: usize,
    n: usize,
    out: Out,
) {
    let mut y = [0f32; ROWS];
    let codes = &pan.codes[r * pan.blocks * BLOCK..][..pan.blocks * BLOCK];
    // One call of `$f::<n>` for the row count (a kernel's accumulators are its registers).
    #[cfg(target_arch = "x86_64")]
    macro_rules! by_n {
        ($f:ident) => {
            match n {
                1 => x86::$f::<1>(mat, codes, r, a, i0, &mut y),
                2 => x86::$f::<2>(mat, codes, r, a, i0, &mut y),
                3 => x86::$f::<3>(mat, codes, r, a, i0, &mut y),
                4 => x86::$f::<4>(mat, codes, r, a, i0, &mut y),
                _ => {}
            }
        };
    }
    match kernel {
        // SAFETY: `kernel_for` chose `Vnni` only where the CPU reports AVX-512 BW and VNNI;
        // rows `i0..i0 + n` exist in `a`, prepared for this kernel and laid out for `pan`.
        #[cfg(target_arch = "x86_64")]
        Kernel::Vnni => unsafe { by_n!(row_vnni) },
        // SAFETY: `kernel_for` chose `Avx2` only where the CPU reports AVX2 and FMA; rows
        // `i0..i0 + n` exist in `a`, prepared for this kernel and laid out for `pan`.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { by_n!(row_avx2) },
        _ => {
            for (i, yi) in y.iter_mut().enumerate().take(n) {
                *yi = scalar(mat, codes, r, a, i0 + i);
            }
        }
    }
    for (i, v) in y.iter().enumerate().take(n) {
        out.put(i0 + i, r, *v);
    }
}

/// The reference: weight row `r` (its repacked `codes`) against activation row `i`.
fn scalar(mat: &QMatrix, codes: &[u8], r: usize, a: &Acts, i: usize) -> f32 {
    let mut acc = [0f32; LANES];
    for b in 0..a.blocks {
        let s = scales(mat, r, b);
        let w = &codes[b * BLOCK..][..BLOCK];
        let xq = &a.q16[(i * a.blocks + b) * BLOCK..][..BLOCK];
        for (j, lane) in acc.iter_mut().enumerate() {
            let isum: i32 = (0..LANES)
                .map(|k| {
                    let at = slot(j * LANES + k);
                    i32::from((w[at] ^ 0x80) as i8) * i32::from(xq[at])
                })
                .sum();
            let sd = s[j] * a.dx[(i * a.blocks + b) * LANES + j];
            *lane = (isum as f32).mul_add(sd, *lane);
        }
    }
    tree16(&acc)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Acts, BLOCK, LANES, QUAD, QUAD_ROWS};
    use crate::QMatrix;

    /// A block's 16 group scales of row `r` (`Q6_K`: `d·sc`, formed as [`super::scales`] does).
    ///
    /// # Safety
    /// The CPU runs AVX-512 F; block `b` and row `r` are the matrix's.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scales512(mat: &QMatrix, r: usize, b: usize) -> __m512 {
        let at = r * (mat.cols() / LANES) + b * LANES;
        // SAFETY: 16 scales (or scale bytes) of row `r` from block `b`'s first group.
        unsafe {
            if mat.sc8.is_empty() {
                _mm512_loadu_ps(mat.scales.as_ptr().add(at))
            } else {
                let d = mat.supers[r * (mat.cols() / BLOCK) + b];
                let sc = _mm_loadu_si128(mat.sc8.as_ptr().add(at).cast());
                _mm512_mul_ps(
                    _mm512_set1_ps(d),
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)),
                )
            }
        }
    }

    /// [`super::tree16`] on a register.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn tree512(v: __m512) -> f32 {
        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(v, v);
        let t8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_castps512_ps256(hi));
        tree256(t8)
    }

    /// Lanes `j + 4`, `j + 2`, `j + 1` of eight sums (the rest of [`super::tree16`]).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn tree256(t8: __m256) -> f32 {
        let t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps::<1>(t8));
        let t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps::<0b01>(t2, t2)))
    }

    /// Weight row `r` (its repacked `codes`) against activation rows `i0..i0 + R` into `y`.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F, BW and VNNI; `codes` is row `r`'s `blocks · 256` bytes and rows
    /// `i0..i0 + R` exist in `a`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn row_vnni<const R: usize>(
        mat: &QMatrix,
        codes: &[u8],
        r: usize,
        a: &Acts,
        i0: usize,
        y: &mut [f32; super::ROWS],
    ) {
        let flip = _mm512_set1_epi8(0x80u8 as i8);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..a.blocks {
            let mut h = [_mm512_setzero_si512(); R];
            let mut l = [_mm512_setzero_si512(); R];
            for t in 0..4 {
                // SAFETY: `codes` holds the block's four 64-byte vectors.
                let wu =
                    unsafe { _mm512_loadu_si512(codes.as_ptr().add(b * BLOCK + 64 * t).cast()) };
                let ws = _mm512_xor_si512(wu, flip);
                for i in 0..R {
                    let at = ((i0 + i) * a.blocks + b) * BLOCK + 64 * t;
                    // SAFETY: row `i0 + i` holds the block's 256 bytes in each array.
                    let (xh, xl) = unsafe {
                        (
                            _mm512_loadu_si512(a.high.as_ptr().add(at).cast()),
                            _mm512_loadu_si512(a.low.as_ptr().add(at).cast()),
                        )
                    };
                    h[i] = _mm512_dpbusd_epi32(h[i], wu, xh);
                    l[i] = _mm512_dpbusd_epi32(l[i], xl, ws);
                }
            }
            // SAFETY: block `b` of row `r`.
            let s = unsafe { scales512(mat, r, b) };
            for i in 0..R {
                let k = ((i0 + i) * a.blocks + b) * LANES;
                // SAFETY: 16 entries per row and block.
                let (corr, dx) = unsafe {
                    (
                        _mm512_loadu_si512(a.corr.as_ptr().add(k).cast()),
                        _mm512_loadu_ps(a.dx.as_ptr().add(k)),
                    )
                };
                let isum =
                    _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32::<8>(h[i]), l[i]), corr);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, dx), acc[i]);
            }
        }
        for (yi, v) in y.iter_mut().zip(acc) {
            *yi = tree512(v);
        }
    }

    /// [`row_vnni`] for weight rows `r..r + 4` at once against activation rows `i0..i0 + R`
    /// (`R ≤ 2`): each activation vector loaded serves the four rows. Per row and activation
    /// row the same integer sums and float steps in the same order: the same bits.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F, BW and VNNI; `codes` is rows `r..r + 4`'s `4 · blocks · 256`
    /// bytes and rows `i0..i0 + R` exist in `a`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn quad_vnni<const R: usize>(
        mat: &QMatrix,
        codes: &[u8],
        r: usize,
        a: &Acts,
        i0: usize,
        y: &mut [[f32; QUAD]; QUAD_ROWS],
    ) {
        let flip = _mm512_set1_epi8(0x80u8 as i8);
        let len = a.blocks * BLOCK;
        let mut acc = [[_mm512_setzero_ps(); R]; QUAD];
        for b in 0..a.blocks {
            let mut h = [[_mm512_setzero_si512(); R]; QUAD];
            let mut l = [[_mm512_setzero_si512(); R]; QUAD];
            for t in 0..4 {
                let mut xh = [_mm512_setzero_si512(); R];
                let mut xl = [_mm512_setzero_si512(); R];
                for i in 0..R {
                    let at = ((i0 + i) * a.blocks + b) * BLOCK + 64 * t;
                    // SAFETY: row `i0 + i` holds the block's 256 bytes in each array.
                    unsafe {
                        xh[i] = _mm512_loadu_si512(a.high.as_ptr().add(at).cast());
                        xl[i] = _mm512_loadu_si512(a.low.as_ptr().add(at).cast());
                    }
                }
                for (w, (hw, lw)) in h.iter_mut().zip(l.iter_mut()).enumerate() {
                    // SAFETY: `codes` holds the four rows' blocks of four 64-byte vectors.
                    let wu = unsafe {
                        _mm512_loadu_si512(codes.as_ptr().add(w * len + b * BLOCK + 64 * t).cast())
                    };
                    let ws = _mm512_xor_si512(wu, flip);
                    for i in 0..R {
                        hw[i] = _mm512_dpbusd_epi32(hw[i], wu, xh[i]);
                        lw[i] = _mm512_dpbusd_epi32(lw[i], xl[i], ws);
                    }
                }
            }
            for (w, accw) in acc.iter_mut().enumerate() {
                // SAFETY: block `b` of row `r + w`.
                let s = unsafe { scales512(mat, r + w, b) };
                for i in 0..R {
                    let k = ((i0 + i) * a.blocks + b) * LANES;
                    // SAFETY: 16 entries per row and block.
                    let (corr, dx) = unsafe {
                        (
                            _mm512_loadu_si512(a.corr.as_ptr().add(k).cast()),
                            _mm512_loadu_ps(a.dx.as_ptr().add(k)),
                        )
                    };
                    let isum = _mm512_sub_epi32(
                        _mm512_add_epi32(_mm512_slli_epi32::<8>(h[w][i]), l[w][i]),
                        corr,
                    );
                    accw[i] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, dx), accw[i]);
                }
            }
        }
        for (w, accw) in acc.iter().enumerate() {
            for (i, v) in accw.iter().enumerate() {
                y[i][w] = tree512(*v);
            }
        }
    }

    /// [`row_vnni`] with 16-bit products (`vpmaddwd`): the same integer sums.
    ///
    /// # Safety
    /// The CPU runs AVX2 and FMA; `codes` is row `r`'s `blocks · 256` bytes and rows
    /// `i0..i0 + R` exist in `a`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn row_avx2<const R: usize>(
        mat: &QMatrix,
        codes: &[u8],
        r: usize,
        a: &Acts,
        i0: usize,
        y: &mut [f32; super::ROWS],
    ) {
        let flip = _mm_set1_epi8(0x80u8 as i8);
        // hadd of two quarters gives lanes (0, 1, 4, 5, 2, 3, 6, 7) of their eight.
        let order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
        let g = mat.cols() / LANES;
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for b in 0..a.blocks {
            let at = r * g + b * LANES;
            let s: [__m256; 2] = std::array::from_fn(|half| {
                // SAFETY: 16 scales (or scale bytes) of row `r` from block `b`'s first group.
                unsafe {
                    if mat.sc8.is_empty() {
                        _mm256_loadu_ps(mat.scales.as_ptr().add(at + 8 * half))
                    } else {
                        let d = mat.supers[r * (mat.cols() / BLOCK) + b];
                        let sc = _mm_loadl_epi64(mat.sc8.as_ptr().add(at + 8 * half).cast());
                        _mm256_mul_ps(
                            _mm256_set1_ps(d),
                            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)),
                        )
                    }
                }
            });
            for (i, acc) in acc.iter_mut().enumerate() {
                // Per quarter of the lanes (4 groups): two dwords a group.
                let (mut p0, mut p1, mut p2, mut p3) = (
                    _mm256_setzero_si256(),
                    _mm256_setzero_si256(),
                    _mm256_setzero_si256(),
                    _mm256_setzero_si256(),
                );
                let row = ((i0 + i) * a.blocks + b) * BLOCK;
                for t in 0..4 {
                    // SAFETY: `codes` holds the block's four 64-byte vectors, and row `i0 + i`
                    // of the activations the block's 256 words.
                    unsafe {
                        let w = codes.as_ptr().add(b * BLOCK + 64 * t);
                        let x = a.q16.as_ptr().add(row + 64 * t);
                        let words = |k: usize| {
                            _mm256_cvtepi8_epi16(_mm_xor_si128(
                                _mm_loadu_si128(w.add(16 * k).cast()),
                                flip,
                            ))
                        };
                        let xs = |k: usize| _mm256_loadu_si256(x.add(16 * k).cast());
                        p0 = _mm256_add_epi32(p0, _mm256_madd_epi16(words(0), xs(0)));
                        p1 = _mm256_add_epi32(p1, _mm256_madd_epi16(words(1), xs(1)));
                        p2 = _mm256_add_epi32(p2, _mm256_madd_epi16(words(2), xs(2)));
                        p3 = _mm256_add_epi32(p3, _mm256_madd_epi16(words(3), xs(3)));
                    }
                }
                let k = ((i0 + i) * a.blocks + b) * LANES;
                for (half, sums) in [
                    (0, _mm256_hadd_epi32(p0, p1)),
                    (1, _mm256_hadd_epi32(p2, p3)),
                ] {
                    let sums = _mm256_permutevar8x32_epi32(sums, order);
                    // SAFETY: 16 entries per row and block.
                    let dx = unsafe { _mm256_loadu_ps(a.dx.as_ptr().add(k + 8 * half)) };
                    acc[half] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(sums),
                        _mm256_mul_ps(s[half], dx),
                        acc[half],
                    );
                }
            }
        }
        for (yi, v) in y.iter_mut().zip(acc) {
            *yi = tree256(_mm256_add_ps(v[0], v[1]));
        }
    }
}
