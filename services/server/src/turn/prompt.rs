//! The prompt of a turn: the agent's layers (with the memory graph's neighbourhood in the
//! memories layer) and the session's history, built under the layers' budgets.

use std::time::Instant;

use engram_context::{
    Budgets, BuiltContext, ContextRequest, Fit, Layer, LayerKind, Speaker, TokenCounter,
    Turn as Said, Volatility, build,
};
use engram_store::{Agent, LayerRow, Role};

use super::{Answer, Turn, TurnError};
use crate::state::AppState;
use engram_engine::PrefixLookup;
use engram_memory::{Neighbourhood, RecallQuery, now_ms, render};

/// A layer kind by name (`system_state`, …).
pub fn parse_kind(s: &str) -> Result<LayerKind, TurnError> {
    LayerKind::parse(s).ok_or_else(|| TurnError::UnknownLayerKind(s.to_string()))
}

/// Stored layer rows as the context pipeline takes them, with `memories` (a recalled
/// neighbourhood) appended to the memories layer.
pub fn pipeline_layers(
    rows: &[LayerRow],
    memories: Option<&Neighbourhood>,
) -> Result<Vec<Layer>, TurnError> {
    let mut layers = rows
        .iter()
        .map(|r| {
            let kind =
                parse_kind(&r.kind).map_err(|_| TurnError::StoredLayerKind(r.kind.clone()))?;
            Ok(Layer {
                kind,
                content: r.content.clone(),
                budget: r.budget as usize,
                volatility: if r.stable {
                    Volatility::Stable
                } else {
                    match kind.default_volatility() {
                        Volatility::Stable => Volatility::Slow,
                        v => v,
                    }
                },
                importance: r.importance as f32,
                public: r.public && r.stable,
            })
        })
        .collect::<Result<Vec<_>, TurnError>>()?;
    if let Some(m) = memories.filter(|m| !m.text.is_empty()) {
        match layers.iter_mut().find(|l| l.kind == LayerKind::Memories) {
            Some(l) if l.content.trim().is_empty() => l.content = m.text.clone(),
            Some(l) => l.content = format!("{}\n{}", l.content.trim_end(), m.text),
            None => layers.push(Layer::new(LayerKind::Memories, m.text.clone())),
        }
    }
    Ok(layers)
}

/// A session's turn log as the prompt shows it, with the steps its KV was prefilled in.
#[derive(Debug, Clone, Default)]
pub struct Log {
    /// The conversation: turns and injected entries, in order.
    pub said: Vec<Said>,
    /// Where injections prefilled the conversation: after `said[..e]` for each `e`, ascending
    /// (turns prefill their prompt and then the conversation after their reply; see
    /// [`Turn::replay_lost`]).
    pub injected: Vec<usize>,
    /// When each entry was logged (ms); empty for a conversation that is not stored.
    pub created: Vec<i64>,
    /// The memories layer each entry's turn showed, when logged (see
    /// `engram_store::TurnRow::memories`); empty for a conversation that is not stored.
    pub memories: Vec<Option<String>>,
}

impl Log {
    /// A conversation that is not stored (a stateless request's).
    pub fn unstored(said: Vec<Said>) -> Self {
        Self {
            said,
            ..Self::default()
        }
    }
}

/// An entry of the log as the conversation shows it: user and assistant text as said, an
/// injected tool result in the `tool` role, injected system text and events in the `system`
/// role, each under its name.
pub fn said_of(role: Role, name: Option<&str>, text: &str) -> Said {
    let (speaker, text) = match (role, name) {
        (Role::User, _) => (Speaker::User, text.to_string()),
        (Role::Assistant, _) => (Speaker::Assistant, text.to_string()),
        (Role::Tool, Some(n)) => (Speaker::Tool, format!("Result of {n}:\n{text}")),
        (Role::Tool, None) => (Speaker::Tool, text.to_string()),
        (Role::System, Some(n)) => (Speaker::System, format!("{n}: {text}")),
        (Role::System, None) => (Speaker::System, text.to_string()),
        (Role::Event, Some(n)) => (Speaker::System, format!("Event from {n}: {text}")),
        (Role::Event, None) => (Speaker::System, format!("Event: {text}")),
    };
    Said { speaker, text }
}

/// A session's turn log as the context pipeline takes it.
pub async fn history_of(state: &AppState, agent: &Agent, session: &str) -> Result<Log, TurnError> {
    Ok(log_of(&state.store.turns(&agent.id, session).await?))
}

