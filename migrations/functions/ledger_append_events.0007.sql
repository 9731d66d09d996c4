-- ledger_append_events as of migration 0007: 0006's function, its text arguments packed and its rows
-- built as `events` values.
-- Each text column arrives as one text value, its elements joined by the unit separator (chr(31)),
-- which never occurs unescaped in JSON text, in a UUID, in an event type or in a valid stream id
-- (the hash chain joins the same fields with it).  A binary array parameter cost the client about
-- 3 us to dump in psycopg (its list dumper runs in Python), 14 of them per call; a text value costs
-- 0.2 us (measured with psycopg 3.3).  `string_to_array` splits them back in C.  A count that does
-- not match (a separator inside an element) refuses the whole call, before or after the appends' own
-- checks and always before anything commits: SQLSTATE LE004.
-- Each written event becomes one `events` row value as its hash is chained, and is answered with
-- RETURN NEXT; one INSERT unnests them all.  Ten parallel arrays unnested together (0006) cost a
-- tuplestore per array: 10% more server time per call at 1, 10 and 80 events (measured in one
-- session, each call its own transaction).
CREATE OR REPLACE FUNCTION ledger_append_events(
    a_streams text, a_expected text, a_check_ids text, a_counts text,
    a_ids text, a_types text, a_versions text, a_data text, a_metadata text,
    p_recorded_at double precision, p_blob_digests text[], p_blobs bytea[], p_notify boolean,
    p_fence_streams text[], p_fence_versions bigint[], p_independent boolean
) RETURNS TABLE (out_append int, out_position bigint, out_stream_version bigint, out_idempotent boolean,
                 out_prev_hash text, out_hash text, out_refusal text)
LANGUAGE plpgsql AS $$
DECLARE
    p_streams text[] := string_to_array(a_streams, chr(31));
    p_expected bigint[] := string_to_array(a_expected, chr(31))::bigint[];
    p_check_ids boolean[] := string_to_array(a_check_ids, chr(31))::boolean[];
    p_counts int[] := string_to_array(a_counts, chr(31))::int[];
    p_ids text[] := string_to_array(a_ids, chr(31));
    p_types text[] := string_to_array(a_types, chr(31));
    p_versions int[] := string_to_array(a_versions, chr(31))::int[];
    p_data text[] := string_to_array(a_data, chr(31));
    p_metadata text[] := string_to_array(a_metadata, chr(31));
    n_appends int := cardinality(p_streams);
    n int := cardinality(p_ids);
    v_head bigint;
    v_written bigint := 0;
    seen text[] := '{}';
    seen_version bigint[] := '{}';
    seen_hash text[] := '{}';
    v_rows events[] := '{}';
    j int;
    k int;
    e int := 0;
    s int;
    cur_v bigint;
    cur_h text;
    fence_v bigint;
    refused text;
    refused_v bigint;
    r record;
    v_retry boolean := false;
