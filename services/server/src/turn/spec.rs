//! A built prompt as the engine takes it: tokenized segment by segment (each distinct text once,
//! whichever turn shows it first), tagged with source layers, the tenant's salt, quotas and pin
//! keys.

use std::sync::Arc;

use engram_context::{BuiltContext, Turn as Said, Volatility};
use engram_engine::{PromptSegment, SequenceSpec};
use engram_kvcore::{SessionId, SourceLayer};

use super::{Turn, TurnError, pin_key, public_pin_key};
use engram_memory::Neighbourhood;

impl Turn {
    /// The tokens of `text`: tokenized on first use, then reused by every turn (see
    /// `crate::tokens`).
    pub(super) fn tokens(&self, text: &str) -> Result<Arc<[u32]>, TurnError> {
        let tok = self.state.engine()?.tokenizer();
        Ok(self.state.tokens.get_or_encode(
            self.kv_tenant,
            self.kv_session.map(|s| s.0),
            text,
            |t| tok.encode(t),
        )?)
    }

    /// `built` as a sequence filed under the turn's session key, with the segments `keep`
    /// selects.
    pub fn spec(
        &self,
        built: &BuiltContext,
        keep: impl Fn(Volatility) -> bool,
    ) -> Result<SequenceSpec, TurnError> {
        self.spec_in(built, self.kv_session, keep)
    }

    /// `built` as a sequence filed under `session`.
    pub fn spec_in(
        &self,
        built: &BuiltContext,
        session: Option<SessionId>,
        keep: impl Fn(Volatility) -> bool,
    ) -> Result<SequenceSpec, TurnError> {
        let public = built.public_segments();
        let mut public_tokens = 0;
        let mut segments = Vec::with_capacity(built.segments.len());
        for (i, s) in built.segments.iter().enumerate() {
            if !keep(s.volatility) {
                continue;
            }
            let tokens = self.tokens(&s.text)?.to_vec();
            if i < public {
                public_tokens += tokens.len();
            }
            segments.push(PromptSegment {
                tokens,
                source: s.source,
                importance: s.importance,
            });
        }
        let quotas = &self.tenant.quotas;
        Ok(SequenceSpec {
            segments,
            tenant: self.kv_tenant,
            session,
            reuse: Default::default(),
            hot_block_quota: usize::try_from(quotas.hot_blocks).ok(),
            pin_key: Some(pin_key(&self.tenant, built)),
            cold_block_quota: usize::try_from(quotas.cold_blocks).ok(),
            public_tokens,
            public_pin_key: public_pin_key(built),
        })
    }

    /// The canonical prefix after `history`: everything but the volatile block and the
    /// (placeholder) message, with `memories`. Prefilled after each turn so the next one finds
    /// it.
    pub fn canonical_spec(
        &self,
        history: &[Said],
        memories: Option<&Neighbourhood>,
    ) -> Result<SequenceSpec, TurnError> {
        let next = self.build_for(history, ".", memories, 0)?;
        self.spec(&next, |v| v != Volatility::Volatile)
    }

    /// The prompt of a neighbourhood as the agent's next turn after `history` would show it —
    /// the conversation's prefix, then the memories at the head of the volatile block — cut
    /// after the memories layer, and that layer's segment index; `None` when the prompt has no
    /// memories layer.
    pub fn memories_prompt(
        &self,
        history: &[Said],
        memories: &Neighbourhood,
    ) -> Result<Option<(SequenceSpec, usize)>, TurnError> {
        let built = self.build_for(history, ".", Some(memories), 0)?;
        let Some(at) = built
            .segments
            .iter()
            .position(|s| s.source == SourceLayer::Memories && s.text.starts_with("## "))
        else {
            return Ok(None);
        };
        let mut spec = self.spec_in(&built, None, |_| true)?;
        spec.segments.truncate(at + 1);
        Ok(Some((spec, at)))
    }
}
