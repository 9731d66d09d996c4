"""The log, its append-only triggers, subscriptions, blobs, projection checkpoints, work leases.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

POSTGRES = [
    # data/metadata are `json`, not `jsonb`: the exact text the writer hashed is kept.
    """
    CREATE TABLE events (
        position        BIGINT PRIMARY KEY,
        stream_id       TEXT NOT NULL,
        stream_version  BIGINT NOT NULL,
        event_id        TEXT NOT NULL UNIQUE,
        type            TEXT NOT NULL,
        schema_version  INTEGER NOT NULL,
        data            JSON NOT NULL,
        metadata        JSON NOT NULL,
        recorded_at     DOUBLE PRECISION NOT NULL,
        prev_hash       TEXT NOT NULL,
        hash            TEXT NOT NULL,
        UNIQUE (stream_id, stream_version)
    )
    """,
    "CREATE INDEX events_type_position ON events (type, position)",
    """
    CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'the event log is append-only: % refused', TG_OP
            USING ERRCODE = 'restrict_violation';
    END $$
    """,
    """
    CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events
        FOR EACH ROW EXECUTE FUNCTION events_append_only()
    """,
    """
    CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
        FOR EACH STATEMENT EXECUTE FUNCTION events_append_only()
    """,
    # The append core, one round trip: lock, head, idempotency, expected version, hash chain, insert.
    # It mirrors `UnitOfWork._append_in_python` (SQLite); the chain tests verify both with one Python hash.
    """
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
    """,
    """
    CREATE TABLE subscriptions (
        name        TEXT PRIMARY KEY,
        position    BIGINT NOT NULL,
        updated_at  DOUBLE PRECISION NOT NULL
    )
    """,
    """
    CREATE TABLE blobs (
        digest      TEXT PRIMARY KEY,
        media_type  TEXT NOT NULL,
        content     BYTEA NOT NULL,
        created_at  DOUBLE PRECISION NOT NULL
    )
    """,
    """
    CREATE TABLE projection_checkpoints (
        projection  TEXT NOT NULL,
        version     INTEGER NOT NULL,
        position    BIGINT NOT NULL,
        state       JSON NOT NULL,
        state_hash  TEXT NOT NULL,
        log_digest  TEXT NOT NULL,
        created_at  DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (projection, version, position)
    )
    """,
    """
    CREATE TABLE work_leases (
        work_key        TEXT PRIMARY KEY,
        kind            TEXT NOT NULL,
        source_position BIGINT NOT NULL,
        owner           TEXT,
        expires_at      DOUBLE PRECISION NOT NULL DEFAULT 0,
        done            BOOLEAN NOT NULL DEFAULT FALSE
    )
    """,
    "CREATE INDEX work_leases_open ON work_leases (kind, done, source_position)",
]

SQLITE = [
    """
    CREATE TABLE events (
        position        INTEGER PRIMARY KEY,
        stream_id       TEXT NOT NULL,
        stream_version  INTEGER NOT NULL,
        event_id        TEXT NOT NULL UNIQUE,
        type            TEXT NOT NULL,
        schema_version  INTEGER NOT NULL,
        data            TEXT NOT NULL,
        metadata        TEXT NOT NULL,
        recorded_at     REAL NOT NULL,
        prev_hash       TEXT NOT NULL,
        hash            TEXT NOT NULL,
        UNIQUE (stream_id, stream_version)
    )
    """,
    "CREATE INDEX events_type_position ON events (type, position)",
    """
    CREATE TRIGGER events_no_update BEFORE UPDATE ON events
    BEGIN SELECT RAISE(ABORT, 'the event log is append-only: UPDATE refused'); END
    """,
    """
    CREATE TRIGGER events_no_delete BEFORE DELETE ON events
    BEGIN SELECT RAISE(ABORT, 'the event log is append-only: DELETE refused'); END
    """,
    """
    CREATE TABLE subscriptions (
        name        TEXT PRIMARY KEY,
        position    INTEGER NOT NULL,
        updated_at  REAL NOT NULL
    )
    """,
    """
    CREATE TABLE blobs (
        digest      TEXT PRIMARY KEY,
        media_type  TEXT NOT NULL,
        content     BLOB NOT NULL,
        created_at  REAL NOT NULL
    )
    """,
    """
    CREATE TABLE projection_checkpoints (
        projection  TEXT NOT NULL,
        version     INTEGER NOT NULL,
        position    INTEGER NOT NULL,
        state       TEXT NOT NULL,
        state_hash  TEXT NOT NULL,
        log_digest  TEXT NOT NULL,
        created_at  REAL NOT NULL,
        PRIMARY KEY (projection, version, position)
    )
    """,
    """
    CREATE TABLE work_leases (
        work_key        TEXT PRIMARY KEY,
        kind            TEXT NOT NULL,
        source_position INTEGER NOT NULL,
        owner           TEXT,
        expires_at      REAL NOT NULL DEFAULT 0,
        done            BOOLEAN NOT NULL DEFAULT 0
    )
    """,
    "CREATE INDEX work_leases_open ON work_leases (kind, done, source_position)",
]


def upgrade() -> None:
    statements = POSTGRES if op.get_bind().dialect.name == "postgresql" else SQLITE
    for statement in statements:
        op.execute(statement)


def downgrade() -> None:
    for table in ("work_leases", "projection_checkpoints", "blobs", "subscriptions", "events"):
        op.execute(f"DROP TABLE {table}")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION events_append_only()")
        op.execute(
            "DROP FUNCTION ledger_append(text, bigint, text[], text[], int[], text[], text[], double precision, boolean)"
        )
