//! Agent turns: the durable turn log, generation through the engine (JSON or SSE), and the
//! session's working memory.
//!
//! A turn: authenticate → load the agent's layers and the session's turns → build the prompt
//! (engram-context) → tokenize it segment by segment, tagged with source layers → the engine
//! (prefix cache, tenant salt) → append the user and assistant turns to the log and the spilled
//! lines to working memory → prefill the canonical prefix (stable + slow layers + conversation,
//! without the volatile block), so the next turn reuses this one too.

use std::time::Instant;

use actix_web::http::StatusCode;
use actix_web::web::Bytes;
use actix_web::{HttpResponse, get, post, web};
use engram_context::{BuiltContext, TokenCounter, Volatility};
use engram_engine::{
    Admission, FinishReason, GenerateRequest, PromptSegment, ReserveRequest, SamplingParams,
    SequenceSpec, StreamEvent, Usage,
};
use engram_graph::{NodeId, NodeKind};
use engram_kvcore::SourceLayer;
use engram_kvcore::{SessionId, TenantId};
use engram_store::{Agent, Role, Tenant};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::api::Answer;
use crate::api::admin::check_name;
use crate::api::agents::{Turned, build_with_history, history_of, neighbourhood, turn_context};
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;

/// Body of a turn.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TurnRequest {
    /// The user's message (1 byte to 64 KiB).
    pub message: String,
    /// Tokens to generate at most (default 256).
    pub max_tokens: Option<usize>,
    /// Sampling temperature (0 = greedy, the default).
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k.
    pub top_k: Option<usize>,
    /// Seed.
    pub seed: Option<u64>,
    /// Stop sequences.
    pub stop: Option<Vec<String>>,
    /// Answer as server-sent events.
    #[serde(default)]
    pub stream: bool,
}

/// The JSON answer of a turn.
#[derive(Debug, Clone, Serialize)]
pub struct TurnResponse {
    /// Generated text.
    pub text: String,
    /// `stop` or `length`.
    pub finish_reason: FinishReason,
    /// Token counts (`cached_tokens`: prompt tokens reused from the KV cache).
    pub usage: Usage,
    /// Milliseconds from submission to the first token.
    pub ttft_ms: f64,
    /// SHA-256 of the stable prefix.
    pub stable_prefix_hash: String,
    /// What the memory graph put in the prompt (absent without the memory service).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memories: Option<MemoryUsage>,
}

/// The memories layer of a turn.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct MemoryUsage {
    /// Recalled node ids, in the order the layer shows them.
    pub nodes: Vec<u64>,
    /// Prompt tokens of the memories layer.
    pub tokens: usize,
    /// Of those, tokens whose KV came from a reservation (computed ahead, warmed for this turn).
    pub reserved_tokens: usize,
    /// Of those, tokens whose KV was reused from the cache by any route.
    pub cached_tokens: usize,
}

const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// A session's cache key: the agent's 32 bits (see [`agent_bits`]) over 32 bits of the
/// session's name, so that every cached block and shadow entry of an agent can be found (and
/// deleted) by its upper half.
pub(crate) fn session_key(agent: &Agent, session: &str) -> SessionId {
    let h = Sha256::digest(format!("{}/{session}", agent.id).as_bytes());
    let mut b = [0u8; 4];
    b.copy_from_slice(&h[..4]);
    SessionId(agent_bits(agent) | u64::from(u32::from_le_bytes(b)))
}

/// Mask of the agent's part of a session key.
pub(crate) const AGENT_MASK: u64 = 0xFFFF_FFFF_0000_0000;

/// The agent's part of its sessions' keys.
pub(crate) fn agent_bits(agent: &Agent) -> u64 {
    let h = Sha256::digest(format!("engram-agent\0{}", agent.id).as_bytes());
    let mut b = [0u8; 4];
    b.copy_from_slice(&h[..4]);
    u64::from(u32::from_le_bytes(b)) << 32
}

