//! Admission: what the caches hold for a prompt, and admitting it (exact-prefix walk, cold
//! blocks warmed, relocated runs filled).

use engram_kvcore::{BlockId, PinState, Precision, TenantId, Tier};

use super::{
    Admission, EngineCore, PrefixLookup, PrefixReuse, SeqId, Sequence, SequenceSpec, block_salt,
    relocate,
};
use crate::error::{EngineError, EngineResult};
use crate::prefix::{BlockHash, chain_hash};

impl EngineCore {
    /// What [`Self::start`] would reuse for `spec`, without admitting it: the leading cached
    /// blocks that are hot and cold, and the prompt's total blocks.
    pub fn lookup(&self, spec: &SequenceSpec) -> PrefixLookup {
        let tokens: Vec<u32> = spec
            .segments
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let bs = self.config.block_size;
        let mut out = PrefixLookup {
            hot: 0,
            cold: 0,
            blocks: tokens.len().div_ceil(bs),
        };
        if spec.reuse == PrefixReuse::Disabled || tokens.is_empty() {
            return out;
        }
        let public_blocks = spec.public_tokens.min(tokens.len()) / bs;
        for h in self.prompt_hashes(spec.tenant, public_blocks, &tokens) {
            let tier = self
                .cache
                .get(&h)
                .and_then(|id| self.store.metadata().get(id))
                .map(|m| m.tier());
            match tier {
                Some(Tier::Hot) => out.hot += 1,
                Some(Tier::Cold) => out.cold += 1,
                _ => break,
            }
        }
        out
    }

