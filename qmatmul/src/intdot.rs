//! Products of the nibble form with integer activations: int16 (W4A16) or int8 (W4A8, the
//! numerics llama.cpp's CPU backend uses for its 4-bit blocks).
//!
//! Each activation row is quantized per 32 columns (one nibble group) to `L` levels (32,767 for
//! int16, 127 for int8): `dx = max|x| / L` and `xq = round(x / dx)` (ties to even), so
//! `x ≈ dx·xq` with `|xq| ≤ L`. A group's weights are `q·s + o` with `q` in `0..16`, and its part
//! of an output is `s·dx·Σ q·xq + o·dx·Σ xq`: the integer sums are exact (at most 32·15·32,767 <
//! 2²⁴ in magnitude, so exact in f32 too), and the two float terms are added in group order with
//! fused multiply-adds. So an output is the product of the weights with the quantized
//! activations, rounded the same on every kernel tier, for any number of activation rows and any
//! thread count. Int16 rounds an activation to 1/65,534 of its group's largest magnitude (below
//! f32 rounding noise of the model, see `engram eval kv`); int8 to 1/254, which moves answers.
//!
//! The weights are repacked once into panels of [`PANEL_ROWS`] rows: per 32-column group, four
//! 64-byte vectors whose 32-bit lane `j` holds row `j`'s nibbles for 8 columns (columns `c..c+4`
//! in the low nibbles, `c+4..c+8` in the high ones); the 4-bit memory footprint is kept. For
//! int8, one `vpdpbusd` adds four products into each of 16 rows' sums; for int16, the low (or
//! high) nibbles split into even and odd 16-bit words, and one `vpdpwssd` adds two products, the
//! activations stored with columns `1` and `2` of every four swapped to match.
//!
//! A group's scale and offset are f32 per row, or for `Q4_K` weights the block's own form: a
//! byte `sc` and a byte `m` per group and row, with the `d` and `−dmin` of each 256 columns, the
//! kernels forming `d·sc` and `(−dmin)·m` as the reading of the blocks did (the same bits:
//! 0.59 bytes a weight instead of 0.75).
#![allow(unsafe_code)]

use crate::kernel::Out;
use crate::{Form, Isa, QMatrix, Row};

/// Weight rows per panel (one 32-bit lane each of a 512-bit register).
pub const PANEL_ROWS: usize = 16;
/// Columns per quantization group of the activations (a nibble group of the weights).
const GROUP: usize = 32;
/// Code bytes of one panel's group: 16 rows × 32 nibbles.
const PANEL_GROUP_BYTES: usize = PANEL_ROWS * GROUP / 2;
/// Groups of a `Q4_K` block (256 columns), which share its `d` and `dmin`.
const SUPER_GROUPS: usize = 8;
/// The integer activations of a product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bits {
    I16,
    I8,
}

impl Bits {
    fn levels(self) -> f32 {
        match self {
            Bits::I16 => 32_767.0,
            Bits::I8 => 127.0,
        }
    }
}

/// Where column `k` of a group sits in the int16 activations: columns 1 and 2 of every four
/// swapped, so the words a `vpdpwssd` lane pairs, `(c, c + 2)` and `(c + 1, c + 3)`, are
/// adjacent.
fn i16_slot(k: usize) -> usize {
    (k & !3) | [0, 2, 1, 3][k & 3]
}

/// Activation rows the 512-bit kernel carries at once.
const ROWS_512: usize = 8;
/// Activation rows the 256-bit kernel carries at once.
const ROWS_256: usize = 4;
/// Multiply-adds below which one thread does the whole product.
const PAR_MIN_MACS: usize = 1 << 16;
/// `v + MAGIC − MAGIC` rounds `|v| < 2²²` to an integer, ties to even (the default rounding).
const MAGIC: f32 = 12_582_912.0;

/// A nibble matrix's weights repacked into panels for the int8 kernels.
#[derive(Clone, PartialEq)]
pub(crate) struct Panels {
    groups: usize,
    /// `[panel][group][PANEL_GROUP_BYTES]`.
    codes: Vec<u8>,
    /// The groups' scales and offsets.
    scales: Scales,
}

