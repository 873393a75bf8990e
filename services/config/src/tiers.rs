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

/// `[eviction]`: which idle hot blocks leave first when a turn needs room, and how the tier
/// bridge weighs attention.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvictionSection {
    /// `attention` (the default: priority bands, blocks unread for `idle_steps` demoted, then
    /// attention mass and read recency) or `priority` (priority, then least recently touched).
    pub mode: String,
    /// Weight of a block's decayed attention mass within its band.
    pub mass_weight: f64,
    /// Weight of how recently the model read it (a step gave it at least half a uniform share).
    pub recency_weight: f64,
    /// Weight of how often the model read it (log scale).
    pub frequency_weight: f64,
    /// Weight of how often running sequences held it, whatever its mass (log scale): how often
    /// its chain runs.
    pub use_weight: f64,
    /// Sampled decode steps without a read after which an unpinned block loses its priority
    /// band (spilled first, never dropped for room while anything else can go); 0: never.
    pub idle_steps: u64,
    /// Sampled steps after which the counts the ranking weighs (reads, uses; live and carried)
    /// are halved, so that old use fades; 0: never.
    pub use_half_life: u64,
    /// Rank whole session chains: a conversation's blocks are worth what its chain's most
    /// valuable block (its agent's prefix, as a rule; a pinned one in its priority's band) is
    /// worth, so the least valuable chains lose blocks first, from their ends.
    pub whole_chains: bool,
}

impl Default for EvictionSection {
    fn default() -> Self {
        let p = engram_engine::EvictionPolicy::default();
        Self {
            mode: "attention".into(),
            mass_weight: p.mass_weight,
            recency_weight: p.recency_weight,
            frequency_weight: p.frequency_weight,
            use_weight: p.use_weight,
            idle_steps: p.idle_steps,
            use_half_life: p.use_half_life,
            whole_chains: p.whole_chains,
        }
    }
}

impl EvictionSection {
    /// The engine policy these settings describe.
    pub fn policy(&self) -> Result<engram_engine::EvictionPolicy, engram_engine::EngineError> {
        let p = engram_engine::EvictionPolicy {
            mode: engram_engine::EvictionMode::parse(&self.mode)?,
            mass_weight: self.mass_weight,
            recency_weight: self.recency_weight,
            frequency_weight: self.frequency_weight,
            use_weight: self.use_weight,
            idle_steps: self.idle_steps,
            use_half_life: self.use_half_life,
            whole_chains: self.whole_chains,
        };
        p.validate()?;
        Ok(p)
    }
}