/// Tokenizes the built prompt segment by segment.
pub(crate) fn spec_of(
    state: &AppState,
    built: &BuiltContext,
    tenant: &Tenant,
    session: Option<SessionId>,
    keep: impl Fn(Volatility) -> bool,
) -> Result<SequenceSpec, ApiError> {
    let tok = state.engine()?.tokenizer();
    let public = built.public_segments();
    let mut public_tokens = 0;
    let mut segments = Vec::with_capacity(built.segments.len());
    for (i, s) in built.segments.iter().enumerate() {
        if !keep(s.volatility) {
            continue;
        }
        let tokens = tok.encode(&s.text)?;
        if i < public {
            public_tokens += tokens.len();
        }
        segments.push(PromptSegment {
            tokens,
            source: s.source,
            importance: s.importance,
        });
    }
    Ok(SequenceSpec {
        segments,
        tenant: TenantId(tenant.cache_salt),
        session,
        reuse: Default::default(),
        hot_block_quota: usize::try_from(tenant.quotas.hot_blocks).ok(),
        pin_key: Some(pin_key(tenant, built)),
        cold_block_quota: usize::try_from(tenant.quotas.cold_blocks).ok(),
        public_tokens,
        public_pin_key: public_pin_key(built),
    })
}

/// The key public blocks are pinned under: SHA-256 of the public segments' text (no tenant),
/// or `None` when the prompt has no public part.
pub(crate) fn public_pin_key(built: &BuiltContext) -> Option<[u8; 32]> {
    let n = built.public_segments();
    if n == 0 {
        return None;
    }
    let mut h = Sha256::new();
    h.update(b"engram-public\0");
    built.segments[..n]
        .iter()
        .for_each(|s| h.update(s.text.as_bytes()));
    Some(h.finalize().into())
}

/// The key a tenant's stable prefix is pinned under: SHA-256 of the tenant and the prefix hash.
pub(crate) fn pin_key(tenant: &Tenant, built: &BuiltContext) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(tenant.id.as_bytes());
    h.update(built.stable_prefix_hash);
    h.finalize().into()
}

fn sampling(body: &TurnRequest) -> SamplingParams {
    let d = SamplingParams::default();
    SamplingParams {
        temperature: body.temperature.unwrap_or(d.temperature),
        top_k: body.top_k.unwrap_or(d.top_k),
        top_p: body.top_p.unwrap_or(d.top_p),
        seed: body.seed.unwrap_or(d.seed),
        max_tokens: body.max_tokens.unwrap_or(d.max_tokens),
        stop: body.stop.clone().unwrap_or_default(),
    }
}

/// Checks the request and the session quota. The session row itself is written with the turn
/// (see [`record`]), so a refused or failed turn stores nothing. Two concurrent first turns
/// of new sessions may both pass the check; the quota is exceeded by at most the concurrency.
pub(crate) async fn open_session(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
    session: &str,
    message: &str,
) -> Result<(), ApiError> {
    check_name("session", session)?;
    if message.trim().is_empty() || message.len() > MAX_MESSAGE_BYTES {
        return Err(ApiError::invalid(
            "message must be 1 byte to 64 KiB of text",
        ));
    }
    state.engine()?;
    let known = !state.store.turns(&agent.id, session).await?.is_empty();
    if !known && state.store.session_count(&tenant.id).await? >= tenant.quotas.sessions {
        return Err(ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "quota_exceeded",
            format!(
                "the tenant's session quota ({}) is used up",
                tenant.quotas.sessions
            ),
        ));
    }
    Ok(())
}

/// Collected output of one generation.
pub(crate) struct Generated {
    pub admission: Option<Admission>,
    pub text: String,
    pub tokens: Vec<u32>,
    pub reason: FinishReason,
    pub usage: Usage,
    pub ttft_ms: f64,
}

/// What one engine event meant for a generation being collected.
pub(crate) enum Step {
    /// Nothing to pass on.
    Wait,
    /// New text.
    Delta(String),
    /// The end (the reason and usage are in the `Generated`).
    Done,
    /// The request failed.
    Failed(ApiError),
}

impl Generated {
    /// Nothing generated yet.
    pub(crate) fn new() -> Self {
        Self {
            admission: None,
            text: String::new(),
            tokens: Vec::new(),
            reason: FinishReason::Stop,
            usage: Usage {
                prompt_tokens: 0,
                cached_tokens: 0,
                completion_tokens: 0,
            },
            ttft_ms: 0.0,
        }
    }

