-- Bytes of the shadow a tenant's sessions may hold, MiB (0: no bound of its own; the shadow's
-- budget still applies). Over it, the tenant's least recently written sessions are archived.
ALTER TABLE tenants ADD COLUMN quota_shadow_mib BIGINT NOT NULL DEFAULT 0;
