//! Sessions, their turn logs (appends, forks, branches, pages) and working memory.

use sqlx::Row;
use sqlx::any::AnyRow;

use super::{Store, WORKING_MEMORY_LINES, conflict, now_ms, token_list, u64_of};
use crate::error::{StoreError, StoreResult};
use crate::model::{NewEntry, Role, SessionRow, TurnRow, WorkingLine};

/// Sessions, turns, working memory.
impl Store {
    /// Creates the session if it does not exist; true when it was created.
    pub async fn ensure_session(
        &self,
        tenant_id: &str,
        agent_id: &str,
        session_id: &str,
    ) -> StoreResult<bool> {
        if self.session_exists(agent_id, session_id).await? {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO sessions (agent_id, id, tenant_id, created_at) VALUES ($1, $2, $3, $4)",
        )
        .bind(agent_id)
        .bind(session_id)
        .bind(tenant_id)
        .bind(now_ms())
        .execute(&self.pool)
        .await
        .map_err(conflict("session", session_id))?;
        Ok(true)
    }

    /// Stores what the client called a session (an OpenAI `user` string the session's name is
    /// a hash of).
    pub async fn label_session(
        &self,
        agent_id: &str,
        session_id: &str,
        label: &str,
    ) -> StoreResult<()> {
        sqlx::query("UPDATE sessions SET label = $3 WHERE agent_id = $1 AND id = $2")
            .bind(agent_id)
            .bind(session_id)
            .bind(label)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// What the client called a session, if its name is a hash of that.
    pub async fn session_label(
        &self,
        agent_id: &str,
        session_id: &str,
    ) -> StoreResult<Option<String>> {
        let row = sqlx::query("SELECT label FROM sessions WHERE agent_id = $1 AND id = $2")
            .bind(agent_id)
            .bind(session_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.try_get("label")).transpose()?.flatten())
    }

