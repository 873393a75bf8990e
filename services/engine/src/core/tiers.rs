//! The tier bridge: one cycle of the OODA loop that moves cached blocks between tiers.
//!
//! - **Observe**: occupancy of both tiers against their byte budgets, and for every cached block
//!   no running sequence attends: its tier, pin, importance, how often and how recently attention
//!   read it, and the cycle of its last tier move.
//! - **Orient**: a block's weight is `w_frequency · f + w_recency · r + w_importance ·
//!   importance` (plus a floor), scaled by its eviction priority, where `f` is `ln(1 + attended) /
//!   ln(1 + max attended)` and `r` is its last attention as a share of the observed span (with
//!   attention-aware eviction, [`super::EvictionMode::Attention`]: its last read with at least
//!   the threshold mass, plus `mass_weight` times its decayed mass over the largest, and no
//!   priority scaling for a block unread for the eviction window; see `core/evict.rs`). Its
//!   value in a tier is that weight times what leaving the tier would cost per byte: warming it
//!   back from cold, reading it back from the shadow (blocks of a recorded session chain, when the
//!   shadow is on), or recomputing its tokens. Pinned blocks, blocks a sequence attends and
//!   blocks moved within `cooldown_cycles` are protected. Values are then made monotone along
//!   every session chain (a block is worth at least what any later block of its chain is worth,
//!   and a protected later block protects it), and ties go to the later position first: every
//!   demotion is prefix-closed — a chain never keeps a later block in a faster tier than an
//!   earlier one because of the bridge.
//! - **Decide**: hot fill (of its budget) above `hot_high` → spill the least valuable hot blocks
//!   over the budget, then stage the next ones (copy them to free cold slots, keeping them hot:
//!   admission's spill then takes the copy) until the hot blocks not staged are at
//!   `hot_target`. It stages in admission's own eviction order
//!   ([`EngineCore::admission_order`]), so that the blocks the next admissions evict are the
//!   ones with a copy. With `stage` off, it spills them until the hot tier is at `hot_target`.
//!   Otherwise, hot fill below `warm_below` → warm the cold blocks of the sessions the caller
//!   names active (their recorded chains, leading blocks first,
//!   a chain stopping at its first block in cooldown) while the hot tier stays under
//!   `hot_target`; cold fill above `cold_high` → remove the least valuable cold blocks until it is
//!   at `cold_target` (the shadow still holds them on disk; with down-tiering on they are
//!   re-encoded into the reduced pool instead, as far as it has room).
//! - **Act** through kvcore (spill, warm, and dropping from the cache). Every tier move is
//!   stamped with the cycle ([`engram_kvcore::BlockMeta::moved_epoch`]): at most one move by the
//!   bridge per block per `cooldown_cycles`.
//!
//! Feedback moves the thresholds both ways, from what the bridge's own moves turned out to be
//! worth within [`REVIEW_CYCLES`]: a spilled block that a turn needed again (warmed back) is a
//! regret → demote later (`hot_high` up); admissions that found the hot tier full and had to
//! evict, other than onto a staged copy (which costs the turn nothing) → demote sooner
//! (`hot_high` down); a crowded cold tier (> 80 %) also demotes later.
//! Warmed blocks a turn then read → promote sooner (`warm_below` up); warmed blocks left unread
//! or moved away → promote later (`warm_below` down); an emptier cold tier (< 50 %) with no
//! wasted warm promotes sooner. With `adapt` on they are applied, clamped to the bounds.

use std::collections::{HashMap, HashSet};

use engram_kvcore::{BlockId, PinState, Tier};
use serde::{Deserialize, Serialize};

use super::evict::EvictionMode;
use super::{ChainKey, EngineCore};
use crate::error::{EngineError, EngineResult};

/// Cycles after a bridge move within which its outcome is judged (a regret or a waste).
pub const REVIEW_CYCLES: u64 = 10;

