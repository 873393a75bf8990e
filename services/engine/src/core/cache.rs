//! The engine's cache management: registering and pinning computed blocks, making room in the
//! hot tier (spill to cold, trim cold, per-tenant cold quotas), and releasing pins and blocks.

use std::collections::{HashMap, HashSet, VecDeque};

use engram_kvcore::{
    BlockId, KvError, KvShape, LayerCodecs, PinState, Precision, SessionId, TenantId, Tier,
};

use serde::{Deserialize, Serialize};

use super::evict::HotRanking;
use super::{EngineConfig, EngineCore, PUBLIC_TENANT, PrefixReuse, SeqId, block_salt};
use crate::error::{EngineError, EngineResult};
use crate::prefix::chain_hash;
use crate::profile::KvProfile;

/// Down-tiering options (see [`EngineConfig::down_tier`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DownTier {
    /// The looser KL budget (nats) a wholly down-tiered cache may cost, as the profile's
    /// measured contributions predict it; the profile's own budget is the tighter one.
    pub budget_kl: f64,
    /// Bytes of the pool of down-tiered blocks.
    pub bytes: u64,
}

/// The reduced pool down-tiering needs, as `(codecs, blocks)`: `None` when it is off. Refuses a
/// configuration without a profile (its measured sensitivity picks the codecs), one whose looser
/// budget narrows nothing, and a pool too small for one block.
pub(super) fn reduced_pool(
    config: &EngineConfig,
    profile: Option<&KvProfile>,
    codecs: &LayerCodecs,
    shape: &KvShape,
) -> EngineResult<Option<(LayerCodecs, u64)>> {
    Ok(match (config.down_tier, profile) {
        (None, _) => None,
        (Some(_), None) => {
            return Err(EngineError::InvalidConfig {
                field: "down_tier",
                reason: "down-tiering needs kv_profile: its measured sensitivity picks the \
                         narrower codecs"
                    .into(),
            });
        }
        (Some(d), Some(p)) => {
            let (reduced, _) = p.reduced_codecs(shape, d.budget_kl)?;
            if &reduced == codecs {
                return Err(EngineError::InvalidConfig {
                    field: "down_tier",
                    reason: format!(
                        "at {} nats the profile narrows no stream: down-tiering would save \
                         nothing",
                        d.budget_kl
                    ),
                });
            }
            let bytes = shape.block_size * reduced.token_bytes(shape);
            let blocks = d.bytes / bytes as u64;
            if blocks == 0 {
                return Err(EngineError::InvalidConfig {
                    field: "down_tier",
                    reason: format!(
                        "{} bytes hold no down-tiered block of {bytes} bytes",
                        d.bytes
                    ),
                });
            }
            Some((reduced, blocks))
        }
    })
}

/// What [`EngineCore::evict_session`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvictReport {
    /// The session's blocks dropped from the hot and cold tiers.
    pub dropped: usize,
    /// Its pinned blocks (the stable prefix), kept.
    pub pinned: usize,
    /// Its blocks a running sequence attends, kept.
    pub busy: usize,
}

/// What [`EngineCore::forget`] dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForgetReport {
    /// Cached blocks dropped.
    pub blocks: usize,
    /// Session chain records dropped.
    pub chains: usize,
    /// Ready reservations expired.
    pub reservations: usize,
    /// Running sequences of the sessions, which will leave nothing cached when they end.
    pub running: usize,
}

