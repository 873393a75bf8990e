//! Admission of a turn and its record: the turn log, working memory, the memory graph's
//! episode, the canonical prefix warmed for the next turn.

use engram_context::{Speaker, TokenCounter, Turn as Said};
use engram_graph::{NodeId, NodeKind};
use engram_store::{NewEntry, Role, Tenant};

use crate::state::AppState;

use super::generate::prefill;
use super::{Generated, Turn, TurnError, Turned, check_name};

const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// [`TurnError::SessionQuota`] when `tenant` holds as many sessions as its quota allows: what a
/// new session (a first turn, an injection, a fork) checks first.
pub async fn session_room(state: &AppState, tenant: &Tenant) -> Result<(), TurnError> {
    if state.store.session_count(&tenant.id).await? >= tenant.quotas.sessions {
        return Err(TurnError::SessionQuota {
            limit: tenant.quotas.sessions,
        });
    }
    Ok(())
}

impl Turn {
    /// A generation's figures: the TTFT histogram, the tenant's turn, token and cache-hit
    /// counters, and the request's log line.
    pub fn observe(&self, g: &Generated) {
        let u = &g.usage;
        let prefilled = u.prompt_tokens.saturating_sub(u.cached_tokens);
        self.state.metrics.observe_turn(
            &self.tenant.id,
            u.cached_tokens as u64,
            prefilled as u64,
            u.completion_tokens as u64,
            g.ttft_ms + self.prepare_ms,
        );
        crate::telemetry::record_turn(
            &self.span,
            u.cached_tokens,
            prefilled,
            u.completion_tokens,
            g.ttft_ms + self.prepare_ms,
        );
    }

    /// Checks the session name, the message and the session quota before anything runs. The
    /// session row itself is written with the turn (see [`Turn::record`]), so a refused or
    /// failed turn stores nothing. Two concurrent first turns of new sessions may both pass the
    /// check; the quota is exceeded by at most the concurrency.
    pub async fn admit(&self, message: &str) -> Result<(), TurnError> {
        if let Some(session) = &self.session {
            check_name("session", session)?;
        }
        if message.trim().is_empty() || message.len() > MAX_MESSAGE_BYTES {
            return Err(TurnError::InvalidMessage);
        }
        self.admit_session().await
    }

    /// The session name, the model and the session quota: what a turn and an injection check
    /// before anything runs.
    pub async fn admit_session(&self) -> Result<(), TurnError> {
        if let Some(session) = &self.session {
            check_name("session", session)?;
        }
        let state = &self.state;
        state.engine()?;
        let Some(session) = &self.session else {
            return Ok(());
        };
        if state.store.session_exists(&self.agent.id, session).await? {
            return Ok(());
        }
        session_room(state, &self.tenant).await
    }

    /// Appends the turn to the log and spilled lines to working memory, records it as an
    /// episode of the memory graph, warms the canonical prefix for the next turn, and in the
    /// background reserves cold-tier blocks for the neighbourhood of what was just said.
    /// A stateless turn records nothing.
    ///
    /// Records nothing, failing with [`TurnError::SessionDeleted`], when the session (its
    /// agent, its tenant) was deleted while the turn ran.
    /// `reply`, the answer's JSON, is stored with the turn under the turn's idempotency key.
    pub async fn record(
        &self,
        message: &str,
        turned: &Turned,
        generated: &Generated,
        reply: &str,
    ) -> Result<(), TurnError> {
        let (Some(session), Some(key)) = (&self.session, self.kv_session) else {
            return Ok(());
        };
        let state = &self.state;
        let (tenant, agent) = (&self.tenant, &self.agent);
        let Some(_recording) = state
            .deletions
            .record(self.kv_tenant, key.0, turned.started)
            .await
        else {
            return Err(TurnError::SessionDeleted);
        };
        state.tiers.touch((self.kv_tenant, key));
        let tok = state.engine()?.tokenizer();
        let preface = self
            .preface
            .iter()
            .map(|t| tok.encode(&t.text))
            .collect::<Result<Vec<_>, _>>()?;
        let user_tokens = tok.encode(message)?;
        let entry = |role, text, tokens, ends_prefill| NewEntry {
            role,
            name: None,
            text,
            tokens,
            ends_prefill,
            memories: None,
        };
        // Entries before the message are part of this turn's prompt, not a prefill of their
        // own.
        let mut rows: Vec<NewEntry<'_>> = self
            .preface
            .iter()
            .zip(&preface)
            .map(|(t, ids)| {
                let role = match t.speaker {
                    Speaker::User => Role::User,
                    Speaker::Assistant => Role::Assistant,
                    Speaker::Tool => Role::Tool,
                    Speaker::System => Role::System,
                };
                entry(role, t.text.as_str(), ids.as_slice(), false)
            })
            .collect();
        let role = match self.message_speaker {
            Speaker::Tool => Role::Tool,
            Speaker::User | Speaker::Assistant | Speaker::System => Role::User,
        };
        // With the memory graph on, the memories layer the prompt showed goes with the message,
        // so that replay rebuilds this prompt as it was.
        let memories = state
            .memory
            .is_some()
            .then(|| turned.memories.as_ref().map_or("", |m| m.text.as_str()));
        rows.push(NewEntry {
            memories,
            ..entry(role, message, &user_tokens, true)
        });
        rows.push(entry(
            Role::Assistant,
            &generated.text,
            &generated.tokens,
            true,
        ));
        let store = &state.store;
        if store.ensure_session(&tenant.id, &agent.id, session).await?
            && let Some(label) = &self.session_label
        {
            store.label_session(&agent.id, session, label).await?;
        }
        store
            .append_entries(
                &agent.id,
                session,
                &rows,
                self.idempotency_key.as_deref().map(|k| (k, reply)),
            )
            .await?;
        let mut spilled = Vec::new();
        for l in &turned.built.layers {
            if !l.spilled.is_empty() {
                let added = store
                    .add_working_memory(&agent.id, session, l.kind.as_str(), &l.spilled)
                    .await?;
                // The memories layer's spill is recalled nodes already.
                if l.kind != engram_context::LayerKind::Memories {
                    spilled.extend(added);
                }
            }
        }
        self.ingest_spilled(&spilled).await?;
        let who = match self.message_speaker {
            Speaker::Tool => "tool",
            _ => "user",
        };
        let episode = format!("{who}: {message}\nassistant: {}", generated.text);
        self.ingest_episode(session, &episode, turned).await?;
        // The canonical prefix: everything but the volatile block and the (placeholder)
        // message, after this turn, with this turn's memories. Awaited, so the session's next
        // turn finds these blocks cached (it costs the prefill of this turn's tokens only:
        // everything before them is already cached).
        let mut after = turned.history.clone();
        after.push(Said {
            speaker: match self.message_speaker {
                Speaker::Tool => Speaker::Tool,
                _ => Speaker::User,
            },
            text: message.to_string(),
        });
        after.push(Said {
            speaker: Speaker::Assistant,
            text: generated.text.clone(),
        });
        let spec = self.canonical_spec(&after, turned.memories.as_ref())?;
        // A warm-up the engine refuses (a full queue) costs the next turn time, not this one
        // its record.
        let _ = prefill(state, spec).await;
        if state.memory.as_ref().is_some_and(|m| m.config().reserve) {
            let turn = self.clone();
            let current = turned.memories.as_ref().map(|m| m.ids());
            let history = after;
            let started = turned.started;
            let since = turned.since;
            tokio::task::spawn_local(async move {
                // Held like the record itself: a delete meanwhile means no reservation for it.
                let state = &turn.state;
                let Some(_recording) = state.deletions.record(turn.kv_tenant, key.0, started).await
                else {
                    return;
                };
                if let Err(e) = turn.reserve_next(&history, &episode, current, since).await {
                    tracing::warn!("reservation after a turn: {e}");
                }
            });
        }
        Ok(())
    }

