//! The BlockStore: blocks of packed K/V codes in a hot and a cold tier, with the metadata that
//! says what each block means.
//!
//! A block is `block_size` token positions of every layer. Its id is stable for its whole life;
//! its bytes live in one slot of one tier (or in none: [`Tier::Recompute`], when the bytes were
//! dropped and must be prefilled again from the token log). Free slots are kept on a free list
//! per tier; ids are never reused.
//!
//! Invariants:
//! - every operation validates all of its input first and mutates only when the whole call can
//!   succeed: an error leaves the store exactly as it was (tests compare whole stores);
//! - a block in `Hot` or `Cold` owns exactly one slot of that tier, and a staged hot block also
//!   one cold slot holding a copy of its bytes (`staged.rs`); free list ∪ owned slots is every
//!   slot, disjointly;
//! - a block lives while its reference count is ≥ 1; the release that drops it to 0 frees it.
//!
//! Costs: allocate/release/retain O(n) in the ids given; spill/warm O(n·layers) copies, merged
//! into one per run of consecutive slots; metadata lookups O(log blocks).

mod attended;
mod buf;
mod copy;
pub(crate) mod host;
pub(crate) mod hot;
mod moves;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
mod pinned;
mod reduced;
mod staged;
mod walk;

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::block::{BlockId, BlockTags, Tier};
use crate::codec::{Codec, DEFAULT_ROTATION_SEED, Rows};
use crate::error::{KvError, KvResult};
use crate::metadata::{BlockMeta, BlockMetadataTable, Precision, PriorityTable};
use crate::shape::{KvShape, LayerCodecs};
use host::{HostTier, Layout};
#[cfg(feature = "cuda")]
use hot::CudaTier;
use hot::{HotStorage, HotTier, HotTierKind};
use reduced::ReducedPool;
pub use staged::StageStats;

/// One of the four byte streams of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockStream {
    /// Packed K codes.
    KCodes,
    /// Packed V codes.
    VCodes,
    /// K norms.
    KNorms,
    /// V norms.
    VNorms,
}

impl BlockStream {
    /// The streams in the order a block's bytes concatenate them.
    pub const ALL: [Self; 4] = [Self::KCodes, Self::VCodes, Self::KNorms, Self::VNorms];

    /// `k_codes`, `v_codes`, `k_norms` or `v_norms`.
    pub fn name(self) -> &'static str {
        match self {
            Self::KCodes => "k_codes",
            Self::VCodes => "v_codes",
            Self::KNorms => "k_norms",
            Self::VNorms => "v_norms",
        }
    }

    /// Whether the stream holds codes (row directions, for TurboQuant) rather than norms.
    pub fn is_code(self) -> bool {
        matches!(self, Self::KCodes | Self::VCodes)
    }
}

/// Where one (stream, layer) lies in a block's bytes (see [`BlockStore::block_parts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockPart {
    /// The stream.
    pub stream: BlockStream,
    /// The layer.
    pub layer: usize,
    /// Byte offset in the block's bytes.
    pub offset: usize,
    /// `[kv_head, pos, bytes per head row]` ([`crate::LAYOUT`]).
    pub shape: [usize; 3],
}

impl BlockPart {
    /// Bytes of this part in one block.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// True when the part holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How to build a [`BlockStore`].
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    /// Cache geometry.
    pub shape: KvShape,
    /// One codec per layer and stream.
    pub codecs: LayerCodecs,
    /// Hot-tier backend.
    pub hot_kind: HotTierKind,
    /// Hot-tier capacity in blocks.
    pub hot_blocks: u32,
    /// Cold-tier capacity in blocks.
    pub cold_blocks: u32,
    /// Seed of the TurboQuant rotation (part of the storage format).
    pub rotation_seed: u64,
    /// Source layer → eviction priority.
    pub priorities: PriorityTable,
}

