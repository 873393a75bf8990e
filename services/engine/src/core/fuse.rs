//! Block fusion on the serving path (issue 26; [`EngineConfig::fusion`], off by default, CPU
//! engine only).
//!
//! **When.** Only when the cold tier must make room ([`EngineCore::trim_cold_for`]): before a
//! victim is dropped (or down-tiered), the engine looks for a *partner* — a cached cold block of
//! the same tenant over the same token positions (same rotary phases), never a public block,
//! never a pinned one — whose row directions match the victim's: per layer, the mean cosine of
//! the key rows and of the value rows (keys as stored, centered by the calibrated means) must
//! both reach the current threshold. The best partner (most layers) is taken and the store
//! fuses the pair ([`engram_kvcore::BlockStore::fuse`]): the victim keeps its norms and shares
//! the partner's codes in those layers, and stays cached; the cold slots it (and a partner that
//! founds a group) held are freed. Fused blocks count against the tenant's cold quota like any
//! cold block; warming one expands it.
//!
//! **The threshold tunes itself against a KL budget.** It starts at `start_threshold`; every
//! `witness_every`-th fusion decision (and the next one when a decision could not be witnessed)
//! runs a *witness*: a session chain holding the victim and the block after it is copied into a
//! scratch store, the next block's tokens are prefilled over it twice — once as stored, once
//! with every block of the chain up to the victim that has a partner at the threshold replaced
//! by its fused form — and the mean KL(as stored ‖ fused) of those rows' next-token
//! distributions is the witness's measure. Over `kl_budget`, the victim is not fused and the
//! threshold rises by `step` (up to 1); at most half the budget, the threshold falls by `step`
//! (down to `min_threshold`). When no victim has a partner at the threshold, once per
//! room-making the engine takes the first victim that would fuse at or above `min_threshold`,
//! witnesses the highest threshold at which it would (its best partner's best layer), and moves
//! the threshold down to it if the witness stays within the budget: the threshold follows what
//! the witness allows instead of staying where it started. A witness costs two forward passes of
//! one block over the chain's context, on the turn that made room.
//!
//! **What it saves** is measured by `engram eval kv --fuse` (`services/engine/src/fusion.rs`):
//! at ΔKL ≤ 0.01 nats it found little to share on real text (1.03×), which is why fusion is
//! opt-in. Fused blocks are never written to the shadow (their bytes carry the fusion's error;
//! the shadow keeps what prefill computed), and a chain record marks them.

use std::collections::HashMap;

use candle_core::Tensor;
use engram_kvcore::{
    BlockId, BlockStore, BlockTags, KvError, PinState, Precision, SourceLayer, StoreConfig,
    TenantId, Tier, TokenRange,
};
use serde::{Deserialize, Serialize};

use super::{EngineCore, PUBLIC_TENANT};
use crate::error::{EngineError, EngineResult};
use crate::model::{KvTransform, LogitRows};
use crate::relocation::{Placement, prefill_chunks};

/// Partners compared per victim at most (the most recently created first).
pub const MAX_PARTNERS: usize = 16;

/// Block fusion's settings ([`super::EngineConfig::fusion`]; module docs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FusionPolicy {
    /// KL budget (nats) a witness may measure; over it the threshold rises.
    pub kl_budget: f64,
    /// The threshold (mean cosine of a layer's key rows and of its value rows) to start from.
    pub start_threshold: f32,
    /// The threshold never falls below this.
    pub min_threshold: f32,
    /// How far one witness moves the threshold.
    pub step: f32,
    /// One fusion decision in this many is witnessed.
    pub witness_every: u32,
    /// Bytes of the fused pool.
    pub pool_bytes: u64,
}

impl Default for FusionPolicy {
    fn default() -> Self {
        Self {
            kl_budget: 0.01,
            start_threshold: 0.98,
            min_threshold: 0.8,
            step: 0.01,
            witness_every: 8,
            pool_bytes: 256 << 20,
        }
    }
}

