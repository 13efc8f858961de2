-- Per-user limits (issue 24): when each client ID was bound, for the cap
-- on registrations per hour (a binding from before counts as long ago),
-- and the rows each rebuild session staged, for the staging budgets.
ALTER TABLE synchro.clients ADD COLUMN registered_at bigint NOT NULL DEFAULT 0;
CREATE INDEX clients_registrations ON synchro.clients (user_id, registered_at);
ALTER TABLE synchro.rebuild_sessions ADD COLUMN staged_rows bigint NOT NULL DEFAULT 0;
CREATE INDEX rebuild_sessions_client_scope ON synchro.rebuild_sessions (client_id, scope_id) WHERE NOT swept;