/// A block's tier move within this many cycles of its previous one is a quick move (a flip),
/// counted in [`EngineCore::quick_moves`].
pub const FLIP_WINDOW_CYCLES: u64 = 100;

/// What leaving a tier costs when the block is needed again: the latencies the allocator weighs
/// per byte (defaults measured on the 2-vCPU reference machine with SmolLM2-135M; see
/// docs/kv-cache.md).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct TierCosts {
    /// Warming a block back from the cold tier, ns per byte.
    pub cold_ns_per_byte: f64,
    /// Reading a block back from the shadow on a miss, ns per byte; 0 when there is no shadow
    /// (a dropped block is then recomputed).
    pub disk_ns_per_byte: f64,
    /// Recomputing a block by prefill, ns per token.
    pub recompute_ns_per_token: f64,
}

impl Default for TierCosts {
    fn default() -> Self {
        Self {
            cold_ns_per_byte: 0.2,
            disk_ns_per_byte: 15.0,
            recompute_ns_per_token: 8.0e6,
        }
    }
}

/// Thresholds, budgets and weights of the tier bridge (shares are of a tier's budget).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// Bytes of the hot tier the bridge manages to (0: the whole tier). Admission may still
    /// fill the tier to its capacity; the bridge brings it back under the budget.
    pub hot_budget_bytes: u64,
    /// Bytes of the cold tier the bridge manages to (0: the whole tier).
    pub cold_budget_bytes: u64,
    /// Cycles a block stays where a tier move put it before the bridge moves it again (a turn
    /// that needs a block warms it whatever its cooldown).
    pub cooldown_cycles: u64,
    /// Restore latencies the values weigh.
    pub costs: TierCosts,
    /// Spill ahead by staging: above `hot_high` the least valuable hot blocks are copied to
    /// free cold slots and stay hot until admission wants their room (then their spill takes
    /// the copy, nothing copied); only blocks over the hot budget itself are spilled. Off, they
    /// are spilled down to `hot_target` (the turns that need them find them cold). See
    /// `engram_kvcore::BlockStore::stage`.
    pub stage: bool,
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
            hot_budget_bytes: 0,
            cold_budget_bytes: 0,
            cooldown_cycles: 100,
            costs: TierCosts::default(),
            stage: true,
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
        for (field, c) in [
            ("costs.cold_ns_per_byte", self.costs.cold_ns_per_byte),
            ("costs.disk_ns_per_byte", self.costs.disk_ns_per_byte),
            (
                "costs.recompute_ns_per_token",
                self.costs.recompute_ns_per_token,
            ),
        ] {
            if !(c >= 0.0 && c.is_finite()) {
                return bad(field, "must be a finite latency ≥ 0");
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TierObservation {
    /// Hot blocks in use.
    pub hot_used: usize,
    /// Hot capacity.
    pub hot_capacity: usize,
    /// Hot blocks the budget allows (the capacity without a budget).
    #[serde(default)]
    pub hot_budget: usize,
    /// Cold blocks in use.
    pub cold_used: usize,
    /// Cold capacity.
    pub cold_capacity: usize,
    /// Cold blocks the budget allows (the capacity without a budget).
    #[serde(default)]
    pub cold_budget: usize,
    /// Cached blocks no running sequence attends (the movable ones).
    pub idle_cached: usize,
    /// Of those, the ones in cooldown (moved within `cooldown_cycles`).
    #[serde(default)]
    pub cooling: usize,
    /// Sessions the caller named active.
    pub active_sessions: usize,
    /// Cold blocks of those sessions' chains.
    pub active_cold_blocks: usize,
    /// Live reservations.
    pub reservations: usize,
    /// Tier moves of every block so far (the bridge's, the turns', the evictions'), counting
    /// blocks that left the cache.
    #[serde(default)]
    pub tier_moves: u64,
    /// Of those, moves of a block within [`FLIP_WINDOW_CYCLES`] of its previous move.
    #[serde(default)]
    pub quick_moves: u64,
}

/// What the bridge's earlier moves turned out to be worth (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MoveReview {
    /// Spilled blocks a turn warmed back within the review window.
    pub spill_regrets: usize,
    /// Warmed blocks attention read afterwards.
    pub warms_used: usize,
    /// Warmed blocks left unread, or moved away before a read.
    pub warms_wasted: usize,
    /// Hot blocks evicted at admission since the last cycle.
    pub admission_evictions: u64,
    /// Of those, spills onto a copy the bridge had staged (nothing copied on the turn's path).
    #[serde(default)]
    pub admission_staged: u64,
}

/// What a cycle did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CycleReport {
    /// The cycle's number (the epoch its moves carry).
    #[serde(default)]
    pub cycle: u64,
    /// The observation.
    pub observed: TierObservation,
    /// `hot_high` and `warm_below` in force for this cycle.
    pub thresholds: [f64; 2],
    /// The threshold moves the feedback suggests: `demote_later` or `demote_sooner` (`hot_high`
    /// up or down), `promote_sooner` or `promote_later` (`warm_below` up or down).
    pub suggestions: Vec<String>,
    /// The review behind them.
    #[serde(default)]
    pub review: MoveReview,
    /// Blocks spilled hot → cold.
    pub spilled: usize,
    /// Blocks staged: copied to the cold tier, still hot (`TierPolicy::stage`).
    #[serde(default)]
    pub staged: usize,
    /// Blocks warmed cold → hot.
    pub warmed: usize,
    /// Blocks removed from the cold tier (and the cache); with down-tiering on, the blocks that
    /// left the cache to make room (cold blocks the reduced pool could not take, or down-tiered
    /// blocks dropped for more valuable ones); the blocks down-tiered are counted in
    /// `CacheCounters::down_tiered`.
    pub removed: usize,
}

