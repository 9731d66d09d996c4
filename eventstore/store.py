"""The event store: append, read, subscribe and verify, on SQLite or PostgreSQL."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from eventstore.backends import Backend, mask_url
from eventstore.errors import (
    AppendOnlyViolation,
    DatabaseUnavailable,
    EventIdConflict,
    EventStoreError,
    Fenced,
    InvalidEvent,
    UnknownEventType,
    UnknownSchemaVersion,
    WrongExpectedVersion,
)
from eventstore.events import EVENT_TYPES, Event
from eventstore.records import (
    GENESIS_HASH,
    AppendResult,
    ExpectedVersion,
    Fence,
    NewEvent,
    RecordedEvent,
    canonical,
    chain_hash,
    from_row,
)
from protocol.digests import sha256_digest

if TYPE_CHECKING:
    from eventstore.subscription import Subscription

# One append of a batch: (stream, events, expected version) and optionally its fence.
Append = (
    tuple[str, Sequence[Event | NewEvent], int] | tuple[str, Sequence[Event | NewEvent], int, Fence | None]
)
# An append checked and rendered: (stream, rows, expected version, fence).
_Checked = tuple[str, list[dict[str, Any]], int, Fence | None]

_WRITER = {"host": socket.gethostname(), "pid": os.getpid()}
_STREAM_ID_MAX = 400


@dataclass(frozen=True, slots=True)
class ChainBreak:
    position: int
    reason: str


class EventStore:
    """An append-only log of events.  Thread-safe; one instance per process is plenty."""

    def __init__(
        self, url: str, writer: Engine, reader: Engine, backend: Backend, notify: bool = False
    ) -> None:
        self.url = mask_url(url)
        self._writer = writer
        self._reader = reader
        self.backend = backend
        # NOTIFY takes a global lock at commit; it is opt-in (see benchmarks/eventstore.py).
        self.notify = notify and backend.name == "postgresql"

    # --- writing ----------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[UnitOfWork]:
        """One database transaction holding appends, blobs and subscriber positions together."""
        with self._database_errors(), self._writer.begin() as conn:
            yield UnitOfWork(self, conn)

    def append(
        self,
        stream_id: str,
        events: Sequence[Event | NewEvent],
        expected_version: int = ExpectedVersion.ANY,
        metadata: dict[str, Any] | None = None,
        fence: Fence | None = None,
    ) -> AppendResult:
        with self.transaction() as tx:
            return tx.append(stream_id, events, expected_version, metadata, fence)

    def append_batch(
        self, appends: Sequence[Append], blobs: Sequence[bytes] = (), fence: Fence | None = None
    ) -> list[AppendResult]:
        """`UnitOfWork.append_batch` in a transaction of its own, committed.

        On PostgreSQL one statement in autocommit mode, blobs included, is the whole transaction: one
        network round trip, and one wait on the socket for a writer thread (each wait gives the GIL
        away, and taking it back from a busy event loop thread cost more than the database's own
        work).  Any refusal rolls the whole batch back and raises as `append` would.
        """
        if self.backend.name != "postgresql":
            with self.transaction() as tx:
                return tx.append_batch(appends, blobs, fence)
        checked = _checked_batch(appends, fence)
        with self._database_errors(), self._writer.connect() as conn:
            return UnitOfWork(self, conn)._append_in_postgres(checked, blobs, commit=True)

    def put_blob(self, content: bytes, media_type: str = "application/json") -> str:
        with self.transaction() as tx:
            return tx.put_blob(content, media_type)

    def save_position(self, name: str, position: int) -> None:
        with self.transaction() as tx:
            tx.save_position(name, position)

    # --- reading ----------------------------------------------------------

    def head(self) -> int:
        """The highest position a reader may safely read up to (every position below it is committed)."""
        return int(self._scalar("SELECT COALESCE(MAX(position), 0) FROM events", {}) or 0)

    def stream_version(self, stream_id: str) -> int:
        value = self._scalar("SELECT MAX(stream_version) FROM events WHERE stream_id = :s", {"s": stream_id})
        return -1 if value is None else int(value)

    def read_all(
        self,
        from_position: int = 0,
        to_position: int | None = None,
        types: Collection[str] | None = None,
        batch_size: int = 5000,
    ) -> Iterator[RecordedEvent]:
        """Events with `from_position < position <= to_position`, in position order, gap-free."""
        p = self.backend.param.format
        where = f"position > {p('after')}"
        params: dict[str, Any] = {"limit": batch_size}
        if to_position is not None:
            where += f" AND position <= {p('to')}"
            params["to"] = to_position
        if types is not None:
            names = sorted(types)
            where += " AND type IN (" + ", ".join(p(f"t{i}") for i in range(len(names))) + ")"
            params.update({f"t{i}": n for i, n in enumerate(names)})
        query = f"SELECT {self.backend.select_columns} FROM events WHERE {where} ORDER BY position LIMIT {p('limit')}"
        after = from_position
        make = from_row
        while True:
            rows = self._fetch(query, {**params, "after": after})
            yield from map(make, rows)
            if len(rows) < batch_size:
                return
            after = rows[-1][0]

    def read_stream(self, stream_id: str, from_version: int = 0) -> Iterator[RecordedEvent]:
        query = text(
            f"SELECT {self.backend.select_columns} FROM events "
            "WHERE stream_id = :s AND stream_version >= :v ORDER BY stream_version"
        )
        with self._database_errors(), self._reader.connect() as conn:
            rows = conn.execute(query, {"s": stream_id, "v": from_version}).all()
        return iter([RecordedEvent(*row) for row in rows])

    def get_blob(self, digest: str) -> bytes | None:
        value = self._scalar("SELECT content FROM blobs WHERE digest = :d", {"d": digest})
        return None if value is None else bytes(value)

    def subscriber_position(self, name: str) -> int:
        value = self._scalar("SELECT position FROM subscriptions WHERE name = :n", {"n": name})
        return 0 if value is None else int(value)

    def subscribe(
        self, name: str, from_position: int | None = None, poll_interval_s: float = 0.05
    ) -> Subscription:
        """A catch-up subscription that then follows live appends.

        It starts after `from_position`, or after the subscriber's stored position
        when none is given.  Delivery is at least once: a subscriber stores its
        position with `Subscription.commit` (in its own transaction when it writes).
        """
        from eventstore.subscription import Subscription

        start = self.subscriber_position(name) if from_position is None else from_position
        return Subscription(self, name, start, poll_interval_s)

    # --- verifying --------------------------------------------------------

    def chain_breaks(self, to_position: int | None = None) -> Iterator[ChainBreak]:
        """Every row whose hash, stream predecessor or position does not verify."""
        last: dict[str, tuple[int, str]] = {}
        expected_position = 1
        for ev in self.read_all(0, to_position):
            if ev.position != expected_position:
                yield ChainBreak(ev.position, f"positions {expected_position}..{ev.position - 1} are missing")
            expected_position = ev.position + 1
            version, prev = last.get(ev.stream_id, (-1, GENESIS_HASH))
            if ev.stream_version != version + 1:
                yield ChainBreak(
                    ev.position,
                    f"stream {ev.stream_id!r} jumps from version {version} to {ev.stream_version}",
                )
            elif ev.prev_hash != prev:
                yield ChainBreak(
                    ev.position, f"prev_hash does not match the hash of {ev.stream_id!r} v{version}"
                )
            if ev.hash != ev.expected_hash():
                yield ChainBreak(ev.position, "hash does not match the row's content")
            last[ev.stream_id] = (ev.stream_version, ev.hash)

    def verify_chain(self) -> int | None:
        """None, or the first position whose hash does not verify."""
        return next((b.position for b in self.chain_breaks()), None)

    def listen_connection(self) -> Any:
        """A dedicated driver connection LISTENing for appends (PostgreSQL with `notify=True`)."""
        raw = self._reader.raw_connection()
        raw.detach()  # it lives as long as its subscription, outside the pool
        conn = raw.driver_connection
        assert conn is not None
        conn.rollback()
        conn.autocommit = True
        conn.execute("LISTEN ledger_events")
        return conn

    def close(self) -> None:
        self._writer.dispose()
        self._reader.dispose()

    # --- internals --------------------------------------------------------

    def _fetch(self, sql: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Rows straight from the driver's cursor: replay skips SQLAlchemy's row layer (3x faster)."""
        with self._database_errors(), self._reader.connect() as conn:
            cursor = conn.connection.cursor()
            try:
                cursor.execute(sql, params)
                return list(cursor.fetchall())
            finally:
                cursor.close()

    def _scalar(self, sql: str, params: dict[str, Any]) -> Any:
        with self._database_errors(), self._reader.connect() as conn:
            return conn.execute(text(sql), params).scalar()

    @contextmanager
    def _database_errors(self) -> Iterator[None]:
        try:
            yield
        except EventStoreError:
            raise
        except IntegrityError as exc:
            raise EventStoreError(f"integrity error, nothing was written: {exc.orig}") from None
        except OperationalError as exc:
            if "append-only" in str(exc.orig):
                raise AppendOnlyViolation(str(exc.orig)) from None
            raise DatabaseUnavailable(f"database {self.url} unavailable: {_first_line(exc.orig)}") from None
        except DBAPIError as exc:
            if "append-only" in str(exc.orig):
                raise AppendOnlyViolation(str(exc.orig)) from None
            if exc.connection_invalidated:
                raise DatabaseUnavailable(f"database {self.url} went away: {_first_line(exc.orig)}") from None
            raise EventStoreError(f"database error, nothing was written: {_first_line(exc.orig)}") from None
        except Exception as exc:  # raised by the driver itself on the raw read and append paths
            dbapi = self._reader.dialect.dbapi
            if dbapi is not None and isinstance(exc, dbapi.Error) and "append-only" in str(exc):
                raise AppendOnlyViolation(_first_line(exc)) from None
            if dbapi is not None and isinstance(exc, dbapi.IntegrityError):
                raise EventStoreError(f"integrity error, nothing was written: {_first_line(exc)}") from None
            if dbapi is not None and isinstance(exc, dbapi.OperationalError | dbapi.InterfaceError):
                raise DatabaseUnavailable(f"database {self.url} unavailable: {_first_line(exc)}") from None
            if dbapi is not None and isinstance(exc, dbapi.Error):
                raise EventStoreError(f"database error: {_first_line(exc)}") from None
            raise


