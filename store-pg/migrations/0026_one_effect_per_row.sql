-- ADR 0034: a scope keeps one effect per row, its last (ADR 0024), so the
-- row's index is unique and the materializer replaces a stored effect by
-- ON CONFLICT. The replaced delete joined the group's rows against the
-- table, a sort of the whole table while it was small. Any earlier effect
-- of a row left by an older version goes first: it is never served.
DELETE FROM synchro.scope_effects e USING synchro.scope_effects l
WHERE l.scope_id = e.scope_id AND l.table_id = e.table_id AND l.identity = e.identity
  AND (l.commit_lsn, l.event_ordinal, l.effect_ordinal)
    > (e.commit_lsn, e.event_ordinal, e.effect_ordinal);
CREATE UNIQUE INDEX scope_effects_one_per_row ON synchro.scope_effects
    (scope_id, table_id, identity);
DROP INDEX synchro.scope_effects_row;
