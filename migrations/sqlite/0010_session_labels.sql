-- What the client called a session when its name is a hash of it: an OpenAI `user` string that
-- is not a session name (any string of up to 256 bytes) names the session `u-{sha256 prefix}`.
ALTER TABLE sessions ADD COLUMN label TEXT;