impl StoreConfig {
    /// A host-memory store with the same codec in every layer and stream, and default seed and
    /// priorities.
    pub fn new(shape: KvShape, codec: crate::codec::CodecKind, hot: u32, cold: u32) -> Self {
        Self {
            codecs: LayerCodecs::uniform(&shape, codec),
            shape,
            hot_kind: HotTierKind::Host,
            hot_blocks: hot,
            cold_blocks: cold,
            rotation_seed: DEFAULT_ROTATION_SEED,
            priorities: PriorityTable::default(),
        }
    }
}

/// A free list of slots. Slots are handed out lowest first from a fresh pool, and a batch comes
/// back sorted so that consecutive slots merge into single copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlotPool {
    free: Vec<u32>,
}

impl SlotPool {
    fn new(capacity: u32) -> Self {
        Self {
            free: (0..capacity).rev().collect(),
        }
    }

    fn available(&self) -> usize {
        self.free.len()
    }

    /// Takes `n` slots; the caller has checked `n <= available()`.
    fn take(&mut self, n: usize) -> Vec<u32> {
        let mut slots = self.free.split_off(self.free.len() - n);
        slots.sort_unstable();
        slots
    }

    fn give(&mut self, slot: u32) {
        self.free.push(slot);
    }
}

/// Blocks, their tiers and their meaning (see the module docs).
#[derive(Debug, PartialEq)]
pub struct BlockStore {
    layout: Layout,
    /// The built key codec of each layer.
    k_codecs: Vec<Codec>,
    /// The built value codec of each layer.
    v_codecs: Vec<Codec>,
    kinds: LayerCodecs,
    rotation_seed: u64,
    hot: HotTier,
    cold: HostTier,
    hot_free: SlotPool,
    cold_free: SlotPool,
    /// Down-tiering's pool of narrower cold slots, when on.
    reduced: Option<ReducedPool>,
    /// Hot blocks with a copy in the cold tier, ahead of their spill (`staged.rs`).
    staged: staged::Staged,
    meta: BlockMetadataTable,
    next_id: u64,
}

/// Builds the key and value codecs of `kinds`; each kind is solved once and shared through
/// `built`.
fn build_codecs(
    kinds: &LayerCodecs,
    head_dim: usize,
    seed: u64,
    built: &mut Vec<Codec>,
) -> KvResult<(Vec<Codec>, Vec<Codec>)> {
    let mut build = |kind| -> KvResult<Codec> {
        if let Some(c) = built.iter().find(|c| c.kind() == kind) {
            return Ok(c.clone());
        }
        let c = Codec::new(kind, head_dim, seed)?;
        built.push(c.clone());
        Ok(c)
    };
    let k = kinds
        .keys()
        .iter()
        .map(|&k| build(k))
        .collect::<KvResult<Vec<_>>>()?;
    // Attention sums values in the rotated space; a value's stored-apart coordinates would need
    // a second accumulator in every kernel, so the split is a key codec.
    if let Some(split) = kinds.values().iter().find(|v| v.outliers() > 0) {
        return Err(KvError::InvalidConfig {
            field: "value_codec",
            value: split.outliers() as f64,
            reason: "an outlier split (tqBoN) is a key codec; values take another",
        });
    }
    let v = kinds
        .values()
        .iter()
        .map(|&k| build(k))
        .collect::<KvResult<Vec<_>>>()?;
    Ok((k, v))
}

/// The row widths of codecs `k` and `v` per layer.
fn layout_of(shape: KvShape, k: &[Codec], v: &[Codec]) -> Layout {
    Layout {
        shape,
        rows: [
            k.iter().map(Codec::code_bytes).collect(),
            v.iter().map(Codec::code_bytes).collect(),
            k.iter().map(Codec::norm_bytes).collect(),
            v.iter().map(Codec::norm_bytes).collect(),
        ],
    }
}

impl BlockStore {
    /// Builds the store: validates the shape, builds one codec per layer (codecs of the same kind
    /// are solved once and shared), and allocates both tiers.
    pub fn new(config: StoreConfig) -> KvResult<Self> {
        Self::build(config, HotTier::new)
    }