class UnitOfWork:
    """The writes of one transaction.  Appends take the log-wide append lock on first use."""

    def __init__(self, store: EventStore, conn: Connection) -> None:
        self.store = store
        self.connection = conn
        self._notified = False

    def append(
        self,
        stream_id: str,
        events: Sequence[Event | NewEvent],
        expected_version: int = ExpectedVersion.ANY,
        metadata: dict[str, Any] | None = None,
        fence: Fence | None = None,
    ) -> AppendResult:
        """Appends `events` to `stream_id` if it is at `expected_version` and `fence` (if any) holds."""
        rows = _checked(stream_id, events, expected_version, metadata)
        if self.store.backend.name == "postgresql":
            [result] = self._append_in_postgres([(stream_id, rows, expected_version, fence)], ())
        else:
            result = self._append_in_python(stream_id, rows, expected_version, fence)
        self._notify([result])
        return result

    def append_batch(
        self, appends: Sequence[Append], blobs: Sequence[bytes] = (), fence: Fence | None = None
    ) -> list[AppendResult]:
        """Several appends `(stream_id, events, expected_version[, fence])` and blobs, in order, in this
        transaction.  `fence` is the fence of every append that names none of its own.

        The same as `put_blob` for each blob then `append` for each append, but on PostgreSQL one
        `ledger_append_events` statement: a single network round trip however many streams it writes.  Appends to the same
        stream chain (the second expects the version the first leaves).  A refused append raises as
        `append` would, and the transaction is then unusable (roll it back).
        """
        checked = _checked_batch(appends, fence)
        if self.store.backend.name == "postgresql":
            results = self._append_in_postgres(checked, blobs)
        else:
            for blob in blobs:
                self.put_blob(blob)
            results = [self._append_in_python(*append) for append in checked]
        self._notify(results)
        return results

    def _notify(self, results: list[AppendResult]) -> None:
        if self.store.notify and not self._notified and not all(r.idempotent for r in results):
            self.connection.exec_driver_sql("NOTIFY ledger_events")
            self._notified = True

    def _append_in_postgres(
        self,
        appends: list[_Checked],
        blobs: Sequence[bytes],
        commit: bool = False,
    ) -> list[AppendResult]:
        """One `ledger_append_events` statement (migration 0004): every append and blob, binary arrays.

        Straight on the driver's cursor (no SQLAlchemy statement layer: it cost more than the call).
        With `commit` the connection is in autocommit mode for the statement, which is then its own
        transaction: the write and its commit are one network round trip.
        """
        driver = self.connection.connection.driver_connection
        assert driver is not None
        params = _events_params(appends)
        unique = {_digest(b): b for b in blobs}
        # A transaction of the caller NOTIFYs once, at its first append (`_notify`).
        params.update(
            blob_digests=list(unique), blobs=list(unique.values()), notify=commit and self.store.notify
        )
        cursor = driver.cursor()
        try:
            if commit:
                driver.autocommit = True
            cursor.execute(_PG_APPEND_EVENTS, params)
            rows = cursor.fetchall()
        except Exception as exc:
            hint = getattr(getattr(exc, "diag", None), "message_hint", None)
            index = int(hint) if hint is not None and hint.isdigit() else 0
            if index < len(appends):
                stream, _, expected, fence = appends[index]
                _raise_refusal(exc, stream, expected, fence)
            raise
        finally:
            cursor.close()
            if commit:
                try:
                    driver.autocommit = False
                except Exception:  # a broken connection: never back to the pool in autocommit mode
                    self.connection.invalidate()
        by_append: list[list[tuple[Any, ...]]] = [[] for _ in appends]
        for row in rows:
            by_append[row[0]].append(row)
        results = []
        for (stream, events, _, _), out in zip(appends, by_append, strict=True):
            idempotent = bool(out[0][3])
            if not idempotent:
                for row, (_, position, version, _, prev_hash, hash_) in zip(events, out, strict=True):
                    row.update(
                        position=position,
                        stream_id=stream,
                        stream_version=version,
                        recorded_at=params["recorded_at"],
                        prev_hash=prev_hash,
                        hash=hash_,
                    )
            results.append(
                AppendResult(
                    positions=[r[1] for r in out],
                    stream_version=out[-1][2],
                    idempotent=idempotent,
                    records=[] if idempotent else [_record(row) for row in events],
                )
            )
        return results

    def _append_in_python(
        self, stream_id: str, rows: list[dict[str, Any]], expected: int, fence: Fence | None = None
    ) -> AppendResult:
        """The same algorithm as `ledger_append_events`, for SQLite (whose `BEGIN IMMEDIATE` is the append lock)."""
        conn = self.connection
        head = int(conn.execute(text("SELECT COALESCE(MAX(position), 0) FROM events")).scalar() or 0)
        last = conn.execute(
            text(
                "SELECT stream_version, hash FROM events WHERE stream_id = :s ORDER BY stream_version DESC LIMIT 1"
            ),
            {"s": stream_id},
        ).first()
        version, prev_hash = (int(last[0]), str(last[1])) if last else (-1, GENESIS_HASH)

        chosen = [r["event_id"] for r in rows if r["chosen_id"]]
        if chosen:
            existing = _existing(conn, chosen)
            if existing:
                return _idempotent(stream_id, rows, existing)

        if fence is not None:
            actual = _version_of(conn, fence.stream_id)
            if actual != fence.version:
                raise Fenced(fence.stream_id, fence.version, actual, stream_id)

        if (expected == ExpectedVersion.NO_STREAM and version != -1) or (
            expected >= 0 and version != expected
        ):
            raise WrongExpectedVersion(stream_id, int(expected), version)

        positions = []
        for row in rows:
            version += 1
            head += 1
            row.update(position=head, stream_id=stream_id, stream_version=version, prev_hash=prev_hash)
            row["hash"] = prev_hash = chain_hash(
                prev_hash,
                stream_id,
                version,
                row["event_id"],
                row["type"],
                row["schema_version"],
                row["data"],
                row["metadata"],
            )
            positions.append(head)
        conn.execute(_SQLITE_INSERT, rows)
        return AppendResult(
            positions=positions,
            stream_version=version,
            records=[_record(row) for row in rows],
        )

    def put_blob(self, content: bytes, media_type: str = "application/json") -> str:
        """Stores content under its sha256; storing the same content twice is a no-op."""
        params = _blob_params(content, media_type)
        digest = str(params["digest"])
        if self.store.backend.name == "postgresql":
            cursor = self.connection.connection.cursor()
            try:
                cursor.execute(_PG_BLOB_INSERT, params)
            finally:
                cursor.close()
        else:
            self.connection.execute(text(self.store.backend.blob_insert), params)
        return digest

    def save_position(self, name: str, position: int) -> None:
        self.connection.execute(
            text(self.store.backend.position_upsert), {"name": name, "position": position, "now": time.time()}
        )


