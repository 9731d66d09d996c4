"""The SQLite log's appends on the driver's own connection: `ledger_append_events`'s algorithm in one
`BEGIN IMMEDIATE` transaction, with no SQLAlchemy statement per row or per append.

One writer connection of the store's, held for its life (as PostgreSQL's group session is): each
batch reads the log's head once, each stream's head and the chosen ids it names once, decides every
append in Python (its stream's version and hash as the earlier appends of the batch leave them), then
inserts every row of the batch in one `executemany` of one prepared statement, and commits.  An append
refused (a version conflict, a fence, ids recorded with other content) writes nothing: in `each` mode
it answers its own error and the others go on as if it had not been there; otherwise the whole batch
rolls back and raises.  The same decisions as `eventstore.sqlite._append_one` (which the unit of work's
transactions still use), read from the log and from the rows of the batch not yet written.

Commit order is position order: the write lock is taken (`BEGIN IMMEDIATE`) before the head is read,
and `synchronous=FULL` makes the commit durable before it returns (the connection's pragmas are the
engine's: it is checked out of the writer's pool)."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

from sqlalchemy import Engine

from eventstore.errors import EventIdConflict, EventStoreError, Fenced, WrongExpectedVersion
from eventstore.recorder import CheckedAppend, RenderedEvent, blob_params, select_columns
from eventstore.records import GENESIS_HASH, AppendResult, ExpectedVersion, RecordedEvent, chain_hash

_INSERT = (
    f"INSERT INTO events ({select_columns('data', 'metadata')}) "
    f"VALUES ({', '.join('?' * len(RecordedEvent._fields))})"
)
_BLOB_INSERT = (
    "INSERT INTO blobs (digest, media_type, content, created_at) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (digest) DO NOTHING"
)
_HEAD = "SELECT COALESCE(MAX(position), 0) FROM events"
_STREAM_HEAD = (
    "SELECT stream_version, hash FROM events WHERE stream_id = ? ORDER BY stream_version DESC LIMIT 1"
)
_IDS = "SELECT event_id, position, stream_id, stream_version, type, data FROM events WHERE event_id IN ({})"
# Ids asked for in one query at most (SQLite's own limit on parameters is far above it).
_IDS_PER_QUERY = 500


# Each step of a batch, named as it is reached: None, or a test's gate (tests/eventstore/test_sqlite_writer.py
# stops a writer at each and SIGKILLs it there).
STEPS: Final = ("begun", "blobs_written", "decided", "rows_written", "committed")
at_step: Callable[[str], None] | None = None


def _reached(step: str) -> None:
    if at_step is not None:
        at_step(step)


class SqliteWriter:
    """The writer connection and the batches written on it; thread-safe (one batch at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fairy: Any = None  # the pooled connection, checked out for the writer's life
        self._pid = 0

    def write(
        self, engine: Engine, appends: Sequence[CheckedAppend], blobs: Sequence[bytes], each: bool
    ) -> list[AppendResult | EventStoreError] | None:
        """Every append of the batch (and every blob) in one committed transaction; None when the
        connection is busy with another batch (the caller writes through the pool instead)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return _write_batch(self._connection(engine), appends, blobs, each)
        finally:
            self._lock.release()

    def _connection(self, engine: Engine) -> sqlite3.Connection:
        if self._fairy is None or self._pid != os.getpid():  # a forked child opens its own
            self._fairy = engine.raw_connection()
            self._pid = os.getpid()
        driver = self._fairy.driver_connection
        assert isinstance(driver, sqlite3.Connection)
        return driver

    def close(self) -> None:
        with self._lock:
            if self._fairy is not None and self._pid == os.getpid():
                self._fairy.close()
            self._fairy = None


def _write_batch(
    conn: sqlite3.Connection, appends: Sequence[CheckedAppend], blobs: Sequence[bytes], each: bool
) -> list[AppendResult | EventStoreError]:
    cursor = conn.cursor()
    cursor.execute("BEGIN IMMEDIATE")
    try:
        _reached("begun")
        if blobs:
            params = [blob_params(blob, "application/json") for blob in blobs]
            cursor.executemany(
                _BLOB_INSERT, [(p["digest"], p["media_type"], p["content"], p["now"]) for p in params]
            )
        _reached("blobs_written")
        batch = _Batch(cursor)
        results: list[AppendResult | EventStoreError] = []
        for append in appends:
            try:
                results.append(batch.decide(append))
            except (WrongExpectedVersion, Fenced, EventIdConflict) as refusal:
                if not each:
                    raise
                results.append(refusal)
        _reached("decided")
        if batch.records:
            cursor.executemany(_INSERT, batch.records)
        _reached("rows_written")
        cursor.execute("COMMIT")
        _reached("committed")
    except BaseException:
        if conn.in_transaction:
            conn.rollback()
        raise
    finally:
        cursor.close()
    return results


class _Batch:
    """What the log holds as the batch's appends are decided, its rows not yet written."""

    def __init__(self, cursor: sqlite3.Cursor) -> None:
        self.cursor = cursor
        self.head = int(cursor.execute(_HEAD).fetchone()[0])
        self.streams: dict[str, tuple[int, str]] = {}
        # Rows decided in this batch by event id, as `_IDS` reads a recorded one.
        self.pending: dict[str, tuple[Any, ...]] = {}
        self.records: list[RecordedEvent] = []

    def stream_head(self, stream_id: str) -> tuple[int, str]:
        found = self.streams.get(stream_id)
        if found is None:
            row = self.cursor.execute(_STREAM_HEAD, (stream_id,)).fetchone()
            found = (int(row[0]), str(row[1])) if row else (-1, GENESIS_HASH)
            self.streams[stream_id] = found
        return found

    def recorded(self, event_ids: list[str]) -> dict[str, tuple[Any, ...]]:
        found = {e: self.pending[e] for e in event_ids if e in self.pending}
        wanted = [e for e in event_ids if e not in found]
        for start in range(0, len(wanted), _IDS_PER_QUERY):
            part = wanted[start : start + _IDS_PER_QUERY]
            rows = self.cursor.execute(_IDS.format(", ".join("?" * len(part))), part).fetchall()
            found.update((str(r[0]), tuple(r)) for r in rows)
        return found

    def decide(self, append: CheckedAppend) -> AppendResult:
        """`eventstore.sqlite._append_one`'s decision for `append`, its rows kept to write."""
        stream_id, rows, expected, fence, recorded_at = append
        version, prev_hash = self.stream_head(stream_id)
        chosen = [r.event_id for r in rows if r.chosen_id]
        if chosen:
            existing = self.recorded(chosen)
            if existing:
                return idempotent(stream_id, rows, existing)
        if fence is not None:
            actual = self.stream_head(fence.stream_id)[0]
            if actual != fence.version:
                raise Fenced(fence.stream_id, fence.version, actual, stream_id)
        if (expected == ExpectedVersion.NO_STREAM and version != -1) or (
            expected >= 0 and version != expected
        ):
            raise WrongExpectedVersion(stream_id, int(expected), version)
        if len({r.event_id for r in rows}) < len(rows):
            # Where the pool path's insert of this append fails, before any later append is decided.
            raise sqlite3.IntegrityError("UNIQUE constraint failed: events.event_id")
        written = []
        head = self.head
        for row in rows:
            version += 1
            head += 1
            hash_ = chain_hash(
                prev_hash,
                stream_id,
                version,
                row.event_id,
                row.type,
                row.schema_version,
                row.data,
                row.metadata,
            )
            written.append(append.written(row, head, version, prev_hash, hash_, recorded_at))
            prev_hash = hash_
        self.head = head
        self.streams[stream_id] = (version, prev_hash)
        for record in written:
            self.pending[record.event_id] = (
                record.event_id,
                record.position,
                record.stream_id,
                record.stream_version,
                record.type,
                record.data_json,
            )
        self.records += written
        return AppendResult(positions=[r.position for r in written], stream_version=version, records=written)


def idempotent(
    stream_id: str, rows: list[RenderedEvent], existing: dict[str, tuple[Any, ...]]
) -> AppendResult:
    """Same ids and same content: the original positions, nothing written.  Anything else: an error."""
    originals = []
    for row in rows:
        found = existing.get(row.event_id)
        if found is None:
            raise EventIdConflict(
                f"append to {stream_id!r} mixes already-recorded and new event ids; nothing was written"
            )
        _, position, stream, version, type_, data = found
        if stream != stream_id or type_ != row.type or not _same_json(data, row.data):
            raise EventIdConflict(
                f"event id {row.event_id} was already recorded at position {position} with other content; "
                "nothing was written"
            )
        originals.append((int(position), int(version)))
    return AppendResult(positions=[p for p, _ in originals], stream_version=originals[-1][1], idempotent=True)


def _same_json(stored: str, new: str) -> bool:
    return bool(stored == new or json.loads(stored) == json.loads(new))
