-- ADR 0030: each chunk of the baseline commits on its own. The count of
-- chunks committed tells a feed that finds the baseline unfinished whether
-- to take it again under a new slot (none) or to keep the slot and hand
-- the rows not yet read over to re-reads (some).
ALTER TABLE synchro.capture_slot ADD COLUMN baseline_chunks bigint NOT NULL DEFAULT 0;
