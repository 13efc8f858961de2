-- The membership index: the rows of each scope in row-identity order, kept
-- by every materialization in its own transaction from the membership
-- changes it computes, so that a scope's rows (scope digests, rebuild
-- staging) are read without scanning every projection. A row identity
-- includes its table, so it is unique in a scope.
CREATE TABLE synchro.scope_members (
    scope_id  text NOT NULL,
    identity  bytea NOT NULL,
    table_id  text NOT NULL,
    PRIMARY KEY (scope_id, identity)
);
INSERT INTO synchro.scope_members (scope_id, identity, table_id)
SELECT s, p.identity, p.table_id
FROM synchro.projections p, jsonb_array_elements_text(p.scopes::jsonb) AS s;
