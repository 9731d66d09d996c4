"""The log, its append-only triggers, subscriptions, blobs, projection checkpoints, work leases.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from alembic import op

from migrations import function_sql

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
    function_sql("events_append_only", revision),
    """
    CREATE TRIGGER events_no_update_delete BEFORE UPDATE OR DELETE ON events
        FOR EACH ROW EXECUTE FUNCTION events_append_only()
    """,
    """
    CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
        FOR EACH STATEMENT EXECUTE FUNCTION events_append_only()
    """,
    # The append core, one round trip: lock, head, idempotency, expected version, hash chain, insert.
    function_sql("ledger_append", revision),
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
