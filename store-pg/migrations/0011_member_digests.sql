-- Each member of the membership index carries its row's digest (the
-- projection's, kept equal by every materialization in its transaction),
-- and the primary key includes it: a scope digest is then one index-only
-- range scan in row-identity order, with no join and no sort.
ALTER TABLE synchro.scope_members ADD COLUMN digest bytea;
UPDATE synchro.scope_members m SET digest = p.digest
FROM synchro.projections p WHERE p.table_id = m.table_id AND p.identity = m.identity;
-- A member without a projection violates the index's invariant; such a
-- row fails here rather than serve a wrong scope digest later.
ALTER TABLE synchro.scope_members ALTER COLUMN digest SET NOT NULL;
ALTER TABLE synchro.scope_members DROP CONSTRAINT scope_members_pkey;
ALTER TABLE synchro.scope_members ADD PRIMARY KEY (scope_id, identity) INCLUDE (digest);
