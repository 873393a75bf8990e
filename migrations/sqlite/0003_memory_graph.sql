-- The memory graph's source of truth: nodes (episodes, facts, entities, concepts) and typed
-- edges. The in-memory graph and the vector index are rebuilt from these rows at start.
CREATE TABLE memory_nodes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id TEXT NOT NULL REFERENCES tenants(id),
    agent_id TEXT NOT NULL REFERENCES agents(id),
    session_id TEXT,
    kind TEXT NOT NULL,
    text TEXT NOT NULL,
    importance DOUBLE PRECISION NOT NULL,
    tokens BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    last_accessed_at BIGINT NOT NULL
);
CREATE INDEX memory_nodes_agent ON memory_nodes (agent_id);

CREATE TABLE memory_edges (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant_id TEXT NOT NULL REFERENCES tenants(id),
    from_id BIGINT NOT NULL REFERENCES memory_nodes(id) ON DELETE CASCADE,
    to_id BIGINT NOT NULL REFERENCES memory_nodes(id) ON DELETE CASCADE,
    kind TEXT NOT NULL,
    weight DOUBLE PRECISION NOT NULL,
    valid_from BIGINT,
    valid_to BIGINT,
    created_at BIGINT NOT NULL
);
CREATE INDEX memory_edges_from ON memory_edges (from_id);
CREATE INDEX memory_edges_to ON memory_edges (to_id);

-- Small facts about derived state (the embedding model's fingerprint the vectors were made with).
CREATE TABLE memory_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
