"""Which recorder a database URL gets, and the URL helpers every entry point shares."""

from __future__ import annotations

import os

from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url

from eventstore.errors import BadDatabaseUrl
from eventstore.postgres import PostgresRecorder
from eventstore.recorder import Recorder
from eventstore.sqlite import SqliteRecorder, split_synchronous

DEFAULT_URL = "sqlite:///ledger.db"


# What a database URL may be, in the words every refusal of one ends with.
URL_FORMS = "sqlite:///PATH (a SQLite file) or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE"


def resolve_url(url: str | None) -> str:
    """`--db`, else `LEDGER_DB`, else the embedded default, checked (`check_url`)."""
    return check_url(url or os.environ.get("LEDGER_DB") or DEFAULT_URL)


def check_url(url: str) -> str:
    """`url` when it names a log this code can open (`postgresql://` and `postgres://` as
    `postgresql+psycopg://`);
    else `BadDatabaseUrl`, whose one line says what is wrong and what to write."""
    if "://" not in url:
        if url.startswith("sqlite:"):
            raise BadDatabaseUrl(
                f"{url!r} is not a database URL: a SQLite file is sqlite:///RELATIVE/PATH or "
                "sqlite:////ABSOLUTE/PATH (three slashes, then the path)"
            )
        raise BadDatabaseUrl(
            f"{url!r} is not a database URL: for a SQLite file write sqlite:///{url}; the log is {URL_FORMS}"
        )
    try:
        parsed = make_url(url)
    except Exception:  # sqlalchemy's ArgumentError, or a port that is not a number (ValueError)
        raise BadDatabaseUrl(f"{mask_url(url)!r} is not a database URL; the log is {URL_FORMS}") from None
    # From the text: sqlalchemy's get_driver_name() loads the dialect, which an unknown scheme lacks.
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise BadDatabaseUrl(f"{url!r} names no file: the log is sqlite:///PATH (a file, not memory)")
        split_synchronous(url)  # `?synchronous=` names a setting the log runs with
        return url
    if backend in ("postgres", "postgresql"):
        if not driver:  # `postgres://` too, as many hosts hand it out
            return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
        if backend == "postgresql" and driver == "psycopg":
            return url
        raise BadDatabaseUrl(
            f"{mask_url(parsed)}: PostgreSQL is reached through psycopg 3: write "
            f"postgresql+psycopg://{mask_url(parsed).split('://', 1)[1]}"
        )
    raise BadDatabaseUrl(f"{parsed.drivername}:// is not a log this ledger can use: the log is {URL_FORMS}")


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


def create_engines(
    url: str, pool_size: int = 5, read_only: bool = False, create: bool = True
) -> tuple[Engine, Engine]:
    """A writer engine and a reader engine on `url`, as its recorder makes them."""
    return recorder_for(url).create_engines(url, pool_size, read_only, create)
