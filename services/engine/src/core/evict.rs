//! Which idle hot blocks leave first when a turn needs room: by priority alone (kvcore's
//! [`engram_kvcore::BlockStore::eviction_order`]), or by what the model reads.
//!
//! **Attention-aware** ranking ([`EvictionMode::Attention`], the default): every idle hot block
//! gets a key `(band, heat)`:
//! - `band` is its eviction priority (999 pinned), except that an unpinned block the model has
//!   not read for `idle_steps` sampled decode steps (no step gave it at least the threshold
//!   mass: [`engram_kvcore::BlockMeta::read_step`]) falls to band 0 — a high semantic priority
//!   does not keep a block hot that nothing reads. Such a block is *demoted*: it may be spilled
//!   to the cold tier but is not dropped to make room.
//! - `heat = mass_weight · m + recency_weight · r + frequency_weight · f + use_weight · u`,
//!   where `m` is its decayed attention mass over the largest among the candidates, `r` its
//!   last read as a share of the candidates' span of reads (1 = the latest), `f = ln(1 + reads)
//!   / ln(1 + most reads)`, `reads` counting the steps that gave it at least the threshold mass
//!   ([`engram_kvcore::BlockMeta::reads`]): blocks the model reads often and lately stay; and
//!   `u = ln(1 + attended) / ln(1 + most attended)`, `attended` counting the steps a running
//!   sequence held it whatever its mass ([`engram_kvcore::BlockMeta::attended`]): how often its
//!   chain runs. A reused prefix is needed whole, whatever mass each of its blocks gets, and a
//!   block in the middle of a long prefix seldom gets half a uniform share, so its `reads` stay
//!   near zero however busy its chain; `attended` sees the chain's use. Both counts outlive a
//!   block: a block computed again under the hash of one the cache dropped starts with that
//!   one's counts ([`crate::prefix::ReadHistory`]), so the stable prefix of an agent that runs
//!   often keeps its frequency from one conversation to the next, and an occasional agent's
//!   fresh prefix does not look as worth keeping as a busy agent's.
//!
//! Keys are then made monotone along every cached session chain (a block is worth at least
//! what any later hot block of its chain is worth: a running sequence's blocks are worth the
//! most), so the chain loses its hot blocks from the end and a prefix never has a hole because
//! of eviction. Victims go in ascending key order, later positions first among equals.
//! With `whole_chains`, every block of a chain is also worth at least what the chain's most
//! valuable block is worth (a pinned block in its priority's band, not the pinned one): chains
//! rank as wholes (by their prefix, as a rule), and the least valuable ones lose blocks first,
//! from their ends.
//!
//! The same keys order the cold tier's drops when it must make room ([`EngineCore::rank_cold`]:
//! heat normalized over every resident block, lifted along the chains, over-quota tenants'
//! blocks first): a dropped block is recomputed, so there the policy decides misses.
//!
//! Cost: O(hot blocks + cached chain blocks), plus the sort.

use std::collections::{HashMap, HashSet};

use engram_kvcore::{BlockId, PINNED_PRIORITY, PinState, Tier};
use serde::{Deserialize, Serialize};

use super::EngineCore;
use crate::error::{EngineError, EngineResult};

/// How idle hot blocks are ranked for eviction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionMode {
    /// (pinned, priority, last touched, age): kvcore's rule, blind to what attention read.
    Priority,
    /// Priority bands with demotion of unread blocks, attention mass and read recency within a
    /// band, monotone along session chains (see the module docs).
    #[default]
    Attention,
}

impl EvictionMode {
    /// `priority` or `attention`.
    pub fn parse(s: &str) -> EngineResult<Self> {
        match s.trim() {
            "priority" => Ok(Self::Priority),
            "attention" => Ok(Self::Attention),
            other => Err(EngineError::InvalidConfig {
                field: "eviction.mode",
                reason: format!("unknown mode `{other}` (priority, attention)"),
            }),
        }
    }
}

