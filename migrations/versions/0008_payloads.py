"""The payload plane's PostgreSQL table, `ledger_payloads`, in the log's own database: the default
payload store beside a PostgreSQL log (payloads._postgres; created here so that the roles can be
granted on it, and created on first use by a payload store in a database of its own).  SQLite logs
keep their payloads in a directory beside the file.  The `blobs` table stays: older events' payloads
are read from it.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from alembic import op

from payloads._postgres import CREATE_TABLE, TABLE

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CREATE_TABLE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP TABLE IF EXISTS {TABLE}")