/// The log of a session's rows, in order.
pub fn log_of(rows: &[engram_store::TurnRow]) -> Log {
    let mut log = Log::default();
    for (i, t) in rows.iter().enumerate() {
        log.said.push(said_of(t.role, t.name.as_deref(), &t.text));
        log.created.push(t.created_at);
        log.memories.push(t.memories.clone());
        // An entry a reply follows is a turn's message (a tool's result, on the OpenAI route),
        // not an injection.
        let answered = rows.get(i + 1).is_some_and(|n| n.role == Role::Assistant);
        if t.role.is_injected() && t.ends_prefill && !answered {
            log.injected.push(i + 1);
        }
    }
    log
}

/// The prompt `agent` would build for `message` now (no memories), outside a turn: the
/// layer edits and deletes compare the stable prefixes before and after.
pub async fn build_context(
    state: &AppState,
    agent: &Agent,
    session: Option<&str>,
    message: &str,
) -> Result<BuiltContext, TurnError> {
    let history = match session {
        Some(s) => history_of(state, agent, s).await?.said,
        None => Vec::new(),
    };
    let layers = pipeline_layers(&state.store.layers(&agent.id).await?, None)?;
    let req = ContextRequest {
        layers: &layers,
        history: &history,
        user_message: message,
        message_speaker: Speaker::User,
        fit: None,
        format: state.chat_format(),
        instructions: "",
    };
    Ok(build(&req, &state.counter())?)
}

/// A layer's expanded budget: DESIGN §2's when its budget is the standard one, else its own.
fn expanded_budget(l: &Layer) -> usize {
    if l.budget == Budgets::standard().get(l.kind) {
        Budgets::expanded().get(l.kind)
    } else {
        l.budget
    }
}

/// Which budgets a turn's layers were fitted to.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct BudgetsUsed {
    /// `standard`, or `expanded` (DESIGN §2's larger budgets, when they fit the context).
    pub set: &'static str,
    /// Tokens of context the prompt and the reply fit in.
    pub context: usize,
    /// The layers' budgets were multiplied by this (1 when they fit in half the context).
    pub scale: f64,
    /// Tokens the conversation's steady window holds.
    pub window: usize,
    /// Oldest turns of the conversation left out of the prompt (still in the turn log and the
    /// memory graph).
    pub dropped_turns: usize,
}

/// A turn's prompt and what went into it.
#[derive(Debug, Clone)]
pub struct Turned {
    /// The built prompt.
    pub built: BuiltContext,
    /// The conversation before this turn's message.
    pub history: Vec<Said>,
    /// The recalled neighbourhood shown in the memories layer.
    pub memories: Option<Neighbourhood>,
    /// The session's own episodes since this time (ms) were not recalled: the conversation
    /// shows them (`None`: none of its episodes were).
    pub since: Option<i64>,
    /// When the turn started (a delete after it wins over its record).
    pub started: Instant,
    /// Where the prompt's leading blocks were when the turn arrived, before the replay of what
    /// the cache lost recomputed any (see [`Turn::prepare`]); `None` for a stateless turn, with
    /// the memory graph on (the prompt is built after the recall) and without an engine.
    pub arrival: Option<PrefixLookup>,
}

impl Turn {
    /// The session's turn log (empty for a stateless turn).
    pub async fn history(&self) -> Result<Log, TurnError> {
        match &self.session {
            Some(s) => history_of(&self.state, &self.agent, s).await,
            None => Ok(Log::default()),
        }
    }

    /// Tokens of context a prompt and its reply fit in: the model's, or `model.context_tokens`
    /// when smaller; `None` without a model.
    pub fn context_tokens(&self) -> Option<usize> {
        let model = self.state.engine().ok()?.model_config().context_length;
        Some(match self.state.config.model.context_tokens {
            0 => model,
            cap => cap.min(model),
        })
    }

    /// The prompt after `history` for `message`, over the layers the turn read, fitted with
    /// room for a reply of [`Turn::reply`] tokens.
    pub fn build(
        &self,
        history: &[Said],
        message: &str,
        memories: Option<&Neighbourhood>,
    ) -> Result<BuiltContext, TurnError> {
        self.build_for(history, message, memories, self.reply)
    }

    /// [`Turn::build`] with room for `reply` tokens.
    pub fn build_for(
        &self,
        history: &[Said],
        message: &str,
        memories: Option<&Neighbourhood>,
        reply: usize,
    ) -> Result<BuiltContext, TurnError> {
        self.build_as(history, message, self.message_speaker, memories, reply)
    }