BEGIN
    IF cardinality(p_expected) <> n_appends OR cardinality(p_check_ids) <> n_appends
            OR cardinality(p_counts) <> n_appends OR cardinality(p_types) <> n OR cardinality(p_versions) <> n
            OR cardinality(p_data) <> n OR cardinality(p_metadata) <> n THEN
        RAISE EXCEPTION 'ledger_append_events: packed arguments disagree on their counts'
            USING ERRCODE = 'LE004';
    END IF;
    -- The payloads the events refer to (content-addressed, so writing one twice is a no-op).
    IF p_blob_digests IS NOT NULL THEN
        INSERT INTO blobs (digest, media_type, content, created_at)
            SELECT u.digest, 'application/json', u.content, p_recorded_at
            FROM unnest(p_blob_digests, p_blobs) AS u(digest, content)
            ON CONFLICT (digest) DO NOTHING;
    END IF;
    IF p_notify THEN
        PERFORM pg_notify('ledger_events', '');
    END IF;
    PERFORM pg_advisory_xact_lock(2021093);
    IF true = ANY (p_check_ids) THEN
        v_retry := EXISTS (SELECT 1 FROM events WHERE event_id = ANY (p_ids));
    END IF;
    IF v_retry THEN
        -- A retry of appends that may have committed: each append on its own, with idempotency.
        FOR j IN 1..n_appends LOOP
            BEGIN
                IF p_fence_streams[j] IS NOT NULL AND NOT (p_check_ids[j] AND EXISTS (
                        SELECT 1 FROM events WHERE event_id = ANY (p_ids[e + 1:e + p_counts[j]]))) THEN
                    -- Not a retry of rows already recorded: the fence holds or nothing is written.
                    SELECT ev.stream_version INTO fence_v FROM events ev
                        WHERE ev.stream_id = p_fence_streams[j] ORDER BY ev.stream_version DESC LIMIT 1;
                    IF NOT FOUND THEN
                        fence_v := -1;
                    END IF;
                    IF fence_v <> p_fence_versions[j] THEN
                        RAISE EXCEPTION 'fenced' USING ERRCODE = 'LE003', DETAIL = fence_v::text;
                    END IF;
                END IF;
                FOR r IN SELECT * FROM ledger_append(p_streams[j], p_expected[j], p_ids[e + 1:e + p_counts[j]],
                        p_types[e + 1:e + p_counts[j]], p_versions[e + 1:e + p_counts[j]], p_data[e + 1:e + p_counts[j]],
                        p_metadata[e + 1:e + p_counts[j]], p_recorded_at, p_check_ids[j]) LOOP
                    RETURN QUERY SELECT j - 1, r.out_position, r.out_stream_version, r.out_idempotent, ev.prev_hash,
                        ev.hash, NULL::text FROM events ev WHERE ev.position = r.out_position;
                END LOOP;
            EXCEPTION WHEN SQLSTATE 'LE001' OR SQLSTATE 'LE002' OR SQLSTATE 'LE003' THEN
                DECLARE v_state text; v_message text; v_detail text; BEGIN
                    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_message = MESSAGE_TEXT, v_detail = PG_EXCEPTION_DETAIL;
                    IF NOT p_independent THEN
                        RAISE EXCEPTION '%', v_message USING ERRCODE = v_state, DETAIL = v_detail, HINT = (j - 1)::text;
                    END IF;
                    RETURN QUERY SELECT j - 1, NULL::bigint, NULLIF(v_detail, '')::bigint, false, NULL::text, NULL::text, v_state;
                END;
            END;
            e := e + p_counts[j];
        END LOOP;
        IF e <> n THEN
            RAISE EXCEPTION 'ledger_append_events: packed arguments disagree on their counts' USING ERRCODE = 'LE004';
        END IF;
        RETURN;
    END IF;
    SELECT COALESCE(MAX(position), 0) INTO v_head FROM events;
    FOR j IN 1..n_appends LOOP
        refused := NULL;
        IF p_fence_streams[j] IS NOT NULL THEN
            -- The fence stream as the batch's earlier appends leave it (as appending one by one would).
            s := array_position(seen, p_fence_streams[j]);
            IF s IS NULL THEN
                SELECT ev.stream_version INTO fence_v FROM events ev
                    WHERE ev.stream_id = p_fence_streams[j] ORDER BY ev.stream_version DESC LIMIT 1;
                IF NOT FOUND THEN
                    fence_v := -1;
                END IF;
            ELSE
                fence_v := seen_version[s];
            END IF;
            IF fence_v <> p_fence_versions[j] THEN
                refused := 'LE003';
                refused_v := fence_v;
            END IF;
        END IF;
        s := array_position(seen, p_streams[j]);
        IF s IS NULL THEN
            SELECT ev.stream_version, ev.hash INTO cur_v, cur_h FROM events ev
                WHERE ev.stream_id = p_streams[j] ORDER BY ev.stream_version DESC LIMIT 1;
            IF NOT FOUND THEN
                cur_v := -1;
                cur_h := repeat('0', 64);
            END IF;
            seen := seen || p_streams[j];
            s := cardinality(seen);
            seen_version[s] := cur_v;
            seen_hash[s] := cur_h;
        ELSE
            cur_v := seen_version[s];
            cur_h := seen_hash[s];
        END IF;
        IF refused IS NULL AND ((p_expected[j] = -1 AND cur_v <> -1) OR (p_expected[j] >= 0 AND cur_v <> p_expected[j])) THEN
            refused := 'LE001';
            refused_v := cur_v;
        END IF;
        IF refused IS NOT NULL THEN
            IF NOT p_independent THEN
                RAISE EXCEPTION '%', CASE refused WHEN 'LE001' THEN 'wrong expected version' ELSE 'fenced' END
                    USING ERRCODE = refused, DETAIL = refused_v::text, HINT = (j - 1)::text;
            END IF;
            RETURN QUERY SELECT j - 1, NULL::bigint, refused_v, false, NULL::text, NULL::text, refused;
        ELSE
            FOR k IN e + 1..e + p_counts[j] LOOP
                cur_v := cur_v + 1;
                v_written := v_written + 1;
                out_prev_hash := cur_h;
                cur_h := encode(sha256(convert_to(concat_ws(chr(31), cur_h, p_streams[j], cur_v::text,
                    p_ids[k], p_types[k], p_versions[k]::text, p_data[k], p_metadata[k]), 'UTF8')), 'hex');
                v_rows[v_written] := ROW(v_head + v_written, p_streams[j], cur_v, p_ids[k], p_types[k], p_versions[k],
                    p_data[k]::json, p_metadata[k]::json, p_recorded_at, out_prev_hash, cur_h)::events;
                out_append := j - 1;
                out_position := v_head + v_written;
                out_stream_version := cur_v;
                out_idempotent := false;
                out_hash := cur_h;
                out_refusal := NULL;
                RETURN NEXT;
            END LOOP;
            seen_version[s] := cur_v;
            seen_hash[s] := cur_h;
        END IF;
        e := e + p_counts[j];
    END LOOP;
    IF e <> n THEN
        RAISE EXCEPTION 'ledger_append_events: packed arguments disagree on their counts' USING ERRCODE = 'LE004';
    END IF;
    INSERT INTO events SELECT * FROM unnest(v_rows);
END $$;
