//! The memory graph's rows: nodes, edges and the index's metadata.

use sqlx::Row;
use sqlx::any::AnyRow;

use super::{Store, commit_if_found, is_unique_violation, now_ms, random_id};
use crate::error::{StoreError, StoreResult};
use crate::model::{MemoryEdgeRow, MemoryNodeRow, NewMemoryEdge, NewMemoryNode};

const NODE_COLUMNS: &str = "id, tenant_id, agent_id, session_id, kind, text, importance, tokens, \
                            created_at, updated_at, last_accessed_at";
const EDGE_COLUMNS: &str =
    "id, tenant_id, from_id, to_id, kind, weight, valid_from, valid_to, created_at";

/// The memory graph's rows.
impl Store {
    fn node_of(row: &AnyRow) -> StoreResult<MemoryNodeRow> {
        Ok(MemoryNodeRow {
            id: row.try_get("id")?,
            tenant_id: row.try_get("tenant_id")?,
            agent_id: row.try_get("agent_id")?,
            session_id: row.try_get("session_id")?,
            kind: row.try_get("kind")?,
            text: row.try_get("text")?,
            importance: row.try_get("importance")?,
            tokens: row.try_get("tokens")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            last_accessed_at: row.try_get("last_accessed_at")?,
        })
    }

    fn edge_of(row: &AnyRow) -> StoreResult<MemoryEdgeRow> {
        Ok(MemoryEdgeRow {
            id: row.try_get("id")?,
            tenant_id: row.try_get("tenant_id")?,
            from_id: row.try_get("from_id")?,
            to_id: row.try_get("to_id")?,
            kind: row.try_get("kind")?,
            weight: row.try_get("weight")?,
            valid_from: row.try_get("valid_from")?,
            valid_to: row.try_get("valid_to")?,
            created_at: row.try_get("created_at")?,
        })
    }

    /// `columns` of every row of `table` (of one tenant, or of all when `tenant_id` is `None`),
    /// by id.
    async fn tenant_rows(
        &self,
        columns: &str,
        table: &str,
        tenant_id: Option<&str>,
    ) -> StoreResult<Vec<AnyRow>> {
        let filter = if tenant_id.is_some() {
            " WHERE tenant_id = $1"
        } else {
            ""
        };
        let sql = format!("SELECT {columns} FROM {table}{filter} ORDER BY id");
        let mut q = sqlx::query(&sql);
        if let Some(t) = tenant_id {
            q = q.bind(t);
        }
        Ok(q.fetch_all(&self.pool).await?)
    }

