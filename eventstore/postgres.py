"""The log on PostgreSQL: `ledger_append_events` (migrations/functions/) does the append server-side."""

from __future__ import annotations

import contextlib
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, exc, text
from sqlalchemy.engine import make_url

from eventstore.errors import EventIdConflict, EventStoreError, Fenced, WrongExpectedVersion
from eventstore.recorder import CheckedAppend, Recorder, blob_params, select_columns
from eventstore.records import UNIT_SEPARATOR, AppendResult, RecordedEvent, from_row

# Driver (psycopg) parameter markers: run on the DBAPI cursor, not through SQLAlchemy.  The text
# columns go packed, one text value each (migration 0007: psycopg dumps a list in Python, a string in
# C); the rare blob and fence arrays go as binary arrays (`%(x)b`), which never escape a quote.
_APPEND_EVENTS = (
    "SELECT out_append, out_position, out_stream_version, out_idempotent, out_prev_hash, out_hash, out_refusal "
    "FROM ledger_append_events(%(streams)s::text, %(expected)s::text, %(check_ids)s::text, %(counts)s::text, "
    "%(ids)s::text, %(types)s::text, %(versions)s::text, %(data)s::text, %(metadata)s::text, "
    "%(recorded_at)s::double precision, %(blob_digests)b::text[], %(blobs)b::bytea[], %(notify)s::boolean, "
    "%(fence_streams)b::text[], %(fence_versions)b::bigint[], %(independent)s::boolean)"
)
_BLOB_INSERT = (
    "INSERT INTO blobs (digest, media_type, content, created_at) "
    "VALUES (%(digest)s, %(media_type)s, %(content)s, %(now)s) ON CONFLICT (digest) DO NOTHING"
)
_NOTIFY = "NOTIFY ledger_events"

# A pooled connection back from use within this many seconds is handed out without a ping, unless
# the server has said something on it meanwhile.
PING_AFTER_IDLE_S = 1.0


