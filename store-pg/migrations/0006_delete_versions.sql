-- Every delete carries a server_version: a hard delete its deletion fence's,
-- a row leaving a scope the version the row has. Row and digest stay
-- together; the version no longer goes with them. NOT VALID: deletes
-- materialized before this migration have none, and reading one is an
-- integrity failure rather than a delete without its version.
DO $$
DECLARE c text;
BEGIN
  FOR c IN SELECT conname FROM pg_constraint
           WHERE conrelid = 'synchro.scope_effects'::regclass AND contype = 'c'
  LOOP
    EXECUTE format('ALTER TABLE synchro.scope_effects DROP CONSTRAINT %I', c);
  END LOOP;
END $$;
ALTER TABLE synchro.scope_effects
    ADD CONSTRAINT scope_effects_op CHECK (op IN (0, 1)),
    ADD CONSTRAINT scope_effects_row CHECK ((row_json IS NULL) = (digest IS NULL)),
    ADD CONSTRAINT scope_effects_upsert_row CHECK (op = 1 OR row_json IS NOT NULL),
    ADD CONSTRAINT scope_effects_version CHECK (version IS NOT NULL) NOT VALID;
