-- Swept rebuild sessions are forgotten (deleted) long after their expiry:
-- the sweep finds the oldest of them by this index.
CREATE INDEX rebuild_sessions_swept ON synchro.rebuild_sessions (expires_at) WHERE swept;
