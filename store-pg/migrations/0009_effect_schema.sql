-- The manifest each effect's row digest was computed under, so that pull
-- serves the stored digest only under that manifest and recomputes it
-- under any other. Effects stored before this have NULL: recomputed.
ALTER TABLE synchro.scope_effects ADD COLUMN schema_version bigint;