/// How panels hold their groups' scales and offsets; rows past the matrix are 0.
#[derive(Clone, PartialEq)]
pub(crate) enum Scales {
    /// `[panel][group][PANEL_ROWS]` each.
    F32 { scales: Vec<f32>, offsets: Vec<f32> },
    /// `Q4_K`'s: the scale is `d·sc` and the offset `nmin·m`, `sc` and `m` bytes
    /// `[panel][group][PANEL_ROWS]`, `d` and `nmin` (`−dmin`) `[panel][group / 8][PANEL_ROWS]`.
    K {
        sc: Vec<u8>,
        m: Vec<u8>,
        d: Vec<f32>,
        nmin: Vec<f32>,
    },
}

/// The byte `k` with `base·k` exactly `v` (the same bits), if there is one.
fn multiple_of(base: f32, v: f32) -> Option<u8> {
    let k = if base != 0.0 && base.is_finite() {
        (v / base).round()
    } else {
        0.0
    };
    if !(0.0..=255.0).contains(&k) {
        return None;
    }
    let k = k as u8;
    ((base * f32::from(k)).to_bits() == v.to_bits()).then_some(k)
}

impl Panels {
    /// The panels of a nibble matrix (`None` for another form).
    pub(crate) fn of(m: &QMatrix) -> Option<Self> {
        if m.form() != Form::Nibbles {
            return None;
        }
        let (rows, groups) = (m.rows(), m.cols() / GROUP);
        let panels = rows.div_ceil(PANEL_ROWS);
        let scales = Self::k_scales(m).unwrap_or_else(|| Scales::F32 {
            scales: vec![0.0; panels * groups * PANEL_ROWS],
            offsets: vec![0.0; panels * groups * PANEL_ROWS],
        });
        let mut p = Self {
            groups,
            codes: vec![0; panels * groups * PANEL_GROUP_BYTES],
            scales,
        };
        for r in 0..rows {
            let (panel, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
            let row = m.row(r);
            for g in 0..groups {
                let at = panel * groups + g;
                if let Scales::F32 { scales, offsets } = &mut p.scales {
                    scales[at * PANEL_ROWS + lane] = row.scales[g];
                    offsets[at * PANEL_ROWS + lane] = row.offsets[g];
                }
                let q = |k: usize| nibble(&row.codes[g * 16..][..16], k);
                let dst = &mut p.codes[at * PANEL_GROUP_BYTES..][..PANEL_GROUP_BYTES];
                for v in 0..4 {
                    for t in 0..4 {
                        let c = 8 * v + t;
                        dst[64 * v + 4 * lane + t] = q(c) | (q(c + 4) << 4);
                    }
                }
            }
        }
        Some(p)
    }

    /// `Q4_K`'s scales of `m` (rows held in rows, with their blocks' `d` and `dmin`) when every
    /// group's scale and offset is exactly a byte multiple of them; else `None`.
    fn k_scales(m: &QMatrix) -> Option<Scales> {
        let (rows, groups) = (m.rows(), m.cols() / GROUP);
        let supers = groups / SUPER_GROUPS;
        if m.supers.len() != rows * supers * 2 || !groups.is_multiple_of(SUPER_GROUPS) {
            return None;
        }
        let panels = rows.div_ceil(PANEL_ROWS);
        let mut sc = vec![0; panels * groups * PANEL_ROWS];
        let mut mins = vec![0; panels * groups * PANEL_ROWS];
        let mut d = vec![0.0; panels * supers * PANEL_ROWS];
        let mut nmin = vec![0.0; panels * supers * PANEL_ROWS];
        for r in 0..rows {
            let (panel, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
            let row = m.row(r);
            for j in 0..supers {
                let (dj, nj) = (
                    m.supers[(r * supers + j) * 2],
                    -m.supers[(r * supers + j) * 2 + 1],
                );
                let at = (panel * supers + j) * PANEL_ROWS + lane;
                d[at] = dj;
                nmin[at] = nj;
                for g in j * SUPER_GROUPS..(j + 1) * SUPER_GROUPS {
                    let at = (panel * groups + g) * PANEL_ROWS + lane;
                    sc[at] = multiple_of(dj, row.scales[g])?;
                    mins[at] = multiple_of(nj, row.offsets[g])?;
                }
            }
        }
        Some(Scales::K {
            sc,
            m: mins,
            d,
            nmin,
        })
    }

    /// Whether the panels hold the matrix's `Q4_K` `d` and `dmin` (its rows then do not).
    pub(crate) fn holds_supers(&self) -> bool {
        matches!(self.scales, Scales::K { .. })
    }

    /// Appends row `r`'s `d`, `dmin` pairs when the panels hold them.
    pub(crate) fn supers_into(&self, r: usize, out: &mut Vec<f32>) {
        if let Scales::K { d, nmin, .. } = &self.scales {
            let (panel, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
            let supers = self.groups / SUPER_GROUPS;
            for j in 0..supers {
                let at = (panel * supers + j) * PANEL_ROWS + lane;
                out.extend([d[at], -nmin[at]]);
            }
        }
    }

    /// Group `g` of panel `p`'s scale and offset of `lane`.
    fn scale_offset(&self, p: usize, g: usize, lane: usize) -> (f32, f32) {
        let at = (p * self.groups + g) * PANEL_ROWS + lane;
        match &self.scales {
            Scales::F32 { scales, offsets } => (scales[at], offsets[at]),
            Scales::K { sc, m, d, nmin } => {
                let sup = (p * (self.groups / SUPER_GROUPS) + g / SUPER_GROUPS) * PANEL_ROWS + lane;
                (d[sup] * f32::from(sc[at]), nmin[sup] * f32::from(m[at]))
            }
        }
    }

    /// Row `r`'s groups back in the nibble form's row layout (the panels are the matrix's only
    /// copy once [`QMatrix::with_activations`] built them): `scales`, `offsets` and `codes` are
    /// cleared and refilled.
    pub(crate) fn row_into(
        &self,
        r: usize,
        scales: &mut Vec<f32>,
        offsets: &mut Vec<f32>,
        codes: &mut Vec<u8>,
    ) {
        let (panel, lane) = (r / PANEL_ROWS, r % PANEL_ROWS);
        scales.clear();
        offsets.clear();
        codes.clear();
        for g in 0..self.groups {
            let at = panel * self.groups + g;
            let (s, o) = self.scale_offset(panel, g, lane);
            scales.push(s);
            offsets.push(o);
            let src = &self.codes[at * PANEL_GROUP_BYTES..][..PANEL_GROUP_BYTES];
            let mut q = [0u8; GROUP];
            for v in 0..4 {
                for t in 0..4 {
                    let b = src[64 * v + 4 * lane + t];
                    q[8 * v + t] = b & 0xF;
                    q[8 * v + t + 4] = b >> 4;
                }
            }
            codes.extend((0..16).map(|k| q[k] | (q[k + 16] << 4)));
        }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.codes.len()
            + match &self.scales {
                Scales::F32 { scales, offsets } => 4 * (scales.len() + offsets.len()),
                Scales::K { sc, m, d, nmin } => sc.len() + m.len() + 4 * (d.len() + nmin.len()),
            }
    }
}

/// Weight `k` (0..32) of a nibble group's 16 code bytes.
fn nibble(codes: &[u8], k: usize) -> u8 {
    if k < 16 {
        codes[k] & 0xF
    } else {
        codes[k - 16] >> 4
    }
}

/// Activation rows quantized per 32 columns.
pub(crate) struct Quantized {
    cols: usize,
    groups: usize,
    /// `[m][cols]` (int8 only).
    q: Vec<i8>,
    /// `[m][cols]`, each group in [`i16_slot`] order (int16 only).
    q16: Vec<i16>,
    /// `[m][groups]`: the scale `dx`.
    d: Vec<f32>,
    /// `[m][groups]`: `dx·Σ xq`.
    s: Vec<f32>,
}

/// Quantizes `m` rows of `cols` (a multiple of 32) floats.
pub(crate) fn quantize(x: &[f32], m: usize, cols: usize, bits: Bits) -> Quantized {
    let groups = cols / GROUP;
    let (n8, n16) = match bits {
        Bits::I8 => (m * cols, 0),
        Bits::I16 => (0, m * cols),
    };
    let mut a = Quantized {
        cols,
        groups,
        q: vec![0; n8],
        q16: vec![0; n16],
        d: vec![0.0; m * groups],
        s: vec![0.0; m * groups],
    };
    #[cfg(target_arch = "x86_64")]
    if bits == Bits::I16
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        // SAFETY: the CPU runs AVX-512 F and BW; the arrays hold `m · cols` values and
        // `m · groups` groups.
        unsafe { x86::quantize_i16(&x[..m * cols], &mut a.q16, &mut a.d, &mut a.s) };
        return a;
    }
    quantize_groups(x, m, cols, bits, &mut a);
    a
}

/// [`quantize`] one group at a time (every CPU; the reference of the AVX-512 form).
fn quantize_groups(x: &[f32], m: usize, cols: usize, bits: Bits, a: &mut Quantized) {
    let levels = bits.levels();
    for (i, xg) in x[..m * cols].chunks_exact(GROUP).enumerate() {
        // The largest magnitude, in eight lanes (exact in any order).
        let mut lanes = [0f32; 8];
        for c in xg.chunks_exact(8) {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l = l.max(v.abs());
            }
        }
        let amax = lanes.iter().fold(0f32, |a, &l| a.max(l));
        if amax == 0.0 || !amax.is_finite() {
            continue;
        }
        let inv = levels / amax;
        let round = |v: f32| ((v * inv + MAGIC) - MAGIC).clamp(-levels, levels) as i32;
        let mut sum = 0i32;
        match bits {
            Bits::I8 => {
                for (q, &v) in a.q[i * GROUP..][..GROUP].iter_mut().zip(xg) {
                    let r = round(v);
                    *q = r as i8;
                    sum += r;
                }
            }
            Bits::I16 => {
                let qg = &mut a.q16[i * GROUP..][..GROUP];
                for (k, &v) in xg.iter().enumerate() {
                    let r = round(v);
                    qg[i16_slot(k)] = r as i16;
                    sum += r;
                }
            }
        }
        let dx = amax / levels;
        a.d[i] = dx;
        a.s[i] = dx * sum as f32;
    }
}

/// [`quantize`]'s rows scaled back to floats (`dx·xq`), in column order.
pub(crate) fn dequantized(x: &[f32], m: usize, cols: usize, bits: Bits) -> Vec<f32> {
    let a = quantize(x, m, cols, bits);
    (0..m * cols)
        .map(|k| a.value(k / cols, k % cols) as f32 * a.d[k / GROUP])
        .collect()
}

impl Quantized {
    /// The int16 activations, `[m][cols]`, each group in [`i16_slot`] order (empty for int8).
    pub(crate) fn q16(&self) -> &[i16] {
        &self.q16
    }

