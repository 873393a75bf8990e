//! Prefix reuse: chained block hashes → cached blocks, and the read history of dropped blocks.
//!
//! **Block hashes.** Block `b` of a token sequence hashes
//! `SHA-256("engram-block-v1" ‖ fingerprint ‖ salt ‖ hash(b − 1) ‖ tokens of b)`, where the
//! fingerprint covers the model file and the KV format (codec per layer, rotation seed, block
//! size) and the salt separates tenants. A block's hash therefore names the whole prefix up to its
//! end: equal hashes mean equal KV, and a lookup walks the chain until the first miss. Only full
//! blocks are hashed; a sequence's partial last block is always recomputed.

use std::collections::HashMap;

use engram_kvcore::{BlockId, BlockStore, SessionId, TenantId};
use sha2::{Digest, Sha256};

use crate::error::EngineResult;

/// A chained block hash.
pub type BlockHash = [u8; 32];

/// The hash of a block given its parent's.
pub fn chain_hash(
    fingerprint: &[u8; 32],
    salt: u64,
    parent: Option<&BlockHash>,
    tokens: &[u32],
) -> BlockHash {
    let mut h = Sha256::new();
    h.update(b"engram-block-v1");
    h.update(fingerprint);
    h.update(salt.to_le_bytes());
    h.update(parent.unwrap_or(&[0u8; 32]));
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// Hash → block map, with the inverse for eviction.
#[derive(Debug, Clone, Default)]
pub struct PrefixCache {
    by_hash: HashMap<BlockHash, BlockId>,
    by_block: HashMap<BlockId, BlockHash>,
}

impl PrefixCache {
    /// The block cached under `hash`.
    pub fn get(&self, hash: &BlockHash) -> Option<BlockId> {
        self.by_hash.get(hash).copied()
    }

    /// Registers `id` under `hash`; false (and nothing changes) if either is already known.
    pub fn insert(&mut self, hash: BlockHash, id: BlockId) -> bool {
        if self.by_hash.contains_key(&hash) || self.by_block.contains_key(&id) {
            return false;
        }
        self.by_hash.insert(hash, id);
        self.by_block.insert(id, hash);
        true
    }

    /// Forgets a block; true if it was cached.
    pub fn remove_block(&mut self, id: BlockId) -> bool {
        match self.by_block.remove(&id) {
            Some(h) => {
                self.by_hash.remove(&h);
                true
            }
            None => false,
        }
    }

    /// The hash `id` is cached under.
    pub fn hash_of(&self, id: BlockId) -> Option<&BlockHash> {
        self.by_block.get(&id)
    }

    /// True when `id` is cached.
    pub fn contains_block(&self, id: BlockId) -> bool {
        self.by_block.contains_key(&id)
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// Every cached block.
    pub fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.by_block.keys().copied()
    }
}

/// How often the model read and used blocks that have left the cache, by content: when a cached
/// block is dropped (its conversation deleted, the cold tier full) its counts ([`Carried`]: the
/// steps that read it, [`engram_kvcore::BlockMeta::reads`], and the steps that attended it at
/// all, [`engram_kvcore::BlockMeta::attended`]) are remembered under its chained hash, and a
/// block computed later under the same hash by the same tenant starts with them
/// ([`engram_kvcore::BlockStore::carry_counts`]). An agent's stable prefix is the same tokens in
/// each of its conversations, so its frequencies survive the end of one and the start of the
/// next: attention-aware eviction then tells a busy agent's fresh prefix from an occasional
/// agent's (see `core::evict`). The engine keeps one only with attention-aware eviction
/// (priority-only eviction is the rule from before, with nothing carried).
///
/// Bounded: past `capacity` entries the older half is forgotten (the newest `capacity / 2`
/// stay), so the table costs O(capacity) memory and amortized O(1) per entry.
#[derive(Debug, Clone)]
pub struct ReadHistory {
    entries: HashMap<BlockHash, Remembered>,
    capacity: usize,
    clock: u64,
}

/// A dropped block's counts, handed to the block that replaces it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Carried {
    /// Sampled steps that gave it at least the threshold mass.
    pub reads: u32,
    /// Steps a running sequence attended it (whatever the mass).
    pub attended: u32,
}

