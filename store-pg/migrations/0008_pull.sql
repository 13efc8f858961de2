-- The pull stream's lineage (one row): its generation (only a stream reset
-- changes it), the retention generation and the floor below which effects
-- may be compacted. A position is (lsn, event, effect) as scope_effects
-- orders them: generation_start is (-1, 0, 0), transaction_end(l) is
-- (l, max, max).
CREATE TABLE synchro.stream (
    singleton             boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    generation            bigint NOT NULL DEFAULT 1 CHECK (generation > 0),
    retention_generation  bigint NOT NULL DEFAULT 1 CHECK (retention_generation > 0),
    floor_lsn             bigint NOT NULL DEFAULT -1,
    floor_event           bigint NOT NULL DEFAULT 0,
    floor_effect          bigint NOT NULL DEFAULT 0
);
INSERT INTO synchro.stream DEFAULT VALUES;

-- The token keys every server process shares; old keys keep verifying
-- until retired (removed).
CREATE TABLE synchro.token_keys (
    key_id      text PRIMARY KEY,
    kind        text NOT NULL CHECK (kind IN ('incremental', 'rebuild')),
    state       text NOT NULL CHECK (state IN ('active', 'verify_only')),
    secret      bytea NOT NULL CHECK (length(secret) = 32),
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX token_keys_one_active ON synchro.token_keys (kind) WHERE state = 'active';

-- The history of each table's scope rules: a change gives the table the
-- next membership generation, which makes cursors of the scopes the old
-- or new rules can place rows in stale.
CREATE TABLE synchro.membership_rules (
    table_id     text NOT NULL,
    generation   bigint NOT NULL CHECK (generation > 0),
    fingerprint  text NOT NULL,
    templates    text[] NOT NULL,
    PRIMARY KEY (table_id, generation)
);

-- Each client's acknowledged position per scope: advanced only by a pull
-- that presents a valid cursor, never backward.
CREATE TABLE synchro.client_checkpoints (
    client_id          text NOT NULL,
    scope_id           text NOT NULL,
    stream_generation  bigint NOT NULL,
    commit_lsn         bigint NOT NULL,
    event_ordinal      bigint NOT NULL,
    effect_ordinal     bigint NOT NULL,
    PRIMARY KEY (client_id, scope_id)
);

-- Every scope assigned to the client's current generation: a pull may
-- present one removed since (and learns of its removal), never another.
ALTER TABLE synchro.clients ADD COLUMN ever_assigned text[] NOT NULL DEFAULT '{}';
UPDATE synchro.clients SET ever_assigned = assigned;

-- Pull keeps only each row's last effect through its boundary: the later
-- effect of a row is found by this index, not by reading the scope.
CREATE INDEX scope_effects_row ON synchro.scope_effects
    (scope_id, table_id, identity, commit_lsn, event_ordinal, effect_ordinal);