def _checked(
    stream_id: str, events: Sequence[Event | NewEvent], expected_version: int, metadata: dict[str, Any] | None
) -> list[dict[str, Any]]:
    if not events:
        raise ValueError("append needs at least one event")
    if not stream_id or len(stream_id) > _STREAM_ID_MAX or "\x1f" in stream_id:
        raise ValueError(f"invalid stream id {stream_id!r}")
    if expected_version < ExpectedVersion.ANY:
        raise ValueError(f"invalid expected version {expected_version}")
    try:  # one rendering for every event of the append that brings no metadata of its own
        shared = canonical({**_WRITER, "wall_time": time.time(), **(metadata or {})})
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(f"metadata is not JSON-serialisable: {exc}") from None
    return [_prepare(e, metadata, shared) for e in events]


def _checked_batch(appends: Sequence[Append], fence: Fence | None) -> list[_Checked]:
    checked: list[_Checked] = []
    for append in appends:
        stream, events, expected = append[:3]
        own = append[3] if len(append) > 3 else fence
        checked.append((stream, _checked(stream, events, expected, None), expected, own))
    return checked


def _record(row: dict[str, Any]) -> RecordedEvent:
    """A row as written (its columns filled in by the append) as the log hands it back."""
    return RecordedEvent(
        row["position"],
        row["stream_id"],
        row["stream_version"],
        row["event_id"],
        row["type"],
        row["schema_version"],
        row["data"],
        row["metadata"],
        row["recorded_at"],
        row["prev_hash"],
        row["hash"],
    )


def _events_params(appends: list[_Checked]) -> dict[str, Any]:
    """`ledger_append_events`' arguments: per append its stream, expected version, id check, event
    count and fence; the events of every append flattened, in order."""
    events = [row for _, rows, _, _ in appends for row in rows]
    return {
        "streams": [stream for stream, _, _, _ in appends],
        "expected": [int(expected) for _, _, expected, _ in appends],
        "check_ids": [any(r["chosen_id"] for r in rows) for _, rows, _, _ in appends],
        "counts": [len(rows) for _, rows, _, _ in appends],
        "fence_streams": [None if f is None else f.stream_id for _, _, _, f in appends],
        "fence_versions": [None if f is None else f.version for _, _, _, f in appends],
        "ids": [r["event_id"] for r in events],
        "types": [r["type"] for r in events],
        "versions": [r["schema_version"] for r in events],
        "data": [r["data"] for r in events],
        "metadata": [r["metadata"] for r in events],
        # One clock reading for the batch: every row of one transaction records the same instant.
        "recorded_at": events[0]["recorded_at"],
    }


def _digest(content: bytes) -> str:
    return sha256_digest(content)


def _blob_params(content: bytes, media_type: str = "application/json") -> dict[str, Any]:
    return {"digest": _digest(content), "media_type": media_type, "content": content, "now": time.time()}


