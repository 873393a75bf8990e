//! Rows.

use serde::{Deserialize, Serialize};

/// Which database backs the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// SQLite (embedded).
    Sqlite,
    /// PostgreSQL.
    Postgres,
}

/// Per-tenant limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Quotas {
    /// Hot-tier blocks the tenant may hold.
    pub hot_blocks: u64,
    /// Cold-tier blocks.
    pub cold_blocks: u64,
    /// Sessions.
    pub sessions: u64,
    /// Bytes of the shadow its sessions may hold, MiB (0: no bound of its own; the shadow's
    /// budget still applies): over it, its least recently written sessions are archived.
    #[serde(default)]
    pub shadow_mib: u64,
}

/// A tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Tenant {
    /// Id.
    pub id: String,
    /// Unique name.
    pub name: String,
    /// Salt mixed into the tenant's KV block hashes.
    pub cache_salt: u64,
    /// Limits.
    pub quotas: Quotas,
    /// Creation time.
    pub created_at: i64,
}

/// An API key's public part (the secret is shown once, at creation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApiKey {
    /// Id.
    pub id: String,
    /// Owner.
    pub tenant_id: String,
    /// Creation time.
    pub created_at: i64,
    /// Revocation time, if revoked.
    pub revoked_at: Option<i64>,
}

/// What an operator key may do. Each scope includes the ones before it: `read` can scrape
/// metrics, `admin` can do everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum AdminScope {
    /// Prometheus scraping (`GET /metrics`).
    Metrics,
    /// The operator's views (cache, blocks, tenants, memory, reservations, the admin page).
    Read,
    /// Every operator action: tenants, keys, public layers, cache operations.
    Admin,
}

impl AdminScope {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Metrics => "metrics",
            Self::Read => "read",
            Self::Admin => "admin",
        }
    }

    /// The scope of a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "metrics" => Some(Self::Metrics),
            "read" => Some(Self::Read),
            "admin" => Some(Self::Admin),
            _ => None,
        }
    }
}

/// An operator key's public part (the secret is shown once, at creation).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AdminKey {
    /// Id.
    pub id: String,
    /// A name for people (what it is for).
    pub name: String,
    /// What it may do (the widest scope counts: see [`AdminScope`]).
    pub scopes: Vec<AdminScope>,
    /// Creation time.
    pub created_at: i64,
    /// Revocation time, if revoked.
    pub revoked_at: Option<i64>,
}

impl AdminKey {
    /// Whether the key may act with `scope`.
    pub fn allows(&self, scope: AdminScope) -> bool {
        self.revoked_at.is_none() && self.scopes.iter().any(|&s| s >= scope)
    }
}

/// An agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Agent {
    /// Id.
    pub id: String,
    /// Owner.
    pub tenant_id: String,
    /// Name, unique per tenant.
    pub name: String,
    /// Creation time.
    pub created_at: i64,
    /// Who recalls what the agent's sessions bring (their episodes, the request text that
    /// spilled over a layer's budget, tool results).
    pub memory_scope: MemoryScope,
}

/// Whose turns recall what a session brought into an agent's memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum MemoryScope {
    /// Only that session's own turns (the default): one end user's text never reaches another
    /// session of the agent. The agent's own memory (nodes of no session, its layers' spill)
    /// is recalled everywhere.
    #[default]
    Session,
    /// Every session of the agent: what one session said can be recalled in all of them.
    Agent,
}

impl MemoryScope {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Session => "session",
            Self::Agent => "agent",
        }
    }

    /// The scope of a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "session" => Some(Self::Session),
            "agent" => Some(Self::Agent),
            _ => None,
        }
    }
}

/// One version of a layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LayerRow {
    /// Layer kind (`axioms`, `identity`, …).
    pub kind: String,
    /// Version, from 1.
    pub version: i64,
    /// Text.
    pub content: String,
    /// Token budget.
    pub budget: u64,
    /// Part of the stable prefix.
    pub stable: bool,
    /// Importance, 0..=1.
    pub importance: f64,
    /// Marked public by the operator: its KV blocks are shared across tenants.
    pub public: bool,
    /// Time of this version.
    pub created_at: i64,
}

/// Who spoke an entry of the turn log: the user and the agent take turns; system text, tool
/// results and events are injected between turns (`POST …/sessions/{s}/context`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The user.
    User,
    /// The agent.
    Assistant,
    /// Injected system text (an instruction for the next phase).
    System,
    /// An injected tool result.
    Tool,
    /// An injected event (another agent's output, something that happened).
    Event,
}

