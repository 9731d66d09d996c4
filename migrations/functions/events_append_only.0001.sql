-- The trigger function that makes the log append-only (migration 0001).
CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the event log is append-only: % refused', TG_OP
        USING ERRCODE = 'restrict_violation';
END $$
