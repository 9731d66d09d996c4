"""The event store: append, read, subscribe and verify, on SQLite or PostgreSQL."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from sqlalchemy import Connection, Engine, bindparam, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from eventstore.backends import mask_url
from eventstore.bulk_reads import fewer_collections
from eventstore.errors import (
    AppendOnlyViolation,
    DatabaseUnavailable,
    EventStoreError,
    InvalidEvent,
    UnknownEventType,
    UnknownSchemaVersion,
    connection_failed,
)
from eventstore.events import EVENT_TYPES, Event
from eventstore.group_commit import GroupCommit
from eventstore.read_ahead import PAGE_SIZE, read_ahead_pages
from eventstore.recorder import CheckedAppend, Recorder, RenderedEvent
from eventstore.records import (
    GENESIS_HASH,
    UNIT_SEPARATOR,
    AppendResult,
    ExpectedVersion,
    Fence,
    NewEvent,
    RecordedEvent,
    canonical,
    canonical_uuid,
    decode_events,
    new_event_ids,
)
from eventstore.subscription import Subscription
from protocol.connections import first_line

_BLOBS_IN = text("SELECT digest, content FROM blobs WHERE digest IN :digests").bindparams(
    bindparam("digests", expanding=True)
)

# One append of a batch: (stream, events, expected version) and optionally its fence.
Append = (
    tuple[str, Sequence[Event | NewEvent], int] | tuple[str, Sequence[Event | NewEvent], int, Fence | None]
)

_WRITER = {"host": socket.gethostname(), "pid": os.getpid()}
# A forked child's appends name the child, not its parent.
os.register_at_fork(after_in_child=lambda: _WRITER.update(pid=os.getpid()))
_STREAM_ID_MAX = 400


@dataclass(frozen=True, slots=True)
class ChainBreak:
    position: int
    reason: str


class EventStore:
    """An append-only log of events.  Thread-safe; one instance per process is plenty."""

    def __init__(
        self, url: str, writer: Engine, reader: Engine, recorder: Recorder, notify: bool = False
    ) -> None:
        self.url = mask_url(url)
        self._writer = writer
        self._reader = reader
        self.recorder = recorder
        # NOTIFY takes a global lock at commit; it is opt-in (see benchmarks/eventstore.py).
        self.notify = notify and recorder.supports_notify
        # What closes with the store (the payload plane beside the log: eventstore.payload_stores).
        self._on_close: list[Callable[[], None]] = []
        # Concurrent `append` calls share one statement and one commit (eventstore/group_commit.py).
        self.group_commit = GroupCommit(self._append_each)

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
        """Appends `events` to `stream_id` if it is at `expected_version` and `fence` (if any) holds.

        Its own transaction, committed; concurrent calls share one (group commit), each still
        written or refused on its own.
        """
        return self.group_commit.append(
            lambda: _checked(stream_id, events, expected_version, metadata, fence)
        )

    def _append_each(self, appends: list[CheckedAppend]) -> list[AppendResult | Exception]:
        with self._database_errors():
            return list(self.recorder.append_each(self._writer, appends))

    def append_batch(
        self,
        appends: Sequence[Append],
        blobs: Sequence[bytes] = (),
        fence: Fence | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> list[AppendResult]:
        """`UnitOfWork.append_batch` in a transaction of its own, committed.

        On PostgreSQL one statement in autocommit mode, blobs included, is the whole transaction: one
        network round trip, and one wait on the socket for a writer thread (each wait gives the GIL
        away, and taking it back from a busy event loop thread cost more than the database's own
        work).  Any refusal rolls the whole batch back and raises as `append` would.
        """
        checked = _checked_batch(appends, fence, metadata)
        with self._database_errors():
            return self.recorder.append_committed(self._writer, checked, blobs)

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
        batch_size: int = PAGE_SIZE,
    ) -> Iterator[RecordedEvent]:
        """Events with `from_position < position <= to_position`, in position order, gap-free."""
        for page in self.read_pages(from_position, to_position, types, batch_size, read_ahead=False):
            yield from page

    def read_pages(
        self,
        from_position: int = 0,
        to_position: int | None = None,
        types: Collection[str] | None = None,
        batch_size: int = PAGE_SIZE,
        read_ahead: bool = True,
    ) -> Generator[list[RecordedEvent], None, None]:
        """`read_all` in pages of `batch_size`.  With `read_ahead` a reader thread fetches the next page
        while the caller works on this one (the database's time overlaps the caller's)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        p = self.recorder.param
        where = f"position > {p('after')}"
        params: dict[str, Any] = {"limit": batch_size}
        if to_position is not None:
            where += f" AND position <= {p('to')}"
            params["to"] = to_position
        if types is not None:
            names = sorted(types)
            where += " AND type IN (" + ", ".join(p(f"t{i}") for i in range(len(names))) + ")"
            params.update({f"t{i}": n for i, n in enumerate(names)})
        query = f"SELECT {self.recorder.select_columns} FROM events WHERE {where} ORDER BY position LIMIT {p('limit')}"

        def fetch(after: int) -> list[RecordedEvent]:
            with self._database_errors(), self._reader.connect() as conn:
                return self.recorder.fetch_records(conn, query, {**params, "after": after})

        if read_ahead:
            yield from read_ahead_pages(fetch, from_position, batch_size)
            return
        after = from_position
        while True:
            page = fetch(after)
            if page:
                yield page
            if len(page) < batch_size:
                return
            after = page[-1].position

    def read_typed(
        self, from_position: int = 0, to_position: int | None = None, batch_size: int = PAGE_SIZE
    ) -> Iterator[tuple[RecordedEvent, Event]]:
        """Every event with its typed payload (upcast to the current schema), in position order.

        Pages are read ahead and decoded in one pass each (`decode_events`); an event that cannot be
        decoded raises its error, naming its position, after every event before it was yielded.
        """
        with fewer_collections():
            for page in self.read_pages(from_position, to_position, batch_size=batch_size):
                decoded, error = decode_events(page)
                yield from zip(page, decoded, strict=False)
                if error is not None:
                    raise error

    def read_stream(self, stream_id: str, from_version: int = 0) -> Iterator[RecordedEvent]:
        p = self.recorder.param
        query = (
            f"SELECT {self.recorder.select_columns} FROM events "
            f"WHERE stream_id = {p('s')} AND stream_version >= {p('v')} ORDER BY stream_version"
        )
        with self._database_errors(), self._reader.connect() as conn:
            return iter(self.recorder.fetch_records(conn, query, {"s": stream_id, "v": from_version}))

    def get_blob(self, digest: str) -> bytes | None:
        return self.get_blobs([digest]).get(digest)

    def get_blobs(self, digests: Collection[str]) -> dict[str, bytes]:
        """The stored content of each of `digests` that is stored, in one query (a sealed group's
        replies: one read per group, not one per sibling)."""
        if not digests:
            return {}
        with self._database_errors(), self._reader.connect() as conn:
            rows = conn.execute(_BLOBS_IN, {"digests": sorted(set(digests))}).all()
        return {str(digest): bytes(content) for digest, content in rows}

    def iter_blobs(self, batch: int = 256) -> Iterator[tuple[str, bytes]]:
        """Every row of the blob table, `batch` rows a query, in digest order (the auditor's check)."""
        after = ""
        while True:
            with self._database_errors(), self._reader.connect() as conn:
                rows = conn.execute(
                    text("SELECT digest, content FROM blobs WHERE digest > :after ORDER BY digest LIMIT :n"),
                    {"after": after, "n": batch},
                ).all()
            for digest, content in rows:
                yield str(digest), bytes(content)
            if len(rows) < batch:
                return
            after = str(rows[-1][0])

    def integrity_check(self) -> tuple[bool, str]:
        """The database's own check of its files: SQLite's `PRAGMA integrity_check`; on PostgreSQL the
        data-checksum failures it has counted (pages are checked as they are read, when the cluster
        was initialised with checksums)."""
        with self._database_errors(), self._reader.connect() as conn:
            if self._reader.dialect.name == "sqlite":
                try:
                    found = [str(r[0]) for r in conn.execute(text("PRAGMA integrity_check")).all()]
                except DBAPIError as exc:  # a file damaged enough that the check itself cannot run
                    return False, f"SQLite integrity_check: {first_line(exc.orig)}"
                if found == ["ok"]:
                    return True, "SQLite integrity_check: ok"
                shown = "; ".join(found[:5]) + (f" (and {len(found) - 5} more)" if len(found) > 5 else "")
                return False, f"SQLite integrity_check: {shown}"
            checksums = str(conn.execute(text("SHOW data_checksums")).scalar_one())
            if checksums != "on":
                return True, "PostgreSQL: data checksums are off (initdb --data-checksums turns them on)"
            failures = conn.execute(
                text(
                    "SELECT coalesce(sum(checksum_failures), 0) FROM pg_stat_database "
                    "WHERE datname = current_database()"
                )
            ).scalar_one()
            if int(failures or 0):
                return False, f"PostgreSQL: {int(failures)} data checksum failure(s) in this database"
            return True, "PostgreSQL: data checksums on, no failures"

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
        return self.recorder.listen(self._reader)

    @contextmanager
    def read_connection(self) -> Iterator[Connection]:
        """A connection of the read-only engine, for a caller's own queries on the store's tables.

        Reading through the writer would take the append lock (`BEGIN IMMEDIATE` on SQLite).
        """
        with self._database_errors(), self._reader.connect() as conn:
            yield conn

    def on_close(self, fn: Callable[[], None]) -> None:
        """Runs `fn` when the store is closed (before its engines are disposed)."""
        self._on_close.append(fn)

    def close(self) -> None:
        while self._on_close:
            self._on_close.pop()()
        self.recorder.close()
        self._writer.dispose()
        self._reader.dispose()

    # --- internals --------------------------------------------------------

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
            raise connection_failed(self.url, first_line(exc.orig)) from None
        except DBAPIError as exc:
            if "append-only" in str(exc.orig):
                raise AppendOnlyViolation(str(exc.orig)) from None
            if exc.connection_invalidated:
                raise DatabaseUnavailable(f"database {self.url} went away: {first_line(exc.orig)}") from None
            raise EventStoreError(f"database error, nothing was written: {first_line(exc.orig)}") from None
        except Exception as exc:  # raised by the driver itself on the raw read and append paths
            dbapi = self._reader.dialect.dbapi
            if dbapi is not None and isinstance(exc, dbapi.Error) and "append-only" in str(exc):
                raise AppendOnlyViolation(first_line(exc)) from None
            if dbapi is not None and isinstance(exc, dbapi.IntegrityError):
                raise EventStoreError(f"integrity error, nothing was written: {first_line(exc)}") from None
            if dbapi is not None and isinstance(exc, dbapi.OperationalError | dbapi.InterfaceError):
                raise connection_failed(self.url, first_line(exc)) from None
            if dbapi is not None and isinstance(exc, dbapi.Error):
                raise EventStoreError(f"database error: {first_line(exc)}") from None
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
        append = _checked(stream_id, events, expected_version, metadata, fence)
        [result] = self.store.recorder.append(self.connection, [append], ())
        self._notify([result])
        return result

    def append_batch(
        self,
        appends: Sequence[Append],
        blobs: Sequence[bytes] = (),
        fence: Fence | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> list[AppendResult]:
        """Several appends `(stream_id, events, expected_version[, fence])` and blobs, in order, in this
        transaction.  `fence` is the fence of every append that names none of its own; `metadata` is
        the metadata of every one (as `append`'s: e.g. the writer, who wrote the whole batch).

        The same as `put_blob` for each blob then `append` for each append, but on PostgreSQL one
        `ledger_append_events` statement: a single network round trip however many streams it writes.  Appends to the same
        stream chain (the second expects the version the first leaves).  A refused append raises as
        `append` would, and the transaction is then unusable (roll it back).
        """
        results = self.store.recorder.append(self.connection, _checked_batch(appends, fence, metadata), blobs)
        self._notify(results)
        return results

    def _notify(self, results: list[AppendResult]) -> None:
        if self.store.notify and not self._notified and not all(r.idempotent for r in results):
            self.store.recorder.notify(self.connection)
            self._notified = True

    def put_blob(self, content: bytes, media_type: str = "application/json") -> str:
        """Stores content under its sha256; storing the same content twice is a no-op."""
        return self.store.recorder.put_blob(self.connection, content, media_type)

    def save_position(self, name: str, position: int) -> None:
        self.store.recorder.save_position(self.connection, name, position)


def _checked(
    stream_id: str,
    events: Sequence[Event | NewEvent],
    expected_version: int,
    metadata: dict[str, Any] | None,
    fence: Fence | None,
) -> CheckedAppend:
    if not events:
        raise ValueError("append needs at least one event")
    if not stream_id or len(stream_id) > _STREAM_ID_MAX or UNIT_SEPARATOR in stream_id:
        raise ValueError(f"invalid stream id {stream_id!r}")
    if expected_version < ExpectedVersion.ANY:
        raise ValueError(f"invalid expected version {expected_version}")
    now = time.time()
    try:  # one rendering for every event of the append that brings no metadata of its own
        shared = canonical({**_WRITER, "wall_time": now, **(metadata or {})})
    except (TypeError, ValueError) as exc:
        raise InvalidEvent(f"metadata is not JSON-serialisable: {exc}") from None
    rows = [
        _prepare(e, metadata, shared, new_id)
        for e, new_id in zip(events, new_event_ids(len(events)), strict=True)
    ]
    return CheckedAppend(stream_id, rows, expected_version, fence, now)


def _checked_batch(
    appends: Sequence[Append], fence: Fence | None, metadata: dict[str, Any] | None = None
) -> list[CheckedAppend]:
    checked = []
    for append in appends:
        stream, events, expected = append[:3]
        own = append[3] if len(append) > 3 else fence
        checked.append(_checked(stream, events, expected, metadata, own))
    return checked


def _prepare(
    event: Event | NewEvent, metadata: dict[str, Any] | None, shared_meta: str, new_id: str
) -> RenderedEvent:
    """Validates one event and renders the exact JSON text that is stored and hashed; `new_id` is
    its id unless it chose one."""
    if isinstance(event, Event):
        model = type(event)
        if EVENT_TYPES.get(model.__name__) is model:
            # A catalogue model is valid by construction: its JSON as `NewEvent.of` renders it,
            # without the dict `NewEvent.data` would carry (nothing here reads it).
            return RenderedEvent(
                new_id, False, model.__name__, model.schema_version, event.model_dump_json(), shared_meta
            )
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
            event_id = canonical_uuid(str(event.event_id))
        except ValueError:
            raise InvalidEvent(f"event id {event.event_id!r} is not a UUID") from None
    else:
        event_id = new_id
    return RenderedEvent(event_id, event.event_id is not None, event.type, version, data, meta)
