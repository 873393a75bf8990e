//! Staged spills: a hot block's bytes copied to a cold slot ahead of need, the block staying hot.
//!
//! Spilling ahead (the tier bridge making room before admissions want it) moves blocks a turn
//! may still need: the turn then finds them cold. Staging does the copy ahead instead and keeps
//! the block hot: a turn that needs it finds it hot, and the spill that finally wants its slot
//! ([`BlockStore::spill`], eviction) takes the copy — no copy at that moment, the bytes already
//! in the cold tier.
//!
//! Invariants:
//! - a staged block is hot and owns a second slot, in the cold tier, holding exactly its bytes;
//! - a copy is free room: [`BlockStore::free_blocks`] counts it as a free cold slot, and when
//!   the cold tier runs out of truly free slots the oldest copies are dropped first;
//! - a copy goes as soon as the block's bytes could change or the block leaves the hot tier
//!   otherwise: writes through the store ([`BlockStore::write`], [`BlockStore::copy_tokens`]
//!   into it), removal, release. Writes through the raw hot tier ([`BlockStore::hot_mut`]) are
//!   the caller's to keep off staged blocks: stage only blocks nothing writes (an engine stages
//!   idle cached blocks, which are full and immutable).

use std::collections::BTreeMap;

use crate::block::{BlockId, Tier};
use crate::error::KvResult;

use super::hot::HotStorage;
use super::{BlockStore, SlotPool};

/// The staged copies of a store.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Staged {
    /// Block → (stage order, cold slot holding its copy).
    copies: BTreeMap<BlockId, (u64, u32)>,
    next: u64,
    /// Spills served by a copy.
    used: u64,
    /// Copies dropped before a spill used them.
    dropped: u64,
}

/// The staged blocks of one spill, their copies held apart: `(hot slot, block, copy's cold
/// slot, copy's stage order)`.
#[derive(Debug, Default)]
pub(super) struct Held {
    pub(super) blocks: Vec<(u32, BlockId, u32, u64)>,
}

/// What staging has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StageStats {
    /// Blocks staged now (hot, with a copy in the cold tier).
    pub staged: usize,
    /// Spills that took a staged copy (no copy at spill time).
    pub used: u64,
    /// Copies dropped unused: the cold tier wanted their slots, or the block was written,
    /// removed or freed.
    pub dropped: u64,
}

impl Staged {
    pub(crate) fn len(&self) -> usize {
        self.copies.len()
    }

    /// Takes the staged blocks out of a spill's `(hot slot, block)` list, holding their copies
    /// apart until the spill is done ([`Self::put_back`] when it fails).
    pub(super) fn hold(&mut self, order: &mut Vec<(u32, BlockId)>) -> Held {
        let mut held = Held::default();
        order.retain(|&(hot, id)| match self.copies.remove(&id) {
            Some((order, slot)) => {
                held.blocks.push((hot, id, slot, order));
                false
            }
            None => true,
        });
        held
    }

    /// Returns held copies (a spill that failed).
    pub(super) fn put_back(&mut self, held: Held) {
        for (_, id, slot, order) in held.blocks {
            self.copies.insert(id, (order, slot));
        }
    }

    /// Counts `n` spills served by a copy.
    pub(super) fn note_used(&mut self, n: u64) {
        self.used += n;
    }

    /// Drops the copies of `ids` (those staged), giving their slots to `free`.
    pub(super) fn drop_copies(&mut self, ids: &[BlockId], free: &mut SlotPool) {
        for id in ids {
            if let Some((_, slot)) = self.copies.remove(id) {
                free.give(slot);
                self.dropped += 1;
            }
        }
    }
}

impl BlockStore {
    /// Copies hot blocks' bytes to free cold slots ahead of a spill, keeping them hot (see the
    /// module docs). Blocks already staged are skipped; only truly free cold slots are used (no
    /// other copy is dropped for one), in the order given. Returns the blocks staged. Errors,
    /// changing nothing, when an id is unknown, listed twice or not hot.
    pub fn stage(&mut self, ids: &[BlockId]) -> KvResult<Vec<BlockId>> {
        let slots = self.slots_in(ids, Tier::Hot)?;
        let room = self.cold_free.available();
        let mut order: Vec<(u32, BlockId)> = slots
            .into_iter()
            .zip(ids.iter().copied())
            .filter(|(_, id)| !self.staged.copies.contains_key(id))
            .take(room)
            .collect();
        if order.is_empty() {
            return Ok(Vec::new());
        }
        let picked: Vec<BlockId> = order.iter().map(|&(_, id)| id).collect();
        order.sort_unstable();
        let to = self.cold_free.take(order.len());
        let pairs: Vec<(u32, u32)> = order
            .iter()
            .map(|&(s, _)| s)
            .zip(to.iter().copied())
            .collect();
        if let Err(e) = self.hot.spill_to(&mut self.cold, &pairs) {
            to.into_iter().for_each(|slot| self.cold_free.give(slot));
            return Err(e);
        }
        for (&(_, id), &slot) in order.iter().zip(&to) {
            let n = self.staged.next;
            self.staged.next += 1;
            self.staged.copies.insert(id, (n, slot));
        }
        Ok(picked)
    }

    /// Whether a block is staged (hot, with a copy in the cold tier).
    pub fn is_staged(&self, id: BlockId) -> bool {
        self.staged.copies.contains_key(&id)
    }

    /// What staging has done so far.
    pub fn stage_stats(&self) -> StageStats {
        StageStats {
            staged: self.staged.len(),
            used: self.staged.used,
            dropped: self.staged.dropped,
        }
    }

    /// Drops the copies of `ids` (those staged), freeing their cold slots.
    pub fn unstage(&mut self, ids: &[BlockId]) {
        self.staged.drop_copies(ids, &mut self.cold_free);
    }

    /// Drops the oldest copies until `n` cold slots are truly free (or no copy is left).
    pub(super) fn reclaim_copies(&mut self, n: usize) {
        let short = n.saturating_sub(self.cold_free.available());
        if short == 0 {
            return;
        }
        let mut oldest: Vec<(u64, BlockId)> = self
            .staged
            .copies
            .iter()
            .map(|(&id, &(order, _))| (order, id))
            .collect();
        oldest.sort_unstable();
        let ids: Vec<BlockId> = oldest.into_iter().take(short).map(|(_, id)| id).collect();
        self.unstage(&ids);
    }
}