impl EngineCore {
    /// Registers the sequence's newly full blocks in the prefix cache and pins stable ones.
    pub(super) fn register(&mut self, id: SeqId) -> EngineResult<()> {
        let bs = self.config.block_size;
        let Some(seq) = self.seqs.get_mut(&id) else {
            return Ok(());
        };
        self.store.touch(&seq.blocks)?;
        if seq.reuse == PrefixReuse::Disabled || seq.forgotten {
            return Ok(());
        }
        let mut stable = Vec::new();
        let cacheable = if self.config.cache_generated {
            seq.computed
        } else {
            seq.computed.min(seq.prompt_len)
        };
        while seq.hashes.len() < cacheable / bs {
            let b = seq.hashes.len();
            let h = chain_hash(
                &self.fingerprint,
                block_salt(seq.tenant, seq.public_blocks, b),
                Self::parent_of(seq, b, bs),
                &seq.tokens[b * bs..(b + 1) * bs],
            );
            let block = seq.blocks[b];
            // A relocated run's copies are never cached (see the `relocate` module).
            let copied = seq
                .relocation
                .as_ref()
                .is_some_and(|r| (r.run.start / bs..r.run.end / bs).contains(&b));
            if !copied && self.cache.get(&h).is_none() && self.cache.insert(h, block) {
                self.store.retain(&[block])?;
                self.history.hand_over(&mut self.store, &h, block)?;
                let source = self.store.metadata().get(block).map(|m| m.source());
                if source.is_some_and(|s| self.config.pin_policy.sources.contains(&s)) {
                    stable.push((b, block));
                }
            }
            seq.hashes.push(h);
        }
        self.pin_blocks(id, &stable)?;
        self.index_segments(id);
        Ok(())
    }

    /// Pins blocks `(index in the sequence, id)` of sequence `id` and files each under the key
    /// that may release it: the public key for public blocks, the sequence's key otherwise.
    pub(super) fn pin_blocks(
        &mut self,
        id: SeqId,
        blocks: &[(usize, BlockId)],
    ) -> EngineResult<()> {
        if blocks.is_empty() {
            return Ok(());
        }
        let ids: Vec<BlockId> = blocks.iter().map(|&(_, b)| b).collect();
        self.pins.pin(&mut self.store, &ids)?;
        let Some(seq) = self.seqs.get(&id) else {
            return Ok(());
        };
        for &(b, block) in blocks {
            let key = if b < seq.public_blocks {
                seq.public_pin_key
            } else {
                seq.pin_key
            };
            if let Some(key) = key {
                self.pins_by_key.entry(key).or_default().push(block);
            }
        }
        Ok(())
    }

    /// Frees `n` hot slots: first makes cold room for what will spill, then evicts hot blocks no
    /// running sequence attends. Blocks the cold tier cannot take leave the cache, but only
    /// blocks of `tenants` (whom the room is for) or of a tenant holding more cached blocks
    /// than its cold quota: another tenant's blocks within its quota are only ever spilled.
    /// Errors with [`EngineError::NoHotRoom`], changing nothing in the hot tier, when that
    /// cannot free `n` slots.
    ///
    /// The cold room for the spill comes out of `tenants`' own or over-quota tenants' cold
    /// blocks too, see [`Self::trim_cold_for`].
    pub(super) fn make_hot_room(&mut self, n: usize, tenants: &[TenantId]) -> EngineResult<()> {
        let free = self.store.free_blocks(Tier::Hot);
        if free >= n {
            return Ok(());
        }
        self.trim_cold_for(n - free, Some(tenants))?;
        let busy = self.busy_blocks();
        let removable = self.hot_removable(tenants, &busy);
        let HotRanking { order, demoted } = self.admission_ranking(&busy);
        let used = self.store.stage_stats().used;
        // Demoted blocks are spilled, not dropped — unless nothing else can make room.
        let ev = self
            .store
            .make_room_ordered(n, order.clone(), |id| {
                removable.contains(&id) && !demoted.contains(&id)
            })
            .or_else(|e| {
                if demoted.is_empty() {
                    return Err(e);
                }
                self.store
                    .make_room_ordered(n, order, |id| removable.contains(&id))
            })
            .map_err(|e| match e {
                KvError::TierExhausted {
                    tier: Tier::Hot,
                    requested,
                    available,
                } => EngineError::NoHotRoom {
                    needed: requested,
                    available,
                },
                other => other.into(),
            })?;
        self.counters.admission_evictions += ev.freed() as u64;
        self.counters.admission_staged += self.store.stage_stats().used.saturating_sub(used);
        for &id in &ev.spilled {
            if let Some(m) = self.store.metadata().get(id) {
                *self.counters.spilled.entry(m.source()).or_default() += 1;
            }
        }
        for id in ev.removed {
            self.drop_cached(id)?;
        }
        if !ev.spilled.is_empty() {
            self.enforce_cold_quotas()?;
        }
        Ok(())
    }

