-- Context injection (POST …/sessions/{s}/context): the turn log also holds entries that were
-- appended without a turn (role system, tool or event), each with an optional name. An
-- injection prefills the session's conversation once, after its last entry: `ends_prefill`
-- marks that entry (and every user and assistant row), so that replay after a restart
-- prefills in the same steps and computes the same KV.
ALTER TABLE turns ADD COLUMN name TEXT;
ALTER TABLE turns ADD COLUMN ends_prefill BIGINT NOT NULL DEFAULT 1;
