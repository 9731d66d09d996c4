"""Options and error handling shared by every `ledger` command.

Every `ledger` command imports this module, and `ledger --help` imports every command module: they
import typer and rich at the top and the rest (the log, the trainer, torch) in the command that uses
it, so a command costs only what it needs and runs with only the extras it needs (`require_extra`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Final, Literal

import typer
from rich.console import Console
from rich.markup import escape

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
    SELECT-only role) when it is set, and fall back to `$LEDGER_DB`.  A URL that names no log this
    code can open is `BadDatabaseUrl` (call it inside `clear_errors`).
    """
    from eventstore.backends import resolve_url

    if role not in ("writer", "auditor"):
        raise ValueError(f"unknown database role {role!r} (writer, auditor)")
    if db:
        return resolve_url(db)
    if role == "auditor":
        auditor = os.environ.get(AUDITOR_ENV)
        if auditor:
            return resolve_url(auditor)
    return resolve_url(None)


@contextmanager
def clear_errors() -> Iterator[None]:
    """A store error (the log's or a payload store's) ends the command with its message (password
    masked) and exit status 2."""
    from eventstore.errors import EventStoreError
    from payloads import PayloadStoreError

    try:
        yield
    except (EventStoreError, PayloadStoreError) as exc:
        error(str(exc))
        raise typer.Exit(2) from None


def mask_url(url: str) -> str:
    """The URL with its password hidden (`eventstore.backends.mask_url`)."""
    from eventstore.backends import mask_url as mask

    return mask(url)


# What each extra brings, as `require_extra` names it.
EXTRAS: Final = {
    "workers": "torch, Triton, numpy",
    "agent": "uvicorn, torch",
    "ray": "ray",
    "metrics": "prometheus_client",
    "otel": "opentelemetry-sdk",
    "console": "uvicorn, Jinja2",
}


def require_extra(extra: str, what: str, *modules: str, load: bool = True) -> None:
    """Imports `modules` (with `load=False` only looks them up, for a package whose import must wait:
    Ray settles its network at import, after `prepare_loopback`); when one is missing, ends the
    command with one line naming the extra that brings it and the command that installs it (exit
    status 2)."""
    for name in modules:
        try:
            if load:
                importlib.import_module(name)
            elif importlib.util.find_spec(name) is None:
                raise ImportError(f"no module named {name!r}", name=name)
        except ImportError as exc:
            missing = exc.name or name
            error(
                f"{what} needs the `{extra}` extra ({EXTRAS.get(extra, extra)}; {missing} is not installed): "
                f"pip install -c requirements/constraints.txt '.[{extra}]'"
            )
            raise typer.Exit(2) from None


# The most of one value a command echoes back (an id, a URL, a name the user typed), and of one
# error line: a longer one is cut, saying how long it was.
ECHO_LIMIT: Final = 120
ERROR_LIMIT: Final = 1000


def bounded(text: str, limit: int = ECHO_LIMIT) -> str:
    """`text` as a command echoes it: whole up to `limit` characters, else its first `limit` and how
    long it was.  Print it markup-escaped and with `highlight=False`: rich's highlighter takes
    minutes over one long word (100,000 characters), which a user may type."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def error(message: str) -> None:
    """`error: MESSAGE` on stderr as one line (never wrapped at the terminal's width), markup-free,
    unhighlighted and bounded (`bounded`, `ERROR_LIMIT`): the message may carry what the user typed."""
    err_console.print(
        f"[red]error:[/red] {escape(bounded(message, ERROR_LIMIT))}", soft_wrap=True, highlight=False
    )


__all__ = [
    "AUDITOR_ENV",
    "ECHO_LIMIT",
    "ERROR_LIMIT",
    "WRITER_ENV",
    "DbOption",
    "Role",
    "bounded",
    "clear_errors",
    "console",
    "db_url",
    "err_console",
    "error",
    "mask_url",
    "require_extra",
]