impl FusionPolicy {
    pub(super) fn validate(&self) -> EngineResult<()> {
        let bad = |field, reason: &str| {
            Err(EngineError::InvalidConfig {
                field,
                reason: reason.into(),
            })
        };
        if !(self.kl_budget.is_finite() && self.kl_budget > 0.0) {
            return bad("fusion.kl_budget", "must be a positive number of nats");
        }
        let cos = |t: f32| t.is_finite() && (-1.0..=1.0).contains(&t);
        if !cos(self.start_threshold) || !cos(self.min_threshold) {
            return bad(
                "fusion.start_threshold",
                "thresholds are cosines in [-1, 1]",
            );
        }
        if self.min_threshold > self.start_threshold {
            return bad("fusion.min_threshold", "must not exceed start_threshold");
        }
        if !(self.step.is_finite() && self.step > 0.0 && self.step <= 1.0) {
            return bad("fusion.step", "must be in (0, 1]");
        }
        if self.witness_every == 0 {
            return bad("fusion.witness_every", "must be at least 1");
        }
        if self.pool_bytes == 0 {
            return bad("fusion.pool_bytes", "must be at least one block");
        }
        Ok(())
    }
}

/// Where block fusion stands ([`EngineCore::fusion_status`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FusionStatus {
    /// The threshold fusion decisions use now.
    pub threshold: f32,
    /// Fusion decisions taken (a victim with a partner at the threshold).
    pub decisions: u64,
    /// Witnesses run.
    pub witnesses: u64,
    /// Decisions a witness refused (its KL over the budget).
    pub refused: u64,
    /// The last witness's KL (nats), if one ran.
    pub last_kl: Option<f64>,
    /// The highest similarity a victim without a partner at the threshold reached with a
    /// candidate in one layer (the smaller of the key and value cosines): how near the nearest
    /// miss came.
    pub nearest: Option<f32>,
    /// Blocks in the fused pool.
    pub pool_blocks: usize,
    /// Groups (shared directions) in the pool.
    pub pool_groups: usize,
    /// Bytes the pool stores.
    pub pool_bytes: usize,
    /// Bytes the pool's blocks would take in cold slots of their own.
    pub unfused_bytes: usize,
}

/// The controller's state (module docs).
#[derive(Debug, Clone, Default)]
pub(super) struct FusionState {
    /// The controller's part of the status (the pool's is read from the store).
    status: FusionStatus,
    /// A decision was due a witness that could not run; the next one runs it.
    pending: bool,
}

impl FusionState {
    pub(super) fn new(policy: Option<&FusionPolicy>) -> Self {
        Self {
            status: FusionStatus {
                threshold: policy.map_or(1.0, |p| p.start_threshold),
                ..FusionStatus::default()
            },
            pending: false,
        }
    }
}

/// Partner candidates by (tenant, token range).
type Candidates = HashMap<(TenantId, TokenRange), Vec<BlockId>>;

impl EngineCore {
    /// Block fusion's state, when it is on.
    pub fn fusion_status(&self) -> Option<FusionStatus> {
        self.config.fusion?;
        let stats = self.store.fused_stats().unwrap_or_default();
        Some(FusionStatus {
            pool_blocks: stats.blocks,
            pool_groups: stats.groups,
            pool_bytes: stats.bytes,
            unfused_bytes: stats.unfused_bytes,
            ..self.fusion.status
        })
    }

    /// Cached cold blocks that may be fusion partners (module docs), newest first per place.
    fn fusion_candidates(&self) -> Candidates {
        let mut out: Candidates = HashMap::new();
        let mut all: Vec<_> = self
            .store
            .metadata()
            .iter()
            .filter(|m| {
                m.tier() == Tier::Cold
                    && m.ref_count() == 1
                    && m.pin() != PinState::Pinned
                    && m.tenant() != PUBLIC_TENANT
                    && m.precision() != Precision::Reduced
                    && self.cache.contains_block(m.id())
                    && !self.relocating.contains(&m.id())
            })
            .map(|m| {
                (
                    std::cmp::Reverse(m.created_at()),
                    m.id(),
                    m.tenant(),
                    m.tokens(),
                )
            })
            .collect();
        all.sort_unstable_by_key(|&(created, id, _, _)| (created, id));
        for (_, id, tenant, tokens) in all {
            out.entry((tenant, tokens)).or_default().push(id);
        }
        out
    }

