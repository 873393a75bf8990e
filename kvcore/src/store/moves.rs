//! Slots and moves between tiers: taking and freeing slots, and the bulk copy of a spill or a
//! warm (a staged block's spill takes its copy, `staged.rs`).

use super::hot::HotStorage;
use super::{BlockStore, staged};
use crate::block::{BlockId, Tier};
use crate::error::{KvError, KvResult};

impl BlockStore {
    pub(super) fn take_slots(&mut self, tier: Tier, n: usize) -> KvResult<Vec<u32>> {
        if tier == Tier::Cold {
            // Staged copies give way, but only for a call that can succeed.
            if self.free_blocks(Tier::Cold) < n {
                return Err(KvError::TierExhausted {
                    tier,
                    requested: n,
                    available: self.free_blocks(Tier::Cold),
                });
            }
            self.reclaim_copies(n);
        }
        let pool = match tier {
            Tier::Hot => &mut self.hot_free,
            Tier::Cold => &mut self.cold_free,
            Tier::Recompute => {
                return Err(KvError::TierExhausted {
                    tier,
                    requested: n,
                    available: 0,
                });
            }
        };
        if pool.available() < n {
            return Err(KvError::TierExhausted {
                tier,
                requested: n,
                available: pool.available(),
            });
        }
        Ok(pool.take(n))
    }

    pub(super) fn free_slot(&mut self, tier: Tier, slot: u32) {
        match tier {
            Tier::Hot => self.hot_free.give(slot),
            Tier::Cold => self.cold_free.give(slot),
            Tier::Recompute => {}
        }
    }

    /// Copies `ids` from `source` to `dest` (hot ↔ cold) and updates their slots and tier.
    ///
    /// Blocks are paired in source-slot order with destination slots in ascending order, so
    /// blocks adjacent in the source land adjacent in the destination and move as one copy,
    /// whatever order the caller listed them in (eviction lists them by priority). A staged
    /// block spills onto its copy, nothing copied. When the copy fails (a device error), nothing
    /// moved, but other blocks' copies the spill made room out of may be gone (free room either
    /// way: [`Self::free_blocks`] is unchanged).
    pub(super) fn transfer(&mut self, ids: &[BlockId], source: Tier, dest: Tier) -> KvResult<()> {
        let from = self.slots_in(ids, source)?;
        let mut order: Vec<(u32, BlockId)> = from.into_iter().zip(ids.iter().copied()).collect();
        order.sort_unstable();
        if dest == Tier::Cold && self.free_blocks(Tier::Cold) < ids.len() {
            return Err(KvError::TierExhausted {
                tier: dest,
                requested: ids.len(),
                available: self.free_blocks(Tier::Cold),
            });
        }
        // The copies of the staged blocks spilled here are held apart, so that making room for
        // the others never takes them; they go back if the copy fails.
        let own = if dest == Tier::Cold {
            self.staged.hold(&mut order)
        } else {
            staged::Held::default()
        };
        let to = match self.take_slots(dest, order.len()) {
            Ok(to) => to,
            Err(e) => {
                self.staged.put_back(own);
                return Err(e);
            }
        };
        let pairs: Vec<(u32, u32)> = order
            .iter()
            .map(|&(s, _)| s)
            .zip(to.iter().copied())
            .collect();
        let copied = match dest {
            Tier::Cold => self.hot.spill_to(&mut self.cold, &pairs),
            _ => self.hot.warm_from(&self.cold, &pairs),
        };
        if let Err(e) = copied {
            to.into_iter().for_each(|slot| self.free_slot(dest, slot));
            self.staged.put_back(own);
            return Err(e);
        }
        let spent = own.blocks.len() as u64;
        for (old, id, new, _) in own.blocks {
            self.hot_free.give(old);
            if let Some(meta) = self.meta.get_mut(id) {
                meta.tier = Tier::Cold;
                meta.slot = new;
            }
            self.meta.note_move(id);
        }
        self.staged.note_used(spent);
        for (&(old, id), &new) in order.iter().zip(&to) {
            self.free_slot(source, old);
            if let Some(meta) = self.meta.get_mut(id) {
                meta.tier = dest;
                meta.slot = new;
            }
            self.meta.note_move(id);
        }
        Ok(())
    }
}