class PostgresRecorder(Recorder):
    # `::text` hands back the stored JSON text as written (no parse in the driver).
    select_columns = select_columns("data::text AS data", "metadata::text AS metadata")
    positional_mark = "%s"
    supports_notify = True

    def __init__(self, notify: bool = False) -> None:
        # NOTIFY takes a global lock at commit; it is opt-in (see benchmarks/eventstore.py).
        self.notifies = notify
        # The group commit's own session: one write is in flight at a time, so one connection,
        # held in autocommit mode, serves every group write (no pool checkout and check-in, no
        # autocommit switch per write: about 50 us of the client's CPU per write, py-spy).
        self._group_session: Connection | None = None
        # One statement at a time on the session: the group commit's writes (`append_each`) and the
        # journal's batches (`append_committed`, which take a pooled connection when it is busy).
        self._session_lock = threading.Lock()
        self._group_cursor: Any = None  # the session's one cursor, reused (psycopg's dumper caches too)
        self._group_idle_since = 0.0

    def fetch_records(self, conn: Connection, sql: str, params: dict[str, Any]) -> list[RecordedEvent]:
        # Binary results (integers and floats arrive as machine values, not digits to parse) and the
        # driver building each record itself (no intermediate row tuple to allocate, copy and
        # collect): typed replay 212k -> 267k events/s with the larger collector threshold
        # (bulk_reads.py), one run side by side.
        driver = conn.connection.driver_connection
        assert driver is not None
        cursor = driver.cursor(binary=True, row_factory=_record_rows)
        try:
            cursor.execute(sql, params)
            records: list[RecordedEvent] = cursor.fetchall()
            return records
        finally:
            cursor.close()

    def create_engines(
        self, url: str, pool_size: int, read_only: bool = False, create: bool = True
    ) -> tuple[Engine, Engine]:
        parsed = make_url(url)
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        kwargs: dict[str, Any] = {
            "pool_size": pool_size,
            "max_overflow": pool_size,
            "connect_args": {"connect_timeout": 10, "application_name": "ledger"},
        }
        # Every lookup of an append is by a unique key: the writer's sessions plan them as index scans
        # whatever size `events` had when a session first planned them (migration 0006).
        given = parsed.query.get("options")
        given_options = [given] if isinstance(given, str) else list(given or [])
        if read_only:  # the server refuses every write of these sessions, whatever the role may do
            given_options.append("-c default_transaction_read_only=on")
            kwargs["connect_args"]["options"] = " ".join(given_options)
        options = " ".join([*given_options, "-c enable_seqscan=off"])
        writer = create_engine(
            parsed, **{**kwargs, "connect_args": {**kwargs["connect_args"], "options": options}}
        )
        reader = create_engine(parsed, **kwargs)
        for engine in (writer, reader):
            _ping_when_idle(engine)
        return writer, reader

    def param(self, name: str) -> str:
        return f"%({name})s"

    def json_text(self, column: str) -> str:
        return f"{column}::text"

    def json_param(self, name: str) -> str:
        return f"CAST(:{name} AS json)"

    def append(
        self, conn: Connection, appends: list[CheckedAppend], blobs: Sequence[bytes]
    ) -> list[AppendResult]:
        # No NOTIFY here: the caller's transaction (the store's unit of work) NOTIFYs once itself.
        results = self._append(conn, appends, blobs, commit=False)
        return [r for r in results if isinstance(r, AppendResult)]

    def append_committed(
        self, writer: Engine, appends: list[CheckedAppend], blobs: Sequence[bytes]
    ) -> list[AppendResult]:
        """One statement in autocommit mode, blobs included, is the whole transaction: one network
        round trip, and one wait on the socket for a writer thread (each wait gives the GIL away, and
        taking it back from a busy event loop thread cost more than the database's own work).  On the
        group session when it is free (no pool checkout, no autocommit switch per write), else on a
        pooled connection."""
        if self._session_lock.acquire(blocking=False):
            try:
                results = self._on_session(writer, appends, blobs, independent=False)
            finally:
                self._session_lock.release()
        else:
            with writer.connect() as conn:
                results = self._append(conn, appends, blobs, commit=True, notify=self.notifies)
        return [r for r in results if isinstance(r, AppendResult)]

    def append_each(
        self, writer: Engine, appends: list[CheckedAppend]
    ) -> list[AppendResult | EventStoreError]:
        """One statement, autocommit, `p_independent`, on the group commit's session: every append
        written or refused on its own.  Any error drops the session; the next write opens another."""
        with self._session_lock:
            return self._on_session(writer, appends, (), independent=True)

    def _on_session(
        self, writer: Engine, appends: list[CheckedAppend], blobs: Sequence[bytes], independent: bool
    ) -> list[AppendResult | EventStoreError]:
        """One statement on the group session (held in autocommit mode: the statement is its own
        transaction); the caller holds `_session_lock`."""
        conn = self._group_session
        if conn is None or _stale(conn.connection.dbapi_connection, self._group_idle_since, writer):
            self._drop_session()
            conn = writer.connect()
            driver = conn.connection.driver_connection
            assert driver is not None
            driver.autocommit = True
            self._group_session, self._group_cursor = conn, driver.cursor()
        try:
            results = self._append(
                conn,
                appends,
                blobs,
                commit=False,
                independent=independent,
                notify=self.notifies,
                cursor=self._group_cursor,
            )
        except (WrongExpectedVersion, Fenced, EventIdConflict):
            raise  # a refusal: the statement failed alone, the session goes on
        except BaseException:
            self._drop_session()
            raise
        self._group_idle_since = time.monotonic()
        return results

    def close(self) -> None:
        with self._session_lock:
            self._drop_session()

    def _drop_session(self) -> None:
        conn, self._group_session, self._group_cursor = self._group_session, None, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken session is discarded, not returned
                conn.invalidate()
            conn.close()

    def _append(
        self,
        conn: Connection,
        appends: list[CheckedAppend],
        blobs: Sequence[bytes],
        commit: bool,
        independent: bool = False,
        notify: bool = False,
        cursor: Any = None,
    ) -> list[AppendResult | EventStoreError]:
        """One `ledger_append_events` statement: every append and blob, straight on the driver's
        cursor (no SQLAlchemy statement layer: it cost more than the call).  `commit`: the statement
        is its own transaction (autocommit for it); `notify`: it wakes the listening subscribers;
        `cursor`: a cursor of `conn` to run it on (kept open), else one of its own."""
        driver = conn.connection.driver_connection
        assert driver is not None
        params = _events_params(appends)
        unique = {b["digest"]: b["content"] for b in map(blob_params, blobs)}
        # Absent arrays go as NULL (the function reads a NULL array as empty): dumping an array of
        # NULLs or an empty one costs the client as much as a full one.
        params.update(
            blob_digests=list(unique) or None,
            blobs=list(unique.values()) or None,
            notify=notify,
            independent=independent,
        )
        own_cursor = cursor is None
        if own_cursor:
            cursor = driver.cursor()
        try:
            if commit:
                driver.autocommit = True
            cursor.execute(_APPEND_EVENTS, params)
            rows = cursor.fetchall()
        except Exception as error:
            hint = getattr(getattr(error, "diag", None), "message_hint", None)
            index = int(hint) if hint is not None and hint.isdigit() else 0
            if index < len(appends):
                refusal = _refusal(
                    getattr(error, "sqlstate", None),
                    getattr(getattr(error, "diag", None), "message_detail", None),
                    appends[index],
                )
                if refusal is not None:
                    raise refusal from None
            raise
        finally:
            if own_cursor:
                cursor.close()
            if commit:
                try:
                    driver.autocommit = False
                except Exception:  # a broken connection: never back to the pool in autocommit mode
                    conn.invalidate()
        by_append: list[list[tuple[Any, ...]]] = [[] for _ in appends]
        for row in rows:
            by_append[row[0]].append(row)
        results: list[AppendResult | EventStoreError] = []
        for append, out in zip(appends, by_append, strict=True):
            if out[0][6] is not None:
                refusal = _refusal(out[0][6], None if out[0][2] is None else str(out[0][2]), append)
                assert refusal is not None
                results.append(refusal)
                continue
            idempotent = bool(out[0][3])
            results.append(
                AppendResult(
                    positions=[r[1] for r in out],
                    stream_version=out[-1][2],
                    idempotent=idempotent,
                    records=[]
                    if idempotent
                    else [
                        append.written(row, position, version, prev_hash, hash_, params["recorded_at"])
                        for row, (_, position, version, _, prev_hash, hash_, _) in zip(
                            append.rows, out, strict=True
                        )
                    ],
                )
            )
        return results

    def put_blob(self, conn: Connection, content: bytes, media_type: str) -> str:
        params = blob_params(content, media_type)
        cursor = conn.connection.cursor()
        try:
            cursor.execute(_BLOB_INSERT, params)
        finally:
            cursor.close()
        return str(params["digest"])

    def clock(self, conn: Connection) -> float:
        return float(conn.execute(text("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8")).scalar_one())

    def lock_rows_clause(self) -> str:
        return " FOR UPDATE SKIP LOCKED"

    def notify(self, conn: Connection) -> None:
        conn.exec_driver_sql(_NOTIFY)

    def listen(self, reader: Engine) -> Any:
        raw = reader.raw_connection()
        raw.detach()  # it lives as long as its subscription, outside the pool
        conn = raw.driver_connection
        assert conn is not None
        conn.rollback()
        conn.autocommit = True
        conn.execute("LISTEN ledger_events")
        return conn


