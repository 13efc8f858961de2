-- The baseline (ADR 0011): the stream's slot is created with an exported
-- snapshot, under which every existing captured row is materialized before
-- the stream. Until that commits, the slot is a candidate: a crash drops it
-- and takes the baseline again under a new one. A slot recorded before this
-- column existed began with the stream itself.
ALTER TABLE synchro.capture_slot ADD COLUMN baseline_done boolean NOT NULL DEFAULT true;
ALTER TABLE synchro.capture_slot ALTER COLUMN baseline_done DROP DEFAULT;