    /// Folds one engine event in; `submitted` is when the request went to the engine.
    pub(crate) fn absorb(&mut self, ev: StreamEvent, submitted: Instant) -> Step {
        match ev {
            StreamEvent::Started(a) => {
                self.admission = Some(a);
                Step::Wait
            }
            StreamEvent::Delta { tokens, text } => {
                if self.tokens.is_empty() {
                    self.ttft_ms = submitted.elapsed().as_secs_f64() * 1e3;
                }
                self.tokens.extend(tokens);
                self.text.push_str(&text);
                Step::Delta(text)
            }
            StreamEvent::Done { reason, usage } => {
                self.reason = reason;
                self.usage = usage;
                Step::Done
            }
            StreamEvent::Failed(e) => Step::Failed(e.into()),
        }
    }
}

/// Recomputes, turn by turn, the blocks of a session's earlier turns that the cache lost (a
/// restart whose shadow was behind the turn log, an eviction). Prefill on the CPU is not
/// batch-invariant: the same tokens prefilled in one long chunk round differently from the
/// turn-by-turn prefills that first computed them, and greedy decoding can then drift. Replaying
/// what each lost turn prefilled — its prompt, then the canonical prefix warmed after it (see
/// [`record`]), both rebuilt from the turn log — in order gives the blocks a run that never lost
/// them holds, so the next answer equals that run's. Cheap when nothing was lost: one prompt
/// build and one cache lookup. Skipped with the memory graph on (past memories layers cannot be
/// rebuilt as they were) and with `shadow.replay` off. Returns how many turns were replayed.
pub(crate) async fn replay_lost_turns(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
    session: &str,
    history: &[engram_context::Turn],
) -> Result<usize, ApiError> {
    if !state.config.shadow.replay || state.memory.is_some() {
        return Ok(0);
    }
    let engine = state.engine()?;
    let bs = engine.kv_format().shape.block_size;
    let users: Vec<usize> = history
        .iter()
        .enumerate()
        .filter(|(_, t)| t.speaker == engram_context::Speaker::User)
        .map(|(i, _)| i)
        .collect();
    let key = Some(session_key(agent, session));
    // Whether turn `i`'s prompt is cached as far as its prefill left it.
    let cached = |spec: SequenceSpec| async move {
        let want = spec
            .segments
            .iter()
            .map(|s| s.tokens.len())
            .sum::<usize>()
            .saturating_sub(1)
            / bs;
        let found = engine.lookup(spec)?.answer().await?;
        Ok::<bool, ApiError>(found.hot + found.cold >= want)
    };
    // What the session's turns prefilled, in order: each turn's prompt, then the canonical
    // prefix warmed after it. Back from the last to the last one fully cached; the rest is lost.
    let mut lost = Vec::new();
    for &i in users.iter().rev() {
        let after = &history[..(i + 2).min(history.len())];
        let warmed = canonical_spec(state, tenant, agent, session, after, None).await?;
        if cached(warmed.clone()).await? {
            break;
        }
        lost.push(warmed);
        let built = build_with_history(state, agent, &history[..i], &history[i].text, None).await?;
        let prompt = spec_of(state, &built, tenant, key, |_| true)?;
        if cached(prompt.clone()).await? {
            break;
        }
        lost.push(prompt);
    }
    lost.reverse();
    let mut replayed = 0;
    for spec in lost {
        let rx = engine.submit(GenerateRequest {
            spec,
            sampling: SamplingParams::greedy(1),
        })?;
        while let Ok(ev) = rx.recv_async().await {
            match ev {
                StreamEvent::Done { .. } => break,
                StreamEvent::Failed(e) => return Err(e.into()),
                _ => {}
            }
        }
        replayed += 1;
    }
    if replayed > 0 {
        state.metrics.count_replayed(replayed as u64);
    }
    Ok(replayed)
}