def _events_params(appends: list[CheckedAppend]) -> dict[str, Any]:
    """`ledger_append_events`' arguments: per append its stream, expected version, id check, event
    count and fence; the events of every append flattened, in order; each text column packed."""
    ids, _, types, versions, data, metadata = zip(*(row for a in appends for row in a.rows), strict=True)
    fenced = any(a.fence is not None for a in appends)
    pack = UNIT_SEPARATOR.join
    return {
        "streams": pack([a.stream_id for a in appends]),
        "expected": pack([str(int(a.expected)) for a in appends]),
        "check_ids": pack(["t" if any(r.chosen_id for r in a.rows) else "f" for a in appends]),
        "counts": pack([str(len(a.rows)) for a in appends]),
        "fence_streams": [None if a.fence is None else a.fence.stream_id for a in appends]
        if fenced
        else None,
        "fence_versions": [None if a.fence is None else a.fence.version for a in appends] if fenced else None,
        "ids": pack(ids),
        "types": pack(types),
        "versions": pack(map(str, versions)),
        "data": pack(data),
        "metadata": pack(metadata),
        # One clock reading for the batch: every row of one transaction records the same instant.
        "recorded_at": appends[0].recorded_at,
    }


def _refusal(state: str | None, detail: str | None, append: CheckedAppend) -> EventStoreError | None:
    """`ledger_append_events`' own refusals (SQLSTATE LE001/LE002/LE003) as the store's typed errors."""
    actual = int(detail) if detail is not None and detail.lstrip("-").isdigit() else -1
    if state == "LE003" and append.fence is not None:
        return Fenced(append.fence.stream_id, append.fence.version, actual, append.stream_id)
    if state == "LE001":
        return WrongExpectedVersion(append.stream_id, int(append.expected), actual)
    if state == "LE002":
        return EventIdConflict(
            f"append to {append.stream_id!r}: event ids already recorded with other content or in another "
            "stream; nothing was written"
        )
    return None


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
        if _stale(dbapi_connection, idle_since, engine):
            raise exc.DisconnectionError("pooled connection failed its ping")  # the pool reconnects


def _stale(dbapi_connection: Any, idle_since: float, engine: Engine) -> bool:
    """Whether a connection last used at `idle_since` fails its ping; pinged only if it sat idle
    or the server has written to it since (see `_ping_when_idle`)."""
    if time.monotonic() - idle_since < PING_AFTER_IDLE_S and not _readable(dbapi_connection):
        return False
    try:
        return not engine.dialect.do_ping(dbapi_connection)
    except Exception:
        return True


def _readable(dbapi_connection: Any) -> bool:
    try:
        ready, _, _ = select.select([dbapi_connection.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True  # closed: let the ping find out
    return bool(ready)


def _record_rows(cursor: object) -> Callable[[Sequence[Any]], RecordedEvent]:
    """psycopg's row factory for `select_columns`: each row becomes a record in C (`from_row`)."""
    return from_row
