//! Weight matrices kept in their GGUF blocks, multiplied with f32 activations.
//!
//! A [`QMatrix`] holds a `[rows, cols]` weight matrix as one of two in-memory forms, each read
//! from several GGUF block types without changing a weight's value:
//!
//! * **nibbles** (`Q4_0`, `Q4_1`, `Q4_K`): per 32 weights a scale `s`, an offset `o` and 16
//!   bytes of 4-bit codes (low nibbles are weights 0..16, high nibbles 16..32); the weight is
//!   `q·s + o`. `Q4_0`'s `d·(q − 8)` is `q·d + (−8d)`, `Q4_K`'s `d·sc·q − dmin·m` is
//!   `q·(d·sc) + (−dmin·m)` with the two products formed as the GGUF reference does.
//! * **bytes** (`Q8_0`, `Q6_K`, `Q5_0`): per 16 weights a scale and 16 signed bytes; the weight
//!   is `q·s`. `Q5_0`'s `d·(q − 16)` is a signed byte times `d`: read losslessly into this form
//!   (a byte per weight instead of 5.5 bits, the W8A32 kernels).
//!
//! [`QMatrix::matmul`] computes `y = x · Wᵀ` for `m` activation rows (W4A32 / W8A32): up to 15
//! rows, each block is expanded to f32 in registers once and used by up to eight activation rows;
//! from 16 rows (prefill, AVX-512) a thread expands four weight rows at a time into an L1 tile
//! and runs every activation row against it. Both add in the same order, so an output is the
//! same bits whatever the number of rows in the product. These kernels do not quantize the activations. The weight rows are split over threads in fixed ranges, and each
//! output is one thread's sum in a fixed order, so results are deterministic for a given ISA (the
//! ISAs differ from each other in summation order only). The kernel tier is
//! [`Isa::active`]: AVX-512 F, AVX2 + FMA or portable Rust,
//! chosen at run time and lowered with `ENGRAM_SIMD`.
//!
//! [`QMatrix::with_activations`] switches a nibble matrix to integer activations (the `intdot`
//! module): int16 (W4A16) or int8 (W4A8), quantized per 32 columns and multiplied with integer
//! dot products (AVX-512 VNNI, AVX2, scalar), bit-identical on every tier, any row count and
//! thread count. Int16 rounds below the model's f32 noise and is about 1.5× the f32 activations'
//! prefill speed; int8 about 2.3×, and it moves answers. A byte matrix whose width is whole
//! 256-column blocks takes int16 activations too (W8A16, the `bytedot` module), with the same
//! guarantees; int8 leaves it on f32 activations. Its panels hold six bits a weight where every
//! weight is in `-32..32` (`Q6_K`, `Q5_0`; `Q6_K` at 6.625 bits with its scale bytes), else a
//! byte.
#![deny(unsafe_code)]

use half::f16;
use thiserror::Error;

pub use engram_kvcore::Isa;

mod bytedot;
mod intdot;
mod kernel;

pub use intdot::PANEL_ROWS;

/// What the activations of a product are multiplied as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Activations {
    /// f32, the weights expanded in registers (W4A32, W8A32).
    #[default]
    F32,
    /// Quantized per 32 columns to 16-bit integers (W4A16), nibble blocks only.
    Int16,
    /// Quantized per 32 columns to 8-bit integers (W4A8, llama.cpp's numerics), nibble blocks
    /// only.
    Int8,
}

impl Activations {
    fn bits(self) -> Option<intdot::Bits> {
        match self {
            Self::F32 => None,
            Self::Int16 => Some(intdot::Bits::I16),
            Self::Int8 => Some(intdot::Bits::I8),
        }
    }
}
pub use kernel::PANEL_MIN_M;

/// Weights per nibble group (one scale and one offset).
pub const NIBBLE_GROUP: usize = 32;
/// Weights per byte group (one scale).
pub const BYTE_GROUP: usize = 16;
/// Columns of every matrix are a multiple of this (the widest block the kernels step over).
pub const COL_STEP: usize = 32;