/// Runs one generation to the end.
pub(crate) async fn generate(
    state: &AppState,
    spec: SequenceSpec,
    sampling: SamplingParams,
) -> Result<Generated, ApiError> {
    let rx = state.engine()?.submit(GenerateRequest { spec, sampling })?;
    let t = Instant::now();
    let mut out = Generated::new();
    while let Ok(ev) = rx.recv_async().await {
        match out.absorb(ev, t) {
            Step::Wait | Step::Delta(_) => {}
            Step::Done => {
                state.metrics.observe_ttft(out.ttft_ms);
                return Ok(out);
            }
            Step::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::internal("the engine closed a stream early"))
}

/// The canonical prefix after `history`: everything but the volatile block and the
/// (placeholder) message, with `memories`. Prefilled after each turn so the next one finds it.
pub(crate) async fn canonical_spec(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
    session: &str,
    history: &[engram_context::Turn],
    memories: Option<&crate::memory::Neighbourhood>,
) -> Result<SequenceSpec, ApiError> {
    let next = build_with_history(state, agent, history, ".", memories).await?;
    spec_of(
        state,
        &next,
        tenant,
        Some(session_key(agent, session)),
        |v| v != Volatility::Volatile,
    )
}

/// Appends the turn to the log and spilled lines to working memory, records it as an episode
/// of the memory graph, warms the canonical prefix for the next turn, and in the background
/// reserves cold-tier blocks for the neighbourhood of what was just said.
///
/// Records nothing, answering 409 `session_deleted`, when the session (its agent, its tenant)
/// was deleted while the turn ran.
pub(crate) async fn record(
    state: &web::Data<AppState>,
    tenant: &Tenant,
    agent: &Agent,
    session: &str,
    message: &str,
    turned: &Turned,
    generated: &Generated,
) -> Result<(), ApiError> {
    let key = (TenantId(tenant.cache_salt), session_key(agent, session));
    let Some(_recording) = state.deletions.record(key.0, key.1.0, turned.started).await else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "session_deleted",
            "the session was deleted while the turn ran; the turn was not recorded",
        ));
    };
    state.tiers.touch(key);
    let built = &turned.built;
    let tok = state.engine()?.tokenizer();
    let user_tokens = tok.encode(message).map_err(ApiError::from)?;
    let store = &state.store;
    store.ensure_session(&tenant.id, &agent.id, session).await?;
    store
        .append_turn(&agent.id, session, Role::User, message, &user_tokens)
        .await?;
    store
        .append_turn(
            &agent.id,
            session,
            Role::Assistant,
            &generated.text,
            &generated.tokens,
        )
        .await?;
    for l in &built.layers {
        if !l.spilled.is_empty() {
            let kind = serde_json::to_value(l.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            store
                .add_working_memory(&agent.id, session, &kind, &l.spilled)
                .await?;
        }
    }
    let episode = format!("user: {message}\nassistant: {}", generated.text);
    ingest_episode(state, tenant, agent, session, &episode, turned).await?;
    // The canonical prefix: everything but the volatile block and the (placeholder) message,
    // with this turn's memories.
    let history = history_of(state, agent, session).await?;
    let spec = canonical_spec(
        state,
        tenant,
        agent,
        session,
        &history,
        turned.memories.as_ref(),
    )
    .await?;
    // Awaited, so the session's next turn finds these blocks cached (it costs the prefill of this
    // turn's tokens only: everything before them is already cached).
    let warm = SamplingParams::greedy(1);
    if let Ok(rx) = state.engine()?.submit(GenerateRequest {
        spec,
        sampling: warm,
    }) {
        while rx.recv_async().await.is_ok() {}
    }
    if state.memory.as_ref().is_some_and(|m| m.config().reserve) {
        let (state, tenant, agent) = (state.clone(), tenant.clone(), agent.clone());
        let (session, current) = (
            session.to_string(),
            turned.memories.as_ref().map(|m| m.ids()),
        );
        let started = turned.started;
        actix_web::rt::spawn(async move {
            // Held like the record itself: a delete meanwhile means no reservation for it.
            let Some(_recording) = state.deletions.record(key.0, key.1.0, started).await else {
                return;
            };
            if let Err(e) = reserve_next(&state, &tenant, &agent, &session, &episode, current).await
            {
                eprintln!("engram: reservation after a turn: {e}");
            }
        });
    }
    Ok(())
}