    /// The idle hot blocks [`Self::make_hot_room`] may drop for `tenants`: theirs, and of every
    /// other tenant with a cold quota the lowest in eviction order beyond that quota (counting
    /// its cold blocks and its idle hot ones). Public blocks and tenants without a quota are
    /// never dropped for someone else.
    fn hot_removable(&self, tenants: &[TenantId], busy: &HashSet<BlockId>) -> HashSet<BlockId> {
        let mut held: HashMap<TenantId, usize> = HashMap::new();
        for m in self.store.metadata().iter() {
            let idle_hot = m.tier() == Tier::Hot && !busy.contains(&m.id());
            if (m.tier() == Tier::Cold || idle_hot) && !tenants.contains(&m.tenant()) {
                *held.entry(m.tenant()).or_default() += 1;
            }
        }
        let mut excess: HashMap<TenantId, usize> = held
            .into_iter()
            .filter_map(|(t, n)| {
                let quota = *self.cold_quotas.get(&t)?;
                (t != PUBLIC_TENANT && n > quota).then(|| (t, n - quota))
            })
            .collect();
        let mut removable = HashSet::new();
        for id in self.store.eviction_order() {
            if busy.contains(&id) {
                continue;
            }
            let Some(t) = self.store.metadata().get(id).map(|m| m.tenant()) else {
                continue;
            };
            if tenants.contains(&t) {
                removable.insert(id);
            } else if let Some(left) = excess.get_mut(&t)
                && *left > 0
            {
                *left -= 1;
                removable.insert(id);
            }
        }
        removable
    }

    /// Drops cached cold blocks of every tenant over its cold quota, its lowest priority and
    /// least recently attended first, until it is within the quota.
    pub(super) fn enforce_cold_quotas(&mut self) -> EngineResult<()> {
        if self.cold_quotas.is_empty() {
            return Ok(());
        }
        let mut by_tenant: HashMap<TenantId, Vec<_>> = HashMap::new();
        for m in self.store.metadata().iter() {
            if m.tier() == Tier::Cold
                && m.ref_count() == 1
                && self.cold_quotas.contains_key(&m.tenant())
                && self.cache.contains_block(m.id())
            {
                by_tenant.entry(m.tenant()).or_default().push((
                    m.priority(),
                    m.last_attended(),
                    m.created_at(),
                    m.id(),
                ));
            }
        }
        for (tenant, mut blocks) in by_tenant {
            let quota = self.cold_quotas.get(&tenant).copied().unwrap_or(usize::MAX);
            if blocks.len() <= quota {
                continue;
            }
            blocks.sort_unstable();
            let over = blocks.len() - quota;
            for (_, _, _, id) in blocks.into_iter().take(over) {
                self.drop_cached(id)?;
                self.counters.cold_quota_dropped += 1;
            }
        }
        Ok(())
    }

    /// Drops cached cold blocks, lowest priority and least recently attended first, until `n`
    /// cold slots are free (or no cached cold block is left).
    pub(super) fn trim_cold(&mut self, n: usize) -> EngineResult<()> {
        self.trim_cold_for(n, None)
    }

    /// [`Self::trim_cold`] on behalf of `tenants`: room made for them comes out of the blocks
    /// of tenants over their cold quota and then out of their own, never out of another
    /// tenant's (nor out of public blocks). `None`: any tenant's (the operator's maintenance).
    pub(super) fn trim_cold_for(
        &mut self,
        n: usize,
        tenants: Option<&[TenantId]>,
    ) -> EngineResult<()> {
        let free = self.store.free_blocks(Tier::Cold);
        if free >= n || self.store.capacity(Tier::Cold) == 0 {
            return Ok(());
        }
        let victims = self.cold_victims(tenants);
        if self.store.reduced_capacity() == 0 {
            for id in victims.into_iter().take(n - free) {
                self.drop_cached(id)?;
            }
            return Ok(());
        }
        self.down_tier(victims, n - free).map(|_| ())
    }

