-- A pull reads each row's last effect in a scope. Marking an effect
-- superseded when the same row's next effect in that scope is materialized
-- (in that transaction) turns the read into a range scan of this partial
-- index, instead of a probe of the row index for every effect it reads.
ALTER TABLE synchro.scope_effects ADD COLUMN superseded boolean NOT NULL DEFAULT false;

UPDATE synchro.scope_effects e SET superseded = true
WHERE EXISTS (
    SELECT 1 FROM synchro.scope_effects l
    WHERE l.scope_id = e.scope_id AND l.table_id = e.table_id AND l.identity = e.identity
      AND (l.commit_lsn, l.event_ordinal, l.effect_ordinal)
        > (e.commit_lsn, e.event_ordinal, e.effect_ordinal)
);

CREATE INDEX scope_effects_latest ON synchro.scope_effects
    (scope_id, commit_lsn, event_ordinal, effect_ordinal) WHERE NOT superseded;
