-- Retention (docs/adr/0024). A superseded effect is never served, so the
-- materializer now deletes it instead of marking it; the marked ones go.
DELETE FROM synchro.scope_effects WHERE superseded;
DROP INDEX synchro.scope_effects_latest;
ALTER TABLE synchro.scope_effects DROP COLUMN superseded;

-- When a checkpoint was last acknowledged and a rebuild session begun, by
-- the database's clock: what the retention window measures.
ALTER TABLE synchro.client_checkpoints ADD COLUMN acknowledged_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE synchro.rebuild_sessions ADD COLUMN created_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX rebuild_sessions_created ON synchro.rebuild_sessions (created_at);

-- Deletions and removals in position order: what compaction below the
-- floor looks for.
CREATE INDEX scope_effects_deletions ON synchro.scope_effects
    (commit_lsn, event_ordinal, effect_ordinal) WHERE op = 1;

-- Rows updated again and again: room on each page for HOT updates (none of
-- the updated columns is indexed), and vacuum sooner than the 20% default.
ALTER TABLE synchro.projections SET (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.05);
ALTER TABLE synchro.scope_members SET (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.05);
ALTER TABLE synchro.row_versions SET (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.05);
-- Every pull advances checkpoints: no index holds their positions, so
-- those updates stay HOT.
ALTER TABLE synchro.client_checkpoints SET (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.05);
ALTER TABLE synchro.scope_effects SET (autovacuum_vacuum_scale_factor = 0.05);
