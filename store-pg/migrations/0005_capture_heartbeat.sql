-- The capture leader's heartbeat, shared in the database so that every
-- server process on it judges readiness by it, not only the one that
-- leads. UNLOGGED, so that a beat every second writes only its commit
-- record (about 40 bytes of WAL, against about 115 and full-page images for
-- a logged row), which the slot retains while capture is idle. After a
-- database crash the table is empty, and readiness waits for the next beat.
CREATE UNLOGGED TABLE synchro.capture_heartbeat (
    singleton     boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    heartbeat_at  timestamptz NOT NULL,
    caught_up_at  timestamptz,
    lag_bytes     bigint NOT NULL CHECK (lag_bytes >= 0)
);
