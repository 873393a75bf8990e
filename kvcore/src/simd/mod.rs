//! Run-time selected SIMD kernels for attention over TurboQuant codes.
//!
//! The instruction set is detected once ([`Isa::detected`]); `ENGRAM_SIMD` (`scalar`, `avx2`,
//! `avx512`) lowers it, so the AVX2 and scalar paths run on an AVX-512 machine too. The scalar
//! path is the reference every other path is tested against. Within the AVX-512 tier, packed
//! TurboQuant codes (2, 3, 5, 6 bits) are expanded by byte lookups where the CPU has VBMI
//! (`ENGRAM_SIMD_VBMI=off` keeps the other expansion; both give the same bits, tested).
//!
//! The kernels work on one KV head's group of query heads over a range of keys and leave an
//! online-softmax [`Partial`] (running max, normalizer, accumulator in the rotated space); the
//! caller merges partials of consecutive key ranges in a fixed order, so a result depends on the
//! split (the thread count), never on which thread ran first.

use std::sync::OnceLock;

mod scalar_codes;
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86;

pub(crate) use scalar_codes::CodesJob;

// exp(x) = 2^n · e^r with r = x − n·ln2 (ln2 split in two for precision) and e^r from a degree-7
// polynomial (Cephes' expf coefficients): relative error about 1e-7 on the reduced range.
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
pub(crate) const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// Scores are relative to the running max (≤ 0); below this `exp` is 0 for softmax purposes
/// and the clamp keeps `2^n` a normal number.
pub(crate) const EXP_MIN: f32 = -87.0;
pub(crate) const EXP_MAX: f32 = 88.0;

/// An instruction-set tier of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust (the reference).
    Scalar,
    /// AVX2 with FMA.
    Avx2,
    /// AVX-512 F (the 16-entry codebook in one register).
    Avx512,
}

impl Isa {
    /// Every tier, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The best tier this CPU runs.
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(detect)
    }

    /// The tier in use: [`Self::detected`], lowered by `ENGRAM_SIMD` when it names a lower one
    /// (a higher or unknown name is ignored).
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let best = Isa::detected();
            std::env::var("ENGRAM_SIMD")
                .ok()
                .and_then(|v| Isa::parse(&v))
                .map_or(best, |forced| forced.min(best))
        })
    }

    /// Every tier this CPU runs, lowest first.
    pub fn available() -> Vec<Isa> {
        let best = Isa::detected();
        Isa::ALL.into_iter().filter(|&i| i <= best).collect()
    }

    /// `scalar`, `avx2` or `avx512`.
    pub fn parse(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            _ => None,
        }
    }

    /// The tier's name, as [`Self::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    if std::arch::is_x86_feature_detected!("avx512f") {
        Isa::Avx512
    } else if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        Isa::Avx2
    } else {
        Isa::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Scalar
}

/// Keys per softmax tile of the SIMD decode kernels (the scalar path's tiles are blocks).
pub(crate) const SIMD_TILE: usize = 16;

/// The online-softmax state of a group of query heads over a range of keys.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Partial {
    /// Running max of each head's scores.
    pub max: Vec<f32>,
    /// Running normalizer of each head, relative to its max.
    pub sum: Vec<f32>,
    /// `[group, head_dim]` unnormalized value sums, rotated space, natural coordinate order.
    pub acc: Vec<f32>,
    /// With [`KeyRange::trace`], each softmax tile's share, tile by tile and head by head within
    /// a tile (the decode kernels' own states: the attention mass per block comes from them);
    /// empty otherwise.
    pub tiles: Vec<TileMass>,
}

/// One softmax tile's state for one head: the running max after the tile and what the tile
/// added to the normalizer at that max.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TileMass {
    /// The tile's first position.
    pub start: u32,
    /// The head's running max after the tile.
    pub max: f32,
    /// `Σ exp(score − max)` over the tile's keys.
    pub added: f32,
}

impl Partial {
    /// The state before any key: max −∞, sums 0.
    pub fn empty(group: usize, head_dim: usize) -> Self {
        Self {
            max: vec![f32::NEG_INFINITY; group],
            sum: vec![0.0; group],
            acc: vec![0.0; group * head_dim],
            tiles: Vec::new(),
        }
    }

    /// Sets head `j`'s running max, normalizer and accumulator: `acc` is `head_dim` coordinates,
    /// in the kernels' order for `lanes` lanes ([`to_kernel_order`]) when `kernel_order` is
    /// `Some(lanes)`, else natural.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub fn set_head(
        &mut self,
        j: usize,
        (max, sum): (f32, f32),
        acc: &[f32],
        kernel_order: Option<usize>,
    ) {
        let d = acc.len();
        self.max[j] = max;
        self.sum[j] = sum;
        let out = &mut self.acc[j * d..][..d];
        match kernel_order {
            Some(lanes) => from_kernel_order(acc, lanes, out),
            None => out.copy_from_slice(acc),
        }
    }

    /// Folds `next` (the following key range) into `self`.
    pub fn merge(&mut self, next: &Partial) {
        let d = self.acc.len() / self.max.len().max(1);
        for j in 0..self.max.len() {
            let m = self.max[j].max(next.max[j]);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let (a, b) = ((self.max[j] - m).exp(), (next.max[j] - m).exp());
            self.sum[j] = self.sum[j] * a + next.sum[j] * b;
            for (x, &y) in self.acc[j * d..][..d]
                .iter_mut()
                .zip(&next.acc[j * d..][..d])
            {
                *x = *x * a + y * b;
            }
            self.max[j] = m;
        }
    }
}