    /// [`Turn::build_for`] with the message said by `speaker` (replay rebuilds earlier turns,
    /// whose message a tool may have said).
    pub fn build_as(
        &self,
        history: &[Said],
        message: &str,
        speaker: Speaker,
        memories: Option<&Neighbourhood>,
        reply: usize,
    ) -> Result<BuiltContext, TurnError> {
        let (layers, _) = self.layers_for(memories)?;
        let req = ContextRequest {
            layers: &layers,
            history,
            user_message: message,
            message_speaker: speaker,
            fit: self.context_tokens().map(|context| Fit {
                context,
                reply,
                recall: self.state.memory.is_some(),
            }),
            format: self.state.chat_format(),
            instructions: &self.instructions,
        };
        Ok(build(&req, self)?)
    }

    /// The pipeline's layers with the budgets this turn uses (see [`Turn::expanded_fit`]).
    fn layers_for(
        &self,
        memories: Option<&Neighbourhood>,
    ) -> Result<(Vec<Layer>, &'static str), TurnError> {
        let mut layers = pipeline_layers(self.layers(), memories)?;
        if !self.expanded {
            return Ok((layers, "standard"));
        }
        for l in &mut layers {
            l.budget = expanded_budget(l);
        }
        Ok((layers, "expanded"))
    }

    /// Whether this turn uses DESIGN §2's expanded budgets (for the layers whose stored budget
    /// is the standard one): when they fit in half the context and the tiered cache has room
    /// for what they add. Decided once, when the turn opens.
    pub(super) fn expanded_fit(&self) -> Result<bool, TurnError> {
        let layers = pipeline_layers(self.layers(), None)?;
        let Some(context) = self.context_tokens() else {
            return Ok(false);
        };
        let memories = |budget: usize| {
            if layers.iter().any(|l| l.kind == LayerKind::Memories) {
                0
            } else {
                budget
            }
        };
        let expanded: usize = layers.iter().map(expanded_budget).sum::<usize>()
            + memories(Budgets::expanded().get(LayerKind::Memories));
        let standard: usize = layers.iter().map(|l| l.budget).sum::<usize>()
            + memories(Budgets::standard().get(LayerKind::Memories));
        Ok(expanded <= context / 2 && self.cache_has_room(expanded.saturating_sub(standard)))
    }

    /// Whether the tiered cache has room for `extra` more tokens of a prompt's KV: the tier
    /// bridge's last cycle saw at least that many blocks free in the cold tier (where idle
    /// blocks go). No cycle yet (or the bridge off): no.
    fn cache_has_room(&self, extra: usize) -> bool {
        let Ok(engine) = self.state.engine() else {
            return false;
        };
        let need = extra.div_ceil(engine.kv_format().shape.block_size.max(1));
        let history = self
            .state
            .tiers
            .history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        history.back().is_some_and(|r| {
            let o = &r.report.observed;
            o.cold_capacity.saturating_sub(o.cold_used) >= need
        })
    }

    /// What [`Turn::build`] fitted `built` to, for the turn's answer.
    pub fn budgets_used(&self, built: &BuiltContext) -> Option<BudgetsUsed> {
        let fit = built.fit?;
        Some(BudgetsUsed {
            set: if self.expanded {
                "expanded"
            } else {
                "standard"
            },
            context: self.context_tokens()?,
            scale: fit.scale,
            window: fit.window,
            dropped_turns: fit.dropped_turns,
        })
    }

    /// Tokens the memories layer may give recalled nodes: its budget less its own content.
    fn recall_budget(&self) -> u32 {
        let (budget, own) = match self.layers().iter().find(|r| r.kind == "memories") {
            Some(r) => (r.budget as usize, self.state.counter().count(&r.content)),
            None => (Budgets::standard().get(LayerKind::Memories), 0),
        };
        u32::try_from(budget.saturating_sub(own + 4)).unwrap_or(u32::MAX)
    }

    /// The memory graph's neighbourhood of `text` as the memories layer would show it; `None`
    /// without the memory graph or when nothing was recalled. `exclude_session`'s own episodes
    /// are left out (the conversation already shows them) — those since `exclude_since_ms`
    /// when given (older ones left the conversation's window and may be recalled). Only the
    /// nodes the turn's session may see are recalled ([`Turn::recall_scope`]).
    pub async fn neighbourhood(
        &self,
        exclude_session: Option<&str>,
        exclude_since_ms: Option<i64>,
        text: &str,
    ) -> Result<Option<Neighbourhood>, TurnError> {
        let Some(memory) = &self.state.memory else {
            return Ok(None);
        };
        let cfg = memory.config();
        let recalled = memory
            .recall(&RecallQuery {
                tenant: &self.tenant.id,
                agent: &self.agent.id,
                text,
                k: cfg.recall_k,
                hops: cfg.hops,
                kinds: None,
                exclude_session,
                exclude_since_ms,
                at_ms: now_ms(),
                sessions: self.recall_scope(),
                asker: self.session.as_deref(),
            })
            .await?;
        let n = render(recalled, self.recall_budget());
        Ok((!n.nodes.is_empty()).then_some(n))
    }

