"""What differs between SQLite and PostgreSQL: engines, the append lock, a few SQL strings.

Gap-free tailing: every append takes one log-wide lock before it reads the
head, and holds it until commit (PostgreSQL: a transaction-scoped advisory
lock, taken inside the `ledger_append` function of the first migration;
SQLite: `BEGIN IMMEDIATE`).  Positions are therefore assigned
`max(position) + 1` in commit order: they are contiguous, a reader that has
seen position p has seen every position below it, and a rolled-back append
leaves no hole.  See the README ("Why positions are gap-free").
"""

from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.engine import URL, make_url

DEFAULT_URL = "sqlite:///ledger.db"

_COLUMNS = "position, stream_id, stream_version, event_id, type, schema_version, {data}, {metadata}, recorded_at, prev_hash, hash"


def resolve_url(url: str | None) -> str:
    """`--db`, else `LEDGER_DB`, else the embedded default."""
    return url or os.environ.get("LEDGER_DB") or DEFAULT_URL


def mask_url(url: str | URL) -> str:
    """The URL with its password hidden: the only form of a URL that reaches a log line or an error."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable database URL>"


@dataclass(frozen=True)
class Backend:
    name: str
    select_columns: str
    blob_insert: str
    position_upsert: str
    # DBAPI parameter marker for a named parameter (reads bypass SQLAlchemy's row layer for speed).
    param: str


SQLITE = Backend(
    name="sqlite",
    select_columns=_COLUMNS.format(data="data", metadata="metadata"),
    blob_insert=(
        "INSERT INTO blobs (digest, media_type, content, created_at) VALUES (:digest, :media_type, :content, :now) "
        "ON CONFLICT (digest) DO NOTHING"
    ),
    position_upsert=(
        "INSERT INTO subscriptions (name, position, updated_at) VALUES (:name, :position, :now) "
        "ON CONFLICT (name) DO UPDATE SET position = excluded.position, updated_at = excluded.updated_at"
    ),
    param=":{}",
)

POSTGRES = Backend(
    name="postgresql",
    # `::text` hands back the stored JSON text as written (no parse in the driver).
    select_columns=_COLUMNS.format(data="data::text AS data", metadata="metadata::text AS metadata"),
    blob_insert=SQLITE.blob_insert,
    position_upsert=SQLITE.position_upsert,
    param="%({})s",
)


def backend_for(url: str) -> Backend:
    return POSTGRES if make_url(url).get_backend_name() == "postgresql" else SQLITE


def create_engines(url: str, pool_size: int = 5) -> tuple[Engine, Engine]:
    """A writer engine and a reader engine.

    On SQLite the writer's transactions start with `BEGIN IMMEDIATE` so that the
    write lock is taken before the head is read (commit order = position order);
    readers use plain deferred transactions and never block writers (WAL).
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(url, immediate=True), _sqlite_engine(url, immediate=False)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    kwargs: dict[str, Any] = {
        "pool_size": pool_size,
        "max_overflow": pool_size,
        "connect_args": {"connect_timeout": 10, "application_name": "ledger"},
    }
    writer = create_engine(parsed, **kwargs)
    reader = create_engine(parsed, **kwargs)
    for engine in (writer, reader):
        _ping_when_idle(engine)
    return writer, reader


# A pooled connection back from use within this many seconds is handed out without a ping, unless
# the server has said something on it meanwhile.
PING_AFTER_IDLE_S = 1.0


def _ping_when_idle(engine: Engine) -> None:
    """Pings a pooled connection on checkout only if it sat idle in the pool, or if its socket has
    something to read (pre-ping, rationed).

    `pool_pre_ping` costs a round trip on every checkout: two per group-commit batch of a busy
    writer.  An idle pooled connection has nothing to read unless the server wrote to it: a server
    shutting down (`pg_ctl restart`) sends its sessions a FATAL message and closes them, which makes
    the socket readable at once.  So a connection used a moment ago, with a quiet socket, is handed
    out as it is; a dead one is replaced before anyone uses it (`DisconnectionError` makes the pool
    connect again).
    """

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_connection: Any, record: Any) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        idle_since = record.info.get("idle_since")
        if idle_since is None:  # just connected
            return
        if time.monotonic() - idle_since < PING_AFTER_IDLE_S and not _readable(dbapi_connection):
            return
        try:
            alive = engine.dialect.do_ping(dbapi_connection)
        except Exception:
            alive = False
        if not alive:
            raise exc.DisconnectionError("pooled connection failed its ping")  # the pool reconnects


def _readable(dbapi_connection: Any) -> bool:
    try:
        ready, _, _ = select.select([dbapi_connection.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True  # closed: let the ping find out
    return bool(ready)


def _sqlite_engine(url: str, immediate: bool) -> Engine:
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module so BEGIN is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine
