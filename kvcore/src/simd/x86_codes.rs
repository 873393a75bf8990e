//! The AVX-512 decode kernel for every codec pair: keys and values each expanded from their own
//! codes into registers by an [`Expander`], then the same tile loop as the 4-bit kernel (scores
//! of 16 keys from one transpose-reduce per head, online softmax per tile, one FMA per register
//! and head for values).
//!
//! Expansion per 16 coordinates:
//! - TurboQuant at 4 bits: one byte per two codes, nibbles looked up with `vpermps` (the
//!   kernels' coordinate order, see [`super::super::to_kernel_order`]);
//! - TurboQuant at 2, 3, 5 and 6 bits: 16 codes are `2·bits` bytes, LSB first; each group of 8
//!   codes (`bits` bytes) is read as one 64-bit word, broadcast, shifted per lane (`vpsrlvq`)
//!   and masked, and the 16 indices look up up to 64 centroids held in four registers
//!   (`vpermps` for 16, `vpermt2ps` for 32, two of those and a blend on bit 5 for 64);
//! - Q8: 16 signed bytes widened to i32 and converted;
//! - F16: `vcvtph2ps`; F32: a load.
//!
//! With AVX-512 VBMI (and head_dim 64, 128 or 256) the packed widths take a shorter path per
//! 64 coordinates ([`byte_lookup`]): one `vpermb` places the bytes of each group of 4 codes in
//! a 64-bit word, one `vpmultishiftqb` moves every code to its own byte, four `vpermb` look up
//! the four bytes of each centroid (the 64-entry table of each byte in one register) and eight
//! unpacks assemble the singles — about 3.5 instructions per 16 coordinates instead of 10 for
//! 6-bit codes, and the same bits ([`vbmi`] says whether it runs).
//!
//! The causal (prefill) form expands each tile of 16 keys once for every query row and head of
//! the call and runs them through the 4-bit causal kernel's register blocks
//! ([`super::causal_tile`]), so a row's arithmetic does not depend on the other rows of its call.

use std::arch::x86_64::*;

use super::{
    CausalTile, MAX_D, TILE, TileApart, causal_tile, load512, store512, transpose_stage,
    transpose16,
};
use super::{add_tile_values, prefetch_layer};
use crate::codec::{Codec, CodecKind};
use crate::simd::CodesJob;
use crate::simd::{CausalCodes, Partial, to_kernel_order};
use crate::store::host::LayerBytes;

/// How one stream's code bytes become registers of values, 16 coordinates each.
// One value per kernel call, held on the stack; boxing the centroids would put a load in front
// of every lookup.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy)]
enum Expander {
    /// TurboQuant at 4 bits: the 16 centroids; coordinates come out in the kernels' order.
    Nibbles(__m512),
    /// TurboQuant at 2, 3, 5 or 6 bits: up to 64 centroids (16 per register, the rest zero),
    /// and the per-lane constants that unpack 16 codes.
    Packed {
        bits: usize,
        cb: [__m512; 4],
        packing: Packing,
        /// The byte tables of the VBMI path, when the kernel runs it.
        lut: Option<ByteLookup>,
    },
    /// Signed 8-bit codes.
    Q8,
    /// IEEE halves.
    F16,
    /// IEEE singles.
    F32,
}

impl Expander {
    /// The expander of `codec` for a kernel of head_dim `16·nz`; packed widths get the byte
    /// tables of the VBMI path when `vbmi` (the kernel is compiled for it) and `nz` is a
    /// multiple of 4.
    #[target_feature(enable = "avx512f")]
    fn new(codec: &Codec, vbmi: bool, nz: usize) -> Self {
        match codec.kind() {
            CodecKind::F32 => Self::F32,
            CodecKind::F16 => Self::F16,
            CodecKind::Q8 => Self::Q8,
            CodecKind::TurboQuant { bits } | CodecKind::TurboQuantSplit { bits, .. } => {
                let mut table = [0.0f32; 64];
                let book = codec.codebook();
                let n = book.len().min(64);
                table[..n].copy_from_slice(&book[..n]);
                let cb: [__m512; 4] = std::array::from_fn(|i| load512(&table[16 * i..]));
                if bits == 4 {
                    return Self::Nibbles(cb[0]);
                }
                let bits = usize::from(bits);
                let lut = (vbmi && nz.is_multiple_of(4)).then(|| ByteLookup::new(&table, n, bits));
                Self::Packed {
                    bits,
                    cb,
                    packing: Packing::new(bits),
                    lut,
                }
            }
        }
    }

    /// Whether coordinates come out in the kernels' order rather than the natural one.
    fn kernel_order(&self) -> bool {
        matches!(self, Self::Nibbles(_))
    }
}

/// Runs `$body` with `$expand` bound to `$x`'s row expansion (a closure from the codes of a row
/// on to `NZ` registers): the codec is matched once, outside `$body`'s loop, and `$body` is
/// compiled once per codec with the expansion inlined. In `vbmi` mode (a kernel compiled with
/// AVX-512 VBMI) packed codes with byte tables take [`byte_lookup`]; in `plain` mode they never
/// do.
macro_rules! per_codec {
    (vbmi, $x:expr, $nz:ident, $expand:ident => $body:block) => {
        match $x {
            Expander::Packed { lut: Some(lut), .. } => {
                // SAFETY: this mode runs only in kernels compiled for AVX-512 F, BW and VBMI,
                // called only where the CPU has them ([`vbmi`]).
                let $expand = |rest: &[u8]| unsafe { byte_lookup::<$nz>(rest, &lut) };
                $body
            }
            other => per_codec!(plain, other, $nz, $expand => $body),
        }
    };
    (plain, $x:expr, $nz:ident, $expand:ident => $body:block) => {
        match $x {
            Expander::Nibbles(cb) => {
                // SAFETY: the kernels run only where the CPU has AVX-512 F.
                let $expand = |rest: &[u8]| unsafe { nibbles::<$nz>(rest, cb) };
                $body
            }
            Expander::Packed {
                bits, cb, packing, ..
            } => {
                // SAFETY: as above.
                let $expand = |rest: &[u8]| unsafe { packed::<$nz>(rest, bits, &cb, &packing) };
                $body
            }
            Expander::Q8 => {
                // SAFETY: as above.
                let $expand = |rest: &[u8]| unsafe { q8::<$nz>(rest) };
                $body
            }
            Expander::F16 => {
                // SAFETY: as above.
                let $expand = |rest: &[u8]| unsafe { halves::<$nz>(rest) };
                $body
            }
            Expander::F32 => {
                // SAFETY: as above.
                let $expand = |rest: &[u8]| unsafe { singles::<$nz>(rest) };
                $body
            }
        }
    };
}

/// 4-bit codes: 16 bytes give 32 coordinates, low nibbles then high nibbles.
///
/// # Safety
/// As [`packed`].
#[inline(always)]
unsafe fn nibbles<const NZ: usize>(rest: &[u8], cb: __m512) -> [__m512; NZ] {
    // SAFETY: the caller guarantees AVX-512 F.
    unsafe {
        let mut e = [_mm512_setzero_ps(); NZ];
        let low = _mm512_set1_epi32(0x0F);
        for c in 0..NZ / 2 {
            let a = _mm512_cvtepu8_epi32(load128(&rest[16 * c..]));
            e[2 * c] = _mm512_permutexvar_ps(_mm512_and_si512(a, low), cb);
            e[2 * c + 1] = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(a), cb);
        }
        e
    }
}

/// 2-, 3-, 5- or 6-bit codes packed LSB first: 16 codes are `2·bits` bytes (at most 12), read
/// as one 16-byte register. Lane `i`'s code starts at bit `i·bits`, in dword `k = ⌊i·bits/32⌋`
/// at shift `s`; it is `(dword[k] >> s | dword[k + 1] << (32 − s)) & mask` (a shift by 32
/// gives 0), the dwords placed per lane by `vpermd` ([`Packing`]).
///
/// # Safety
/// The CPU has AVX-512 F. Not a `target_feature` function, and with no closure inside: always
/// inlined into the kernel, whose features its intrinsics then take (a `target_feature`
/// function may not be `inline(always)`, and the compiler keeps a large kernel's callee out of
/// line, returning its registers through memory; a closure here would call every intrinsic out
/// of line — each made this expansion several times slower).
#[inline(always)]
unsafe fn packed<const NZ: usize>(
    rest: &[u8],
    bits: usize,
    cb: &[__m512; 4],
    p: &Packing,
) -> [__m512; NZ] {
    // SAFETY: the caller guarantees AVX-512 F.
    unsafe {
        let mut e = [_mm512_setzero_ps(); NZ];
        match bits {
            2..=4 => {
                for (c, ec) in e.iter_mut().enumerate() {
                    *ec = _mm512_permutexvar_ps(packed_index(rest, 2 * bits * c, p), cb[0]);
                }
            }
            5 => {
                for (c, ec) in e.iter_mut().enumerate() {
                    let idx = packed_index(rest, 2 * bits * c, p);
                    *ec = _mm512_permutex2var_ps(cb[0], idx, cb[1]);
                }
            }
            _ => {
                let bit5 = _mm512_set1_epi32(32);
                for (c, ec) in e.iter_mut().enumerate() {
                    let idx = packed_index(rest, 2 * bits * c, p);
                    let low = _mm512_permutex2var_ps(cb[0], idx, cb[1]);
                    let high = _mm512_permutex2var_ps(cb[2], idx, cb[3]);
                    *ec = _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, bit5), low, high);
                }
            }
        }
        e
    }
}

/// The 16 code indices of [`packed`] whose bytes start at `rest[at..]`.
///
/// # Safety
/// As [`packed`].
#[inline(always)]
unsafe fn packed_index(rest: &[u8], at: usize, p: &Packing) -> __m512i {
    // SAFETY: the caller guarantees AVX-512 F.
    unsafe {
        let v = _mm512_castsi128_si512(load128_padded(rest, at));
        let lo = _mm512_srlv_epi32(_mm512_permutexvar_epi32(p.first, v), p.shift);
        let hi = _mm512_sllv_epi32(_mm512_permutexvar_epi32(p.second, v), p.back);
        // (lo | hi) & mask
        _mm512_ternarylogic_epi32::<0xA8>(lo, hi, p.mask)
    }
}

/// The per-lane constants of [`packed`] for one width.
#[derive(Clone, Copy)]
struct Packing {
    /// Dword holding the start of lane `i`'s code.
    first: __m512i,
    /// The dword after it.
    second: __m512i,
    /// The code's shift in `first`.
    shift: __m512i,
    /// `32 − shift`: where `second`'s bits go.
    back: __m512i,
    /// `2^bits − 1`.
    mask: __m512i,
}

impl Packing {
    #[target_feature(enable = "avx512f")]
    fn new(bits: usize) -> Self {
        let lanes = |f: &dyn Fn(usize) -> usize| {
            let v: [i32; 16] = std::array::from_fn(|i| f(i) as i32);
            // SAFETY: `v` holds 16 i32 (64 bytes); the load is unaligned.
            unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
        };
        Self {
            first: lanes(&|i| i * bits / 32),
            second: lanes(&|i| i * bits / 32 + 1),
            shift: lanes(&|i| i * bits % 32),
            back: lanes(&|i| 32 - i * bits % 32),
            mask: _mm512_set1_epi32((1 << bits) - 1),
        }
    }
}

/// The constants of [`byte_lookup`] for one packed width.
#[derive(Clone, Copy)]
struct ByteLookup {
    /// Byte `k` of every centroid, `k` = 0..3: 64 entries per register, indexed by the low 6
    /// bits of an index byte (a narrower codebook repeats to fill them, so bits above the
    /// code's width do not matter).
    planes: [__m512i; 4],
    /// `vpermb` control: the source byte of each byte of the gathered words.
    gather: __m512i,
    /// `vpmultishiftqb` control: the bit in its 64-bit word where each index byte starts.
    shifts: __m512i,
    /// Code bytes of 64 coordinates (`8·bits`).
    block: usize,
    /// Load mask of those bytes.
    mask: __mmask64,
}

impl ByteLookup {
    /// The tables of the first `n` centroids of `table` (`n` = 2^bits) for `bits`-bit codes.
    ///
    /// Index byte `p = 16·L + 4·k + j` (128-bit lane `L`, quarter `k`, `j` < 4) holds the code of
    /// coordinate `16·k + 4·L + j`: after the byte and word unpacks, which work within lanes,
    /// register `k` then holds coordinates `16·k..16·k + 16` in order. The 64-bit word
    /// `2·L + h` thus holds two runs of 4 codes, from coordinates `a = 32·h + 4·L` and
    /// `a + 16`; each run is at most 3 bytes from bit `a·bits mod 8` of byte `⌊a·bits/8⌋`.
    #[target_feature(enable = "avx512f")]
    fn new(table: &[f32; 64], n: usize, bits: usize) -> Self {
        let n = n.clamp(1, 64);
        let mut planes = [[0u8; 64]; 4];
        for (t, c) in (0..64).map(|t| (t, table[t % n].to_le_bytes())) {
            for (plane, byte) in planes.iter_mut().zip(c) {
                plane[t] = byte;
            }
        }
        let (mut gather, mut shifts) = ([0u8; 64], [0u8; 64]);
        for word in 0..8 {
            let (lane, half) = (word / 2, word % 2);
            for run in 0..2 {
                let a = 32 * half + 16 * run + 4 * lane;
                let (byte, bit) = (a * bits / 8, a * bits % 8);
                for j in 0..4 {
                    let at = 8 * word + 4 * run + j;
                    gather[at] = (byte + j).min(63) as u8;
                    shifts[at] = (32 * run + bit + j * bits) as u8;
                }
            }
        }
        let load = |v: &[u8; 64]| {
            // SAFETY: `v` holds 64 bytes; the load is unaligned.
            unsafe { _mm512_loadu_si512(v.as_ptr().cast()) }
        };
        let block = 8 * bits;
        Self {
            planes: planes.each_ref().map(load),
            gather: load(&gather),
            shifts: load(&shifts),
            block,
            mask: u64::MAX >> (64 - block.min(64)),
        }
    }
}

/// Packed 2-, 3-, 5- or 6-bit codes (LSB first) of `NZ / 4` blocks of 64 coordinates, through
/// byte lookups (see [`ByteLookup::new`] for the order that comes out natural).
///
/// # Safety
/// The CPU has AVX-512 F, BW and VBMI; inlined only into kernels compiled for them (see
/// [`packed`] on why this is no `target_feature` function).
#[inline(always)]
unsafe fn byte_lookup<const NZ: usize>(rest: &[u8], l: &ByteLookup) -> [__m512; NZ] {
    // SAFETY: the caller guarantees AVX-512 F, BW and VBMI.
    unsafe {
        let mut e = [_mm512_setzero_ps(); NZ];
        for b in 0..NZ / 4 {
            let src = &rest[b * l.block..][..l.block];
            // Reads only the `block` bytes of `src` (the mask's bits), in bounds above.
            let v = _mm512_maskz_loadu_epi8(l.mask, src.as_ptr().cast());
            let idx = _mm512_multishift_epi64_epi8(l.shifts, _mm512_permutexvar_epi8(l.gather, v));
            let [p0, p1, p2, p3] = l.planes;
            let (b0, b1) = (
                _mm512_permutexvar_epi8(idx, p0),
                _mm512_permutexvar_epi8(idx, p1),
            );
            let (b2, b3) = (
                _mm512_permutexvar_epi8(idx, p2),
                _mm512_permutexvar_epi8(idx, p3),
            );
            let (lo01, hi01) = (_mm512_unpacklo_epi8(b0, b1), _mm512_unpackhi_epi8(b0, b1));
            let (lo23, hi23) = (_mm512_unpacklo_epi8(b2, b3), _mm512_unpackhi_epi8(b2, b3));
            e[4 * b] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
            e[4 * b + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
            e[4 * b + 2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
            e[4 * b + 3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
        }
        e
    }
}

/// 16 bytes of `rest` from `at` as a register, zero past the end of `rest`.
#[inline(always)]
fn load128_padded(rest: &[u8], at: usize) -> __m128i {
    match rest.get(at..at + 16) {
        Some(b) => load128(b),
        None => {
            let mut w = [0u8; 16];
            let tail = rest.get(at..).unwrap_or_default();
            let n = tail.len().min(16);
            w[..n].copy_from_slice(&tail[..n]);
            load128(&w)
        }
    }
}

/// Signed bytes.
///
/// # Safety
/// As [`packed`].
#[inline(always)]
unsafe fn q8<const NZ: usize>(rest: &[u8]) -> [__m512; NZ] {
    // SAFETY: the caller guarantees AVX-512 F.
    unsafe {
        let mut e = [_mm512_setzero_ps(); NZ];
        for (c, ec) in e.iter_mut().enumerate() {
            *ec = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load128(&rest[16 * c..])));
        }
        e
    }
}

/// IEEE halves.
///
/// # Safety
/// As [`packed`].
#[inline(always)]
unsafe fn halves<const NZ: usize>(rest: &[u8]) -> [__m512; NZ] {
    // SAFETY: the caller guarantees AVX-512 F.
    unsafe {
        let mut e = [_mm512_setzero_ps(); NZ];
        for (c, ec) in e.iter_mut().enumerate() {
            let h = &rest[32 * c..][..32];
            // `h` is 32 bytes long (bounds-checked above); the load is unaligned.
            *ec = _mm512_cvtph_ps(_mm256_loadu_si256(h.as_ptr().cast()));
        }
        e
    }
}

/// IEEE singles.
///
/// # Safety
/// As [`packed`].
#[inline(always)]
unsafe fn singles<const NZ: usize>(rest: &[u8]) -> [__m512; NZ] {
    // SAFETY: the caller guarantees AVX-512 F.
    unsafe {
        let mut e = [_mm512_setzero_ps(); NZ];
        for (c, ec) in e.iter_mut().enumerate() {
            let f = &rest[64 * c..][..64];
            // `f` is 64 bytes long (bounds-checked above); the load is unaligned.
            *ec = _mm512_loadu_ps(f.as_ptr().cast());
        }
        e
    }
}

/// 16 bytes of `bytes` as a register.
#[inline(always)]
fn load128(bytes: &[u8]) -> __m128i {
    let b = &bytes[..16];
    // SAFETY: `b` is 16 bytes long (bounds-checked above); the load is unaligned.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

/// Whether the kernel takes `job`: head_dim a multiple of 32 up to 256, at most 8 query heads
/// per KV head, and code rows as wide as the codecs say.
pub(super) fn supports(job: &CodesJob<'_>) -> bool {
    geometry_fits(job.codecs, job.bytes, job.d, job.group) && job.qp.len() == job.group * job.d
}

/// Whether the kernels take this geometry and the layer's rows are as wide as its codecs say.
pub(super) fn geometry_fits(
    (kc, vc): (&Codec, &Codec),
    bytes: &LayerBytes<'_>,
    d: usize,
    group: usize,
) -> bool {
    d.is_multiple_of(32)
        && (32..=256).contains(&d)
        && (1..=super::MAX_GROUP).contains(&group)
        && kc.head_dim() == d
        && vc.head_dim() == d
        && bytes.k_code_row == kc.code_bytes()
        && bytes.v_code_row == vc.code_bytes()
        && bytes.k_norm_row == kc.norm_bytes()
        && bytes.v_norm_row == vc.norm_bytes()
}

/// Whether the kernels of this process expand packed codes by byte lookups: the CPU has
/// AVX-512 F, BW and VBMI, and `ENGRAM_SIMD_VBMI` is not `off` (or `0`), which keeps the
/// shift-and-`vpermt2ps` path to compare with. Both give the same bits.
pub(crate) fn vbmi() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let off = std::env::var("ENGRAM_SIMD_VBMI")
            .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "off" | "0"));
        !off && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vbmi")
    })
}

/// Whether a job takes the VBMI kernels: [`vbmi`], a packed stream (2, 3, 5 or 6 bits), and
/// head_dim 64, 128 or 256 (the VBMI kernels are compiled for those only).
fn takes_vbmi((kc, vc): (&Codec, &Codec), d: usize) -> bool {
    let packed = |c: &Codec| c.kind().turboquant_bits().is_some_and(|bits| bits != 4);
    matches!(d, 64 | 128 | 256) && (packed(kc) || packed(vc)) && vbmi()
}

/// Runs the kernel for `job`'s geometry (the caller checked [`supports`] and that the CPU has
/// AVX-512 F): the VBMI kernels where [`takes_vbmi`].
#[target_feature(enable = "avx512f")]
pub(super) fn attend(job: &CodesJob<'_>) -> Partial {
    if takes_vbmi(job.codecs, job.d) {
        // SAFETY: `vbmi` holds only where the CPU reports AVX-512 F, BW and VBMI.
        return unsafe { attend_on(true, job) };
    }
    // SAFETY: the plain kernels need AVX-512 F only, which the caller checked.
    unsafe { attend_on(false, job) }
}

/// [`attend`] on the chosen kernels.
///
/// # Safety
/// The CPU has AVX-512 F; with `vbmi`, BW and VBMI too, and head_dim is 64, 128 or 256.
#[target_feature(enable = "avx512f")]
unsafe fn attend_on(vbmi: bool, job: &CodesJob<'_>) -> Partial {
    macro_rules! by_group {
        ($k:ident, $nz:literal) => {
            match job.group {
                1 => $k::<$nz, 1>(job),
                2 => $k::<$nz, 2>(job),
                3 => $k::<$nz, 3>(job),
                4 => $k::<$nz, 4>(job),
                5 => $k::<$nz, 5>(job),
                6 => $k::<$nz, 6>(job),
                7 => $k::<$nz, 7>(job),
                _ => $k::<$nz, 8>(job),
            }
        };
    }
    if vbmi {
        // SAFETY: the caller checked the CPU's features and head_dim.
        return unsafe {
            match job.d / 16 {
                4 => by_group!(kernel_vbmi, 4),
                8 => by_group!(kernel_vbmi, 8),
                _ => by_group!(kernel_vbmi, 16),
            }
        };
    }
    match job.d / 16 {
        2 => by_group!(kernel, 2),
        4 => by_group!(kernel, 4),
        6 => by_group!(kernel, 6),
        8 => by_group!(kernel, 8),
        10 => by_group!(kernel, 10),
        12 => by_group!(kernel, 12),
        14 => by_group!(kernel, 14),
        _ => by_group!(kernel, 16),
    }
}

/// The scales of the tile's rows (lanes past `rows` are 1): their stored f16 norms converted
/// in one instruction, or 1 for a codec without norms.
#[inline]
#[target_feature(enable = "avx512f")]
fn tile_scales(norms: &[u8], rows: &[usize], norm_row: usize) -> __m512 {
    if norm_row == 0 {
        return _mm512_set1_ps(1.0);
    }
    let mut halves = [0x3C00u16; TILE];
    for (h, &r) in halves.iter_mut().zip(rows) {
        let n = &norms[r * norm_row..][..2];
        *h = u16::from_le_bytes([n[0], n[1]]);
    }
    // SAFETY: `halves` is 16 u16 (32 bytes); the load is unaligned.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(halves.as_ptr().cast()) })
}

/// Runs the causal kernel for `job`'s geometry (the caller checked [`geometry_fits`], the query
/// length and the limits' order, and that the CPU has AVX-512 F): the VBMI kernels where
/// [`takes_vbmi`].
#[target_feature(enable = "avx512f")]
pub(super) fn causal(job: &CausalCodes<'_>) -> Partial {
    if takes_vbmi(job.codecs, job.d) {
        // SAFETY: `vbmi` holds only where the CPU reports AVX-512 F, BW and VBMI, and
        // `takes_vbmi` checked head_dim.
        return unsafe {
            match job.d / 16 {
                4 => causal_vbmi::<4>(job),
                8 => causal_vbmi::<8>(job),
                _ => causal_vbmi::<16>(job),
            }
        };
    }
    match job.d / 16 {
        2 => causal_n::<2>(job),
        4 => causal_n::<4>(job),
        6 => causal_n::<6>(job),
        8 => causal_n::<8>(job),
        10 => causal_n::<10>(job),
        12 => causal_n::<12>(job),
        14 => causal_n::<14>(job),
        _ => causal_n::<16>(job),
    }
}

/// The decode kernel (`$kernel`) and the causal one (`$causal`) compiled for `$features`:
/// `$mode` `plain` for AVX-512 F, `vbmi` for F, BW and VBMI (packed codes by byte lookups).
macro_rules! codes_kernels {
    ($mode:ident, $vbmi:literal, $features:literal, $kernel:ident, $causal:ident) => {
        /// The decode kernel: `G` query heads sharing each key's expansion, head_dim `16·NZ`.
        #[target_feature(enable = $features)]
        fn $kernel<const NZ: usize, const G: usize>(job: &CodesJob<'_>) -> Partial {
            const W: usize = 16;
            let d = NZ * W;
            let (kc, vc) = job.codecs;
            let (keys, bytes) = (job.keys, job.bytes);
            let (kx, vx) = (Expander::new(kc, $vbmi, NZ), Expander::new(vc, $vbmi, NZ));
            let (kcr, knr) = (bytes.k_code_row, bytes.k_norm_row);
            let (vcr, vnr) = (bytes.v_code_row, bytes.v_norm_row);
            let zero = _mm512_setzero_ps();
            let mut perm = [0.0f32; MAX_D];
            let mut qz = [[zero; NZ]; G];
            for (j, qj) in qz.iter_mut().enumerate() {
                let src = &job.qp[j * d..][..d];
                let scaled: [f32; MAX_D] =
                    std::array::from_fn(|i| src.get(i).map_or(0.0, |x| x * job.scale));
                if kx.kernel_order() {
                    to_kernel_order(&scaled[..d], W, &mut perm[..d]);
                } else {
                    perm[..d].copy_from_slice(&scaled[..d]);
                }
                for (z, r) in qj.iter_mut().enumerate() {
                    *r = load512(&perm[z * W..]);
                }
            }
            let mut acc = [[zero; NZ]; G];
            let mut max = [f32::NEG_INFINITY; G];
            let mut sum = [0.0f32; G];
            let mut s = [[0.0f32; TILE]; G];
            let mut lane_sums = [[zero; TILE]; G];
            let stages = [
                transpose_stage(8),
                transpose_stage(4),
                transpose_stage(2),
                transpose_stage(1),
            ];
            let mut rows = [0usize; TILE];
            let mut ve = [[zero; NZ]; TILE];
            let split = kc.outliers() > 0;
            let scale = _mm512_set1_ps(job.scale);
            let mut tiles = Vec::new();
            let mut t = keys.start;
            while t < keys.end {
                let n = TILE.min(keys.end - t);
                keys.rows_into(t, &mut rows[..n]);
                // The next tile's rows are fetched while this one computes: a tile is one
                // block (its rows consecutive), the blocks lie anywhere in the tier, and the
                // hardware prefetcher does not cross to the next one in time.
                prefetch_layer(bytes, keys, (t + n)..keys.end.min(t + n + TILE));
                per_codec!($mode, kx, NZ, expand => {
                    for (i, &r) in rows[..n].iter().enumerate() {
                        let e = expand(&bytes.k_codes[r * kcr..]);
                        for (ls, qj) in lane_sums.iter_mut().zip(&qz) {
                            let mut v = _mm512_mul_ps(qj[0], e[0]);
                            for z in 1..NZ {
                                v = _mm512_fmadd_ps(qj[z], e[z], v);
                            }
                            ls[i] = v;
                        }
                    }
                });
                // An outlier split's stored-apart coordinates: one term per key and head.
                let apart = split.then(|| {
                    TileApart::read(bytes.k_codes, &rows[..n], kcr, kc.apart_offset(), kc.outliers())
                });
                let lanes: __mmask16 = if n == TILE { 0xFFFF } else { (1u16 << n) - 1 };
                let norm_v = tile_scales(bytes.k_norms, &rows[..n], knr);
                for j in 0..G {
                    let added = super::tile_softmax(
                        &lane_sums[j],
                        norm_v,
                        match &apart {
                            Some(a) => _mm512_mul_ps(a.scores(&job.q[j * d..][..d]), scale),
                            None => zero,
                        },
                        lanes,
                        &stages,
                        &mut max[j],
                        &mut sum[j],
                        &mut acc[j],
                        &mut s[j],
                    );
                    if keys.trace {
                        tiles.push(crate::simd::TileMass {
                            start: t as u32,
                            max: max[j],
                            added,
                        });
                    }
                }
                // The tile's values are expanded once into `ve`, then added head by head
                // (`add_tile_values`: each head's accumulators in registers).
                per_codec!($mode, vx, NZ, expand => {
                    for (e, &r) in ve.iter_mut().zip(&rows[..n]) {
                        *e = expand(&bytes.v_codes[r * vcr..]);
                    }
                });
                let vn = tile_scales(bytes.v_norms, &rows[..n], vnr);
                // SAFETY: the kernels run only where the CPU has AVX-512 F.
                unsafe { add_tile_values(&mut acc, &mut s, &ve[..n], vn) };
                t += n;
            }
            let mut part = Partial::empty(G, d);
            let order = vx.kernel_order().then_some(W);
            for j in 0..G {
                for z in 0..NZ {
                    store512(&mut perm[z * W..], acc[j][z]);
                }
                part.set_head(j, (max[j], sum[j]), &perm[..d], order);
            }
            part.tiles = tiles;
            part
        }

        /// The causal kernel for head_dim `16·NZ`: per tile of 16 keys, the keys expanded by
        /// their codec and transposed (coordinate-major, one lane per key), the values expanded
        /// by theirs and scaled by their norms; then every query head whose limit reaches the
        /// tile, in register blocks. Queries are in the keys' coordinate order, accumulators in
        /// the values'.
        #[target_feature(enable = $features)]
        fn $causal<const NZ: usize>(job: &CausalCodes<'_>) -> Partial {
            const W: usize = 16;
            let d = NZ * W;
            let &CausalCodes {
                codecs: (kc, vc),
                bytes,
                keys,
                q,
                limits,
                group,
                ..
            } = job;
            let (kx, vx) = (Expander::new(kc, $vbmi, NZ), Expander::new(vc, $vbmi, NZ));
            let (kcr, knr) = (bytes.k_code_row, bytes.k_norm_row);
            let (vcr, vnr) = (bytes.v_code_row, bytes.v_norm_row);
            let nq = limits.len() * group;
            let zero = _mm512_setzero_ps();
            let stages = [
                transpose_stage(8),
                transpose_stage(4),
                transpose_stage(2),
                transpose_stage(1),
            ];
            let mut qk = vec![0.0f32; nq * d];
            for (dst, src) in qk.chunks_exact_mut(d).zip(q.chunks_exact(d)) {
                if kx.kernel_order() {
                    to_kernel_order(src, W, dst);
                } else {
                    dst.copy_from_slice(src);
                }
            }
            let mut acc = vec![0.0f32; nq * d];
            let mut max = vec![f32::NEG_INFINITY; nq];
            let mut sumv = vec![zero; nq];
            // The tile's expanded keys (key-major, before the transpose) and values (norms applied).
            // Lanes past a short tile's end keep earlier (finite) keys: every row masks them out.
            let mut ke = [[zero; NZ]; TILE];
            let mut kt = vec![0.0f32; d * TILE];
            let mut vt = vec![zero; TILE * NZ];
            let mut rows = [0usize; TILE];
            let mut vnorms = [0.0f32; TILE];
            let per_key = kc.outliers();
            let last = limits.iter().copied().max().unwrap_or(0).min(keys.end);
            let mut t = keys.start;
            while t < last {
                let n = TILE.min(last - t);
                keys.rows_into(t, &mut rows[..n]);
                per_codec!($mode, kx, NZ, expand => {
                    for (k, &r) in ke.iter_mut().zip(&rows[..n]) {
                        *k = expand(&bytes.k_codes[r * kcr..]);
                    }
                });
                // An outlier split's pairs of the tile's keys.
                let apart = (per_key > 0).then(|| {
                    TileApart::read(bytes.k_codes, &rows[..n], kcr, kc.apart_offset(), per_key)
                });
                store512(&mut vnorms, tile_scales(bytes.v_norms, &rows[..n], vnr));
                per_codec!($mode, vx, NZ, expand => {
                    for (i, &r) in rows[..n].iter().enumerate() {
                        let e = expand(&bytes.v_codes[r * vcr..]);
                        let vn = _mm512_set1_ps(vnorms[i]);
                        for (o, &x) in vt[i * NZ..][..NZ].iter_mut().zip(&e) {
                            *o = _mm512_mul_ps(x, vn);
                        }
                    }
                });
                for z in 0..NZ {
                    let mut m: [__m512; 16] = std::array::from_fn(|i| ke[i][z]);
                    transpose16(&mut m, &stages);
                    for (c, row) in m.iter().enumerate() {
                        store512(&mut kt[(z * W + c) * W..], *row);
                    }
                }
                let tile = CausalTile {
                    kt: &kt,
                    k_norm: tile_scales(bytes.k_norms, &rows[..n], knr),
                    vt: &vt,
                    t,
                    n,
                    apart,
                    q_apart: job.q_apart,
                };
                causal_tile(&tile, &qk, limits, group, d, &mut acc, &mut max, &mut sumv);
                t += n;
            }
            let mut part = Partial::empty(nq, d);
            let order = vx.kernel_order().then_some(W);
            for p in 0..nq {
                let sum = _mm512_reduce_add_ps(sumv[p]);
                part.set_head(p, (max[p], sum), &acc[p * d..][..d], order);
            }
            part
        }
    };
}

codes_kernels!(plain, false, "avx512f", kernel, causal_n);
codes_kernels!(
    vbmi,
    true,
    "avx512f,avx512bw,avx512vbmi",
    kernel_vbmi,
    causal_vbmi
);

#[cfg(test)]
#[path = "x86_codes_tests.rs"]
mod tests;
