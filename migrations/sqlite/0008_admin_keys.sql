-- Operator keys with scopes, issued and revoked through the API (the bootstrap key from the
-- configuration is not stored). `scopes`: a comma-separated subset of metrics, read, admin.
CREATE TABLE admin_keys (
    id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    scopes TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);