/// A GGUF block type this crate reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufBlock {
    /// 32 weights: f16 `d`, 16 bytes of nibbles; `d·(q − 8)`.
    Q4_0,
    /// 32 weights: f16 `d`, f16 `m`, 16 bytes of nibbles; `d·q + m`.
    Q4_1,
    /// 32 weights: f16 `d`, 32 signed bytes; `d·q`.
    Q8_0,
    /// 32 weights: f16 `d`, 4 bytes of high bits, 16 bytes of low nibbles; `d·(q − 16)` with
    /// `q` the 5-bit code.
    Q5_0,
    /// 256 weights: f16 `d`, f16 `dmin`, 12 bytes of 6-bit sub-block scales and mins, 128 bytes
    /// of nibbles.
    Q4K,
    /// 256 weights: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed sub-block
    /// scales, f16 `d`.
    Q6K,
}

impl GgufBlock {
    /// Weights per block.
    pub fn weights(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 | Self::Q5_0 => 32,
            Self::Q4K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q5_0 => 22,
            Self::Q4K => 144,
            Self::Q6K => 210,
        }
    }

    /// The in-memory form the blocks are read into.
    pub fn form(self) -> Form {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q4K => Form::Nibbles,
            Self::Q8_0 | Self::Q6K | Self::Q5_0 => Form::Bytes,
        }
    }
}

/// How a [`QMatrix`] holds its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Form {
    /// 4-bit codes, a scale and an offset per 32 weights.
    Nibbles,
    /// Signed bytes, a scale per 16 weights.
    Bytes,
}

/// What can go wrong reading blocks or multiplying.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum QError {
    /// A buffer of the wrong length.
    #[error("{what}: expected {expected}, got {got}")]
    Size {
        /// Which buffer.
        what: &'static str,
        /// The length the shape implies.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// Columns that are not whole blocks.
    #[error("{cols} columns is not a multiple of the block width {block}")]
    Columns {
        /// The matrix's columns.
        cols: usize,
        /// The block's weights.
        block: usize,
    },
    /// A kernel tier this CPU does not run.
    #[error("this CPU does not run the {0:?} kernels")]
    Isa(Isa),
    /// Matrices that cannot be stacked (different forms or widths, or none).
    #[error("cannot stack matrices of different forms or column counts")]
    Stack,
    /// A row permutation that is not one.
    #[error("row permutation of {len} entries for a matrix of {rows} rows")]
    Permutation {
        /// Entries given.
        len: usize,
        /// Rows of the matrix.
        rows: usize,
    },
}

/// A weight matrix in one of the two block forms.
#[derive(Clone, PartialEq)]
pub struct QMatrix {
    form: Form,
    rows: usize,
    cols: usize,
    /// Per group, row-major: `rows × cols / group`.
    scales: Vec<f32>,
    /// Per nibble group (empty for bytes).
    offsets: Vec<f32>,
    /// Nibbles: 16 bytes per group; bytes: one per weight.
    codes: Vec<u8>,
    /// Per row and 256 columns, the block's own scales: for `Q4_K` its `d` and `dmin` (every
    /// group's scale is `d·sc` and offset `−dmin·m`), so the integer panels keep a group's
    /// scale and offset as the bytes `sc` and `m` (see the `intdot` module); for `Q6_K` its `d`
    /// (with `sc8`). Else empty.
    supers: Vec<f32>,
    /// `Q6_K` only (else empty): per row and 16 columns the block's signed scale byte `sc`; the
    /// group's scale `d·sc` is formed where a row is read ([`QMatrix::row_in`]), the same bits as
    /// reading the block formed, so `scales` stays empty (1.08 bytes a weight instead of 1.25).
    sc8: Vec<i8>,
    /// The weights repacked for integer activations, when [`QMatrix::with_activations`] asked
    /// for them: then the panels are the only copy (`scales`, `offsets` and `codes` are empty;
    /// a row is read back from the panels where one is needed).
    int: Option<(Activations, Panels)>,
}