    /// Makes each line a layer spilled (new to the session's working memory) a fact node,
    /// unless it exists already: what did not fit the layer's budget can still be recalled when
    /// a message is about it. The lines are the agent's layers' (a request's own system text is
    /// never spilled), so each is the agent's fact, of no session.
    async fn ingest_spilled(&self, lines: &[String]) -> Result<(), TurnError> {
        let state = &self.state;
        let Some(memory) = state.memory.as_ref().filter(|m| m.config().ingest_turns) else {
            return Ok(());
        };
        let (tenant, agent) = (&self.tenant, &self.agent);
        let fact = NodeKind::Fact.as_str();
        for line in lines {
            let line = line.trim();
            if line.is_empty()
                || state
                    .store
                    .memory_node_with_text(&tenant.id, &agent.id, None, fact, line)
                    .await?
                    .is_some()
            {
                continue;
            }
            let row = state
                .store
                .insert_memory_node(&engram_store::NewMemoryNode {
                    tenant_id: tenant.id.clone(),
                    agent_id: agent.id.clone(),
                    session_id: None,
                    kind: fact.to_string(),
                    text: line.to_string(),
                    importance: 0.3,
                    tokens: state.counter().count(line) as i64,
                })
                .await?;
            memory.add(&row).await?;
        }
        Ok(())
    }

    /// Records a turn as an episode node linked `follows` to the session's previous episode,
    /// and marks the nodes the turn recalled as accessed.
    async fn ingest_episode(
        &self,
        session: &str,
        text: &str,
        turned: &Turned,
    ) -> Result<(), TurnError> {
        let state = &self.state;
        let Some(memory) = &state.memory else {
            return Ok(());
        };
        let (tenant, agent) = (&self.tenant, &self.agent);
        let now = engram_memory::now_ms();
        if let Some(m) = &turned.memories {
            let ids: Vec<i64> = m.ids().iter().map(|&i| i as i64).collect();
            state
                .store
                .touch_memory_nodes(&tenant.id, &ids, now)
                .await?;
            memory.touch(
                &m.nodes.iter().map(|n| n.recall.id).collect::<Vec<_>>(),
                now,
            )?;
        }
        if !memory.config().ingest_turns {
            return Ok(());
        }
        let previous = memory.last_episode(&agent.id, session);
        let row = state
            .store
            .insert_memory_node(&engram_store::NewMemoryNode {
                tenant_id: tenant.id.clone(),
                agent_id: agent.id.clone(),
                session_id: Some(session.to_string()),
                kind: NodeKind::Episode.as_str().to_string(),
                text: text.to_string(),
                importance: 0.5,
                tokens: state.counter().count(text) as i64,
            })
            .await?;
        let node = memory.add(&row).await?;
        if let Some(NodeId(prev)) = previous {
            let edge = state
                .store
                .insert_memory_edge(&engram_store::NewMemoryEdge {
                    tenant_id: tenant.id.clone(),
                    from_id: node.id.0 as i64,
                    to_id: prev as i64,
                    kind: engram_graph::EdgeKind::Follows.as_str().to_string(),
                    weight: 1.0,
                    valid_from: None,
                    valid_to: None,
                })
                .await?;
            memory.add_edge(&edge)?;
        }
        Ok(())
    }
}
