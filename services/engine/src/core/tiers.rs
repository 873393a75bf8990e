//! The tier bridge: one cycle of the OODA loop that moves cached blocks between tiers.
//!
//! - **Observe**: occupancy of both tiers, and for every cached block no running sequence
//!   attends: its tier, pin, importance, how often and how recently attention read it.
//! - **Orient**: score = `w_frequency · f + w_recency · r + w_importance · importance`, where `f`
//!   is `ln(1 + attended) / ln(1 + max attended)` and `r` is the block's last attention as a
//!   share of the observed span (0 oldest, 1 newest); pinned blocks are never moved. Ties break by
//!   eviction priority, then id, so a cycle is deterministic.
//! - **Decide**: hot fill above `hot_high` → spill the lowest-scored hot blocks until the hot
//!   tier is at `hot_target`; otherwise, hot fill below `warm_below` → warm the cold blocks of
//!   the sessions the caller names active (their recorded chains, leading blocks first) while the
//!   hot tier stays under `hot_target`; cold fill above `cold_high` → remove the lowest-scored
//!   cold blocks until it is at `cold_target` (the shadow still holds them on disk; with
//!   down-tiering on they are re-encoded into the reduced pool instead, as far as it has room).
//! - **Act** through kvcore (spill, warm, and dropping from the cache).
//!
//! Threshold suggestions follow cold-tier fill: below 50 % the cold tier has room, so promote
//! sooner (raise `warm_below`); above 80 % it is crowded, so demote later (raise `hot_high`).
//! With `adapt` on they are applied, clamped to the configured bounds.

use std::collections::HashSet;

use engram_kvcore::{BlockId, PinState, Tier};
use serde::{Deserialize, Serialize};

use super::{ChainKey, EngineCore};
use crate::error::{EngineError, EngineResult};

/// Thresholds and weights of the tier bridge (shares are of a tier's capacity).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierPolicy {
    /// Spill when the hot tier is fuller than this.
    pub hot_high: f64,
    /// Spill down to this, and warm no further than this.
    pub hot_target: f64,
    /// Warm active sessions' cold blocks while the hot tier is emptier than this.
    pub warm_below: f64,
    /// Remove cold blocks when the cold tier is fuller than this.
    pub cold_high: f64,
    /// Remove down to this.
    pub cold_target: f64,
    /// Weight of attention frequency in the score.
    pub w_frequency: f64,
    /// Weight of recency.
    pub w_recency: f64,
    /// Weight of importance.
    pub w_importance: f64,
    /// Apply the threshold suggestions (within the bounds below).
    pub adapt: bool,
    /// Bounds of `hot_high` when adapting.
    pub hot_high_bounds: [f64; 2],
    /// Bounds of `warm_below` when adapting.
    pub warm_below_bounds: [f64; 2],
    /// Blocks moved per cycle at most.
    pub max_moves: usize,
}

impl Default for TierPolicy {
    fn default() -> Self {
        Self {
            hot_high: 0.9,
            hot_target: 0.75,
            warm_below: 0.5,
            cold_high: 0.95,
            cold_target: 0.85,
            w_frequency: 0.4,
            w_recency: 0.4,
            w_importance: 0.2,
            adapt: true,
            hot_high_bounds: [0.8, 0.97],
            warm_below_bounds: [0.3, 0.7],
            max_moves: 1024,
        }
    }
}

impl TierPolicy {
    /// Checks that shares are in 0..=1, ordered, and the weights are non-negative.
    pub fn validate(&self) -> EngineResult<()> {
        let bad = |field, reason: &str| {
            Err(EngineError::InvalidConfig {
                field,
                reason: reason.into(),
            })
        };
        let shares = [
            ("hot_high", self.hot_high),
            ("hot_target", self.hot_target),
            ("warm_below", self.warm_below),
            ("cold_high", self.cold_high),
            ("cold_target", self.cold_target),
        ];
        for (field, v) in shares {
            if !(0.0..=1.0).contains(&v) {
                return bad(field, "must be a share in 0..=1");
            }
        }
        if self.hot_target > self.hot_high || self.cold_target > self.cold_high {
            return bad("hot_target", "targets must not exceed their high marks");
        }
        if self.warm_below > self.hot_target {
            return bad("warm_below", "must not exceed hot_target");
        }
        for (field, w) in [
            ("w_frequency", self.w_frequency),
            ("w_recency", self.w_recency),
            ("w_importance", self.w_importance),
        ] {
            if !(w >= 0.0 && w.is_finite()) {
                return bad(field, "must be a finite weight ≥ 0");
            }
        }
        for (field, [lo, hi]) in [
            ("hot_high_bounds", self.hot_high_bounds),
            ("warm_below_bounds", self.warm_below_bounds),
        ] {
            if !(0.0..=1.0).contains(&lo) || !(0.0..=1.0).contains(&hi) || lo > hi {
                return bad(field, "must be [low, high] shares with low ≤ high");
            }
        }
        Ok(())
    }
}

