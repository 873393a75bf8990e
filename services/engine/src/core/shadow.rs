//! What the shadow needs from the engine: each session's last block chain, the bytes of its
//! blocks, and the way back in (restore into the cold tier after a restart, or an import).
//!
//! **Chains.** When a sequence of a session finishes, the engine records the session's chain:
//! its tokens and the hashes of its full blocks, which blocks are public, and how many leading
//! blocks belong to the stable prefix (they form the shared-prefix entry of the shadow). Each
//! record carries a generation, so the shadow asks only for chains that changed since it last
//! wrote them. Each tenant keeps at most `EngineConfig::chains_per_tenant` records and all
//! tenants together at most [`MAX_CHAINS`]: a tenant over its cap loses its own oldest record,
//! and over the total the tenant with the most records loses its oldest (the shadow keeps what
//! it already wrote).
//!
//! **Restore** validates a whole chain before it changes anything: every block's parent is the
//! previous block, its salt is the tenant's (or public), its hash recomputed from the model
//! fingerprint, salt, parent and tokens equals the recorded one, and its bytes have this store's
//! length. A block's bytes are checked against their checksum by the caller (the shadow format
//! records them). Blocks already cached are kept; the others are loaded into the cold tier (as far
//! as it has room, leading blocks first; with `make_room`, room is first made out of the
//! tenant's own cold blocks) and registered in the prefix cache, so the next turn of
//! the session warms them like any cold block. Stable blocks recorded as pinned are pinned again
//! under their prefix's key.

use std::collections::{HashMap, HashSet};

use engram_kvcore::{
    BlockId, BlockTags, PinState, Precision, SessionId, SourceLayer, TenantId, Tier, TokenRange,
};
use serde::{Deserialize, Serialize};

use super::{EngineCore, PUBLIC_TENANT, Sequence};
use crate::error::{EngineError, EngineResult};
use crate::prefix::{BlockHash, chain_hash};

/// Sessions whose chain the engine remembers at most, all tenants together (a memory bound;
/// each tenant also has its own cap, `EngineConfig::chains_per_tenant`).
pub const MAX_CHAINS: usize = 16_384;

/// The default of `EngineConfig::chains_per_tenant`.
pub const CHAINS_PER_TENANT: usize = 2048;

/// A session: tenant salt and session key.
pub type ChainKey = (TenantId, SessionId);

pub use crate::hex::Hex32;

/// One block of a chain as the shadow records it (without its bytes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowBlock {
    /// The chained hash (names the whole prefix up to this block's end).
    pub hash: Hex32,
    /// Hashed with the public salt (shared by every tenant) instead of the tenant's.
    pub public: bool,
    /// The block's tokens.
    pub tokens: Vec<u32>,
    /// Prompt layer it came from.
    pub source: SourceLayer,
    /// Importance 0..=1.
    pub importance: f32,
    /// Pinned when it was recorded.
    pub pinned: bool,
}

/// Where the bytes of a collected block are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CollectedBytes {
    /// The shadow said it holds this block already.
    Known,
    /// Resident in the cache and new to the shadow: its bytes.
    New(Vec<u8>),
    /// Neither cached at full precision nor known to the shadow: the chain is usable only up
    /// to here.
    Missing,
}

/// A session's chain as the shadow collects it.
#[derive(Debug, Clone, PartialEq)]
pub struct ShadowChain {
    /// Tenant salt.
    pub tenant: TenantId,
    /// Session key.
    pub session: SessionId,
    /// Generation of this record (pass it back to skip the chain until it changes).
    pub generation: u64,
    /// Leading blocks that belong to the stable prefix.
    pub stable_blocks: usize,
    /// Key the tenant's stable blocks are pinned under.
    pub pin_key: Option<Hex32>,
    /// Key the public blocks are pinned under.
    pub public_pin_key: Option<Hex32>,
    /// The blocks in order; `pinned`, `source` and `importance` are meaningful where the block
    /// is resident.
    pub blocks: Vec<ShadowBlock>,
    /// Per block, where its bytes are.
    pub bytes: Vec<CollectedBytes>,
}

