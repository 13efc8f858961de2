-- Push: the idempotent ledger, the client's accepted-write epoch, and a
-- version trigger that the push writer role may fire.

ALTER TABLE synchro.clients
    ADD COLUMN accepted_write_epoch bigint NOT NULL DEFAULT 0 CHECK (accepted_write_epoch >= 0);

-- Completed batches, kept until the client is irreversibly retired: replay
-- returns `body` with `status`, byte for byte.
CREATE TABLE synchro.push_batches (
    user_id      text NOT NULL,
    client_id    text NOT NULL,
    batch_id     uuid NOT NULL,
    fingerprint  bytea NOT NULL CHECK (length(fingerprint) = 32),
    status       smallint NOT NULL,
    body         bytea NOT NULL,
    PRIMARY KEY (user_id, client_id, batch_id)
);

-- Completed mutations and their terminal outcome objects (canonical JSON).
CREATE TABLE synchro.push_mutations (
    user_id      text NOT NULL,
    client_id    text NOT NULL,
    mutation_id  uuid NOT NULL,
    batch_id     uuid NOT NULL,
    fingerprint  bytea NOT NULL CHECK (length(fingerprint) = 32),
    outcome      bytea NOT NULL,
    PRIMARY KEY (user_id, client_id, mutation_id)
);

-- Pushes write as a role without BYPASSRLS, so the application's row
-- security applies. The version trigger runs with its owner's rights: it
-- writes synchro's tables, which that role cannot.
ALTER FUNCTION synchro.capture_version() SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
