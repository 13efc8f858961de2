-- The capture leader's heartbeat, durable so that every server process on
-- this database judges readiness by it, not only the one that leads.
ALTER TABLE synchro.capture_progress
    ADD COLUMN heartbeat_at  timestamptz,
    ADD COLUMN caught_up_at  timestamptz,
    ADD COLUMN lag_bytes     bigint NOT NULL DEFAULT 0 CHECK (lag_bytes >= 0);
