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

use crate::block::{BlockId, Tier};
use crate::codec::Codec;
use crate::error::{KvError, KvResult};
use crate::metadata::Precision;
use crate::shape::LayerCodecs;
use crate::store::host::{HostTier, Layout};
use crate::store::{BlockStore, SlotPool, build_codecs, layout_of};

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

/// Down-tiering's part of the store (see the module docs).
impl BlockStore {
    /// Adds a reduced cold pool of `blocks` slots whose blocks are stored in `codecs`
    /// (down-tiering, see [`Self::reduce`]); every reduced codec must be no wider than the
    /// layer's own.
    pub fn with_reduced_pool(mut self, codecs: LayerCodecs, blocks: u32) -> KvResult<Self> {
        if self.reduced.is_some() {
            return Err(KvError::InvalidConfig {
                field: "reduced_codecs",
                value: self.reduced_capacity() as f64,
                reason: "the store has a reduced pool already",
            });
        }
        let d = self.layout.shape.head_dim;
        check_narrower(&self.kinds, &codecs, d)?;
        let mut built: Vec<Codec> = self
            .k_codecs
            .iter()
            .chain(&self.v_codecs)
            .cloned()
            .collect();
        let (k, v) = build_codecs(&codecs, d, self.rotation_seed, &mut built)?;
        let layout = layout_of(self.layout.shape, &k, &v);
        self.reduced = Some(ReducedPool::new(codecs, k, v, layout, blocks)?);
        Ok(self)
    }

    /// The reduced pool's codecs, when down-tiering is on.
    pub fn reduced_codecs(&self) -> Option<&LayerCodecs> {
        self.reduced.as_ref().map(|p| &p.kinds)
    }

    /// Slots of the reduced pool (0 without one).
    pub fn reduced_capacity(&self) -> usize {
        self.reduced
            .as_ref()
            .map_or(0, |p| p.tier.capacity() as usize)
    }

    /// Free slots of the reduced pool (0 without one).
    pub fn free_reduced(&self) -> usize {
        self.reduced.as_ref().map_or(0, |p| p.free.available())
    }

    /// Bytes of one block in the reduced pool's codecs, when down-tiering is on.
    pub fn reduced_block_bytes(&self) -> Option<usize> {
        self.reduced.as_ref().map(|p| p.tier.layout().block_bytes())
    }

    /// Down-tiers cold blocks: re-encodes each into the reduced pool's codecs and frees its cold
    /// slot; the block stays `Cold`, marked [`Precision::Reduced`]. Every id must be cold and not
    /// reduced already, and the pool must have room; nothing changes on error.
    pub fn reduce(&mut self, ids: &[BlockId]) -> KvResult<()> {
        let slots = self.slots_in(ids, Tier::Cold)?;
        if let Some(&id) = ids
            .iter()
            .find(|&&id| self.precision_of(id) == Precision::Reduced)
        {
            return Err(KvError::Reduced { id });
        }
        let Some(pool) = self.reduced.as_mut() else {
            return Err(KvError::NoReducedPool);
        };
        if ids.is_empty() {
            return Ok(());
        }
        if pool.free.available() < ids.len() {
            return Err(KvError::TierExhausted {
                tier: Tier::Cold,
                requested: ids.len(),
                available: pool.free.available(),
            });
        }
        let mut scratch = HostTier::new(pool.tier.layout().clone(), ids.len() as u32)?;
        let from = Side {
            k: &self.k_codecs,
            v: &self.v_codecs,
        };
        let to = Side {
            k: &pool.k_codecs,
            v: &pool.v_codecs,
        };
        for (i, &slot) in (0u32..).zip(&slots) {
            recode_block(&self.cold, &from, slot, &mut scratch, &to, i)?;
        }
        let dest = pool.free.take(ids.len());
        let pairs: Vec<(u32, u32)> = (0..).zip(dest.iter().copied()).collect();
        pool.tier.copy_from(&scratch, &pairs);
        for ((&id, &old), &new) in ids.iter().zip(&slots).zip(&dest) {
            self.cold_free.give(old);
            if let Some(meta) = self.meta.get_mut(id) {
                meta.precision = Precision::Reduced;
                meta.slot = new;
            }
            self.meta.note_move(id);
        }
        Ok(())
    }

    /// The bytes of down-tiered blocks re-encoded to the layer's codecs, block `i` of `ids` in
    /// slot `i` of a scratch tier the hot tier can copy from.
    pub(crate) fn expand_reduced(&self, ids: &[BlockId]) -> KvResult<HostTier> {
        let pool = self.reduced.as_ref().ok_or(KvError::NoReducedPool)?;
        let mut scratch = self.hot.cold_tier(self.layout.clone(), ids.len() as u32)?;
        let from = Side {
            k: &pool.k_codecs,
            v: &pool.v_codecs,
        };
        let to = Side {
            k: &self.k_codecs,
            v: &self.v_codecs,
        };
        for (i, &id) in (0u32..).zip(ids) {
            let slot = self.lookup(id)?.slot;
            recode_block(&pool.tier, &from, slot, &mut scratch, &to, i)?;
        }
        Ok(scratch)
    }

    pub(crate) fn precision_of(&self, id: BlockId) -> Precision {
        self.meta.get(id).map_or(Precision::Full, |m| m.precision)
    }

    /// Errors with [`KvError::Reduced`] if one of `ids` is down-tiered: its bytes are not in a
    /// slot of its own.
    pub(crate) fn check_not_reduced(&self, ids: &[BlockId]) -> KvResult<()> {
        for &id in ids {
            match self.precision_of(id) {
                Precision::Reduced => return Err(KvError::Reduced { id }),
                Precision::Full | Precision::Restored => {}
            }
        }
        Ok(())
    }

    /// Frees the slot of a block in `tier` with `precision` (a reduced block's is the pool's).
    pub(crate) fn free_slot_of(&mut self, tier: Tier, precision: Precision, slot: u32) {
        match (tier, precision, self.reduced.as_mut()) {
            (Tier::Cold, Precision::Reduced, Some(pool)) => pool.free.give(slot),
            _ => self.free_slot(tier, slot),
        }
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