    /// At most `limit` of an agent's sessions after `after` (a `(created_at, id)` of the
    /// previous page), oldest first, with the entries of each log.
    pub async fn sessions_page(
        &self,
        agent_id: &str,
        after: Option<(i64, &str)>,
        limit: i64,
    ) -> StoreResult<Vec<SessionRow>> {
        let (at, id) = after.unwrap_or((i64::MIN, ""));
        sqlx::query(
            "SELECT s.id, s.label, s.created_at, \
             (SELECT COUNT(*) FROM turns t WHERE t.agent_id = s.agent_id AND t.session_id = s.id) \
             AS entries FROM sessions s WHERE s.agent_id = $1 \
             AND (s.created_at > $2 OR (s.created_at = $2 AND s.id > $3)) \
             ORDER BY s.created_at, s.id LIMIT $4",
        )
        .bind(agent_id)
        .bind(at)
        .bind(id)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| {
            Ok(SessionRow {
                id: r.try_get("id")?,
                label: r.try_get("label")?,
                created_at: r.try_get("created_at")?,
                entries: r.try_get("entries")?,
            })
        })
        .collect()
    }

    /// At most `limit` entries of a session's log after position `after`, in order.
    pub async fn turns_page(
        &self,
        agent_id: &str,
        session_id: &str,
        after: i64,
        limit: i64,
    ) -> StoreResult<Vec<TurnRow>> {
        sqlx::query(
            "SELECT * FROM turns WHERE agent_id = $1 AND session_id = $2 AND seq > $3 \
             ORDER BY seq LIMIT $4",
        )
        .bind(agent_id)
        .bind(session_id)
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(Self::turn_of)
        .collect()
    }

    /// Whether an agent has the session.
    pub async fn session_exists(&self, agent_id: &str, session_id: &str) -> StoreResult<bool> {
        Ok(
            sqlx::query("SELECT 1 AS one FROM sessions WHERE agent_id = $1 AND id = $2")
                .bind(agent_id)
                .bind(session_id)
                .fetch_optional(&self.pool)
                .await?
                .is_some(),
        )
    }

    /// Sessions a tenant holds.
    pub async fn session_count(&self, tenant_id: &str) -> StoreResult<u64> {
        let n: i64 = sqlx::query("SELECT COUNT(*) AS n FROM sessions WHERE tenant_id = $1")
            .bind(tenant_id)
            .fetch_one(&self.pool)
            .await?
            .try_get("n")?;
        u64_of(n, "session")
    }

    /// Appends one turn to a session's log; answers its position.
    pub async fn append_turn(
        &self,
        agent_id: &str,
        session_id: &str,
        role: Role,
        text: &str,
        tokens: &[u32],
    ) -> StoreResult<i64> {
        self.append_turns(agent_id, session_id, &[(role, text, tokens)], None)
            .await
    }

    /// Appends turns to a session's log in one transaction (a user turn and its reply land
    /// together or not at all); answers the position of the last. `reply`, an idempotency key
    /// and the answer's JSON, is stored on the last turn (see [`Store::turn_reply`]); a key the
    /// session already used is a `Conflict`.
    pub async fn append_turns(
        &self,
        agent_id: &str,
        session_id: &str,
        turns: &[(Role, &str, &[u32])],
        reply: Option<(&str, &str)>,
    ) -> StoreResult<i64> {
        let entries: Vec<NewEntry<'_>> = turns
            .iter()
            .map(|&(role, text, tokens)| NewEntry {
                role,
                name: None,
                text,
                tokens,
                ends_prefill: true,
                memories: None,
            })
            .collect();
        self.append_entries(agent_id, session_id, &entries, reply)
            .await
    }

    /// Appends entries to a session's log in one transaction; answers the position of the
    /// last. `reply` as for [`Store::append_turns`].
    pub async fn append_entries(
        &self,
        agent_id: &str,
        session_id: &str,
        entries: &[NewEntry<'_>],
        reply: Option<(&str, &str)>,
    ) -> StoreResult<i64> {
        let mut tx = self.agent_write_tx(agent_id).await?;
        let mut seq: i64 = sqlx::query(
            "SELECT COALESCE(MAX(seq), 0) AS s FROM turns WHERE agent_id = $1 AND session_id = $2",
        )
        .bind(agent_id)
        .bind(session_id)
        .fetch_one(&mut *tx)
        .await?
        .try_get("s")?;
        for (i, e) in entries.iter().enumerate() {
            let (key, json) = match reply {
                Some((k, j)) if i + 1 == entries.len() => (Some(k), Some(j)),
                _ => (None, None),
            };
            seq += 1;
            sqlx::query(
                "INSERT INTO turns (agent_id, session_id, seq, role, text, tokens, created_at, \
                 idem_key, reply, name, ends_prefill, memories) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
            )
            .bind(agent_id)
            .bind(session_id)
            .bind(seq)
            .bind(e.role.as_str())
            .bind(e.text)
            .bind(token_list(e.tokens))
            .bind(now_ms())
            .bind(key)
            .bind(json)
            .bind(e.name)
            .bind(i64::from(e.ends_prefill))
            .bind(e.memories)
            .execute(&mut *tx)
            .await
            .map_err(|err| match &err {
                sqlx::Error::Database(d) if d.is_unique_violation() => StoreError::Conflict {
                    entity: "idempotency key",
                    id: key.unwrap_or_default().to_string(),
                },
                _ => StoreError::from(err),
            })?;
        }
        tx.commit().await?;
        Ok(seq)
    }

    /// Copies session `from`'s log and working memory into a new session `to` of the same
    /// agent, in one transaction (a fork: the two then go on independently); answers the
    /// entries copied. `NotFound` when `from` does not exist, `Conflict` when `to` does.
    /// Idempotency keys stay with the parent.
    pub async fn fork_session(
        &self,
        tenant_id: &str,
        agent_id: &str,
        from: &str,
        to: &str,
    ) -> StoreResult<u64> {
        let mut tx = self.agent_write_tx(agent_id).await?;
        let copied = Self::copy_session(&mut tx, tenant_id, agent_id, from, to, None).await?;
        tx.commit().await?;
        Ok(copied)
    }

    /// Forks a session's log where a client's history left it: copies the whole log and the
    /// working memory into a new session `branch` (labelled `label`), then drops the session's
    /// entries from `from_seq` on, in one transaction; answers the entries dropped. `NotFound`
    /// when `session` does not exist, `Conflict` when `branch` does. Idempotency keys stay with
    /// the entries the session keeps.
    pub async fn branch_session(
        &self,
        tenant_id: &str,
        agent_id: &str,
        session: &str,
        branch: &str,
        label: &str,
        from_seq: i64,
    ) -> StoreResult<u64> {
        let mut tx = self.agent_write_tx(agent_id).await?;
        Self::copy_session(&mut tx, tenant_id, agent_id, session, branch, Some(label)).await?;
        let dropped =
            sqlx::query("DELETE FROM turns WHERE agent_id = $1 AND session_id = $2 AND seq >= $3")
                .bind(agent_id)
                .bind(session)
                .bind(from_seq)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        tx.commit().await?;
        Ok(dropped)
    }

    /// Within `tx`: a new session `to` (labelled `label`) with a copy of `from`'s log (without
    /// idempotency keys) and working memory; answers the entries copied.
    async fn copy_session(
        tx: &mut sqlx::Transaction<'static, sqlx::Any>,
        tenant_id: &str,
        agent_id: &str,
        from: &str,
        to: &str,
        label: Option<&str>,
    ) -> StoreResult<u64> {
        let parent = sqlx::query("SELECT 1 AS one FROM sessions WHERE agent_id = $1 AND id = $2")
            .bind(agent_id)
            .bind(from)
            .fetch_optional(&mut **tx)
            .await?;
        if parent.is_none() {
            return Err(StoreError::NotFound {
                entity: "session",
                id: from.to_string(),
            });
        }
        sqlx::query(
            "INSERT INTO sessions (agent_id, id, tenant_id, created_at, label) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(agent_id)
        .bind(to)
        .bind(tenant_id)
        .bind(now_ms())
        .bind(label)
        .execute(&mut **tx)
        .await
        .map_err(conflict("session", to))?;
        let copied = sqlx::query(
            "INSERT INTO turns (agent_id, session_id, seq, role, text, tokens, created_at, name, \
             ends_prefill, memories) SELECT agent_id, $3, seq, role, text, tokens, created_at, \
             name, ends_prefill, memories FROM turns WHERE agent_id = $1 AND session_id = $2",
        )
        .bind(agent_id)
        .bind(from)
        .bind(to)
        .execute(&mut **tx)
        .await?
        .rows_affected();
        sqlx::query(
            "INSERT INTO working_memory (agent_id, session_id, seq, kind, line, created_at) \
             SELECT agent_id, $3, seq, kind, line, created_at FROM working_memory \
             WHERE agent_id = $1 AND session_id = $2",
        )
        .bind(agent_id)
        .bind(from)
        .bind(to)
        .execute(&mut **tx)
        .await?;
        Ok(copied)
    }

    /// The answer stored with a session's turn under an idempotency key, if any.
    pub async fn turn_reply(
        &self,
        agent_id: &str,
        session_id: &str,
        key: &str,
    ) -> StoreResult<Option<String>> {
        let row = sqlx::query(
            "SELECT reply FROM turns WHERE agent_id = $1 AND session_id = $2 AND idem_key = $3",
        )
        .bind(agent_id)
        .bind(session_id)
        .bind(key)
        .fetch_optional(&self.pool)
        .await?;
        Ok(row.map(|r| r.try_get("reply")).transpose()?)
    }

    /// A session's turns in order.
    pub async fn turns(&self, agent_id: &str, session_id: &str) -> StoreResult<Vec<TurnRow>> {
        let rows =
            sqlx::query("SELECT * FROM turns WHERE agent_id = $1 AND session_id = $2 ORDER BY seq")
                .bind(agent_id)
                .bind(session_id)
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(Self::turn_of).collect()
    }

    fn turn_of(r: &AnyRow) -> StoreResult<TurnRow> {
        let role: String = r.try_get("role")?;
        let tokens: String = r.try_get("tokens")?;
        let corrupt = |reason: String| StoreError::Corrupt {
            entity: "turn",
            reason,
        };
        let ids = tokens
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<u32>().map_err(|e| corrupt(e.to_string())))
            .collect::<StoreResult<Vec<_>>>()?;
        let ends: i64 = r.try_get("ends_prefill")?;
        Ok(TurnRow {
            seq: r.try_get("seq")?,
            role: Role::parse(&role).ok_or_else(|| corrupt(format!("role `{role}`")))?,
            text: r.try_get("text")?,
            tokens: ids,
            created_at: r.try_get("created_at")?,
            name: r.try_get("name")?,
            ends_prefill: ends != 0,
            memories: r.try_get("memories")?,
        })
    }

    /// Adds spilled lines of a layer to a session's working memory: a line already there (same
    /// layer) is kept once, and the session keeps its newest [`WORKING_MEMORY_LINES`] lines.
    /// Answers the lines that were new.
    pub async fn add_working_memory(
        &self,
        agent_id: &str,
        session_id: &str,
        kind: &str,
        lines: &[String],
    ) -> StoreResult<Vec<String>> {
        let mut added = Vec::new();
        let mut tx = self.agent_write_tx(agent_id).await?;
        let mut seq: i64 = sqlx::query(
            "SELECT COALESCE(MAX(seq), 0) AS s FROM working_memory \
             WHERE agent_id = $1 AND session_id = $2",
        )
        .bind(agent_id)
        .bind(session_id)
        .fetch_one(&mut *tx)
        .await?
        .try_get("s")?;
        for line in lines {
            let known = sqlx::query(
                "SELECT seq FROM working_memory \
                 WHERE agent_id = $1 AND session_id = $2 AND kind = $3 AND line = $4",
            )
            .bind(agent_id)
            .bind(session_id)
            .bind(kind)
            .bind(line)
            .fetch_optional(&mut *tx)
            .await?;
            if known.is_some() {
                continue;
            }
            seq += 1;
            sqlx::query(
                "INSERT INTO working_memory (agent_id, session_id, seq, kind, line, created_at) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(agent_id)
            .bind(session_id)
            .bind(seq)
            .bind(kind)
            .bind(line)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?;
            added.push(line.clone());
        }
        sqlx::query(
            "DELETE FROM working_memory WHERE agent_id = $1 AND session_id = $2 AND seq <= $3",
        )
        .bind(agent_id)
        .bind(session_id)
        .bind(seq - WORKING_MEMORY_LINES)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(added)
    }

    /// A session's working memory, oldest first.
    pub async fn working_memory(
        &self,
        agent_id: &str,
        session_id: &str,
    ) -> StoreResult<Vec<WorkingLine>> {
        sqlx::query(
            "SELECT * FROM working_memory WHERE agent_id = $1 AND session_id = $2 ORDER BY seq",
        )
        .bind(agent_id)
        .bind(session_id)
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| {
            Ok(WorkingLine {
                kind: r.try_get("kind")?,
                line: r.try_get("line")?,
                created_at: r.try_get("created_at")?,
            })
        })
        .collect()
    }
}
