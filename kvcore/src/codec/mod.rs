//! Row codecs: how one head row of K or V becomes packed bytes plus a norm, and how attention
//! reads those bytes back without materializing the row.
//!
//! | codec | code bytes per row | norm bytes | bits / element at d = 64 |
//! |---|---|---|---|
//! | `F32` | 4·d | 0 | 32 |
//! | `F16` | 2·d | 0 | 16 |
//! | `Q8` (per-row absmax scale) | d | 2 (scale, f16) | 8.25 |
//! | `TurboQuant { bits: b }` | b·d/8 | 2 (‖x‖, f16) | b + 0.25 |
//! | `TurboQuantSplit { bits: b, outliers: n }` | b·d/8 + 3n | 2 (‖x − o‖, f16) | b + 0.25 + 24n/d |
//!
//! TurboQuant (MSE variant) stores `x` as `‖x‖` and the Lloyd–Max codes of `Π·x/‖x‖`, where Π is
//! the seeded rotation of [`rotation`]; `x̂ = ‖x‖·Πᵀ·c[idx]`. Because Π is orthogonal,
//! `⟨q, x̂⟩ = ‖x‖·⟨Πq, c[idx]⟩`: attention rotates the query once and never decodes a key, and it
//! sums values in the rotated space and rotates the sum back once.
//!
//! Codebooks (centroids in `t = x·√d` units; divide by √d for the stored unit-vector scale),
//! solved at construction by [`lloyd_max`]; the upper half is shown, the lower half mirrors it:
//!
//! | d | bits | upper centroids | MSE (= expected relative MSE) |
//! |---|---|---|---|
//! | 64 | 2 | 0.4521, 1.5000 | 0.11453 |
//! | 64 | 3 | 0.2438, 0.7507, 1.3293, 2.1113 | 0.033391 |
//! | 64 | 4 | 0.1274, 0.3847, 0.6505, 0.9319, 1.2394, 1.5908, 2.0233, 2.6464 | 0.0091318 |
//! | 128 | 4 | 0.1279, 0.3864, 0.6536, 0.9371, 1.2478, 1.6043, 2.0459, 2.6888 | 0.0093153 |
//!
//! 5 and 6 bits (32 and 64 levels; MSE at d = 64: 0.0024, 0.00064) serve the streams a
//! calibrated profile gives more bits, keys above all; their codes straddle bytes like 3 bits'.
//!
//! The **outlier split** (`TurboQuantSplit`, names like `tq6o1`) takes each row's `n` largest-
//! magnitude coordinates out *before* the rotation — post-RoPE keys put much of their energy in
//! a few channels, and TurboQuant's error is relative to the whole row's norm — and stores them
//! after the TurboQuant codes of the rest, `n` × (index byte, f16 value), in ascending index
//! order. A row decodes to `‖r‖·Πᵀ·c[idx] + Σ oⱼ·eⱼ` and scores as
//! `‖r‖·⟨Πq, c[idx]⟩ + Σ qⱼ·oⱼ`: attention still never decodes a key, it adds `n` products of
//! the unrotated query. One index byte limits the split to head_dim ≤ 256
//! ([`MAX_SPLIT_HEAD_DIM`]), and `n` is 1 to [`MAX_OUTLIERS`].
//!
//! (`cargo test -p engram-kvcore codebook_table -- --nocapture` prints these from the code; a
//! test fails if they drift from the table.) The Gaussian limit is the classic Max quantizer
//! (2 bits: ±0.4528, ±1.5104, MSE 0.1175; 4 bits: MSE 0.009497).

mod bitpack;
mod lloyd_max;
pub(crate) mod rng;
mod rotation;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::error::{KvError, KvResult};
use bitpack::for_each_code;
use rotation::Rotation;

/// The seed of the rotation unless configured otherwise. Part of the storage format.
pub const DEFAULT_ROTATION_SEED: u64 = 0x454E_4752_414D_0001;

