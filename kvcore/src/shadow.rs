//! The shadow's segment files: blocks as safetensors, in the same layout as every tier.
//!
//! A segment holds `n` blocks of one store. Each (stream, layer) becomes one `u8` tensor named
//! `{stream}.{layer}` (e.g. `k_codes.0`) of shape `[n, kv_head, pos, bytes]`: block `i` of the
//! tensor is the part of block `i`'s bytes that [`BlockStore::block_parts`] places there, so a
//! segment is the tiers' `[layer, block, kv_head, pos, packed]` layout cut into one tensor per
//! layer (layers may use different codecs, hence different row widths). Free-form string
//! metadata (the manifest of an exported session) rides in the safetensors header.
//!
//! Decoding checks every tensor's presence, dtype and shape against the store's parts; the
//! caller checks each block's bytes against the checksum its manifest recorded ([`checksum`]),
//! so a flipped byte anywhere is detected before a block is trusted.
//!
//! [`BlockStore::block_parts`]: crate::BlockStore::block_parts

use std::collections::HashMap;

use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo, TensorView};

use crate::error::{KvError, KvResult};
use crate::store::BlockPart;

/// CRC-32C of a block's bytes (hardware-accelerated where the CPU has it).
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

fn tensor_name(part: &BlockPart) -> String {
    format!("{}.{}", part.stream.name(), part.layer)
}

/// Encodes `blocks` (each laid out as `parts` describe) as one safetensors buffer, with
/// `metadata` in its header.
pub fn encode_segment(
    parts: &[BlockPart],
    blocks: &[&[u8]],
    metadata: Option<HashMap<String, String>>,
) -> KvResult<Vec<u8>> {
    let block_len: usize = parts.iter().map(BlockPart::len).sum();
    if let Some(b) = blocks.iter().find(|b| b.len() != block_len) {
        return Err(KvError::BlockBytesLength {
            expected: block_len,
            got: b.len(),
        });
    }
    let gathered: Vec<(String, Vec<usize>, Vec<u8>)> = parts
        .iter()
        .map(|p| {
            let mut data = Vec::with_capacity(p.len() * blocks.len());
            for b in blocks {
                data.extend_from_slice(&b[p.offset..p.offset + p.len()]);
            }
            let shape = vec![blocks.len(), p.shape[0], p.shape[1], p.shape[2]];
            (tensor_name(p), shape, data)
        })
        .collect();
    let views = gathered
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::U8, shape.clone(), data)
                .map(|v| (name.as_str(), v))
                .map_err(|e| segment_error("tensor", e))
        })
        .collect::<KvResult<Vec<_>>>()?;
    safetensors::tensor::serialize(views, metadata).map_err(|e| segment_error("serialize", e))
}

/// A decoded segment: each block's bytes, and the header's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// One entry per block, laid out as the store's parts describe.
    pub blocks: Vec<Vec<u8>>,
    /// The header's string metadata.
    pub metadata: HashMap<String, String>,
}

/// Decodes a segment written by [`encode_segment`] for a store with the same `parts`.
pub fn decode_segment(parts: &[BlockPart], bytes: &[u8]) -> KvResult<Segment> {
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| segment_error("header", e))?;
    let st = SafeTensors::deserialize(bytes).map_err(|e| segment_error("header", e))?;
    if st.len() != parts.len() {
        return Err(KvError::Segment {
            reason: "tensor count differs from the store's layout",
            detail: format!("{} tensors, {} expected", st.len(), parts.len()),
        });
    }
    let mut n = None;
    let mut views = Vec::with_capacity(parts.len());
    for p in parts {
        let name = tensor_name(p);
        let view = st
            .tensor(&name)
            .map_err(|e| segment_error("missing tensor", e))?;
        let shape = view.shape();
        let blocks = shape.first().copied().unwrap_or(0);
        if view.dtype() != Dtype::U8
            || shape.len() != 4
            || shape[1..] != p.shape[..]
            || n.is_some_and(|n| n != blocks)
        {
            return Err(KvError::Segment {
                reason: "tensor shape differs from the store's layout",
                detail: format!("{name}: {:?} {shape:?}", view.dtype()),
            });
        }
        n = Some(blocks);
        views.push(view);
    }
    let n = n.unwrap_or(0);
    let block_len: usize = parts.iter().map(BlockPart::len).sum();
    let mut blocks = vec![Vec::with_capacity(block_len); n];
    for (p, view) in parts.iter().zip(&views) {
        let len = p.len();
        for (i, chunk) in view.data().chunks_exact(len).enumerate() {
            if let Some(b) = blocks.get_mut(i) {
                b.extend_from_slice(chunk);
            }
        }
    }
    Ok(Segment {
        blocks,
        metadata: header.metadata().clone().unwrap_or_default(),
    })
}

