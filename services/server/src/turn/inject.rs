//! Context injection between the phases of an agent workflow (seed 002): entries — a tool
//! result, an event, another agent's output, an instruction — appended to a session's log and
//! prefilled once, without generating, so that the next phase's turn continues on the same
//! cache and computes only its own message.

use engram_store::{NewEntry, Role};

use super::generate::prefill;
use super::{Turn, TurnError, said_of};

/// Entries one injection may append.
pub const MAX_ENTRIES: usize = 32;

const MAX_CONTENT_BYTES: usize = 64 * 1024;

/// One entry to inject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// `System`, `Tool` or `Event`.
    pub role: Role,
    /// The tool's or the event source's name (required for those), or a label of system text.
    pub name: Option<String>,
    /// The text.
    pub content: String,
}

/// What an injection did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Injected {
    /// Entries appended.
    pub entries: usize,
    /// Position of the last entry in the session's log.
    pub seq: i64,
    /// Tokens the injected entries add to the conversation (with their role headers).
    pub injected_tokens: usize,
    /// Tokens of the session's conversation prefix after the injection.
    pub prompt_tokens: usize,
    /// Of those, tokens whose KV was already cached.
    pub cached_tokens: usize,
    /// Tokens the injection computed: `prompt_tokens - cached_tokens` (the injected tokens,
    /// plus at most a block's worth before them when the previous prefix ended inside one).
    pub prefilled_tokens: usize,
    /// Earlier prefills of the session replayed first because the cache had lost them.
    pub replayed: usize,
}

impl Entry {
    /// Checks the role, the name and the content.
    fn check(&self) -> Result<(), TurnError> {
        let bad = |why: String| Err(TurnError::InvalidEntries { why });
        if !self.role.is_injected() {
            return bad(format!(
                "role `{}`: inject `system`, `tool` or `event` entries (user messages are turns)",
                self.role.as_str()
            ));
        }
        match &self.name {
            None if self.role != Role::System => {
                return bad(format!("a `{}` entry needs a name", self.role.as_str()));
            }
            Some(n)
                if n.is_empty()
                    || n.len() > 64
                    || n.chars().any(|c| c.is_control() || c == '\n') =>
            {
                return bad("a name is 1–64 bytes without control characters".into());
            }
            _ => {}
        }
        if self.content.trim().is_empty() || self.content.len() > MAX_CONTENT_BYTES {
            return bad("an entry's content is 1 byte to 64 KiB of text".into());
        }
        Ok(())
    }
}

impl Turn {
    /// Appends `entries` to the session's log and prefills the session's conversation through
    /// them — the canonical prefix a next turn starts with, so everything before the entries is
    /// already cached and only they are computed. The log is written after the prefill, in one
    /// transaction, with the answer under the turn's idempotency key; the last entry marks the
    /// prefill's end, so that replay after a restart prefills in the same steps.
    ///
    /// The caller holds the session's slot (one turn or injection of a session at a time).
    pub async fn inject(&self, entries: &[Entry]) -> Result<(Injected, String), TurnError> {
        let (Some(session), Some(key)) = (&self.session, self.kv_session) else {
            return Err(TurnError::InvalidEntries {
                why: "an injection needs a session".into(),
            });
        };
        if entries.is_empty() || entries.len() > MAX_ENTRIES {
            return Err(TurnError::InvalidEntries {
                why: format!("inject 1 to {MAX_ENTRIES} entries"),
            });
        }
        entries.iter().try_for_each(Entry::check)?;
        self.admit_session().await?;
        let started = std::time::Instant::now();
        let log = self.history().await?;
        let replayed = self.replay_lost(&log).await?;
        let mut after = log.said;
        let before = after.len();
        after.extend(
            entries
                .iter()
                .map(|e| said_of(e.role, e.name.as_deref(), &e.content)),
        );
        let spec = self.canonical_spec(&after, None)?;
        // The injected entries are the conversation's last segments.
        let injected_tokens: usize = spec
            .segments
            .iter()
            .rev()
            .take(entries.len())
            .map(|s| s.tokens.len())
            .sum();
        let usage = prefill(&self.state, spec).await?;
        let state = &self.state;
        let Some(_recording) = state.deletions.record(self.kv_tenant, key.0, started).await else {
            return Err(TurnError::SessionDeleted);
        };
        state.tiers.touch((self.kv_tenant, key));
        let tok = state.engine()?.tokenizer();
        let tokens = entries
            .iter()
            .map(|e| tok.encode(&e.content))
            .collect::<Result<Vec<_>, _>>()?;
        let rows: Vec<NewEntry<'_>> = entries
            .iter()
            .zip(&tokens)
            .enumerate()
            .map(|(i, (e, t))| NewEntry {
                role: e.role,
                name: e.name.as_deref(),
                text: &e.content,
                tokens: t,
                ends_prefill: i + 1 == entries.len(),
                memories: None,
            })
            .collect();
        // Turns and injections of a session run one at a time and the log only grows, so
        // the entries land right after the log read above.
        let out = Injected {
            entries: entries.len(),
            seq: (before + entries.len()) as i64,
            injected_tokens,
            prompt_tokens: usage.prompt_tokens,
            cached_tokens: usage.cached_tokens,
            prefilled_tokens: usage.prompt_tokens.saturating_sub(usage.cached_tokens),
            replayed,
        };
        let reply = serde_json::to_string(&out).unwrap_or_default();
        state
            .store
            .ensure_session(&self.tenant.id, &self.agent.id, session)
            .await?;
        state
            .store
            .append_entries(
                &self.agent.id,
                session,
                &rows,
                self.idempotency_key.as_deref().map(|k| (k, reply.as_str())),
            )
            .await?;
        Ok((out, reply))
    }
}
