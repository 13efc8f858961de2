-- ADR 0032: a mutation's outcome is stored once. Its batch's answer holds
-- the same bytes, so the mutation row keeps where they lie in it (a byte
-- offset and length) instead of a copy. An outcome that is not in its
-- batch's answer verbatim is kept as before. The lookup returns the same
-- bytes either way.
ALTER TABLE synchro.push_mutations
    ALTER COLUMN outcome DROP NOT NULL,
    ADD COLUMN outcome_at integer CHECK (outcome_at >= 0),
    ADD COLUMN outcome_len integer CHECK (outcome_len > 0),
    ADD CONSTRAINT push_mutations_outcome_once
        CHECK ((outcome IS NULL) = (outcome_at IS NOT NULL AND outcome_len IS NOT NULL));

-- ADR 0031: a push reads its client's row locked and its ledger rows in one
-- statement. The ledger rows come from this function, called after the
-- lock in the same statement: VOLATILE, so each of its queries takes a
-- snapshot of its own, which includes a batch that the lock's previous
-- holder committed while this push waited for it. (The statement's own
-- snapshot is older than the wait.) Planned at each call, as the lookup
-- was: a cached generic plan would keep the scan chosen while the tables
-- were small.
CREATE FUNCTION synchro.push_ledger_rows(
    p_user text, p_client text, p_batch uuid, p_mutations uuid[]
) RETURNS TABLE (
    kind text, mutation_id text, batch_id text, fingerprint bytea, status smallint, body bytea
) LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY EXECUTE
        'SELECT ''b''::text, NULL::text, NULL::text, b.fingerprint, b.status, b.body '
        'FROM synchro.push_batches b '
        'WHERE b.user_id = $1 AND b.client_id = $2 AND b.batch_id = $3 '
        'UNION ALL '
        'SELECT ''m'', m.mutation_id::text, m.batch_id::text, m.fingerprint, NULL::smallint, '
        '  coalesce(m.outcome, substring(b.body FROM m.outcome_at + 1 FOR m.outcome_len)) '
        'FROM synchro.push_mutations m '
        'LEFT JOIN synchro.push_batches b '
        '  ON b.user_id = m.user_id AND b.client_id = m.client_id AND b.batch_id = m.batch_id '
        'WHERE m.user_id = $1 AND m.client_id = $2 AND m.mutation_id = ANY($4)'
        USING p_user, p_client, p_batch, p_mutations;
END
$$;

-- The same for a push's rows: their versions are read, by the writer,
-- after the statement that calls this has locked the rows, which may have
-- waited for another writer of them. `p_locked` (the count of rows
-- locked) only ties the call to the lock.
CREATE FUNCTION synchro.row_versions_after_lock(
    p_table text, p_keys text[], p_locked bigint
) RETURNS TABLE (key text, version text, deleted boolean)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN QUERY EXECUTE
        'SELECT v.key, v.version, v.deleted FROM synchro.row_versions v '
        'WHERE v.table_id = $1 AND v.key = ANY($2)'
        USING p_table, p_keys;
END
$$;
