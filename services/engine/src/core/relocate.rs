//! Relocated segment reuse (issue 26; off unless [`EngineConfig::relocation`] is set).
//!
//! Exact-prefix reuse stops at the first block whose prefix differs: an agent whose identity
//! differs from another's by one line recomputes the rules, capabilities and soul both share.
//! With relocation on, the engine also keeps a **content index** of prompt segments (one prompt
//! layer or message each), keyed by the segment's tokens, the model and KV format, and the
//! tenant — never its position, never across tenants. When a prompt's exact-prefix walk stops
//! and one of its later segments is in the index, the positions the match covers are filled by
//! copying the stored codes from where the segment was computed ([`BlockStore::copy_tokens`]:
//! bytes as stored, nothing re-encoded, any block alignment), and attention reads them with
//! the query-side RoPE shift and the key-mean correction ([`engram_kvcore::Relocation`]).
//!
//! What is computed instead of reused: the partial block the segment starts in and one more
//! whole block (the segment's first block recomputed after its new prefix: the harness
//! `engram eval kv --relocate` measured KL 0.0122 → 0.0101 nats for it), and the prompt's last
//! block, as always.
//!
//! **Never in the exact-prefix cache.** Relocated KV is an approximation (what the segment's
//! keys would be after its new prefix is not what they were after the old one), so the copies
//! are never cached and a chain hash never names them. Blocks computed *after* a relocated run
//! depend on it, so they are cached under hashes that chain from an **anchor** naming the run —
//! the exact hash of the block before it, the exact hashes of the source blocks it was copied
//! from, its positions and shift — which no exact walk can produce. The next turn of the same
//! conversation finds the same segment, copies it again (bytes identical: same source) and
//! continues along the anchored chain, so a conversation after a relocated base is reused turn
//! by turn like any other. Session chain records (what the shadow persists) stop before the run.
//!
//! Each copy counts one relocation on its source blocks (`BlockMeta::relocations`) and records
//! its shift on the copies (`BlockMeta::shift`); [`CacheCounters`](super::CacheCounters) keeps
//! the totals.

use std::collections::HashMap;
use std::sync::Arc;

use engram_kvcore::{BlockId, Relocated, SessionId, TenantId, Tier};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{EngineCore, SeqId, Sequence, block_salt, block_tags};
use crate::error::EngineResult;
use crate::prefix::{BlockHash, chain_hash};

/// Relocated segment reuse (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default, deny_unknown_fields)]
pub struct RelocationPolicy {
    /// Tokens a relocated run must reuse at least (whole blocks); shorter matches are
    /// computed.
    pub min_tokens: usize,
}

impl Default for RelocationPolicy {
    fn default() -> Self {
        Self { min_tokens: 64 }
    }
}

/// Segments the index keeps at most; past it the oldest entries go.
pub const MAX_SEGMENTS: usize = 4096;

/// The exact, cached prefix of a sequence whose segments the index points into.
#[derive(Debug)]
pub(super) struct Source {
    tokens: Vec<u32>,
    /// The cached block of each full block of `tokens`.
    blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
}

#[derive(Debug, Clone)]
struct Entry {
    source: Arc<Source>,
    /// Where the segment starts in the source.
    start: usize,
    tenant: TenantId,
    session: Option<SessionId>,
    stamp: u64,
}

/// Segment key → where it was computed.
#[derive(Debug, Default)]
pub(super) struct SegmentIndex {
    entries: HashMap<[u8; 32], Entry>,
    clock: u64,
}

impl SegmentIndex {
    /// Segments indexed.
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    fn insert(&mut self, key: [u8; 32], mut e: Entry) {
        self.clock += 1;
        e.stamp = self.clock;
        self.entries.insert(key, e);
        if self.entries.len() > MAX_SEGMENTS {
            let mut stamps: Vec<u64> = self.entries.values().map(|e| e.stamp).collect();
            stamps.sort_unstable();
            let cut = stamps[self.entries.len() - MAX_SEGMENTS * 3 / 4];
            self.entries.retain(|_, e| e.stamp >= cut);
        }
    }

    /// Forgets every segment of `tenant`'s sessions matching `mask`/`value` (all of them with
    /// `mask` 0), as [`EngineCore::forget`] does with blocks.
    pub(super) fn forget(&mut self, tenant: TenantId, mask: u64, value: u64) {
        self.entries.retain(|_, e| {
            !(e.tenant == tenant && (mask == 0 || e.session.is_some_and(|s| s.0 & mask == value)))
        });
    }

    /// Forgets everything.
    pub(super) fn clear(&mut self) {
        self.entries.clear();
    }
}

/// A sequence's relocated run and what its prefill skips.
#[derive(Debug, Clone)]
pub(super) struct SeqRelocation {
    /// Positions filled by copying, and the shift their keys are read with.
    pub(super) run: Relocated,
    /// Prefill jumps from `run.start` to here (the run and the anchored blocks cached after
    /// it).
    pub(super) skip_to: usize,
    /// The parent hash of the run's first block.
    pub(super) anchor: BlockHash,
}

/// What [`EngineCore::plan_relocation`] found.
pub(super) struct Plan {
    pub(super) run: Relocated,
    /// The source blocks covering the copied positions.
    pub(super) source_blocks: Vec<BlockId>,
    /// Where the run's first token is within `source_blocks`.
    pub(super) source_offset: usize,
    pub(super) anchor: BlockHash,
}

impl EngineCore {
    /// Segments the content index holds ([`super::EngineConfig::relocation`]).
    pub fn indexed_segments(&self) -> usize {
        self.index.len()
    }

    fn segment_key(&self, tenant: TenantId, tokens: &[u32]) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(b"engram-segment-v1");
        h.update(self.fingerprint);
        h.update(tenant.0.to_le_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        h.finalize().into()
    }

    /// Whether `id` can be copied from: cached, resident, at full precision.
    fn copyable(&self, id: BlockId) -> bool {
        self.cache.contains_block(id)
            && self.store.metadata().get(id).is_some_and(|m| {
                matches!(m.tier(), Tier::Hot | Tier::Cold) && !m.precision().stored_apart()
            })
    }

    /// The first segment of the prompt ending after the exact walk's blocks (`exact`) that the
    /// index holds and that leaves a run of at least `min_tokens` whole blocks to reuse.
    pub(super) fn plan_relocation(
        &mut self,
        tokens: &[u32],
        segments: &[(usize, engram_kvcore::SourceLayer, f32)],
        tenant: TenantId,
        public_blocks: usize,
        exact: &[BlockHash],
    ) -> Option<Plan> {
        let policy = self.config.relocation?;
        let bs = self.config.block_size;
        let hits = exact.len();
        let last_full = (tokens.len() - 1) / bs * bs;
        let mut seg_start = 0;
        for &(end, _, _) in segments {
            let (p, len) = (seg_start, end - seg_start);
            seg_start = end;
            if end <= hits * bs || len < policy.min_tokens {
                continue;
            }
            let key = self.segment_key(tenant, &tokens[p..end]);
            let Some(e) = self.index.entries.get(&key).cloned() else {
                continue;
            };
            let src = &e.source.tokens;
            let common = tokens[p..]
                .iter()
                .zip(src.get(e.start..).unwrap_or_default())
                .take_while(|(a, b)| a == b)
                .count();
            // The partial block the segment starts in and one more are computed after the new
            // prefix; so are the public blocks (cached under the public salt for every tenant,
            // they must be exact).
            let start = ((p.div_ceil(bs) + 1) * bs)
                .max(hits * bs)
                .max(public_blocks * bs);
            let end = ((p + common) / bs * bs).min(last_full);
            if end < start + policy.min_tokens.div_ceil(bs) * bs {
                continue;
            }
            let shift = p as i64 - e.start as i64;
            let source_start = e.start + (start - p);
            let covering = source_start / bs..(source_start + end - start).div_ceil(bs);
            let Some(source_blocks) = e.source.blocks.get(covering.clone()).map(<[_]>::to_vec)
            else {
                continue;
            };
            if !source_blocks.iter().all(|&id| self.copyable(id)) {
                self.index.entries.remove(&key);
                continue;
            }
            // The exact hashes up to the run: the walk's, then the blocks the prefill computes.
            let mut fresh_hashes = Vec::new();
            for b in hits..start / bs {
                let parent = fresh_hashes.last().or(exact.last());
                let h = chain_hash(
                    &self.fingerprint,
                    block_salt(tenant, public_blocks, b),
                    parent,
                    &tokens[b * bs..(b + 1) * bs],
                );
                fresh_hashes.push(h);
            }
            let mut a = Sha256::new();
            a.update(b"engram-relocated-v1");
            a.update(self.fingerprint);
            a.update(tenant.0.to_le_bytes());
            a.update(fresh_hashes.last().or(exact.last()).unwrap_or(&[0u8; 32]));
            for h in &e.source.hashes[covering] {
                a.update(h);
            }
            a.update(shift.to_le_bytes());
            a.update((source_start as u64).to_le_bytes());
            a.update(((end - start) as u64).to_le_bytes());
            return Some(Plan {
                run: Relocated { start, end, shift },
                source_blocks,
                source_offset: source_start - source_start / bs * bs,
                anchor: a.finalize().into(),
            });
        }
        None
    }

