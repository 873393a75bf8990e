//! `[tiers]` and `[eviction]`: how cached blocks move between tiers.

use serde::{Deserialize, Serialize};

/// `[tiers]`: the tier bridge's loop and policy (shares of a tier's capacity).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TiersSection {
    /// Run the loop.
    pub enabled: bool,
    /// Milliseconds between cycles.
    pub interval_ms: u64,
    /// A session with a turn within this many seconds is active (its blocks are warmed).
    pub active_window_secs: u64,
    /// Spill above this hot fill.
    pub hot_high: f64,
    /// Spill down to, and warm up to, this hot fill.
    pub hot_target: f64,
    /// Warm active sessions below this hot fill.
    pub warm_below: f64,
    /// Remove cold blocks above this cold fill (the shadow keeps them).
    pub cold_high: f64,
    /// Remove down to this cold fill.
    pub cold_target: f64,
    /// Apply the threshold suggestions within the policy's bounds.
    pub adapt: bool,
    /// MiB of the hot tier the bridge keeps it to (0: the whole tier); admission may fill the
    /// tier to its capacity, the bridge brings it back under the budget.
    pub hot_budget_mib: u64,
    /// MiB of the cold tier the bridge keeps it to (0: the whole tier).
    pub cold_budget_mib: u64,
    /// Cycles a block stays where a tier move put it before the bridge moves it again.
    pub cooldown_cycles: u64,
    /// Spill ahead by staging (copy to the cold tier, stay hot until admission wants the room);
    /// off, the bridge spills ahead.
    pub stage: bool,
}

impl Default for TiersSection {
    fn default() -> Self {
        let p = engram_engine::TierPolicy::default();
        Self {
            enabled: true,
            interval_ms: 1000,
            active_window_secs: 120,
            hot_high: p.hot_high,
            hot_target: p.hot_target,
            warm_below: p.warm_below,
            cold_high: p.cold_high,
            cold_target: p.cold_target,
            adapt: p.adapt,
            hot_budget_mib: 0,
            cold_budget_mib: 0,
            cooldown_cycles: p.cooldown_cycles,
            stage: p.stage,
        }
    }
}

impl TiersSection {
    /// The engine policy these settings describe.
    pub fn policy(&self) -> engram_engine::TierPolicy {
        engram_engine::TierPolicy {
            hot_high: self.hot_high,
            hot_target: self.hot_target,
            warm_below: self.warm_below,
            cold_high: self.cold_high,
            cold_target: self.cold_target,
            adapt: self.adapt,
            hot_budget_bytes: self.hot_budget_mib << 20,
            cold_budget_bytes: self.cold_budget_mib << 20,
            cooldown_cycles: self.cooldown_cycles,
            stage: self.stage,
            ..engram_engine::TierPolicy::default()
        }
    }
}

/// `[eviction]`: the engine's own policy type, read as it is (`mode` is `attention` or
/// `priority`; the weights and counts as [`engram_engine::EvictionPolicy`] documents them), so a
/// new knob there is a configuration key without a copy here.
pub type EvictionSection = engram_engine::EvictionPolicy;