/// What a cycle saw.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct TierObservation {
    /// Hot blocks in use / capacity.
    pub hot_used: usize,
    /// Hot capacity.
    pub hot_capacity: usize,
    /// Cold blocks in use.
    pub cold_used: usize,
    /// Cold capacity.
    pub cold_capacity: usize,
    /// Cached blocks no running sequence attends (the movable ones).
    pub idle_cached: usize,
    /// Sessions the caller named active.
    pub active_sessions: usize,
    /// Cold blocks of those sessions' chains.
    pub active_cold_blocks: usize,
    /// Live reservations.
    pub reservations: usize,
}

/// What a cycle did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct CycleReport {
    /// The observation.
    pub observed: TierObservation,
    /// `hot_high` and `warm_below` in force for this cycle.
    pub thresholds: [f64; 2],
    /// The suggestion from cold-tier fill: `promote_sooner`, `demote_later` or none.
    pub suggestion: Option<String>,
    /// Blocks spilled hot → cold.
    pub spilled: usize,
    /// Blocks warmed cold → hot.
    pub warmed: usize,
    /// Blocks removed from the cold tier (and the cache); with down-tiering on, the blocks that
    /// left the cache to make room (cold blocks the reduced pool could not take, or down-tiered
    /// blocks dropped for more valuable ones); the blocks down-tiered are counted in
    /// `CacheCounters::down_tiered`.
    pub removed: usize,
}

/// One scored, movable block.
#[derive(Debug, Clone, Copy)]
struct Scored {
    score: f64,
    priority: u16,
    id: BlockId,
    tier: Tier,
}

