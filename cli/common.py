"""Options and error handling shared by every `ledger` command."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Final, Literal

import typer
from rich.console import Console

from eventstore import EventStoreError
from eventstore.backends import mask_url, resolve_url
from protocol.logsafety import install_log_masking

# Every `ledger` command imports this module: from here on no log line carries a database password.
install_log_masking()

WRITER_ENV: Final = "LEDGER_DB"
AUDITOR_ENV: Final = "LEDGER_AUDITOR_DB"
Role = Literal["writer", "auditor"]

console = Console()
err_console = Console(stderr=True)

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="Database URL (default: $LEDGER_DB, else sqlite:///ledger.db; read-only commands: "
        "$LEDGER_AUDITOR_DB first).",
        show_default=False,
    ),
]


def db_url(db: str | None, role: Role = "writer") -> str:
    """The URL a command connects with: `--db`, else the role's environment, else the default.

    Commands that append (simulate, replay, worker, db) are `writer`s and take `$LEDGER_DB` (a URL
    of the role with INSERT and SELECT only, once `ledger db roles` has made it).  Read-only commands
    (audit, snapshot, show, status, tail) are `auditor`s: they take `$LEDGER_AUDITOR_DB` (the
    SELECT-only role) when it is set, and fall back to `$LEDGER_DB`.
    """
    if role not in ("writer", "auditor"):
        raise ValueError(f"unknown database role {role!r} (writer, auditor)")
    if db:
        return db
    if role == "auditor":
        auditor = os.environ.get(AUDITOR_ENV)
        if auditor:
            return auditor
    return resolve_url(None)


@contextmanager
def clear_errors() -> Iterator[None]:
    """A store error ends the command with its message (password masked) and exit status 2."""
    try:
        yield
    except EventStoreError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


__all__ = [
    "AUDITOR_ENV",
    "WRITER_ENV",
    "DbOption",
    "Role",
    "clear_errors",
    "console",
    "db_url",
    "err_console",
    "mask_url",
]