/// Weights of attention-aware eviction (used by admission's evictions and the tier bridge).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EvictionPolicy {
    /// The ranking.
    pub mode: EvictionMode,
    /// Weight of the block's attention mass in its heat.
    pub mass_weight: f64,
    /// Weight of how recently the model read it.
    pub recency_weight: f64,
    /// Weight of how often the model read it (steps that gave it at least the threshold
    /// mass, on a log scale).
    pub frequency_weight: f64,
    /// Weight of how often running sequences held it (steps that attended it whatever its
    /// mass, on a log scale): how often its chain runs.
    pub use_weight: f64,
    /// Sampled decode steps without a read after which an unpinned block is demoted to the
    /// lowest band (0: never).
    pub idle_steps: u64,
    /// Sampled steps after which every count the ranking weighs (`reads`, `attended`, live
    /// and carried) is halved (0: never): an agent that was busy long ago and is idle now does
    /// not keep its chain hot on old counts against one that is busy now.
    pub use_half_life: u64,
    /// Rank whole chains: every block of a cached session chain is worth at least what the
    /// chain's most valuable block is worth (its stable prefix, as a rule; a pinned block
    /// counted in its priority's band, not the pinned one), so a conversation's blocks rank
    /// with its agent's prefix instead of below every prefix, and the least valuable chains
    /// lose blocks first, from their ends, before a busier chain loses any. Off: a block is
    /// worth at least what later blocks of its chain are worth, no more.
    pub whole_chains: bool,
}

impl Default for EvictionPolicy {
    fn default() -> Self {
        Self {
            mode: EvictionMode::Attention,
            // Chosen by `engram-bench eviction` (benches/results/2026-11-29-eviction-use/ in git history, f74a4d2): with
            // counts carried across a block's lives, how often a chain runs decides best; the
            // mass-threshold read count adds nothing beside it.
            mass_weight: 0.1,
            recency_weight: 0.1,
            frequency_weight: 0.0,
            use_weight: 0.8,
            idle_steps: 512,
            // Long beside a turn (tens of sampled steps): counts age over thousands of turns.
            use_half_life: 65_536,
            // Chosen by `engram-bench eviction` (benches/results/2026-11-29-eviction-on-arrival/,
            // `…-whole-chains/`): with a bounded cold tier, TTFT p50 0.17× priority-only's and
            // more blocks hot on arrival; with the default cold tier, the best hot hit rate.
            whole_chains: true,
        }
    }
}

impl EvictionPolicy {
    /// Checks the weights (finite, ≥ 0).
    pub fn validate(&self) -> EngineResult<()> {
        for (field, w) in [
            ("eviction.mass_weight", self.mass_weight),
            ("eviction.recency_weight", self.recency_weight),
            ("eviction.frequency_weight", self.frequency_weight),
            ("eviction.use_weight", self.use_weight),
        ] {
            if !(w >= 0.0 && w.is_finite()) {
                return Err(EngineError::InvalidConfig {
                    field,
                    reason: "must be a finite weight ≥ 0".into(),
                });
            }
        }
        Ok(())
    }
}

/// A block's rank key: (band, heat); higher survives longer.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd)]
struct Key(u16, f64);

impl Key {
    const LOWEST: Self = Self(0, f64::NEG_INFINITY);
    const BUSY: Self = Self(u16::MAX, f64::INFINITY);

    fn max(self, other: Self) -> Self {
        if other.0 > self.0 || (other.0 == self.0 && other.1 > self.1) {
            other
        } else {
            self
        }
    }
}

/// The idle hot blocks in attention-aware eviction order, and those demoted (unread for the
/// policy's window: spill only).
pub(super) struct HotRanking {
    pub order: Vec<BlockId>,
    pub demoted: HashSet<BlockId>,
}

impl EngineCore {
    /// Halves the ranking's counts (live blocks' and the carried history's) once
    /// `use_half_life` sampled steps have passed since the last halving; attention-aware
    /// eviction only (priority-only weighs no counts and carries none). Called after every
    /// forward pass.
    pub(super) fn age_counts(&mut self) {
        let half_life = self.config.eviction.use_half_life;
        if half_life == 0 || self.config.eviction.mode != EvictionMode::Attention {
            return;
        }
        let steps = self.store.metadata().steps();
        if steps.saturating_sub(self.aged_at) >= half_life {
            self.store.halve_counts();
            self.history.halve();
            self.aged_at = steps;
        }
    }

