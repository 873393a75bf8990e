//! Sessions as workflows (seed 002): context injected between phases, and forks.
//!
//! `POST …/sessions/{s}/context` appends system text, tool results and events to the session's
//! log and prefills only them (`crate::turn::Turn::inject`); the next turn continues on the
//! same cache. `POST …/sessions/{s}/fork` makes a new session with a copy of the log: the KV
//! cache is content-addressed (a block is found by its tenant and every token before it), so
//! the fork's prompts find the parent's blocks without copying any, and each session's new
//! blocks are its own — copy-on-write at block granularity.

use actix_web::{HttpRequest, HttpResponse, get, post, web};
use engram_kvcore::TenantId;
use serde::{Deserialize, Serialize};

use crate::api::idempotency::{answer_again, idempotency_key};
use crate::auth::TenantCaller;
use crate::error::ApiError;
use crate::state::AppState;
use crate::turn::{Entry, Injected, Turn, TurnError, check_name, session_key, session_room};
use engram_store::Role;

/// One entry to inject.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ContextEntry {
    /// `system` (an instruction), `tool` (a tool's result) or `event` (another agent's
    /// output, something that happened).
    pub role: String,
    /// The tool's or the event source's name (1–64 bytes; required for `tool` and `event`),
    /// or a label of system text.
    pub name: Option<String>,
    /// The text (1 byte to 64 KiB).
    pub content: String,
}

/// Body of `POST …/sessions/{session}/context`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ContextRequest {
    /// 1 to 32 entries, appended in order.
    pub entries: Vec<ContextEntry>,
}

/// Appends entries to a session's conversation between turns — a tool result, an event,
/// another agent's output, an instruction for the next phase — and prefills only them, without
/// generating; the next turn reuses them with everything before. The entries are logged like
/// turns (a new session is created, within the tenant's quota), shown in every later prompt
/// (a `tool` entry in the `tool` role as `Result of {name}:`, `system` and `event` entries in
/// the `system` role), and replayed like turns after a restart.
#[utoipa::path(
    tag = "sessions",
    request_body = ContextRequest,
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "1 to 255 visible ASCII characters: an injection sent again with the key of one the session recorded answers that injection's stored answer instead of appending again"),
    ),
    responses(
        (status = 200, description = "What was appended and prefilled", body = Injected),
        (status = 400, description = "Invalid entries (`invalid_request`)", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 409, description = "A turn of the session ran too long (`session_busy`), or the session was deleted meanwhile", body = crate::error::ErrorSchema),
        (status = 429, description = "Over the tenant's session quota or request rate", body = crate::error::ErrorSchema),
        (status = 503, description = "No model is loaded", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/context")]
pub async fn inject_context(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    body: web::Json<ContextRequest>,
    req: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    crate::turn::check_name("session", &session)?;
    let entries = body
        .into_inner()
        .entries
        .into_iter()
        .map(|e| {
            // Which roles may be injected is `Entry`'s to say.
            let role = Role::parse(&e.role).ok_or_else(|| TurnError::InvalidEntries {
                why: format!(
                    "role `{}`: inject `system`, `tool` or `event` entries",
                    e.role
                ),
            })?;
            Ok(Entry {
                role,
                name: e.name,
                content: e.content,
            })
        })
        .collect::<Result<Vec<_>, TurnError>>()?;
    let mut turn = Turn::open(state.into_inner(), caller.0, &agent, Some(&session)).await?;
    turn.idempotency_key = idempotency_key(&req)?;
    let _slot = turn.hold_session().await?;
    if let Some(stored) = turn.stored_reply().await? {
        return Ok(answer_again(&stored, false));
    }
    let _generation = turn.state.limits.begin_generation(&turn.tenant.id)?;
    let (_, reply) = turn.inject(&entries).await?;
    Ok(HttpResponse::Ok()
        .content_type("application/json")
        .body(reply))
}

/// Body of `POST …/sessions/{session}/fork`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// The new session's name (1–64 letters, digits, `-`, `_`; must not exist).
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    pub session: String,
}

/// A fork.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Forked {
    /// The new session.
    pub session: String,
    /// The session it was forked from.
    pub parent: String,
    /// Log entries (turns and injected entries) the fork starts with.
    pub entries: u64,
}

