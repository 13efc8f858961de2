-- The stream's replication slot as capture created it (ADR 0010). Once it
-- exists, a slot that is missing, invalidated, or another slot under its
-- name (its confirmed position past both its creation point and everything
-- materialized) means the stream cannot continue where it stopped: capture
-- blocks, and the slot is never silently created again.
CREATE TABLE synchro.capture_slot (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    slot_name       text NOT NULL,
    consistent_lsn  bigint NOT NULL  -- where the slot's stream began
);