/// The keys a kernel reads: positions `start..end` of the blocks in `slots` for KV head `g`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyRange<'a> {
    /// Hot slots of the blocks, in order.
    pub slots: &'a [u32],
    /// Positions per block.
    pub block_size: usize,
    /// KV heads per position.
    pub kv_heads: usize,
    /// The KV head.
    pub g: usize,
    /// First position.
    pub start: usize,
    /// One past the last position.
    pub end: usize,
    /// Whether the kernel records each softmax tile's state ([`Partial::tiles`]).
    pub trace: bool,
}

impl KeyRange<'_> {
    /// The row of position `t` (KV head `g`) in the layer's code arrays: blocks are head-major
    /// ([`crate::LAYOUT`]), so the rows of one block's positions are consecutive.
    #[inline]
    pub fn row(&self, t: usize) -> usize {
        let bs = self.block_size;
        (self.slots[t / bs] as usize * self.kv_heads + self.g) * bs + t % bs
    }

    /// The rows of positions `t..t + out.len()` ([`Self::row`] of each), one division for the
    /// run: within a block the rows are consecutive.
    #[inline]
    pub fn rows_into(&self, t: usize, out: &mut [usize]) {
        if out.is_empty() {
            return;
        }
        let bs = self.block_size;
        let (mut block, mut at) = (t / bs, t % bs);
        let mut base = (self.slots[block] as usize * self.kv_heads + self.g) * bs;
        for r in out {
            if at == bs {
                (block, at) = (block + 1, 0);
                base = (self.slots[block] as usize * self.kv_heads + self.g) * bs;
            }
            *r = base + at;
            at += 1;
        }
    }
}

/// A layer's 4-bit TurboQuant codes and norms, and the codebook they index.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tq4Rows<'a> {
    /// The 16 centroids.
    pub codebook: &'a [f32; 16],
    /// Key codes, `code_row` bytes per row (two coordinates per byte, low nibble first).
    pub k_codes: &'a [u8],
    /// Key norms (f16, `norm_row` bytes per row).
    pub k_norms: &'a [u8],
    /// Value codes.
    pub v_codes: &'a [u8],
    /// Value norms.
    pub v_norms: &'a [u8],
    /// Code bytes per row.
    pub code_row: usize,
    /// Norm bytes per row.
    pub norm_row: usize,
}

/// Attention over the codes of any codec pair on one KV head's key range
/// ([`scalar_codes::codes_partial`]), compiled for `isa` (lowered to what this CPU runs):
/// the path of every layer whose keys and values are not both TurboQuant-4.
pub(crate) fn codes_partial(isa: Isa, job: &CodesJob<'_>) -> Partial {
    #[cfg(target_arch = "x86_64")]
    {
        x86::codes_partial(isa.min(Isa::detected()), job)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        scalar_codes::codes_partial(job)
    }
}

/// Whether `isa`'s kernel takes this geometry (head_dim a multiple of 32 up to 256, at most 8
/// query heads per KV head); the caller falls back to the scalar path otherwise.
pub(crate) fn tq4_supports(isa: Isa, head_dim: usize, group: usize) -> bool {
    isa != Isa::Scalar
        && head_dim.is_multiple_of(32)
        && (32..=256).contains(&head_dim)
        && (1..=8).contains(&group)
}

/// Runs `isa`'s kernel: the `group` query heads `q` (`[group, head_dim]`, rotated, the score
/// scale folded in) over `keys`; `None` when `isa` has no kernel for it on this CPU.
pub(crate) fn tq4_attend(
    isa: Isa,
    rows: &Tq4Rows<'_>,
    keys: &KeyRange<'_>,
    q: &[f32],
    group: usize,
    head_dim: usize,
) -> Option<Partial> {
    if !tq4_supports(isa, head_dim, group) || isa > Isa::detected() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::tq4_attend(isa, rows, keys, q, group, head_dim)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, keys, q);
        None
    }
}

/// Whether `isa` has a causal (prefill) kernel for this geometry: AVX-512 only, where one key
/// expansion shared by a tile of query rows pays; elsewhere a prefill attends row by row.
pub(crate) fn tq4_causal_supports(isa: Isa, head_dim: usize, group: usize) -> bool {
    isa >= Isa::Avx512 && isa <= Isa::detected() && tq4_supports(isa, head_dim, group)
}