    /// Whether `m` has gone unread for the policy's window (never a pinned block).
    pub(super) fn unread(&self, m: &engram_kvcore::BlockMeta) -> bool {
        let p = &self.config.eviction;
        p.idle_steps > 0
            && m.pin() != PinState::Pinned
            && self.store.metadata().steps().saturating_sub(m.read_step()) > p.idle_steps
    }

    /// The attention-aware key of each of `blocks` before chain lifting (module docs), heat
    /// normalized over `blocks`; and which of them are unread for the policy's window.
    fn heat_keys(
        &self,
        blocks: &[&engram_kvcore::BlockMeta],
    ) -> (HashMap<BlockId, Key>, HashSet<BlockId>) {
        let p = self.config.eviction;
        let max_mass = blocks
            .iter()
            .map(|m| f64::from(m.mass()))
            .fold(0.0f64, f64::max);
        let (lo, hi) = blocks.iter().fold((u64::MAX, 0u64), |(lo, hi), m| {
            (lo.min(m.read_step()), hi.max(m.read_step()))
        });
        let span = hi.saturating_sub(lo).max(1) as f64;
        let max_reads = blocks.iter().map(|m| m.reads()).max().unwrap_or(0);
        let reads_denom = (1.0 + f64::from(max_reads)).ln().max(f64::MIN_POSITIVE);
        let max_attended = blocks.iter().map(|m| m.attended()).max().unwrap_or(0);
        let attended_denom = (1.0 + f64::from(max_attended)).ln().max(f64::MIN_POSITIVE);
        let mut own: HashMap<BlockId, Key> = HashMap::with_capacity(blocks.len());
        let mut unread_ids = HashSet::new();
        for m in blocks {
            let unread = self.unread(m);
            if unread {
                unread_ids.insert(m.id());
            }
            let band = if m.pin() == PinState::Pinned {
                PINNED_PRIORITY
            } else if unread {
                0
            } else {
                m.priority()
            };
            let mass = if max_mass > 0.0 {
                f64::from(m.mass()) / max_mass
            } else {
                0.0
            };
            let r = m.read_step().saturating_sub(lo) as f64 / span;
            let f = (1.0 + f64::from(m.reads())).ln() / reads_denom;
            let u = (1.0 + f64::from(m.attended())).ln() / attended_denom;
            let heat = p.mass_weight * mass
                + p.recency_weight * r
                + p.frequency_weight * f
                + p.use_weight * u;
            own.insert(m.id(), Key(band, heat));
        }
        (own, unread_ids)
    }

    /// `own` keys made monotone along every cached session chain: a block is worth at least
    /// what `key_of` says any later block of its chain is worth; with `whole_chains`, at least
    /// what the chain's most valuable block is worth too (a pinned one in its priority's band).
    fn lift_along_chains(
        &self,
        own: &HashMap<BlockId, Key>,
        key_of: impl Fn(&BlockId) -> Key,
    ) -> HashMap<BlockId, Key> {
        let mut effective = own.clone();
        let whole = self.config.eviction.whole_chains;
        let meta = self.store.metadata();
        for chain in self.cached_chains() {
            let mut later = Key::LOWEST;
            for id in chain.iter().rev() {
                later = later.max(key_of(id));
                if let Some(e) = effective.get_mut(id) {
                    *e = e.max(later);
                }
            }
            if whole {
                // The chain's worth: its most valuable block's own key, a pinned block counted
                // in its priority's band (the pinned band would lift a whole conversation
                // above every unpinned block).
                let worth = chain
                    .iter()
                    .filter_map(|id| {
                        let k = *own.get(id)?;
                        if k.0 < PINNED_PRIORITY {
                            return Some(k);
                        }
                        let band = meta.get(*id)?.priority().min(PINNED_PRIORITY - 1);
                        Some(Key(band, k.1))
                    })
                    .fold(Key::LOWEST, Key::max);
                for id in &chain {
                    if let Some(e) = effective.get_mut(id) {
                        *e = e.max(worth);
                    }
                }
            }
        }
        effective
    }

