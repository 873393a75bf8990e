//! Embedded migrations, one set per backend (`migrations/sqlite`, `migrations/postgres`), given
//! to sqlx's migrator as a [`MigrationSource`], so the binary needs no files at run time.

use std::borrow::Cow;
use std::future::Future;
use std::pin::Pin;

use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType};

use crate::model::Backend;

const SQLITE: &[(i64, &str, &str)] = &[
    (
        1,
        "initial",
        include_str!("../../../migrations/sqlite/0001_initial.sql"),
    ),
    (
        2,
        "public_layers",
        include_str!("../../../migrations/sqlite/0002_public_layers.sql"),
    ),
    (
        3,
        "memory_graph",
        include_str!("../../../migrations/sqlite/0003_memory_graph.sql"),
    ),
    (
        4,
        "turn_replies",
        include_str!("../../../migrations/sqlite/0004_turn_replies.sql"),
    ),
    (
        5,
        "context_entries",
        include_str!("../../../migrations/sqlite/0005_context_entries.sql"),
    ),
    (
        6,
        "turn_memories",
        include_str!("../../../migrations/sqlite/0006_turn_memories.sql"),
    ),
    (
        7,
        "memory_scope",
        include_str!("../../../migrations/sqlite/0007_memory_scope.sql"),
    ),
    (
        8,
        "admin_keys",
        include_str!("../../../migrations/sqlite/0008_admin_keys.sql"),
    ),
    (
        9,
        "shadow_quota",
        include_str!("../../../migrations/sqlite/0009_shadow_quota.sql"),
    ),
    (
        10,
        "session_labels",
        include_str!("../../../migrations/sqlite/0010_session_labels.sql"),
    ),
    (
        11,
        "responses",
        include_str!("../../../migrations/sqlite/0011_responses.sql"),
    ),
];

const POSTGRES: &[(i64, &str, &str)] = &[
    (
        1,
        "initial",
        include_str!("../../../migrations/postgres/0001_initial.sql"),
    ),
    (
        2,
        "public_layers",
        include_str!("../../../migrations/postgres/0002_public_layers.sql"),
    ),
    (
        3,
        "memory_graph",
        include_str!("../../../migrations/postgres/0003_memory_graph.sql"),
    ),
    (
        4,
        "turn_replies",
        include_str!("../../../migrations/postgres/0004_turn_replies.sql"),
    ),
    (
        5,
        "context_entries",
        include_str!("../../../migrations/postgres/0005_context_entries.sql"),
    ),
    (
        6,
        "turn_memories",
        include_str!("../../../migrations/postgres/0006_turn_memories.sql"),
    ),
    (
        7,
        "memory_scope",
        include_str!("../../../migrations/postgres/0007_memory_scope.sql"),
    ),
    (
        8,
        "admin_keys",
        include_str!("../../../migrations/postgres/0008_admin_keys.sql"),
    ),
    (
        9,
        "shadow_quota",
        include_str!("../../../migrations/postgres/0009_shadow_quota.sql"),
    ),
    (
        10,
        "session_labels",
        include_str!("../../../migrations/postgres/0010_session_labels.sql"),
    ),
    (
        11,
        "responses",
        include_str!("../../../migrations/postgres/0011_responses.sql"),
    ),
];

/// The migrations of one backend.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Embedded(pub Backend);

type Resolved = Pin<Box<dyn Future<Output = Result<Vec<Migration>, BoxDynError>> + Send>>;

impl MigrationSource<'static> for Embedded {
    fn resolve(self) -> Resolved {
        let set = match self.0 {
            Backend::Sqlite => SQLITE,
            Backend::Postgres => POSTGRES,
        };
        let migrations = set
            .iter()
            .map(|&(version, description, sql)| {
                Migration::new(
                    version,
                    Cow::Borrowed(description),
                    MigrationType::Simple,
                    Cow::Borrowed(sql),
                    false,
                )
            })
            .collect();
        Box::pin(async move { Ok(migrations) })
    }
}
