-- Rebuild pages are rendered from the stage and the session alone, the
-- same bytes on every replay (ADR 0017): they are no longer stored. The
-- stage is kept in blocks of consecutive ordinals, each column an array
-- that PostgreSQL compresses (a row's text and its neighbours' share most
-- of their bytes), instead of one heap row per staged row.
--
-- A session staged before this migration answered pages whose tokens
-- carry the time they were answered: it cannot render them again, so it
-- ends now (its rebuild_id and continuations are answered 409
-- rebuild_restart_required, and the client starts a new attempt).
UPDATE synchro.rebuild_sessions
SET swept = true,
    expires_at = least(expires_at, (extract(epoch FROM clock_timestamp()) * 1000000)::int8)
WHERE NOT swept;
DROP TABLE synchro.rebuild_pages;
DROP TABLE synchro.rebuild_stage;

-- The keys every page's tokens are issued under (the active ones when the
-- session was created).
ALTER TABLE synchro.rebuild_sessions
    ADD COLUMN cursor_key_id text NOT NULL DEFAULT '',
    ADD COLUMN continuation_key_id text NOT NULL DEFAULT '';

-- One row per block of `rows` consecutive ordinals from `first_ordinal`;
-- element i of every array is the staged row at first_ordinal + i.
CREATE TABLE synchro.rebuild_stage (
    session_id    uuid NOT NULL REFERENCES synchro.rebuild_sessions ON DELETE CASCADE,
    first_ordinal bigint NOT NULL CHECK (first_ordinal >= 0),
    rows          integer NOT NULL CHECK (rows > 0),
    table_ids     text[] NOT NULL CHECK (cardinality(table_ids) = rows),
    identities    bytea[] NOT NULL CHECK (cardinality(identities) = rows),
    row_texts     text[] NOT NULL CHECK (cardinality(row_texts) = rows),
    versions      text[] NOT NULL CHECK (cardinality(versions) = rows),
    digests       bytea[] NOT NULL CHECK (cardinality(digests) = rows),
    PRIMARY KEY (session_id, first_ordinal)
);
-- Digests are random bytes: stored out of line without a compression
-- attempt. The rest compresses, with lz4 where this PostgreSQL has it.
ALTER TABLE synchro.rebuild_stage ALTER COLUMN digests SET STORAGE EXTERNAL;
DO $$
BEGIN
    ALTER TABLE synchro.rebuild_stage
        ALTER COLUMN table_ids SET COMPRESSION lz4,
        ALTER COLUMN identities SET COMPRESSION lz4,
        ALTER COLUMN row_texts SET COMPRESSION lz4,
        ALTER COLUMN versions SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN
    NULL;
END
$$;