    /// Row `i`'s scale `dx` of group `g`.
    pub(crate) fn scale(&self, i: usize, g: usize) -> f32 {
        self.d[i * self.groups + g]
    }

    /// Row `i`'s quantized column `c`.
    pub(crate) fn value(&self, i: usize, c: usize) -> i32 {
        let at = i * self.cols + c;
        if self.q16.is_empty() {
            i32::from(self.q[at])
        } else {
            i32::from(self.q16[at - c % GROUP + i16_slot(c % GROUP)])
        }
    }
}

/// Which integer kernel runs a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// AVX-512 with VNNI (`vpdpbusd`).
    Vnni,
    /// AVX2 (`vpmaddubsw` + `vpmaddwd`), also for AVX-512 without VNNI.
    Avx2,
    Scalar,
}

pub(crate) fn kernel_for(isa: Isa) -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        match isa {
            Isa::Avx512
                if std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vnni") =>
            {
                return Kernel::Vnni;
            }
            Isa::Avx512 | Isa::Avx2
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma") =>
            {
                return Kernel::Avx2;
            }
            _ => {}
        }
    }
    let _ = isa;
    Kernel::Scalar
}

/// `y = x · Wᵀ` through the panels (the caller checked the lengths and that the CPU runs `isa`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(
    isa: Isa,
    mat: &QMatrix,
    pan: &Panels,
    bits: Bits,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    threads: usize,
) {
    let rows = mat.rows();
    let a = quantize(x, m, mat.cols(), bits);
    let panels = rows.div_ceil(PANEL_ROWS);
    let units = if rows * mat.cols() * m < PAR_MIN_MACS {
        1
    } else {
        threads.min(panels).max(1)
    };
    let share = panels.div_ceil(units);
    let out = Out::new(y, rows);
    let kernel = kernel_for(isa);
    let run = |u: usize| {
        let (p0, p1) = ((u * share).min(panels), ((u + 1) * share).min(panels));
        for p in p0..p1 {
            panel(kernel, bits, mat, pan, p, &a, m, out);
        }
    };
    if units == 1 {
        run(0);
    } else {
        engram_kvcore::team::run(units, &run);
    }
}