    /// A store whose hot tier lives on the device of `stream`, with compute (the kernels that
    /// write and read blocks) on that stream; `config.hot_kind` is ignored. The cold tier is
    /// page-locked host memory.
    #[cfg(feature = "cuda")]
    pub fn on_cuda_stream(
        config: StoreConfig,
        stream: std::sync::Arc<cudarc::driver::CudaStream>,
    ) -> KvResult<Self> {
        Self::build(config, |_, layout, capacity| {
            Ok(HotTier::Cuda(CudaTier::on_stream(
                stream, layout, capacity,
            )?))
        })
    }

    /// On a device hot tier, turns cudarc's per-slice event tracking off for its context
    /// ([`CudaTier::untrack_events`]): the caller queues all its other device work on the
    /// stream the store was built on. Nothing on a host tier.
    #[cfg(feature = "cuda")]
    pub fn untrack_device_events(&self) {
        if let Some(t) = self.hot.cuda() {
            t.untrack_events();
        }
    }

    /// A copy of the store, its metadata and the bytes of both tiers.
    pub fn try_clone(&self) -> KvResult<Self> {
        Ok(Self {
            layout: self.layout.clone(),
            k_codecs: self.k_codecs.clone(),
            v_codecs: self.v_codecs.clone(),
            kinds: self.kinds.clone(),
            rotation_seed: self.rotation_seed,
            hot: self.hot.try_clone()?,
            cold: self.cold.clone(),
            hot_free: self.hot_free.clone(),
            cold_free: self.cold_free.clone(),
            reduced: self.reduced.clone(),
            staged: self.staged.clone(),
            meta: self.meta.clone(),
            next_id: self.next_id,
        })
    }

    fn build(
        config: StoreConfig,
        hot: impl FnOnce(HotTierKind, Layout, u32) -> KvResult<HotTier>,
    ) -> KvResult<Self> {
        let StoreConfig {
            shape,
            codecs: kinds,
            hot_kind,
            hot_blocks,
            cold_blocks,
            rotation_seed,
            priorities,
        } = config;
        shape.validate()?;
        if kinds.layers() != shape.layers {
            return Err(KvError::CodecCount {
                expected: shape.layers,
                got: kinds.layers(),
            });
        }
        let (k_codecs, v_codecs) =
            build_codecs(&kinds, shape.head_dim, rotation_seed, &mut Vec::new())?;
        let layout = layout_of(shape, &k_codecs, &v_codecs);
        let hot = hot(hot_kind, layout.clone(), hot_blocks)?;
        let cold = hot.cold_tier(layout.clone(), cold_blocks)?;
        Ok(Self {
            layout,
            k_codecs,
            v_codecs,
            kinds,
            rotation_seed,
            hot,
            cold,
            hot_free: SlotPool::new(hot_blocks),
            cold_free: SlotPool::new(cold_blocks),
            reduced: None,
            staged: staged::Staged::default(),
            meta: BlockMetadataTable::new(priorities),
            next_id: 0,
        })
    }

    /// The cache geometry.
    pub fn shape(&self) -> &KvShape {
        &self.layout.shape
    }

    /// The codec of each layer and stream, as configured.
    pub fn codec_kinds(&self) -> &LayerCodecs {
        &self.kinds
    }

    /// The built key codec of one layer.
    pub fn key_codec(&self, layer: usize) -> KvResult<&Codec> {
        self.k_codecs.get(layer).ok_or(KvError::UnknownLayer {
            layer,
            layers: self.layout.shape.layers,
        })
    }

    /// The built value codec of one layer.
    pub fn value_codec(&self, layer: usize) -> KvResult<&Codec> {
        self.v_codecs.get(layer).ok_or(KvError::UnknownLayer {
            layer,
            layers: self.layout.shape.layers,
        })
    }

    /// The rotation seed.
    pub fn rotation_seed(&self) -> u64 {
        self.rotation_seed
    }

