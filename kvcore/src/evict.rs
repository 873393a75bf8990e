//! Semantic eviction: free hot blocks by what they mean, not by when they were last used.
//!
//! Rule of [`BlockStore::make_room`]:
//! 1. victims are hot blocks in ascending order of (pinned?, eviction priority, last_attended,
//!    created_at, id) — so a [`PinState::Pinned`] block is chosen only when no unpinned hot block
//!    is left, lower priority goes first, and among equals the one attended longest ago (then the
//!    older one) goes first;
//! 2. of the victims, as many as the cold tier has free slots are spilled — the most valuable
//!    victims (taken from the end of the order) — and the rest are removed (tier `Recompute`);
//! 3. if the hot tier cannot free `n` slots at all, nothing happens and the call errors;
//!    [`BlockStore::make_room_except`] also skips blocks the caller marks busy.
//!
//! Cost: O(hot blocks · log) for the sort, plus the spill copies.

use serde::{Deserialize, Serialize};

use crate::block::BlockId;
use crate::error::{KvError, KvResult};
use crate::metadata::PinState;
use crate::store::{BlockStore, Tier};

/// What [`BlockStore::make_room`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Eviction {
    /// Blocks moved to the cold tier (in eviction order).
    pub spilled: Vec<BlockId>,
    /// Blocks whose bytes were dropped (in eviction order).
    pub removed: Vec<BlockId>,
}

impl Eviction {
    /// Hot slots this eviction freed.
    pub fn freed(&self) -> usize {
        self.spilled.len() + self.removed.len()
    }
}

impl BlockStore {
    /// Hot blocks in eviction order (first = evicted first); see the module docs.
    pub fn eviction_order(&self) -> Vec<BlockId> {
        let mut hot: Vec<_> = self
            .metadata()
            .iter()
            .filter(|m| m.tier() == Tier::Hot)
            .collect();
        hot.sort_by_key(|m| {
            (
                m.pin() == PinState::Pinned,
                m.priority(),
                m.last_attended(),
                m.created_at(),
                m.id(),
            )
        });
        hot.into_iter().map(|m| m.id()).collect()
    }

    /// Makes at least `n` hot slots free, evicting by the rule in the module docs.
    pub fn make_room(&mut self, n: usize) -> KvResult<Eviction> {
        self.make_room_except(n, |_| false)
    }

    /// [`Self::make_room`], never choosing a block for which `busy` is true (an engine passes the
    /// blocks its running sequences attend). Errors, changing nothing, when the free slots plus
    /// the evictable blocks are fewer than `n`.
    pub fn make_room_except(
        &mut self,
        n: usize,
        busy: impl Fn(BlockId) -> bool,
    ) -> KvResult<Eviction> {
        let free = self.free_blocks(Tier::Hot);
        if free >= n {
            return Ok(Eviction::default());
        }
        let mut victims = self.eviction_order();
        victims.retain(|&id| !busy(id));
        if free + victims.len() < n {
            return Err(KvError::TierExhausted {
                tier: Tier::Hot,
                requested: n,
                available: free + victims.len(),
            });
        }
        victims.truncate(n - free);
        let to_cold = self.free_blocks(Tier::Cold).min(victims.len());
        let split = victims.len() - to_cold;
        let (removed, spilled) = victims.split_at(split);
        self.spill(spilled)?;
        self.remove(removed)?;
        Ok(Eviction {
            spilled: spilled.to_vec(),
            removed: removed.to_vec(),
        })
    }
}