/// Records a turn as an episode node linked `follows` to the session's previous episode, and
/// marks the nodes the turn recalled as accessed.
async fn ingest_episode(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
    session: &str,
    text: &str,
    turned: &Turned,
) -> Result<(), ApiError> {
    let Some(memory) = &state.memory else {
        return Ok(());
    };
    let now = crate::memory::now_ms();
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

/// The prompt of a neighbourhood as a turn of `agent` would show it, cut after the memories
/// layer, and that layer's segment index; `None` when the prompt has no memories layer.
pub(crate) async fn memories_prompt(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
    memories: &crate::memory::Neighbourhood,
) -> Result<Option<(SequenceSpec, usize)>, ApiError> {
    let built = build_with_history(state, agent, &[], ".", Some(memories)).await?;
    let Some(at) = built
        .segments
        .iter()
        .position(|s| s.source == SourceLayer::Memories && s.text.starts_with("## "))
    else {
        return Ok(None);
    };
    let mut spec = spec_of(state, &built, tenant, None, |_| true)?;
    spec.segments.truncate(at + 1);
    Ok(Some((spec, at)))
}

/// Reserves cold-tier blocks for `memories` (see `EngineCore::reserve`); answers the
/// reservation id.
pub(crate) async fn reserve(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
    memories: &crate::memory::Neighbourhood,
) -> Result<Option<u64>, ApiError> {
    let Some((spec, segment)) = memories_prompt(state, tenant, agent, memories).await? else {
        return Ok(None);
    };
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

/// After a turn: the neighbourhood of what was just said (the episode's text) is the likely
/// memories of the next turn; unless it is what this turn already showed (and computed),
/// reserve it.
async fn reserve_next(
    state: &AppState,
    tenant: &Tenant,
    agent: &Agent,
    session: &str,
    text: &str,
    current: Option<Vec<u64>>,
) -> Result<(), ApiError> {
    let Some(next) = neighbourhood(state, tenant, agent, Some(session), text).await? else {
        return Ok(());
    };
    if current.as_deref() == Some(&next.ids()) {
        return Ok(());
    }
    match reserve(state, tenant, agent, &next).await {
        Ok(_) => Ok(()),
        // A full cold tier or queue is not an error of the turn: the reservation is skipped.
        Err(e) if e.code == "no_cold_room" || e.code == "overloaded" => Ok(()),
        Err(e) => Err(e),
    }
}

/// What the memories layer of a turn cost and where its KV came from.
fn memory_usage(turned: &Turned, spec: &SequenceSpec, g: &Generated) -> Option<MemoryUsage> {
    let m = turned.memories.as_ref()?;
    let (mut start, mut end) = (0, 0);
    for s in &spec.segments {
        let len = s.tokens.len();
        if s.source == SourceLayer::Memories && end == 0 && len > 0 && start > 0 {
            end = start + len;
            break;
        }
        start += len;
    }
    let a = g.admission.unwrap_or(Admission {
        prompt_tokens: 0,
        cached_tokens: 0,
        warmed_blocks: 0,
        reserved_blocks: 0,
    });
    let covered = |upto: usize| upto.clamp(start, end) - start;
    let cached = covered(a.cached_tokens);
    Some(MemoryUsage {
        nodes: m.ids(),
        tokens: end - start,
        reserved_tokens: if a.reserved_blocks > 0 { cached } else { 0 },
        cached_tokens: cached,
    })
}

/// One turn of a session: answers JSON, or server-sent events with `"stream": true`.
#[utoipa::path(
    tag = "sessions",
    request_body = TurnRequest,
    responses(
        (status = 200, description = "The reply (JSON), or with `\"stream\": true` server-sent events: `data: {\"delta\": …}` per piece, then `data: {\"done\": true, …}` or `data: {\"error\": …}`", content(
            (serde_json::Value = "application/json"),
            (crate::openapi::SseEvent = "text/event-stream"),
        )),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/turns")]
pub async fn create_turn(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    body: web::Json<TurnRequest>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let tenant = caller.0;
    let agent = state.store.agent(&tenant.id, &agent).await?;
    let sampling = sampling(&body);
    sampling.validate().map_err(ApiError::from)?;
    open_session(&state, &tenant, &agent, &session, &body.message).await?;
    let slot = state.limits.begin_generation(&tenant.id)?;
    // Replayed prefills delay the first token: they count in the turn's TTFT.
    let history = history_of(&state, &agent, &session).await?;
    let replay_started = Instant::now();
    replay_lost_turns(&state, &tenant, &agent, &session, &history).await?;
    let replay_ms = replay_started.elapsed().as_secs_f64() * 1e3;
    let turned = turn_context(
        &state,
        &tenant,
        &agent,
        Some(&session),
        Some(&history),
        &body.message,
    )
    .await?;
    let spec = spec_of(
        &state,
        &turned.built,
        &tenant,
        Some(session_key(&agent, &session)),
        |_| true,
    )?;
    if body.stream {
        return stream_turn(
            state,
            tenant,
            agent,
            session,
            body.into_inner(),
            turned,
            spec,
            sampling,
            replay_ms,
            slot,
        );
    }
    let layout = spec.clone();
    let generated = generate(&state, spec, sampling).await?;
    record(
        &state,
        &tenant,
        &agent,
        &session,
        &body.message,
        &turned,
        &generated,
    )
    .await?;
    Ok(HttpResponse::Ok().json(TurnResponse {
        memories: memory_usage(&turned, &layout, &generated),
        text: generated.text,
        finish_reason: generated.reason,
        usage: generated.usage,
        ttft_ms: generated.ttft_ms + replay_ms,
        stable_prefix_hash: turned.built.stable_prefix_hex(),
    }))
}

fn sse(value: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// The SSE variant: `data: {"delta": …}` per piece, then `data: {"done": true, …}`.
#[allow(clippy::too_many_arguments)]
fn stream_turn(
    state: web::Data<AppState>,
    tenant: Tenant,
    agent: Agent,
    session: String,
    body: TurnRequest,
    turned: Turned,
    spec: SequenceSpec,
    sampling: SamplingParams,
    replay_ms: f64,
    slot: crate::limits::GenerationSlot,
) -> Result<HttpResponse, ApiError> {
    let layout = spec.clone();
    let rx = state.engine()?.submit(GenerateRequest { spec, sampling })?;
    let (tx, out) = flume::unbounded::<Result<Bytes, actix_web::Error>>();
    actix_web::rt::spawn(async move {
        let _slot = slot;
        let t = Instant::now();
        let mut g = Generated::new();
        while let Ok(ev) = rx.recv_async().await {
            match g.absorb(ev, t) {
                Step::Wait => {}
                Step::Delta(text) => {
                    if tx.send(Ok(sse(&json!({"delta": text})))).is_err() {
                        return; // the client left; dropping `rx` cancels the sequence
                    }
                }
                Step::Done => {
                    let saved = record(
                        &state,
                        &tenant,
                        &agent,
                        &session,
                        &body.message,
                        &turned,
                        &g,
                    )
                    .await;
                    let done = match saved {
                        Ok(()) => json!({
                            "done": true,
                            "finish_reason": g.reason,
                            "usage": g.usage,
                            "ttft_ms": g.ttft_ms + replay_ms,
                            "stable_prefix_hash": turned.built.stable_prefix_hex(),
                            "memories": memory_usage(&turned, &layout, &g),
                        }),
                        Err(e) => json!({"error": {"code": e.code, "message": e.message}}),
                    };
                    let _ = tx.send(Ok(sse(&done)));
                    return;
                }
                Step::Failed(e) => {
                    let _ = tx.send(Ok(sse(
                        &json!({"error": {"code": e.code, "message": e.message}}),
                    )));
                    return;
                }
            }
        }
    });
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .streaming(out.into_stream()))
}

/// The lines the synthesizer spilled in a session.
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "Spilled lines", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/sessions/{session}/working-memory")]
pub async fn working_memory(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let agent = state.store.agent(&caller.0.id, &agent).await?;
    let lines = state.store.working_memory(&agent.id, &session).await?;
    Ok(HttpResponse::Ok().json(json!({"lines": lines})))
}

/// The session's KV blocks: how many, by tier and by source layer, and tokens covered.
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "The session's blocks by tier and source", body = serde_json::Value),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/sessions/{session}/cache")]
pub async fn session_cache(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let agent = state.store.agent(&caller.0.id, &agent).await?;
    let filter = engram_kvcore::BlockFilter {
        tenant: Some(TenantId(caller.0.cache_salt)),
        session: Some(session_key(&agent, &session)),
        ..Default::default()
    };
    let rx = state.engine()?.blocks(engram_engine::BlockQuery {
        filter,
        offset: 0,
        limit: usize::MAX,
    })?;
    let page = rx.answer().await?;
    let mut by_tier = std::collections::BTreeMap::<String, usize>::new();
    let mut by_source = std::collections::BTreeMap::<String, usize>::new();
    let mut pinned = 0;
    for b in &page.blocks {
        *by_tier.entry(format!("{}", b.tier)).or_default() += 1;
        let source = serde_json::to_value(b.source)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        *by_source.entry(source).or_default() += 1;
        pinned += usize::from(b.pin == engram_kvcore::PinState::Pinned);
    }
    Ok(HttpResponse::Ok().json(json!({
        "blocks": page.total,
        "by_tier": by_tier,
        "by_source": by_source,
        "pinned": pinned,
    })))
}
