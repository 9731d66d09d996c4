"""Independent appends: one `ledger_append_events` statement carries a group commit's appends, each
written or refused on its own (`p_independent`), refusals answered as rows instead of raised.

The function's text is `migrations/functions/ledger_append_events.0005.sql`.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from alembic import op

from migrations import function_sql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_0004_SIGNATURE = (
    "ledger_append_events(text[], bigint[], boolean[], int[], text[], text[], int[], text[], text[], "
    "double precision, text[], bytea[], boolean, text[], bigint[])"
)
_SIGNATURE = _0004_SIGNATURE[:-1] + ", boolean)"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {_0004_SIGNATURE}")
        op.execute(function_sql("ledger_append_events", revision))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION {_SIGNATURE}")
        op.execute(function_sql("ledger_append_events", "0004"))
