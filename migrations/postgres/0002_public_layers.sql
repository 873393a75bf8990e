-- Layers an operator marked public: their KV blocks are shared by every tenant whose prompt
-- starts with the same public text. Each version carries its own mark, so a tenant's edit
-- (a new version) is private until the operator marks it again.
ALTER TABLE layers ADD COLUMN is_public BIGINT NOT NULL DEFAULT 0;