/// A matrix's weights repacked for integer activations.
#[derive(Clone, PartialEq)]
enum Panels {
    /// Nibbles in panels of 16 rows, with their scales (`intdot`).
    Nibbles(intdot::Panels),
    /// Bytes repacked per row; the scales stay in the matrix (`bytedot`).
    Bytes(bytedot::Panels),
}

impl Panels {
    fn bytes(&self) -> usize {
        match self {
            Self::Nibbles(p) => p.bytes(),
            Self::Bytes(p) => p.bytes(),
        }
    }
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("form", &self.form)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// A `Q4_K` sub-block's 6-bit scale and min (`j` in 0..8), as GGUF packs them in 12 bytes.
fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Packs 32 4-bit values (each < 16) into the nibble form's 16 bytes.
fn pack_nibbles(v: &[u8; 32], out: &mut Vec<u8>) {
    out.extend((0..16).map(|i| v[i] | (v[i + 16] << 4)));
}

impl QMatrix {
    /// Reads `rows × cols` weights stored as GGUF `block`s, row-major (each row whole blocks).
    pub fn from_gguf(
        block: GgufBlock,
        rows: usize,
        cols: usize,
        data: &[u8],
    ) -> Result<Self, QError> {
        let per = block.weights();
        if !cols.is_multiple_of(per) || cols == 0 {
            return Err(QError::Columns { cols, block: per });
        }
        let blocks = rows * cols / per;
        let expected = blocks * block.bytes();
        if data.len() != expected {
            return Err(QError::Size {
                what: "block bytes",
                expected,
                got: data.len(),
            });
        }
        let form = block.form();
        let weights = rows * cols;
        let mut m = Self {
            form,
            rows,
            cols,
            scales: Vec::with_capacity(weights / Self::group_of(form)),
            offsets: Vec::with_capacity(if form == Form::Nibbles {
                weights / 32
            } else {
                0
            }),
            codes: Vec::with_capacity(if form == Form::Nibbles {
                weights / 2
            } else {
                weights
            }),
            supers: Vec::with_capacity(match block {
                GgufBlock::Q4K => weights / 128,
                GgufBlock::Q6K => weights / 256,
                _ => 0,
            }),
            sc8: Vec::with_capacity(if block == GgufBlock::Q6K {
                weights / 16
            } else {
                0
            }),
            int: None,
        };
        for b in data.chunks_exact(block.bytes()) {
            m.push_block(block, b);
        }
        Ok(m)
    }

    fn group_of(form: Form) -> usize {
        match form {
            Form::Nibbles => NIBBLE_GROUP,
            Form::Bytes => BYTE_GROUP,
        }
    }

