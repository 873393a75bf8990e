//! The repository: every query of the service.

use std::io::Read;
use std::time::{SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::migrate::Migrator;
use sqlx::{AnyPool, Executor, Row};

use crate::error::{StoreError, StoreResult};
use crate::migrate::Embedded;
mod lifecycle;
mod memory;
mod sessions;

use lifecycle::commit_if_found;

use crate::model::{
    AdminKey, AdminScope, Agent, ApiKey, Backend, LayerRow, MemoryScope, Quotas, Tenant,
};

/// Lines a session's working memory keeps at most (the newest).
pub const WORKING_MEMORY_LINES: i64 = 512;

/// The durable store (cheap to clone: a pool handle).
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Fills `buf` from the system's random source.
fn random_bytes(buf: &mut [u8]) -> StoreResult<()> {
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(StoreError::Random)
}

/// `bytes` random bytes from the OS, in hex.
pub fn random_hex(bytes: usize) -> StoreResult<String> {
    let mut buf = vec![0u8; bytes];
    random_bytes(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A random id in 1..2^53 (exact in every JSON reader).
fn random_id() -> StoreResult<i64> {
    let mut buf = [0u8; 8];
    random_bytes(&mut buf)?;
    let v = u64::from_le_bytes(buf) & ((1 << 53) - 1);
    Ok(i64::try_from(v.max(1)).unwrap_or(1))
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .is_some_and(|d| d.is_unique_violation())
}

/// The `id` column of each row.
fn ids_of(rows: Vec<sqlx::any::AnyRow>) -> StoreResult<Vec<i64>> {
    rows.iter()
        .map(|r| r.try_get::<i64, _>("id").map_err(Into::into))
        .collect()
}

fn hash_secret(secret: &str) -> String {
    Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Maps a unique violation to `Conflict`.
fn conflict<'a>(entity: &'static str, id: &'a str) -> impl FnOnce(sqlx::Error) -> StoreError + 'a {
    move |e| match &e {
        sqlx::Error::Database(d) if d.is_unique_violation() => StoreError::Conflict {
            entity,
            id: id.to_string(),
        },
        _ => StoreError::Database(e),
    }
}

fn u64_of(v: i64, entity: &'static str) -> StoreResult<u64> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt {
        entity,
        reason: format!("negative count {v}"),
    })
}

impl Store {
    /// Connects (`sqlite://path?mode=rwc` or `postgres://…`) and applies the migrations.
    pub async fn connect(url: &str) -> StoreResult<Self> {
        sqlx::any::install_default_drivers();
        let scheme = url.split(':').next().unwrap_or_default();
        let backend = match scheme {
            "sqlite" => Backend::Sqlite,
            "postgres" | "postgresql" => Backend::Postgres,
            other => {
                return Err(StoreError::UnsupportedUrl {
                    scheme: other.to_string(),
                });
            }
        };
        let mut options = AnyPoolOptions::new().max_connections(8);
        if backend == Backend::Sqlite {
            options = options.after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("PRAGMA foreign_keys = ON").await?;
                    conn.execute("PRAGMA busy_timeout = 5000").await?;
                    Ok(())
                })
            });
        }
        let pool = options.connect(url).await?;
        let store = Self { pool, backend };
        Migrator::new(Embedded(backend))
            .await?
            .run(&store.pool)
            .await?;
        Ok(store)
    }

    /// Begins a write transaction. On SQLite it takes the write lock at once (`BEGIN
    /// IMMEDIATE`): a deferred transaction that reads first and then writes cannot wait for
    /// another writer (SQLite answers "database is locked" at once rather than deadlock), while
    /// an immediate one waits out `busy_timeout` like any other.
    pub(crate) async fn write_tx(&self) -> StoreResult<sqlx::Transaction<'static, sqlx::Any>> {
        Ok(match self.backend {
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await?,
            Backend::Postgres => self.pool.begin().await?,
        })
    }

    /// [`Self::write_tx`] holding agent `agent_id`'s row, so that writers numbering the agent's
    /// rows (layer versions, turn and working-memory sequence numbers: read the max, insert the
    /// next) take turns on PostgreSQL too; SQLite's immediate transaction already does.
    pub(crate) async fn agent_write_tx(
        &self,
        agent_id: &str,
    ) -> StoreResult<sqlx::Transaction<'static, sqlx::Any>> {
        let mut tx = self.write_tx().await?;
        if self.backend == Backend::Postgres {
            sqlx::query("SELECT id FROM agents WHERE id = $1 FOR UPDATE")
                .bind(agent_id)
                .fetch_optional(&mut *tx)
                .await?;
        }
        Ok(tx)
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Closes the pool.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// True when the database answers.
    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }

    // ---- tenants and keys ----

    /// Creates a tenant with a fresh cache salt.
    pub async fn create_tenant(&self, name: &str, quotas: Quotas) -> StoreResult<Tenant> {
        let salt_hex = random_hex(8)?;
        // Fits i64; never 0, the salt of blocks an operator marked public.
        let salt = (u64::from_str_radix(&salt_hex, 16).unwrap_or(0) >> 1).max(1);
        let t = Tenant {
            id: format!("tn_{}", random_hex(8)?),
            name: name.to_string(),
            cache_salt: salt,
            quotas,
            created_at: now_ms(),
        };
        sqlx::query(
            "INSERT INTO tenants (id, name, cache_salt, quota_hot_blocks, quota_cold_blocks, \
             quota_sessions, quota_shadow_mib, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&t.id)
        .bind(&t.name)
        .bind(t.cache_salt as i64)
        .bind(quotas.hot_blocks as i64)
        .bind(quotas.cold_blocks as i64)
        .bind(quotas.sessions as i64)
        .bind(quotas.shadow_mib as i64)
        .bind(t.created_at)
        .execute(&self.pool)
        .await
        .map_err(conflict("tenant", name))?;
        Ok(t)
    }

    fn tenant_of(row: &AnyRow) -> StoreResult<Tenant> {
        Ok(Tenant {
            id: row.try_get("id")?,
            name: row.try_get("name")?,
            cache_salt: u64_of(row.try_get("cache_salt")?, "tenant")?,
            quotas: Quotas {
                hot_blocks: u64_of(row.try_get("quota_hot_blocks")?, "tenant")?,
                cold_blocks: u64_of(row.try_get("quota_cold_blocks")?, "tenant")?,
                sessions: u64_of(row.try_get("quota_sessions")?, "tenant")?,
                shadow_mib: u64_of(row.try_get("quota_shadow_mib")?, "tenant")?,
            },
            created_at: row.try_get("created_at")?,
        })
    }

    /// A tenant by id.
    pub async fn tenant(&self, id: &str) -> StoreResult<Tenant> {
        let row = sqlx::query("SELECT * FROM tenants WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                entity: "tenant",
                id: id.to_string(),
            })?;
        Self::tenant_of(&row)
    }

    /// Every tenant, oldest first.
    pub async fn tenants(&self) -> StoreResult<Vec<Tenant>> {
        sqlx::query("SELECT * FROM tenants ORDER BY created_at, id")
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(Self::tenant_of)
            .collect()
    }

    /// At most `limit` rows of `table` (of `tenant` when given) after `after`, a
    /// `(created_at, id)` of the previous page, in creation order: the keyset page every
    /// creation-ordered listing uses.
    async fn keyset(
        &self,
        table: &'static str,
        tenant: Option<&str>,
        after: Option<(i64, &str)>,
        limit: i64,
    ) -> StoreResult<Vec<AnyRow>> {
        let (at, id) = after.unwrap_or((i64::MIN, ""));
        let scope = if tenant.is_some() {
            "tenant_id = $4 AND "
        } else {
            ""
        };
        let sql = format!(
            "SELECT * FROM {table} WHERE {scope}(created_at > $1 OR (created_at = $1 AND id > $2)) \
             ORDER BY created_at, id LIMIT $3"
        );
        let mut q = sqlx::query(&sql).bind(at).bind(id).bind(limit);
        if let Some(t) = tenant {
            q = q.bind(t);
        }
        Ok(q.fetch_all(&self.pool).await?)
    }

    /// At most `limit` tenants after `after` (a `(created_at, id)` of the previous page), in
    /// creation order.
    pub async fn tenants_page(
        &self,
        after: Option<(i64, &str)>,
        limit: i64,
    ) -> StoreResult<Vec<Tenant>> {
        self.keyset("tenants", None, after, limit)
            .await?
            .iter()
            .map(Self::tenant_of)
            .collect()
    }

    /// Issues an API key; returns its record and the secret (shown once; only its hash is kept).
    pub async fn create_key(&self, tenant_id: &str) -> StoreResult<(ApiKey, String)> {
        self.tenant(tenant_id).await?;
        let secret = format!("ek_{}", random_hex(24)?);
        let key = ApiKey {
            id: format!("key_{}", random_hex(8)?),
            tenant_id: tenant_id.to_string(),
            created_at: now_ms(),
            revoked_at: None,
        };
        sqlx::query(
            "INSERT INTO api_keys (id, tenant_id, key_hash, created_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(&key.id)
        .bind(tenant_id)
        .bind(hash_secret(&secret))
        .bind(key.created_at)
        .execute(&self.pool)
        .await?;
        Ok((key, secret))
    }

    /// The tenant a secret belongs to, if the key exists and is not revoked.
    pub async fn authenticate(&self, secret: &str) -> StoreResult<Option<Tenant>> {
        let row = sqlx::query(
            "SELECT t.* FROM api_keys k JOIN tenants t ON t.id = k.tenant_id \
             WHERE k.key_hash = $1 AND k.revoked_at IS NULL",
        )
        .bind(hash_secret(secret))
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(Self::tenant_of).transpose()
    }

    /// Revokes a key of a tenant.
    pub async fn revoke_key(&self, tenant_id: &str, key_id: &str) -> StoreResult<()> {
        let done = sqlx::query(
            "UPDATE api_keys SET revoked_at = $1 WHERE id = $2 AND tenant_id = $3 \
             AND revoked_at IS NULL",
        )
        .bind(now_ms())
        .bind(key_id)
        .bind(tenant_id)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                entity: "api key",
                id: key_id.to_string(),
            });
        }
        Ok(())
    }

    // ---- operator keys ----

    /// Issues an operator key with `scopes`; returns its record and the secret (shown once;
    /// only its hash is kept).
    pub async fn create_admin_key(
        &self,
        name: &str,
        scopes: &[AdminScope],
    ) -> StoreResult<(AdminKey, String)> {
        let secret = format!("eka_{}", random_hex(24)?);
        let mut scopes = scopes.to_vec();
        scopes.sort_unstable();
        scopes.dedup();
        let key = AdminKey {
            id: format!("akey_{}", random_hex(8)?),
            name: name.to_string(),
            scopes,
            created_at: now_ms(),
            revoked_at: None,
        };
        sqlx::query(
            "INSERT INTO admin_keys (id, key_hash, name, scopes, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&key.id)
        .bind(hash_secret(&secret))
        .bind(name)
        .bind(scopes_text(&key.scopes))
        .bind(key.created_at)
        .execute(&self.pool)
        .await?;
        Ok((key, secret))
    }

    fn admin_key_of(row: &AnyRow) -> StoreResult<AdminKey> {
        let text: String = row.try_get("scopes")?;
        let scopes = text
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                AdminScope::parse(s).ok_or_else(|| StoreError::Corrupt {
                    entity: "admin_keys",
                    reason: format!("scope `{s}`"),
                })
            })
            .collect::<StoreResult<Vec<_>>>()?;
        Ok(AdminKey {
            id: row.try_get("id")?,
            name: row.try_get("name")?,
            scopes,
            created_at: row.try_get("created_at")?,
            revoked_at: row.try_get("revoked_at")?,
        })
    }

    /// The operator key a secret belongs to, if it exists and is not revoked.
    pub async fn admin_key_of_secret(&self, secret: &str) -> StoreResult<Option<AdminKey>> {
        let row =
            sqlx::query("SELECT * FROM admin_keys WHERE key_hash = $1 AND revoked_at IS NULL")
                .bind(hash_secret(secret))
                .fetch_optional(&self.pool)
                .await?;
        row.as_ref().map(Self::admin_key_of).transpose()
    }

    /// At most `limit` operator keys, revoked ones too, after `after` (a `(created_at, id)` of
    /// the previous page), oldest first.
    pub async fn admin_keys(
        &self,
        after: Option<(i64, &str)>,
        limit: i64,
    ) -> StoreResult<Vec<AdminKey>> {
        self.keyset("admin_keys", None, after, limit)
            .await?
            .iter()
            .map(Self::admin_key_of)
            .collect()
    }

    /// Revokes an operator key.
    pub async fn revoke_admin_key(&self, key_id: &str) -> StoreResult<()> {
        let done = sqlx::query(
            "UPDATE admin_keys SET revoked_at = $1 WHERE id = $2 AND revoked_at IS NULL",
        )
        .bind(now_ms())
        .bind(key_id)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                entity: "admin key",
                id: key_id.to_string(),
            });
        }
        Ok(())
    }

    // ---- agents and layers ----

    /// Creates an agent; names are unique per tenant.
    pub async fn create_agent(
        &self,
        tenant_id: &str,
        name: &str,
        memory_scope: MemoryScope,
    ) -> StoreResult<Agent> {
        let agent = Agent {
            id: format!("ag_{}", random_hex(8)?),
            tenant_id: tenant_id.to_string(),
            name: name.to_string(),
            created_at: now_ms(),
            memory_scope,
        };
        sqlx::query(
            "INSERT INTO agents (id, tenant_id, name, created_at, memory_scope) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&agent.id)
        .bind(tenant_id)
        .bind(name)
        .bind(agent.created_at)
        .bind(memory_scope.as_str())
        .execute(&self.pool)
        .await
        .map_err(conflict("agent", name))?;
        Ok(agent)
    }

    fn agent_of(row: &AnyRow) -> StoreResult<Agent> {
        Ok(Agent {
            id: row.try_get("id")?,
            tenant_id: row.try_get("tenant_id")?,
            name: row.try_get("name")?,
            created_at: row.try_get("created_at")?,
            memory_scope: {
                let s: String = row.try_get("memory_scope")?;
                MemoryScope::parse(&s).ok_or_else(|| StoreError::Corrupt {
                    entity: "agents",
                    reason: format!("memory_scope `{s}`"),
                })?
            },
        })
    }

    /// A tenant's agent, by id or by name.
    pub async fn agent(&self, tenant_id: &str, id_or_name: &str) -> StoreResult<Agent> {
        let row =
            sqlx::query("SELECT * FROM agents WHERE tenant_id = $1 AND (id = $2 OR name = $3)")
                .bind(tenant_id)
                .bind(id_or_name)
                .bind(id_or_name)
                .fetch_optional(&self.pool)
                .await?
                .ok_or_else(|| StoreError::NotFound {
                    entity: "agent",
                    id: id_or_name.to_string(),
                })?;
        Self::agent_of(&row)
    }

    /// At most `limit` of a tenant's agents after `after` (a `(created_at, id)` of the previous
    /// page), oldest first.
    pub async fn agents_page(
        &self,
        tenant_id: &str,
        after: Option<(i64, &str)>,
        limit: i64,
    ) -> StoreResult<Vec<Agent>> {
        self.keyset("agents", Some(tenant_id), after, limit)
            .await?
            .iter()
            .map(Self::agent_of)
            .collect()
    }

    /// A tenant's agents, oldest first.
    pub async fn agents(&self, tenant_id: &str) -> StoreResult<Vec<Agent>> {
        sqlx::query("SELECT * FROM agents WHERE tenant_id = $1 ORDER BY created_at, id")
            .bind(tenant_id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(Self::agent_of)
            .collect()
    }

    /// Stores a new version of a layer; returns it.
    pub async fn put_layer(
        &self,
        agent_id: &str,
        kind: &str,
        content: &str,
        budget: u64,
        stable: bool,
        importance: f64,
    ) -> StoreResult<LayerRow> {
        let mut tx = self.agent_write_tx(agent_id).await?;
        let version: i64 = sqlx::query(
            "SELECT COALESCE(MAX(version), 0) AS v FROM layers WHERE agent_id = $1 AND kind = $2",
        )
        .bind(agent_id)
        .bind(kind)
        .fetch_one(&mut *tx)
        .await?
        .try_get("v")?;
        let row = LayerRow {
            kind: kind.to_string(),
            version: version + 1,
            content: content.to_string(),
            budget,
            stable,
            importance,
            public: false,
            created_at: now_ms(),
        };
        sqlx::query(
            "INSERT INTO layers (agent_id, kind, version, content, budget, stable, importance, \
             created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(agent_id)
        .bind(kind)
        .bind(row.version)
        .bind(content)
        .bind(budget as i64)
        .bind(i64::from(stable))
        .bind(importance)
        .bind(row.created_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(row)
    }

    fn layer_of(row: &AnyRow) -> StoreResult<LayerRow> {
        Ok(LayerRow {
            kind: row.try_get("kind")?,
            version: row.try_get("version")?,
            content: row.try_get("content")?,
            budget: u64_of(row.try_get("budget")?, "layer")?,
            stable: row.try_get::<i64, _>("stable")? != 0,
            importance: row.try_get("importance")?,
            public: row.try_get::<i64, _>("is_public")? != 0,
            created_at: row.try_get("created_at")?,
        })
    }

    /// Marks (or unmarks) the current version of a layer public; returns it.
    pub async fn set_layer_public(
        &self,
        agent_id: &str,
        kind: &str,
        public: bool,
    ) -> StoreResult<LayerRow> {
        let done = sqlx::query(
            "UPDATE layers SET is_public = $3 WHERE agent_id = $1 AND kind = $2 AND version = \
             (SELECT MAX(version) FROM layers m WHERE m.agent_id = $1 AND m.kind = $2)",
        )
        .bind(agent_id)
        .bind(kind)
        .bind(i64::from(public))
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                entity: "layer",
                id: format!("{agent_id}/{kind}"),
            });
        }
        self.layers(agent_id)
            .await?
            .into_iter()
            .find(|l| l.kind == kind)
            .ok_or_else(|| StoreError::NotFound {
                entity: "layer",
                id: format!("{agent_id}/{kind}"),
            })
    }

    /// The newest version of each of an agent's layers, by kind.
    pub async fn layers(&self, agent_id: &str) -> StoreResult<Vec<LayerRow>> {
        sqlx::query(
            "SELECT l.* FROM layers l WHERE l.agent_id = $1 AND l.version = \
             (SELECT MAX(version) FROM layers m WHERE m.agent_id = l.agent_id AND m.kind = l.kind) \
             ORDER BY l.kind",
        )
        .bind(agent_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(Self::layer_of)
        .collect()
    }

    /// Every version of one layer, oldest first.
    pub async fn layer_history(&self, agent_id: &str, kind: &str) -> StoreResult<Vec<LayerRow>> {
        sqlx::query("SELECT * FROM layers WHERE agent_id = $1 AND kind = $2 ORDER BY version")
            .bind(agent_id)
            .bind(kind)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(Self::layer_of)
            .collect()
    }
}

/// Token ids as the log stores them: a JSON list.
fn token_list(tokens: &[u32]) -> String {
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    format!("[{}]", ids.join(","))
}

/// Scopes as stored: comma-separated names.
fn scopes_text(scopes: &[AdminScope]) -> String {
    scopes
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(",")
}
