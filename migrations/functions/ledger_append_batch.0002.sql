-- ledger_append_batch as of migration 0002 (dropped by 0003).
CREATE FUNCTION ledger_append_batch(p_batch json, p_recorded_at double precision)
RETURNS TABLE (out_append int, out_position bigint, out_stream_version bigint, out_idempotent boolean)
LANGUAGE plpgsql AS $$
DECLARE
    a record;
    i int := 0;
    v_state text;
    v_message text;
    v_detail text;
BEGIN
    -- One parse of the whole batch: JSON arrays become the text[]/int[] arguments, strings exactly.
    FOR a IN SELECT * FROM json_to_recordset(p_batch) AS x(
        stream_id text, expected bigint, check_ids boolean,
        ids text[], types text[], versions int[], data text[], metadata text[]
    ) LOOP
        RETURN QUERY SELECT i, r.out_position, r.out_stream_version, r.out_idempotent FROM ledger_append(
            a.stream_id, a.expected, a.ids, a.types, a.versions, a.data, a.metadata, p_recorded_at, a.check_ids
        ) r;
        i := i + 1;
    END LOOP;
EXCEPTION WHEN SQLSTATE 'LE001' OR SQLSTATE 'LE002' THEN
    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT, v_detail = PG_EXCEPTION_DETAIL;
    RAISE EXCEPTION '%', v_message USING ERRCODE = v_state, DETAIL = v_detail, HINT = i::text;
END $$