/// One panel against every activation row.
#[allow(clippy::too_many_arguments)]
fn panel(
    kernel: Kernel,
    bits: Bits,
    mat: &QMatrix,
    pan: &Panels,
    p: usize,
    a: &Quantized,
    m: usize,
    out: Out,
) {
    let r0 = p * PANEL_ROWS;
    let live = PANEL_ROWS.min(mat.rows() - r0);
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Vnni => {
            let mut i = 0;
            while i < m {
                let n = ROWS_512.min(m - i);
                macro_rules! by_n {
                    ($($k:literal)*) => {
                        match n {
                            $($k => {
                                // SAFETY: `kernel_for` chose `Vnni` only where the CPU reports
                                // AVX-512 BW and VNNI; rows `i..i + n` exist in `a`, quantized
                                // to `bits`.
                                unsafe {
                                    match bits {
                                        Bits::I8 => x86::panel_vnni::<$k, false>(pan, p, a, i, r0, live, out),
                                        Bits::I16 => x86::panel_vnni::<$k, true>(pan, p, a, i, r0, live, out),
                                    }
                                }
                            })*
                            _ => {}
                        }
                    };
                }
                by_n!(1 2 3 4 5 6 7 8);
                i += n;
            }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => {
            for half in 0..2 {
                let lanes = live.saturating_sub(8 * half).min(8);
                if lanes == 0 {
                    continue;
                }
                let mut i = 0;
                while i < m {
                    let n = ROWS_256.min(m - i);
                    macro_rules! by_n {
                        ($($k:literal)*) => {
                            match n {
                                $($k => {
                                    // SAFETY: `kernel_for` chose `Avx2` only where the CPU
                                    // reports AVX2 and FMA; rows `i..i + n` exist in `a`,
                                    // quantized to `bits`.
                                    unsafe {
                                        match bits {
                                            Bits::I8 => x86::panel_avx2::<$k, false>(pan, p, half, a, i, r0, lanes, out),
                                            Bits::I16 => x86::panel_avx2::<$k, true>(pan, p, half, a, i, r0, lanes, out),
                                        }
                                    }
                                })*
                                _ => {}
                            }
                        };
                    }
                    by_n!(1 2 3 4);
                    i += n;
                }
            }
        }
        _ => {
            let (mut scales, mut offsets, mut codes) = (Vec::new(), Vec::new(), Vec::new());
            for r in r0..r0 + live {
                pan.row_into(r, &mut scales, &mut offsets, &mut codes);
                let row = Row {
                    scales: &scales,
                    offsets: &offsets,
                    codes: &codes,
                };
                for i in 0..m {
                    out.put(i, r, scalar(row, a, i));
                }
            }
        }
    }
}