/// Runs the causal kernel: `limits.len()` query rows (`q`: `[rows, group, head_dim]`, rotated,
/// scale folded in), row `r` attending the keys of `keys` before `limits[r]`; one softmax state
/// per (row, head), row-major. `None` when `isa` has no causal kernel here.
pub(crate) fn tq4_causal(
    isa: Isa,
    rows: &Tq4Rows<'_>,
    keys: &KeyRange<'_>,
    q: &[f32],
    limits: &[usize],
    group: usize,
    head_dim: usize,
) -> Option<Partial> {
    if !tq4_causal_supports(isa, head_dim, group) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::tq4_causal(isa, rows, keys, q, limits, group, head_dim)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, keys, q, limits);
        None
    }
}

/// A causal call over the codes of any codec pair: `limits.len()` query rows (`q`: `[rows,
/// group, d]`, prepared by the key codec, scale folded in), row `r` attending the keys of `keys`
/// before `limits[r]` (ascending).
pub(crate) struct CausalCodes<'a> {
    /// Keys' and values' codecs.
    pub codecs: (&'a crate::codec::Codec, &'a crate::codec::Codec),
    /// The layer's codes and norms.
    pub bytes: &'a crate::store::host::LayerBytes<'a>,
    /// The KV head's keys.
    pub keys: &'a KeyRange<'a>,
    /// The queries.
    pub q: &'a [f32],
    /// The queries unrotated, scale folded in (`[rows, group, d]`), for keys whose codec stores
    /// coordinates apart (an outlier split); empty otherwise.
    pub q_apart: &'a [f32],
    /// Each row's end (exclusive).
    pub limits: &'a [usize],
    /// Query heads per KV head.
    pub group: usize,
    /// Head dimension.
    pub d: usize,
}

/// Runs the causal kernel over any codec pair's codes (AVX-512, where
/// [`tq4_causal_supports`] holds for the geometry); one softmax state per (row, head),
/// row-major. `None` when `isa` has no such kernel here for the job.
pub(crate) fn codes_causal(isa: Isa, job: &CausalCodes<'_>) -> Option<Partial> {
    if !tq4_causal_supports(isa, job.d, job.group) {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    {
        x86::codes_causal(isa, job)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Reorders `natural` (a row of `head_dim` coordinates) into the kernels' order for `lanes`
/// lanes: per chunk of `lanes` code bytes (`2·lanes` coordinates), the even coordinates (low
/// nibbles) then the odd ones (high nibbles).
pub(crate) fn to_kernel_order(natural: &[f32], lanes: usize, out: &mut [f32]) {
    for (c, (src, dst)) in natural
        .chunks_exact(2 * lanes)
        .zip(out.chunks_exact_mut(2 * lanes))
        .enumerate()
    {
        let _ = c;
        for k in 0..lanes {
            dst[k] = src[2 * k];
            dst[lanes + k] = src[2 * k + 1];
        }
    }
}

/// The inverse of [`to_kernel_order`].
pub(crate) fn from_kernel_order(kernel: &[f32], lanes: usize, out: &mut [f32]) {
    for (src, dst) in kernel
        .chunks_exact(2 * lanes)
        .zip(out.chunks_exact_mut(2 * lanes))
    {
        for k in 0..lanes {
            dst[2 * k] = src[k];
            dst[2 * k + 1] = src[lanes + k];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_order_round_trips() {
        let natural: Vec<f32> = (0..64).map(|i| i as f32).collect();
        for lanes in [8, 16] {
            let mut k = vec![0.0; 64];
            to_kernel_order(&natural, lanes, &mut k);
            assert_eq!(k[0..3], [0.0, 2.0, 4.0]);
            assert_eq!(k[lanes], 1.0);
            let mut back = vec![0.0; 64];
            from_kernel_order(&k, lanes, &mut back);
            assert_eq!(back, natural);
        }
    }

    #[test]
    fn isa_names_parse_and_the_forced_tier_never_exceeds_the_cpu() {
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
        }
        assert_eq!(Isa::parse("AVX512 "), Some(Isa::Avx512));
        assert_eq!(Isa::parse("neon"), None);
        assert!(Isa::active() <= Isa::detected());
        assert_eq!(Isa::available().first(), Some(&Isa::Scalar));
        assert_eq!(Isa::available().last(), Some(&Isa::detected()));
    }

    #[test]
    fn merging_partials_equals_one_pass() {
        // Two heads, d = 2; scores and values chosen by hand.
        let keys = [
            (0.5f32, [1.0f32, 2.0]),
            (2.0, [3.0, -1.0]),
            (-1.0, [0.0, 4.0]),
        ];
        let one = |range: &[(f32, [f32; 2])]| {
            let mut p = Partial::empty(1, 2);
            let m = range.iter().map(|k| k.0).fold(f32::NEG_INFINITY, f32::max);
            p.max[0] = m;
            for (s, v) in range {
                let w = (s - m).exp();
                p.sum[0] += w;
                p.acc[0] += w * v[0];
                p.acc[1] += w * v[1];
            }
            p
        };
        let whole = one(&keys);
        let mut split = one(&keys[..1]);
        split.merge(&one(&keys[1..]));
        assert_eq!(split.max, whole.max);
        assert!((split.sum[0] - whole.sum[0]).abs() < 1e-6);
        for (a, b) in split.acc.iter().zip(&whole.acc) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }
}
