-- Pull asks whether any projection's digest predates the current manifest
-- (then it recomputes that scope's stale members): an index answers it
-- without a scan.
CREATE INDEX projections_schema_version ON synchro.projections (schema_version);
