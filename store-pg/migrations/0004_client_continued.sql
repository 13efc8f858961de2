-- A client that went on from its first connect (a continuing connect or a
-- push): a repeat of that first connect no longer replays it.
ALTER TABLE synchro.clients ADD COLUMN continued boolean NOT NULL DEFAULT false;
