-- Rematerialization (ADR 0020): each captured relation's capture model (a
-- fingerprint of what capture makes of its rows), and the re-reading of
-- its rows owed since that model changed, with the identity of the last
-- row re-read (canonical JSON of its identity columns' text forms).
CREATE TABLE synchro.rematerializations (
    relation     text PRIMARY KEY,
    fingerprint  text NOT NULL,
    pending      boolean NOT NULL,
    after_key    text,
    rows         bigint NOT NULL CHECK (rows >= 0)
);