    /// Frees `need` cold slots out of `victims` (cached cold blocks in drop order) by
    /// down-tiering them into the reduced pool instead of dropping them. When the pool is full,
    /// the least valuable block — its first down-tiered victim or the block at hand, whichever
    /// comes first in drop order — leaves the cache to make room. A block the narrower codecs
    /// cannot encode is dropped, as without down-tiering. Returns how many blocks were dropped.
    pub(super) fn down_tier(
        &mut self,
        victims: Vec<BlockId>,
        mut need: usize,
    ) -> EngineResult<usize> {
        let reduced = |core: &Self, id| {
            core.store.metadata().get(id).map(|m| m.precision()) == Some(Precision::Reduced)
        };
        // (rank in drop order, block)
        type Ranked = Vec<(usize, BlockId)>;
        let (pool, full): (Ranked, Ranked) = victims
            .into_iter()
            .enumerate()
            .partition(|&(_, id)| reduced(self, id));
        let mut pool = VecDeque::from(pool);
        let mut dropped = 0;
        for (rank, id) in full {
            if need == 0 {
                break;
            }
            need -= 1;
            if self.store.free_reduced() == 0 {
                match pool.front() {
                    Some(&(r, worse)) if r < rank => {
                        pool.pop_front();
                        self.drop_cached(worse)?;
                    }
                    _ => {
                        self.drop_cached(id)?;
                        dropped += 1;
                        continue;
                    }
                }
                dropped += 1;
            }
            match self.store.reduce(&[id]) {
                Ok(()) => {
                    self.counters.down_tiered += 1;
                    // Now a pool candidate itself, in its place in drop order.
                    let at = pool.partition_point(|&(r, _)| r < rank);
                    pool.insert(at, (rank, id));
                }
                Err(_) => {
                    self.drop_cached(id)?;
                    dropped += 1;
                }
            }
        }
        Ok(dropped)
    }

    /// The cached cold blocks [`Self::trim_cold_for`] may drop (or down-tier) for `tenants`, in
    /// the order it takes them; down-tiered ones included, though dropping them frees no cold
    /// slot. With attention-aware eviction (the default) the order is by what the model reads
    /// ([`Self::rank_cold`]: priority band, then attention mass, read recency and read
    /// frequency); with priority-only eviction by priority and last touch.
    pub(super) fn cold_victims(&self, tenants: Option<&[TenantId]>) -> Vec<BlockId> {
        let mut per_tenant: HashMap<TenantId, usize> = HashMap::new();
        if tenants.is_some() {
            for m in self.store.metadata().iter() {
                if m.tier() == Tier::Cold {
                    *per_tenant.entry(m.tenant()).or_default() += 1;
                }
            }
        }
        let over = |t: TenantId| {
            self.cold_quotas
                .get(&t)
                .is_some_and(|&q| per_tenant.get(&t).copied().unwrap_or(0) > q)
        };
        let class_of = |m: &engram_kvcore::BlockMeta| -> Option<u8> {
            // Class 0: over-quota tenants' blocks; 1: the requester's own; others untouched.
            match tenants {
                None => Some(0),
                Some(_) if over(m.tenant()) => Some(0),
                Some(ts) if ts.contains(&m.tenant()) => Some(1),
                Some(_) => None,
            }
        };
        let cached_cold = |m: &&engram_kvcore::BlockMeta| {
            m.tier() == Tier::Cold && m.ref_count() == 1 && self.cache.contains_block(m.id())
        };
        if self.config.eviction.mode == super::EvictionMode::Attention {
            let candidates = self
                .store
                .metadata()
                .iter()
                .filter(cached_cold)
                .filter_map(|m| Some((class_of(m)?, m.id())))
                .collect();
            return self.rank_cold(candidates);
        }
        // A block counts as high a priority and as late an attention as any later block of its
        // session chains, so that a chain loses its cold blocks from the end: dropping never
        // leaves a hole.
        let mut later_kept: HashMap<BlockId, (u16, u64)> = HashMap::new();
        for chain in self.cached_chains() {
            let mut later = (0u16, 0u64);
            for id in chain.iter().rev() {
                if let Some(m) = self.store.metadata().get(*id) {
                    later = later.max((m.priority(), m.last_attended()));
                }
                let e = later_kept.entry(*id).or_insert((0, 0));
                *e = (*e).max(later);
            }
        }
        let mut cold: Vec<_> = self
            .store
            .metadata()
            .iter()
            .filter(cached_cold)
            .filter_map(|m| {
                let class = class_of(m)?;
                let (priority, attended) = later_kept
                    .get(&m.id())
                    .copied()
                    .unwrap_or((0, 0))
                    .max((m.priority(), m.last_attended()));
                Some((
                    class,
                    priority,
                    attended,
                    std::cmp::Reverse(m.tokens().start),
                    m.created_at(),
                    m.id(),
                ))
            })
            .collect();
        cold.sort_unstable();
        cold.into_iter().map(|(_, _, _, _, _, id)| id).collect()
    }

