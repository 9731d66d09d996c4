"""`ledger_append` plans its lookups with index scans, whatever the table's size when first planned.

PL/pgSQL caches a plan per statement and session.  A writer's pooled session that first appended
while `events` was small kept sequential-scan plans for the event-id, stream-head and head lookups
until the next ANALYZE; on a growing log every append then scanned the table (measured: 0.47 against
0.14 ms per 3-event append after a few thousand events).  Every lookup in the function is by a
unique key, so an index scan is always the right plan.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_SIGNATURE = "ledger_append(text, bigint, text[], text[], int[], text[], text[], double precision, boolean)"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER FUNCTION {_SIGNATURE} SET enable_seqscan = off")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER FUNCTION {_SIGNATURE} RESET enable_seqscan")