def _raise_refusal(exc: Exception, stream_id: str, expected: int, fence: Fence | None) -> None:
    """`ledger_append_events`' own refusals (SQLSTATE LE001/LE002/LE003) as the store's typed errors."""
    state = getattr(exc, "sqlstate", None)
    if state in ("LE001", "LE003"):
        actual = int(getattr(getattr(exc, "diag", None), "message_detail", -1) or -1)
        if state == "LE003" and fence is not None:
            raise Fenced(fence.stream_id, fence.version, actual, stream_id) from None
        raise WrongExpectedVersion(stream_id, int(expected), actual) from None
    if state == "LE002":
        raise EventIdConflict(
            f"append to {stream_id!r}: event ids already recorded with other content or in another "
            "stream; nothing was written"
        ) from None


def _prepare(event: Event | NewEvent, metadata: dict[str, Any] | None, shared_meta: str) -> dict[str, Any]:
    """Validates one event and renders the exact JSON text that is stored and hashed."""
    if isinstance(event, Event):
        event = NewEvent.of(event)
    elif not isinstance(event, NewEvent):
        raise TypeError(f"expected a catalogue event or a NewEvent, got {type(event).__name__}")
    cls = EVENT_TYPES.get(event.type)
    if cls is None:
        raise UnknownEventType(f"unknown event type {event.type!r}; nothing was written")
    version = cls.schema_version if event.schema_version is None else event.schema_version
    if version > cls.schema_version:
        raise UnknownSchemaVersion(
            f"{event.type} schema version {version} is newer than this writer's {cls.schema_version}"
        )
    data = event.validated_json
    if data is None:
        if version == cls.schema_version:
            try:  # an untyped event is checked against its model before anything is written
                cls.model_validate(event.data)
            except ValidationError as exc:
                raise InvalidEvent(
                    f"{event.type} payload does not validate, nothing was written: {exc}"
                ) from None
        try:
            data = canonical(event.data)
        except (TypeError, ValueError) as exc:
            raise InvalidEvent(f"{event.type} payload is not JSON-serialisable: {exc}") from None
    try:
        meta = (
            canonical({**_WRITER, "wall_time": time.time(), **(metadata or {}), **event.metadata})
            if event.metadata
            else shared_meta
        )
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(f"metadata is not JSON-serialisable: {exc}") from None
    if event.event_id is not None:
        try:
            event_id = str(uuid.UUID(str(event.event_id)))
        except ValueError:
            raise InvalidEvent(f"event id {event.event_id!r} is not a UUID") from None
    else:
        event_id = str(uuid.uuid4())
    return {
        "event_id": event_id,
        "chosen_id": event.event_id is not None,
        "type": event.type,
        "schema_version": version,
        "data": data,
        "metadata": meta,
        "recorded_at": time.time(),
    }


