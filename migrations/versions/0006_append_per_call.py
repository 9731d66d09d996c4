"""`ledger_append_events` costs less per call: no per-call `SET` clause, and the blob INSERT and the
retry check run only when a call needs them.

The function's text is `migrations/functions/ledger_append_events.0006.sql`.  Its lookups are by
unique keys, so an index scan is always the right plan; PL/pgSQL keeps a plan per session, and a
session that first appended while `events` was small would keep sequential-scan plans (migration
0002 measured it).  The clause that guarded against that ran on every call; the store's writer
sessions now set `enable_seqscan = off` once, when they connect (`PostgresRecorder`).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from alembic import op

from migrations import function_sql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(function_sql("ledger_append_events", revision))


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            function_sql("ledger_append_events", "0005").replace(
                "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1
            )
        )
