-- Rebuild sessions (wire spec "Rebuild", ADR 003): each bound to one
-- client's attempt (rebuild_id) and the exact context it was staged in,
-- with its immutable stage in row-identity order and the pages it has
-- answered, replayed byte for byte. A session's stage and pages go with it.
CREATE TABLE synchro.rebuild_sessions (
    session_id            uuid PRIMARY KEY,
    client_id             text NOT NULL,
    rebuild_id            uuid NOT NULL,
    scope_id              text NOT NULL,
    client_generation     bigint NOT NULL,
    schema_hash           bytea NOT NULL CHECK (length(schema_hash) = 32),
    stream_generation     bigint NOT NULL,
    membership_generation bigint NOT NULL,
    retention_generation  bigint NOT NULL,
    accepted_write_epoch  bigint NOT NULL,
    boundary_lsn          bigint,  -- NULL: generation start
    page_limit            smallint NOT NULL CHECK (page_limit BETWEEN 1 AND 1000),
    expires_at            bigint NOT NULL,  -- microseconds since the epoch
    digest                bytea CHECK (length(digest) = 32),  -- NULL until sealed
    -- Expired, and its stage and pages deleted; the row stays so that its
    -- rebuild_id is still answered with 409.
    swept                 boolean NOT NULL DEFAULT false,
    UNIQUE (client_id, rebuild_id)
);
CREATE INDEX rebuild_sessions_expiry ON synchro.rebuild_sessions (expires_at) WHERE NOT swept;

CREATE TABLE synchro.rebuild_stage (
    session_id uuid NOT NULL REFERENCES synchro.rebuild_sessions ON DELETE CASCADE,
    ordinal    bigint NOT NULL,
    table_id   text NOT NULL,
    identity   bytea NOT NULL,
    row_json   text NOT NULL,
    version    text NOT NULL,
    digest     bytea NOT NULL CHECK (length(digest) = 32),
    PRIMARY KEY (session_id, ordinal)
);

CREATE TABLE synchro.rebuild_pages (
    session_id uuid NOT NULL REFERENCES synchro.rebuild_sessions ON DELETE CASCADE,
    ordinal    bigint NOT NULL,
    body       bytea NOT NULL,
    PRIMARY KEY (session_id, ordinal)
);