impl Carried {
    /// A block's counts from its metadata.
    pub fn of(m: &engram_kvcore::BlockMeta) -> Self {
        Self {
            reads: m.reads(),
            attended: m.attended(),
        }
    }
}

/// One dropped block's counts, its tenant and session, and when they were remembered.
#[derive(Debug, Clone, Copy)]
struct Remembered {
    counts: Carried,
    tenant: TenantId,
    session: Option<SessionId>,
    at: u64,
}

impl ReadHistory {
    /// An empty history of at most `capacity` entries (0: remembers nothing).
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: HashMap::new(),
            capacity,
            clock: 0,
        }
    }

    /// Remembers the counts of the block cached under `hash` for `tenant` (replacing what was
    /// remembered under `hash`), computed by `session`; a block never read nor attended is not
    /// remembered.
    pub fn remember(
        &mut self,
        hash: BlockHash,
        tenant: TenantId,
        session: Option<SessionId>,
        counts: Carried,
    ) {
        if counts == Carried::default() || self.capacity == 0 {
            return;
        }
        self.clock += 1;
        self.entries.insert(
            hash,
            Remembered {
                counts,
                tenant,
                session,
                at: self.clock,
            },
        );
        if self.entries.len() > self.capacity {
            let keep = (self.capacity / 2).max(1);
            let mut stamps: Vec<u64> = self.entries.values().map(|r| r.at).collect();
            let cut = stamps.len() - keep;
            let (_, &mut oldest_kept, _) = stamps.select_nth_unstable(cut);
            self.entries.retain(|_, r| r.at >= oldest_kept);
        }
    }

    /// The counts remembered under `hash` for `tenant` (the tenant the block's metadata names:
    /// the public tenant for a public block), forgotten as they are handed over; another
    /// tenant's entry under the same hash is not handed over.
    pub fn take(&mut self, hash: &BlockHash, tenant: TenantId) -> Option<Carried> {
        match self.entries.get(hash) {
            Some(r) if r.tenant == tenant => self.entries.remove(hash).map(|r| r.counts),
            _ => None,
        }
    }

    /// Gives block `id` of `store`, just cached under `hash`, the counts remembered under it
    /// for the block's tenant (as its metadata names it), if any.
    pub fn hand_over(
        &mut self,
        store: &mut BlockStore,
        hash: &BlockHash,
        id: BlockId,
    ) -> EngineResult<()> {
        let owner = store.metadata().get(id).map(|m| m.tenant());
        if let Some(c) = owner.and_then(|t| self.take(hash, t)) {
            store.carry_counts(id, c.reads, c.attended)?;
        }
        Ok(())
    }

    /// Halves every remembered count (rounding down), as [`BlockStore::halve_counts`] does for
    /// live blocks, and forgets the entries left with nothing.
    pub fn halve(&mut self) {
        self.entries.retain(|_, r| {
            r.counts.reads /= 2;
            r.counts.attended /= 2;
            r.counts != Carried::default()
        });
    }

    /// Forgets the entries of `tenant`'s sessions with `session & mask == value` (a mask of 0:
    /// every entry of the tenant), as a delete of those sessions forgets their blocks.
    pub fn forget(&mut self, tenant: TenantId, mask: u64, value: u64) {
        self.entries.retain(|_, r| {
            r.tenant != tenant || (mask != 0 && r.session.is_none_or(|s| s.0 & mask != value))
        });
    }

    /// Entries held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is remembered.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_chain_and_separate_tenants() {
        let fp = [7u8; 32];
        let a = chain_hash(&fp, 1, None, &[1, 2, 3]);
        assert_eq!(a, chain_hash(&fp, 1, None, &[1, 2, 3]));
        assert_ne!(a, chain_hash(&fp, 2, None, &[1, 2, 3]), "tenant salt");
        assert_ne!(a, chain_hash(&[8u8; 32], 1, None, &[1, 2, 3]), "model");
        let b1 = chain_hash(&fp, 1, Some(&a), &[4]);
        let other_parent = chain_hash(&fp, 1, None, &[1, 2, 9]);
        assert_ne!(b1, chain_hash(&fp, 1, Some(&other_parent), &[4]), "parent");
    }

    #[test]
    fn the_cache_maps_both_ways() {
        let mut c = PrefixCache::default();
        let h = [1u8; 32];
        let id = engram_kvcore_block(5);
        assert!(c.insert(h, id));
        assert!(
            !c.insert(h, engram_kvcore_block(6)),
            "a hash is registered once"
        );
        assert_eq!(c.get(&h), Some(id));
        assert!(c.remove_block(id));
        assert_eq!(c.get(&h), None);
        assert!(c.is_empty());
    }

    fn engram_kvcore_block(n: u64) -> BlockId {
        // Ids are minted by a store; a manifest's id deserializes the same way.
        serde_json::from_str(&n.to_string()).unwrap()
    }

    fn hash(i: u8) -> BlockHash {
        [i; 32]
    }

    fn reads(n: u32) -> Carried {
        Carried {
            reads: n,
            attended: 2 * n,
        }
    }

    #[test]
    fn read_history_hands_reads_to_the_same_tenant_once() {
        let (a, b) = (TenantId(1), TenantId(2));
        let mut h = ReadHistory::new(16);
        h.remember(hash(1), a, None, reads(7));
        h.remember(hash(2), a, None, Carried::default()); // never read nor attended: not remembered
        assert_eq!(h.len(), 1);
        assert_eq!(h.take(&hash(1), b), None, "another tenant gets nothing");
        assert_eq!(h.take(&hash(2), a), None);
        assert_eq!(h.take(&hash(1), a), Some(reads(7)));
        assert_eq!(h.take(&hash(1), a), None, "handed over once");
        let attended_only = Carried {
            reads: 0,
            attended: 3,
        };
        h.remember(hash(6), a, None, attended_only); // attended, never above the threshold
        assert_eq!(h.take(&hash(6), a), Some(attended_only));
        h.remember(hash(3), a, None, reads(4));
        h.remember(hash(3), a, None, reads(9)); // the later count replaces the earlier
        h.remember(hash(4), b, None, reads(5));
        h.forget(a, 0, 0);
        assert_eq!(h.take(&hash(3), a), None);
        assert_eq!(h.take(&hash(4), b), Some(reads(5)));
    }

    #[test]
    fn a_deleted_session_s_read_counts_are_forgotten_and_no_one_else_s() {
        let (a, b) = (TenantId(1), TenantId(2));
        let mut h = ReadHistory::new(16);
        let (s1, s2) = (SessionId(0x10), SessionId(0x20));
        h.remember(hash(1), a, Some(s1), reads(3));
        h.remember(hash(2), a, Some(s2), reads(4));
        h.remember(hash(3), a, None, reads(5));
        h.remember(hash(4), b, Some(s1), reads(6));
        h.forget(a, u64::MAX, s1.0);
        assert_eq!(h.take(&hash(1), a), None, "the deleted session's entry");
        assert_eq!(h.take(&hash(2), a), Some(reads(4)));
        assert_eq!(h.take(&hash(3), a), Some(reads(5)));
        assert_eq!(
            h.take(&hash(4), b),
            Some(reads(6)),
            "another tenant's same key"
        );
    }

    #[test]
    fn halving_the_history_ages_its_counts_and_forgets_what_reaches_nothing() {
        let t = TenantId(1);
        let mut h = ReadHistory::new(16);
        h.remember(hash(1), t, None, reads(5)); // 5 reads, 10 uses
        h.remember(
            hash(2),
            t,
            None,
            Carried {
                reads: 0,
                attended: 1,
            },
        );
        h.halve();
        assert_eq!(
            h.len(),
            1,
            "a single use halves to nothing and is forgotten"
        );
        assert_eq!(
            h.take(&hash(1), t),
            Some(Carried {
                reads: 2,
                attended: 5
            })
        );
    }

    #[test]
    fn read_history_past_capacity_keeps_the_newest_half() {
        let t = TenantId(1);
        let mut h = ReadHistory::new(8);
        for i in 0..9u8 {
            h.remember(hash(i), t, None, reads(u32::from(i) + 1));
        }
        assert_eq!(h.len(), 4);
        for i in 0..5u8 {
            assert_eq!(h.take(&hash(i), t), None, "entry {i} is among the oldest");
        }
        for i in 5..9u8 {
            assert_eq!(h.take(&hash(i), t), Some(reads(u32::from(i) + 1)));
        }
        let mut off = ReadHistory::new(0);
        off.remember(hash(1), t, None, reads(3));
        assert!(off.is_empty());
    }
}
