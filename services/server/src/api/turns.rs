//! Agent turns over HTTP: the native route (JSON or SSE), the session's working memory and its
//! cache. The turn itself — prompt, generation, record, replay, reservation — is `crate::turn`;
//! these handlers only read the request and write the answer.

use actix_web::{HttpRequest, HttpResponse, get, post, web};
use engram_engine::{Admission, FinishReason, PrefixLookup, SamplingParams, SequenceSpec, Usage};
use engram_kvcore::{SourceLayer, TenantId};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::api::idempotency::{answer_again, done_event, idempotency_key};
use crate::api::stream::{self, Framing};
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{Answer, BudgetsUsed, Generated, Turn, Turned, generate, session_key};

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
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct TurnResponse {
    /// Generated text.
    pub text: String,
    /// `stop` (a stop token or sequence) or `length` (`max_tokens` or the context reached).
    #[schema(value_type = FinishReasonSchema)]
    pub finish_reason: FinishReason,
    /// Token counts (`cached_tokens`: prompt tokens reused from the KV cache).
    #[schema(value_type = UsageSchema)]
    pub usage: Usage,
    /// Milliseconds from submission to the first token.
    pub ttft_ms: f64,
    /// SHA-256 of the stable prefix.
    pub stable_prefix_hash: String,
    /// What the memory graph put in the prompt (absent without the memory service).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memories: Option<MemoryUsage>,
    /// The budgets the prompt was fitted to and the conversation's window (absent without a
    /// model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budgets: Option<BudgetsUsed>,
    /// Where the prompt's KV blocks came from when the turn was admitted (absent when the
    /// engine admitted no prompt; a stored reply answered again repeats its first answer's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<TurnCache>,
}

/// Where a turn's full prompt blocks came from at admission: found hot, warmed from the cold
/// tier, or computed by the prefill (what the engine's `hot_hit`, `cold_hit` and `miss` counters
/// add for this prompt; the server's own prefills around the turn — replays of lost turns, the
/// canonical prefix after it — are not in it).
#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
pub struct TurnCache {
    /// Blocks reused from the hot tier.
    pub hot_blocks: usize,
    /// Blocks reused from the cold tier (copied back to hot first).
    pub warmed_blocks: usize,
    /// Blocks computed.
    pub computed_blocks: usize,
    /// Where the prompt's leading blocks were when the turn arrived, before the server
    /// replayed the earlier turns whose blocks the cache had lost: a replay recomputes them
    /// into the hot tier, where admission then finds them. Absent for a stateless turn and
    /// with the memory graph on (the prompt is built after the recall).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arrival: Option<TurnArrival>,
}

/// Leading blocks of a turn's prompt cached when the turn arrived.
#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
pub struct TurnArrival {
    /// In the hot tier.
    pub hot_blocks: usize,
    /// In the cold tier.
    pub cold_blocks: usize,
}

impl TurnCache {
    fn of(a: &Admission, arrival: Option<PrefixLookup>) -> Self {
        Self {
            hot_blocks: a.hot_blocks,
            warmed_blocks: a.warmed_blocks,
            computed_blocks: a.computed_blocks,
            arrival: arrival.map(|l| TurnArrival {
                hot_blocks: l.hot,
                cold_blocks: l.cold,
            }),
        }
    }
}

/// Why generation ended (the schema of the engine's `FinishReason`).
#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReasonSchema {
    /// A stop token or stop sequence.
    Stop,
    /// `max_tokens`, or the model's context, was reached.
    Length,
}

/// Token accounting of a generation (the schema of the engine's `Usage`).
#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
pub struct UsageSchema {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, reused from the KV cache.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

/// A session's KV blocks, counted.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct SessionCache {
    /// Blocks of the session's chain the cache holds.
    pub blocks: usize,
    /// By tier (`hot`, `cold`, `recompute`).
    pub by_tier: std::collections::BTreeMap<String, usize>,
    /// By source layer.
    pub by_source: std::collections::BTreeMap<String, usize>,
    /// Pinned blocks.
    pub pinned: usize,
}

/// A session's working memory: lines spilled from layers over their budgets.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct WorkingMemory {
    /// Lines, oldest first.
    pub lines: Vec<engram_store::WorkingLine>,
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