    /// `id`'s per-layer (key, value) similarities to its live candidates, at most
    /// [`MAX_PARTNERS`], newest first.
    fn partner_similarities(&self, id: BlockId, candidates: &Candidates) -> EngineResult<Sims> {
        let Some(m) = self.store.metadata().get(id) else {
            return Ok(Vec::new());
        };
        let Some(list) = candidates.get(&(m.tenant(), m.tokens())) else {
            return Ok(Vec::new());
        };
        // A candidate may have left since the list was made (room made for a fusion).
        let live = |p: BlockId| {
            self.store
                .metadata()
                .get(p)
                .is_some_and(|m| m.tier() == Tier::Cold && m.precision() != Precision::Reduced)
        };
        list.iter()
            .filter(|&&p| p != id && live(p))
            .take(MAX_PARTNERS)
            .map(|&p| Ok((p, self.store.fusion_similarity(id, p)?)))
            .collect()
    }

    /// The partner of `id` sharing the most layers at `threshold`, and those layers.
    fn best_partner(
        &self,
        id: BlockId,
        candidates: &Candidates,
        threshold: f32,
    ) -> EngineResult<Option<(BlockId, Vec<bool>)>> {
        Ok(best_at(
            &self.partner_similarities(id, candidates)?,
            threshold,
        ))
    }

