//! Reservations: a recalled neighbourhood's memories layer computed ahead in the cold tier, so
//! the turn that shows it finds its KV.

use engram_context::Turn as Said;
use engram_engine::ReserveRequest;
use serde::Serialize;

use super::{Answer, Turn, TurnError};
use crate::metrics::PrefetchOutcome;
use engram_memory::Neighbourhood;

/// What a prefetch did.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Prefetch {
    /// What the request did.
    pub outcome: PrefetchOutcome,
    /// The reservation made (`reserved` only).
    pub reservation: Option<u64>,
    /// The memory nodes the neighbourhood of the text holds, in the order the memories layer
    /// would show them.
    pub memories: Vec<u64>,
}

impl Turn {
    /// Reserves cold-tier blocks for `memories` as the next turn after `history` would show
    /// them (see `EngineCore::reserve`); answers the reservation id, or `None` when the agent's
    /// prompt has no memories layer.
    pub async fn reserve(
        &self,
        history: &[Said],
        memories: &Neighbourhood,
    ) -> Result<Option<u64>, TurnError> {
        let Some((spec, segment)) = self.memories_prompt(history, memories)? else {
            return Ok(None);
        };
        let state = &self.state;
        let ttl = std::time::Duration::from_secs(state.memory()?.config().reservation_ttl_secs);
        let id = state
            .engine()?
            .reserve(ReserveRequest {
                spec,
                segment,
                labels: memories.ids(),
                ttl,
            })?
            .answer()
            .await??;
        Ok(Some(id.0))
    }

    /// Query-time prefetch: the neighbourhood of `text` (what the user is typing) recalled as
    /// the session's next turn would recall it, and its memories layer reserved in the cold
    /// tier as that turn's prompt will hold it — unless the session's last prefetch reserved
    /// the same neighbourhood. A full cold tier or queue is an outcome, not an error.
    pub async fn prefetch(&self, text: &str) -> Result<Prefetch, TurnError> {
        let log = self.history().await?;
        let since = self.window_since(&log, text)?;
        let nothing = |memories| Prefetch {
            outcome: PrefetchOutcome::Nothing,
            reservation: None,
            memories,
        };
        let Some(n) = self
            .neighbourhood(self.session.as_deref(), since, text)
            .await?
        else {
            return Ok(nothing(Vec::new()));
        };
        let ids = n.ids();
        let key = self.kv_session.map(|s| (self.kv_tenant, s.0));
        if let Some((tenant, session)) = key
            && self
                .state
                .prefetched
                .get(tenant, session)
                .is_some_and(|last| *last == *ids)
        {
            return Ok(Prefetch {
                outcome: PrefetchOutcome::Unchanged,
                reservation: None,
                memories: ids,
            });
        }
        match self.reserve(&log.said, &n).await {
            Ok(Some(id)) => {
                if let Some((tenant, session)) = key {
                    self.state.prefetched.put(tenant, session, ids.clone());
                }
                Ok(Prefetch {
                    outcome: PrefetchOutcome::Reserved,
                    reservation: Some(id),
                    memories: ids,
                })
            }
            Ok(None) => Ok(nothing(ids)),
            Err(e) if e.is_capacity() => Ok(Prefetch {
                outcome: PrefetchOutcome::Capacity,
                reservation: None,
                memories: ids,
            }),
            Err(e) => Err(e),
        }
    }

    /// A turn of the session shows `memories`: counts a prefetch hit or miss when a prefetch of
    /// the session reserved a neighbourhood since its last turn.
    pub(super) fn settle_prefetch(&self, memories: Option<&Neighbourhood>) {
        let Some(session) = self.kv_session else {
            return;
        };
        if let Some(last) = self.state.prefetched.take(self.kv_tenant, session.0) {
            let shown = memories.map(|n| n.ids()).unwrap_or_default();
            self.state.metrics.count_prefetch_turn(*last == *shown);
        }
    }

    /// After a turn: the neighbourhood of what was just said (the episode's text) is the
    /// likely memories of the next turn (recalled as this turn recalled, `since` its window's
    /// start); unless it is what this turn already showed (and computed), reserve it. A full
    /// cold tier or queue skips the reservation: capacity is not an error of the turn.
    pub(super) async fn reserve_next(
        &self,
        history: &[Said],
        text: &str,
        current: Option<Vec<u64>>,
        since: Option<i64>,
    ) -> Result<(), TurnError> {
        let Some(next) = self
            .neighbourhood(self.session.as_deref(), since, text)
            .await?
        else {
            return Ok(());
        };
        if current.as_deref() == Some(&next.ids()) {
            return Ok(());
        }
        match self.reserve(history, &next).await {
            Ok(_) => Ok(()),
            Err(e) if e.is_capacity() => Ok(()),
            Err(e) => Err(e),
        }
    }
}