/// A move of the bridge under review.
#[derive(Debug, Clone, Copy)]
struct BridgeMove {
    cycle: u64,
    warm: bool,
    /// The block's tier moves right after this one.
    moves: u32,
    /// Its last attention tick right after it.
    attended: u64,
}

/// The bridge's memory between cycles (kept by the engine).
#[derive(Debug, Default)]
pub(super) struct BridgeState {
    cycle: u64,
    under_review: HashMap<BlockId, BridgeMove>,
    admission_evictions_seen: u64,
    admission_staged_seen: u64,
}

/// Blocks that may not be demoted at all.
const PROTECTED: f64 = f64::INFINITY;

/// The threshold moves a review suggests (see the module docs); `cold_fill` is the cold tier's
/// fill of its budget (`None` without a cold tier).
fn suggest(review: &MoveReview, cold_fill: Option<f64>) -> Vec<String> {
    let crowded = cold_fill.is_some_and(|f| f > 0.8);
    let roomy = cold_fill.is_some_and(|f| f < 0.5);
    let pressure = review
        .admission_evictions
        .saturating_sub(review.admission_staged);
    let regrets = review.spill_regrets;
    let mut out = Vec::new();
    if (regrets > 0 || crowded) && pressure == 0 {
        out.push("demote_later".to_owned());
    } else if pressure > 0 && regrets == 0 && !crowded {
        out.push("demote_sooner".to_owned());
    }
    if review.warms_wasted > review.warms_used {
        out.push("promote_later".to_owned());
    } else if review.warms_used > review.warms_wasted || roomy {
        out.push("promote_sooner".to_owned());
    }
    out
}

/// Applies suggestions to `policy`, one step each, within its bounds (`hot_high` never below
/// `hot_target`, `warm_below` never above it).
fn adapt(policy: &mut TierPolicy, suggestions: &[String]) {
    for s in suggestions {
        match s.as_str() {
            "demote_later" => policy.hot_high += 0.02,
            "demote_sooner" => policy.hot_high -= 0.02,
            "promote_sooner" => policy.warm_below += 0.05,
            "promote_later" => policy.warm_below -= 0.05,
            _ => {}
        }
    }
    policy.hot_high = policy
        .hot_high
        .clamp(policy.hot_high_bounds[0], policy.hot_high_bounds[1])
        .max(policy.hot_target);
    policy.warm_below = policy
        .warm_below
        .clamp(policy.warm_below_bounds[0], policy.warm_below_bounds[1])
        .min(policy.hot_target);
}