/// Makes a new session that starts where this one is (its log and working memory copied) and
/// then goes its own way: branching workflows. No KV is copied: the fork's prompts find the
/// parent's blocks in the cache (they are addressed by content), so its first turn computes
/// only its own message; blocks either session computes afterwards are its own. Deleting the
/// parent later deletes the blocks it computed; the fork then recomputes them from its own
/// log when it next needs them.
#[utoipa::path(
    tag = "sessions",
    request_body = ForkRequest,
    responses(
        (status = 201, description = "The new session", body = Forked),
        (status = 400, description = "Invalid session name (`invalid_request`)", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent or session", body = crate::error::ErrorSchema),
        (status = 409, description = "The new session exists (`conflict`), or a turn of the parent ran too long (`session_busy`)", body = crate::error::ErrorSchema),
        (status = 429, description = "Over the tenant's session quota or request rate", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/fork")]
pub async fn fork_session(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    body: web::Json<ForkRequest>,
) -> Result<HttpResponse, ApiError> {
    let (agent, parent) = path.into_inner();
    let child = body.into_inner().session;
    check_name("session", &parent)?;
    check_name("session", &child)?;
    let tenant = caller.0;
    let agent = state.store.agent(&tenant.id, &agent).await?;
    session_room(&state, &tenant).await?;
    // The parent's running turn (or injection) ends first, so the copy holds it whole.
    let _slot = state
        .session_slot(TenantId(tenant.cache_salt), session_key(&agent, &parent).0)
        .await
        .ok_or(TurnError::SessionBusy)?;
    let entries = state
        .store
        .fork_session(&tenant.id, &agent.id, &parent, &child)
        .await?;
    Ok(HttpResponse::Created().json(Forked {
        session: child,
        parent,
        entries,
    }))
}

/// Body of `POST …/sessions/{session}/prefetch`.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PrefetchRequest {
    /// What the user has typed so far (1 byte to 64 KiB, not only whitespace).
    pub text: String,
}

/// Stages the memories the session's next turn will likely show while the user is still
/// typing: the memory graph's neighbourhood of `text` is recalled as that turn would recall it
/// (the session's own recent episodes left out), and its memories layer is computed ahead in the
/// cold tier, covering exactly the tokens the turn's prompt will hold there — so the turn finds
/// that KV cached. Nothing is logged and no session is created. Calling it again as the text
/// grows is cheap: a neighbourhood the session's last prefetch reserved is not reserved again
/// (`unchanged`). A full cold tier or engine queue answers `capacity`, not an error. The next
/// turn counts a prefetch hit when it shows exactly the reserved memories
/// (`engram_prefetch_turns_total`, `GET /v1/admin/reservations`).
#[utoipa::path(
    tag = "sessions",
    request_body = PrefetchRequest,
    responses(
        (status = 200, description = "What the prefetch did", body = crate::turn::Prefetch),
        (status = 400, description = "Empty or oversized text, or an invalid session name (`invalid_request`)", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
        (status = 429, description = "Over the tenant's request rate", body = crate::error::ErrorSchema),
        (status = 503, description = "No model is loaded, or the memory graph is off", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[post("/v1/agents/{agent}/sessions/{session}/prefetch")]
pub async fn prefetch(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    body: web::Json<PrefetchRequest>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    check_name("session", &session)?;
    let text = body.into_inner().text;
    if text.trim().is_empty() || text.len() > 64 * 1024 {
        return Err(TurnError::InvalidEntries {
            why: "text: 1 byte to 64 KiB, not only whitespace".into(),
        }
        .into());
    }
    state.engine()?;
    state.memory()?;
    let turn = Turn::open(state.into_inner(), caller.0, &agent, Some(&session)).await?;
    let done = turn.prefetch(&text).await?;
    turn.state.metrics.count_prefetch(done.outcome);
    Ok(HttpResponse::Ok().json(done))
}

/// A page of an agent's sessions.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct SessionList {
    /// Sessions, oldest first: their names, labels and log sizes.
    pub sessions: Vec<engram_store::SessionRow>,
    /// The `cursor` of the next page (null on the last).
    pub next_cursor: Option<String>,
}

/// An agent's sessions, oldest first, a page at a time (`limit`, `cursor`): each with its label
/// — the OpenAI `user` string a hashed name stands for, or what a branch is (a resent history
/// that left the log forked it: `api/history.rs`) — and its log's size.
#[utoipa::path(
    tag = "sessions",
    params(crate::pages::ListPage),
    responses(
        (status = 200, description = "A page of sessions", body = SessionList),
        (status = 400, description = "Invalid paging (`invalid_request`)", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/sessions")]
pub async fn list_sessions(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<String>,
    page: web::Query<crate::pages::ListPage>,
) -> Result<HttpResponse, ApiError> {
    let (after, limit) = page.bounds()?;
    let agent = state.store.agent(&caller.0.id, &path.into_inner()).await?;
    let rows = state
        .store
        .sessions_page(
            &agent.id,
            after.as_ref().map(|(t, id)| (*t, id.as_str())),
            limit + 1,
        )
        .await?;
    let (sessions, next_cursor) = crate::pages::cut(rows, limit, |s| (s.created_at, &s.id));
    Ok(HttpResponse::Ok().json(SessionList {
        sessions,
        next_cursor,
    }))
}

/// One entry of a session's log.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct LogEntry {
    /// Position in the log, from 1.
    pub seq: i64,
    /// `user`, `assistant`, `system`, `tool` or `event`.
    pub role: String,
    /// Its text.
    pub text: String,
    /// The name an injected entry came with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Tokens of its text.
    pub tokens: usize,
    /// When it was logged (ms since the epoch).
    pub created_at: i64,
}

/// A page of a session's log.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct SessionLog {
    /// The session.
    pub session: String,
    /// Its label (see `GET …/sessions`).
    pub label: Option<String>,
    /// Entries, in order.
    pub turns: Vec<LogEntry>,
    /// The `cursor` of the next page (null on the last).
    pub next_cursor: Option<String>,
}

/// A session's log — the turns, the entries injected, what requests resent — in order, a page
/// at a time (`limit`, `cursor`).
#[utoipa::path(
    tag = "sessions",
    params(crate::pages::ListPage),
    responses(
        (status = 200, description = "A page of the log", body = SessionLog),
        (status = 400, description = "Invalid session name or paging (`invalid_request`)", body = crate::error::ErrorSchema),
        (status = 401, description = "Missing or wrong key", body = crate::error::ErrorSchema),
        (status = 404, description = "Unknown agent or session", body = crate::error::ErrorSchema),
    ),
    security(("bearer" = []))
)]
#[get("/v1/agents/{agent}/sessions/{session}/turns")]
pub async fn session_log(
    caller: TenantCaller,
    state: web::Data<AppState>,
    path: web::Path<(String, String)>,
    page: web::Query<crate::pages::ListPage>,
) -> Result<HttpResponse, ApiError> {
    let (agent, session) = path.into_inner();
    check_name("session", &session)?;
    let (after, limit) = page.bounds()?;
    let agent = state.store.agent(&caller.0.id, &agent).await?;
    if !state.store.session_exists(&agent.id, &session).await? {
        return Err(ApiError::not_found(format!("no session `{session}`")));
    }
    let label = state.store.session_label(&agent.id, &session).await?;
    let after = after.map_or(0, |(seq, _)| seq);
    let rows = state
        .store
        .turns_page(&agent.id, &session, after, limit + 1)
        .await?;
    let (rows, next_cursor) = crate::pages::cut(rows, limit, |t| (t.seq, "seq"));
    let turns = rows
        .into_iter()
        .map(|t| LogEntry {
            seq: t.seq,
            role: t.role.as_str().to_string(),
            tokens: t.tokens.len(),
            text: t.text,
            name: t.name,
            created_at: t.created_at,
        })
        .collect();
    Ok(HttpResponse::Ok().json(SessionLog {
        session,
        label,
        turns,
        next_cursor,
    }))
}