    /// The anchored blocks cached after `plan`'s run: the hashes of the run's blocks (never
    /// cached) chain from the anchor, and the walk goes on from the run's end to the first
    /// miss, as the exact walk does. Returns the hits.
    pub(super) fn anchored_hits(
        &self,
        tokens: &[u32],
        tenant: TenantId,
        public_blocks: usize,
        plan: &Plan,
    ) -> Vec<BlockId> {
        let bs = self.config.block_size;
        let mut parent = plan.anchor;
        let mut hits = Vec::new();
        for b in plan.run.start / bs..(tokens.len() - 1) / bs {
            parent = chain_hash(
                &self.fingerprint,
                block_salt(tenant, public_blocks, b),
                Some(&parent),
                &tokens[b * bs..(b + 1) * bs],
            );
            // The run's own blocks are copies, never cached: only their hashes chain.
            if b < plan.run.end / bs {
                continue;
            }
            let Some(id) = self.cache.get(&parent) else {
                break;
            };
            if !matches!(
                self.store.metadata().get(id).map(|m| m.tier()),
                Some(Tier::Hot | Tier::Cold)
            ) {
                break;
            }
            hits.push(id);
        }
        hits
    }

    /// Allocates the blocks of sequence `id` up to `plan`'s run's end — those the prefill
    /// computes before the run, then the run's — copies the run's codes from its source, and
    /// appends the anchored blocks reused after it.
    pub(super) fn fill_relocated(
        &mut self,
        id: SeqId,
        plan: &Plan,
        anchored: &[BlockId],
    ) -> EngineResult<()> {
        let bs = self.config.block_size;
        let tags = {
            let seq = self.seq(id)?;
            (seq.blocks.len()..plan.run.end / bs)
                .map(|b| block_tags(seq, b, bs))
                .collect::<Vec<_>>()
        };
        let fresh = self.store.allocate(Tier::Hot, &tags)?;
        let copies = &fresh[fresh.len() - (plan.run.end - plan.run.start) / bs..];
        let copied = self.store.copy_tokens(
            &plan.source_blocks,
            plan.source_offset,
            copies,
            0,
            plan.run.end - plan.run.start,
            plan.run.shift,
        );
        if let Err(e) = copied {
            self.store.release(&fresh)?;
            return Err(e.into());
        }
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.blocks.extend_from_slice(&fresh);
            seq.blocks.extend_from_slice(anchored);
            // The exact walk may end where the run starts: nothing to compute before it.
            if let Some(r) = &seq.relocation
                && seq.computed == r.run.start
            {
                seq.computed = r.skip_to;
            }
        }
        Ok(())
    }

    /// The parent hash of block `b` of `seq` as [`Self::register`] chains it: exact up to a
    /// relocated run, from the run's anchor after.
    pub(super) fn parent_of(seq: &Sequence, b: usize, bs: usize) -> Option<&BlockHash> {
        match &seq.relocation {
            Some(r) if b == r.run.start / bs => Some(&r.anchor),
            _ => seq.hashes.last(),
        }
    }

    /// Indexes the segments of a sequence whose prompt is computed: each segment long enough
    /// to be relocated, within the sequence's exact and cached prefix.
    pub(super) fn index_segments(&mut self, id: SeqId) {
        let Some(policy) = self.config.relocation else {
            return;
        };
        let bs = self.config.block_size;
        let Some(seq) = self.seqs.get(&id) else {
            return;
        };
        if seq.indexed
            || seq.computed < seq.prompt_len
            || seq.reuse == super::PrefixReuse::Disabled
            || seq.forgotten
        {
            return;
        }
        let exact = seq
            .relocation
            .as_ref()
            .map_or(seq.hashes.len(), |r| r.run.start / bs)
            .min(seq.hashes.len());
        let blocks: Vec<BlockId> = seq.hashes[..exact]
            .iter()
            .map_while(|h| self.cache.get(h))
            .collect();
        let n = blocks.len();
        let source = Arc::new(Source {
            tokens: seq.tokens[..n * bs].to_vec(),
            hashes: seq.hashes[..n].to_vec(),
            blocks,
        });
        let (tenant, session) = (seq.tenant, seq.session);
        let mut keyed = Vec::new();
        let mut start = 0;
        for &(end, _, _) in &seq.segments {
            // A segment reused from here leaves at least `min_tokens` of whole cached blocks.
            if end - start >= policy.min_tokens && start + policy.min_tokens + 2 * bs <= n * bs {
                keyed.push((self.segment_key(tenant, &seq.tokens[start..end]), start));
            }
            start = end;
        }
        if let Some(s) = self.seqs.get_mut(&id) {
            s.indexed = true;
        }
        for (key, start) in keyed {
            // A segment's first source stays while it can be copied from: the blocks cached
            // after its relocations are anchored to it.
            if let Some(e) = self.index.entries.get(&key)
                && e.source
                    .blocks
                    .get(e.start / bs..)
                    .is_some_and(|b| b.iter().all(|&id| self.copyable(id)))
            {
                continue;
            }
            self.index.insert(
                key,
                Entry {
                    source: Arc::clone(&source),
                    start,
                    tenant,
                    session,
                    stamp: 0,
                },
            );
        }
    }
}
