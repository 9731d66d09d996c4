"""Options and error handling shared by every `ledger` command."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.console import Console

from eventstore import EventStoreError
from eventstore.backends import mask_url, resolve_url

console = Console()
err_console = Console(stderr=True)

DbOption = Annotated[
    str | None,
    typer.Option(
        "--db", help="Database URL (default: $LEDGER_DB, else sqlite:///ledger.db).", show_default=False
    ),
]


def db_url(db: str | None) -> str:
    return resolve_url(db)


@contextmanager
def clear_errors() -> Iterator[None]:
    """A store error ends the command with its message (password masked) and exit status 2."""
    try:
        yield
    except EventStoreError as exc:
        err_console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


__all__ = ["DbOption", "clear_errors", "console", "db_url", "err_console", "mask_url"]
