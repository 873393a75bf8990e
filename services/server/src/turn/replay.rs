//! Replay: the blocks of a session's earlier turns that the cache lost, recomputed in order.

use engram_context::{Speaker, Turn as Said};
use engram_engine::SequenceSpec;

use super::generate::prefill;
use super::{Answer, Turn, TurnError};

impl Turn {
    /// Recomputes, turn by turn, the blocks of the session's earlier turns that the cache lost
    /// (a restart whose shadow was behind the turn log, an eviction). Prefill on the CPU is not
    /// batch-invariant: the same tokens prefilled in one long chunk round differently from the
    /// turn-by-turn prefills that first computed them, and greedy decoding can then drift.
    /// Replaying what each lost turn prefilled — its prompt, then the canonical prefix warmed
    /// after it (see [`Turn::record`]), both rebuilt from the turn log — in order gives the
    /// blocks a run that never lost them holds, so the next answer equals that run's. Cheap
    /// when nothing was lost: one prompt build and one cache lookup. Skipped for a stateless
    /// turn, with the memory graph on (past memories layers cannot be rebuilt as they were) and
    /// with `shadow.replay` off. Returns how many prefills were replayed.
    pub async fn replay_lost(&self, history: &[Said]) -> Result<usize, TurnError> {
        let state = &self.state;
        if self.session.is_none() || !state.config.shadow.replay || state.memory.is_some() {
            return Ok(0);
        }
        let engine = state.engine()?;
        let bs = engine.kv_format().shape.block_size;
        let users: Vec<usize> = history
            .iter()
            .enumerate()
            .filter(|(_, t)| t.speaker == Speaker::User)
            .map(|(i, _)| i)
            .collect();
        // Whether a prefill is cached as far as it left it.
        let cached = |spec: SequenceSpec| async move {
            let want = spec
                .segments
                .iter()
                .map(|s| s.tokens.len())
                .sum::<usize>()
                .saturating_sub(1)
                / bs;
            let found = engine.lookup(spec)?.answer().await?;
            Ok::<bool, TurnError>(found.hot + found.cold >= want)
        };
        // What the session's turns prefilled, in order: each turn's prompt, then the canonical
        // prefix warmed after it. Back from the last to the last one fully cached; the rest is
        // lost.
        let mut lost = Vec::new();
        for &i in users.iter().rev() {
            let after = &history[..(i + 2).min(history.len())];
            let warmed = self.canonical_spec(after, None)?;
            if cached(warmed.clone()).await? {
                break;
            }
            lost.push(warmed);
            let built = self.build(&history[..i], &history[i].text, None)?;
            let prompt = self.spec(&built, |_| true)?;
            if cached(prompt.clone()).await? {
                break;
            }
            lost.push(prompt);
        }
        lost.reverse();
        let replayed = lost.len();
        for spec in lost {
            prefill(state, spec).await?;
        }
        if replayed > 0 {
            state.metrics.count_replayed(replayed as u64);
        }
        Ok(replayed)
    }
}