/// Which codec a layer uses. Serialized in manifests as `{"kind":"turbo_quant","bits":4}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CodecKind {
    /// IEEE single precision, no norm: exact, for correctness anchors against f32 engines.
    F32,
    /// IEEE half precision, no norm. The reference codec.
    F16,
    /// Signed 8-bit codes with a per-row absmax scale (f16).
    Q8,
    /// Rotation + Lloyd–Max codebook + f16 norm, at 2 to 6 bits per coordinate.
    TurboQuant {
        /// Bits per coordinate: 2 to 6.
        bits: u8,
    },
    /// TurboQuant of a row without its `outliers` largest-magnitude coordinates, which are
    /// stored apart at f16 (see the module docs). Serialized as
    /// `{"kind":"turbo_quant_split","bits":6,"outliers":1}`.
    TurboQuantSplit {
        /// Bits per coordinate of the rest of the row: 2 to 6.
        bits: u8,
        /// Coordinates stored apart: 1 to [`MAX_OUTLIERS`].
        outliers: u8,
    },
}

/// The most coordinates an outlier split stores apart per row.
pub const MAX_OUTLIERS: u8 = 4;

/// The largest head_dim an outlier split takes (its indices are one byte).
pub const MAX_SPLIT_HEAD_DIM: usize = 256;

/// Bytes of one stored outlier: its index and its f16 value.
const OUTLIER_BYTES: usize = 3;

impl CodecKind {
    /// The default: TurboQuant at 4 bits.
    pub const TQ4: Self = Self::TurboQuant { bits: 4 };

    /// Packed code bytes of one row of `head_dim` elements.
    pub fn code_bytes(self, head_dim: usize) -> usize {
        match self {
            Self::F32 => 4 * head_dim,
            Self::F16 => 2 * head_dim,
            Self::Q8 => head_dim,
            Self::TurboQuant { bits } => head_dim * usize::from(bits) / 8,
            Self::TurboQuantSplit { bits, outliers } => {
                head_dim * usize::from(bits) / 8 + OUTLIER_BYTES * usize::from(outliers)
            }
        }
    }

    /// Coordinates per row stored apart (0 but for the outlier split).
    pub fn outliers(self) -> usize {
        match self {
            Self::TurboQuantSplit { outliers, .. } => usize::from(outliers),
            _ => 0,
        }
    }

    /// TurboQuant's bits per coordinate, split or not (None for the other codecs).
    pub fn turboquant_bits(self) -> Option<u8> {
        match self {
            Self::TurboQuant { bits } | Self::TurboQuantSplit { bits, .. } => Some(bits),
            _ => None,
        }
    }

    /// Norm (or scale) bytes of one row.
    pub fn norm_bytes(self) -> usize {
        match self {
            Self::F32 | Self::F16 => 0,
            Self::Q8 | Self::TurboQuant { .. } | Self::TurboQuantSplit { .. } => 2,
        }
    }

    /// Stored bits per element, norms included.
    pub fn bits_per_element(self, head_dim: usize) -> f64 {
        8.0 * (self.code_bytes(head_dim) + self.norm_bytes()) as f64 / head_dim as f64
    }
}

impl std::fmt::Display for CodecKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::F32 => f.write_str("f32"),
            Self::F16 => f.write_str("f16"),
            Self::Q8 => f.write_str("q8"),
            Self::TurboQuant { bits } => write!(f, "tq{bits}"),
            Self::TurboQuantSplit { bits, outliers } => write!(f, "tq{bits}o{outliers}"),
        }
    }
}

/// The codec names [`CodecKind`]'s `FromStr` knows.
pub const CODEC_NAMES: &str = "f32, f16, q8, tq6, tq5, tq4, tq3, tq2, or tqBoN: TurboQuant at B bits with N outliers per \
     row stored apart (B 2 to 6, N 1 to 4, such as tq6o1)";

/// A codec name `CodecKind::from_str` does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown codec `{name}` ({CODEC_NAMES})")]
pub struct UnknownCodec {
    /// The name as given (trimmed).
    pub name: String,
}

impl std::str::FromStr for CodecKind {
    type Err = UnknownCodec;

