//! The shadow's one error type.

use std::path::PathBuf;

use engram_engine::EngineError;
use engram_kvcore::KvError;

/// Why the shadow failed. `Invalid.reason` starts with a stable reason code (see [`crate::RecoveryEntry::outcome`]).
#[derive(Debug, thiserror::Error)]
pub enum ShadowError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A segment could not be encoded or decoded.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// A file is not a valid shadow file.
    #[error("{what}: {reason}")]
    Invalid {
        /// The file or entry.
        what: String,
        /// What is wrong (a stable reason code first).
        reason: String,
    },
    /// The object store failed (network, credentials, server).
    #[error("shadow store, {key}: {reason}")]
    Store {
        /// The object.
        key: String,
        /// The store's error.
        reason: String,
    },
    /// The session has no shadow entry.
    #[error("no shadowed cache for this session")]
    NotFound,
}

impl ShadowError {
    /// Whether the stored entry itself is damaged — a block's checksum, a missing segment, a
    /// malformed file, hashes the engine recomputes differently — as opposed to a store that
    /// could not be reached or an entry written for another model or KV format (still good for
    /// the engine that wrote it).
    pub fn is_damage(&self) -> bool {
        match self {
            Self::Invalid { reason, .. } => matches!(
                reason.split(':').next().unwrap_or_default().trim(),
                "checksum" | "missing_segment" | "format"
            ),
            Self::Engine(EngineError::ShadowMismatch { .. }) => true,
            _ => false,
        }
    }
}

pub type Result<T> = std::result::Result<T, ShadowError>;

pub(crate) fn invalid(what: impl Into<String>, reason: impl Into<String>) -> ShadowError {
    ShadowError::Invalid {
        what: what.into(),
        reason: reason.into(),
    }
}
