-- Fence satisfaction that does not depend on visibility (ADR 0014).
-- PostgreSQL can hand a commit to logical decoding before the committing
-- session leaves the proc array, so a materialization can run while a
-- push's pending fence is not yet visible to it. The materializer then
-- records the fence satisfied here; a pending fence with such a record is
-- not pending, and the leader removes the pair once both are visible.
CREATE TABLE synchro.satisfied_fences (
    fence  bigint PRIMARY KEY
);

-- The version note marks its fence: `c` for a client's write (pending
-- until satisfied), `a` for the application's. An unmarked fence, written
-- before this migration, is taken as a client's.
CREATE OR REPLACE FUNCTION synchro.capture_version() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    row_key      text;
    new_version  text := replace(gen_random_uuid()::text, '-', '');
    new_fence    bigint := nextval('synchro.fence_seq');
    writer       text := current_setting('synchro.client_id', true);
    mark         text := 'a';
BEGIN
    IF TG_OP = 'DELETE' THEN
        row_key := to_jsonb(OLD) ->> TG_ARGV[1];
    ELSE
        row_key := to_jsonb(NEW) ->> TG_ARGV[1];
    END IF;
    INSERT INTO synchro.row_versions (table_id, key, version, fence, deleted)
    VALUES (TG_ARGV[0], row_key, new_version, new_fence, TG_OP = 'DELETE')
    ON CONFLICT (table_id, key) DO UPDATE
        SET version = EXCLUDED.version, fence = EXCLUDED.fence, deleted = EXCLUDED.deleted;
    IF writer IS NOT NULL AND writer <> '' THEN
        INSERT INTO synchro.pending_fences (fence, client_id) VALUES (new_fence, writer);
        mark := 'c';
    END IF;
    PERFORM pg_logical_emit_message(true, 'synchro.version',
        TG_ARGV[0] || E'\t' || mark || new_fence || E'\t' || new_version || E'\t' || row_key);
    RETURN NULL;
END
$$;

-- Fences left behind before this migration: a pending fence whose row's
-- current version is the one materialized was satisfied.
DELETE FROM synchro.pending_fences p
USING synchro.row_versions v, synchro.projections j
WHERE v.fence = p.fence AND j.table_id = v.table_id AND j.key = v.key
  AND j.version = v.version;
