-- Engram's durable state (PostgreSQL). Times are Unix milliseconds; flags are 0/1.
CREATE TABLE tenants (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    cache_salt BIGINT NOT NULL,
    quota_hot_blocks BIGINT NOT NULL,
    quota_cold_blocks BIGINT NOT NULL,
    quota_sessions BIGINT NOT NULL,
    created_at BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id),
    key_hash TEXT NOT NULL UNIQUE,
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);

CREATE TABLE agents (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL REFERENCES tenants(id),
    name TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    UNIQUE (tenant_id, name)
);

-- Every edit of a layer is a new version; the newest version is the layer.
CREATE TABLE layers (
    agent_id TEXT NOT NULL REFERENCES agents(id),
    kind TEXT NOT NULL,
    version BIGINT NOT NULL,
    content TEXT NOT NULL,
    budget BIGINT NOT NULL,
    stable BIGINT NOT NULL,
    importance DOUBLE PRECISION NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (agent_id, kind, version)
);

CREATE TABLE sessions (
    agent_id TEXT NOT NULL REFERENCES agents(id),
    id TEXT NOT NULL,
    tenant_id TEXT NOT NULL REFERENCES tenants(id),
    created_at BIGINT NOT NULL,
    PRIMARY KEY (agent_id, id)
);

-- The durable turn log: the source of truth every KV tier can be rebuilt from.
CREATE TABLE turns (
    agent_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    role TEXT NOT NULL,
    text TEXT NOT NULL,
    tokens TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (agent_id, session_id, seq),
    FOREIGN KEY (agent_id, session_id) REFERENCES sessions(agent_id, id)
);

-- Lines the synthesizer spilled, per session.
CREATE TABLE working_memory (
    agent_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    kind TEXT NOT NULL,
    line TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (agent_id, session_id, seq),
    FOREIGN KEY (agent_id, session_id) REFERENCES sessions(agent_id, id)
);
