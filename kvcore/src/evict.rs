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
//!    [`BlockStore::make_room_except`] also skips blocks the caller marks busy, and
//!    [`BlockStore::make_room_for`] removes only blocks the caller marks removable (the others
//!    may only spill).
//!
//! Cost: O(hot blocks · log) for the sort, plus the spill copies.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::block::BlockId;
use crate::block::Tier;
use crate::error::{KvError, KvResult};
use crate::metadata::PinState;
use crate::store::BlockStore;

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
        self.make_room_for(n, busy, |_| true)
    }

    /// [`Self::make_room_except`] where only blocks for which `removable` is true may lose their
    /// bytes; the others may only be spilled (an engine passes "belongs to the tenants the room is
    /// for", so making room for one tenant never drops another's blocks).
    ///
    /// The blocks removed are the first removable ones in eviction order, as many as the cold
    /// tier cannot take; the blocks spilled are the next ones in eviction order, removable or
    /// not. With `removable` always true this is exactly [`Self::make_room_except`]'s rule.
    /// Errors with [`KvError::TierExhausted`], changing nothing, when that cannot free `n` slots.
    pub fn make_room_for(
        &mut self,
        n: usize,
        busy: impl Fn(BlockId) -> bool,
        removable: impl Fn(BlockId) -> bool,
    ) -> KvResult<Eviction> {
        if self.free_blocks(Tier::Hot) >= n {
            return Ok(Eviction::default());
        }
        let mut victims = self.eviction_order();
        victims.retain(|&id| !busy(id));
        self.make_room_ordered(n, victims, removable)
    }

    /// [`Self::make_room_for`] with the caller's victims in the caller's order (first = evicted
    /// first) instead of [`Self::eviction_order`]: an engine that ranks blocks by what they
    /// hold for its sequences (attention-aware eviction) passes its own ranking. Ids that are
    /// not hot are skipped. Errors with [`KvError::TierExhausted`], changing nothing, when the
    /// victims cannot free `n` slots.
    pub fn make_room_ordered(
        &mut self,
        n: usize,
        mut victims: Vec<BlockId>,
        removable: impl Fn(BlockId) -> bool,
    ) -> KvResult<Eviction> {
        let free = self.free_blocks(Tier::Hot);
        if free >= n {
            return Ok(Eviction::default());
        }
        let mut seen = HashSet::new();
        victims.retain(|&id| {
            seen.insert(id)
                && self
                    .metadata()
                    .get(id)
                    .is_some_and(|m| m.tier() == Tier::Hot)
        });
        let need = n - free;
        let to_cold = self.free_blocks(Tier::Cold).min(need).min(victims.len());
        let to_remove = need - to_cold;
        let removed: Vec<BlockId> = victims
            .iter()
            .copied()
            .filter(|&id| removable(id))
            .take(to_remove)
            .collect();
        let gone: HashSet<BlockId> = removed.iter().copied().collect();
        let spilled: Vec<BlockId> = victims
            .iter()
            .copied()
            .filter(|id| !gone.contains(id))
            .take(to_cold)
            .collect();
        if removed.len() + spilled.len() < need {
            let removable_count = victims.iter().filter(|&&id| removable(id)).count();
            let cold_free = self.free_blocks(Tier::Cold);
            return Err(KvError::TierExhausted {
                tier: Tier::Hot,
                requested: n,
                available: free + victims.len().min(cold_free + removable_count),
            });
        }
        self.spill(&spilled)?;
        self.remove(&removed)?;
        Ok(Eviction { spilled, removed })
    }
}
