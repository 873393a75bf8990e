//! Products of the byte form (`Q6_K`, `Q8_0`, `Q5_0`: a signed byte per weight, a scale per 16)
//! with int16 activations (W8A16).
//!
//! The activations are quantized as the nibble form's int16 ones (per 32 columns, `xq` with
//! `|xq| ≤ 32,767`, see the `intdot` module). A 16-column group's part of an output is
//! `s·dx·Σ w·xq`: the integer sum is exact in 32 bits (`16·128·32,767 < 2³¹`), its conversion to
//! f32 rounds to nearest, and the float terms are added in a fixed order, so every kernel tier
//! gives the same bits for any number of activation rows and any thread count.
//!
//! The float order: per row, sixteen sums, one per group position `j` of a 256-column block, each
//! over the row's blocks in order (`fma(Σ w·xq, s·dx, sum)`), then added in a fixed tree
//! ([`tree16`]).
//!
//! The weights are repacked once into panels of [`PANEL_ROWS`] rows: per 16-column group, four
//! 64-byte vectors whose 32-bit lane `r` holds row `r`'s four columns `4t .. 4t + 4` of the group
//! (vector `t`), each byte stored as `w + 128`; a panel's groups are in position-major order
//! (`j`, then the block), the order the kernels run. The groups' scales are the panel's too:
//! `Q6_K`'s signed scale bytes with each block's `d`, else an f32 per group, 16 rows each. So one
//! vector load serves 16 rows and a broadcast of four activation columns, as in the nibble
//! panels.
//!
//! A matrix whose every weight is in `-32..32` (`Q6_K` always, `Q5_0` too) is held in **six
//! bits** a weight, as its blocks hold it: a group is three 64-byte vectors of `u = w + 32`, two
//! of low nibbles (byte `4r + i` of the first holds columns `i` and `4 + i` of row `r`, the
//! second columns `8 + i` and `12 + i`) and one of the high two bits (bits `2t, 2t + 1` of byte
//! `4r + i`: column `4t + i`'s). The kernels rebuild the four byte vectors with shifts and masks
//! (the same integers, so the same bits); a `Q6_K` matrix is 6.625 bits a weight instead of
//! 8.625, and a decoded token reads a quarter fewer of its bytes.
//!
//! AVX-512 VNNI forms `Σ w·xq` from unsigned-by-signed byte products (`vpdpbusd`), the
//! activation split into its bytes, `xq = 256·h + l` (`h` signed, `l` unsigned):
//! `Σ w·xq = 256·(Σ (w + 128)·h − 128·Σ h) + Σ l·w`, the `128·Σ h` of each group formed with the
//! activations; six-bit panels multiply `u = w + 32` both ways (`0 ≤ u < 64` is a signed byte
//! too): `Σ w·xq = 256·Σ u·h + Σ l·u − 32·Σ xq`. AVX2 multiplies 16-bit words (`vpmaddwd`) against the int16 activations as the
//! nibble kernels hold them; the scalar tier adds the products one by one. The sums are the same
//! integers.
#![allow(unsafe_code)]

use crate::intdot::{Bits, Kernel, Quantized, kernel_for, quantize};
use crate::kernel::Out;
use crate::{Form, Isa, QMatrix};

/// Columns of one block (16 groups of 16), the unit of `Q6_K`'s `d`.
pub(crate) const BLOCK: usize = 256;
/// Columns per weight group (one scale).
const GROUP: usize = 16;
/// Groups per block.
const POSITIONS: usize = BLOCK / GROUP;
/// Weight rows per panel (one 32-bit lane each of a 512-bit register).
const PANEL_ROWS: usize = 16;
/// Code bytes of one panel's group: 16 rows × 16 columns.
const PANEL_GROUP_BYTES: usize = PANEL_ROWS * GROUP;
/// Code bytes of one six-bit panel's group: 16 rows × 16 columns × 6 bits.
const SIX_GROUP_BYTES: usize = PANEL_ROWS * GROUP * 6 / 8;
/// The offset of six-bit codes: `u = w + 32`.
const SIX_OFFSET: i32 = 32;
/// Quantization group of the activations (two weight groups).
const ACT_GROUP: usize = 32;
/// Multiply-adds below which one thread does the whole product.
const PAR_MIN_MACS: usize = 1 << 16;
/// Activation rows the 512-bit kernel carries at once.
const ROWS_512: usize = 8;
/// Activation rows the 256-bit kernel carries at once.
const ROWS_256: usize = 4;
/// Bytes of activations a thread keeps in cache while its panels pass (rows at a time: this
/// over the bytes of a row, at least one kernel call's).
const CHUNK_BYTES: usize = 512 << 10;

