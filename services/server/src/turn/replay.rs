//! Replay: the blocks of a session's earlier turns and injections that the cache lost,
//! recomputed in order.

use engram_context::Speaker;
use engram_engine::SequenceSpec;

use super::generate::prefill;
use super::{Answer, Log, Turn, TurnError};

impl Turn {
    /// Recomputes, turn by turn, the blocks of the session's earlier turns that the cache lost
    /// (a restart whose shadow was behind the turn log, an eviction). Prefill on the CPU is not
    /// batch-invariant: the same tokens prefilled in one long chunk round differently from the
    /// turn-by-turn prefills that first computed them, and greedy decoding can then drift.
    /// Replaying what each lost turn prefilled — its prompt, then the canonical prefix warmed
    /// after it (see [`Turn::record`]) — and what each injection prefilled (the canonical
    /// prefix after its last entry, see [`Turn::inject`]), all rebuilt from the turn log, in
    /// order gives the blocks a run that never lost them holds, so the next answer equals that
    /// run's. Cheap
    /// when nothing was lost: one prompt build and one cache lookup. Skipped for a stateless
    /// turn, with the memory graph on (past memories layers cannot be rebuilt as they were) and
    /// with `shadow.replay` off. Returns how many prefills were replayed.
    pub async fn replay_lost(&self, log: &Log) -> Result<usize, TurnError> {
        let state = &self.state;
        if self.session.is_none() || !state.config.shadow.replay || state.memory.is_some() {
            return Ok(0);
        }
        let engine = state.engine()?;
        let bs = engine.kv_format().shape.block_size;
        let history = &log.said;
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
        // What the session prefilled, in order: each turn's prompt, then the conversation
        // warmed after its reply; each injection's conversation after its last entry. Back
        // from the last to the last one fully cached; the rest is lost.
        let mut lost = Vec::new();
        for point in prefills(log).into_iter().rev() {
            let spec = match point {
                Prefill::Prompt(i) => {
                    let (message, speaker) = (&history[i].text, history[i].speaker);
                    let built = self.build_as(&history[..i], message, speaker, None, self.reply)?;
                    self.spec(&built, |_| true)?
                }
                Prefill::Conversation(end) => self.canonical_spec(&history[..end], None)?,
            };
            if cached(spec.clone()).await? {
                break;
            }
            lost.push(spec);
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

/// One prefill a session made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prefill {
    /// A turn's prompt: the conversation before entry `i` (a user message), then it.
    Prompt(usize),
    /// The conversation up to entry `end` (exclusive), warmed after a turn or an injection.
    Conversation(usize),
}

/// The prefills of a session's log, in the order they ran.
fn prefills(log: &Log) -> Vec<Prefill> {
    let history = &log.said;
    let mut out = Vec::new();
    let mut injected = log.injected.iter().copied().peekable();
    for (i, t) in history.iter().enumerate() {
        // An injection that ended before this entry ran before it.
        while let Some(end) = injected.next_if(|&e| e <= i) {
            out.push(Prefill::Conversation(end));
        }
        // A turn: its message (the user's, or a tool's result) and the reply after it.
        let answered = history
            .get(i + 1)
            .is_some_and(|n| n.speaker == Speaker::Assistant);
        if t.speaker != Speaker::Assistant && answered {
            out.push(Prefill::Prompt(i));
            out.push(Prefill::Conversation(i + 2));
        }
    }
    out.extend(injected.map(Prefill::Conversation));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_context::Turn as Said;

    fn said(speaker: Speaker) -> Said {
        Said {
            speaker,
            text: "x".into(),
        }
    }

    #[test]
    fn prefills_follow_turns_and_injections_in_order() {
        use Prefill::{Conversation as C, Prompt as P};
        let (u, a, t, s) = (
            said(Speaker::User),
            said(Speaker::Assistant),
            said(Speaker::Tool),
            said(Speaker::System),
        );
        // An injection first, a turn, two injections in a row (one of two entries), a turn.
        let log = Log {
            said: vec![
                t.clone(),
                u.clone(),
                a.clone(),
                t.clone(),
                s,
                t,
                u.clone(),
                a.clone(),
            ],
            injected: vec![1, 4, 6],
            created: Vec::new(),
        };
        assert_eq!(prefills(&log), [C(1), P(1), C(3), C(4), C(6), P(6), C(8)]);
        // Ending with an injection.
        let log = Log {
            said: vec![u.clone(), a.clone(), said(Speaker::Tool)],
            injected: vec![3],
            created: Vec::new(),
        };
        assert_eq!(prefills(&log), [P(0), C(2), C(3)]);
        // A turn whose message is a tool's result (two results, the first logged before it).
        let log = Log {
            said: vec![u, a.clone(), said(Speaker::Tool), said(Speaker::Tool), a],
            injected: vec![],
            created: Vec::new(),
        };
        assert_eq!(prefills(&log), [P(0), C(2), P(3), C(5)]);
    }
}