    /// Fuses victims (cold blocks in drop order) with partners until `need` cold slots are
    /// freed or none is left to fuse; returns the slots freed (module docs).
    pub(super) fn fuse_victims(&mut self, victims: &[BlockId], need: usize) -> EngineResult<usize> {
        let Some(policy) = self.config.fusion else {
            return Ok(0);
        };
        let candidates = self.fusion_candidates();
        let mut freed = 0;
        let mut probed = false;
        for (rank, &v) in victims.iter().enumerate() {
            if freed >= need {
                break;
            }
            let Some(m) = self.store.metadata().get(v) else {
                continue;
            };
            if m.tier() != Tier::Cold
                || !matches!(m.precision(), Precision::Full | Precision::Restored)
                || m.tenant() == PUBLIC_TENANT
                || m.pin() == PinState::Pinned
            {
                continue;
            }
            let threshold = self.fusion.status.threshold;
            let mut witnessed = false;
            let sims = self.partner_similarities(v, &candidates)?;
            let found = match best_at(&sims, threshold) {
                Some(found) => Some(found),
                None if !probed => {
                    // Nothing at the threshold: once a call, for the first victim that would
                    // fuse at or above the floor, witness the threshold at which it would, and
                    // move there if the witness allows it.
                    let (first, nearest) = first_at(&sims, policy.min_threshold);
                    if let Some(n) = nearest
                        && self.fusion.status.nearest.is_none_or(|m| n > m)
                    {
                        self.fusion.status.nearest = Some(n);
                    }
                    match first {
                        Some(at) if at < threshold => {
                            probed = true;
                            self.fusion.status.decisions += 1;
                            match self.fusion_witness(v, at, &candidates)? {
                                Some(kl) => {
                                    self.fusion.status.witnesses += 1;
                                    self.fusion.status.last_kl = Some(kl);
                                    if kl > policy.kl_budget {
                                        self.fusion.status.refused += 1;
                                        continue;
                                    }
                                    self.fusion.status.threshold = at;
                                    witnessed = true;
                                    best_at(&sims, at)
                                }
                                None => continue,
                            }
                        }
                        _ => None,
                    }
                }
                None => None,
            };
            let Some((partner, shared)) = found else {
                continue;
            };
            let due = !witnessed
                && (self.fusion.pending
                    || self
                        .fusion
                        .status
                        .decisions
                        .is_multiple_of(u64::from(policy.witness_every)));
            if !witnessed {
                self.fusion.status.decisions += 1;
            }
            if due {
                match self.fusion_witness(v, threshold, &candidates)? {
                    Some(kl) => {
                        self.fusion.pending = false;
                        self.fusion.status.witnesses += 1;
                        self.fusion.status.last_kl = Some(kl);
                        if kl > policy.kl_budget {
                            self.fusion.status.refused += 1;
                            self.fusion.status.threshold = (threshold + policy.step).min(1.0);
                            continue;
                        }
                        if kl <= policy.kl_budget / 2.0 {
                            self.fusion.status.threshold =
                                (threshold - policy.step).max(policy.min_threshold);
                        }
                    }
                    None => self.fusion.pending = true,
                }
            }
            match self.store.fuse(v, partner, &shared) {
                Ok(n) => {
                    freed += n;
                    self.counters.fused_blocks += 1;
                }
                Err(KvError::FusedPoolFull { .. }) => {
                    // Make room out of a fused block that comes earlier in drop order.
                    let worse = victims[..rank].iter().copied().find(|&w| {
                        w != partner
                            && self.store.metadata().get(w).map(|m| m.precision())
                                == Some(Precision::Fused)
                    });
                    let Some(worse) = worse else { break };
                    self.drop_cached(worse)?;
                    if let Ok(n) = self.store.fuse(v, partner, &shared) {
                        freed += n;
                        self.counters.fused_blocks += 1;
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(freed)
    }

    /// The witness of a fusion decision for `victim` at `threshold` (module docs): mean KL in
    /// nats, or `None` when no session chain holds the victim and the block after it with
    /// every block before resident.
    fn fusion_witness(
        &self,
        victim: BlockId,
        threshold: f32,
        candidates: &Candidates,
    ) -> EngineResult<Option<f64>> {
        let bs = self.config.block_size;
        let Some(tenant) = self.store.metadata().get(victim).map(|m| m.tenant()) else {
            return Ok(None);
        };
        let mut found = None;
        for (key, chain) in &self.chains.by_key {
            if key.0 != tenant {
                continue;
            }
            let Some(b) = chain
                .hashes
                .iter()
                .position(|h| self.cache.get(h) == Some(victim))
            else {
                continue;
            };
            if chain.tokens().len() < (b + 2) * bs {
                continue;
            }
            let ids: Option<Vec<BlockId>> = chain.hashes[..=b]
                .iter()
                .map(|h| {
                    self.cache.get(h).filter(|&id| {
                        self.store
                            .metadata()
                            .get(id)
                            .is_some_and(|m| m.tier() != Tier::Recompute)
                    })
                })
                .collect();
            if let Some(ids) = ids {
                found = Some((ids, chain.tokens()[(b + 1) * bs..(b + 2) * bs].to_vec()));
                break;
            }
        }
        let Some((ids, next)) = found else {
            return Ok(None);
        };
        let n = ids.len();
        let shape = *self.store.shape();
        let blocks = u32::try_from(n + 1).map_err(|_| EngineError::InvalidConfig {
            field: "fusion",
            reason: "a witness chain is too long".into(),
        })?;
        let mut scratch = BlockStore::new(StoreConfig {
            codecs: self.store.codec_kinds().clone(),
            rotation_seed: self.store.rotation_seed(),
            ..StoreConfig::new(shape, engram_kvcore::CodecKind::F32, blocks, blocks)
        })?;
        let tags = |j: usize| BlockTags {
            source: SourceLayer::UserTurn,
            importance: 0.5,
            tenant,
            session: None,
            tokens: TokenRange::new((j * bs) as u32, ((j + 1) * bs) as u32),
        };
        let table = scratch.allocate(Tier::Cold, &(0..=n).map(tags).collect::<Vec<_>>())?;
        for (&id, &to) in ids.iter().zip(&table) {
            scratch.write_block_bytes(to, &self.store.block_bytes_of(id)?)?;
        }
        scratch.warm(&table)?;
        let transform = KvTransform {
            key_means: self.key_means.as_deref(),
            probe: None,
        };
        let next_rows = |scratch: &mut BlockStore| {
            let at = Placement {
                start: n * bs,
                blocks: &table,
                relocated: &[],
            };
            prefill_chunks(&self.model, transform, scratch, &next, at, LogitRows::All)
        };
        let reference = next_rows(&mut scratch)?;
        // Every block of the chain that would fuse at the threshold, fused.
        let mut changed = 0;
        for (&id, &to) in ids.iter().zip(&table) {
            let eligible = self.store.metadata().get(id).is_some_and(|m| {
                matches!(m.precision(), Precision::Full | Precision::Restored)
                    && m.tenant() != PUBLIC_TENANT
            });
            if !eligible {
                continue;
            }
            let Some((partner, shared)) = self.best_partner(id, candidates, threshold)? else {
                continue;
            };
            let bytes = self.store.fused_bytes(id, partner, &shared)?;
            scratch.spill(&[to])?;
            scratch.write_block_bytes(to, &bytes)?;
            scratch.warm(&[to])?;
            changed += 1;
        }
        if changed == 0 {
            return Ok(Some(0.0));
        }
        let fused = next_rows(&mut scratch)?;
        Ok(Some(mean_kl(&reference, &fused)?))
    }
}

/// A victim's candidates and their per-layer (key, value) similarities.
type Sims = Vec<(BlockId, Vec<Option<(f32, f32)>>)>;

/// Of `sims`, the partner sharing the most layers at `threshold` (the newest among equals), and
/// those layers; a layer is shared when its key and value similarities both reach it.
fn best_at(sims: &Sims, threshold: f32) -> Option<(BlockId, Vec<bool>)> {
    let mut best: Option<(usize, BlockId, Vec<bool>)> = None;
    for (p, layers) in sims {
        let shared: Vec<bool> = layers
            .iter()
            .map(|l| l.is_some_and(|(k, v)| k >= threshold && v >= threshold))
            .collect();
        let n = shared.iter().filter(|&&s| s).count();
        if n > 0 && best.as_ref().is_none_or(|b| n > b.0) {
            best = Some((n, *p, shared));
        }
    }
    best.map(|(_, p, s)| (p, s))
}

/// The highest threshold, not below `floor`, at which one of `sims` shares a layer (the largest
/// over partners and layers of the smaller of the key and value similarities; `None` when none
/// reaches `floor`), and that largest value whatever the floor (`None` without a candidate).
fn first_at(sims: &Sims, floor: f32) -> (Option<f32>, Option<f32>) {
    let (mut best, mut nearest): (Option<f32>, Option<f32>) = (None, None);
    for (k, v) in sims.iter().flat_map(|(_, l)| l.iter().flatten()) {
        let at = k.min(*v);
        if nearest.is_none_or(|n| at > n) {
            nearest = Some(at);
        }
        if at >= floor && best.is_none_or(|b| at > b) {
            best = Some(at);
        }
    }
    (best, nearest)
}

/// Mean over rows of KL(softmax(p) ‖ softmax(q)), in nats.
fn mean_kl(p: &Tensor, q: &Tensor) -> EngineResult<f64> {
    let p: Vec<Vec<f32>> = p.to_dtype(candle_core::DType::F32)?.to_vec2()?;
    let q: Vec<Vec<f32>> = q.to_dtype(candle_core::DType::F32)?.to_vec2()?;
    let log_softmax = |row: &[f32]| -> Vec<f64> {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
        row.iter().map(|&x| f64::from(x - max) - sum.ln()).collect()
    };
    let mut total = 0.0;
    for (a, b) in p.iter().zip(&q) {
        let (la, lb) = (log_softmax(a), log_softmax(b));
        total += la
            .iter()
            .zip(&lb)
            .map(|(&x, &y)| x.exp() * (x - y))
            .sum::<f64>();
    }
    Ok(total / p.len().max(1) as f64)
}
