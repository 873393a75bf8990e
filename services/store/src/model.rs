//! Rows.

use serde::{Deserialize, Serialize};

/// Which database backs the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// SQLite (embedded).
    Sqlite,
    /// PostgreSQL.
    Postgres,
}

/// Per-tenant limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quotas {
    /// Hot-tier blocks the tenant may hold.
    pub hot_blocks: u64,
    /// Cold-tier blocks.
    pub cold_blocks: u64,
    /// Sessions.
    pub sessions: u64,
}

/// A tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// An agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Agent {
    /// Id.
    pub id: String,
    /// Owner.
    pub tenant_id: String,
    /// Name, unique per tenant.
    pub name: String,
    /// Creation time.
    pub created_at: i64,
}

/// One version of a layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// Who spoke a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The user.
    User,
    /// The agent.
    Assistant,
}

impl Role {
    /// `user` or `assistant`, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Assistant => "assistant",
        }
    }
}

/// One turn of the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
}

/// A spilled line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