impl EngineCore {
    /// Tier moves of every block so far: the store's (spill, warm, removal, readmission,
    /// down-tiering) plus the blocks dropped from the cache (a hot block removed at admission
    /// counts twice: an upper bound).
    pub fn tier_moves(&self) -> u64 {
        self.store.metadata().tier_moves() + self.counters.dropped.values().sum::<u64>()
    }

    /// Tier moves of a block within [`FLIP_WINDOW_CYCLES`] of its previous move, so far (every
    /// mover's: the bridge's, the turns', admission's).
    pub fn quick_moves(&self) -> u64 {
        self.store.metadata().quick_moves()
    }

    /// What staged spills have done so far (see [`TierPolicy::stage`]).
    pub fn stage_stats(&self) -> engram_kvcore::StageStats {
        self.store.stage_stats()
    }

    /// Judges the bridge's moves of earlier cycles (see the module docs).
    fn review_moves(&mut self, cycle: u64) -> MoveReview {
        let mut review = MoveReview::default();
        let meta = self.store.metadata();
        self.bridge.under_review.retain(|&id, mv| {
            let Some(m) = meta.get(id) else {
                return false;
            };
            let moved_since = m.moves() > mv.moves;
            let expired = cycle.saturating_sub(mv.cycle) > REVIEW_CYCLES;
            if mv.warm {
                if m.last_attended() > mv.attended && !moved_since {
                    review.warms_used += 1;
                    false
                } else if moved_since || expired {
                    review.warms_wasted += 1;
                    false
                } else {
                    true
                }
            } else if moved_since && m.tier() == Tier::Hot {
                review.spill_regrets += 1;
                false
            } else {
                !(moved_since || expired)
            }
        });
        let evictions = self.counters.admission_evictions;
        review.admission_evictions = evictions - self.bridge.admission_evictions_seen;
        self.bridge.admission_evictions_seen = evictions;
        let staged = self.counters.admission_staged;
        review.admission_staged = staged - self.bridge.admission_staged_seen;
        self.bridge.admission_staged_seen = staged;
        review
    }

    /// Puts the bridge's moves of this cycle under review.
    fn note_bridge_moves(&mut self, ids: &[BlockId], cycle: u64, warm: bool) {
        for &id in ids {
            if let Some(m) = self.store.metadata().get(id) {
                let mv = BridgeMove {
                    cycle,
                    warm,
                    moves: m.moves(),
                    attended: m.last_attended(),
                };
                self.bridge.under_review.insert(id, mv);
            }
        }
    }

    /// The blocks of every recorded session chain that are cached, leading blocks first (each
    /// chain up to its first block no longer cached).
    pub(super) fn cached_chains(&self) -> Vec<Vec<BlockId>> {
        self.chains
            .by_key
            .values()
            .map(|chain| {
                chain
                    .hashes
                    .iter()
                    .map_while(|h| self.cache.get(h))
                    .collect()
            })
            .collect()
    }