/// How panels hold their groups' scales; rows past the matrix are 0.
#[derive(Clone, PartialEq)]
enum Scales {
    /// `[panel][group][16]`, the panel's group order.
    F32(Vec<f32>),
    /// `Q6_K`'s: the scale is `d·sc`, `sc` `[panel][group][16]` (the panel's group order), `d`
    /// `[panel][block][16]`.
    K { sc: Vec<i8>, d: Vec<f32> },
}

/// A byte matrix's weights repacked into panels, with its groups' scales (the matrix's only
/// copy while it has them).
#[derive(Clone, PartialEq)]
pub(crate) struct Panels {
    rows: usize,
    blocks: usize,
    /// Six bits a weight (every weight in `-32..32`), else a byte.
    six: bool,
    /// `[panel][group][PANEL_GROUP_BYTES]`, `w + 128`; six-bit: `[panel][group][SIX_GROUP_BYTES]`
    /// (see the module doc).
    codes: Vec<u8>,
    scales: Scales,
}

/// Where group `(b, j)` (block `b`, position `j`) sits among a panel's `blocks · 16` groups.
fn group_at(blocks: usize, b: usize, j: usize) -> usize {
    j * blocks + b
}

/// Where column `k` (0..16) of a group sits in its panel group's bytes, for lane `lane`.
fn byte_at(lane: usize, k: usize) -> usize {
    64 * (k / 4) + 4 * lane + k % 4
}

/// Stores lane `lane`'s 16 weights (each in `-32..32`) in a six-bit panel group.
fn set_six(group: &mut [u8], lane: usize, w: [i8; GROUP]) {
    let u = w.map(|v| (i32::from(v) + SIX_OFFSET) as u8);
    for i in 0..4 {
        let at = 4 * lane + i;
        group[at] = (u[i] & 0x0F) | (u[4 + i] & 0x0F) << 4;
        group[64 + at] = (u[8 + i] & 0x0F) | (u[12 + i] & 0x0F) << 4;
        group[128 + at] = (0..4).fold(0, |h, t| h | (u[4 * t + i] >> 4) << (2 * t));
    }
}