    /// Inserts a node; returns it with its id.
    ///
    /// Its id is random (53 bits, so JSON clients read it exactly): ids reveal neither how many
    /// nodes other tenants made nor when.
    pub async fn insert_memory_node(&self, n: &NewMemoryNode) -> StoreResult<MemoryNodeRow> {
        let now = now_ms();
        let mut tries = 0;
        loop {
            let row = sqlx::query(&format!(
                "INSERT INTO memory_nodes (id, tenant_id, agent_id, session_id, kind, text, \
                 importance, tokens, created_at, updated_at, last_accessed_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9, $9) RETURNING {NODE_COLUMNS}"
            ))
            .bind(random_id()?)
            .bind(&n.tenant_id)
            .bind(&n.agent_id)
            .bind(&n.session_id)
            .bind(&n.kind)
            .bind(&n.text)
            .bind(n.importance)
            .bind(n.tokens)
            .bind(now)
            .fetch_one(&self.pool)
            .await;
            match row {
                Ok(row) => return Self::node_of(&row),
                // A random id already taken (about one chance in 2^53 per node): draw again.
                Err(e) if tries < 3 && is_unique_violation(&e) => tries += 1,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Every node (of one tenant, or of all when `tenant_id` is `None`), by id.
    pub async fn memory_nodes(&self, tenant_id: Option<&str>) -> StoreResult<Vec<MemoryNodeRow>> {
        let rows = self
            .tenant_rows(NODE_COLUMNS, "memory_nodes", tenant_id)
            .await?;
        rows.iter().map(Self::node_of).collect()
    }

    /// A page of an agent's nodes: ids above `after`, by id, at most `limit`.
    pub async fn memory_nodes_page(
        &self,
        tenant_id: &str,
        agent_id: &str,
        after: i64,
        limit: i64,
    ) -> StoreResult<Vec<MemoryNodeRow>> {
        let rows = sqlx::query(&format!(
            "SELECT {NODE_COLUMNS} FROM memory_nodes WHERE tenant_id = $1 AND agent_id = $2 \
             AND id > $3 ORDER BY id LIMIT $4"
        ))
        .bind(tenant_id)
        .bind(agent_id)
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(Self::node_of).collect()
    }

    /// A page of the edges leaving an agent's nodes: ids above `after`, by id, at most `limit`.
    pub async fn memory_edges_page(
        &self,
        tenant_id: &str,
        agent_id: &str,
        after: i64,
        limit: i64,
    ) -> StoreResult<Vec<MemoryEdgeRow>> {
        let rows = sqlx::query(&format!(
            "SELECT {EDGE_COLUMNS} FROM memory_edges WHERE tenant_id = $1 AND from_id IN \
             (SELECT id FROM memory_nodes WHERE tenant_id = $1 AND agent_id = $2) \
             AND id > $3 ORDER BY id LIMIT $4"
        ))
        .bind(tenant_id)
        .bind(agent_id)
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(Self::edge_of).collect()
    }

    /// One node of a tenant.
    pub async fn memory_node(&self, tenant_id: &str, id: i64) -> StoreResult<MemoryNodeRow> {
        let row = sqlx::query(&format!(
            "SELECT {NODE_COLUMNS} FROM memory_nodes WHERE tenant_id = $1 AND id = $2"
        ))
        .bind(tenant_id)
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        match row {
            Some(r) => Self::node_of(&r),
            None => Err(StoreError::NotFound {
                entity: "memory node",
                id: id.to_string(),
            }),
        }
    }

    /// The id of an agent's node of `kind` whose text is `text` in session `session_id` (`None`:
    /// of no session, the agent's own), if there is one (the oldest).
    pub async fn memory_node_with_text(
        &self,
        tenant_id: &str,
        agent_id: &str,
        session_id: Option<&str>,
        kind: &str,
        text: &str,
    ) -> StoreResult<Option<i64>> {
        // `session_id IS NULL` when none is given: the agent's own node, not a session's.
        let row = sqlx::query(
            "SELECT id FROM memory_nodes WHERE tenant_id = $1 AND agent_id = $2 AND kind = $3 \
             AND text = $4 AND (session_id = $5 OR ($5 IS NULL AND session_id IS NULL)) \
             ORDER BY created_at LIMIT 1",
        )
        .bind(tenant_id)
        .bind(agent_id)
        .bind(kind)
        .bind(text)
        .bind(session_id)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| r.try_get("id")).transpose()?)
    }

    /// Changes a node's text, importance and token count; returns it.
    pub async fn update_memory_node(
        &self,
        tenant_id: &str,
        id: i64,
        text: &str,
        importance: f64,
        tokens: i64,
    ) -> StoreResult<MemoryNodeRow> {
        let done = sqlx::query(
            "UPDATE memory_nodes SET text = $3, importance = $4, tokens = $5, updated_at = $6 \
             WHERE tenant_id = $1 AND id = $2",
        )
        .bind(tenant_id)
        .bind(id)
        .bind(text)
        .bind(importance)
        .bind(tokens)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                entity: "memory node",
                id: id.to_string(),
            });
        }
        self.memory_node(tenant_id, id).await
    }

    /// Deletes a node and its edges (one transaction); `NotFound` if the tenant has no such node.
    pub async fn delete_memory_node(&self, tenant_id: &str, id: i64) -> StoreResult<()> {
        let mut tx = self.write_tx().await?;
        sqlx::query(
            "DELETE FROM memory_edges WHERE tenant_id = $1 AND (from_id = $2 OR to_id = $2)",
        )
        .bind(tenant_id)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        let done = sqlx::query("DELETE FROM memory_nodes WHERE tenant_id = $1 AND id = $2")
            .bind(tenant_id)
            .bind(id)
            .execute(&mut *tx)
            .await?;
        commit_if_found(tx, done.rows_affected(), "memory node", id.to_string()).await?;
        Ok(())
    }

    /// Records that nodes were recalled at `at` (never moves the time back).
    pub async fn touch_memory_nodes(
        &self,
        tenant_id: &str,
        ids: &[i64],
        at: i64,
    ) -> StoreResult<()> {
        for &id in ids {
            sqlx::query(
                "UPDATE memory_nodes SET last_accessed_at = $3 \
                 WHERE tenant_id = $1 AND id = $2 AND last_accessed_at < $3",
            )
            .bind(tenant_id)
            .bind(id)
            .bind(at)
            .execute(&self.pool)
            .await?;
        }
        Ok(())
    }

    /// Inserts an edge between two nodes of its tenant; returns it with its id.
    pub async fn insert_memory_edge(&self, e: &NewMemoryEdge) -> StoreResult<MemoryEdgeRow> {
        // Both ends must be the tenant's: the insert selects nothing otherwise. The id is random,
        // as a node's.
        let mut tries = 0;
        let row = loop {
            let row = sqlx::query(&format!(
                "INSERT INTO memory_edges (id, tenant_id, from_id, to_id, kind, weight, \
                 valid_from, valid_to, created_at) \
                 SELECT $9, $1, $2, $3, $4, $5, $6, $7, $8 WHERE \
                 (SELECT COUNT(*) FROM memory_nodes WHERE tenant_id = $1 AND id IN ($2, $3)) = 2 \
                 RETURNING {EDGE_COLUMNS}"
            ))
            .bind(&e.tenant_id)
            .bind(e.from_id)
            .bind(e.to_id)
            .bind(&e.kind)
            .bind(e.weight)
            .bind(e.valid_from)
            .bind(e.valid_to)
            .bind(now_ms())
            .bind(random_id()?)
            .fetch_optional(&self.pool)
            .await;
            match row {
                Ok(row) => break row,
                Err(err) if tries < 3 && is_unique_violation(&err) => tries += 1,
                Err(err) => return Err(err.into()),
            }
        };
        match row {
            Some(r) => Self::edge_of(&r),
            None => Err(StoreError::NotFound {
                entity: "memory node",
                id: format!("{} or {}", e.from_id, e.to_id),
            }),
        }
    }

    /// Every edge (of one tenant, or of all), by id.
    pub async fn memory_edges(&self, tenant_id: Option<&str>) -> StoreResult<Vec<MemoryEdgeRow>> {
        let rows = self
            .tenant_rows(EDGE_COLUMNS, "memory_edges", tenant_id)
            .await?;
        rows.iter().map(Self::edge_of).collect()
    }

    /// Deletes an edge of a tenant.
    pub async fn delete_memory_edge(&self, tenant_id: &str, id: i64) -> StoreResult<()> {
        let done = sqlx::query("DELETE FROM memory_edges WHERE tenant_id = $1 AND id = $2")
            .bind(tenant_id)
            .bind(id)
            .execute(&self.pool)
            .await?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                entity: "memory edge",
                id: id.to_string(),
            });
        }
        Ok(())
    }

    /// A value of derived state (e.g. `embedding_fingerprint`).
    pub async fn memory_meta(&self, key: &str) -> StoreResult<Option<String>> {
        let row = sqlx::query("SELECT value FROM memory_meta WHERE key = $1")
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        Ok(match row {
            Some(r) => Some(r.try_get("value")?),
            None => None,
        })
    }

    /// Sets a value of derived state.
    pub async fn set_memory_meta(&self, key: &str, value: &str) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO memory_meta (key, value) VALUES ($1, $2) \
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        )
        .bind(key)
        .bind(value)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}
