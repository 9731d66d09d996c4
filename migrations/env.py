"""Alembic environment: the store passes its own connection; no alembic.ini is needed."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

config = context.config
connection = config.attributes.get("connection")

if connection is not None:
    context.configure(connection=connection, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()
else:  # plain `alembic upgrade head` with sqlalchemy.url set
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "sqlite:///ledger.db")
    with engine.begin() as conn:
        context.configure(connection=conn, transactional_ddl=True)
        with context.begin_transaction():
            context.run_migrations()
