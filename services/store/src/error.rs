//! The store's error type.

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration failed.
    #[error("migration: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// The URL names no supported database.
    #[error("unsupported database URL scheme in `{scheme}` (sqlite: or postgres:)")]
    UnsupportedUrl {
        /// The scheme found.
        scheme: String,
    },
    /// No such row (or not the caller's).
    #[error("{entity} `{id}` not found")]
    NotFound {
        /// What was looked up.
        entity: &'static str,
        /// Its id.
        id: String,
    },
    /// A unique name is taken.
    #[error("{entity} `{id}` already exists")]
    Conflict {
        /// What was created.
        entity: &'static str,
        /// Its name.
        id: String,
    },
    /// A stored value could not be read back (a corrupt row).
    #[error("corrupt {entity} row: {reason}")]
    Corrupt {
        /// The table.
        entity: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The OS random source failed.
    #[error("random source: {0}")]
    Random(std::io::Error),
}

/// The store's result type.
pub type StoreResult<T> = Result<T, StoreError>;