/// A chain to load back (from the shadow at start, or an import).
#[derive(Debug, Clone, PartialEq)]
pub struct RestoreChain {
    /// Tenant salt (the chain's hashes are checked against it).
    pub tenant: TenantId,
    /// Session key (none for a shared prefix on its own: no chain is recorded for it).
    pub session: Option<SessionId>,
    /// Leading blocks that belong to the stable prefix.
    pub stable_blocks: usize,
    /// Key the tenant's stable blocks are pinned under.
    pub pin_key: Option<Hex32>,
    /// Key the public blocks are pinned under.
    pub public_pin_key: Option<Hex32>,
    /// The tenant's cold-tier quota in blocks: a restore adds at most what is left of it.
    pub cold_quota: Option<usize>,
    /// Make room in the cold tier out of the tenant's own (or over-quota tenants') blocks when
    /// it is full (a session's miss, a load, an import); off, the restore fills only the free
    /// room (a recovery at start, which must not drop what it loaded for another session).
    pub make_room: bool,
    /// The blocks in order, each with its bytes.
    pub blocks: Vec<(ShadowBlock, Vec<u8>)>,
}

/// What a restore did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RestoreReport {
    /// Blocks loaded into the cold tier.
    pub loaded: usize,
    /// Blocks already cached (kept as they were).
    pub present: usize,
    /// Blocks left out for want of cold room.
    pub no_room: usize,
    /// Tokens the restored leading blocks cover.
    pub tokens: usize,
    /// Generation the engine gave the restored chain (0 when it kept a newer record).
    pub generation: u64,
}

/// A session's last chain (see the module docs).
#[derive(Debug, Clone, Default)]
pub(super) struct Chain {
    tokens: Vec<u32>,
    pub(super) hashes: Vec<BlockHash>,
    public_blocks: usize,
    stable_blocks: usize,
    pin_key: Option<[u8; 32]>,
    public_pin_key: Option<[u8; 32]>,
    generation: u64,
}

/// The engine's chain records.
#[derive(Debug)]
pub(super) struct Chains {
    pub(super) by_key: HashMap<ChainKey, Chain>,
    next_generation: u64,
    /// Records per tenant at most.
    per_tenant: usize,
    /// Records at most, all tenants together.
    total: usize,
}

impl Chains {
    pub(super) fn new(per_tenant: usize, total: usize) -> Self {
        Self {
            by_key: HashMap::new(),
            next_generation: 0,
            per_tenant: per_tenant.max(1),
            total: total.max(1),
        }
    }

    /// Records `chain`; a tenant over its cap loses its own oldest record, and over the total
    /// the tenant holding the most records loses its oldest — so one tenant's stateless chats
    /// never push another tenant's sessions out of the shadow.
    pub(super) fn insert(&mut self, key: ChainKey, mut chain: Chain) -> u64 {
        self.next_generation += 1;
        chain.generation = self.next_generation;
        self.by_key.insert(key, chain);
        let mut counts: HashMap<TenantId, usize> = HashMap::new();
        for k in self.by_key.keys() {
            *counts.entry(k.0).or_default() += 1;
        }
        if counts.get(&key.0).copied().unwrap_or(0) > self.per_tenant {
            self.remove_oldest_of(key.0);
        }
        if self.by_key.len() > self.total
            && let Some((&tenant, _)) = counts
                .iter()
                .max_by_key(|&(t, &n)| (n, std::cmp::Reverse(t.0)))
        {
            self.remove_oldest_of(tenant);
        }
        self.next_generation
    }

    fn remove_oldest_of(&mut self, tenant: TenantId) {
        if let Some(oldest) = self
            .by_key
            .iter()
            .filter(|(k, _)| k.0 == tenant)
            .min_by_key(|(_, c)| c.generation)
            .map(|(k, _)| *k)
        {
            self.by_key.remove(&oldest);
        }
    }
}

impl EngineCore {
    /// Records the chain of a finishing sequence of a session (see the module docs).
    pub(super) fn record_chain(&mut self, seq: &Sequence) {
        let Some(session) = seq.session else {
            return;
        };
        let bs = self.config.block_size;
        // Only the exact chain: blocks after a relocated run are cached under its anchor.
        let hashes = &seq.hashes[..seq.exact_blocks(bs)];
        if hashes.is_empty() {
            return;
        }
        let stable = &self.config.pin_policy.sources;
        let stable_end = seq
            .segments
            .iter()
            .take_while(|(_, source, _)| stable.contains(source))
            .last()
            .map_or(0, |&(end, _, _)| end);
        let chain = Chain {
            tokens: seq.tokens[..hashes.len() * bs].to_vec(),
            hashes: hashes.to_vec(),
            public_blocks: seq.public_blocks.min(hashes.len()),
            stable_blocks: (stable_end / bs).min(hashes.len()),
            pin_key: seq.pin_key,
            public_pin_key: seq.public_pin_key,
            generation: 0,
        };
        self.chains.insert((seq.tenant, session), chain);
    }

    /// The chains whose generation differs from `written` (every chain the shadow has not
    /// written as it is now), with the bytes of their resident blocks whose hash is not in
    /// `known`. `only` restricts the answer to one session.
    pub fn shadow_collect(
        &self,
        written: &HashMap<ChainKey, u64>,
        known: &HashSet<[u8; 32]>,
        only: Option<ChainKey>,
    ) -> EngineResult<Vec<ShadowChain>> {
        let bs = self.config.block_size;
        let mut out = Vec::new();
        for (&key, chain) in &self.chains.by_key {
            if only.is_some_and(|o| o != key)
                || (only.is_none() && written.get(&key) == Some(&chain.generation))
            {
                continue;
            }
            let mut blocks = Vec::with_capacity(chain.hashes.len());
            let mut bytes = Vec::with_capacity(chain.hashes.len());
            for (b, hash) in chain.hashes.iter().enumerate() {
                let cached = self.cache.get(hash);
                let meta = cached.and_then(|id| self.store.metadata().get(id));
                // The shadow keeps bytes as prefill computed them: a down-tiered block (or one
                // warmed back from the reduced pool) is not written, so a restart or another
                // node never inherits the narrower codecs' error as if it were full precision.
                let resident = meta
                    .filter(|m| m.tier() != Tier::Recompute && m.precision() == Precision::Full);
                blocks.push(ShadowBlock {
                    hash: Hex32(*hash),
                    public: b < chain.public_blocks,
                    tokens: chain.tokens[b * bs..(b + 1) * bs].to_vec(),
                    source: meta.map_or(SourceLayer::UserTurn, |m| m.source()),
                    importance: meta.map_or(0.5, |m| m.importance()),
                    pinned: meta.is_some_and(|m| m.pin() == PinState::Pinned),
                });
                bytes.push(if known.contains(hash) {
                    CollectedBytes::Known
                } else if let Some(m) = resident {
                    CollectedBytes::New(self.store.block_bytes_of(m.id())?)
                } else {
                    CollectedBytes::Missing
                });
            }
            out.push(ShadowChain {
                tenant: key.0,
                session: key.1,
                generation: chain.generation,
                stable_blocks: chain.stable_blocks,
                pin_key: chain.pin_key.map(Hex32),
                public_pin_key: chain.public_pin_key.map(Hex32),
                blocks,
                bytes,
            });
        }
        out.sort_by_key(|c| (c.tenant, c.session));
        Ok(out)
    }

    /// Checks a chain against this engine without changing anything (see the module docs).
    pub fn validate_chain(&self, chain: &RestoreChain) -> EngineResult<()> {
        let bs = self.config.block_size;
        let len = self.store.block_bytes();
        let mut parent: Option<BlockHash> = None;
        let mut public_done = false;
        for (i, (b, bytes)) in chain.blocks.iter().enumerate() {
            let bad = |reason| Err(EngineError::ShadowMismatch { index: i, reason });
            if b.tokens.len() != bs {
                return bad("token count differs from the block size");
            }
            if bytes.len() != len {
                return bad("byte length differs from this store's blocks");
            }
            if b.public && public_done {
                return bad("a public block follows a tenant block");
            }
            public_done |= !b.public;
            let salt = if b.public {
                PUBLIC_TENANT.0
            } else {
                chain.tenant.0
            };
            if !(0.0..=1.0).contains(&b.importance) {
                return bad("importance outside 0..=1");
            }
            let h = chain_hash(&self.fingerprint, salt, parent.as_ref(), &b.tokens);
            if h != b.hash.0 {
                return bad("hash differs (another model, KV format, tenant or token list)");
            }
            parent = Some(h);
        }
        Ok(())
    }