    /// The chained hashes of the full blocks of `tokens` before its last token, in order,
    /// computed as they are taken (a walk stops at its first miss).
    fn prompt_hashes<'a>(
        &'a self,
        tenant: TenantId,
        public_blocks: usize,
        tokens: &'a [u32],
    ) -> impl Iterator<Item = BlockHash> + 'a {
        let bs = self.config.block_size;
        (0..tokens.len().saturating_sub(1) / bs).scan(None::<BlockHash>, move |parent, b| {
            let h = chain_hash(
                &self.fingerprint,
                block_salt(tenant, public_blocks, b),
                parent.as_ref(),
                &tokens[b * bs..(b + 1) * bs],
            );
            *parent = Some(h);
            Some(h)
        })
    }

    /// Admits a sequence: reuses its longest cached prefix (see the module docs).
    pub fn start(&mut self, spec: SequenceSpec) -> EngineResult<(SeqId, Admission)> {
        let mut tokens = Vec::new();
        let mut segments = Vec::with_capacity(spec.segments.len());
        for seg in &spec.segments {
            if !(0.0..=1.0).contains(&seg.importance) {
                return Err(EngineError::Kv(engram_kvcore::KvError::InvalidImportance {
                    value: seg.importance,
                }));
            }
            tokens.extend_from_slice(&seg.tokens);
            segments.push((tokens.len(), seg.source, seg.importance));
        }
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let cfg = self.model.config();
        if tokens.len() > cfg.context_length {
            return Err(EngineError::ContextOverflow {
                requested: tokens.len(),
                context: cfg.context_length,
            });
        }
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(EngineError::TokenOutOfRange {
                id,
                vocab: cfg.vocab_size,
            });
        }
        let bs = self.config.block_size;
        if let Some(quota) = spec.hot_block_quota {
            let used: usize = self
                .seqs
                .values()
                .filter(|s| s.tenant == spec.tenant)
                .map(|s| s.blocks.len().max(s.prompt_len.div_ceil(bs)))
                .sum();
            let wanted = tokens.len().div_ceil(bs);
            if used + wanted > quota {
                return Err(EngineError::QuotaExceeded {
                    resource: "hot_blocks",
                    requested: used + wanted,
                    quota,
                });
            }
        }
        if spec.public_tokens > tokens.len() {
            return Err(EngineError::InvalidConfig {
                field: "public_tokens",
                reason: format!(
                    "{} public tokens in a prompt of {}",
                    spec.public_tokens,
                    tokens.len()
                ),
            });
        }
        let public_blocks = spec.public_tokens / bs;
        if let Some(quota) = spec.cold_block_quota {
            self.cold_quotas.insert(spec.tenant, quota);
        }
        if public_blocks > 0
            && let (Some(public), Some(user)) = (spec.public_pin_key, spec.pin_key)
        {
            self.public_users.entry(public).or_default().insert(user);
        }
        let mut hits = Vec::new();
        let mut hashes = Vec::new();
        if spec.reuse == PrefixReuse::Enabled {
            let mut stale = None;
            for h in self.prompt_hashes(spec.tenant, public_blocks, &tokens) {
                let Some(id) = self.cache.get(&h) else { break };
                let tier = self.store.metadata().get(id).map(|m| m.tier());
                if !matches!(tier, Some(Tier::Hot | Tier::Cold)) {
                    stale = Some(id);
                    break;
                }
                hits.push(id);
                hashes.push(h);
            }
            if let Some(id) = stale {
                self.drop_cached(id)?;
            }
        }
        // Relocated reuse: a later segment cached at another position, and the blocks cached
        // after it under its anchor.
        let plan = match spec.reuse {
            PrefixReuse::Enabled => {
                self.plan_relocation(&tokens, &segments, spec.tenant, public_blocks, &hashes)
            }
            PrefixReuse::Disabled => None,
        };
        let anchored = plan.as_ref().map_or_else(Vec::new, |p| {
            self.anchored_hits(&tokens, spec.tenant, public_blocks, p)
        });
        // Reused blocks with their places in the block table.
        let mut reused: Vec<(usize, BlockId)> = hits.iter().copied().enumerate().collect();
        if let Some(p) = &plan {
            reused.extend(
                anchored
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| (p.run.end / bs + i, b)),
            );
        }
        let reused_ids: Vec<BlockId> = reused.iter().map(|&(_, b)| b).collect();
        self.store.retain(&reused_ids)?;
        let reserved_blocks = self.claim_reservations(&reused_ids)?;
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        let cached_tokens = hits.len() * bs;
        self.seqs.insert(
            id,
            Sequence {
                prompt_len: tokens.len(),
                tokens,
                segments,
                blocks: hits.clone(),
                computed: cached_tokens,
                hashes,
                tenant: spec.tenant,
                session: spec.session,
                reuse: spec.reuse,
                pin_key: spec.pin_key,
                public_blocks,
                public_pin_key: spec.public_pin_key,
                forgotten: false,
                relocation: plan.as_ref().map(|p| relocate::SeqRelocation {
                    run: p.run,
                    skip_to: p.run.end + anchored.len() * bs,
                    anchor: p.anchor,
                }),
                indexed: false,
            },
        );
        let cold: Vec<BlockId> = reused_ids
            .iter()
            .copied()
            .filter(|&b| self.store.metadata().get(b).map(|m| m.tier()) == Some(Tier::Cold))
            .collect();
        // Blocks the table needs now besides the reused: those the prefill computes before the
        // run, and the run's copies.
        let new_blocks = plan.as_ref().map_or(0, |p| p.run.end / bs - hits.len());
        let copies = plan.as_ref().map_or(0, |p| (p.run.end - p.run.start) / bs);
        let full = self
            .seqs
            .get(&id)
            .map_or(0, |s| s.prompt_len.saturating_sub(1) / bs);
        let hot_blocks = reused_ids.len() - cold.len();
        let computed_blocks = full.saturating_sub(reused_ids.len() + copies);
        if spec.reuse == PrefixReuse::Enabled {
            self.counters.hot_hits += hot_blocks as u64;
            self.counters.cold_hits += cold.len() as u64;
            self.counters.misses += computed_blocks as u64;
        }
        let down_tiered = cold
            .iter()
            .filter(|&&b| {
                self.store.metadata().get(b).map(|m| m.precision()) == Some(Precision::Reduced)
            })
            .count() as u64;
        // The copy's sources are held (and never chosen to make room) until it is done.
        if let Some(p) = &plan {
            self.store.retain(&p.source_blocks)?;
            self.relocating = p.source_blocks.clone();
        }
        let warmed = self
            .make_hot_room(cold.len() + new_blocks, &[spec.tenant])
            .and_then(|()| {
                self.store.warm(&cold)?;
                self.store.touch(&reused_ids)?;
                // A reused stable block whose pin was released (its first owner's prefix changed)
                // is pinned again under this sequence's key.
                let unpinned: Vec<(usize, BlockId)> = reused
                    .iter()
                    .copied()
                    .filter(|&(_, b)| {
                        self.store.metadata().get(b).is_some_and(|m| {
                            m.pin() == PinState::Unpinned
                                && self.config.pin_policy.sources.contains(&m.source())
                        })
                    })
                    .collect();
                self.pin_blocks(id, &unpinned)?;
                match &plan {
                    Some(p) => self.fill_relocated(id, p, &anchored),
                    None => Ok(()),
                }
            });
        if let Some(p) = &plan {
            self.relocating.clear();
            self.store.release(&p.source_blocks)?;
        }
        if let Err(e) = warmed {
            // The anchored blocks join the table only once the run is filled.
            if self
                .seqs
                .get(&id)
                .is_some_and(|s| s.blocks.len() == hits.len())
            {
                self.store.release(&anchored)?;
            }
            self.finish(id)?;
            return Err(e);
        }
        self.counters.down_tier_hits += down_tiered;
        if plan.is_some() {
            self.counters.relocated_runs += 1;
            self.counters.relocated_blocks += copies as u64;
        }
        let admission = Admission {
            prompt_tokens: self.seqs.get(&id).map_or(0, |s| s.prompt_len),
            cached_tokens,
            hot_blocks,
            warmed_blocks: cold.len(),
            computed_blocks,
            reserved_blocks,
            relocated_tokens: self
                .seqs
                .get(&id)
                .and_then(|s| s.relocation.as_ref())
                .map_or(0, |r| r.skip_to - r.run.start),
        };
        Ok((id, admission))
    }
}
