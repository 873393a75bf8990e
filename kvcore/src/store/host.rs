//! Host-memory block storage: the cold tier, and the hot tier of the CPU engine.
//!
//! Layout ([`crate::LAYOUT`]): four contiguous byte tensors — K codes and V codes `[layer, block,
//! kv_head, pos, packed]`, K norms and V norms `[layer, block, kv_head, pos]` (f16 little-endian). A layer's key and value
//! codec fixes its row widths, so layer `l` starts at the sum of the earlier layers' slabs and the
//! tensor is exactly 5D whenever all layers share a codec. `tensor[layer]` is a free slice;
//! moving blocks `ids` of every layer is one copy per (stream, layer, run of consecutive slots).
//!
//! Invariant: a device tier uses this same layout, so the bytes of a block are identical in every
//! tier and a spill or warm is a copy, never a re-encode.

use crate::error::{KvError, KvResult};
use crate::shape::KvShape;
use crate::store::buf::HostBuf;

/// Per-layer row widths of the four streams: the part of the layout every tier shares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) shape: KvShape,
    /// Bytes of one head row per layer, for each plane in [`crate::BlockStream::ALL`] order:
    /// K codes, V codes (packed codes of the layer's key and value codec), K norms, V norms.
    pub(crate) rows: [Vec<usize>; 4],
}

impl Layout {
    pub(crate) fn rows_per_block(&self) -> usize {
        self.shape.block_size * self.shape.kv_heads
    }

    /// Bytes of one block in every layer and all four streams.
    pub(crate) fn block_bytes(&self) -> usize {
        let per_row: usize = self.rows.iter().flatten().sum();
        per_row * self.rows_per_block()
    }

    /// The strides of each plane in a tier of `capacity` blocks.
    pub(crate) fn strides(&self, capacity: u32) -> KvResult<[Strides; 4]> {
        let rows = self.rows_per_block();
        let plane = |p: usize| Strides::new(&self.rows[p], rows, capacity as usize);
        Ok([plane(0)?, plane(1)?, plane(2)?, plane(3)?])
    }
}

/// One layer's bytes, as attention reads them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerBytes<'a> {
    pub(crate) k_codes: &'a [u8],
    pub(crate) v_codes: &'a [u8],
    pub(crate) k_norms: &'a [u8],
    pub(crate) v_norms: &'a [u8],
    pub(crate) k_code_row: usize,
    pub(crate) v_code_row: usize,
    pub(crate) k_norm_row: usize,
    pub(crate) v_norm_row: usize,
}

/// Offsets of one plane in the layer-major layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Strides {
    /// Bytes of one block in layer `l`.
    pub(crate) block: Vec<usize>,
    /// Start of layer `l`; one extra entry holds the total.
    pub(crate) layer: Vec<usize>,
}

impl Strides {
    pub(crate) fn new(row: &[usize], rows_per_block: usize, capacity: usize) -> KvResult<Self> {
        let block: Vec<usize> = row.iter().map(|r| r * rows_per_block).collect();
        let mut layer = Vec::with_capacity(block.len() + 1);
        let mut total = 0usize;
        layer.push(0);
        for b in &block {
            total = b
                .checked_mul(capacity)
                .and_then(|x| x.checked_add(total))
                .ok_or(KvError::InvalidConfig {
                    field: "blocks",
                    value: capacity as f64,
                    reason: "the tier's byte size overflows",
                })?;
            layer.push(total);
        }
        Ok(Self { block, layer })
    }

    pub(crate) fn total(&self) -> usize {
        self.layer.last().copied().unwrap_or(0)
    }

    pub(crate) fn range(&self, layer: usize, slot: u32, blocks: usize) -> std::ops::Range<usize> {
        let start = self.layer[layer] + slot as usize * self.block[layer];
        start..start + blocks * self.block[layer]
    }
}

/// Blocks in host memory (see the module docs for the layout).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTier {
    layout: Layout,
    capacity: u32,
    /// K codes, V codes, K norms, V norms.
    strides: [Strides; 4],
    k_codes: HostBuf,
    v_codes: HostBuf,
    k_norms: HostBuf,
    v_norms: HostBuf,
}

impl HostTier {
    pub(crate) fn new(layout: Layout, capacity: u32) -> KvResult<Self> {
        // Zeroed allocations map lazily: an unused tier costs address space, not memory.
        Self::with_alloc(layout, capacity, |n| Ok(HostBuf::heap(n)))
    }

