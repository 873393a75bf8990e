-- A turn sent again with the same Idempotency-Key answers the reply stored with it instead of
-- running a second time: the key and the reply's JSON ride on the turn's assistant row, so
-- they are written in the turn's own transaction and deleted with its session.
ALTER TABLE turns ADD COLUMN idem_key TEXT;
ALTER TABLE turns ADD COLUMN reply TEXT;
CREATE UNIQUE INDEX turns_idem_key ON turns (agent_id, session_id, idem_key);