fn sampling(body: &TurnRequest) -> SamplingParams {
    let d = SamplingParams::default();
    SamplingParams {
        temperature: body.temperature.unwrap_or(d.temperature),
        top_k: body.top_k.unwrap_or(d.top_k),
        top_p: body.top_p.unwrap_or(d.top_p),
        seed: body.seed.unwrap_or(d.seed),
        max_tokens: body.max_tokens.unwrap_or(d.max_tokens),
        stop: body.stop.clone().unwrap_or_default(),
        ..d
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
        hot_blocks: 0,
        warmed_blocks: 0,
        computed_blocks: 0,
        reserved_blocks: 0,
        relocated_tokens: 0,
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
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "1 to 255 visible ASCII characters: a turn sent again with the key of one the session recorded answers that turn's stored reply instead of running again"),
    ),
    responses(
        (status = 200, description = "The reply (JSON), or with `\"stream\": true` server-sent events: `data: {\"delta\": …}` per piece, then `data: {\"done\": true, …}` or `data: {\"error\": …}`", content(
            (TurnResponse = "application/json"),
            (crate::openapi::SseEvent = "text/event-stream"),
        )),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 400, description = "Invalid input", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 409, description = "Another turn of the session ran too long (`session_busy`), or the session was deleted meanwhile", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/turns")]
pub async fn create_turn(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    body: web::Json<TurnRequest>,
    req: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    let body = body.into_inner();
    let mut turn = Turn::open(state.into_inner(), caller.0, &agent, Some(&session)).await?;
    let sampling = sampling(&body);
    sampling.validate().map_err(ApiError::from)?;
    turn.reply = sampling.max_tokens;
    turn.idempotency_key = idempotency_key(&req)?;
    // One turn of a session at a time: the next waits here (bounded), then sees this one's
    // record.
    let session_slot = turn.hold_session().await?;
    if let Some(stored) = turn.stored_reply().await? {
        return Ok(answer_again(&stored, body.stream));
    }
    turn.admit(&body.message).await?;
    let slot = turn.state.limits.begin_generation(&turn.tenant.id)?;
    let log = turn.history().await?;
    // What the cache lost is replayed while the message's memories are recalled; both count
    // in the turn's TTFT.
    let turned = turn.prepare(None, log, &body.message).await?;
    let spec = turn.spec(&turned.built, |_| true)?;
    let framing = Native {
        budgets: turn.budgets_used(&turned.built),
        prepare_ms: turn.prepare_ms,
        hash: turned.built.stable_prefix_hex(),
        turned: turned.clone(),
        layout: spec.clone(),
    };
    if body.stream {
        let held = (slot, session_slot);
        let job = stream::Job {
            spec,
            sampling,
            constraint: None,
        };
        return stream::pump(turn, body.message, turned, job, held, framing);
    }
    let generated = generate(&turn.state, spec, sampling, None).await?;
    turn.observe(&generated);
    let reply = framing.reply(&generated);
    turn.record(&body.message, &turned, &generated, &reply)
        .await?;
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .body(reply))
}

/// The native SSE framing: `data: {"delta": …}` per piece, then `data: {"done": true, …}` or
/// `data: {"error": …}`.
struct Native {
    budgets: Option<BudgetsUsed>,
    prepare_ms: f64,
    hash: String,
    turned: Turned,
    layout: SequenceSpec,
}

impl Native {
    fn response(&self, g: &Generated) -> TurnResponse {
        TurnResponse {
            memories: memory_usage(&self.turned, &self.layout, g),
            text: g.text.clone(),
            finish_reason: g.reason,
            usage: g.usage,
            ttft_ms: g.ttft_ms + self.prepare_ms,
            stable_prefix_hash: self.hash.clone(),
            budgets: self.budgets,
            cache: g
                .admission
                .as_ref()
                .map(|a| TurnCache::of(a, self.turned.arrival)),
        }
    }
}

impl Framing for Native {
    fn delta(&mut self, text: &str, _: &[engram_engine::TokenLogprob]) -> String {
        stream::event(&json!({"delta": text}))
    }

    fn reply(&self, g: &Generated) -> String {
        serde_json::to_string(&self.response(g)).unwrap_or_default()
    }

    fn done(&mut self, g: &Generated, recorded: Result<(), ApiError>) -> Vec<String> {
        vec![match recorded {
            Ok(()) => match serde_json::to_value(self.response(g)) {
                Ok(serde_json::Value::Object(answer)) => done_event(answer).1,
                _ => stream::event(&json!({"done": true})),
            },
            Err(e) => stream::error_event(&e),
        }]
    }
}

/// The lines the synthesizer spilled in a session.
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "Spilled lines", body = WorkingMemory),
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
    crate::turn::check_name("session", &session)?;
    let agent = state.store.agent(&caller.0.id, &agent).await?;
    let lines = state.store.working_memory(&agent.id, &session).await?;
    Ok(HttpResponse::Ok().json(WorkingMemory { lines }))
}

/// The session's KV blocks: how many, by tier and by source layer, and tokens covered.
#[utoipa::path(
    tag = "sessions",
    responses(
        (status = 200, description = "The session's blocks by tier and source", body = SessionCache),
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
    crate::turn::check_name("session", &session)?;
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
    Ok(HttpResponse::Ok().json(SessionCache {
        blocks: page.total,
        by_tier,
        by_source,
        pinned,
    }))
}