    /// `f32`, `f16`, `q8`, `tq2` to `tq6` (TurboQuant at 2 to 6 bits), or `tqBoN` (TurboQuant
    /// at `B` bits with an outlier split of `N` coordinates per row, `N` 1 to
    /// [`MAX_OUTLIERS`]): what `Display` prints, read back.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        // One decimal digit in `lo..=hi`.
        let digit = |t: &str, lo: u8, hi: u8| match t.as_bytes() {
            [c @ b'0'..=b'9'] => Some(c - b'0').filter(|v| (lo..=hi).contains(v)),
            _ => None,
        };
        let kind = match s {
            "f32" => Some(Self::F32),
            "f16" => Some(Self::F16),
            "q8" => Some(Self::Q8),
            _ => s
                .strip_prefix("tq")
                .and_then(|rest| match rest.split_once('o') {
                    None => digit(rest, 2, 6).map(|bits| Self::TurboQuant { bits }),
                    Some((b, n)) => digit(b, 2, 6)
                        .zip(digit(n, 1, MAX_OUTLIERS))
                        .map(|(bits, outliers)| Self::TurboQuantSplit { bits, outliers }),
                }),
        };
        kind.ok_or_else(|| UnknownCodec {
            name: s.to_string(),
        })
    }
}

/// Input rows in any of the precisions a model produces.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
}

impl Rows<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::F16(x) => x.len(),
            Self::Bf16(x) => x.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies elements `start..start + out.len()` into `out` as f32.
    pub(crate) fn read_into(&self, start: usize, out: &mut [f32]) {
        let end = start + out.len();
        match self {
            Self::F32(x) => out.copy_from_slice(&x[start..end]),
            Self::F16(x) => out
                .iter_mut()
                .zip(&x[start..end])
                .for_each(|(o, v)| *o = v.to_f32()),
            Self::Bf16(x) => out
                .iter_mut()
                .zip(&x[start..end])
                .for_each(|(o, v)| *o = v.to_f32()),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct TurboQuant {
    bits: u8,
    rotation: Rotation,
    /// Ascending centroids in unit-vector scale.
    codebook: Vec<f32>,
    /// Midpoints between consecutive centroids.
    thresholds: Vec<f32>,
    /// The Lloyd–Max solve's expected relative MSE.
    expected_mse: f64,
    /// For 4 and 2 bits: the codebook values of every byte's codes (256 × 8/bits floats), so a
    /// row expands with one table read per byte. Empty for 3, 5 and 6 bits (codes straddle
    /// bytes).
    byte_table: Vec<f32>,
}

/// The constants of a TurboQuant codec with a Hadamard rotation (see
/// [`Codec::turboquant_tables`]): `Πx = scale · H · (signs ⊙ x)`, code `i` of a unit row is the
/// number of `thresholds` below `(Πx)_i / ‖x‖`, and decodes to `codebook[i]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TurboQuantTables {
    /// Bits per coordinate.
    pub bits: u8,
    /// The random signs `D` (±1), `head_dim` of them.
    pub signs: Vec<f32>,
    /// `1/√head_dim`.
    pub scale: f32,
    /// Ascending centroids, `2^bits` of them.
    pub codebook: Vec<f32>,
    /// Midpoints between consecutive centroids.
    pub thresholds: Vec<f32>,
}

/// A built codec for one head_dim: the rotation and codebook are computed once here.
#[derive(Debug, Clone, PartialEq)]
pub struct Codec {
    kind: CodecKind,
    head_dim: usize,
    tq: Option<TurboQuant>,
    /// Where an outlier split's stored-apart pairs start in a row's code bytes (after the
    /// TurboQuant codes; the row's end for the other codecs).
    tq_code_bytes: usize,
}

impl Codec {
    /// Builds the codec; TurboQuant solves its codebook and derives its rotation from `seed`.
    pub fn new(kind: CodecKind, head_dim: usize, seed: u64) -> KvResult<Self> {
        check_head_dim(head_dim)?;
        if let CodecKind::TurboQuantSplit { outliers, .. } = kind {
            if !(1..=MAX_OUTLIERS).contains(&outliers) {
                return Err(KvError::InvalidConfig {
                    field: "outliers",
                    value: f64::from(outliers),
                    reason: "an outlier split stores 1 to 4 coordinates per row",
                });
            }
            if head_dim > MAX_SPLIT_HEAD_DIM {
                return Err(KvError::InvalidConfig {
                    field: "head_dim",
                    value: head_dim as f64,
                    reason: "an outlier split indexes coordinates with one byte: at most 256",
                });
            }
        }
        let tq = match kind.turboquant_bits() {
            None => None,
            Some(bits) => {
                if !(2..=6).contains(&bits) {
                    return Err(KvError::UnsupportedBits { bits });
                }
                let q = lloyd_max::solve(head_dim, bits);
                let scale = 1.0 / (head_dim as f64).sqrt();
                let codebook: Vec<f32> = q.centroids.iter().map(|c| (c * scale) as f32).collect();
                let thresholds = codebook.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
                let byte_table = match bits {
                    2 | 4 => (0..=255u8)
                        .flat_map(|byte| {
                            let mut values = Vec::with_capacity(8 / usize::from(bits));
                            for_each_code(&[byte], bits, |_, c| values.push(codebook[c]));
                            values
                        })
                        .collect(),
                    _ => Vec::new(),
                };
                Some(TurboQuant {
                    expected_mse: q.mse,
                    byte_table,
                    bits,
                    rotation: Rotation::new(head_dim, seed),
                    codebook,
                    thresholds,
                })
            }
        };
        let tq_code_bytes = match kind.turboquant_bits() {
            Some(bits) => head_dim * usize::from(bits) / 8,
            None => kind.code_bytes(head_dim),
        };
        Ok(Self {
            kind,
            head_dim,
            tq,
            tq_code_bytes,
        })
    }

    /// The codec's kind.
    pub fn kind(&self) -> CodecKind {
        self.kind
    }

    /// Elements per row.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Packed code bytes per row.
    pub fn code_bytes(&self) -> usize {
        self.kind.code_bytes(self.head_dim)
    }

    /// Norm bytes per row.
    pub fn norm_bytes(&self) -> usize {
        self.kind.norm_bytes()
    }

    /// Coordinates per row stored apart by an outlier split (0 for the other codecs).
    pub fn outliers(&self) -> usize {
        self.kind.outliers()
    }

    /// The TurboQuant codebook in unit-vector scale (empty for F16 and Q8).
    pub fn codebook(&self) -> &[f32] {
        self.tq.as_ref().map_or(&[], |t| t.codebook.as_slice())
    }

    /// What a GPU kernel needs to reproduce this codec's TurboQuant encoding and attention:
    /// `None` for the other codecs and for a head_dim that is not a power of two (dense
    /// rotation).
    pub fn turboquant_tables(&self) -> Option<TurboQuantTables> {
        if self.outliers() > 0 {
            return None;
        }
        let tq = self.tq.as_ref()?;
        match &tq.rotation {
            Rotation::Hadamard { signs, scale } => Some(TurboQuantTables {
                bits: tq.bits,
                signs: signs.clone(),
                scale: *scale,
                codebook: tq.codebook.clone(),
                thresholds: tq.thresholds.clone(),
            }),
            Rotation::Dense { .. } => None,
        }
    }

    /// The expected relative MSE of the Lloyd–Max solve (None for F16 and Q8).
    pub fn expected_relative_mse(&self) -> Option<f64> {
        self.tq.as_ref().map(|t| t.expected_mse)
    }

    /// Encodes `rows` (a whole number of rows of `head_dim`) into `codes` and `norms`.
    ///
    /// Errors (and writes nothing) on a wrong buffer size or a row that is not encodable
    /// (non-finite values, or a norm beyond f16's range).
    pub fn encode(&self, rows: Rows<'_>, codes: &mut [u8], norms: &mut [u8]) -> KvResult<()> {
        let d = self.head_dim;
        if rows.is_empty() || !rows.len().is_multiple_of(d) {
            return Err(KvError::RowWidth {
                expected: d * rows.len().div_ceil(d).max(1),
                got: rows.len(),
            });
        }
        let n = rows.len() / d;
        self.check_buffers(n, codes.len(), norms.len())?;
        // Validate every row first so that a bad row leaves the outputs untouched.
        let mut row = vec![0.0f32; d];
        for r in 0..n {
            rows.read_into(r * d, &mut row);
            self.check_encodable(&row)?;
        }
        let mut scratch = vec![0.0f32; d];
        let mut idx = vec![0u8; d];
        for r in 0..n {
            rows.read_into(r * d, &mut row);
            let code = &mut codes[r * self.code_bytes()..(r + 1) * self.code_bytes()];
            let norm = &mut norms[r * self.norm_bytes()..(r + 1) * self.norm_bytes()];
            self.encode_row(&row, code, norm, &mut scratch, &mut idx);
        }
        Ok(())
    }

    /// Decodes `codes`/`norms` of whole rows into `out` (the dequantize reference path).
    pub fn decode(&self, codes: &[u8], norms: &[u8], out: &mut [f32]) -> KvResult<()> {
        let d = self.head_dim;
        if out.is_empty() || !out.len().is_multiple_of(d) {
            return Err(KvError::RowWidth {
                expected: d * out.len().div_ceil(d).max(1),
                got: out.len(),
            });
        }
        let n = out.len() / d;
        self.check_buffers(n, codes.len(), norms.len())?;
        self.decode_rows(codes, norms, out, &mut vec![0.0f32; d]);
        Ok(())
    }

    /// Decodes whole rows whose buffer sizes the caller has checked; `scratch` holds `head_dim`.
    pub(crate) fn decode_rows(
        &self,
        codes: &[u8],
        norms: &[u8],
        out: &mut [f32],
        scratch: &mut [f32],
    ) {
        let d = self.head_dim;
        for (r, o) in out.chunks_exact_mut(d).enumerate() {
            let code = &codes[r * self.code_bytes()..(r + 1) * self.code_bytes()];
            let norm = &norms[r * self.norm_bytes()..(r + 1) * self.norm_bytes()];
            self.decode_row(code, norm, o, scratch);
        }
    }

    fn check_buffers(&self, rows: usize, codes: usize, norms: usize) -> KvResult<()> {
        if codes != rows * self.code_bytes() {
            return Err(KvError::RowWidth {
                expected: rows * self.code_bytes(),
                got: codes,
            });
        }
        if norms != rows * self.norm_bytes() {
            return Err(KvError::RowWidth {
                expected: rows * self.norm_bytes(),
                got: norms,
            });
        }
        Ok(())
    }

    /// Checks that a row can be encoded: finite, and its norm (Q8: absmax) fits an f16.
    pub(crate) fn check_encodable(&self, row: &[f32]) -> KvResult<()> {
        let magnitude = match self.kind {
            // Finite f32 values are stored exactly.
            CodecKind::F32 => 0.0,
            CodecKind::F16 | CodecKind::Q8 => row.iter().fold(0.0f32, |m, v| m.max(v.abs())),
            CodecKind::TurboQuant { .. } | CodecKind::TurboQuantSplit { .. } => l2(row),
        };
        let fits = magnitude.is_finite() && magnitude <= f16::MAX.to_f32();
        if !fits || row.iter().any(|v| !v.is_finite()) {
            return Err(KvError::NotEncodable { norm: magnitude });
        }
        Ok(())
    }

    /// Encodes one validated row. `scratch` and `idx` hold `head_dim` elements.
    pub(crate) fn encode_row(
        &self,
        row: &[f32],
        code: &mut [u8],
        norm: &mut [u8],
        scratch: &mut [f32],
        idx: &mut [u8],
    ) {
        match self.kind {
            CodecKind::F32 => {
                for (c, &v) in code.chunks_exact_mut(4).zip(row) {
                    c.copy_from_slice(&v.to_le_bytes());
                }
            }
            CodecKind::F16 => {
                for (c, &v) in code.chunks_exact_mut(2).zip(row) {
                    c.copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
            CodecKind::Q8 => {
                let absmax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                // Quantize with the scale as it will be stored, so decode sees the same scale.
                let scale = f16::from_f32(absmax / 127.0);
                norm.copy_from_slice(&scale.to_le_bytes());
                let s = scale.to_f32();
                let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                for (c, &v) in code.iter_mut().zip(row) {
                    *c = ((v * inv).round().clamp(-127.0, 127.0) as i8) as u8;
                }
            }
            CodecKind::TurboQuant { bits } => {
                let Some(tq) = &self.tq else { return };
                encode_turboquant(tq, bits, row, code, norm, scratch, idx);
            }
            CodecKind::TurboQuantSplit { bits, .. } => {
                let Some(tq) = &self.tq else { return };
                let (tq_code, apart) = code.split_at_mut(self.tq_code_bytes);
                let mut rest = [0.0f32; MAX_SPLIT_HEAD_DIM];
                let rest = &mut rest[..row.len()];
                rest.copy_from_slice(row);
                // The largest magnitudes, the first index on ties, each taken once.
                let mut picked = [usize::MAX; MAX_OUTLIERS as usize];
                for k in 0..self.outliers() {
                    let mut best = None::<(usize, f32)>;
                    for (j, &v) in row.iter().enumerate() {
                        if picked[..k].contains(&j) {
                            continue;
                        }
                        if best.is_none_or(|(_, m)| v.abs() > m) {
                            best = Some((j, v.abs()));
                        }
                    }
                    picked[k] = best.map_or(0, |(j, _)| j);
                }
                let picked = &mut picked[..self.outliers()];
                picked.sort_unstable();
                for (&j, out) in picked.iter().zip(apart.chunks_exact_mut(OUTLIER_BYTES)) {
                    out[0] = j as u8;
                    out[1..].copy_from_slice(&f16::from_f32(row[j]).to_le_bytes());
                    rest[j] = 0.0;
                }
                encode_turboquant(tq, bits, rest, tq_code, norm, scratch, idx);
            }
        }
    }

    fn decode_row(&self, code: &[u8], norm: &[u8], out: &mut [f32], scratch: &mut [f32]) {
        let scale = self.row_scale(norm);
        match &self.tq {
            Some(tq) => {
                self.expand(code, scratch);
                tq.rotation.inverse(scratch, out);
            }
            None => self.expand(code, out),
        }
        out.iter_mut().for_each(|o| *o *= scale);
        for (j, v) in self.apart(code) {
            if let Some(o) = out.get_mut(j) {
                *o += v;
            }
        }
    }

    /// Where an outlier split's stored-apart pairs start in a row's code bytes (after the
    /// TurboQuant codes); each pair is an index byte and an f16 value.
    pub(crate) fn apart_offset(&self) -> usize {
        self.tq_code_bytes
    }

    /// The coordinates an outlier split stored apart in a row's code bytes: (index, value).
    #[inline]
    pub(crate) fn apart<'a>(&self, code: &'a [u8]) -> impl Iterator<Item = (usize, f32)> + 'a {
        // Empty for the other codecs: their codes end the row.
        let apart = code.get(self.tq_code_bytes..).unwrap_or_default();
        apart
            .chunks_exact(OUTLIER_BYTES)
            .map(|o| (usize::from(o[0]), f16::from_le_bytes([o[1], o[2]]).to_f32()))
    }

    /// `Σ q[j]·o_j` over a row's stored-apart coordinates (`q` unrotated; 0 without a split):
    /// the term a score adds to `row_scale · ⟨q', expand(code)⟩`. An index past `q` (bytes
    /// that did not come from this codec) counts 0.
    #[inline]
    pub(crate) fn apart_dot(&self, code: &[u8], q: &[f32]) -> f32 {
        self.apart(code)
            .map(|(j, v)| q.get(j).copied().unwrap_or(0.0) * v)
            .sum()
    }

    /// Prepares a query for scoring: q' = Πq for TurboQuant, a copy otherwise.
    pub(crate) fn prepare_query(&self, q: &[f32], out: &mut [f32]) {
        match &self.tq {
            Some(tq) => tq.rotation.forward(q, out),
            None => out.copy_from_slice(q),
        }
    }

    /// Writes a row's code values into `out` (`head_dim` floats), without rotating back or
    /// scaling: `codebook[idx]` for TurboQuant, the integer codes for Q8, the halves for F16.
    /// A row is then `row_scale · (Πᵀ) · out`, and a score is `row_scale · ⟨q', out⟩`.
    #[inline]
    pub(crate) fn expand(&self, code: &[u8], out: &mut [f32]) {
        let code = &code[..self.tq_code_bytes.min(code.len())];
        match &self.tq {
            // Fixed-size copies per byte: the compiler keeps them in registers.
            Some(tq) if tq.bits == 4 => {
                let t = tq.byte_table.as_slice();
                for (o, &byte) in out.chunks_exact_mut(2).zip(code) {
                    let i = 2 * usize::from(byte);
                    o[0] = t[i];
                    o[1] = t[i + 1];
                }
            }
            Some(tq) if tq.bits == 2 => {
                let t = tq.byte_table.as_slice();
                for (o, &byte) in out.chunks_exact_mut(4).zip(code) {
                    let i = 4 * usize::from(byte);
                    o.copy_from_slice(&t[i..i + 4]);
                }
            }
            Some(tq) => {
                let cb = tq.codebook.as_slice();
                for_each_code(code, tq.bits, |i, c| out[i] = cb[c]);
            }
            None => match self.kind {
                CodecKind::Q8 => {
                    for (o, &c) in out.iter_mut().zip(code) {
                        *o = f32::from(c as i8);
                    }
                }
                CodecKind::F32 => {
                    for (o, c) in out.iter_mut().zip(code.chunks_exact(4)) {
                        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
                _ => {
                    for (o, c) in out.iter_mut().zip(code.chunks_exact(2)) {
                        *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                    }
                }
            },
        }
    }

    /// The factor a row's expanded values are multiplied by: ‖x‖ (TurboQuant), the absmax
    /// scale (Q8), 1 (F16).
    #[inline]
    pub(crate) fn row_scale(&self, norm: &[u8]) -> f32 {
        match self.kind {
            CodecKind::F32 | CodecKind::F16 => 1.0,
            CodecKind::Q8 | CodecKind::TurboQuant { .. } | CodecKind::TurboQuantSplit { .. } => {
                read_norm(norm)
            }
        }
    }

    /// Maps an accumulator back to model space: Πᵀ·acc for TurboQuant, a copy otherwise.
    pub(crate) fn finish(&self, acc: &[f32], out: &mut [f32]) {
        match &self.tq {
            Some(tq) => tq.rotation.inverse(acc, out),
            None => out.copy_from_slice(acc),
        }
    }
}

/// TurboQuant's encoding of one validated row into its codes and norm.
fn encode_turboquant(
    tq: &TurboQuant,
    bits: u8,
    row: &[f32],
    code: &mut [u8],
    norm: &mut [u8],
    scratch: &mut [f32],
    idx: &mut [u8],
) {
    let n = l2(row);
    let stored = f16::from_f32(n);
    norm.copy_from_slice(&stored.to_le_bytes());
    if stored.to_f32() == 0.0 {
        // The norm decodes to zero; any code gives x̂ = 0.
        code.fill(0);
        return;
    }
    // Π is linear: rotate the row, then scale to the unit sphere.
    tq.rotation.forward(row, scratch);
    let inv = 1.0 / n;
    scratch.iter_mut().for_each(|y| *y *= inv);
    // idx = number of thresholds below y (thresholds ascend): counted threshold by threshold
    // over the whole row, which is branchless and vectorizes.
    idx.fill(0);
    for &t in &tq.thresholds {
        for (i, &y) in idx.iter_mut().zip(scratch.iter()) {
            *i += u8::from(t < y);
        }
    }
    bitpack::pack(idx, bits, code);
}

#[inline]
fn read_norm(norm: &[u8]) -> f32 {
    f16::from_le_bytes([norm[0], norm[1]]).to_f32()
}

/// ⟨a, b⟩ with eight independent partial sums, so the loop vectorizes and is not bound by the
/// latency of one accumulator. Lengths are multiples of 8 (head_dim invariant).
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum()
}

/// y += w·x.
#[inline]
pub(crate) fn axpy(y: &mut [f32], w: f32, x: &[f32]) {
    for (a, &b) in y.iter_mut().zip(x) {
        *a += w * b;
    }
}

fn l2(row: &[f32]) -> f32 {
    row.iter().map(|v| v * v).sum::<f32>().sqrt()
}

/// Head dimensions every codec supports: multiples of 8 in `8..=1024`.
pub(crate) fn check_head_dim(head_dim: usize) -> KvResult<()> {
    if !(8..=1024).contains(&head_dim) || !head_dim.is_multiple_of(8) {
        return Err(KvError::InvalidConfig {
            field: "head_dim",
            value: head_dim as f64,
            reason: "must be a multiple of 8 in 8..=1024",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codebook_table() {
        // Prints the doc table's rows and checks them against the values stated there.
        let stated: [(usize, u8, &[f64], f64); 4] = [
            (64, 2, &[0.4521, 1.5000], 0.11453),
            (64, 3, &[0.2438, 0.7507, 1.3293, 2.1113], 0.033391),
            (
                64,
                4,
                &[
                    0.1274, 0.3847, 0.6505, 0.9319, 1.2394, 1.5908, 2.0233, 2.6464,
                ],
                0.0091318,
            ),
            (
                128,
                4,
                &[
                    0.1279, 0.3864, 0.6536, 0.9371, 1.2478, 1.6043, 2.0459, 2.6888,
                ],
                0.0093153,
            ),
        ];
        let solved: Vec<_> = stated
            .iter()
            .map(|&(d, bits, _, _)| lloyd_max::solve(d, bits))
            .collect();
        for (&(d, bits, _, _), q) in stated.iter().zip(&solved) {
            let half = &q.centroids[q.centroids.len() / 2..];
            let shown: Vec<String> = half.iter().map(|c| format!("{c:.4}")).collect();
            println!("| {d} | {bits} | {} | {:.4e} |", shown.join(", "), q.mse);
        }
        for (&(d, bits, upper, mse), q) in stated.iter().zip(&solved) {
            let half = &q.centroids[q.centroids.len() / 2..];
            for (got, want) in half.iter().zip(upper) {
                assert!(
                    (got - want).abs() < 1.5e-4,
                    "d {d} bits {bits}: {got} vs {want}"
                );
            }
            assert!(
                (q.mse - mse).abs() / mse < 2e-3,
                "d {d} bits {bits}: {}",
                q.mse
            );
        }
    }

    #[test]
    fn bits_per_element_at_head_dim_64() {
        assert_eq!(CodecKind::TQ4.bits_per_element(64), 4.25);
        assert_eq!(CodecKind::TurboQuant { bits: 3 }.bits_per_element(64), 3.25);
        assert_eq!(CodecKind::TurboQuant { bits: 2 }.bits_per_element(64), 2.25);
        assert_eq!(CodecKind::TurboQuant { bits: 5 }.bits_per_element(64), 5.25);
        assert_eq!(CodecKind::TurboQuant { bits: 6 }.bits_per_element(64), 6.25);
        assert_eq!(CodecKind::Q8.bits_per_element(64), 8.25);
        assert_eq!(CodecKind::F16.bits_per_element(64), 16.0);
    }

    #[test]
    fn unsupported_bits_and_head_dims_are_rejected() {
        for bits in [0, 1, 7, 8] {
            assert_eq!(
                Codec::new(CodecKind::TurboQuant { bits }, 64, 1),
                Err(KvError::UnsupportedBits { bits })
            );
        }
        for d in [0, 4, 63, 2048] {
            assert!(matches!(
                Codec::new(CodecKind::TQ4, d, 1),
                Err(KvError::InvalidConfig {
                    field: "head_dim",
                    ..
                })
            ));
        }
    }

    #[test]
    fn serde_names_are_stable() {
        let json = serde_json::to_string(&CodecKind::TQ4).unwrap();
        assert_eq!(json, r#"{"kind":"turbo_quant","bits":4}"#);
        assert_eq!(
            serde_json::to_string(&CodecKind::Q8).unwrap(),
            r#"{"kind":"q8"}"#
        );
    }
}