# Driver (psycopg) parameter markers: run on the DBAPI cursor, not through SQLAlchemy.  The arrays go
# in binary (`%(x)b`): the text format escapes every quote of every JSON document with a regex, which
# cost the trainer more CPU than anything else it did (4.5x slower per append, measured).
_PG_APPEND_EVENTS = (
    "SELECT out_append, out_position, out_stream_version, out_idempotent, out_prev_hash, out_hash "
    "FROM ledger_append_events(%(streams)b::text[], %(expected)b::bigint[], %(check_ids)b::boolean[], "
    "%(counts)b::int[], %(ids)b::text[], %(types)b::text[], %(versions)b::int[], %(data)b::text[], "
    "%(metadata)b::text[], %(recorded_at)s::double precision, %(blob_digests)b::text[], %(blobs)b::bytea[], "
    "%(notify)s::boolean, %(fence_streams)b::text[], %(fence_versions)b::bigint[])"
)
_PG_BLOB_INSERT = (
    "INSERT INTO blobs (digest, media_type, content, created_at) "
    "VALUES (%(digest)s, %(media_type)s, %(content)s, %(now)s) ON CONFLICT (digest) DO NOTHING"
)
_SQLITE_INSERT = text(
    "INSERT INTO events (position, stream_id, stream_version, event_id, type, schema_version, data, metadata, "
    "recorded_at, prev_hash, hash) VALUES (:position, :stream_id, :stream_version, :event_id, :type, "
    ":schema_version, :data, :metadata, :recorded_at, :prev_hash, :hash)"
)


def _version_of(conn: Connection, stream_id: str) -> int:
    value = conn.execute(
        text("SELECT MAX(stream_version) FROM events WHERE stream_id = :s"), {"s": stream_id}
    ).scalar()
    return -1 if value is None else int(value)


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


def _idempotent(
    stream_id: str, rows: list[dict[str, Any]], existing: dict[str, tuple[Any, ...]]
) -> AppendResult:
    """Same ids and same content: the original positions, nothing written.  Anything else: an error."""
    originals = []
    for row in rows:
        found = existing.get(row["event_id"])
        if found is None:
            raise EventIdConflict(
                f"append to {stream_id!r} mixes already-recorded and new event ids; nothing was written"
            )
        _, position, stream, version, type_, data = found
        if stream != stream_id or type_ != row["type"] or not _same_json(data, row["data"]):
            raise EventIdConflict(
                f"event id {row['event_id']} was already recorded at position {position} with other content; "
                "nothing was written"
            )
        originals.append((int(position), int(version)))
    return AppendResult(positions=[p for p, _ in originals], stream_version=originals[-1][1], idempotent=True)


def _same_json(stored: str, new: str) -> bool:
    return bool(stored == new or json.loads(stored) == json.loads(new))


def _first_line(exc: BaseException | None) -> str:
    return str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else type(exc).__name__
