//! Deleting what a tenant stored: a session, an agent, a tenant, each in one transaction that
//! either removes every row of it or (when its main row does not exist) nothing.

use sqlx::Row;

use super::{Store, ids_of};
use crate::error::{StoreError, StoreResult};

impl Store {
    /// Session names of an agent.
    pub async fn sessions(&self, agent_id: &str) -> StoreResult<Vec<String>> {
        let rows = sqlx::query("SELECT id FROM sessions WHERE agent_id = $1 ORDER BY id")
            .bind(agent_id)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| r.try_get::<String, _>("id").map_err(Into::into))
            .collect()
    }

    /// Deletes a session: its turn log, working memory, stored responses and memory nodes (with
    /// their edges), in one transaction. Returns the deleted nodes' ids; `NotFound` when the session does not
    /// exist.
    pub async fn delete_session(&self, agent_id: &str, session_id: &str) -> StoreResult<Vec<i64>> {
        let mut tx = self.write_tx().await?;
        let nodes = ids_of(
            sqlx::query("SELECT id FROM memory_nodes WHERE agent_id = $1 AND session_id = $2")
                .bind(agent_id)
                .bind(session_id)
                .fetch_all(&mut *tx)
                .await?,
        )?;
        delete_edges_of(&mut tx, &nodes).await?;
        sqlx::query("DELETE FROM memory_nodes WHERE agent_id = $1 AND session_id = $2")
            .bind(agent_id)
            .bind(session_id)
            .execute(&mut *tx)
            .await?;
        for table in ["working_memory", "turns", "responses"] {
            sqlx::query(&format!(
                "DELETE FROM {table} WHERE agent_id = $1 AND session_id = $2"
            ))
            .bind(agent_id)
            .bind(session_id)
            .execute(&mut *tx)
            .await?;
        }
        let done = sqlx::query("DELETE FROM sessions WHERE agent_id = $1 AND id = $2")
            .bind(agent_id)
            .bind(session_id)
            .execute(&mut *tx)
            .await?;
        commit_if_found(tx, done.rows_affected(), "session", session_id.to_string()).await?;
        Ok(nodes)
    }

    /// Deletes an agent and everything it holds (sessions, turns, working memory, stored
    /// responses, layers, memory nodes and edges), in one transaction; returns the deleted nodes' ids.
    pub async fn delete_agent(&self, tenant_id: &str, agent_id: &str) -> StoreResult<Vec<i64>> {
        let mut tx = self.write_tx().await?;
        let nodes = ids_of(
            sqlx::query("SELECT id FROM memory_nodes WHERE tenant_id = $1 AND agent_id = $2")
                .bind(tenant_id)
                .bind(agent_id)
                .fetch_all(&mut *tx)
                .await?,
        )?;
        delete_edges_of(&mut tx, &nodes).await?;
        for table in [
            "memory_nodes",
            "working_memory",
            "turns",
            "responses",
            "sessions",
            "layers",
        ] {
            sqlx::query(&format!("DELETE FROM {table} WHERE agent_id = $1"))
                .bind(agent_id)
                .execute(&mut *tx)
                .await?;
        }
        let done = sqlx::query("DELETE FROM agents WHERE tenant_id = $1 AND id = $2")
            .bind(tenant_id)
            .bind(agent_id)
            .execute(&mut *tx)
            .await?;
        commit_if_found(tx, done.rows_affected(), "agent", agent_id.to_string()).await?;
        Ok(nodes)
    }

    /// Deletes a tenant and everything it holds (agents and all they hold, stored responses,
    /// API keys), in one
    /// transaction; returns the deleted nodes' ids.
    pub async fn delete_tenant(&self, tenant_id: &str) -> StoreResult<Vec<i64>> {
        let mut tx = self.write_tx().await?;
        let nodes = ids_of(
            sqlx::query("SELECT id FROM memory_nodes WHERE tenant_id = $1")
                .bind(tenant_id)
                .fetch_all(&mut *tx)
                .await?,
        )?;
        sqlx::query("DELETE FROM memory_edges WHERE tenant_id = $1")
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM memory_nodes WHERE tenant_id = $1")
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?;
        for table in ["working_memory", "turns", "layers"] {
            sqlx::query(&format!(
                "DELETE FROM {table} WHERE agent_id IN (SELECT id FROM agents WHERE tenant_id = $1)"
            ))
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?;
        }
        for table in ["responses", "sessions", "agents", "api_keys"] {
            sqlx::query(&format!("DELETE FROM {table} WHERE tenant_id = $1"))
                .bind(tenant_id)
                .execute(&mut *tx)
                .await?;
        }
        let done = sqlx::query("DELETE FROM tenants WHERE id = $1")
            .bind(tenant_id)
            .execute(&mut *tx)
            .await?;
        commit_if_found(tx, done.rows_affected(), "tenant", tenant_id.to_string()).await?;
        Ok(nodes)
    }

    /// Stores a response of the Responses API: its body, under the tenant, the agent and the
    /// session its chain continues.
    pub async fn put_response(
        &self,
        id: &str,
        tenant_id: &str,
        agent_id: &str,
        session_id: &str,
        body: &str,
    ) -> StoreResult<()> {
        sqlx::query(
            "INSERT INTO responses (id, tenant_id, agent_id, session_id, body, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(id)
        .bind(tenant_id)
        .bind(agent_id)
        .bind(session_id)
        .bind(body)
        .bind(super::now_ms())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// A tenant's stored response: its agent, session and body; `None` when it has none of
    /// that id.
    pub async fn response(
        &self,
        tenant_id: &str,
        id: &str,
    ) -> StoreResult<Option<(String, String, String)>> {
        let row = sqlx::query(
            "SELECT agent_id, session_id, body FROM responses WHERE tenant_id = $1 AND id = $2",
        )
        .bind(tenant_id)
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| {
            Ok((
                r.try_get("agent_id")?,
                r.try_get("session_id")?,
                r.try_get("body")?,
            ))
        })
        .transpose()
    }

    /// Replaces the body of a tenant's stored response (a streamed one, once it has ended).
    pub async fn update_response(&self, tenant_id: &str, id: &str, body: &str) -> StoreResult<()> {
        sqlx::query("UPDATE responses SET body = $3 WHERE tenant_id = $1 AND id = $2")
            .bind(tenant_id)
            .bind(id)
            .bind(body)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Deletes a tenant's stored response; false when it has none of that id.
    pub async fn delete_response(&self, tenant_id: &str, id: &str) -> StoreResult<bool> {
        let done = sqlx::query("DELETE FROM responses WHERE tenant_id = $1 AND id = $2")
            .bind(tenant_id)
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }
}

/// Deletes the edges touching `nodes`.
async fn delete_edges_of(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    nodes: &[i64],
) -> StoreResult<()> {
    for &id in nodes {
        sqlx::query("DELETE FROM memory_edges WHERE from_id = $1 OR to_id = $1")
            .bind(id)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// Commits a delete whose main row existed (`rows` deleted); rolls back with `NotFound`
/// otherwise, so a delete of nothing changes nothing.
pub(super) async fn commit_if_found(
    tx: sqlx::Transaction<'_, sqlx::Any>,
    rows: u64,
    entity: &'static str,
    id: impl ToString,
) -> StoreResult<()> {
    if rows == 0 {
        tx.rollback().await?;
        return Err(StoreError::NotFound {
            entity,
            id: id.to_string(),
        });
    }
    tx.commit().await?;
    Ok(())
}