impl EngineCore {
    /// Runs one observe–orient–decide–act cycle (see the module docs). `active` names the
    /// sessions whose blocks should be hot; `policy` may be adapted in place.
    pub fn tier_cycle(
        &mut self,
        policy: &mut TierPolicy,
        active: &[ChainKey],
    ) -> EngineResult<CycleReport> {
        // Observe.
        let busy: HashSet<BlockId> = self
            .seqs
            .values()
            .flat_map(|s| s.blocks.iter().copied())
            .collect();
        let occ = self.occupancy();
        let metas: Vec<_> = self
            .cache
            .blocks()
            .filter(|id| !busy.contains(id))
            .filter_map(|id| self.store.metadata().get(id))
            .filter(|m| m.tier() != Tier::Recompute && m.pin() != PinState::Pinned)
            .collect();
        let mut active_cold = Vec::new();
        for key in active {
            if let Some(chain) = self.chains.by_key.get(key) {
                for h in &chain.hashes {
                    let Some(id) = self.cache.get(h) else {
                        break;
                    };
                    if self.store.metadata().get(id).map(|m| m.tier()) == Some(Tier::Cold) {
                        active_cold.push(id);
                    }
                }
            }
        }
        let observed = TierObservation {
            hot_used: occ.hot_used,
            hot_capacity: occ.hot_capacity,
            cold_used: occ.cold_used,
            cold_capacity: occ.cold_capacity,
            idle_cached: metas.len(),
            active_sessions: active.len(),
            active_cold_blocks: active_cold.len(),
            reservations: self.reservations.live_count(),
        };
        // Orient.
        let max_attended = metas.iter().map(|m| m.attended()).max().unwrap_or(1).max(1);
        let (lo, hi) = metas.iter().fold((u64::MAX, 0u64), |(lo, hi), m| {
            (lo.min(m.last_attended()), hi.max(m.last_attended()))
        });
        let span = hi.saturating_sub(lo).max(1) as f64;
        let denom = (1.0 + max_attended as f64).ln();
        let mut scored: Vec<Scored> = metas
            .iter()
            .map(|m| {
                let f = (1.0 + m.attended() as f64).ln() / denom;
                let r = m.last_attended().saturating_sub(lo) as f64 / span;
                Scored {
                    score: policy.w_frequency * f
                        + policy.w_recency * r
                        + policy.w_importance * m.importance() as f64,
                    priority: m.priority(),
                    id: m.id(),
                    tier: m.tier(),
                }
            })
            .collect();
        scored.sort_by(|a, b| {
            a.score
                .total_cmp(&b.score)
                .then(a.priority.cmp(&b.priority))
                .then(a.id.cmp(&b.id))
        });
        let share = |used: usize, cap: usize| {
            if cap == 0 {
                0.0
            } else {
                used as f64 / cap as f64
            }
        };
        let mut report = CycleReport {
            observed,
            thresholds: [policy.hot_high, policy.warm_below],
            ..CycleReport::default()
        };
        let cold_fill = share(occ.cold_used, occ.cold_capacity);
        if occ.cold_capacity > 0 && cold_fill < 0.5 {
            report.suggestion = Some("promote_sooner".into());
        } else if cold_fill > 0.8 {
            report.suggestion = Some("demote_later".into());
        }
        // Decide and act.
        let hot_fill = share(occ.hot_used, occ.hot_capacity);
        let target_hot = (policy.hot_target * occ.hot_capacity as f64).floor() as usize;
        if hot_fill > policy.hot_high {
            let want = occ
                .hot_used
                .saturating_sub(target_hot)
                .min(policy.max_moves);
            let victims: Vec<BlockId> = scored
                .iter()
                .filter(|s| s.tier == Tier::Hot)
                .take(want)
                .map(|s| s.id)
                .collect();
            self.trim_cold(victims.len())?;
            let room = self.store.free_blocks(Tier::Cold).min(victims.len());
            self.store.spill(&victims[..room])?;
            for &id in &victims[..room] {
                if let Some(m) = self.store.metadata().get(id) {
                    *self.counters.spilled.entry(m.source()).or_default() += 1;
                }
            }
            report.spilled = room;
            self.enforce_cold_quotas()?;
        } else if hot_fill < policy.warm_below && !active_cold.is_empty() {
            let room = target_hot
                .saturating_sub(occ.hot_used)
                .min(self.store.free_blocks(Tier::Hot))
                .min(policy.max_moves);
            active_cold.truncate(room);
            let mut seen = HashSet::new();
            active_cold.retain(|id| seen.insert(*id));
            self.store.warm(&active_cold)?;
            report.warmed = active_cold.len();
        }
        let occ = self.occupancy();
        if share(occ.cold_used, occ.cold_capacity) > policy.cold_high {
            let target = (policy.cold_target * occ.cold_capacity as f64).floor() as usize;
            let want = occ.cold_used.saturating_sub(target).min(policy.max_moves);
            let victims: Vec<BlockId> = scored
                .iter()
                .filter(|s| {
                    self.store
                        .metadata()
                        .get(s.id)
                        .map(|m| (m.tier(), m.ref_count()))
                        == Some((Tier::Cold, 1))
                })
                .map(|s| s.id)
                .collect();
            if self.store.reduced_capacity() > 0 {
                // Down-tiered instead of dropped, as far as the reduced pool takes them.
                report.removed = self.down_tier(victims, want)?;
            } else {
                for &id in victims.iter().take(want) {
                    self.drop_cached(id)?;
                }
                report.removed = victims.len().min(want);
            }
        }
        if policy.adapt {
            match report.suggestion.as_deref() {
                Some("promote_sooner") => {
                    policy.warm_below = (policy.warm_below + 0.05)
                        .clamp(policy.warm_below_bounds[0], policy.warm_below_bounds[1])
                        .min(policy.hot_target);
                }
                Some("demote_later") => {
                    policy.hot_high = (policy.hot_high + 0.02)
                        .clamp(policy.hot_high_bounds[0], policy.hot_high_bounds[1])
                        .max(policy.hot_target);
                }
                _ => {}
            }
        }
        Ok(report)
    }
}