    fn push_block(&mut self, block: GgufBlock, b: &[u8]) {
        match block {
            GgufBlock::Q4_0 => {
                let d = f16_at(b, 0);
                self.scales.push(d);
                self.offsets.push(-8.0 * d);
                self.codes.extend_from_slice(&b[2..18]);
            }
            GgufBlock::Q4_1 => {
                self.scales.push(f16_at(b, 0));
                self.offsets.push(f16_at(b, 2));
                self.codes.extend_from_slice(&b[4..20]);
            }
            GgufBlock::Q8_0 => {
                let d = f16_at(b, 0);
                self.scales.extend([d, d]);
                self.codes.extend_from_slice(&b[2..34]);
            }
            GgufBlock::Q5_0 => {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                let qs = &b[6..22];
                self.scales.extend([d, d]);
                // Weight j < 16 is the low nibble of qs[j], weight j + 16 its high one; bit j
                // of qh is weight j's fifth bit.
                for j in 0..32 {
                    let lo = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
                    let hi = ((qh >> j) & 1) as u8;
                    self.codes.push(((lo | (hi << 4)) as i8 - 16) as u8);
                }
            }
            GgufBlock::Q4K => {
                let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
                self.supers.extend([d, dmin]);
                let (sc, qs) = (&b[4..16], &b[16..144]);
                // Four chunks of 64 weights: the low nibbles of 32 bytes, then their high ones.
                for c in 0..4 {
                    let q = &qs[c * 32..(c + 1) * 32];
                    for (half, shift) in [(0, 0), (1, 4)] {
                        let (s, mn) = q4k_scale_min(2 * c + half, sc);
                        self.scales.push(d * f32::from(s));
                        self.offsets.push(-(dmin * f32::from(mn)));
                        let mut v = [0u8; 32];
                        v.iter_mut()
                            .zip(q)
                            .for_each(|(v, q)| *v = (q >> shift) & 0xF);
                        pack_nibbles(&v, &mut self.codes);
                    }
                }
            }
            GgufBlock::Q6K => {
                let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                let d = f16_at(b, 208);
                self.supers.push(d);
                // Two halves of 128 weights; in each, weight `32·k + l` takes the low (k < 2) or
                // high (k ≥ 2) nibble of ql[l + 32·(k mod 2)] and bits 2k, 2k+1 of qh[l].
                for h in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * h..], &qh[32 * h..], &sc[8 * h..]);
                    for k in 0..4 {
                        for l in 0..32 {
                            let lo = (ql[l + 32 * (k % 2)] >> (4 * (k / 2))) & 0xF;
                            let hi = (qh[l] >> (2 * k)) & 3;
                            self.codes.push(((lo | (hi << 4)) as i8 - 32) as u8);
                        }
                        for s in 0..2 {
                            self.sc8.push(sc[2 * k + s] as i8);
                        }
                    }
                }
            }
        }
    }

    /// The form the weights are held in.
    pub fn form(&self) -> Form {
        self.form
    }

    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * (self.scales.len() + self.offsets.len() + self.supers.len())
            + self.sc8.len()
            + self.codes.len()
            + self.int.as_ref().map_or(0, |(_, p)| p.bytes())
    }

    /// The matrix multiplying with `acts` from now on (see the crate doc), when its form has
    /// integer kernels (nibbles; bytes of whole 256-column widths with int16), else f32.
    ///
    /// The weights are held once: in the panels of the integer kernels, or in rows.
    pub fn with_activations(self, acts: Activations) -> Self {
        let mut m = self.into_rows();
        m.int = match (acts, m.form) {
            (Activations::F32, _) => None,
            (a, Form::Nibbles) => intdot::Panels::of(&m).map(|p| (a, Panels::Nibbles(p))),
            (Activations::Int16, Form::Bytes) => {
                bytedot::Panels::of(&m).map(|p| (Activations::Int16, Panels::Bytes(p)))
            }
            (_, Form::Bytes) => None,
        };
        match &m.int {
            Some((_, Panels::Nibbles(p))) => {
                m.scales = Vec::new();
                m.offsets = Vec::new();
                m.codes = Vec::new();
                if p.holds_supers() {
                    m.supers = Vec::new();
                }
            }
            // The codes and scales are the panels'.
            Some((_, Panels::Bytes(_))) => {
                m.codes = Vec::new();
                m.scales = Vec::new();
                m.sc8 = Vec::new();
                m.supers = Vec::new();
            }
            None => {}
        }
        m
    }

    /// Whether the weights are held in rows (not only in integer panels).
    fn has_rows(&self) -> bool {
        self.int.is_none()
    }

    /// The matrix with its weights in rows and f32 activations (panels read back).
    fn into_rows(self) -> Self {
        let p = match &self.int {
            None => return self,
            Some((_, Panels::Bytes(p))) => {
                let mut codes = Vec::with_capacity(self.rows * self.cols);
                for r in 0..self.rows {
                    p.row_into(r, &mut codes);
                }
                let (scales, sc8, supers) = p.scales_back();
                return Self {
                    codes,
                    scales,
                    sc8,
                    supers,
                    int: None,
                    ..self
                };
            }
            Some((_, Panels::Nibbles(p))) => p,
        };
        let (mut scales, mut offsets, mut codes) = (Vec::new(), Vec::new(), Vec::new());
        let mut m = Self {
            form: self.form,
            rows: self.rows,
            cols: self.cols,
            scales: Vec::with_capacity(self.rows * self.groups_per_row()),
            offsets: Vec::with_capacity(self.rows * self.groups_per_row()),
            codes: Vec::with_capacity(self.rows * self.code_bytes_per_row()),
            supers: if p.holds_supers() {
                Vec::with_capacity(self.rows * self.cols / 128)
            } else {
                self.supers.clone()
            },
            sc8: self.sc8.clone(),
            int: None,
        };
        for r in 0..self.rows {
            p.row_into(r, &mut scales, &mut offsets, &mut codes);
            m.scales.extend_from_slice(&scales);
            m.offsets.extend_from_slice(&offsets);
            m.codes.extend_from_slice(&codes);
            p.supers_into(r, &mut m.supers);
        }
        m
    }

    /// This matrix with its weights in rows: itself, or a copy read back from its panels.
    fn in_rows(&self) -> std::borrow::Cow<'_, Self> {
        if self.has_rows() {
            std::borrow::Cow::Borrowed(self)
        } else {
            std::borrow::Cow::Owned(self.clone().into_rows())
        }
    }

    /// What products multiply the activations as.
    pub fn activations(&self) -> Activations {
        self.int.as_ref().map_or(Activations::F32, |(a, _)| *a)
    }

    fn groups_per_row(&self) -> usize {
        self.cols / Self::group_of(self.form)
    }

    fn code_bytes_per_row(&self) -> usize {
        match self.form {
            Form::Nibbles => self.cols / 2,
            Form::Bytes => self.cols,
        }
    }

    /// The rows of `parts` one after the other, as one matrix (one product then serves several
    /// projections of the same input, each output computed bit for bit as by its own matrix).
    /// With the parts' integer activations when they all have the same.
    pub fn stack(parts: &[&QMatrix]) -> Result<Self, QError> {
        let first = parts.first().ok_or(QError::Stack)?;
        if parts
            .iter()
            .any(|p| p.form != first.form || p.cols != first.cols)
        {
            return Err(QError::Stack);
        }
        let acts = first.activations();
        let same_acts = parts.iter().all(|p| p.activations() == acts);
        let parts: Vec<_> = parts.iter().map(|p| p.in_rows()).collect();
        // `Q6_K`'s scale bytes if every part has them, else every part's f32 scales.
        let compact = parts.iter().all(|p| !p.sc8.is_empty());
        let stacked = Self {
            form: first.form,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            scales: if compact {
                Vec::new()
            } else {
                parts.iter().flat_map(|p| p.f32_scales()).collect()
            },
            offsets: parts
                .iter()
                .flat_map(|p| p.offsets.iter().copied())
                .collect(),
            codes: parts.iter().flat_map(|p| p.codes.iter().copied()).collect(),
            // `d`, `dmin` only if every part has them; `Q6_K`'s `d` with its scale bytes.
            supers: if parts.iter().all(|p| !p.supers.is_empty())
                && (compact || parts.iter().all(|p| p.sc8.is_empty()))
            {
                parts
                    .iter()
                    .flat_map(|p| p.supers.iter().copied())
                    .collect()
            } else {
                Vec::new()
            },
            sc8: if compact {
                parts.iter().flat_map(|p| p.sc8.iter().copied()).collect()
            } else {
                Vec::new()
            },
            int: None,
        };
        Ok(if same_acts {
            stacked.with_activations(acts)
        } else {
            stacked
        })
    }

    /// The matrix with row `r` taken from row `order[r]` of this one.
    pub fn permute_rows(&self, order: &[usize]) -> Result<Self, QError> {
        let mut seen = vec![false; self.rows];
        let valid = order.len() == self.rows
            && order
                .iter()
                .all(|&r| r < self.rows && !std::mem::replace(&mut seen[r], true));
        if !valid {
            return Err(QError::Permutation {
                len: order.len(),
                rows: self.rows,
            });
        }
        let (g, c) = (self.groups_per_row(), self.code_bytes_per_row());
        let rows = self.in_rows();
        let moved = Self {
            form: self.form,
            rows: self.rows,
            cols: self.cols,
            scales: pick_rows(&rows.scales, order, g),
            offsets: pick_rows(&rows.offsets, order, g),
            codes: pick_rows(&rows.codes, order, c),
            supers: pick_rows(&rows.supers, order, self.supers_per_row()),
            sc8: pick_rows(&rows.sc8, order, g),
            int: None,
        };
        Ok(moved.with_activations(self.activations()))
    }

    /// Row `r`'s weights as f32 into `out` (`cols` long).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), QError> {
        if r >= self.rows {
            return Err(QError::Size {
                what: "row",
                expected: self.rows,
                got: r,
            });
        }
        if out.len() != self.cols {
            return Err(QError::Size {
                what: "row buffer",
                expected: self.cols,
                got: out.len(),
            });
        }
        match &self.int {
            Some((_, Panels::Bytes(p))) => {
                let mut codes = Vec::with_capacity(self.cols);
                p.row_into(r, &mut codes);
                let mut scales = Vec::new();
                p.row_scales_into(r, &mut scales);
                let row = Row {
                    scales: &scales,
                    offsets: &[],
                    codes: &codes,
                };
                kernel::dequant_row(Isa::active(), self.form, row, out);
            }
            Some((_, Panels::Nibbles(p))) => {
                let (mut scales, mut offsets, mut codes) = (Vec::new(), Vec::new(), Vec::new());
                p.row_into(r, &mut scales, &mut offsets, &mut codes);
                let row = Row {
                    scales: &scales,
                    offsets: &offsets,
                    codes: &codes,
                };
                kernel::dequant_row(Isa::active(), self.form, row, out);
            }
            None => {
                let mut buf = Vec::new();
                kernel::dequant_row(Isa::active(), self.form, self.row_in(r, &mut buf), out);
            }
        }
        Ok(())
    }

    /// The whole matrix as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            // Rows and lengths come from the matrix itself.
            let _ = self.dequantize_row(r, o);
        }
        out
    }

    /// The `d` (and `dmin`) floats of a row in `supers`.
    fn supers_per_row(&self) -> usize {
        match self.form {
            Form::Nibbles => self.cols / 128,
            Form::Bytes => self.cols / 256,
        }
    }

    /// Every group's f32 scale, row-major (formed from `Q6_K`'s bytes where it holds those).
    fn f32_scales(&self) -> Vec<f32> {
        if self.sc8.is_empty() {
            return self.scales.clone();
        }
        let mut out = Vec::with_capacity(self.sc8.len());
        let mut buf = Vec::new();
        for r in 0..self.rows {
            out.extend_from_slice(self.row_in(r, &mut buf).scales);
        }
        out
    }

    /// Row `r`, its group scales formed in `buf` where the matrix holds `Q6_K`'s scale bytes
    /// (`d·sc`, in f32 as reading the block did), else borrowed.
    pub(crate) fn row_in<'a>(&'a self, r: usize, buf: &'a mut Vec<f32>) -> Row<'a> {
        if self.sc8.is_empty() {
            return self.row(r);
        }
        let c = self.code_bytes_per_row();
        Row {
            scales: self.byte_scales(r, buf),
            offsets: &[],
            codes: &self.codes[r * c..(r + 1) * c],
        }
    }

    /// Row `r`'s group scales of a byte matrix: formed in `buf` from `Q6_K`'s scale bytes
    /// (`d·sc`, in f32 as reading the block did), else borrowed.
    fn byte_scales<'a>(&'a self, r: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        let g = self.groups_per_row();
        if self.sc8.is_empty() {
            return &self.scales[r * g..(r + 1) * g];
        }
        let per = self.supers_per_row();
        let d = &self.supers[r * per..(r + 1) * per];
        buf.clear();
        buf.extend(
            self.sc8[r * g..(r + 1) * g]
                .iter()
                .enumerate()
                .map(|(i, &s)| d[i / 16] * f32::from(s)),
        );
        buf
    }

    /// Row `r` of a matrix whose groups' scales are held as f32 (see [`Self::row_in`]).
    pub(crate) fn row(&self, r: usize) -> Row<'_> {
        let (g, c) = (self.groups_per_row(), self.code_bytes_per_row());
        Row {
            scales: &self.scales[r * g..(r + 1) * g],
            offsets: if self.offsets.is_empty() {
                &[]
            } else {
                &self.offsets[r * g..(r + 1) * g]
            },
            codes: &self.codes[r * c..(r + 1) * c],
        }
    }

    /// `y = x · Wᵀ` for `x: [m, cols]` and `y: [m, rows]`, row-major, on the active ISA and up
    /// to `threads` threads.
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32], threads: usize) -> Result<(), QError> {
        self.matmul_on(Isa::active(), x, m, y, threads)
    }

    /// [`Self::matmul`] on the given kernel tier (for tests and benchmarks; refused when the CPU
    /// does not run it).
    pub fn matmul_on(
        &self,
        isa: Isa,
        x: &[f32],
        m: usize,
        y: &mut [f32],
        threads: usize,
    ) -> Result<(), QError> {
        if isa > Isa::detected() {
            return Err(QError::Isa(isa));
        }
        if x.len() != m * self.cols {
            return Err(QError::Size {
                what: "activations",
                expected: m * self.cols,
                got: x.len(),
            });
        }
        if y.len() != m * self.rows {
            return Err(QError::Size {
                what: "output",
                expected: m * self.rows,
                got: y.len(),
            });
        }
        match &self.int {
            Some((a, Panels::Nibbles(p))) => match a.bits() {
                Some(bits) => intdot::product(isa, self, p, bits, x, m, y, threads.max(1)),
                None => kernel::product(isa, self, x, m, y, threads.max(1)),
            },
            Some((_, Panels::Bytes(p))) => bytedot::product(isa, self, p, x, m, y, threads.max(1)),
            None => kernel::product(isa, self, x, m, y, threads.max(1)),
        }
        Ok(())
    }
}

