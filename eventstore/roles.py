"""Database roles for PostgreSQL: a writer (INSERT and SELECT on the log) and a read-only auditor."""

from __future__ import annotations

import psycopg
from psycopg import sql
from sqlalchemy import Engine

from eventstore import check_reachable
from eventstore.backends import mask_url
from eventstore.errors import BadDatabaseUrl, EventStoreError

# Tables the writer appends to but never changes, and work tables it maintains.
APPEND_ONLY_TABLES = ("events", "blobs", "projection_checkpoints")
# `ledger_payloads`: the writer also deletes there (collection and retention, docs/payloads.md).
WORK_TABLES = ("subscriptions", "work_leases", "ledger_payloads")


class RolesRefused(EventStoreError):
    """The database would not make the roles (no ledger schema yet, a role without the right to)."""


def create_roles(
    url: str, engine: Engine, writer: str, writer_password: str, auditor: str, auditor_password: str
) -> None:
    """Creates (or updates) both roles in one transaction on the ledger's PostgreSQL database at `url`
    (over `engine`).  An unreachable database (`eventstore.check_reachable`), one without the ledger's
    schema, or a statement the database refuses is one line, with nothing changed."""
    if engine.dialect.name != "postgresql":
        raise BadDatabaseUrl("roles exist only on PostgreSQL; SQLite has no users")
    if check_reachable(url, engine) is None:
        raise RolesRefused(f"{mask_url(url)} has no ledger schema: run `ledger db upgrade` first")
    statements: list[sql.Composable] = []
    for role, password in ((writer, writer_password), (auditor, auditor_password)):
        statements.append(
            sql.SQL(
                "DO $$ BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {name}) THEN "
                "CREATE ROLE {role} LOGIN; END IF; END $$"
            ).format(name=sql.Literal(role), role=sql.Identifier(role))
        )
        statements.append(
            sql.SQL("ALTER ROLE {role} LOGIN PASSWORD {pw}").format(
                role=sql.Identifier(role), pw=sql.Literal(password)
            )
        )
        statements.append(sql.SQL("GRANT USAGE ON SCHEMA public TO {role}").format(role=sql.Identifier(role)))
        statements.append(
            sql.SQL("GRANT SELECT ON alembic_version TO {role}").format(role=sql.Identifier(role))
        )
    w, a = sql.Identifier(writer), sql.Identifier(auditor)
    for table in APPEND_ONLY_TABLES:
        statements.append(sql.SQL("REVOKE ALL ON {t} FROM {w}").format(t=sql.Identifier(table), w=w))
        statements.append(sql.SQL("GRANT SELECT, INSERT ON {t} TO {w}").format(t=sql.Identifier(table), w=w))
    for table in WORK_TABLES:
        statements.append(
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {t} TO {w}").format(t=sql.Identifier(table), w=w)
        )
    statements.append(sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {a}").format(a=a))
    statements.append(sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA public TO {a}").format(a=a))
    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        assert conn is not None
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
        raw.commit()
    except psycopg.Error as exc:
        raw.rollback()
        # One line: the server's message (libpq's can run over several), the URL's password hidden.
        reason = " ".join(str(exc).split())
        raise RolesRefused(f"{mask_url(url)} made no roles: {reason}") from None
    finally:
        raw.close()
