//! Reservations: a recalled neighbourhood's memories layer computed ahead in the cold tier, so
//! the turn that shows it finds its KV.

use engram_context::Turn as Said;
use engram_engine::ReserveRequest;

use super::{Answer, Turn, TurnError};
use engram_memory::Neighbourhood;

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
