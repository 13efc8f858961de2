-- WAL capture: row versions and fences written by the version trigger, and
-- the materialized state the materializer commits per source transaction.

-- Fence IDs come from a sequence; they only identify, they never order the stream.
CREATE SEQUENCE synchro.fence_seq;

-- The current opaque version of every registered row. A hard delete keeps
-- its row (deleted = true): the deletion fence.
CREATE TABLE synchro.row_versions (
    table_id  text NOT NULL,
    key       text NOT NULL,
    version   text NOT NULL,
    fence     bigint NOT NULL,
    deleted   boolean NOT NULL,
    PRIMARY KEY (table_id, key)
);

-- Fences of writes accepted from a client (push sets synchro.client_id),
-- until the materializer satisfies them.
CREATE TABLE synchro.pending_fences (
    fence      bigint PRIMARY KEY,
    client_id  text NOT NULL
);
CREATE INDEX pending_fences_client ON synchro.pending_fences (client_id);

-- One row: everything through commit_lsn is materialized; a quarantined
-- transaction blocks capture until it materializes.
CREATE TABLE synchro.capture_progress (
    singleton         boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    commit_lsn        bigint,
    end_lsn           bigint NOT NULL DEFAULT 0,
    quarantine_lsn    bigint,
    quarantine_class  text,
    CHECK ((quarantine_lsn IS NULL) = (quarantine_class IS NULL))
);
INSERT INTO synchro.capture_progress DEFAULT VALUES;

-- The OID of every captured relation when capture was installed: a relation
-- dropped and recreated under the same name is drift, not a continuation.
CREATE TABLE synchro.captured_relations (
    relation      text PRIMARY KEY,
    relation_oid  bigint NOT NULL
);

-- Every materialized source transaction; its events are (commit_lsn, 0..row_events).
-- The primary key is a second guard against materializing one twice.
CREATE TABLE synchro.source_transactions (
    commit_lsn  bigint PRIMARY KEY,
    end_lsn     bigint NOT NULL CHECK (end_lsn > commit_lsn),
    row_events  bigint NOT NULL CHECK (row_events >= 0)
);

-- The captured state of every registered row: the complete synced row
-- (canonical JSON), its version and digest, and its scopes.
CREATE TABLE synchro.projections (
    table_id        text NOT NULL,
    identity        bytea NOT NULL,
    key             text NOT NULL,
    row_json        text NOT NULL,
    version         text NOT NULL,
    digest          bytea NOT NULL CHECK (length(digest) = 32),
    schema_version  bigint NOT NULL,
    tombstone       boolean NOT NULL,
    scopes          text NOT NULL,  -- canonical JSON array of scope IDs
    PRIMARY KEY (table_id, identity)
);

-- Rows of dependency relations, keyed by their replica identity.
CREATE TABLE synchro.dependency_rows (
    relation  text NOT NULL,
    identity  text NOT NULL,
    image     jsonb NOT NULL,
    PRIMARY KEY (relation, identity)
);

-- Per-scope effects at their delivery positions. op 0 is upsert, 1 delete;
-- a delete carries a row only for a source tombstone.
CREATE TABLE synchro.scope_effects (
    scope_id        text NOT NULL,
    commit_lsn      bigint NOT NULL,
    event_ordinal   bigint NOT NULL,
    effect_ordinal  bigint NOT NULL,
    table_id        text NOT NULL,
    identity        bytea NOT NULL,
    key_json        text NOT NULL,
    op              smallint NOT NULL CHECK (op IN (0, 1)),
    row_json        text,
    version         text,
    digest          bytea,
    PRIMARY KEY (scope_id, commit_lsn, event_ordinal, effect_ordinal),
    CHECK ((row_json IS NULL) = (version IS NULL) AND (row_json IS NULL) = (digest IS NULL)),
    CHECK (op = 1 OR row_json IS NOT NULL)
);

-- The version trigger: a new random version and a fence per row change,
-- visible to the materializer in WAL order as a transactional message.
-- TG_ARGV: table_id, primary-key column.
CREATE FUNCTION synchro.capture_version() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    row_key      text;
    new_version  text := replace(gen_random_uuid()::text, '-', '');
    new_fence    bigint := nextval('synchro.fence_seq');
    writer       text := current_setting('synchro.client_id', true);
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
    END IF;
    PERFORM pg_logical_emit_message(true, 'synchro.version',
        TG_ARGV[0] || E'\t' || new_fence || E'\t' || new_version || E'\t' || row_key);
    RETURN NULL;
END
$$;

-- The key guard: a synced row's primary key never changes. TG_ARGV: the column.
CREATE FUNCTION synchro.capture_key_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF (to_jsonb(NEW) ->> TG_ARGV[0]) IS DISTINCT FROM (to_jsonb(OLD) ->> TG_ARGV[0]) THEN
        RAISE EXCEPTION 'synchro: the primary key of a synced row cannot change'
            USING ERRCODE = '23514';
    END IF;
    RETURN NEW;
END
$$;
