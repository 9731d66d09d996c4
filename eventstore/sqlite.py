"""The log on SQLite: the append algorithm of `ledger_append_events`, in Python, under `BEGIN IMMEDIATE`."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url

from eventstore.errors import (
    BadDatabaseUrl,
    EventIdConflict,
    EventStoreError,
    Fenced,
    NoSuchLog,
    ReadOnlyLog,
    WrongExpectedVersion,
)
from eventstore.recorder import CheckedAppend, Recorder, blob_params, select_columns
from eventstore.records import GENESIS_HASH, AppendResult, ExpectedVersion, RecordedEvent, chain_hash
from eventstore.sqlite_writer import SqliteWriter, idempotent

# Records are inserted as they are: their fields are the columns, in this order.
_INSERT = (
    f"INSERT INTO events ({select_columns('data', 'metadata')}) "
    f"VALUES ({', '.join('?' * len(RecordedEvent._fields))})"
)
_BLOB_INSERT = text(
    "INSERT INTO blobs (digest, media_type, content, created_at) VALUES (:digest, :media_type, :content, :now) "
    "ON CONFLICT (digest) DO NOTHING"
)
_HEAD = text("SELECT COALESCE(MAX(position), 0) FROM events")
_STREAM_HEAD = text(
    "SELECT stream_version, hash FROM events WHERE stream_id = :s ORDER BY stream_version DESC LIMIT 1"
)


class SqliteRecorder(Recorder):
    select_columns = select_columns("data", "metadata")
    positional_mark = "?"

    def __init__(self) -> None:
        # Batches written on the driver's own connection (eventstore/sqlite_writer.py).
        self._batches = SqliteWriter()

    def create_engines(
        self, url: str, pool_size: int, read_only: bool = False, create: bool = True
    ) -> tuple[Engine, Engine]:
        """The writer's transactions start with `BEGIN IMMEDIATE` so that the write lock is taken
        before the head is read (commit order = position order); readers use plain deferred
        transactions and never block writers (WAL).  Read-only, both open the file as SQLite's
        `mode=ro` (a missing file is `NoSuchLog`, never created)."""
        if not create and not read_only:
            _log_file(url)
        if not read_only:
            _check_writable(url)
        if read_only:
            url = _read_only_url(url)
            return _engine(url, immediate=False, read_only=True), _engine(
                url, immediate=False, read_only=True
            )
        return _engine(url, immediate=True), _engine(url, immediate=False)

    def param(self, name: str) -> str:
        return f":{name}"

    def json_text(self, column: str) -> str:
        return column

    def json_param(self, name: str) -> str:
        return f":{name}"

    def append(
        self, conn: Connection, appends: list[CheckedAppend], blobs: Sequence[bytes]
    ) -> list[AppendResult]:
        for blob in blobs:
            self.put_blob(conn, blob, "application/json")
        return [_append_one(conn, append) for append in appends]

    def append_committed(
        self, writer: Engine, appends: list[CheckedAppend], blobs: Sequence[bytes]
    ) -> list[AppendResult]:
        """On the writer connection, one statement for every row (`SqliteWriter`); through the pool
        when that connection is busy with another batch."""
        done = self._batches.write(writer, appends, blobs, each=False)
        if done is not None:
            return [r for r in done if isinstance(r, AppendResult)]  # a refusal raised
        with writer.begin() as conn:
            return self.append(conn, appends, blobs)

    def close(self) -> None:
        """Gives the writer connection back (every other write checks one out of the pool)."""
        self._batches.close()

    def append_each(
        self, writer: Engine, appends: list[CheckedAppend]
    ) -> list[AppendResult | EventStoreError]:
        """One `BEGIN IMMEDIATE` transaction, each append written or refused on its own: on the writer
        connection (`SqliteWriter`), else through the pool, each append in a savepoint it is rolled
        back to if refused."""
        done = self._batches.write(writer, appends, (), each=True)
        if done is not None:
            return done
        results: list[AppendResult | EventStoreError] = []
        with writer.begin() as conn:
            for append in appends:
                savepoint = conn.begin_nested()
                try:
                    results.append(_append_one(conn, append))
                except (WrongExpectedVersion, Fenced, EventIdConflict) as refusal:
                    savepoint.rollback()
                    results.append(refusal)
                else:
                    savepoint.commit()
        return results

    def put_blob(self, conn: Connection, content: bytes, media_type: str) -> str:
        params = blob_params(content, media_type)
        conn.execute(_BLOB_INSERT, params)
        return str(params["digest"])

    def clock(self, conn: Connection) -> float:
        return time.time()  # one host shares a SQLite file

    def lock_rows_clause(self) -> str:
        return ""  # `BEGIN IMMEDIATE` serialises writers


def _append_one(conn: Connection, append: CheckedAppend) -> AppendResult:
    """The same algorithm as `ledger_append_events`: head, stream head, idempotency, fence, expected
    version, hash chain, insert.  The writer's `BEGIN IMMEDIATE` is the append lock."""
    stream_id, rows, expected, fence, recorded_at = append
    head = int(conn.execute(_HEAD).scalar() or 0)
    last = conn.execute(_STREAM_HEAD, {"s": stream_id}).first()
    version, prev_hash = (int(last[0]), str(last[1])) if last else (-1, GENESIS_HASH)

    chosen = [r.event_id for r in rows if r.chosen_id]
    if chosen:
        existing = _existing(conn, chosen)
        if existing:
            return idempotent(stream_id, rows, existing)

    if fence is not None:
        fence_head = conn.execute(_STREAM_HEAD, {"s": fence.stream_id}).first()
        actual = -1 if fence_head is None else int(fence_head[0])
        if actual != fence.version:
            raise Fenced(fence.stream_id, fence.version, actual, stream_id)

    if (expected == ExpectedVersion.NO_STREAM and version != -1) or (expected >= 0 and version != expected):
        raise WrongExpectedVersion(stream_id, int(expected), version)

    records = []
    for row in rows:
        version += 1
        head += 1
        hash_ = chain_hash(
            prev_hash, stream_id, version, row.event_id, row.type, row.schema_version, row.data, row.metadata
        )
        records.append(append.written(row, head, version, prev_hash, hash_, recorded_at))
        prev_hash = hash_
    conn.exec_driver_sql(_INSERT, records)
    return AppendResult(positions=[r.position for r in records], stream_version=version, records=records)


