//! The life of a turn (DESIGN §2), without a transport: the native route (`api/turns.rs`) and
//! the OpenAI route (`api/openai.rs`) are thin handlers over the same steps. Nothing here knows
//! HTTP: a failure is a [`TurnError`], which `error.rs` maps to a status and a code in one
//! place.
//!
//! The steps, in order (`api/turns.rs::create_turn` reads like this list):
//! 1. [`Turn::open`]: the agent and its layers, read once for the whole turn; the session's
//!    cache key.
//! 2. [`Turn::admit`] (`record.rs`): the session name, the message and the session quota.
//! 3. [`Turn::history`] (`prompt.rs`): the session's turn log, read once.
//! 4. [`Turn::replay_lost`] (`replay.rs`): the blocks the cache lost read back from the shadow
//!    (disk on a miss), and the earlier turns whose blocks neither holds prefilled again in
//!    order.
//! 5. [`Turn::context`] (`prompt.rs`): recall the memory graph's neighbourhood — for a stored
//!    session at once with step 4 ([`Turn::prepare`]: recall overlaps the replay) — build the
//!    layered prompt; [`Turn::spec`] (`spec.rs`) tokenizes it segment by segment — each
//!    distinct segment text once, whichever turn or step asks first (`crate::tokens`).
//! 6. [`generate`] (`generate.rs`): the engine's events folded into a [`Generated`].
//! 7. [`Turn::record`] (`record.rs`): the turn log, working memory, the memory graph's
//!    episode, the canonical prefix warmed for the next turn, and in the background the next
//!    turn's likely neighbourhood reserved in the cold tier (`reserve.rs`).
//!
//! Between turns, [`Turn::inject`] (`inject.rs`) appends system text, tool results and events
//! to the session's log and prefills them without generating.
//!
//! A `Turn` owns its values (the state is shared behind an `Arc`): the streaming route hands it
//! to the task that pumps the engine's events and records the turn at the end.

mod generate;
mod inject;
mod keys;
mod prompt;
mod record;
mod replay;
mod reserve;
mod spec;

use std::sync::Arc;

use engram_context::ContextError;
use engram_engine::EngineError;
use engram_kvcore::{SessionId, TenantId};
use engram_store::{Agent, LayerRow, StoreError, Tenant};

pub use generate::{Generated, Step, generate, prefill};
pub use inject::{Entry, Injected, MAX_ENTRIES};
pub use keys::{AGENT_MASK, agent_bits, check_name, pin_key, public_pin_key, session_key, unpin};
pub use prompt::{
    BudgetsUsed, Log, Turned, build_context, history_of, log_of, parse_kind, pipeline_layers,
    said_of,
};
pub use record::session_room;
pub use reserve::Prefetch;

use crate::state::{AppState, SessionSlot, Unavailable};
use engram_memory::MemoryError;

/// Why a step of a turn (or a lookup the handlers share with it) failed. `error.rs` maps each
/// variant to HTTP.
#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    /// The database failed or refused.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The engine failed or refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The prompt could not be built.
    #[error(transparent)]
    Context(#[from] ContextError),
    /// The memory graph failed.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A tenant, agent or session name is not 1–64 characters of letters, digits, `-`, `_`.
    #[error("{what} must be 1–64 characters of letters, digits, `-` or `_`")]
    InvalidName {
        /// Which name.
        what: &'static str,
    },
    /// A layer kind nobody knows.
    #[error(
        "unknown layer kind `{0}` (axioms, identity, rules, capabilities, soul, partner, \
         neurons, memories, system_state, current_time, affect, awareness)"
    )]
    UnknownLayerKind(String),
    /// A stored layer row names a kind this build does not know.
    #[error("stored layer kind `{0}`")]
    StoredLayerKind(String),
    /// The message is empty or over 64 KiB.
    #[error("message must be 1 byte to 64 KiB of text")]
    InvalidMessage,
    /// Entries to inject that are not 1–32 system, tool or event entries with valid names
    /// and contents.
    #[error("{why}")]
    InvalidEntries {
        /// What is wrong.
        why: String,
    },
    /// A new session would exceed the tenant's session quota.
    #[error("the tenant's session quota ({limit}) is used up")]
    SessionQuota {
        /// The quota.
        limit: u64,
    },
    /// Another turn of the session ran for longer than `limits.session_wait_ms`.
    #[error("another turn of this session is running; retry when it has ended")]
    SessionBusy,
    /// The session (its agent, its tenant) was deleted while the turn ran.
    #[error("the session was deleted while the turn ran; the turn was not recorded")]
    SessionDeleted,
    /// The model, the memory graph or the shadow is off.
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// The engine dropped a command without answering it.
    #[error("the engine did not answer")]
    NoAnswer,
    /// The engine closed a generation's stream before its end.
    #[error("the engine closed a stream early")]
    StreamClosed,
}

