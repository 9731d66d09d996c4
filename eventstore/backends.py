"""Which recorder a database URL gets, and the URL helpers every entry point shares."""

from __future__ import annotations

import os

from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url

from eventstore.postgres import PostgresRecorder
from eventstore.recorder import Recorder
from eventstore.sqlite import SqliteRecorder

DEFAULT_URL = "sqlite:///ledger.db"


def resolve_url(url: str | None) -> str:
    """`--db`, else `LEDGER_DB`, else the embedded default."""
    return url or os.environ.get("LEDGER_DB") or DEFAULT_URL


def mask_url(url: str | URL) -> str:
    """The URL with its password hidden: the only form of a URL that reaches a log line or an error."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable database URL>"


def recorder_for(url: str, notify: bool = False) -> Recorder:
    """The recorder of the database `url` names (`notify`: wake LISTENing subscribers on append,
    where the database can)."""
    if make_url(url).get_backend_name() == "postgresql":
        return PostgresRecorder(notify=notify)
    return SqliteRecorder()


def create_engines(url: str, pool_size: int = 5) -> tuple[Engine, Engine]:
    """A writer engine and a reader engine on `url`, as its recorder makes them."""
    return recorder_for(url).create_engines(url, pool_size)