def _existing(conn: Connection, event_ids: list[str]) -> dict[str, tuple[Any, ...]]:
    marks = ", ".join(f":e{i}" for i in range(len(event_ids)))
    rows = conn.execute(
        text(
            f"SELECT event_id, position, stream_id, stream_version, type, data "
            f"FROM events WHERE event_id IN ({marks})"
        ),
        {f"e{i}": e for i, e in enumerate(event_ids)},
    ).all()
    return {str(r[0]): tuple(r) for r in rows}


def _read_only_url(url: str) -> str:
    """`url` as a SQLite URI opened read-only; `NoSuchLog` when its file does not exist.

    A file nobody here may write, in a folder nobody here may write, with no write-ahead log beside
    it, cannot change while it is read: it is opened `immutable` (SQLite then needs no `-shm` file,
    which it could not create there)."""
    parsed = make_url(url)
    path = _log_file(url).absolute()
    query = {"mode": "ro", "uri": "true"}
    wal = path.with_name(path.name + "-wal")
    if not os.access(path, os.W_OK) and not os.access(path.parent, os.W_OK) and not wal.exists():
        query["immutable"] = "1"
    return parsed.set(database=f"file:{quote(str(path))}", query=query).render_as_string(hide_password=False)


def _check_writable(url: str) -> None:
    """`ReadOnlyLog` in one line when this process cannot write the log at `url`: its file, or its
    folder (where SQLite makes the `-wal` and `-shm` files, unless both are there to write).  SQLite
    opens a read-only file read-only without a word and refuses the first write; taken for an outage,
    that was waited out (30 s) before anything said why.  `os.access` answers for this process as it
    is, root included: a read-only mount is read-only to root too."""
    database = make_url(url).database
    if not database:
        return
    path = Path(database).absolute()
    try:
        sidecars = [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm")]
        if path.exists() and not os.access(path, os.W_OK):
            what = f"the file {path}"
        elif path.parent.is_dir() and not os.access(path.parent, os.W_OK):
            if all(s.exists() and os.access(s, os.W_OK) for s in sidecars):
                return
            what = f"its folder {path.parent}"
        else:
            return
    except OSError:  # a path the file system cannot hold: opening it says so
        return
    raise ReadOnlyLog(
        f"database sqlite:///{path} cannot be written here ({what} is read-only for this process; not "
        "retried): the commands that append (simulate, the workers, debt drop, payloads, projections "
        "run) need a log they can write; the read-only ones (audit, status, show, snapshot, tail, debt "
        "list) open it as it is"
    )


def _log_file(url: str) -> Path:
    """The file of the log at `url`; `NoSuchLog` when there is none (it is never made here)."""
    database = make_url(url).database
    path = Path(database or "")
    try:
        there = bool(database) and path.is_file()
    except OSError as exc:  # a name the file system cannot hold (too long): no log there either
        raise NoSuchLog(f"no log at {path}: {exc.strerror}; check --db / $LEDGER_DB") from None
    if not there:
        raise NoSuchLog(
            f"no log at {path.absolute() if database else '(no path)'}: check --db / $LEDGER_DB "
            "(only `ledger db upgrade`, `ledger simulate` and the workers make a new log)"
        )
    return path


# `PRAGMA synchronous` of a log opened for writing, from the URL's `?synchronous=` (docs/operations.md,
# What a power cut can lose).  In WAL mode FULL syncs the WAL at every commit, so no append that
# returned is lost; NORMAL syncs it only at checkpoints (the last appends can be lost, the file stays
# whole); EXTRA is FULL in WAL mode.  OFF can leave the file corrupt, and is refused.
SYNCHRONOUS: Final = ("full", "normal", "extra")


def split_synchronous(url: str) -> tuple[str, str]:
    """`url` without its `synchronous` query, and the setting it names (`full` when none);
    BadDatabaseUrl for any other value."""
    parsed = make_url(url)
    value = parsed.query.get("synchronous", SYNCHRONOUS[0])
    if not isinstance(value, str) or value.lower() not in SYNCHRONOUS:
        raise BadDatabaseUrl(
            f"synchronous={value!r} is not a setting of the log: sqlite:///PATH?synchronous=full (the "
            "default: no append that returned is lost to a power cut), normal (the last appends can be), "
            "or extra (as full, in WAL mode)"
        )
    return parsed.difference_update_query(["synchronous"]).render_as_string(
        hide_password=False
    ), value.lower()


def _engine(url: str, immediate: bool, read_only: bool = False) -> Engine:
    url, synchronous = split_synchronous(url)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from the sqlite3 module so BEGIN is ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if not read_only:  # both are writes to the file (a read-only file keeps the mode it has)
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA synchronous={synchronous.upper()}")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine
