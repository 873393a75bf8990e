//! Computing sequences: prompt chunks, decode steps, and the one forward pass a scheduler step
//! runs for both; blocks are allocated (room made for them) before each pass.

use std::collections::HashSet;

use candle_core::Tensor;
use engram_kvcore::Tier;

use super::{ChunkOutput, EngineCore, PrefillStep, SeqId, StepOutput, block_tags};
use crate::error::{EngineError, EngineResult};
use engram_model::{KvTransform, LogitRows, SeqInput};

impl EngineCore {
    /// Computes the next prefill chunk (at most `prefill_chunk` tokens) of one sequence.
    pub fn prefill_chunk(&mut self, id: SeqId, rows: LogitRows) -> EngineResult<ChunkOutput> {
        let seq = self.seq(id)?;
        let n = seq.prefill_room().min(self.config.prefill_chunk);
        if n == 0 {
            return Err(EngineError::InvalidConfig {
                field: "prefill",
                reason: "the prompt is already computed".into(),
            });
        }
        let logits = self.run(&[(id, n, rows)])?;
        let seq = self.seq(id)?;
        Ok(ChunkOutput {
            logits,
            tokens: n,
            remaining: seq.prompt_len - seq.computed,
        })
    }

    /// Prefills the whole remaining prompt; returns the last position's logits.
    pub fn prefill(&mut self, id: SeqId) -> EngineResult<Vec<f32>> {
        loop {
            let out = self.prefill_chunk(id, LogitRows::Last)?;
            if out.remaining == 0 {
                return Ok(out.logits.squeeze(0)?.to_vec1()?);
            }
        }
    }

    /// Appends one token to each sequence and computes them as one batch; returns each
    /// sequence's next-token logits, in order.
    pub fn decode(&mut self, next: &[(SeqId, u32)]) -> EngineResult<Vec<Vec<f32>>> {
        Ok(self.step(next, None)?.decoded)
    }

