-- ADR 0037: an effect that carries a row (an upsert, or a tombstone's
-- delete) no longer copies it. A row's last effect in a scope was written
-- with the row's projection, which holds the same row and version (every
-- change of them writes an effect in each of the row's scopes), so pull
-- reads the row from the projection. Only a removal keeps a version of its
-- own. op 2 is a tombstone's delete, told apart from a removal by the op
-- now that no row is stored.
DO $$
DECLARE c text;
BEGIN
  FOR c IN SELECT conname FROM pg_constraint
           WHERE conrelid = 'synchro.scope_effects'::regclass AND contype = 'c'
  LOOP
    EXECUTE format('ALTER TABLE synchro.scope_effects DROP CONSTRAINT %I', c);
  END LOOP;
END $$;
UPDATE synchro.scope_effects SET op = 2 WHERE op = 1 AND row_json IS NOT NULL;
UPDATE synchro.scope_effects SET version = NULL WHERE op <> 1;
ALTER TABLE synchro.scope_effects
    DROP COLUMN row_json,
    DROP COLUMN digest,
    DROP COLUMN schema_version,
    ADD CONSTRAINT scope_effects_op CHECK (op IN (0, 1, 2)),
    ADD CONSTRAINT scope_effects_row_version CHECK (op = 1 OR version IS NULL),
    ADD CONSTRAINT scope_effects_version CHECK (op <> 1 OR version IS NOT NULL) NOT VALID;
-- Deletions and removals, what compaction below the floor looks for: both
-- delete ops now.
DROP INDEX synchro.scope_effects_deletions;
CREATE INDEX scope_effects_deletions ON synchro.scope_effects
    (commit_lsn, event_ordinal, effect_ordinal) WHERE op <> 0;