    /// A tier whose four tensors come from `alloc` (zeroed buffers of the given byte length):
    /// process memory, or page-locked memory a device copies to and from.
    pub(crate) fn with_alloc(
        layout: Layout,
        capacity: u32,
        mut alloc: impl FnMut(usize) -> KvResult<HostBuf>,
    ) -> KvResult<Self> {
        let strides = layout.strides(capacity)?;
        Ok(Self {
            k_codes: alloc(strides[0].total())?,
            v_codes: alloc(strides[1].total())?,
            k_norms: alloc(strides[2].total())?,
            v_norms: alloc(strides[3].total())?,
            layout,
            capacity,
            strides,
        })
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Blocks the tier holds.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Bytes of all four tensors.
    pub fn bytes(&self) -> usize {
        self.strides.iter().map(Strides::total).sum()
    }

    /// The K codes tensor, `[layer, block, kv_head, pos, packed]`.
    pub fn k_codes(&self) -> &[u8] {
        &self.k_codes
    }

    /// The V codes tensor, `[layer, block, kv_head, pos, packed]`.
    pub fn v_codes(&self) -> &[u8] {
        &self.v_codes
    }

    /// The K norms tensor, `[layer, block, kv_head, pos]`.
    pub fn k_norms(&self) -> &[u8] {
        &self.k_norms
    }

    /// The V norms tensor, `[layer, block, kv_head, pos]`.
    pub fn v_norms(&self) -> &[u8] {
        &self.v_norms
    }

    /// All bytes of one block in every layer, concatenated stream by stream (K codes, V codes,
    /// K norms, V norms; layers in order within each): what the shadow checksums.
    pub fn block_bytes(&self, slot: u32) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.layout.block_bytes());
        for (data, strides) in self.planes() {
            for layer in 0..self.layout.shape.layers {
                out.extend_from_slice(&data[strides.range(layer, slot, 1)]);
            }
        }
        out
    }

    /// Overwrites one block's bytes in every layer and stream with `bytes`, laid out as
    /// [`Self::block_bytes`] returns them (the inverse of it); the caller has checked the length.
    pub(crate) fn set_block_bytes(&mut self, slot: u32, bytes: &[u8]) {
        let layers = self.layout.shape.layers;
        let mut at = 0;
        for (data, strides) in self.planes_mut() {
            for layer in 0..layers {
                let range = strides.range(layer, slot, 1);
                let n = range.len();
                data[range].copy_from_slice(&bytes[at..at + n]);
                at += n;
            }
        }
    }

    /// Whether the tensors are page-locked (a device copies them without staging).
    pub fn is_pinned(&self) -> bool {
        self.k_codes.is_pinned()
    }

    /// The four tensors (K codes, V codes, K norms, V norms) with the strides of each.
    pub(crate) fn planes(&self) -> [(&HostBuf, &Strides); 4] {
        let [kc, vc, kn, vn] = &self.strides;
        [
            (&self.k_codes, kc),
            (&self.v_codes, vc),
            (&self.k_norms, kn),
            (&self.v_norms, vn),
        ]
    }

    /// The four tensors, mutable, with the strides of each.
    pub(crate) fn planes_mut(&mut self) -> [(&mut HostBuf, &Strides); 4] {
        let [kc, vc, kn, vn] = &self.strides;
        [
            (&mut self.k_codes, kc),
            (&mut self.v_codes, vc),
            (&mut self.k_norms, kn),
            (&mut self.v_norms, vn),
        ]
    }

    pub(crate) fn layer(&self, layer: usize) -> LayerBytes<'_> {
        let span = |p: usize| self.strides[p].layer[layer]..self.strides[p].layer[layer + 1];
        let row = |p: usize| self.layout.rows[p][layer];
        LayerBytes {
            k_codes: &self.k_codes[span(0)],
            v_codes: &self.v_codes[span(1)],
            k_norms: &self.k_norms[span(2)],
            v_norms: &self.v_norms[span(3)],
            k_code_row: row(0),
            v_code_row: row(1),
            k_norm_row: row(2),
            v_norm_row: row(3),
        }
    }

    /// Slices of one row (layer, slot, row in the block as [`KvShape::row_in_block`] numbers
    /// them): K code, V code, K norm, V norm.
    pub(crate) fn row(&self, layer: usize, slot: u32, row: usize) -> [&[u8]; 4] {
        let at = |p: usize| {
            let width = self.layout.rows[p][layer];
            let start = self.strides[p].range(layer, slot, 1).start + row * width;
            start..start + width
        };
        [
            &self.k_codes[at(0)],
            &self.v_codes[at(1)],
            &self.k_norms[at(2)],
            &self.v_norms[at(3)],
        ]
    }

    /// Mutable slices of one row (layer, slot, row in the block as [`KvShape::row_in_block`]
    /// numbers them): K code, V code, K norm, V norm.
    pub(crate) fn row_mut(
        &mut self,
        layer: usize,
        slot: u32,
        row: usize,
    ) -> (&mut [u8], &mut [u8], &mut [u8], &mut [u8]) {
        let at = |p: usize| {
            let width = self.layout.rows[p][layer];
            let start = self.strides[p].range(layer, slot, 1).start + row * width;
            start..start + width
        };
        let (kc, vc, kn, vn) = (at(0), at(1), at(2), at(3));
        (
            &mut self.k_codes[kc],
            &mut self.v_codes[vc],
            &mut self.k_norms[kn],
            &mut self.v_norms[vn],
        )
    }

    /// Copies blocks `src slot → dst slot` of every layer and stream from `src` into `self`.
    /// Consecutive slot pairs are merged into one copy per (stream, layer, run).
    pub(crate) fn copy_from(&mut self, src: &HostTier, pairs: &[(u32, u32)]) {
        let runs = runs(pairs);
        let layers = self.layout.shape.layers;
        for ((dst, to), (from, from_strides)) in self.planes_mut().into_iter().zip(src.planes()) {
            for layer in 0..layers {
                for &(s, d, n) in &runs {
                    dst[to.range(layer, d, n)]
                        .copy_from_slice(&from[from_strides.range(layer, s, n)]);
                }
            }
        }
    }
}

/// Maximal runs `(src, dst, len)` where both slots advance by one.
pub(crate) fn runs(pairs: &[(u32, u32)]) -> Vec<(u32, u32, usize)> {
    let mut out: Vec<(u32, u32, usize)> = Vec::new();
    for &(s, d) in pairs {
        match out.last_mut() {
            Some((rs, rd, n))
                if *rs as usize + *n == s as usize && *rd as usize + *n == d as usize =>
            {
                *n += 1
            }
            _ => out.push((s, d, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn consecutive_pairs_merge_into_runs() {
        assert_eq!(
            runs(&[(0, 5), (1, 6), (2, 7), (4, 8), (5, 9), (9, 1)]),
            vec![(0, 5, 3), (4, 8, 2), (9, 1, 1)]
        );
        assert!(runs(&[]).is_empty());
    }
}
