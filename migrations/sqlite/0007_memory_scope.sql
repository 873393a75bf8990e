-- Who recalls what an agent's sessions brought into its memory: `session` (only that session's
-- turns; the default, also for agents created before this column) or `agent` (every session).
ALTER TABLE agents ADD COLUMN memory_scope TEXT NOT NULL DEFAULT 'session';
