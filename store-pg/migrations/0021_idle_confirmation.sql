-- Issue 25: while idle, capture confirms WAL past the last source
-- transaction (its own writes among it), so the slot does not keep that
-- WAL. It records the position here first: a slot whose confirmed
-- position passes this, where the slot began and everything materialized
-- is not the stream's (ADR 0010).
ALTER TABLE synchro.capture_slot ADD COLUMN idle_confirmed_lsn bigint NOT NULL DEFAULT 0;
