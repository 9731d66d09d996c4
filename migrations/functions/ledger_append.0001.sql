-- The append core of migration 0001, one round trip: lock, head, idempotency, expected version,
-- hash chain, insert.  It mirrors the SQLite recorder; the chain tests verify both with one Python hash.
CREATE FUNCTION ledger_append(
    p_stream_id text, p_expected bigint, p_event_ids text[], p_types text[], p_schema_versions int[],
    p_data text[], p_metadata text[], p_recorded_at double precision, p_check_ids boolean
) RETURNS TABLE (out_position bigint, out_stream_version bigint, out_idempotent boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_head bigint;
    v_version bigint;
    v_hash text;
    v_prev text;
    v_found int;
    n int := cardinality(p_event_ids);
BEGIN
    -- One log-wide lock until commit: positions are handed out in commit order, contiguously.
    PERFORM pg_advisory_xact_lock(2021093);
    SELECT COALESCE(MAX(position), 0) INTO v_head FROM events;
    SELECT stream_version, hash INTO v_version, v_hash
        FROM events WHERE stream_id = p_stream_id ORDER BY stream_version DESC LIMIT 1;
    IF NOT FOUND THEN
        v_version := -1;
        v_hash := repeat('0', 64);
    END IF;
    IF p_check_ids THEN
        SELECT count(*) INTO v_found FROM events WHERE event_id = ANY (p_event_ids);
        IF v_found > 0 THEN
            IF v_found < n OR EXISTS (
                SELECT 1 FROM events e JOIN unnest(p_event_ids, p_types, p_data) AS u(id, t, d) ON e.event_id = u.id
                WHERE e.stream_id <> p_stream_id OR e.type <> u.t OR e.data::jsonb <> u.d::jsonb
            ) THEN
                RAISE EXCEPTION 'event ids already recorded with other content or in another stream'
                    USING ERRCODE = 'LE002';
            END IF;
            RETURN QUERY SELECT e.position, e.stream_version, true FROM events e
                WHERE e.event_id = ANY (p_event_ids) ORDER BY e.position;
            RETURN;
        END IF;
    END IF;
    IF (p_expected = -1 AND v_version <> -1) OR (p_expected >= 0 AND v_version <> p_expected) THEN
        RAISE EXCEPTION 'wrong expected version' USING ERRCODE = 'LE001', DETAIL = v_version::text;
    END IF;
    FOR i IN 1..n LOOP
        v_version := v_version + 1;
        v_head := v_head + 1;
        v_prev := v_hash;
        v_hash := encode(sha256(convert_to(concat_ws(chr(31), v_prev, p_stream_id, v_version::text,
            p_event_ids[i], p_types[i], p_schema_versions[i]::text, p_data[i], p_metadata[i]), 'UTF8')), 'hex');
        INSERT INTO events (position, stream_id, stream_version, event_id, type, schema_version, data, metadata,
                            recorded_at, prev_hash, hash)
        VALUES (v_head, p_stream_id, v_version, p_event_ids[i], p_types[i], p_schema_versions[i],
                p_data[i]::json, p_metadata[i]::json, p_recorded_at, v_prev, v_hash);
        out_position := v_head;
        out_stream_version := v_version;
        out_idempotent := false;
        RETURN NEXT;
    END LOOP;
END $$
