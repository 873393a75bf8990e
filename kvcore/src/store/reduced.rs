//! Down-tiering: a second cold pool whose slots hold blocks re-encoded to narrower codecs.
//!
//! The cold tier is fixed-size slots of one layout, so a block re-encoded in place would save
//! nothing. The reduced pool is a [`HostTier`] of its own layout (a [`LayerCodecs`] no wider
//! than the store's in any layer and stream, chosen by the caller — the engine takes it from a
//! calibrated profile under a looser KL budget). [`crate::BlockStore::reduce`] moves cold blocks
//! into it (decode with the layer's codec, encode with the reduced one) instead of dropping them,
//! freeing their cold slots; warming a reduced block re-encodes it back to the layer's codec
//! on its way to the hot tier. Streams whose reduced codec is the layer's own are copied byte
//! for byte, so they round once, not twice.
//!
//! A re-encode writes into a scratch tier first and commits with a copy, so a row that the
//! target codec cannot encode leaves the store unchanged.

use crate::codec::Codec;
use crate::error::{KvError, KvResult};
use crate::shape::LayerCodecs;
use crate::store::SlotPool;
use crate::store::host::{HostTier, Layout};

/// The reduced pool (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ReducedPool {
    pub(crate) kinds: LayerCodecs,
    pub(crate) k_codecs: Vec<Codec>,
    pub(crate) v_codecs: Vec<Codec>,
    pub(crate) tier: HostTier,
    pub(crate) free: SlotPool,
}

impl ReducedPool {
    pub(crate) fn new(
        kinds: LayerCodecs,
        k_codecs: Vec<Codec>,
        v_codecs: Vec<Codec>,
        layout: Layout,
        capacity: u32,
    ) -> KvResult<Self> {
        Ok(Self {
            kinds,
            k_codecs,
            v_codecs,
            tier: HostTier::new(layout, capacity)?,
            free: SlotPool::new(capacity),
        })
    }
}

/// The key and value codecs per layer of one side of a re-encode.
pub(crate) struct Side<'a> {
    pub(crate) k: &'a [Codec],
    pub(crate) v: &'a [Codec],
}

/// Re-encodes block `from_slot` of `src` (codecs `from`) into block `to_slot` of `dst` (codecs
/// `to`), every layer and stream. Errors with [`KvError::NotEncodable`] when a decoded row does
/// not fit the target codec; `dst` may then hold part of the block (callers write to scratch).
pub(crate) fn recode_block(
    src: &HostTier,
    from: &Side<'_>,
    from_slot: u32,
    dst: &mut HostTier,
    to: &Side<'_>,
    to_slot: u32,
) -> KvResult<()> {
    let layers = from.k.len();
    let rows = src.layout().rows_per_block();
    let d = src.layout().shape.head_dim;
    let (mut row, mut scratch, mut idx) = (vec![0.0f32; d], vec![0.0f32; d], vec![0u8; d]);
    for layer in 0..layers {
        let pairs = [
            (&from.k[layer], &to.k[layer]),
            (&from.v[layer], &to.v[layer]),
        ];
        for r in 0..rows {
            let [kc, vc, kn, vn] = src.row(layer, from_slot, r);
            let (dkc, dvc, dkn, dvn) = dst.row_mut(layer, to_slot, r);
            for ((code, norm, out_code, out_norm), (a, b)) in
                [(kc, kn, dkc, dkn), (vc, vn, dvc, dvn)]
                    .into_iter()
                    .zip(pairs)
            {
                if a.kind() == b.kind() {
                    out_code.copy_from_slice(code);
                    out_norm.copy_from_slice(norm);
                    continue;
                }
                a.decode_rows(code, norm, &mut row, &mut scratch);
                b.check_encodable(&row)?;
                b.encode_row(&row, out_code, out_norm, &mut scratch, &mut idx);
            }
        }
    }
    Ok(())
}

/// Checks that `reduced` is no wider than `full` in any layer and stream.
pub(crate) fn check_narrower(
    full: &LayerCodecs,
    reduced: &LayerCodecs,
    head_dim: usize,
) -> KvResult<()> {
    if reduced.layers() != full.layers() {
        return Err(KvError::CodecCount {
            expected: full.layers(),
            got: reduced.layers(),
        });
    }
    let width = |c: crate::codec::CodecKind| c.code_bytes(head_dim) + c.norm_bytes();
    let streams = full
        .keys()
        .iter()
        .zip(reduced.keys())
        .chain(full.values().iter().zip(reduced.values()));
    for (&f, &r) in streams {
        if width(r) > width(f) {
            return Err(KvError::InvalidConfig {
                field: "reduced_codecs",
                value: width(r) as f64,
                reason: "a reduced codec must not be wider than the layer's own",
            });
        }
    }
    Ok(())
}