    /// Cold blocks `tenant` may still add under its cold quota (`usize::MAX` without one).
    pub(super) fn cold_room_of(&self, tenant: TenantId) -> usize {
        let Some(&quota) = self.cold_quotas.get(&tenant) else {
            return usize::MAX;
        };
        let used = self
            .store
            .metadata()
            .iter()
            .filter(|m| m.tier() == Tier::Cold && m.tenant() == tenant)
            .count();
        quota.saturating_sub(used)
    }

    /// Removes a block from the cache and drops the cache's reference.
    pub(super) fn drop_cached(&mut self, id: BlockId) -> EngineResult<()> {
        if let Some(m) = self.store.metadata().get(id) {
            *self.counters.dropped.entry(m.source()).or_default() += 1;
            if let Some(&h) = self.cache.hash_of(id) {
                self.history
                    .remember(h, m.tenant(), m.session(), crate::prefix::Carried::of(m));
            }
        }
        if self.cache.remove_block(id) {
            self.store.release(&[id])?;
        }
        Ok(())
    }

    /// Moves every cached hot block that no sequence attends to the cold tier (for benches and
    /// the tier manager); returns how many moved.
    pub fn spill_idle(&mut self) -> EngineResult<usize> {
        let busy: HashSet<BlockId> = self
            .seqs
            .values()
            .flat_map(|s| s.blocks.iter().copied())
            .collect();
        let idle: Vec<BlockId> = self
            .cache
            .blocks()
            .filter(|id| !busy.contains(id))
            .filter(|&id| self.store.metadata().get(id).map(|m| m.tier()) == Some(Tier::Hot))
            .collect();
        self.trim_cold(idle.len())?;
        let room = self.store.free_blocks(Tier::Cold).min(idle.len());
        self.store.spill(&idle[..room])?;
        self.enforce_cold_quotas()?;
        Ok(room)
    }

    /// Releases the pins filed under `key` (a stable prefix that changed); they keep their
    /// layer's priority and leave by eviction like any other block. Returns how many.
    ///
    /// `key` is a tenant's prefix key: its own pins are released, and it stops using every public
    /// prefix; a public prefix's blocks are unpinned only when its last user is gone. Passing a
    /// public key itself unpins its blocks only while no tenant uses it.
    pub fn unpin_prefix(&mut self, key: &[u8; 32]) -> EngineResult<usize> {
        let mut released = Vec::new();
        if self.public_users.get(key).is_none_or(|u| u.is_empty())
            && let Some(ids) = self.pins_by_key.remove(key)
        {
            self.public_users.remove(key);
            released.extend(ids);
        }
        let emptied: Vec<[u8; 32]> = self
            .public_users
            .iter_mut()
            .filter_map(|(public, users)| {
                (users.remove(key) && users.is_empty()).then_some(*public)
            })
            .collect();
        for public in emptied {
            self.public_users.remove(&public);
            released.extend(self.pins_by_key.remove(&public).unwrap_or_default());
        }
        released.sort_unstable();
        released.dedup();
        let live: Vec<BlockId> = released
            .into_iter()
            .filter(|&id| self.store.metadata().get(id).is_some())
            .collect();
        Ok(self.pins.unpin(&mut self.store, &live)?.unpinned.len())
    }