/// The reference: one output from a row's nibble codes in the row layout.
pub(crate) fn scalar(row: Row<'_>, a: &Quantized, i: usize) -> f32 {
    let mut acc = 0f32;
    for g in 0..a.groups {
        let codes = &row.codes[g * 16..][..16];
        let isum: i32 = (0..GROUP)
            .map(|k| i32::from(nibble(codes, k)) * a.value(i, g * GROUP + k))
            .sum();
        let sd = row.scales[g] * a.d[i * a.groups + g];
        acc = (isum as f32).mul_add(sd, acc);
        acc = row.offsets[g].mul_add(a.s[i * a.groups + g], acc);
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{
        Bits, GROUP, PANEL_GROUP_BYTES, PANEL_ROWS, Panels, Quantized, SUPER_GROUPS, Scales,
    };
    use crate::kernel::Out;

    /// The 32-bit lane of activations at element `at` to broadcast: four int8 ones, or two
    /// int16 ones (`WIDE`).
    ///
    /// # Safety
    /// The lane's 4 bytes from element `at` are inside the activations.
    #[inline]
    unsafe fn lane<const WIDE: bool>(a: &Quantized, at: usize) -> i32 {
        // SAFETY: the caller's promise; the reads are unaligned.
        unsafe {
            if WIDE {
                std::ptr::read_unaligned(a.q16.as_ptr().add(at).cast::<i32>())
            } else {
                std::ptr::read_unaligned(a.q.as_ptr().add(at).cast::<i32>())
            }
        }
    }

    /// `acc` plus, per 32-bit lane, the products of `w`'s two words with the two int16 words at
    /// `p` (broadcast): one `vpdpwssd` with a broadcast operand. Written out because LLVM splits
    /// the intrinsic into `vpmaddwd` + `vpaddd` (two instructions for one) on CPUs it has no
    /// tuning for: the int16 kernel ran 1.6× slower on a 256-row chunk.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F and VNNI; `p` points at 4 readable bytes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpwssd_bcst(acc: __m512i, w: __m512i, p: *const i16) -> __m512i {
        let mut acc = acc;
        // SAFETY: the caller's promise; the instruction reads 4 bytes at `p` and writes `acc`.
        unsafe {
            std::arch::asm!(
                "vpdpwssd {acc}, {w}, dword ptr [{p}]{{1to16}}",
                acc = inout(zmm_reg) acc,
                w = in(zmm_reg) w,
                p = in(reg) p,
                options(pure, readonly, nostack, preserves_flags),
            );
        }
        acc
    }

    /// [`super::quantize_groups`] for int16, a group of 32 in two registers: the same
    /// operations in the same roundings (largest magnitude ignoring NaN, `v·inv + MAGIC −
    /// MAGIC`, the clamp, a NaN lane 0, the integer sum), so the same bits; stored in
    /// [`super::i16_slot`] order by one word permutation.
    ///
    /// # Safety
    /// The CPU runs AVX-512 F and BW; `x` and `q16` hold `32 · d.len()` values and `s` as many
    /// as `d`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_i16(x: &[f32], q16: &mut [i16], d: &mut [f32], s: &mut [f32]) {
        let levels = Bits::I16.levels();
        let slots: [i16; GROUP] = std::array::from_fn(|k| super::i16_slot(k) as i16);
        // SAFETY: 32 words.
        let order = unsafe { _mm512_loadu_si512(slots.as_ptr().cast()) };
        let (magic, hi, lo) = (
            _mm512_set1_ps(super::MAGIC),
            _mm512_set1_ps(levels),
            _mm512_set1_ps(-levels),
        );
        for (g, xg) in x.chunks_exact(GROUP).enumerate() {
            // SAFETY: the group's 32 floats.
            let v = unsafe {
                [
                    _mm512_loadu_ps(xg.as_ptr()),
                    _mm512_loadu_ps(xg.as_ptr().add(16)),
                ]
            };
            // |v| with NaN lanes as 0 (the scalar maximum ignores NaN).
            let mag = v.map(|v| {
                let a = _mm512_abs_ps(v);
                _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(a, a), a)
            });
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(mag[0], mag[1]));
            if amax == 0.0 || !amax.is_finite() {
                continue;
            }
            let inv = _mm512_set1_ps(levels / amax);
            let r = v.map(|v| {
                let t = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, inv), magic), magic);
                let live = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(t, t);
                let t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
                _mm512_maskz_mov_epi32(live, _mm512_cvttps_epi32(t))
            });
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(r[0], r[1]));
            let words = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm512_cvtepi32_epi16(r[0])),
                _mm512_cvtepi32_epi16(r[1]),
            );
            // SAFETY: the group's 32 words.
            unsafe {
                _mm512_storeu_si512(
                    q16.as_mut_ptr().add(g * GROUP).cast(),
                    _mm512_permutexvar_epi16(order, words),
                );
            }
            let dx = amax / levels;
            d[g] = dx;
            s[g] = dx * sum as f32;
        }
    }

    /// Panel `p` against activation rows `i0..i0 + R`: 16 weight rows per register, one integer
    /// sum per group and row, then the group's two float terms. Int8 (`vpdpbusd`, four products
    /// a lane: the low nibbles of a vector are columns `c..c+4`, the high ones `c+4..c+8`) or
    /// int16 (`WIDE`, `vpdpwssd`, two products a lane: the nibbles split into even and odd bytes
    /// as words, columns `(c, c+2)`, `(c+1, c+3)`, `(c+4, c+6)`, `(c+5, c+7)`, against the
    /// activations stored in that order).
    ///
    /// # Safety
    /// The CPU runs AVX-512 F, BW and VNNI; `p` is a panel of `pan`, rows `i0..i0 + R` exist in
    /// `a`, quantized to int16 if `WIDE` else int8, and `live ≤ 16` rows from `r0` are columns
    /// of `out`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn panel_vnni<const R: usize, const WIDE: bool>(
        pan: &Panels,
        p: usize,
        a: &Quantized,
        i0: usize,
        r0: usize,
        live: usize,
        out: Out,
    ) {
        let lomask = _mm512_set1_epi8(0x0F);
        let low_byte = _mm512_set1_epi16(0x00FF);
        let mut acc = [_mm512_setzero_ps(); R];
        for g in 0..pan.groups {
            let at = p * pan.groups + g;
            let codes = &pan.codes[at * PANEL_GROUP_BYTES..][..PANEL_GROUP_BYTES];
            let mut isum = [_mm512_setzero_si512(); R];
            for v in 0..4 {
                // SAFETY: `codes` holds four 64-byte vectors.
                let w = unsafe { _mm512_loadu_si512(codes.as_ptr().add(64 * v).cast()) };
                let lo = _mm512_and_si512(w, lomask);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), lomask);
                let x0 = i0 * a.cols + g * GROUP + 8 * v;
                if WIDE {
                    // One word vector at a time against every row: the rows' sums stay in
                    // registers (a row loop around the four words kept them on the stack).
                    let words = [
                        _mm512_and_si512(lo, low_byte),
                        _mm512_srli_epi16::<8>(lo),
                        _mm512_and_si512(hi, low_byte),
                        _mm512_srli_epi16::<8>(hi),
                    ];
                    for (h, wv) in words.iter().enumerate() {
                        for (i, s) in isum.iter_mut().enumerate() {
                            // SAFETY: row `i0 + i` exists and holds the group's columns
                            // `8v..8v + 8`.
                            *s = unsafe {
                                dpwssd_bcst(*s, *wv, a.q16.as_ptr().add(x0 + i * a.cols + 2 * h))
                            };
                        }
                    }
                    continue;
                }
                for (i, s) in isum.iter_mut().enumerate() {
                    let x = x0 + i * a.cols;
                    // SAFETY: row `i0 + i` exists and holds columns `x..x + 8`.
                    let (b0, b1) = unsafe { (lane::<false>(a, x), lane::<false>(a, x + 4)) };
                    *s = _mm512_dpbusd_epi32(*s, lo, _mm512_set1_epi32(b0));
                    *s = _mm512_dpbusd_epi32(*s, hi, _mm512_set1_epi32(b1));
                }
            }
            let (s, o) = match &pan.scales {
                // SAFETY: 16 floats per panel group.
                Scales::F32 { scales, offsets } => unsafe {
                    (
                        _mm512_loadu_ps(scales.as_ptr().add(at * PANEL_ROWS)),
                        _mm512_loadu_ps(offsets.as_ptr().add(at * PANEL_ROWS)),
                    )
                },
                // SAFETY: 16 bytes per panel group, 16 floats per panel block.
                Scales::K { sc, m, d, nmin } => unsafe {
                    let sup = (p * (pan.groups / SUPER_GROUPS) + g / SUPER_GROUPS) * PANEL_ROWS;
                    let bytes = |v: &[u8]| {
                        let b = _mm_loadu_si128(v.as_ptr().add(at * PANEL_ROWS).cast());
                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
                    };
                    (
                        _mm512_mul_ps(_mm512_loadu_ps(d.as_ptr().add(sup)), bytes(sc)),
                        _mm512_mul_ps(_mm512_loadu_ps(nmin.as_ptr().add(sup)), bytes(m)),
                    )
                },
            };
            for i in 0..R {
                let k = (i0 + i) * a.groups + g;
                let sd = _mm512_mul_ps(s, _mm512_set1_ps(a.d[k]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), sd, acc[i]);
                acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.s[k]), acc[i]);
            }
        }
        for (i, v) in acc.iter().enumerate() {
            let mut lanes = [0f32; PANEL_ROWS];
            // SAFETY: `lanes` holds 16 floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *v) };
            out.put_run(i0 + i, r0, &lanes[..live]);
        }
    }

    /// Half `half` (lanes `8·half..8·half + 8`) of panel `p` against activation rows
    /// `i0..i0 + R`, as [`panel_vnni`] with 16-bit pair products: `vpmaddubsw` + `vpmaddwd`
    /// for int8 (no saturation: a pair is at most 2·15·127), `vpmaddwd` for int16.
    ///
    /// # Safety
    /// The CPU runs AVX2 and FMA; `p` is a panel of `pan`, rows `i0..i0 + R` exist in `a`,
    /// quantized to int16 if `WIDE` else int8, and `lanes ≤ 8` rows from `r0 + 8·half` are
    /// columns of `out`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn panel_avx2<const R: usize, const WIDE: bool>(
        pan: &Panels,
        p: usize,
        half: usize,
        a: &Quantized,
        i0: usize,
        r0: usize,
        lanes: usize,
        out: Out,
    ) {
        let lomask = _mm256_set1_epi8(0x0F);
        let low_byte = _mm256_set1_epi16(0x00FF);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for g in 0..pan.groups {
            let at = p * pan.groups + g;
            let codes = &pan.codes[at * PANEL_GROUP_BYTES..][..PANEL_GROUP_BYTES];
            let mut isum = [_mm256_setzero_si256(); R];
            for v in 0..4 {
                // SAFETY: `codes` holds four 64-byte vectors; this reads one half of one.
                let w =
                    unsafe { _mm256_loadu_si256(codes.as_ptr().add(64 * v + 32 * half).cast()) };
                let lo = _mm256_and_si256(w, lomask);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), lomask);
                for (i, s) in isum.iter_mut().enumerate() {
                    let x = (i0 + i) * a.cols + g * GROUP + 8 * v;
                    if WIDE {
                        let words = [
                            _mm256_and_si256(lo, low_byte),
                            _mm256_srli_epi16::<8>(lo),
                            _mm256_and_si256(hi, low_byte),
                            _mm256_srli_epi16::<8>(hi),
                        ];
                        for (h, wv) in words.iter().enumerate() {
                            // SAFETY: row `i0 + i` exists and holds columns `x..x + 8`.
                            let b = unsafe { lane::<true>(a, x + 2 * h) };
                            let pairs = _mm256_madd_epi16(*wv, _mm256_set1_epi32(b));
                            *s = _mm256_add_epi32(*s, pairs);
                        }
                    } else {
                        // SAFETY: row `i0 + i` exists and holds columns `x..x + 8`.
                        let (b0, b1) = unsafe { (lane::<false>(a, x), lane::<false>(a, x + 4)) };
                        let p0 = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(b0));
                        let p1 = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(b1));
                        *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p0, ones));
                        *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p1, ones));
                    }
                }
            }
            let (s, o) = match &pan.scales {
                // SAFETY: 16 floats per panel group; this reads one half.
                Scales::F32 { scales, offsets } => unsafe {
                    (
                        _mm256_loadu_ps(scales.as_ptr().add(at * PANEL_ROWS + 8 * half)),
                        _mm256_loadu_ps(offsets.as_ptr().add(at * PANEL_ROWS + 8 * half)),
                    )
                },
                // SAFETY: 16 bytes per panel group, 16 floats per panel block; this reads one
                // half of each.
                Scales::K { sc, m, d, nmin } => unsafe {
                    let sup = (p * (pan.groups / SUPER_GROUPS) + g / SUPER_GROUPS) * PANEL_ROWS
                        + 8 * half;
                    let bytes = |v: &[u8]| {
                        let b = _mm_loadl_epi64(v.as_ptr().add(at * PANEL_ROWS + 8 * half).cast());
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
                    };
                    (
                        _mm256_mul_ps(_mm256_loadu_ps(d.as_ptr().add(sup)), bytes(sc)),
                        _mm256_mul_ps(_mm256_loadu_ps(nmin.as_ptr().add(sup)), bytes(m)),
                    )
                },
            };
            for i in 0..R {
                let k = (i0 + i) * a.groups + g;
                let sd = _mm256_mul_ps(s, _mm256_set1_ps(a.d[k]));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), sd, acc[i]);
                acc[i] = _mm256_fmadd_ps(o, _mm256_set1_ps(a.s[k]), acc[i]);
            }
        }
        for (i, v) in acc.iter().enumerate() {
            let mut out8 = [0f32; 8];
            // SAFETY: `out8` holds 8 floats.
            unsafe { _mm256_storeu_ps(out8.as_mut_ptr(), *v) };
            out.put_run(i0 + i, r0 + 8 * half, &out8[..lanes]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX-512 quantization is the scalar one, bit for bit, on ordinary, zero, huge,
    /// infinite and NaN values.
    #[test]
    fn every_quantization_path_gives_the_same_codes_and_scales() {
        let (m, cols) = (7, 256);
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut x: Vec<f32> = (0..m * cols)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / 16_777_216.0 - 0.5) * 8.0
            })
            .collect();
        x[0..32].fill(0.0);
        x[40] = f32::NAN;
        x[70] = f32::INFINITY;
        x[100] = 3.0e38;
        x[101] = -3.0e38;
        x[130] = 1.0e-38;
        x[200..232].fill(f32::NAN);
        let fast = quantize(&x, m, cols, Bits::I16);
        let mut slow = Quantized {
            cols,
            groups: cols / GROUP,
            q: Vec::new(),
            q16: vec![0; m * cols],
            d: vec![0.0; m * cols / GROUP],
            s: vec![0.0; m * cols / GROUP],
        };
        quantize_groups(&x, m, cols, Bits::I16, &mut slow);
        assert_eq!(fast.q16, slow.q16);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fast.d), bits(&slow.d));
        assert_eq!(bits(&fast.s), bits(&slow.s));
        assert!(slow.q16.iter().any(|&q| q != 0));
    }
}
