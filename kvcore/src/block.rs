//! Block identity and the meaning a block carries: which prompt layer its tokens came from, how
//! important they are, whose they are, and which token positions they hold.
//!
//! Invariant: a [`BlockId`] is never reused. Slots in a tier are recycled, ids are not, so a
//! stale id is always detected ([`crate::KvError::AlreadyFreed`]) instead of aliasing new data.

use serde::{Deserialize, Serialize};

/// A block's identity, stable across tiers for the block's whole life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct BlockId(pub(crate) u64);

impl BlockId {
    /// The raw id (for logs, manifests and admin endpoints).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for BlockId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// The tenant that owns a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TenantId(pub u64);

/// The session a block belongs to; shared prefix blocks have none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionId(pub u64);

/// The prompt layer a block's tokens came from (docs/design.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SourceLayer {
    /// Non-negotiable principles.
    Axioms,
    /// Who the agent is.
    Identity,
    /// System knowledge and rules.
    Rules,
    /// Tools and skills.
    Capabilities,
    /// Character.
    Soul,
    /// What the agent knows about its conversation partner.
    Partner,
    /// Learned associations.
    Neurons,
    /// Recalled memories (from the memory graph).
    Memories,
    /// Mood.
    Affect,
    /// A user message.
    UserTurn,
    /// A model reply.
    AssistantTurn,
    /// Live system state.
    SystemState,
    /// The clock.
    CurrentTime,
    /// Situational awareness.
    Awareness,
}

impl SourceLayer {
    /// Every source layer, in declaration order.
    pub const ALL: [Self; 14] = [
        Self::Axioms,
        Self::Identity,
        Self::Rules,
        Self::Capabilities,
        Self::Soul,
        Self::Partner,
        Self::Neurons,
        Self::Memories,
        Self::Affect,
        Self::UserTurn,
        Self::AssistantTurn,
        Self::SystemState,
        Self::CurrentTime,
        Self::Awareness,
    ];

    /// The stable layers pinned by default: axioms, identity, rules, capabilities, soul.
    pub const STABLE: [Self; 5] = [
        Self::Axioms,
        Self::Identity,
        Self::Rules,
        Self::Capabilities,
        Self::Soul,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Token positions `start..end` of a sequence held by a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TokenRange {
    /// First position.
    pub start: u32,
    /// One past the last position.
    pub end: u32,
}

impl TokenRange {
    /// The range `start..end`.
    pub fn new(start: u32, end: u32) -> Self {
        Self { start, end }
    }

    /// Positions in the range (0 when `end <= start`).
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start) as usize
    }

    /// True when the range holds no position.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What the caller knows about a block when it allocates it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BlockTags {
    /// The prompt layer the tokens came from.
    pub source: SourceLayer,
    /// Importance in 0..=1.
    pub importance: f32,
    /// Owner.
    pub tenant: TenantId,
    /// Session, if the block is not a shared prefix.
    pub session: Option<SessionId>,
    /// Token positions held (at most the block size).
    pub tokens: TokenRange,
}

/// Where a block's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Read by attention: VRAM, or process memory for the CPU engine.
    Hot,
    /// Host memory with the same bytes.
    Cold,
    /// No bytes: the block must be prefilled again from the token log.
    Recompute,
}

impl std::fmt::Display for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Hot => "hot",
            Self::Cold => "cold",
            Self::Recompute => "recompute",
        })
    }
}