    /// This turn's prompt: `message` after the conversation `log`, with the neighbourhood of
    /// the message — which may hold this session's own episodes of turns the window left out,
    /// never those the conversation shows.
    pub async fn context(&self, log: Log, message: &str) -> Result<Turned, TurnError> {
        let started = Instant::now();
        let since = self.window_since(&log, message)?;
        let memories = self
            .neighbourhood(self.session.as_deref(), since, message)
            .await?;
        self.turned(log, message, since, memories, started, None)
    }

    /// Steps 4 and 5 at once, for a turn of a stored session: the replay of what the cache
    /// lost ([`Turn::replay_lost`] over `replay`, the log as stored; `None`: `log` itself) and
    /// the recall of the message's neighbourhood run as one task's two futures, so the
    /// embedding (on a blocking thread) overlaps the engine thread's prefill of the lost turns;
    /// their synchronous parts (prompt builds, tokenizing, the graph search) still take turns.
    /// Then the prompt is built over `log` (the stored log and what this turn adds before its
    /// message). The wall time of the whole step goes into [`Turn::prepare_ms`].
    pub async fn prepare(
        &mut self,
        replay: Option<&Log>,
        log: Log,
        message: &str,
    ) -> Result<Turned, TurnError> {
        let started = Instant::now();
        let since = self.window_since(&log, message)?;
        // Without the memory graph the prompt does not wait on a recall: it is built now, and
        // the engine is asked where its blocks are before the replay's prefills are sent (the
        // engine answers its commands in order), so the answer is the cache as the turn found
        // it.
        let (prebuilt, arrival) = match (&self.state.memory, &self.session, self.state.engine()) {
            (None, Some(_), Ok(engine)) => {
                let built = self.build(&log.said, message, None)?;
                let asked = engine.lookup(self.spec(&built, |_| true)?)?;
                (Some(built), Some(asked))
            }
            _ => (None, None),
        };
        let (replayed, memories) = tokio::join!(
            self.replay_lost(replay.unwrap_or(&log)),
            self.neighbourhood(self.session.as_deref(), since, message),
        );
        replayed?;
        let arrival = match arrival {
            Some(asked) => Some(asked.answer().await?),
            None => None,
        };
        let mut turned = self.turned(log, message, since, memories?, started, prebuilt)?;
        turned.arrival = arrival;
        self.prepare_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(turned)
    }

    /// The turn's [`Turned`], over `prebuilt` when the prompt was built already (only without
    /// memories: then the build does not depend on the recall).
    fn turned(
        &self,
        log: Log,
        message: &str,
        since: Option<i64>,
        memories: Option<Neighbourhood>,
        started: Instant,
        prebuilt: Option<BuiltContext>,
    ) -> Result<Turned, TurnError> {
        self.settle_prefetch(memories.as_ref());
        let built = match prebuilt {
            Some(built) => built,
            None => self.build(&log.said, message, memories.as_ref())?,
        };
        Ok(Turned {
            built,
            history: log.said,
            memories,
            since,
            started,
            arrival: None,
        })
    }

    /// When the part of the conversation this turn's prompt shows was logged: the first entry
    /// the window keeps, when it left older ones out; `None` when it shows them all (or nothing
    /// is recalled). The window depends on the conversation alone (see `engram_context`), so a
    /// build without memories finds it.
    pub(super) fn window_since(&self, log: &Log, message: &str) -> Result<Option<i64>, TurnError> {
        if self.state.memory.is_none() || log.created.len() != log.said.len() {
            return Ok(None);
        }
        let built = self.build(&log.said, message, None)?;
        let dropped = built.fit.map_or(0, |f| f.dropped_turns);
        Ok((dropped > 0).then(|| log.created.get(dropped).copied().unwrap_or(i64::MAX)))
    }
}

/// A turn counts tokens with the tokens it keeps (see `spec.rs`): what a build counts, the spec
/// of the same text then reuses. Without a model, the service's estimate.
impl TokenCounter for Turn {
    fn count(&self, text: &str) -> usize {
        match self.tokens(text) {
            Ok(t) => t.len(),
            Err(_) => self.state.counter().count(text),
        }
    }
}