/// The tokenizer's and template's errors, as the engine reports them (a request's own mistakes
/// keep their engine variants).
impl From<engram_engine::ModelError> for TurnError {
    fn from(e: engram_engine::ModelError) -> Self {
        Self::Engine(e.into())
    }
}

impl TurnError {
    /// A full cold tier or engine queue: capacity, not a fault of the request (a reservation
    /// after a turn is skipped on it).
    pub fn is_capacity(&self) -> bool {
        matches!(
            self,
            Self::Engine(EngineError::NoColdRoom { .. } | EngineError::Overloaded { .. })
        )
    }
}

/// The one reply the engine thread sends to a command.
pub(crate) trait Answer<T> {
    /// Waits for it; [`TurnError::NoAnswer`] if the engine dropped the command.
    async fn answer(self) -> Result<T, TurnError>;
}

impl<T> Answer<T> for flume::Receiver<T> {
    async fn answer(self) -> Result<T, TurnError> {
        self.recv_async().await.map_err(|_| TurnError::NoAnswer)
    }
}

/// Which sessions' memory nodes a recall in `session` of `agent` may see: with the agent's
/// memory scoped to sessions (the default), only that session's and the agent's own (a
/// stateless turn: only the agent's own); otherwise every session's.
pub fn recall_scope(agent: &Agent, session: Option<&str>) -> engram_graph::SessionScope {
    match agent.memory_scope {
        engram_store::MemoryScope::Session => {
            engram_graph::SessionScope::Only(session.map(str::to_string))
        }
        engram_store::MemoryScope::Agent => engram_graph::SessionScope::Every,
    }
}

/// One turn of an agent: the values every step needs, computed once.
#[derive(Debug, Clone)]
pub struct Turn {
    /// What every handler shares.
    pub state: Arc<AppState>,
    /// The caller.
    pub tenant: Tenant,
    /// The request's log span (a turn's figures are recorded on it; a stream's end logs in it).
    pub span: tracing::Span,
    /// The agent.
    pub agent: Agent,
    /// The session whose turn log this turn reads and appends to (`None`: a stateless turn,
    /// whose conversation comes with the request and is not stored).
    pub session: Option<String>,
    /// The key the turn's KV chain is filed under (and shadowed by): the session's, or for a
    /// stateless turn one of its conversation.
    pub kv_session: Option<SessionId>,
    /// The tenant's cache salt: blocks are shared only within it (and public prefixes).
    pub kv_tenant: TenantId,
    /// Tokens the reply may generate: the prompt is fitted to leave room for them.
    pub reply: usize,
    /// The request's `Idempotency-Key`: the turn's answer is stored under it with the turn.
    pub idempotency_key: Option<String>,
    /// Who says the turn's message: the user, or (an OpenAI request ending with tool results)
    /// a tool.
    pub message_speaker: engram_context::Speaker,
    /// Entries of the conversation before the message that the session's log lacks and that
    /// are logged with the turn (an OpenAI request in a session that resends its history: the
    /// tool results before the last, the messages after a fork — `api/history.rs`). The caller
    /// adds them to the history it builds the prompt on.
    pub preface: Vec<engram_context::Turn>,
    /// What the client called the session when its name is a hash of it (an OpenAI `user`
    /// that is not a session name): stored with the session when the turn creates it.
    pub session_label: Option<String>,
    /// Milliseconds the turn spent before the engine ran it: the replay of what the cache lost
    /// and the recall of its memories ([`Turn::prepare`]) with the prompt's build; part of its
    /// time to first token.
    pub prepare_ms: f64,
    /// The agent's current layers, read once when the turn opened.
    layers: Arc<[LayerRow]>,
    /// The request's own system text ([`Turn::set_instructions`]).
    instructions: String,
    /// The layers use DESIGN §2's expanded budgets (decided when the turn opened).
    expanded: bool,
}

