"""`ledger_append_events` takes its text columns packed: one text value per column, its elements
joined by the unit separator, instead of one binary array each (the client dumped each array in
Python), and builds its rows as `events` values inserted by one unnest (see the function's header).

The function's text is `migrations/functions/ledger_append_events.0007.sql`.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from alembic import op

from migrations import function_sql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_0006_SIGNATURE = (
    "ledger_append_events(text[], bigint[], boolean[], int[], text[], text[], int[], text[], text[], "
    "double precision, text[], bytea[], boolean, text[], bigint[], boolean)"
)
_SIGNATURE = (
    "ledger_append_events(text, text, text, text, text, text, text, text, text, "
    "double precision, text[], bytea[], boolean, text[], bigint[], boolean)"
)


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {_0006_SIGNATURE}")
        op.execute(function_sql("ledger_append_events", revision))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {_SIGNATURE}")
        op.execute(function_sql("ledger_append_events", "0006"))
