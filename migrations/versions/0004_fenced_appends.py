"""Fenced appends: `ledger_append_events` takes a fence (a stream and the version it must be at) per append.

A writer that owns something by having appended to an epoch stream (a trainer's `trainer-<id>`)
fences its appends on that stream's version: a newer owner appends there too, and the stale writer's
next append is refused (SQLSTATE LE003) under the same lock that orders the write, with nothing
written.  The function's text is `migrations/functions/ledger_append_events.0004.sql`.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

from migrations import function_sql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_OLD_SIGNATURE = (
    "ledger_append_events(text[], bigint[], boolean[], int[], text[], text[], int[], text[], text[], "
    "double precision, text[], bytea[], boolean)"
)
_SIGNATURE = _OLD_SIGNATURE[:-1] + ", text[], bigint[])"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {_OLD_SIGNATURE}")
        op.execute(function_sql("ledger_append_events", revision))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {_SIGNATURE}")
        op.execute(function_sql("ledger_append_events", "0003"))