    /// One forward pass for everything a scheduler turn computes: one token of each sequence
    /// in `next` (as [`Self::decode`]) and, with `prefill = Some((id, budget))`, the next chunk
    /// of `id`'s prompt, at most `budget` tokens (and at most `prefill_chunk`). The weights are
    /// read once for both, so a prefill delays the decodes by its chunk, not by a forward of
    /// its own. On an error nothing is computed and every sequence is as before.
    pub fn step(
        &mut self,
        next: &[(SeqId, u32)],
        prefill: Option<(SeqId, usize)>,
    ) -> EngineResult<StepOutput> {
        let vocab = self.model.config().vocab_size;
        let mut seen = HashSet::new();
        for &(id, tok) in next {
            let seq = self.seq(id)?;
            if seq.computed < seq.prompt_len || !seen.insert(id) {
                return Err(EngineError::InvalidConfig {
                    field: "decode",
                    reason: format!("sequence {} is not ready to decode once", id.0),
                });
            }
            if tok as usize >= vocab {
                return Err(EngineError::TokenOutOfRange { id: tok, vocab });
            }
            if seq.tokens.len() >= self.model.config().context_length {
                return Err(EngineError::ContextOverflow {
                    requested: seq.tokens.len() + 1,
                    context: self.model.config().context_length,
                });
            }
        }
        let chunk = match prefill {
            Some((id, budget)) => {
                let seq = self.seq(id)?;
                let left = seq.prefill_room();
                let n = left.min(self.config.prefill_chunk).min(budget);
                if n == 0 || seen.contains(&id) {
                    return Err(EngineError::InvalidConfig {
                        field: "prefill",
                        reason: format!("sequence {} has no prompt chunk to compute", id.0),
                    });
                }
                Some((id, n))
            }
            None => None,
        };
        if next.is_empty() && chunk.is_none() {
            return Ok(StepOutput::default());
        }
        for &(id, tok) in next {
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.tokens.push(tok);
            }
        }
        let mut work: Vec<_> = next
            .iter()
            .map(|&(id, _)| (id, 1, LogitRows::Last))
            .collect();
        work.extend(chunk.map(|(id, n)| (id, n, LogitRows::Last)));
        let logits = match self.run(&work) {
            Ok(l) => l,
            Err(e) => {
                // Nothing was computed: take the tokens back.
                for &(id, _) in next {
                    if let Some(seq) = self.seqs.get_mut(&id) {
                        seq.tokens.pop();
                    }
                }
                return Err(e);
            }
        };
        let mut rows = logits.to_vec2::<f32>()?;
        let prefilled = match chunk {
            Some((id, n)) => {
                let last = rows.pop();
                let seq = self.seq(id)?;
                let remaining = seq.prompt_len - seq.computed.min(seq.prompt_len);
                Some(PrefillStep {
                    id,
                    tokens: n,
                    remaining,
                    logits: if remaining == 0 { last } else { None },
                })
            }
            None => None,
        };
        Ok(StepOutput {
            decoded: rows,
            prefilled,
        })
    }

    /// Computes `n` pending tokens of each listed sequence in one forward pass.
    pub(super) fn run(&mut self, work: &[(SeqId, usize, LogitRows)]) -> EngineResult<Tensor> {
        let bs = self.config.block_size;
        let mut need = 0;
        let mut tenants = Vec::new();
        for &(id, n, _) in work {
            let seq = self.seq(id)?;
            if !tenants.contains(&seq.tenant) {
                tenants.push(seq.tenant);
            }
            need += (seq.computed + n)
                .div_ceil(bs)
                .saturating_sub(seq.blocks.len());
        }
        let started = std::time::Instant::now();
        self.make_hot_room(need, &tenants)?;
        for &(id, n, _) in work {
            let tags = {
                let seq = self.seq(id)?;
                let have = seq.blocks.len();
                (have..(seq.computed + n).div_ceil(bs))
                    .map(|b| block_tags(seq, b, bs))
                    .collect::<Vec<_>>()
            };
            let ids = self.store.allocate(Tier::Hot, &tags)?;
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.blocks.extend(ids);
            }
        }
        engram_model::add_forward_times(|t| t.room += started.elapsed().as_secs_f64() * 1e3);
        let seqs = &self.seqs;
        let inputs = work
            .iter()
            .map(|&(id, n, rows)| {
                let seq = seqs.get(&id).ok_or(EngineError::InvalidConfig {
                    field: "sequence",
                    reason: format!("no running sequence {}", id.0),
                })?;
                Ok(SeqInput {
                    tokens: &seq.tokens[seq.computed..seq.computed + n],
                    start: seq.computed,
                    blocks: &seq.blocks,
                    logits: rows,
                    prompt: seq.computed < seq.prompt_len,
                    relocated: seq.relocated_runs(),
                })
            })
            .collect::<EngineResult<Vec<_>>>()?;
        let transform = KvTransform {
            key_means: self.key_means.as_deref(),
            key_scales: self.key_scales.as_deref(),
            probe: self.config.probe.as_ref().map(|t| &*t.0),
        };
        let logits = self
            .model
            .forward_unsynced(&mut self.store, &inputs, transform)?;
        let registered = std::time::Instant::now();
        for &(id, n, _) in work {
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.computed += n;
                // A relocated run and the anchored blocks after it are filled already.
                if let Some(r) = &seq.relocation
                    && seq.computed == r.run.start
                {
                    seq.computed = r.skip_to;
                }
            }
            self.register(id)?;
        }
        self.age_counts();
        engram_model::add_forward_times(|t| t.register += registered.elapsed().as_secs_f64() * 1e3);
        // On a GPU the registration above ran while the card finished the step; this waits.
        if logits.device().is_cpu() {
            return Ok(logits);
        }
        let synced = std::time::Instant::now();
        let logits = logits.to_device(&candle_core::Device::Cpu)?;
        engram_model::add_forward_times(|t| t.sync += synced.elapsed().as_secs_f64() * 1e3);
        Ok(logits)
    }
}