    /// Runs one observe–orient–decide–act cycle (see the module docs). `active` names the
    /// sessions whose blocks should be hot; `policy` may be adapted in place.
    pub fn tier_cycle(
        &mut self,
        policy: &mut TierPolicy,
        active: &[ChainKey],
    ) -> EngineResult<CycleReport> {
        self.bridge.cycle += 1;
        let cycle = self.bridge.cycle;
        self.store.set_epoch(cycle);
        let review = self.review_moves(cycle);
        // Observe.
        let busy: HashSet<BlockId> = self
            .seqs
            .values()
            .flat_map(|s| s.blocks.iter().copied())
            .collect();
        let occ = self.occupancy();
        let block_bytes = occ.block_bytes.max(1) as u64;
        let budget = |bytes: u64, cap: usize| {
            if bytes == 0 {
                cap
            } else {
                usize::try_from(bytes / block_bytes).map_or(cap, |b| b.min(cap))
            }
        };
        let hot_budget = budget(policy.hot_budget_bytes, occ.hot_capacity);
        let cold_budget = budget(policy.cold_budget_bytes, occ.cold_capacity);
        let cooling = |moves: u32, moved: u64| {
            moves > 0 && cycle.saturating_sub(moved) < policy.cooldown_cycles
        };
        let metas: Vec<_> = self
            .cache
            .blocks()
            .filter(|id| !busy.contains(id))
            .filter_map(|id| self.store.metadata().get(id))
            .filter(|m| m.tier() != Tier::Recompute)
            .collect();
        let chains = self.cached_chains();
        let chained: HashSet<BlockId> = chains.iter().flatten().copied().collect();
        let mut active_cold = Vec::new();
        for key in active {
            if let Some(chain) = self.chains.by_key.get(key) {
                for h in &chain.hashes {
                    let Some(id) = self.cache.get(h) else {
                        break;
                    };
                    let Some(m) = self.store.metadata().get(id) else {
                        break;
                    };
                    if m.tier() == Tier::Cold {
                        // Prefix-closed: the chain's warming stops at a block in cooldown.
                        if cooling(m.moves(), m.moved_epoch()) {
                            break;
                        }
                        active_cold.push(id);
                    }
                }
            }
        }
        let in_cooldown = metas
            .iter()
            .filter(|m| cooling(m.moves(), m.moved_epoch()))
            .count();
        let observed = TierObservation {
            hot_used: occ.hot_used,
            hot_capacity: occ.hot_capacity,
            hot_budget,
            cold_used: occ.cold_used,
            cold_capacity: occ.cold_capacity,
            cold_budget,
            idle_cached: metas.len(),
            cooling: in_cooldown,
            active_sessions: active.len(),
            active_cold_blocks: active_cold.len(),
            reservations: self.reservations.live_count(),
            tier_moves: self.tier_moves(),
            quick_moves: self.quick_moves(),
        };
        // Orient: the weight of every idle block, then its value in its tier.
        let max_attended = metas.iter().map(|m| m.attended()).max().unwrap_or(1).max(1);
        let (lo, hi) = metas.iter().fold((u64::MAX, 0u64), |(lo, hi), m| {
            (lo.min(m.last_attended()), hi.max(m.last_attended()))
        });
        let span = hi.saturating_sub(lo).max(1) as f64;
        let denom = (1.0 + max_attended as f64).ln();
        // Attention-aware: recency is that of the last read above the mass threshold, the
        // decayed mass weighs in, and a block unread for the eviction window loses its
        // priority's scaling (see core/evict.rs).
        let eviction = self.config.eviction;
        let attention = eviction.mode == EvictionMode::Attention;
        let (read_lo, read_hi) = metas.iter().fold((u64::MAX, 0u64), |(lo, hi), m| {
            (lo.min(m.read_step()), hi.max(m.read_step()))
        });
        let read_span = read_hi.saturating_sub(read_lo).max(1) as f64;
        let max_mass = metas
            .iter()
            .map(|m| f64::from(m.mass()))
            .fold(0.0f64, f64::max);
        let costs = policy.costs;
        let mut value: HashMap<BlockId, (Tier, f64, u32)> = HashMap::new();
        for m in &metas {
            let protected = m.pin() == PinState::Pinned || cooling(m.moves(), m.moved_epoch());
            let f = (1.0 + m.attended() as f64).ln() / denom;
            let (r, mass, priority) = if attention {
                let r = m.read_step().saturating_sub(read_lo) as f64 / read_span;
                let mass = if max_mass > 0.0 {
                    eviction.mass_weight * f64::from(m.mass()) / max_mass
                } else {
                    0.0
                };
                let priority = if self.unread(m) { 0 } else { m.priority() };
                (r, mass, priority)
            } else {
                let r = m.last_attended().saturating_sub(lo) as f64 / span;
                (r, 0.0, m.priority())
            };
            let score = policy.w_frequency * f
                + policy.w_recency * r
                + policy.w_importance * m.importance() as f64
                + mass;
            // A floor so that a block never read still weighs its restore cost, and the
            // eviction priority scaling it (a higher layer priority survives longer).
            let weight = (score + 0.01) * (1.0 + f64::from(priority) / 100.0);
            let per_byte = match m.tier() {
                Tier::Hot => costs.cold_ns_per_byte,
                _ if costs.disk_ns_per_byte > 0.0 && chained.contains(&m.id()) => {
                    costs.disk_ns_per_byte
                }
                _ => {
                    let tokens = f64::from(m.tokens().end.saturating_sub(m.tokens().start));
                    costs.recompute_ns_per_token * tokens.max(1.0) / block_bytes as f64
                }
            };
            let v = if protected {
                PROTECTED
            } else {
                weight * per_byte.max(f64::MIN_POSITIVE)
            };
            value.insert(m.id(), (m.tier(), v, m.tokens().start));
        }
        let hot_order = self.demotion_order(&value, &chains, &busy, Tier::Hot);
        let share = |used: usize, cap: usize| {
            if cap == 0 {
                0.0
            } else {
                used as f64 / cap as f64
            }
        };
        let mut report = CycleReport {
            cycle,
            observed,
            thresholds: [policy.hot_high, policy.warm_below],
            review,
            ..CycleReport::default()
        };
        // Decide and act.
        let hot_fill = share(occ.hot_used, hot_budget);
        let target_hot = (policy.hot_target * hot_budget as f64).floor() as usize;
        if hot_fill > policy.hot_high {
            // Staging spills now only what is over the budget itself; spilling ahead, down to
            // the target.
            let floor = if policy.stage {
                hot_budget.max(target_hot)
            } else {
                target_hot
            };
            let want = occ.hot_used.saturating_sub(floor).min(policy.max_moves);
            let victims: Vec<BlockId> = hot_order.into_iter().take(want).collect();
            if !victims.is_empty() {
                // Cold room for them, out of the least valuable cold blocks (prefix-closed too).
                let short = victims
                    .len()
                    .saturating_sub(self.store.free_blocks(Tier::Cold));
                if short > 0 {
                    let cold = self.removable_cold(&value, &chains, &busy);
                    report.removed += self.remove_cold(cold, short)?;
                }
                let room = self.store.free_blocks(Tier::Cold).min(victims.len());
                // The victims come latest position first: any leading part keeps chains
                // prefix-closed.
                self.store.spill(&victims[..room])?;
                for &id in &victims[..room] {
                    if let Some(m) = self.store.metadata().get(id) {
                        *self.counters.spilled.entry(m.source()).or_default() += 1;
                    }
                }
                self.note_bridge_moves(&victims[..room], cycle, false);
                report.spilled = room;
                self.enforce_cold_quotas()?;
            }
            if policy.stage {
                // Copies ahead, into free cold slots only (a cold block is worth more than a
                // copy), until the hot blocks not staged are at the target.
                let hot = occ.hot_used.saturating_sub(report.spilled);
                let want = hot
                    .saturating_sub(self.store.stage_stats().staged)
                    .saturating_sub(target_hot)
                    .min(policy.max_moves.saturating_sub(report.spilled));
                if want > 0 {
                    // In admission's eviction order: the copies are what its next spills take.
                    let victims: Vec<BlockId> = self
                        .admission_order()
                        .into_iter()
                        .filter(|&id| !self.store.is_staged(id))
                        .take(want)
                        .collect();
                    report.staged = self.store.stage(&victims)?.len();
                }
            }
        } else if hot_fill < policy.warm_below && !active_cold.is_empty() {
            let room = target_hot
                .saturating_sub(occ.hot_used)
                .min(self.store.free_blocks(Tier::Hot))
                .min(policy.max_moves);
            let mut seen = HashSet::new();
            active_cold.retain(|id| seen.insert(*id));
            active_cold.truncate(room);
            self.store.warm(&active_cold)?;
            self.note_bridge_moves(&active_cold, cycle, true);
            report.warmed = active_cold.len();
        }
        let occ = self.occupancy();
        if share(occ.cold_used, cold_budget) > policy.cold_high {
            let target = (policy.cold_target * cold_budget as f64).floor() as usize;
            let want = occ.cold_used.saturating_sub(target).min(policy.max_moves);
            // Blocks this cycle moved are where they are now, and in cooldown.
            for (id, entry) in value.iter_mut() {
                if let Some(m) = self.store.metadata().get(*id)
                    && m.tier() != entry.0
                {
                    entry.0 = m.tier();
                    if cooling(m.moves(), m.moved_epoch()) {
                        entry.1 = PROTECTED;
                    }
                }
            }
            let cold = self.removable_cold(&value, &chains, &busy);
            report.removed += self.remove_cold(cold, want)?;
        }
        // Feedback, both ways.
        let cold_fill = (occ.cold_capacity > 0).then(|| share(occ.cold_used, cold_budget));
        report.suggestions = suggest(&review, cold_fill);
        if policy.adapt {
            adapt(policy, &report.suggestions);
        }
        Ok(report)
    }

