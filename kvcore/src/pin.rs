//! The PrefixPinManager: pins the stable prefix layers so eviction spares them, under a soft cap.
//!
//! Rule:
//! - only blocks whose source layer is in the manager's set are pinned (default: axioms,
//!   identity, rules, capabilities, soul); others are reported as `not_pinnable` and unchanged;
//! - the cap is `⌊max_share · hot capacity⌋` blocks in state [`PinState::Pinned`] (any tier),
//!   and one tenant (public blocks count as a tenant of their own) holds at most
//!   `⌊tenant_share · cap⌋` of them (at least one), so no tenant takes every pin;
//! - a pin within the cap gives priority 999; a pin over the cap *degrades*: state
//!   [`PinState::Degraded`], priority 100 (the call reports it), so no tenant can wedge the
//!   hot tier with pins;
//! - unpinning returns blocks to their layer's priority and then promotes degraded blocks,
//!   oldest first (created_at, then id), into the freed room; the call reports them.
//!
//! Cost: O(blocks) per call (the pinned count and the promotion scan read the table).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::block::Tier;
use crate::block::{BlockId, SourceLayer, TenantId};
use crate::error::{KvError, KvResult};
use crate::metadata::{BlockFilter, PinState};
use crate::store::BlockStore;

/// Which layers may be pinned, and the soft cap.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PinPolicy {
    /// Source layers whose blocks may be pinned.
    pub sources: Vec<SourceLayer>,
    /// Soft cap as a share of the hot tier's capacity, in (0, 1].
    pub max_share: f64,
    /// Share of the cap one tenant may hold, in (0, 1] (1: no per-tenant bound).
    #[serde(default = "full_share")]
    pub tenant_share: f64,
}

fn full_share() -> f64 {
    1.0
}

impl Default for PinPolicy {
    fn default() -> Self {
        Self {
            sources: SourceLayer::STABLE.to_vec(),
            max_share: 0.25,
            tenant_share: 1.0,
        }
    }
}

/// What a [`PrefixPinManager::pin`] call did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinReport {
    /// Newly pinned at priority 999.
    pub pinned: Vec<BlockId>,
    /// Over the soft cap: degraded to priority 100.
    pub degraded: Vec<BlockId>,
    /// Already pinned; unchanged.
    pub already_pinned: Vec<BlockId>,
    /// Source layer outside the pin set; unchanged.
    pub not_pinnable: Vec<BlockId>,
}

/// What a [`PrefixPinManager::unpin`] call did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnpinReport {
    /// Returned to their layer's priority.
    pub unpinned: Vec<BlockId>,
    /// Degraded pins promoted to pinned in the room freed.
    pub promoted: Vec<BlockId>,
}

/// Pins and unpins blocks by source set under a soft cap (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixPinManager {
    policy: PinPolicy,
}

impl PrefixPinManager {
    /// A manager with a validated policy.
    pub fn new(policy: PinPolicy) -> KvResult<Self> {
        if !(policy.max_share > 0.0 && policy.max_share <= 1.0) {
            return Err(KvError::InvalidConfig {
                field: "max_share",
                value: policy.max_share,
                reason: "must be in (0, 1]",
            });
        }
        if !(policy.tenant_share > 0.0 && policy.tenant_share <= 1.0) {
            return Err(KvError::InvalidConfig {
                field: "tenant_share",
                value: policy.tenant_share,
                reason: "must be in (0, 1]",
            });
        }
        Ok(Self { policy })
    }

    /// The policy in force.
    pub fn policy(&self) -> &PinPolicy {
        &self.policy
    }

    /// Most blocks that may be pinned at once in `store`.
    pub fn cap(&self, store: &BlockStore) -> usize {
        (self.policy.max_share * store.capacity(Tier::Hot) as f64).floor() as usize
    }

    /// Most blocks one tenant may hold pinned in `store`.
    pub fn tenant_cap(&self, store: &BlockStore) -> usize {
        ((self.policy.tenant_share * self.cap(store) as f64).floor() as usize).max(1)
    }

    fn pinned_by_tenant(store: &BlockStore) -> HashMap<TenantId, usize> {
        let mut out: HashMap<TenantId, usize> = HashMap::new();
        for m in store.metadata().iter() {
            if m.pin() == PinState::Pinned {
                *out.entry(m.tenant()).or_default() += 1;
            }
        }
        out
    }

    fn pinned_count(store: &BlockStore) -> usize {
        store.metadata().count(&BlockFilter {
            pinned: Some(true),
            ..BlockFilter::default()
        })
    }

    /// Pins `ids` in order; see the module docs for the rule.
    pub fn pin(&self, store: &mut BlockStore, ids: &[BlockId]) -> KvResult<PinReport> {
        store.check_unique_live(ids)?;
        let cap = self.cap(store);
        let tenant_cap = self.tenant_cap(store);
        let mut count = Self::pinned_count(store);
        let mut by_tenant = Self::pinned_by_tenant(store);
        let mut report = PinReport::default();
        for &id in ids {
            let meta = store.lookup(id)?;
            let tenant = meta.tenant();
            let held = by_tenant.get(&tenant).copied().unwrap_or(0);
            if !self.policy.sources.contains(&meta.source()) {
                report.not_pinnable.push(id);
            } else if meta.pin() == PinState::Pinned {
                report.already_pinned.push(id);
            } else if count < cap && held < tenant_cap {
                store.metadata_mut().set_pin(id, PinState::Pinned);
                count += 1;
                *by_tenant.entry(tenant).or_default() += 1;
                report.pinned.push(id);
            } else {
                store.metadata_mut().set_pin(id, PinState::Degraded);
                report.degraded.push(id);
            }
        }
        Ok(report)
    }

    /// Pins every block matching `filter` whose source is in the set (e.g. one tenant's prefix).
    pub fn pin_matching(
        &self,
        store: &mut BlockStore,
        filter: &BlockFilter,
    ) -> KvResult<PinReport> {
        let ids: Vec<BlockId> = store
            .metadata()
            .iter()
            .filter(|m| filter.matches(m) && self.policy.sources.contains(&m.source()))
            .map(|m| m.id())
            .collect();
        self.pin(store, &ids)
    }

    /// Unpins `ids` (pinned or degraded; others are left alone) and promotes degraded pins into
    /// the room freed, oldest first.
    pub fn unpin(&self, store: &mut BlockStore, ids: &[BlockId]) -> KvResult<UnpinReport> {
        store.check_unique_live(ids)?;
        let mut report = UnpinReport::default();
        for &id in ids {
            if store.lookup(id)?.pin() != PinState::Unpinned {
                store.metadata_mut().set_pin(id, PinState::Unpinned);
                report.unpinned.push(id);
            }
        }
        let mut room = self.cap(store).saturating_sub(Self::pinned_count(store));
        let tenant_cap = self.tenant_cap(store);
        let mut by_tenant = Self::pinned_by_tenant(store);
        let mut degraded: Vec<_> = store
            .metadata()
            .iter()
            .filter(|m| m.pin() == PinState::Degraded)
            .map(|m| (m.created_at(), m.id(), m.tenant()))
            .collect();
        degraded.sort_unstable_by_key(|&(at, id, _)| (at, id));
        for (_, id, tenant) in degraded {
            if room == 0 {
                break;
            }
            let held = by_tenant.entry(tenant).or_default();
            if *held >= tenant_cap {
                continue;
            }
            store.metadata_mut().set_pin(id, PinState::Pinned);
            *held += 1;
            room -= 1;
            report.promoted.push(id);
        }
        Ok(report)
    }
}