impl Role {
    /// The role as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::System => "system",
            Self::Tool => "tool",
            Self::Event => "event",
        }
    }

    /// The role stored as `s`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "user" => Self::User,
            "assistant" => Self::Assistant,
            "system" => Self::System,
            "tool" => Self::Tool,
            "event" => Self::Event,
            _ => return None,
        })
    }

    /// Whether entries of this role are injected rather than said in a turn.
    pub fn is_injected(self) -> bool {
        matches!(self, Self::System | Self::Tool | Self::Event)
    }
}

/// An entry to append to a session's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NewEntry<'a> {
    /// Speaker.
    pub role: Role,
    /// The tool's, event source's or system text's name (injected entries).
    pub name: Option<&'a str>,
    /// Text.
    pub text: &'a str,
    /// Token ids of the text.
    pub tokens: &'a [u32],
    /// The session's KV was prefilled up to and including this entry (see [`TurnRow`]).
    pub ends_prefill: bool,
    /// The memories layer the prompt of the turn this entry is the message of showed (see
    /// [`TurnRow::memories`]).
    pub memories: Option<&'a str>,
}

/// A session of an agent, as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionRow {
    /// Its name.
    pub id: String,
    /// What the client called it, when its name is a hash of that (an OpenAI `user`), or what
    /// it is (a branch a resent history forked off: the session's label and where it forked).
    pub label: Option<String>,
    /// Time.
    pub created_at: i64,
    /// Entries of its log.
    pub entries: i64,
}

/// One turn of the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TurnRow {
    /// Position in the session, from 1.
    pub seq: i64,
    /// Speaker.
    pub role: Role,
    /// Text.
    pub text: String,
    /// Token ids of the text.
    pub tokens: Vec<u32>,
    /// Time.
    pub created_at: i64,
    /// The name an injected entry came with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Whether the session's KV was prefilled up to and including this entry when it was
    /// appended: true for user and assistant rows and for the last entry of an injection, false
    /// for the entries an injection appended before its last. Replay prefills in these steps.
    #[serde(default = "yes")]
    pub ends_prefill: bool,
    /// On a turn's message: the memories layer its prompt showed (the recalled neighbourhood as
    /// rendered; empty when nothing was recalled), so replay rebuilds the prompt as it was.
    /// `None`: not logged (the memory graph was off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memories: Option<String>,
}

fn yes() -> bool {
    true
}

/// A spilled line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WorkingLine {
    /// Layer it came from.
    pub kind: String,
    /// The line.
    pub line: String,
    /// Time.
    pub created_at: i64,
}

/// A memory-graph node as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MemoryNodeRow {
    /// Id (assigned by the database).
    pub id: i64,
    /// Owner tenant.
    pub tenant_id: String,
    /// Owner agent.
    pub agent_id: String,
    /// The session of an episode.
    pub session_id: Option<String>,
    /// `episode`, `fact`, `entity` or `concept`.
    pub kind: String,
    /// What is remembered.
    pub text: String,
    /// 0..=1.
    pub importance: f64,
    /// Tokens of `text`.
    pub tokens: i64,
    /// Creation time, ms.
    pub created_at: i64,
    /// Last change, ms.
    pub updated_at: i64,
    /// Last recall, ms.
    pub last_accessed_at: i64,
}

/// A node to insert.
#[derive(Debug, Clone, PartialEq)]
pub struct NewMemoryNode {
    /// Owner tenant.
    pub tenant_id: String,
    /// Owner agent.
    pub agent_id: String,
    /// The session of an episode.
    pub session_id: Option<String>,
    /// Kind.
    pub kind: String,
    /// Text.
    pub text: String,
    /// 0..=1.
    pub importance: f64,
    /// Tokens of `text`.
    pub tokens: i64,
}

/// A memory-graph edge as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MemoryEdgeRow {
    /// Id (assigned by the database).
    pub id: i64,
    /// Owner tenant (both ends belong to it).
    pub tenant_id: String,
    /// Source node.
    pub from_id: i64,
    /// Target node.
    pub to_id: i64,
    /// `mentions`, `relates_to`, `derived_from`, `follows` or `supersedes`.
    pub kind: String,
    /// 0..=1.
    pub weight: f64,
    /// Start of validity, ms (inclusive).
    pub valid_from: Option<i64>,
    /// End of validity, ms (exclusive).
    pub valid_to: Option<i64>,
    /// Creation time, ms.
    pub created_at: i64,
}

/// An edge to insert.
#[derive(Debug, Clone, PartialEq)]
pub struct NewMemoryEdge {
    /// Owner tenant.
    pub tenant_id: String,
    /// Source node.
    pub from_id: i64,
    /// Target node.
    pub to_id: i64,
    /// Kind.
    pub kind: String,
    /// 0..=1.
    pub weight: f64,
    /// Start of validity, ms.
    pub valid_from: Option<i64>,
    /// End of validity, ms.
    pub valid_to: Option<i64>,
}
