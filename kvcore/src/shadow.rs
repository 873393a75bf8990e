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

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

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

fn segment_error(reason: &'static str, e: impl std::fmt::Display) -> KvError {
    KvError::Segment {
        reason,
        detail: e.to_string(),
    }
}
