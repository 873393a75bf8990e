//! One turn of the engine thread's work: a forward pass carrying every decoding sequence's
//! next token and a prompt chunk (see [`crate::EngineCore::step`]), and the part-by-part passes
//! it falls back to when that fails.

use super::{Phase, Worker, clone_error, injected_panic};
use crate::core::{FaultKind, SeqId};
use engram_model::LogitRows;

impl Worker {
    /// One forward pass ([`EngineCore::step`]): a token of every decoding sequence and a
    /// prompt chunk of the first request in prefill (else of the oldest reservation), the
    /// chunk within `step_tokens` while anything decodes. If that fails, the parts are run
    /// apart, so an error fails only the sequences it belongs to.
    pub(super) fn compute(&mut self) {
        self.drop_cancelled();
        let batch = self.decoding();
        let request = self
            .running
            .iter()
            .position(|a| !a.finished && matches!(a.phase, Phase::Prefill));
        let chunk = match request {
            Some(i) => Some(self.running[i].id),
            None => self.reserving.first().map(|&(seq, _)| seq),
        };
        if batch.is_empty() && chunk.is_none() {
            return;
        }
        let budget = if batch.is_empty() {
            usize::MAX
        } else {
            self.core
                .config()
                .step_tokens
                .saturating_sub(batch.len())
                .max(1)
        };
        let next: Vec<(SeqId, u32)> = batch.iter().map(|&(_, id, t)| (id, t)).collect();
        self.serving = next.iter().map(|&(id, _)| id).chain(chunk).collect();
        if let Some(i) = request
            && self.fault(FaultKind::Panic, Some(self.running[i].id))
        {
            injected_panic();
        }
        match self.core.step(&next, chunk.map(|id| (id, budget))) {
            Ok(out) => {
                // Indices stay valid: `accept` only marks sequences finished.
                for (&(i, _, _), logits) in batch.iter().zip(&out.decoded) {
                    self.accept(i, logits);
                }
                let done = out.prefilled.filter(|p| p.remaining == 0);
                match (request, done) {
                    (Some(i), Some(p)) => {
                        if let Some(logits) = p.logits {
                            self.accept(i, &logits);
                        }
                    }
                    (None, Some(_)) => self.reservation_done(false),
                    _ => {}
                }
            }
            Err(_) => {
                self.prefill_one();
                self.reserve_one();
                self.decode_all();
            }
        }
        self.reap();
    }

    /// The running sequences in decode: (index, sequence, its last token).
    fn decoding(&self) -> Vec<(usize, SeqId, u32)> {
        self.running
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a.phase {
                Phase::Decode(t) if !a.finished => Some((i, a.id, t)),
                _ => None,
            })
            .collect()
    }

    /// Completes the oldest reservation (its prompt is computed, or it `failed`).
    fn reservation_done(&mut self, failed: bool) {
        if self.reserving.is_empty() {
            return;
        }
        let (seq, id) = self.reserving.remove(0);
        if self.core.complete_reservation(id, failed).is_err() {
            let _ = self.core.drop_sequence(seq);
        }
    }

    fn prefill_one(&mut self) {
        self.drop_cancelled();
        let Some(i) = self
            .running
            .iter()
            .position(|a| !a.finished && matches!(a.phase, Phase::Prefill))
        else {
            return;
        };
        let id = self.running[i].id;
        self.serving = vec![id];
        if self.fault(FaultKind::Panic, Some(id)) {
            injected_panic();
        }
        let result = self
            .core
            .prefill_chunk(id, LogitRows::Last)
            .and_then(|out| {
                if out.remaining > 0 {
                    return Ok(None);
                }
                Ok(Some(out.logits.squeeze(0)?.to_vec1::<f32>()?))
            });
        match result {
            Ok(None) => {}
            Ok(Some(logits)) => self.accept(i, &logits),
            Err(e) => self.fail(i, e),
        }
        self.reap();
    }

    /// Computes one chunk of the oldest reservation when no request is in prefill (so
    /// reservations never delay a turn by more than one chunk).
    fn reserve_one(&mut self) {
        let busy = self
            .running
            .iter()
            .any(|a| !a.finished && matches!(a.phase, Phase::Prefill));
        let Some(&(seq, _)) = self.reserving.first() else {
            return;
        };
        if busy {
            return;
        }
        self.serving = vec![seq];
        match self.core.prefill_chunk(seq, LogitRows::Last) {
            Ok(out) if out.remaining > 0 => {}
            Ok(_) => self.reservation_done(false),
            Err(_) => self.reservation_done(true),
        }
    }

    fn decode_all(&mut self) {
        self.drop_cancelled();
        let batch = self.decoding();
        if batch.is_empty() {
            return;
        }
        let next: Vec<(SeqId, u32)> = batch.iter().map(|&(_, id, t)| (id, t)).collect();
        self.serving = next.iter().map(|&(id, _)| id).collect();
        match self.core.decode(&next) {
            Ok(rows) => {
                // Indices stay valid: `accept` only marks sequences finished.
                for (&(i, _, _), logits) in batch.iter().zip(rows) {
                    self.accept(i, &logits);
                }
            }
            Err(e) => {
                for &(i, _, _) in &batch {
                    self.fail(i, clone_error(&e));
                }
            }
        }
        self.reap();
    }
}