impl Turn {
    /// A turn of `agent` (name or id) of `tenant`, in `session` when given: the agent and its
    /// layers are read here, once.
    pub async fn open(
        state: Arc<AppState>,
        tenant: Tenant,
        agent: &str,
        session: Option<&str>,
    ) -> Result<Self, TurnError> {
        let agent = state.agents.agent(&state.store, &tenant.id, agent).await?;
        Self::of(state, tenant, agent, session).await
    }

    /// A turn of an agent already read.
    pub async fn of(
        state: Arc<AppState>,
        tenant: Tenant,
        agent: Agent,
        session: Option<&str>,
    ) -> Result<Self, TurnError> {
        let layers: Arc<[LayerRow]> = state.agents.layers(&state.store, &agent.id).await?;
        let kv_session = session.map(|s| session_key(&agent, s));
        let mut turn = Self {
            kv_tenant: TenantId(tenant.cache_salt),
            reply: engram_engine::SamplingParams::default().max_tokens,
            idempotency_key: None,
            message_speaker: engram_context::Speaker::User,
            preface: Vec::new(),
            session_label: None,
            prepare_ms: 0.0,
            span: tracing::Span::current(),
            session: session.map(str::to_string),
            kv_session,
            state,
            tenant,
            agent,
            layers,
            instructions: String::new(),
            expanded: false,
        };
        turn.expanded = turn.expanded_fit()?;
        Ok(turn)
    }

    /// The agent's layers as the turn read them.
    pub fn layers(&self) -> &[LayerRow] {
        &self.layers
    }

    /// Which sessions' memory nodes this turn's recalls may see ([`recall_scope`]).
    pub fn recall_scope(&self) -> engram_graph::SessionScope {
        recall_scope(&self.agent, self.session.as_deref())
    }

    /// Sets the request's own system text (OpenAI `system` and `developer` messages, the tool
    /// definitions) for this turn: a stable segment after the agent's stable layers, cached
    /// and pinned with the stable prefix (a request that repeats it reuses it), never cut to a
    /// layer's budget.
    pub fn set_instructions(&mut self, text: String) {
        self.instructions = text;
    }

    /// Waits for the turn of the same session that runs, at most `limits.session_wait_ms`;
    /// the slot is the session's until it drops. `None` for a stateless turn.
    pub async fn hold_session(&self) -> Result<Option<SessionSlot>, TurnError> {
        let Some(key) = self.session.as_ref().and(self.kv_session) else {
            return Ok(None);
        };
        match self.state.session_slot(self.kv_tenant, key.0).await {
            Some(slot) => Ok(Some(slot)),
            None => Err(TurnError::SessionBusy),
        }
    }

    /// The answer stored with an earlier run of this turn (same session, same
    /// `Idempotency-Key`), if there was one.
    pub async fn stored_reply(&self) -> Result<Option<String>, TurnError> {
        let (Some(session), Some(key)) = (&self.session, &self.idempotency_key) else {
            return Ok(None);
        };
        Ok(self
            .state
            .store
            .turn_reply(&self.agent.id, session, key)
            .await?)
    }
}
