"""The one interface every backend of the log implements (`PostgresRecorder`, `SqliteRecorder`).

The store (eventstore/store.py) checks and renders appends, then hands them to its recorder; what
differs between databases (engines, the append lock, SQL dialect, how a batch reaches the database)
lives behind this interface and nowhere else.

Gap-free tailing: every append takes one log-wide lock before it reads the head and holds it until
commit (PostgreSQL: a transaction-scoped advisory lock inside `ledger_append_events`; SQLite:
`BEGIN IMMEDIATE`).  Positions are therefore assigned `max(position) + 1` in commit order: they are
contiguous, a reader that has seen position p has seen every position below it, and a rolled-back
append leaves no hole.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, text

from eventstore.errors import EventStoreError
from eventstore.records import AppendResult, Fence, RecordedEvent, from_row
from protocol.digests import sha256_digest

_COLUMNS = "position, stream_id, stream_version, event_id, type, schema_version, {data}, {metadata}, recorded_at, prev_hash, hash"
_POSITION_UPSERT = text(
    "INSERT INTO subscriptions (name, position, updated_at) VALUES (:name, :position, :now) "
    "ON CONFLICT (name) DO UPDATE SET position = excluded.position, updated_at = excluded.updated_at"
)


class RenderedEvent(NamedTuple):
    """One event of an append, checked and rendered: the exact JSON text that is stored and hashed."""

    event_id: str
    chosen_id: bool  # the writer chose it: a retry may find it recorded, so idempotency is checked
    type: str
    schema_version: int
    data: str
    metadata: str


class CheckedAppend(NamedTuple):
    """One append, checked and rendered, with the clock reading its rows record."""

    stream_id: str
    rows: list[RenderedEvent]
    expected: int
    fence: Fence | None
    recorded_at: float

    def written(
        self, row: RenderedEvent, position: int, version: int, prev_hash: str, hash_: str, recorded_at: float
    ) -> RecordedEvent:
        """`row` as the append wrote it, as the log hands it back."""
        return RecordedEvent(
            position,
            self.stream_id,
            version,
            row.event_id,
            row.type,
            row.schema_version,
            row.data,
            row.metadata,
            recorded_at,
            prev_hash,
            hash_,
        )


class Recorder(ABC):
    """How one database stores and reads the log."""

    #: The `events` columns in `RecordedEvent` order, JSON columns as their stored text.
    select_columns: str
    #: The driver's marker for a positional parameter (`?` or `%s`).
    positional_mark: str
    #: Whether the database can wake subscribers on append (LISTEN/NOTIFY).
    supports_notify: bool = False

    @abstractmethod
    def create_engines(
        self, url: str, pool_size: int, read_only: bool = False, create: bool = True
    ) -> tuple[Engine, Engine]:
        """A writer engine and a reader engine on `url` (`read_only`: both refuse every write, and
        open nothing that does not exist; `create=False`: a log that does not exist is `NoSuchLog`,
        never made, where opening would make one, as a SQLite file)."""

    @abstractmethod
    def param(self, name: str) -> str:
        """The driver's marker for the named parameter `name` (reads run on the driver's cursor)."""

    @abstractmethod
    def json_text(self, column: str) -> str:
        """An expression reading a JSON column back as the exact text stored."""

    @abstractmethod
    def json_param(self, name: str) -> str:
        """A SQLAlchemy bind expression storing the JSON text parameter `name` in a JSON column."""

    @abstractmethod
    def append(
        self, conn: Connection, appends: list[CheckedAppend], blobs: Sequence[bytes]
    ) -> list[AppendResult]:
        """Every append and blob, in order, in the caller's transaction; a refusal raises and the
        transaction is then unusable (roll it back)."""

    @abstractmethod
    def append_committed(
        self, writer: Engine, appends: list[CheckedAppend], blobs: Sequence[bytes]
    ) -> list[AppendResult]:
        """`append` in a transaction of its own, committed; any refusal writes nothing and raises."""

    @abstractmethod
    def append_each(
        self, writer: Engine, appends: list[CheckedAppend]
    ) -> list[AppendResult | EventStoreError]:
        """Every append in one transaction of its own, committed, each written or refused on its own:
        a refused append writes nothing and answers its error, and the others are written as if it had
        not been there (group commit)."""

    @abstractmethod
    def close(self) -> None:
        """Releases any connection the recorder holds of its own (the store closes it)."""

    def fetch_records(self, conn: Connection, sql: str, params: dict[str, Any]) -> list[RecordedEvent]:
        """Rows of `select_columns` as records, straight from the driver's cursor: replay skips
        SQLAlchemy's row layer (3x faster)."""
        cursor = conn.connection.cursor()
        try:
            cursor.execute(sql, params)
            return list(map(from_row, cursor.fetchall()))
        finally:
            cursor.close()

    @abstractmethod
    def put_blob(self, conn: Connection, content: bytes, media_type: str) -> str:
        """Stores content under its digest (a no-op the second time); returns the digest."""

    @abstractmethod
    def clock(self, conn: Connection) -> float:
        """Seconds since the epoch by the clock every host sharing this database agrees on."""

    @abstractmethod
    def lock_rows_clause(self) -> str:
        """What a SELECT appends to lock the rows it claims and skip the ones others hold ('' if the
        database serialises writers anyway)."""

    def notify(self, conn: Connection) -> None:
        """Wakes the subscribers listening for appends (only where `supports_notify`)."""
        raise NotImplementedError

    def listen(self, reader: Engine) -> Any:
        """A dedicated driver connection listening for appends (only where `supports_notify`)."""
        raise NotImplementedError

    def save_position(self, conn: Connection, name: str, position: int) -> None:
        conn.execute(_POSITION_UPSERT, {"name": name, "position": position, "now": time.time()})


def select_columns(data: str, metadata: str) -> str:
    return _COLUMNS.format(data=data, metadata=metadata)


def blob_params(content: bytes, media_type: str = "application/json") -> dict[str, Any]:
    return {
        "digest": sha256_digest(content),
        "media_type": media_type,
        "content": content,
        "now": time.time(),
    }