/// Rows of `n` entries of `v` in `order` (empty stays empty).
fn pick_rows<T: Copy>(v: &[T], order: &[usize], n: usize) -> Vec<T> {
    if v.is_empty() {
        return Vec::new();
    }
    order
        .iter()
        .flat_map(|&r| v[r * n..(r + 1) * n].iter().copied())
        .collect()
}

/// One weight row's groups.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row<'a> {
    pub scales: &'a [f32],
    pub offsets: &'a [f32],
    pub codes: &'a [u8],
}

/// `m` rows of `cols` activations as a product with `acts` sees them: each quantized per 32
/// columns and scaled back (`dx·xq`; f32 unchanged). For references in tests and for measuring
/// the rounding.
pub fn quantized_activations(
    x: &[f32],
    cols: usize,
    acts: Activations,
) -> Result<Vec<f32>, QError> {
    if !cols.is_multiple_of(NIBBLE_GROUP) || cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(QError::Columns {
            cols,
            block: NIBBLE_GROUP,
        });
    }
    Ok(match acts.bits() {
        Some(bits) => intdot::dequantized(x, x.len() / cols, cols, bits),
        None => x.to_vec(),
    })
}

/// Hands the allocator's freed pages back to the system (glibc's `malloc_trim`; elsewhere
/// nothing): loading a model reads its blocks into rows that the integer panels then replace,
/// and glibc keeps most of what that frees (144 MB of a 1.5B model's start-up, measured). Call
/// it once start-up is done; it returns whether memory was released.
pub fn release_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `malloc_trim` only walks and trims glibc's own heaps; any thread may call it.
        #[allow(unsafe_code)]
        let released = unsafe { libc::malloc_trim(0) };
        released == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
