//! # engram-store
//!
//! Engram's durable state behind one API for SQLite (the embedded default) and PostgreSQL:
//! tenants and their hashed API keys, agents, versioned prompt layers, sessions, the turn log
//! (text and token ids: the source of truth every KV tier can be rebuilt from) and the working
//! memory the synthesizer spills to.
//!
//! Queries go through sqlx's `Any` driver with `$n` placeholders in order of appearance, which
//! both backends accept; migrations (`migrations/sqlite`, `migrations/postgres`) are embedded and
//! applied by sqlx's migrator at [`Store::connect`]. Every read of tenant-owned data takes the
//! tenant id, so one tenant can never name another's rows. Times are Unix milliseconds.

#![forbid(unsafe_code)]

mod error;
mod migrate;
mod model;
mod repo;

pub use error::{StoreError, StoreResult};
pub use model::{
    AdminKey, AdminScope, Agent, ApiKey, Backend, LayerRow, MemoryEdgeRow, MemoryNodeRow,
    MemoryScope, NewEntry, NewMemoryEdge, NewMemoryNode, Quotas, Role, SessionRow, Tenant, TurnRow,
    WorkingLine,
};
pub use repo::{Store, WORKING_MEMORY_LINES, random_hex};