    /// Bytes of one block across every layer and stream.
    pub fn block_bytes(&self) -> usize {
        self.layout.block_bytes()
    }

    /// The metadata of every live block.
    pub fn metadata(&self) -> &BlockMetadataTable {
        &self.meta
    }

    /// Sets the epoch stamped on the tier moves from now on (an engine passes its tier-bridge
    /// cycle, so a block's [`crate::BlockMeta::moved_epoch`] is the cycle of its last move).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.meta.set_epoch(epoch);
    }

    /// Counts a block's move within `window` epochs of its previous move as a quick one
    /// ([`BlockMetadataTable::quick_moves`]): a block flipping between tiers.
    pub fn set_move_window(&mut self, window: u64) {
        self.meta.set_move_window(window);
    }

    /// The metadata table, for changes the store does not own (priority table).
    pub fn metadata_mut(&mut self) -> &mut BlockMetadataTable {
        &mut self.meta
    }

    /// The hot tier.
    pub fn hot(&self) -> &HotTier {
        &self.hot
    }

    /// The hot tier, mutable (device kernels write blocks through it). A write through it must
    /// not target a staged block ([`Self::stage`]); [`Self::unstage`] drops a copy first.
    pub fn hot_mut(&mut self) -> &mut HotTier {
        &mut self.hot
    }

    /// The hot-tier slots of `ids` (block tables for device kernels); every id must be live,
    /// distinct and hot.
    pub fn hot_slots(&self, ids: &[BlockId]) -> KvResult<Vec<u32>> {
        self.slots_in(ids, Tier::Hot)
    }

    /// The cold tier.
    pub fn cold(&self) -> &HostTier {
        &self.cold
    }

    /// Capacity of a tier in blocks (0 for `Recompute`, which holds no bytes).
    pub fn capacity(&self, tier: Tier) -> usize {
        match tier {
            Tier::Hot => self.hot.capacity() as usize,
            Tier::Cold => self.cold.capacity() as usize,
            Tier::Recompute => 0,
        }
    }

    /// Free slots of a tier (in the cold tier, the slots of staged copies count as free: they
    /// are dropped when the slots are wanted).
    pub fn free_blocks(&self, tier: Tier) -> usize {
        match tier {
            Tier::Hot => self.hot_free.available(),
            Tier::Cold => self.cold_free.available() + self.staged.len(),
            Tier::Recompute => 0,
        }
    }

    /// Allocates one block per entry of `tags` in `tier` (`Hot` or `Cold`), reference count 1.
    pub fn allocate(&mut self, tier: Tier, tags: &[BlockTags]) -> KvResult<Vec<BlockId>> {
        for t in tags {
            if !(0.0..=1.0).contains(&t.importance) {
                return Err(KvError::InvalidImportance {
                    value: t.importance,
                });
            }
            if t.tokens.len() > self.layout.shape.block_size || t.tokens.start > t.tokens.end {
                return Err(KvError::TokenRange {
                    start: t.tokens.start as usize,
                    end: t.tokens.end as usize,
                    capacity: self.layout.shape.block_size,
                });
            }
        }
        let slots = self.take_slots(tier, tags.len())?;
        let mut ids = Vec::with_capacity(tags.len());
        for (t, slot) in tags.iter().zip(slots) {
            let id = BlockId(self.next_id);
            self.next_id += 1;
            self.meta.insert(id, t, tier, slot);
            ids.push(id);
        }
        Ok(ids)
    }

    /// Adds one owner to each block (a shared prefix block gaining a sequence).
    pub fn retain(&mut self, ids: &[BlockId]) -> KvResult<()> {
        self.check_unique_live(ids)?;
        for &id in ids {
            let meta = self.lookup(id)?;
            if meta.ref_count == u32::MAX {
                return Err(KvError::RefCountOverflow { id });
            }
        }
        for &id in ids {
            if let Some(meta) = self.meta.get_mut(id) {
                meta.ref_count += 1;
            }
        }
        Ok(())
    }

    /// Drops one owner from each block; blocks left with no owner are freed and returned.
    /// Releasing a freed block is [`KvError::AlreadyFreed`] (ids are never reused).
    pub fn release(&mut self, ids: &[BlockId]) -> KvResult<Vec<BlockId>> {
        self.check_unique_live(ids)?;
        let mut freed = Vec::new();
        for &id in ids {
            let Some(meta) = self.meta.get_mut(id) else {
                continue;
            };
            meta.ref_count -= 1;
            if meta.ref_count == 0 {
                if let Some(meta) = self.meta.remove(id) {
                    self.free_slot_of(meta.tier, meta.precision, meta.slot);
                }
                self.unstage(&[id]);
                freed.push(id);
            }
        }
        Ok(freed)
    }

    /// Sets a block's importance (0..=1).
    pub fn set_importance(&mut self, id: BlockId, importance: f32) -> KvResult<()> {
        if !(0.0..=1.0).contains(&importance) {
            return Err(KvError::InvalidImportance { value: importance });
        }
        self.lookup(id)?;
        if let Some(meta) = self.meta.get_mut(id) {
            meta.importance = importance;
        }
        Ok(())
    }

    /// Moves hot blocks to the cold tier: one bulk copy of every layer, bytes unchanged.
    pub fn spill(&mut self, ids: &[BlockId]) -> KvResult<()> {
        self.transfer(ids, Tier::Hot, Tier::Cold)
    }

    /// Moves cold blocks to the hot tier: one bulk copy of every layer, bytes unchanged.
    /// Down-tiered blocks ([`Precision::Reduced`]) are re-encoded to the layer's codecs on the
    /// way and become [`Precision::Restored`]. Nothing changes on error, except when the device
    /// copy of the down-tiered blocks fails after the others moved (each block is then either
    /// wholly cold or wholly hot).
    pub fn warm(&mut self, ids: &[BlockId]) -> KvResult<()> {
        self.slots_in(ids, Tier::Cold)?;
        let (apart, full): (Vec<BlockId>, Vec<BlockId>) = ids
            .iter()
            .partition(|&&id| self.precision_of(id).stored_apart());
        if apart.is_empty() {
            return self.transfer(ids, Tier::Cold, Tier::Hot);
        }
        if self.hot_free.available() < ids.len() {
            return Err(KvError::TierExhausted {
                tier: Tier::Hot,
                requested: ids.len(),
                available: self.hot_free.available(),
            });
        }
        let reduced = apart;
        let mut scratch = self
            .hot
            .cold_tier(self.layout.clone(), reduced.len() as u32)?;
        let expanded = self.expand_reduced(&reduced)?;
        let pairs: Vec<(u32, u32)> = (0..reduced.len() as u32).map(|i| (i, i)).collect();
        scratch.copy_from(&expanded, &pairs);
        let order = reduced;
        self.transfer(&full, Tier::Cold, Tier::Hot)?;
        let to = self.take_slots(Tier::Hot, order.len())?;
        let pairs: Vec<(u32, u32)> = (0..).zip(to.iter().copied()).collect();
        if let Err(e) = self.hot.warm_from(&scratch, &pairs) {
            to.into_iter()
                .for_each(|slot| self.free_slot(Tier::Hot, slot));
            return Err(e);
        }
        for (&id, &new) in order.iter().zip(&to) {
            let Some(meta) = self.meta.get(id) else {
                continue;
            };
            let (old, was) = (meta.slot, meta.precision);
            let back = Precision::Restored;
            let Some(meta) = self.meta.get_mut(id) else {
                continue;
            };
            meta.tier = Tier::Hot;
            meta.slot = new;
            meta.precision = back;
            self.free_slot_of(Tier::Cold, was, old);
            self.meta.note_move(id);
        }
        Ok(())
    }

    /// Drops the bytes of hot or cold blocks; they stay known (tier `Recompute`) while owned, so
    /// their owners learn that the tokens must be prefilled again.
    pub fn remove(&mut self, ids: &[BlockId]) -> KvResult<()> {
        self.check_unique_live(ids)?;
        for &id in ids {
            let meta = self.lookup(id)?;
            if meta.tier == Tier::Recompute {
                return Err(KvError::WrongTier {
                    id,
                    expected: Tier::Hot,
                    actual: Tier::Recompute,
                });
            }
        }
        self.unstage(ids);
        for &id in ids {
            if let Some(meta) = self.meta.get_mut(id) {
                let (tier, precision, slot) = (meta.tier, meta.precision, meta.slot);
                meta.tier = Tier::Recompute;
                // Prefill computes the bytes again, in the layer's codec.
                meta.precision = Precision::Full;
                self.free_slot_of(tier, precision, slot);
                self.meta.note_move(id);
            }
        }
        Ok(())
    }

    /// Gives `Recompute` blocks fresh hot slots, to be filled again by prefill.
    pub fn readmit(&mut self, ids: &[BlockId]) -> KvResult<()> {
        self.slots_in(ids, Tier::Recompute)?;
        let to = self.take_slots(Tier::Hot, ids.len())?;
        for (&id, slot) in ids.iter().zip(to) {
            if let Some(meta) = self.meta.get_mut(id) {
                meta.tier = Tier::Hot;
                meta.slot = slot;
                meta.precision = Precision::Full;
            }
            self.meta.note_move(id);
        }
        Ok(())
    }

    /// Encodes K and V rows of one layer into the token positions `token_start..` of the block
    /// table `blocks` (position `t` is row `t % block_size` of block `blocks[t / block_size]`).
    ///
    /// `k` and `v` hold `[tokens, kv_heads, head_dim]` elements. The blocks the rows land in must
    /// be live, distinct and in a tier the CPU can write (the host hot tier or the cold tier);
    /// the rest of the table is not looked at (a decode step writes one row of a long table, on
    /// every layer). Nothing is written on error.
    pub fn write(
        &mut self,
        layer: usize,
        blocks: &[BlockId],
        token_start: usize,
        k: Rows<'_>,
        v: Rows<'_>,
    ) -> KvResult<()> {
        let bs = self.layout.shape.block_size;
        let tokens = self.check_rows(layer, blocks, token_start, k.len(), v.len())?;
        // From here on, the touched blocks only: the first is `blocks[first]`.
        let first = token_start / bs;
        let blocks = &blocks[first..(token_start + tokens).div_ceil(bs)];
        let token_start = token_start - first * bs;
        self.check_unique_live(blocks)?;
        let tiers = self.resident(blocks)?;
        self.check_not_reduced(blocks)?;
        let (kc, vc) = (&self.k_codecs[layer], &self.v_codecs[layer]);
        let d = self.layout.shape.head_dim;
        let mut row = vec![0.0f32; d];
        for (rows, codec) in [(&k, kc), (&v, vc)] {
            for r in 0..tokens * self.layout.shape.kv_heads {
                rows.read_into(r * d, &mut row);
                codec.check_encodable(&row)?;
            }
        }
        if tiers.iter().any(|&(t, _)| t == Tier::Hot) {
            self.hot.host_mut()?;
        }
        let shape = self.layout.shape;
        let (kv_heads, bs) = (shape.kv_heads, shape.block_size);
        // A staged copy would hold the bytes from before.
        self.staged.drop_copies(
            &blocks[token_start / bs..(token_start + tokens).div_ceil(bs)],
            &mut self.cold_free,
        );
        let mut scratch = vec![0.0f32; d];
        let mut idx = vec![0u8; d];
        for t in 0..tokens {
            let pos = token_start + t;
            let (block, in_block) = (pos / bs, pos % bs);
            let (tier, slot) = tiers[block];
            let target = match tier {
                Tier::Hot => self.hot.host_mut()?,
                _ => &mut self.cold,
            };
            for h in 0..kv_heads {
                let (k_code, v_code, k_norm, v_norm) =
                    target.row_mut(layer, slot, shape.row_in_block(in_block, h));
                let r = (t * kv_heads + h) * d;
                k.read_into(r, &mut row);
                kc.encode_row(&row, k_code, k_norm, &mut scratch, &mut idx);
                v.read_into(r, &mut row);
                vc.encode_row(&row, v_code, v_norm, &mut scratch, &mut idx);
            }
        }
        Ok(())
    }

    /// Decodes K and V rows of one layer (the dequantize reference path): the inverse of
    /// [`Self::write`] up to codec error. `k` and `v` receive `[tokens, kv_heads, head_dim]`.
    pub fn read(
        &self,
        layer: usize,
        blocks: &[BlockId],
        token_start: usize,
        k: &mut [f32],
        v: &mut [f32],
    ) -> KvResult<()> {
        let tokens = self.check_rows(layer, blocks, token_start, k.len(), v.len())?;
        self.check_unique_live(blocks)?;
        let tiers = self.resident(blocks)?;
        let (kv_heads, bs) = (self.layout.shape.kv_heads, self.layout.shape.block_size);
        let d = self.layout.shape.head_dim;
        let row_elems = kv_heads * d;
        let mut scratch = vec![0.0f32; self.layout.shape.head_dim];
        for t in 0..tokens {
            let pos = token_start + t;
            let (block, in_block) = (pos / bs, pos % bs);
            let (tier, slot) = tiers[block];
            let (tier, kc, vc) = match (tier, self.precision_of(blocks[block]), &self.reduced) {
                (Tier::Hot, _, _) => (
                    self.hot.host()?,
                    &self.k_codecs[layer],
                    &self.v_codecs[layer],
                ),
                (_, Precision::Reduced, Some(pool)) => {
                    (&pool.tier, &pool.k_codecs[layer], &pool.v_codecs[layer])
                }
                _ => (&self.cold, &self.k_codecs[layer], &self.v_codecs[layer]),
            };
            let bytes = tier.layer(layer);
            for h in 0..kv_heads {
                let r = self.layout.shape.row(slot, in_block, h);
                let span = |width: usize| r * width..(r + 1) * width;
                let out = t * row_elems + h * d..t * row_elems + (h + 1) * d;
                kc.decode_rows(
                    &bytes.k_codes[span(bytes.k_code_row)],
                    &bytes.k_norms[span(bytes.k_norm_row)],
                    &mut k[out.clone()],
                    &mut scratch,
                );
                vc.decode_rows(
                    &bytes.v_codes[span(bytes.v_code_row)],
                    &bytes.v_norms[span(bytes.v_norm_row)],
                    &mut v[out],
                    &mut scratch,
                );
            }
        }
        Ok(())
    }

    /// The bytes of one resident block in every layer and stream (for checksums and tests); a
    /// down-tiered block's re-encoded to the layer's codecs, as warming it would make them.
    pub fn block_bytes_of(&self, id: BlockId) -> KvResult<Vec<u8>> {
        let meta = self.lookup(id)?;
        match meta.tier {
            Tier::Hot => match &self.hot {
                HotTier::Host(h) => Ok(h.block_bytes(meta.slot)),
                HotTier::Cuda(c) => c.block_bytes(meta.slot),
            },
            Tier::Cold if meta.precision == Precision::Reduced => {
                Ok(self.expand_reduced(&[id])?.block_bytes(0))
            }
            Tier::Cold => Ok(self.cold.block_bytes(meta.slot)),
            Tier::Recompute => Err(KvError::WrongTier {
                id,
                expected: Tier::Hot,
                actual: Tier::Recompute,
            }),
        }
    }

    /// How [`Self::block_bytes_of`] lays out one block: one part per (stream, layer), in order.
    pub fn block_parts(&self) -> Vec<BlockPart> {
        let l = &self.layout;
        let rows = l.shape.block_size * l.shape.kv_heads;
        let mut parts = Vec::with_capacity(4 * l.shape.layers);
        let mut offset = 0;
        for (plane, stream) in BlockStream::ALL.into_iter().enumerate() {
            for layer in 0..l.shape.layers {
                let row = l.rows[plane][layer];
                parts.push(BlockPart {
                    stream,
                    layer,
                    offset,
                    shape: [l.shape.kv_heads, l.shape.block_size, row],
                });
                offset += rows * row;
            }
        }
        parts
    }

    /// Overwrites the bytes of a cold block with `bytes` as [`Self::block_bytes_of`] returns
    /// them (restoring a block from the shadow). Nothing changes on error.
    pub fn write_block_bytes(&mut self, id: BlockId, bytes: &[u8]) -> KvResult<()> {
        let expected = self.layout.block_bytes();
        if bytes.len() != expected {
            return Err(KvError::BlockBytesLength {
                expected,
                got: bytes.len(),
            });
        }
        let slot = self.slots_in(&[id], Tier::Cold)?[0];
        self.check_not_reduced(&[id])?;
        self.cold.set_block_bytes(slot, bytes);
        Ok(())
    }

    // ----- internals shared with attention, eviction and pins -----

    pub(crate) fn lookup(&self, id: BlockId) -> KvResult<&BlockMeta> {
        match self.meta.get(id) {
            Some(m) => Ok(m),
            None if id.0 < self.next_id => Err(KvError::AlreadyFreed { id }),
            None => Err(KvError::UnknownBlock { id }),
        }
    }

    pub(crate) fn hot_layer(&self, layer: usize) -> KvResult<host::LayerBytes<'_>> {
        Ok(self.hot.host()?.layer(layer))
    }

    /// The built key and value codecs of a layer the caller has checked.
    pub(crate) fn layer_codecs(&self, layer: usize) -> (&Codec, &Codec) {
        (&self.k_codecs[layer], &self.v_codecs[layer])
    }

    /// Every id exists, and none is listed twice.
    pub(crate) fn check_unique_live(&self, ids: &[BlockId]) -> KvResult<()> {
        let mut seen = HashSet::with_capacity(ids.len());
        for &id in ids {
            if !seen.insert(id) {
                return Err(KvError::DuplicateBlock { id });
            }
            self.lookup(id)?;
        }
        Ok(())
    }

    /// Validates a row transfer's layer, widths and token range (not the blocks themselves) and
    /// returns its token count.
    fn check_rows(
        &self,
        layer: usize,
        blocks: &[BlockId],
        token_start: usize,
        k_len: usize,
        v_len: usize,
    ) -> KvResult<usize> {
        let shape = &self.layout.shape;
        if layer >= shape.layers {
            return Err(KvError::UnknownLayer {
                layer,
                layers: shape.layers,
            });
        }
        let width = shape.token_width();
        if k_len == 0 || !k_len.is_multiple_of(width) {
            return Err(KvError::RowWidth {
                expected: width * k_len.div_ceil(width).max(1),
                got: k_len,
            });
        }
        if v_len != k_len {
            return Err(KvError::RowWidth {
                expected: k_len,
                got: v_len,
            });
        }
        let tokens = k_len / width;
        let capacity = blocks.len() * shape.block_size;
        if token_start + tokens > capacity {
            return Err(KvError::TokenRange {
                start: token_start,
                end: token_start + tokens,
                capacity,
            });
        }
        Ok(tokens)
    }

    /// The tier and slot of each block, which must hold bytes.
    fn resident(&self, blocks: &[BlockId]) -> KvResult<Vec<(Tier, u32)>> {
        blocks
            .iter()
            .map(|&id| {
                let meta = self.lookup(id)?;
                match meta.tier {
                    Tier::Recompute => Err(KvError::WrongTier {
                        id,
                        expected: Tier::Hot,
                        actual: Tier::Recompute,
                    }),
                    t => Ok((t, meta.slot)),
                }
            })
            .collect()
    }
}
