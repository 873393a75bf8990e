-- Stored responses of the Responses API (`POST /v1/responses` with `store`): the answer as sent,
-- and the session its chain of `previous_response_id`s continues.
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id),
    agent_id TEXT NOT NULL REFERENCES agents(id),
    session_id TEXT NOT NULL,
    body TEXT NOT NULL,
    created_at BIGINT NOT NULL
);
CREATE INDEX responses_session ON responses (agent_id, session_id);