/// The largest header a segment may have (safetensors' own bound).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The header of a segment of `n` blocks laid out as `parts`, with `metadata`: its first bytes
/// (the length, then the JSON header padded to 8 bytes), for a writer that streams the data
/// after it instead of building the file in memory. The data follows in `parts` order: for
/// each part, that part of block 0, of block 1, …, of block `n − 1` ([`segment_data_len`]
/// bytes in all). The result decodes with [`decode_segment`] exactly as [`encode_segment`]'s
/// output of the same blocks does.
pub fn segment_header(
    parts: &[BlockPart],
    n: usize,
    metadata: Option<HashMap<String, String>>,
) -> KvResult<Vec<u8>> {
    let mut start = 0usize;
    let mut tensors = Vec::with_capacity(parts.len());
    for p in parts {
        let len = p
            .len()
            .checked_mul(n)
            .ok_or_else(|| segment_error("size", "overflow"))?;
        tensors.push((
            tensor_name(p),
            TensorInfo {
                dtype: Dtype::U8,
                shape: vec![n, p.shape[0], p.shape[1], p.shape[2]],
                data_offsets: (start, start + len),
            },
        ));
        start += len;
    }
    let meta = Metadata::new(metadata, tensors).map_err(|e| segment_error("header", e))?;
    let mut json = serde_json::to_vec(&meta).map_err(|e| segment_error("header", e))?;
    // Padded with spaces to a multiple of 8, as safetensors writes it.
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Bytes of the data of a segment of `n` blocks laid out as `parts` (after its header).
pub fn segment_data_len(parts: &[BlockPart], n: usize) -> u64 {
    parts.iter().map(|p| (p.len() * n) as u64).sum()
}

/// A segment file read one block at a time: its header is checked against `parts` as
/// [`decode_segment`] checks it, and each block's bytes are gathered from its tensors when
/// asked for, so a file of any size is read in the memory of one block.
#[derive(Debug)]
pub struct SegmentReader<R> {
    reader: R,
    /// Where each part's tensor starts in the file, and that part's bytes per block.
    tensors: Vec<(u64, usize)>,
    blocks: usize,
    metadata: HashMap<String, String>,
}

impl<R: std::io::Read + std::io::Seek> SegmentReader<R> {
    /// Reads and checks the header of the segment in `reader` (of `file_len` bytes).
    pub fn open(parts: &[BlockPart], mut reader: R, file_len: u64) -> KvResult<Self> {
        let io = |e: std::io::Error| segment_error("read", e);
        let mut n = [0u8; 8];
        reader.read_exact(&mut n).map_err(io)?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER_BYTES || n.saturating_add(8) > file_len {
            return Err(segment_error("header", format!("{n} header bytes")));
        }
        let mut json = vec![0u8; n as usize];
        reader.read_exact(&mut json).map_err(io)?;
        let meta: Metadata =
            serde_json::from_slice(&json).map_err(|e| segment_error("header", e))?;
        if 8 + n + meta.data_len() as u64 != file_len {
            return Err(segment_error(
                "header",
                "the data's length differs from the file's",
            ));
        }
        if meta.tensors().len() != parts.len() {
            return Err(KvError::Segment {
                reason: "tensor count differs from the store's layout",
                detail: format!("{} tensors, {} expected", meta.tensors().len(), parts.len()),
            });
        }
        let mut blocks = None;
        let mut tensors = Vec::with_capacity(parts.len());
        for p in parts {
            let name = tensor_name(p);
            let info = meta
                .info(&name)
                .ok_or_else(|| segment_error("missing tensor", &name))?;
            let shape = &info.shape;
            let count = shape.first().copied().unwrap_or(0);
            if info.dtype != Dtype::U8
                || shape.len() != 4
                || shape[1..] != p.shape[..]
                || blocks.is_some_and(|b| b != count)
            {
                return Err(KvError::Segment {
                    reason: "tensor shape differs from the store's layout",
                    detail: format!("{name}: {:?} {shape:?}", info.dtype),
                });
            }
            blocks = Some(count);
            tensors.push((8 + n + info.data_offsets.0 as u64, p.len()));
        }
        Ok(Self {
            reader,
            tensors,
            blocks: blocks.unwrap_or(0),
            metadata: meta.metadata().clone().unwrap_or_default(),
        })
    }

    /// Blocks in the segment.
    pub fn len(&self) -> usize {
        self.blocks
    }

    /// True when it holds no block.
    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    /// The header's string metadata.
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// Block `i`'s bytes, laid out as the store's parts describe.
    pub fn block(&mut self, i: usize) -> KvResult<Vec<u8>> {
        if i >= self.blocks {
            return Err(segment_error("block", format!("{i} of {}", self.blocks)));
        }
        let io = |e: std::io::Error| segment_error("read", e);
        let mut out = vec![0u8; self.tensors.iter().map(|t| t.1).sum()];
        let mut at = 0;
        for &(start, len) in &self.tensors {
            self.reader
                .seek(std::io::SeekFrom::Start(start + (i * len) as u64))
                .map_err(io)?;
            self.reader.read_exact(&mut out[at..at + len]).map_err(io)?;
            at += len;
        }
        Ok(out)
    }
}

fn segment_error(reason: &'static str, e: impl std::fmt::Display) -> KvError {
    KvError::Segment {
        reason,
        detail: e.to_string(),
    }
}
