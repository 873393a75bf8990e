//! Replay: the blocks of a session's earlier turns and injections that the cache lost,
//! recomputed in order.

use engram_context::Speaker;
use engram_engine::{ChainKey, Engine, RestoreChain, SequenceSpec};
use engram_memory::Neighbourhood;
use engram_shadow::{ChainBlocks, Manifest, Shadow, ShadowError, engine_restore};

use super::generate::prefill;
use super::{Answer, Log, Turn, TurnError};
use crate::metrics::MissRead;

impl Turn {
    /// Recomputes, turn by turn, the blocks of the session's earlier turns that the cache lost
    /// (a restart whose shadow was behind the turn log, an eviction). Prefill on the CPU is not
    /// batch-invariant: the same tokens prefilled in one long chunk round differently from the
    /// turn-by-turn prefills that first computed them, and greedy decoding can then drift.
    /// Replaying what each lost turn prefilled — its prompt, then the canonical prefix warmed
    /// after it (see [`Turn::record`]) — and what each injection prefilled (the canonical
    /// prefix after its last entry, see [`Turn::inject`]), all rebuilt from the turn log, in
    /// order gives the blocks a run that never lost them holds, so the next answer equals that
    /// run's. First, when the session's last prefill is not fully cached, the shadow's copy of
    /// the session is read back into the cold tier (disk on a miss, [`Self::read_disk_on_miss`]):
    /// byte-identical blocks, so nothing of them needs replaying. Cheap when nothing was lost:
    /// one prompt build and one cache lookup. Skipped for a stateless turn; the replay (not the
    /// disk read) is skipped with `shadow.replay` off, and with the memory graph on when a lost
    /// turn did not log its memories layer (each turn logs it: a prompt is rebuilt with the
    /// memories it showed, never with a recall made now). Returns how many prefills were
    /// replayed.
    pub async fn replay_lost(&self, log: &Log) -> Result<usize, TurnError> {
        let state = &self.state;
        if self.session.is_none() {
            return Ok(0);
        }
        state.engine()?;
        // A session in the tokens-only archive thaws: its marker goes (the replay below
        // recomputes its blocks from the turn log, and the next flush writes it again).
        if let (Some(shadow), Some(session)) = (&state.shadow, self.kv_session)
            && shadow.is_archived((self.kv_tenant, session))
        {
            match shadow.thawed((self.kv_tenant, session)).await {
                Ok(true) => state.metrics.count_archive(true),
                Ok(false) => {}
                Err(e) => tracing::warn!("shadow: a thawed session's marker stays: {e}"),
            }
        }
        // Disk on a miss: when the cache lost part of what the session's last prefill left
        // (evicted from hot and cold) and the shadow holds more of the session, its blocks go
        // back into the cold tier — checked as at recovery: fingerprint, CRCs, recomputed
        // hashes — and this turn warms them instead of recomputing them.
        // Whether the last prefill is known to be fully cached (then nothing is lost).
        let mut whole = false;
        if state.config.shadow.read_on_miss
            && let Some(&last) = prefills(log).last()
        {
            let (found, want) = self.cached_blocks(self.spec_of(log, last)?).await?;
            if found < want {
                self.read_disk_on_miss(found).await;
            } else {
                whole = true;
            }
        }
        if whole || !state.config.shadow.replay {
            return Ok(0);
        }
        // What the session prefilled, in order: each turn's prompt, then the conversation
        // warmed after its reply; each injection's conversation after its last entry. Back
        // from the last to the last one fully cached; the rest is lost.
        let mut lost = Vec::new();
        for point in prefills(log).into_iter().rev() {
            // With the memory graph on, a prompt is rebuilt only from the memories layer its
            // turn logged (a recall now would find another neighbourhood): a turn logged
            // without it (before the log kept it) stops the replay.
            if state.memory.is_some()
                && let Prefill::Prompt(i) = point
                && log.memories.get(i).is_none_or(Option::is_none)
            {
                return Ok(0);
            }
            let spec = self.spec_of(log, point)?;
            let (found, want) = self.cached_blocks(spec.clone()).await?;
            if found >= want {
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

    /// The spec a prefill of the session's log ran.
    fn spec_of(&self, log: &Log, point: Prefill) -> Result<SequenceSpec, TurnError> {
        let history = &log.said;
        Ok(match point {
            Prefill::Prompt(i) => {
                let (message, speaker) = (&history[i].text, history[i].speaker);
                // The memories layer as the turn showed it (logged with the memory graph on).
                let memories = log
                    .memories
                    .get(i)
                    .and_then(Option::as_deref)
                    .filter(|text| self.state.memory.is_some() && !text.is_empty())
                    .map(|text| Neighbourhood {
                        nodes: Vec::new(),
                        text: text.to_owned(),
                        tokens: 0,
                    });
                let built = self.build_as(
                    &history[..i],
                    message,
                    speaker,
                    memories.as_ref(),
                    self.reply,
                )?;
                self.spec(&built, |_| true)?
            }
            Prefill::Conversation(end) => self.canonical_spec(&history[..end], None)?,
        })
    }

    /// Leading blocks of a prefill cached (hot or cold), and the full blocks it left.
    async fn cached_blocks(&self, spec: SequenceSpec) -> Result<(usize, usize), TurnError> {
        let engine = self.state.engine()?;
        let bs = engine.kv_format().shape.block_size;
        let want = spec
            .segments
            .iter()
            .map(|s| s.tokens.len())
            .sum::<usize>()
            .saturating_sub(1)
            / bs;
        let found = engine.lookup(spec)?.answer().await?;
        Ok((found.hot + found.cold, want))
    }

    /// Reads the session's shadow entry back into the cold tier (see [`Turn::replay_lost`]);
    /// counted in `/metrics`. Never fails the turn: an entry that cannot be used (damaged,
    /// another model, an unreachable store, no cold room) leaves the blocks to be recomputed.
    /// Nothing is read when the shadow holds no more of the chain than the `cached` leading
    /// blocks the cache still has.
    async fn read_disk_on_miss(&self, cached: usize) -> usize {
        let state = &self.state;
        let (Some(shadow), Some(session), Ok(engine)) =
            (&state.shadow, self.kv_session, state.engine())
        else {
            return 0;
        };
        let key = (self.kv_tenant, session);
        match shadow.session_blocks(key).await {
            None if shadow.has_peers() => {
                return self.adopt_from_peer(shadow, engine, key, cached).await;
            }
            None => {
                state.metrics.count_miss_read(MissRead::Absent, 0);
                return 0;
            }
            Some(n) if n <= cached => return 0,
            Some(_) => {}
        }
        let (manifest, blocks) = match shadow.read_session(engine.kv_format(), key).await {
            Ok(read) => read,
            Err(ShadowError::NotFound) => {
                state.metrics.count_miss_read(MissRead::Absent, 0);
                return 0;
            }
            Err(e) => {
                self.failed_read(&e).await;
                return 0;
            }
        };
        match engine_restore(engine, self.restore_chain(key, &manifest, blocks)).await {
            Ok(r) => {
                state
                    .metrics
                    .count_miss_read(MissRead::Loaded, r.loaded as u64);
                r.loaded
            }
            Err(e) => {
                self.failed_read(&e).await;
                0
            }
        }
    }

    /// A session this node's shadow does not hold, looked up in the other nodes' shadows
    /// (`shadow.peers`): found there, it is loaded into the cold tier, written to this node's
    /// shadow and deleted from the peer's — adopted, never duplicated — so a session whose node
    /// is gone resumes its cache here. Returns the blocks loaded.
    async fn adopt_from_peer(
        &self,
        shadow: &Shadow,
        engine: &Engine,
        key: ChainKey,
        cached: usize,
    ) -> usize {
        let state = &self.state;
        let found = match shadow.read_peer_session(engine.kv_format(), key).await {
            Ok(Some(found)) if found.blocks.len() > cached => found,
            Ok(_) => {
                state.metrics.count_miss_read(MissRead::Absent, 0);
                return 0;
            }
            Err(e) => {
                // Another node's entry: left for that node (or its recovery) to judge.
                tracing::warn!(
                    "shadow: a peer's entry could not be read ({e}); the session recomputes"
                );
                state.metrics.count_miss_read(MissRead::Failed, 0);
                return 0;
            }
        };
        let chain = self.restore_chain(key, &found.manifest, found.blocks);
        let loaded = match engine_restore(engine, chain).await {
            Ok(r) => r.loaded,
            Err(e) => {
                tracing::warn!("shadow: a peer's entry was refused ({e}); the session recomputes");
                state.metrics.count_miss_read(MissRead::Failed, 0);
                return 0;
            }
        };
        // Written here first, then released there: a crash between the two leaves two copies
        // (the next miss elsewhere adopts either), never none.
        match shadow.flush(engine, Some(key)).await {
            Ok(_) => {
                if let Err(e) = shadow.release_peer_session(found.peer, key).await {
                    tracing::warn!(
                        "shadow: adopted a session from {} but could not delete it there: {e}",
                        found.location
                    );
                }
            }
            Err(e) => tracing::warn!("shadow: writing an adopted session failed: {e}"),
        }
        state
            .metrics
            .count_miss_read(MissRead::Adopted, loaded as u64);
        loaded
    }

    /// A shadowed chain of this turn's session, to load into the cold tier (room made out of the
    /// tenant's own cold blocks, within its quota).
    fn restore_chain(&self, key: ChainKey, m: &Manifest, blocks: ChainBlocks) -> RestoreChain {
        RestoreChain {
            make_room: true,
            tenant: key.0,
            session: Some(key.1),
            stable_blocks: m.stable_blocks,
            pin_key: m.pin_key,
            public_pin_key: m.public_pin_key,
            cold_quota: usize::try_from(self.tenant.quotas.cold_blocks).ok(),
            blocks,
        }
    }

    /// Counts a read on a miss that could not be used; a damaged entry is removed, so that the
    /// next flush writes the session whole again instead of building on bytes it cannot read.
    async fn failed_read(&self, e: &ShadowError) {
        let state = &self.state;
        state.metrics.count_miss_read(MissRead::Failed, 0);
        let (Some(shadow), Some(session)) = (&state.shadow, self.kv_session) else {
            return;
        };
        if e.is_damage() {
            tracing::warn!(
                "shadow: the session's entry is damaged ({e}); removed, the session \
                 recomputes"
            );
            if let Err(e) = shadow.forget(self.kv_tenant, u64::MAX, session.0).await {
                tracing::warn!("shadow: removing the damaged entry failed: {e}");
            }
        } else {
            tracing::warn!("shadow: read on a miss failed ({e}); the session recomputes");
        }
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
            ..Log::default()
        };
        assert_eq!(prefills(&log), [C(1), P(1), C(3), C(4), C(6), P(6), C(8)]);
        // Ending with an injection.
        let log = Log {
            said: vec![u.clone(), a.clone(), said(Speaker::Tool)],
            injected: vec![3],
            ..Log::default()
        };
        assert_eq!(prefills(&log), [P(0), C(2), C(3)]);
        // A turn whose message is a tool's result (two results, the first logged before it).
        let log = Log {
            said: vec![u, a.clone(), said(Speaker::Tool), said(Speaker::Tool), a],
            injected: vec![],
            ..Log::default()
        };
        assert_eq!(prefills(&log), [P(0), C(2), P(3), C(5)]);
    }
}
