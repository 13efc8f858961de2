-- A mutation's outcome is stored once (issue 25): its batch's answer holds
-- the same bytes, so the mutation row keeps where they lie in it (a byte
-- offset and length) instead of a copy. An outcome that is not in its
-- batch's answer verbatim is kept as before. Nothing else changes: the
-- lookup returns the same bytes either way.
ALTER TABLE synchro.push_mutations
    ALTER COLUMN outcome DROP NOT NULL,
    ADD COLUMN outcome_at integer CHECK (outcome_at >= 0),
    ADD COLUMN outcome_len integer CHECK (outcome_len > 0),
    ADD CONSTRAINT push_mutations_outcome_once
        CHECK ((outcome IS NULL) = (outcome_at IS NOT NULL AND outcome_len IS NOT NULL));

CREATE OR REPLACE FUNCTION synchro.push_ledger_rows(
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