    /// The cold blocks the bridge may drop (only the cache holds them), in demotion order.
    fn removable_cold(
        &self,
        value: &HashMap<BlockId, (Tier, f64, u32)>,
        chains: &[Vec<BlockId>],
        busy: &HashSet<BlockId>,
    ) -> Vec<BlockId> {
        self.demotion_order(value, chains, busy, Tier::Cold)
            .into_iter()
            .filter(|&id| {
                self.store
                    .metadata()
                    .get(id)
                    .map(|m| (m.tier(), m.ref_count()))
                    == Some((Tier::Cold, 1))
            })
            .collect()
    }

    /// Frees `want` cold slots out of `victims` (in order): dropped from the cache, or with
    /// down-tiering on re-encoded into the reduced pool as far as it has room. Returns the
    /// blocks that left the cache.
    fn remove_cold(&mut self, victims: Vec<BlockId>, want: usize) -> EngineResult<usize> {
        if self.store.reduced_capacity() > 0 {
            return self.down_tier(victims, want);
        }
        let n = victims.len().min(want);
        for &id in victims.iter().take(n) {
            self.drop_cached(id)?;
        }
        Ok(n)
    }

    /// The idle blocks of `tier` the bridge may demote, least valuable first, so that taking
    /// any leading part of the order keeps every chain prefix-closed: values are made monotone
    /// backwards along each chain (a block weighs at least what any later block of its chain
    /// in the same tier or a faster one weighs; a later block the bridge may not move — pinned,
    /// cooling, attended, or in a faster tier — protects it), and ties go to the later
    /// position first.
    fn demotion_order(
        &self,
        value: &HashMap<BlockId, (Tier, f64, u32)>,
        chains: &[Vec<BlockId>],
        busy: &HashSet<BlockId>,
        tier: Tier,
    ) -> Vec<BlockId> {
        let faster = |t: Tier| t == Tier::Hot && tier == Tier::Cold;
        let own = |id: &BlockId| -> f64 {
            if busy.contains(id) {
                return PROTECTED;
            }
            match value.get(id) {
                Some(&(t, v, _)) if t == tier => v,
                Some(&(t, _, _)) if faster(t) => PROTECTED,
                // Slower tiers, and blocks the cache no longer holds: nothing to protect.
                _ => 0.0,
            }
        };
        let mut effective: HashMap<BlockId, f64> = HashMap::new();
        for chain in chains {
            let mut later = 0.0f64;
            for id in chain.iter().rev() {
                later = later.max(own(id));
                let e = effective.entry(*id).or_insert(0.0);
                *e = e.max(later);
            }
        }
        let mut order: Vec<(f64, u32, BlockId)> = value
            .iter()
            .filter(|(_, (t, _, _))| *t == tier)
            .map(|(&id, &(_, v, start))| {
                let e = effective.get(&id).copied().unwrap_or(0.0).max(v);
                (e, start, id)
            })
            .filter(|(e, _, _)| e.is_finite())
            .collect();
        order.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)).then(a.2.cmp(&b.2)));
        order.into_iter().map(|(_, _, id)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(regrets: usize, used: usize, wasted: usize, evictions: u64) -> MoveReview {
        MoveReview {
            spill_regrets: regrets,
            warms_used: used,
            warms_wasted: wasted,
            admission_evictions: evictions,
            admission_staged: 0,
        }
    }

    #[test]
    fn feedback_moves_each_threshold_both_ways() {
        let mut p = TierPolicy::default();
        let (high, warm) = (p.hot_high, p.warm_below);
        // Spilled blocks needed again, no admission pressure: demote later.
        let s = suggest(&review(3, 0, 0, 0), Some(0.6));
        assert_eq!(s, ["demote_later"]);
        adapt(&mut p, &s);
        assert!(p.hot_high > high);
        // Admissions had to evict and no spill was regretted: demote sooner, back down.
        let s = suggest(&review(0, 0, 0, 5), Some(0.6));
        assert_eq!(s, ["demote_sooner"]);
        adapt(&mut p, &s);
        adapt(&mut p, &s);
        assert!(p.hot_high < high);
        // Evictions that all spilled onto staged copies are no pressure.
        let staged = MoveReview {
            admission_staged: 5,
            ..review(0, 0, 0, 5)
        };
        assert!(suggest(&staged, Some(0.6)).is_empty());
        let partly = MoveReview {
            admission_staged: 3,
            ..review(0, 0, 0, 5)
        };
        assert_eq!(suggest(&partly, Some(0.6)), ["demote_sooner"]);
        // Both signals at once cancel out.
        assert!(suggest(&review(2, 0, 0, 2), Some(0.6)).is_empty());
        // A crowded cold tier demotes later even without a regret.
        assert_eq!(suggest(&review(0, 0, 0, 0), Some(0.9)), ["demote_later"]);
        // Warmed blocks read: promote sooner; left unread: promote later.
        let s = suggest(&review(0, 4, 1, 0), Some(0.6));
        assert_eq!(s, ["promote_sooner"]);
        adapt(&mut p, &s);
        assert!(p.warm_below > warm);
        let s = suggest(&review(0, 1, 4, 0), Some(0.6));
        assert_eq!(s, ["promote_later"]);
        adapt(&mut p, &s);
        adapt(&mut p, &s);
        assert!(p.warm_below < warm);
        // An emptier cold tier promotes sooner unless warms were wasted.
        assert_eq!(suggest(&review(0, 0, 0, 0), Some(0.2)), ["promote_sooner"]);
        assert_eq!(suggest(&review(0, 0, 1, 0), Some(0.2)), ["promote_later"]);
        assert!(suggest(&review(0, 0, 0, 0), None).is_empty());
    }

    #[test]
    fn adapted_thresholds_stay_within_bounds() {
        let mut p = TierPolicy::default();
        for _ in 0..100 {
            adapt(&mut p, &["demote_sooner".into(), "promote_sooner".into()]);
        }
        assert!((p.hot_high - p.hot_high_bounds[0].max(p.hot_target)).abs() < 1e-9);
        assert!(p.warm_below <= p.warm_below_bounds[1].min(p.hot_target) + 1e-9);
        for _ in 0..100 {
            adapt(&mut p, &["demote_later".into(), "promote_later".into()]);
        }
        assert!((p.hot_high - p.hot_high_bounds[1]).abs() < 1e-9);
        assert!((p.warm_below - p.warm_below_bounds[0]).abs() < 1e-9);
    }
}