impl Panels {
    /// The panels of a byte matrix held in rows whose width is whole blocks (`None` otherwise).
    pub(crate) fn of(m: &QMatrix) -> Option<Self> {
        if m.form() != Form::Bytes || !m.cols().is_multiple_of(BLOCK) || m.codes.is_empty() {
            return None;
        }
        let (rows, cols) = (m.rows(), m.cols());
        let (blocks, groups) = (cols / BLOCK, cols / GROUP);
        let panels = rows.div_ceil(PANEL_ROWS);
        let lanes = panels * groups * PANEL_ROWS;
        let mut scales = if m.sc8.is_empty() {
            Scales::F32(vec![0.0; lanes])
        } else {
            Scales::K {
                sc: vec![0; lanes],
                d: vec![0.0; panels * blocks * PANEL_ROWS],
            }
        };
        let six = m
            .codes
            .iter()
            .all(|&c| (-SIX_OFFSET..SIX_OFFSET).contains(&i32::from(c as i8)));
        let group_bytes = if six {
            SIX_GROUP_BYTES
        } else {
            PANEL_GROUP_BYTES
        };
        // Rows past the matrix hold weight 0 (`u = 32`: bit 1 of its high bits).
        let mut codes = vec![0x80u8; panels * groups * group_bytes];
        if six {
            for g in codes.chunks_exact_mut(SIX_GROUP_BYTES) {
                g[..128].fill(0);
                g[128..].fill(0b1010_1010);
            }
        }
        for r in 0..rows {
            let (p, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
            let row = &m.codes[r * cols..(r + 1) * cols];
            for b in 0..blocks {
                if let Scales::K { d, .. } = &mut scales {
                    d[(p * blocks + b) * PANEL_ROWS + lane] = m.supers[r * blocks + b];
                }
                for j in 0..POSITIONS {
                    let g = p * groups + group_at(blocks, b, j);
                    let src = r * groups + b * POSITIONS + j;
                    match &mut scales {
                        Scales::F32(s) => s[g * PANEL_ROWS + lane] = m.scales[src],
                        Scales::K { sc, .. } => sc[g * PANEL_ROWS + lane] = m.sc8[src],
                    }
                    let dst = &mut codes[g * group_bytes..][..group_bytes];
                    let w = |k: usize| row[b * BLOCK + j * GROUP + k];
                    if six {
                        set_six(dst, lane, std::array::from_fn(|k| w(k) as i8));
                    } else {
                        for k in 0..GROUP {
                            dst[byte_at(lane, k)] = w(k) ^ 0x80;
                        }
                    }
                }
            }
        }
        Some(Self {
            rows,
            blocks,
            six,
            codes,
            scales,
        })
    }

    fn groups(&self) -> usize {
        self.blocks * POSITIONS
    }

    /// Bytes of one panel group's codes.
    fn group_bytes(&self) -> usize {
        if self.six {
            SIX_GROUP_BYTES
        } else {
            PANEL_GROUP_BYTES
        }
    }

    /// Group `g` (panel order) of panel `p`'s codes.
    fn group(&self, p: usize, g: usize) -> &[u8] {
        let n = self.group_bytes();
        &self.codes[(p * self.groups() + g) * n..][..n]
    }

    /// The weight of column `k` (0..16) of a group's codes, lane `lane`.
    fn code(&self, group: &[u8], lane: usize, k: usize) -> i8 {
        if !self.six {
            return (group[byte_at(lane, k)] ^ 0x80) as i8;
        }
        let (t, i) = (k / 4, k % 4);
        let nib = (group[64 * (t / 2) + 4 * lane + i] >> (4 * (t % 2))) & 0x0F;
        let high = (group[128 + 4 * lane + i] >> (2 * t)) & 0x03;
        (i32::from(nib | high << 4) - SIX_OFFSET) as i8
    }

    /// Row `r`'s codes in column order (the byte form's row), appended to `out`.
    pub(crate) fn row_into(&self, r: usize, out: &mut Vec<u8>) {
        let (p, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
        for b in 0..self.blocks {
            for j in 0..POSITIONS {
                let src = self.group(p, group_at(self.blocks, b, j));
                out.extend((0..GROUP).map(|k| self.code(src, lane, k) as u8));
            }
        }
    }

    /// The scales back in the matrix's row layout: `(scales, sc8, supers)` as
    /// [`QMatrix`] holds them (f32 per group, or `Q6_K`'s bytes with `d` per block).
    pub(crate) fn scales_back(&self) -> (Vec<f32>, Vec<i8>, Vec<f32>) {
        let groups = self.groups();
        let (mut f, mut sc8, mut supers) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..self.rows {
            let (p, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
            for b in 0..self.blocks {
                if let Scales::K { d, .. } = &self.scales {
                    supers.push(d[(p * self.blocks + b) * PANEL_ROWS + lane]);
                }
                for j in 0..POSITIONS {
                    let at = (p * groups + group_at(self.blocks, b, j)) * PANEL_ROWS + lane;
                    match &self.scales {
                        Scales::F32(s) => f.push(s[at]),
                        Scales::K { sc, .. } => sc8.push(sc[at]),
                    }
                }
            }
        }
        (f, sc8, supers)
    }

    /// Row `r`'s group scales as f32 in column order (`Q6_K`: `d·sc`, as reading the block
    /// did), into `out` (cleared).
    pub(crate) fn row_scales_into(&self, r: usize, out: &mut Vec<f32>) {
        out.clear();
        let (p, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
        for b in 0..self.blocks {
            for j in 0..POSITIONS {
                out.push(self.scale(p, group_at(self.blocks, b, j), lane));
            }
        }
    }

    /// Group `g` (panel order) of panel `p`'s scale in `lane`.
    fn scale(&self, p: usize, g: usize, lane: usize) -> f32 {
        let at = (p * self.groups() + g) * PANEL_ROWS + lane;
        match &self.scales {
            Scales::F32(s) => s[at],
            Scales::K { sc, d } => {
                // Panel order is position-major: the block is `g % blocks`.
                let b = g % self.blocks;
                d[(p * self.blocks + b) * PANEL_ROWS + lane] * f32::from(sc[at])
            }
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.codes.len()
            + match &self.scales {
                Scales::F32(s) => 4 * s.len(),
                Scales::K { sc, d } => sc.len() + 4 * d.len(),
            }
    }
}

/// Activation rows for the byte kernels: the int16 quantization, with (for VNNI) its bytes.
pub(crate) struct Acts {
    cols: usize,
    blocks: usize,
    /// The int16 activations (the AVX2 and scalar kernels read them as the nibble ones do).
    q: Quantized,
    /// `[m][group][16]`, the panels' group order: `xq`'s high byte `h`, signed (VNNI only; a
    /// kernel's pass over one group position reads each row's bytes in sequence).
    high: Vec<i8>,
    /// The same: its low byte `l` (unsigned).
    low: Vec<u8>,
    /// `[m][groups]`, the panels' group order: `32,768·Σ h` over the group, six-bit panels
    /// `32·Σ xq` (VNNI only).
    corr: Vec<i32>,
    /// `[m][groups]`, the panels' group order: the group's `dx` (of its 32-column
    /// quantization group).
    dx: Vec<f32>,
}

/// Quantizes `m` rows of `cols` (whole blocks) floats into what `kernel` reads.
pub(crate) fn prepare(x: &[f32], m: usize, cols: usize, kernel: Kernel, six: bool) -> Acts {
    let q = quantize(x, m, cols, Bits::I16);
    let (blocks, groups) = (cols / BLOCK, cols / GROUP);
    let bytes = kernel == Kernel::Vnni;
    let n8 = if bytes { m * cols } else { 0 };
    let mut a = Acts {
        cols,
        blocks,
        high: vec![0; n8],
        low: vec![0; n8],
        corr: vec![0; if bytes { m * groups } else { 0 }],
        dx: vec![0.0; m * groups],
        q,
    };
    for i in 0..m {
        for b in 0..blocks {
            for j in 0..POSITIONS {
                let g = i * groups + group_at(blocks, b, j);
                let c0 = b * BLOCK + j * GROUP;
                a.dx[g] = a.q.scale(i, c0 / ACT_GROUP);
                if bytes {
                    let (mut high, mut all) = (0i32, 0i32);
                    for c in c0..c0 + GROUP {
                        let v = a.q.value(i, c);
                        // |v| ≤ 32,767: the high byte is in -128..128 (arithmetic shift).
                        let at = g * GROUP + c - c0;
                        a.high[at] = (v >> 8) as i8;
                        a.low[at] = (v & 0xFF) as u8;
                        high += v >> 8;
                        all += v;
                    }
                    // |32·Σ xq| ≤ 32·16·32,767 < 2³¹.
                    a.corr[g] = if six { SIX_OFFSET * all } else { 32_768 * high };
                }
            }
        }
    }
    a
}

/// The position sums of a row added in the kernels' fixed tree: positions `j + 8`, then
/// `j + 4`, `j + 2`, `j + 1`.
fn tree16(v: &[f32; POSITIONS]) -> f32 {
    let t8: [f32; 8] = std::array::from_fn(|j| v[j] + v[j + 8]);
    let t4: [f32; 4] = std::array::from_fn(|j| t8[j] + t8[j + 4]);
    let t2: [f32; 2] = std::array::from_fn(|j| t4[j] + t4[j + 2]);
    t2[0] + t2[1]
}

/// Activation rows a thread runs against its panels at a time.
fn chunk_rows(cols: usize) -> usize {
    (CHUNK_BYTES / (2 * cols))
        .max(ROWS_512)
        .next_multiple_of(ROWS_512)
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
    let a = prepare(x, m, mat.cols(), kernel, pan.six);
    let panels = rows.div_ceil(PANEL_ROWS);
    let units = if rows * mat.cols() * m < PAR_MIN_MACS {
        1
    } else {
        threads.min(panels).max(1)
    };
    let share = panels.div_ceil(units);
    let out = Out::new(y, rows);
    let chunk = chunk_rows(mat.cols());
    let run = |u: usize| {
        let (p0, p1) = ((u * share).min(panels), ((u + 1) * share).min(panels));
        for c0 in (0..m).step_by(chunk) {
            let c1 = (c0 + chunk).min(m);
            for p in p0..p1 {
                panel(kernel, pan, p, &a, c0, c1, out);
            }
        }
    };
    if units == 1 {
        run(0);
    } else {
        engram_kvcore::team::run(units, &run);
    }
}

/// Panel `p` against activation rows `c0..c1`.
fn panel(kernel: Kernel, pan: &Panels, p: usize, a: &Acts, c0: usize, c1: usize, out: Out) {
    let r0 = p * PANEL_ROWS;
    let live = PANEL_ROWS.min(pan.rows - r0);
    let mut i = c0;
    while i < c1 {
        let mut y = [[0f32; PANEL_ROWS]; ROWS_512];
        let n = match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => {
                let n = ROWS_512.min(c1 - i);
                macro_rules! by_n {
                    ($($k:literal)*) => {
                        match n {
                            // SAFETY: `kernel_for` chose `Vnni` only where the CPU reports
                            // AVX-512 BW and VNNI; rows `i..i + n` exist in `a`, prepared for
                            // it; `p` is a panel of `pan`, of `a`'s width.
                            $($k => unsafe {
                                if pan.six {
                                    x86::panel_vnni::<$k, true>(pan, p, a, i, &mut y)
                                } else {
                                    x86::panel_vnni::<$k, false>(pan, p, a, i, &mut y)
                                }
                            },)*
                            _ => {}
                        }
                    };
                }
                by_n!(1 2 3 4 5 6 7 8);
                n
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                let n = ROWS_256.min(c1 - i);
                macro_rules! by_n {
                    ($($k:literal)*) => {
                        match n {
                            // SAFETY: `kernel_for` chose `Avx2` only where the CPU reports AVX2
                            // and FMA; rows `i..i + n` exist in `a`; `p` is a panel of `pan`, of
                            // `a`'s width.
                            $($k => unsafe {
                                if pan.six {
                                    x86::panel_avx2::<$k, true>(pan, p, a, i, &mut y)
                                } else {
                                    x86::panel_avx2::<$k, false>(pan, p, a, i, &mut y)
                                }
                            },)*
                            _ => {}
                        }
                    };
                }
                by_n!(1 2 3 4);
                n
            }
            _ => {
                let n = ROWS_512.min(c1 - i);
                for (k, yk) in y.iter_mut().enumerate().take(n) {
                    for (lane, v) in yk.iter_mut().enumerate().take(live) {
                        *v = scalar(pan, p, lane, a, i + k);
                    }
                }
                n
            }
        };
        for (k, yk) in y.iter().enumerate().take(n) {
            out.put_run(i + k, r0, &yk[..live]);
        }
        i += n;
    }
}

/// The reference: lane `lane` of panel `p` against activation row `i`.
fn scalar(pan: &Panels, p: usize, lane: usize, a: &Acts, i: usize) -> f32 {
    let mut sums = [0f32; POSITIONS];
    for (j, sum) in sums.iter_mut().enumerate() {
        for b in 0..a.blocks {
            let g = group_at(a.blocks, b, j);
            let w = pan.group(p, g);
            let c0 = b * BLOCK + j * GROUP;
            let isum: i32 = (0..GROUP)
                .map(|k| i32::from(pan.code(w, lane, k)) * a.q.value(i, c0 + k))
                .sum();
            let sd = pan.scale(p, g, lane) * a.dx[i * pan.groups() + g];
            *sum = (isum as f32).mul_add(sd, *sum);
        }
    }
    tree16(&sums)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Acts, PANEL_ROWS, POSITIONS, Panels, SIX_OFFSET, Scales};

    /// A panel group's four byte vectors: loaded (`w + 128`), or for six-bit panels rebuilt from
    /// its two nibble vectors and its high-bits vector (`u = w + 32`, see the module doc). The
    /// 16-bit shifts move no bit of one byte into the kept bits of the other.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F and BW; `w` points at a whole panel group of `SIX`'s form.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn group512<const SIX: bool>(w: *const u8) -> [__m512i; 4] {
        // SAFETY: a group holds four (six-bit: three) 64-byte vectors.
        unsafe {
            let v = |t: usize| _mm512_loadu_si512(w.add(64 * t).cast());
            if !SIX {
                return [v(0), v(1), v(2), v(3)];
            }
            let (l0, l1, hb) = (v(0), v(1), v(2));
            let (lo, hi) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
            let join = |n: __m512i, h: __m512i| {
                _mm512_or_si512(_mm512_and_si512(n, lo), _mm512_and_si512(h, hi))
            };
            [
                join(l0, _mm512_slli_epi16::<4>(hb)),
                join(_mm512_srli_epi16::<4>(l0), _mm512_slli_epi16::<2>(hb)),
                join(l1, hb),
                join(_mm512_srli_epi16::<4>(l1), _mm512_srli_epi16::<2>(hb)),
            ]
        }
    }

    /// The AVX2 half (`half`: lanes `8·half..8·half + 8`) of [`group512`], as signed weights.
    ///
    /// # Safety
    /// The CPU runs AVX2; `w` points at a whole panel group of `SIX`'s form.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn group256<const SIX: bool>(w: *const u8, half: usize) -> [__m256i; 4] {
        // SAFETY: a group holds four (six-bit: three) 64-byte vectors.
        unsafe {
            let v = |t: usize| _mm256_loadu_si256(w.add(64 * t + 32 * half).cast());
            if !SIX {
                let flip = _mm256_set1_epi8(0x80u8 as i8);
                return [0, 1, 2, 3].map(|t| _mm256_xor_si256(v(t), flip));
            }
            let (l0, l1, hb) = (v(0), v(1), v(2));
            let (lo, hi) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
            let off = _mm256_set1_epi8(SIX_OFFSET as i8);
            let join = |n: __m256i, h: __m256i| {
                _mm256_sub_epi8(
                    _mm256_or_si256(_mm256_and_si256(n, lo), _mm256_and_si256(h, hi)),
                    off,
                )
            };
            [
                join(l0, _mm256_slli_epi16::<4>(hb)),
                join(_mm256_srli_epi16::<4>(l0), _mm256_slli_epi16::<2>(hb)),
                join(l1, hb),
                join(_mm256_srli_epi16::<4>(l1), _mm256_srli_epi16::<2>(hb)),
            ]
        }
    }

    /// Group `g` of panel `p`'s 16 scales (`Q6_K`: `d·sc`, formed as [`Panels::scale`] does).
    ///
    /// # Safety
    /// The CPU runs AVX-512 F; `p` is a panel of `pan` and `g` one of its groups.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn scales512(pan: &Panels, p: usize, g: usize) -> __m512 {
        let at = (p * pan.groups() + g) * PANEL_ROWS;
        // SAFETY: 16 scales (or scale bytes) per panel group, 16 `d` per panel block.
        unsafe {
            match &pan.scales {
                Scales::F32(s) => _mm512_loadu_ps(s.as_ptr().add(at)),
                Scales::K { sc, d } => {
                    let b = g % pan.blocks;
                    let dv = _mm512_loadu_ps(d.as_ptr().add((p * pan.blocks + b) * PANEL_ROWS));
                    let s = _mm_loadu_si128(sc.as_ptr().add(at).cast());
                    _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s)))
                }
            }
        }
    }

    /// The AVX2 half (`half`: lanes `8·half..8·half + 8`) of [`scales512`].
    ///
    /// # Safety
    /// The CPU runs AVX2; `p` is a panel of `pan` and `g` one of its groups.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scales256(pan: &Panels, p: usize, g: usize, half: usize) -> __m256 {
        let at = (p * pan.groups() + g) * PANEL_ROWS + 8 * half;
        // SAFETY: 16 scales (or scale bytes) per panel group, 16 `d` per panel block.
        unsafe {
            match &pan.scales {
                Scales::F32(s) => _mm256_loadu_ps(s.as_ptr().add(at)),
                Scales::K { sc, d } => {
                    let b = g % pan.blocks;
                    let dv = _mm256_loadu_ps(
                        d.as_ptr().add((p * pan.blocks + b) * PANEL_ROWS + 8 * half),
                    );
                    let s = _mm_loadl_epi64(sc.as_ptr().add(at).cast());
                    _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)))
                }
            }
        }
    }

    /// `acc` plus, per 32-bit lane, the four products of `u`'s unsigned bytes with the four
    /// signed bytes at `p` (broadcast): `vpdpbusd` with a broadcast operand. Written out (and
    /// [`dpbusd_unsigned_bcst`]) because LLVM hoists every broadcast of a group ahead of the
    /// products and spills them to the stack (the kernel ran 1.25× slower on a 256-row chunk).
    ///
    /// # Safety
    /// The CPU runs AVX-512 F and VNNI; `p` points at 4 readable bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpbusd_signed_bcst(acc: __m512i, u: __m512i, p: *const i8) -> __m512i {
        let mut acc = acc;
        // SAFETY: the caller's promise; the instruction reads 4 bytes at `p` and writes `acc`.
        unsafe {
            std::arch::asm!(
                "vpdpbusd {acc}, {u}, dword ptr [{p}]{{1to16}}",
                acc = inout(zmm_reg) acc,
                u = in(zmm_reg) u,
                p = in(reg) p,
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        acc
    }

    /// `acc` plus, per 32-bit lane, the four products of the unsigned bytes at `p`
    /// (broadcast) with `s`'s signed bytes.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F and VNNI; `p` points at 4 readable bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpbusd_unsigned_bcst(acc: __m512i, p: *const u8, s: __m512i) -> __m512i {
        let mut acc = acc;
        // SAFETY: the caller's promise; the broadcast reads 4 bytes at `p`.
        unsafe {
            std::arch::asm!(
                "vpbroadcastd {x}, dword ptr [{p}]",
                "vpdpbusd {acc}, {x}, {s}",
                acc = inout(zmm_reg) acc,
                x = out(zmm_reg) _,
                s = in(zmm_reg) s,
                p = in(reg) p,
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        acc
    }

    /// Panel `p` against activation rows `i0..i0 + R` into `y[i][lane]`: per group position,
    /// the rows' sums over the blocks in registers, then the tree over positions (as
    /// [`super::tree16`], on 16 rows at once).
    ///
    /// # Safety
    /// The CPU runs AVX-512 F, BW and VNNI; `p` is a panel of `pan`; rows `i0..i0 + R` exist
    /// in `a`, prepared for this kernel, of the panels' width.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn panel_vnni<const R: usize, const SIX: bool>(
        pan: &Panels,
        p: usize,
        a: &Acts,
        i0: usize,
        y: &mut [[f32; PANEL_ROWS]; super::ROWS_512],
    ) {
        let flip = _mm512_set1_epi8(0x80u8 as i8);
        let groups = pan.groups();
        let mut sums = [[_mm512_setzero_ps(); R]; POSITIONS];
        for (j, sum) in sums.iter_mut().enumerate() {
            let mut acc = [_mm512_setzero_ps(); R];
            for b in 0..pan.blocks {
                let g = super::group_at(pan.blocks, b, j);
                // SAFETY: `g` is a group of panel `p`, of the panels' form.
                let wv = unsafe {
                    group512::<SIX>(pan.codes.as_ptr().add((p * groups + g) * pan.group_bytes()))
                };
                let mut h = [_mm512_setzero_si512(); R];
                let mut l = [_mm512_setzero_si512(); R];
                for (t, &wu) in wv.iter().enumerate() {
                    // Six-bit codes are their own signed bytes.
                    let ws = if SIX { wu } else { _mm512_xor_si512(wu, flip) };
                    for i in 0..R {
                        let at = ((i0 + i) * groups + g) * super::GROUP + 4 * t;
                        // SAFETY: row `i0 + i` holds the group's columns in both arrays.
                        unsafe {
                            h[i] = dpbusd_signed_bcst(h[i], wu, a.high.as_ptr().add(at).cast());
                            l[i] = dpbusd_unsigned_bcst(l[i], a.low.as_ptr().add(at), ws);
                        }
                    }
                }
                // SAFETY: `g` is a group of panel `p`.
                let s = unsafe { scales512(pan, p, g) };
                for i in 0..R {
                    let k = (i0 + i) * groups + g;
                    let isum = _mm512_sub_epi32(
                        _mm512_add_epi32(_mm512_slli_epi32::<8>(h[i]), l[i]),
                        _mm512_set1_epi32(a.corr[k]),
                    );
                    acc[i] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(isum),
                        _mm512_mul_ps(s, _mm512_set1_ps(a.dx[k])),
                        acc[i],
                    );
                }
            }
            *sum = acc;
        }
        for (i, yi) in y.iter_mut().enumerate().take(R) {
            let t8: [__m512; 8] =
                std::array::from_fn(|j| _mm512_add_ps(sums[j][i], sums[j + 8][i]));
            let t4: [__m512; 4] = std::array::from_fn(|j| _mm512_add_ps(t8[j], t8[j + 4]));
            let t2: [__m512; 2] = std::array::from_fn(|j| _mm512_add_ps(t4[j], t4[j + 2]));
            // SAFETY: `yi` holds 16 floats.
            unsafe { _mm512_storeu_ps(yi.as_mut_ptr(), _mm512_add_ps(t2[0], t2[1])) };
        }
    }

    /// [`panel_vnni`] with 16-bit products (`vpmaddwd`), 8 rows of the panel at a time: the
    /// bytes sign-extended into words pairing columns `(0, 2)` and `(1, 3)` of each four, as the
    /// int16 activations are stored. The same integer sums and float steps.
    ///
    /// # Safety
    /// The CPU runs AVX2 and FMA; `p` is a panel of `pan`; rows `i0..i0 + R` exist in `a`, of
    /// the panels' width.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn panel_avx2<const R: usize, const SIX: bool>(
        pan: &Panels,
        p: usize,
        a: &Acts,
        i0: usize,
        y: &mut [[f32; PANEL_ROWS]; super::ROWS_512],
    ) {
        let groups = pan.groups();
        let q16 = a.q.q16();
        for half in 0..2 {
            let mut sums = [[_mm256_setzero_ps(); R]; POSITIONS];
            for (j, sum) in sums.iter_mut().enumerate() {
                let mut acc = [_mm256_setzero_ps(); R];
                for b in 0..pan.blocks {
                    let g = super::group_at(pan.blocks, b, j);
                    let col = b * super::BLOCK + j * super::GROUP;
                    // SAFETY: `g` is a group of panel `p`, of the panels' form.
                    let wv = unsafe {
                        group256::<SIX>(
                            pan.codes.as_ptr().add((p * groups + g) * pan.group_bytes()),
                            half,
                        )
                    };
                    let mut isum = [_mm256_setzero_si256(); R];
                    for (t, &ws) in wv.iter().enumerate() {
                        let even = _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(ws));
                        let odd = _mm256_srai_epi16::<8>(ws);
                        for (i, s) in isum.iter_mut().enumerate() {
                            let at = (i0 + i) * a.cols + col + 4 * t;
                            // SAFETY: row `i0 + i` holds the four columns from `at`, in the
                            // int16 layout's order (columns 0, 2, 1, 3).
                            let (x02, x13) = unsafe {
                                (
                                    std::ptr::read_unaligned(q16.as_ptr().add(at).cast::<i32>()),
                                    std::ptr::read_unaligned(
                                        q16.as_ptr().add(at + 2).cast::<i32>(),
                                    ),
                                )
                            };
                            let pairs = _mm256_add_epi32(
                                _mm256_madd_epi16(even, _mm256_set1_epi32(x02)),
                                _mm256_madd_epi16(odd, _mm256_set1_epi32(x13)),
                            );
                            *s = _mm256_add_epi32(*s, pairs);
                        }
                    }
                    // SAFETY: `g` is a group of panel `p`.
                    let s = unsafe { scales256(pan, p, g, half) };
                    for i in 0..R {
                        let k = (i0 + i) * groups + g;
                        acc[i] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(isum[i]),
                            _mm256_mul_ps(s, _mm256_set1_ps(a.dx[k])),
                            acc[i],
                        );
                    }
                }
                *sum = acc;
            }
            for (i, yi) in y.iter_mut().enumerate().take(R) {
                let t8: [__m256; 8] =
                    std::array::from_fn(|j| _mm256_add_ps(sums[j][i], sums[j + 8][i]));
                let t4: [__m256; 4] = std::array::from_fn(|j| _mm256_add_ps(t8[j], t8[j + 4]));
                let t2: [__m256; 2] = std::array::from_fn(|j| _mm256_add_ps(t4[j], t4[j + 2]));
                // SAFETY: `yi` holds 16 floats; this writes lanes `8·half..8·half + 8`.
                unsafe {
                    _mm256_storeu_ps(yi.as_mut_ptr().add(8 * half), _mm256_add_ps(t2[0], t2[1]));
                }
            }
        }
    }
}