    /// Loads a validated chain into the cold tier and the prefix cache (see the module docs).
    pub fn shadow_restore(&mut self, chain: RestoreChain) -> EngineResult<RestoreReport> {
        self.validate_chain(&chain)?;
        let bs = self.config.block_size;
        let mut report = RestoreReport::default();
        let new: Vec<usize> = chain
            .blocks
            .iter()
            .enumerate()
            .filter(|(_, (b, _))| self.cache.get(&b.hash.0).is_none())
            .map(|(i, _)| i)
            .collect();
        if let Some(quota) = chain.cold_quota {
            self.cold_quotas.insert(chain.tenant, quota);
        }
        // The tenant's cold quota bounds what a restore or an import may add, and room is made
        // only out of the tenant's own blocks (or over-quota tenants'), never another's.
        let allowed = new.len().min(self.cold_room_of(chain.tenant));
        if chain.make_room {
            self.trim_cold_for(allowed, Some(&[chain.tenant]))?;
        }
        let room = self.store.free_blocks(Tier::Cold).min(allowed);
        // Leading blocks first: a block is useful only when every block before it is cached.
        let usable = new.get(room).copied().unwrap_or(chain.blocks.len());
        let load: Vec<usize> = new.iter().copied().filter(|&i| i < usable).collect();
        report.no_room = new.len() - load.len();
        report.present = usable - load.len();
        let tags: Vec<BlockTags> = load
            .iter()
            .map(|&i| {
                let b = &chain.blocks[i].0;
                BlockTags {
                    source: b.source,
                    importance: b.importance,
                    tenant: if b.public {
                        PUBLIC_TENANT
                    } else {
                        chain.tenant
                    },
                    session: if b.public { None } else { chain.session },
                    tokens: TokenRange::new((i * bs) as u32, ((i + 1) * bs) as u32),
                }
            })
            .collect();
        let ids = self.store.allocate(Tier::Cold, &tags)?;
        let mut pinned: Vec<(bool, BlockId)> = Vec::new();
        for (&i, &id) in load.iter().zip(&ids) {
            let (b, bytes) = &chain.blocks[i];
            self.store.write_block_bytes(id, bytes)?;
            if !self.cache.insert(b.hash.0, id) {
                // Cannot happen (the hash was absent above); never leak the block.
                self.store.release(&[id])?;
                continue;
            }
            self.history.hand_over(&mut self.store, &b.hash.0, id)?;
            if b.pinned && i < chain.stable_blocks {
                pinned.push((b.public, id));
            }
        }
        report.loaded = load.len();
        report.tokens = usable * bs;
        let ids: Vec<BlockId> = pinned.iter().map(|&(_, id)| id).collect();
        self.pins.pin(&mut self.store, &ids)?;
        if pinned.iter().any(|&(public, _)| public)
            && let (Some(public), Some(user)) = (chain.public_pin_key, chain.pin_key)
        {
            self.public_users
                .entry(public.0)
                .or_default()
                .insert(user.0);
        }
        for (public, id) in pinned {
            let key = if public {
                chain.public_pin_key
            } else {
                chain.pin_key
            };
            if let Some(key) = key {
                self.pins_by_key.entry(key.0).or_default().push(id);
            }
        }
        if let Some(session) = chain.session
            && usable > 0
            && !self.chains.by_key.contains_key(&(chain.tenant, session))
        {
            let key = (chain.tenant, session);
            let public_blocks = chain.blocks.iter().take_while(|(b, _)| b.public).count();
            let record = Chain {
                tokens: chain.blocks[..usable]
                    .iter()
                    .flat_map(|(b, _)| b.tokens.iter().copied())
                    .collect(),
                hashes: chain.blocks[..usable]
                    .iter()
                    .map(|(b, _)| b.hash.0)
                    .collect(),
                public_blocks: public_blocks.min(usable),
                stable_blocks: chain.stable_blocks.min(usable),
                pin_key: chain.pin_key.map(|k| k.0),
                public_pin_key: chain.public_pin_key.map(|k| k.0),
                generation: 0,
            };
            report.generation = self.chains.insert(key, record);
        }
        Ok(report)
    }

    /// The cache keys of a session's recorded chain, if any (the shadow's entry for it).
    pub fn chain_of(&self, key: ChainKey) -> Option<(u64, usize)> {
        self.chains
            .by_key
            .get(&key)
            .map(|c| (c.generation, c.hashes.len()))
    }
}
