-- The registry's durable state. Everything synchro owns lives in schema synchro.
CREATE SCHEMA IF NOT EXISTS synchro;

-- Immutable schema manifests, one per version; `definition` is the canonical
-- schema_definition text, whose hash is verified on every load.
CREATE TABLE synchro.schema_manifests (
    version     bigint PRIMARY KEY CHECK (version > 0),
    hash        text NOT NULL UNIQUE CHECK (hash ~ '^[0-9a-f]{64}$'),
    definition  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- One row per client identity, bound forever to its user.
CREATE TABLE synchro.clients (
    client_id          text PRIMARY KEY,
    user_id            text NOT NULL,
    generation         bigint NOT NULL CHECK (generation > 0),
    retired            boolean NOT NULL DEFAULT false,
    installed_version  bigint,
    installed_hash     text,
    scope_set_version  bigint NOT NULL CHECK (scope_set_version >= 0),
    assigned           text[] NOT NULL DEFAULT '{}',
    CHECK ((installed_version IS NULL) = (installed_hash IS NULL))
);

-- Operator-managed scope grants: a row assigns scope_id to user_id.
CREATE TABLE synchro.scope_grants (
    user_id   text NOT NULL,
    scope_id  text NOT NULL,
    PRIMARY KEY (user_id, scope_id)
);