    /// The cached cold blocks among `candidates` in attention-aware drop order: keys over every
    /// resident block, lifted along the cached session chains (a block is worth at least what
    /// any later block of its chain is worth, so a chain loses its cold blocks from the end),
    /// ascending; `class` (over-quota first) before the key, later positions first among equals.
    pub(super) fn rank_cold(&self, candidates: Vec<(u8, BlockId)>) -> Vec<BlockId> {
        let meta = self.store.metadata();
        let resident: Vec<_> = meta
            .iter()
            .filter(|m| matches!(m.tier(), Tier::Hot | Tier::Cold))
            .collect();
        let (own, _) = self.heat_keys(&resident);
        let effective =
            self.lift_along_chains(&own, |id| own.get(id).copied().unwrap_or(Key::LOWEST));
        let mut ranked: Vec<(u8, Key, u32, u64, BlockId)> = candidates
            .into_iter()
            .filter_map(|(class, id)| {
                let m = meta.get(id)?;
                let k = effective.get(&id).copied().unwrap_or(Key::LOWEST);
                Some((class, k, m.tokens().start, m.created_at(), id))
            })
            .collect();
        ranked.sort_by(|a, b| {
            a.0.cmp(&b.0)
                .then(a.1.0.cmp(&b.1.0))
                .then(a.1.1.total_cmp(&b.1.1))
                .then(b.2.cmp(&a.2))
                .then(a.3.cmp(&b.3))
                .then(a.4.cmp(&b.4))
        });
        ranked.into_iter().map(|(_, _, _, _, id)| id).collect()
    }

    /// The idle hot blocks (not in `busy`) in the order admission evicts them under the
    /// configured mode: kvcore's [`engram_kvcore::BlockStore::eviction_order`] (nothing
    /// demoted) or [`Self::rank_hot`].
    pub(super) fn admission_ranking(&self, busy: &HashSet<BlockId>) -> HotRanking {
        match self.config.eviction.mode {
            EvictionMode::Priority => {
                let mut order = self.store.eviction_order();
                order.retain(|id| !busy.contains(id));
                HotRanking {
                    order,
                    demoted: HashSet::new(),
                }
            }
            EvictionMode::Attention => self.rank_hot(busy),
        }
    }

    /// The blocks running sequences attend or a relocation reads: admission never evicts them.
    pub(super) fn busy_blocks(&self) -> HashSet<BlockId> {
        self.seqs
            .values()
            .flat_map(|s| s.blocks.iter().copied())
            .chain(self.relocating.iter().copied())
            .collect()
    }

    /// The idle hot blocks in the order the next admission that needs hot room evicts them
    /// (first = evicted first), under the configured [`EvictionMode`]. The tier bridge stages
    /// copies in this order (`TierPolicy::stage`), so an admission's spills find them.
    pub fn admission_order(&self) -> Vec<BlockId> {
        self.admission_ranking(&self.busy_blocks()).order
    }

    /// Ranks the idle hot blocks (not in `busy`) by the attention-aware rule (module docs).
    pub(super) fn rank_hot(&self, busy: &HashSet<BlockId>) -> HotRanking {
        let meta = self.store.metadata();
        let idle: Vec<_> = meta
            .iter()
            .filter(|m| m.tier() == Tier::Hot && !busy.contains(&m.id()))
            .collect();
        let (own, mut demoted) = self.heat_keys(&idle);
        let key_of = |id: &BlockId| -> Key {
            if busy.contains(id) {
                return Key::BUSY;
            }
            own.get(id).copied().unwrap_or(Key::LOWEST)
        };
        let effective = self.lift_along_chains(&own, key_of);
        let mut ranked: Vec<(Key, u32, BlockId)> = idle
            .iter()
            .map(|m| {
                let k = effective.get(&m.id()).copied().unwrap_or(Key::LOWEST);
                (k, m.tokens().start, m.id())
            })
            .collect();
        ranked.sort_by(|a, b| {
            a.0.0
                .cmp(&b.0.0)
                .then(a.0.1.total_cmp(&b.0.1))
                .then(b.1.cmp(&a.1))
                .then(a.2.cmp(&b.2))
        });
        // A block a later, readable block of its chain lifted out of band 0 is not demoted.
        demoted.retain(|id| effective.get(id).is_some_and(|k| k.0 == 0));
        HotRanking {
            order: ranked.into_iter().map(|(_, _, id)| id).collect(),
            demoted,
        }
    }
}