    /// Forgets what the engine holds of a tenant's sessions: every cached block of `tenant`
    /// whose session key matches (`session & mask == value`; a mask of 0 takes every block of
    /// the tenant), their pins, the sessions' chain records, and the tenant's ready
    /// reservations. Blocks a running sequence still attends are released when it ends, and
    /// such a sequence caches nothing more and records no chain (a delete racing a running
    /// turn leaves nothing behind). Public blocks belong to no tenant and stay.
    pub fn forget(
        &mut self,
        tenant: TenantId,
        mask: u64,
        value: u64,
    ) -> EngineResult<ForgetReport> {
        let mut report = ForgetReport {
            reservations: self.expire_reservations_of(tenant)?,
            ..ForgetReport::default()
        };
        for seq in self.seqs.values_mut() {
            if seq.tenant == tenant
                && (mask == 0 || seq.session.is_some_and(|s| s.0 & mask == value))
            {
                seq.forgotten = true;
                report.running += 1;
            }
        }
        let ids: Vec<BlockId> = self
            .store
            .metadata()
            .iter()
            .filter(|m| {
                m.tenant() == tenant
                    && (mask == 0 || m.session().is_some_and(|s| s.0 & mask == value))
            })
            .map(|m| m.id())
            .collect();
        self.pins.unpin(&mut self.store, &ids)?;
        let gone: HashSet<BlockId> = ids.iter().copied().collect();
        for id in ids {
            if self.cache.contains_block(id) {
                self.drop_cached(id)?;
                report.blocks += 1;
            }
        }
        self.pins_by_key.retain(|_, v| {
            v.retain(|id| !gone.contains(id));
            !v.is_empty()
        });
        let before = self.chains.by_key.len();
        self.chains
            .by_key
            .retain(|k, _| !(k.0 == tenant && k.1.0 & mask == value));
        report.chains = before - self.chains.by_key.len();
        self.index.forget(tenant, mask, value);
        // The blocks just dropped left their counts in the history: those go too.
        self.history.forget(tenant, mask, value);
        if mask == 0 {
            self.cold_quotas.remove(&tenant);
        }
        Ok(report)
    }

    /// Drops a session's own cached blocks from the hot and cold tiers, keeping its chain record
    /// (the shadow still knows the chain, and a later turn reads it back from disk on a miss),
    /// its pinned blocks and any block a running sequence attends. A block is the session's when
    /// the session computed it (its metadata names the session).
    pub fn evict_session(
        &mut self,
        tenant: TenantId,
        session: SessionId,
    ) -> EngineResult<EvictReport> {
        let busy: HashSet<BlockId> = self
            .seqs
            .values()
            .flat_map(|s| s.blocks.iter().copied())
            .collect();
        let mut report = EvictReport::default();
        let mut drop = Vec::new();
        for m in self.store.metadata().iter() {
            if m.tenant() != tenant || m.session() != Some(session) {
                continue;
            }
            let id = m.id();
            if !self.cache.contains_block(id) {
                continue;
            }
            if m.pin() == PinState::Pinned {
                report.pinned += 1;
            } else if busy.contains(&id) {
                report.busy += 1;
            } else {
                drop.push(id);
            }
        }
        for id in drop {
            self.drop_cached(id)?;
            report.dropped += 1;
        }
        Ok(report)
    }

    /// Archives a session in memory: [`Self::evict_session`], and its chain record goes too,
    /// so no flush writes it again — what is left of it is its turn log (the tokens-only
    /// archive tier; its next turn replays it).
    pub fn archive_session(
        &mut self,
        tenant: TenantId,
        session: SessionId,
    ) -> EngineResult<EvictReport> {
        let report = self.evict_session(tenant, session)?;
        self.chains.by_key.remove(&(tenant, session));
        Ok(report)
    }

    /// Tenant prefix keys using each public prefix (for the admin views and tests).
    pub fn public_users(&self, public: &[u8; 32]) -> usize {
        self.public_users.get(public).map_or(0, HashSet::len)
    }

    /// Drops every cached block no sequence attends (a cold start for benches).
    pub fn clear_cache(&mut self) -> EngineResult<()> {
        self.expire_all_reservations()?;
        let ids: Vec<BlockId> = self.cache.blocks().collect();
        for id in ids {
            self.drop_cached(id)?;
        }
        self.index.clear();
        Ok(())
    }
}
