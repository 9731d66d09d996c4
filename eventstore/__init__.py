"""The durable log.

from eventstore import open_store, NewEvent, RecordedEvent, ExpectedVersion, WrongExpectedVersion
store = open_store("sqlite:///ledger.db")
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError

from eventstore import migrate
from eventstore.backends import create_engines, mask_url, recorder_for, resolve_url
from eventstore.errors import (
    AppendOnlyViolation,
    AppendOutcomeUnknown,
    BadDatabaseUrl,
    DatabaseRefused,
    DatabaseUnavailable,
    EventIdConflict,
    EventStoreError,
    Fenced,
    InvalidEvent,
    NoSuchLog,
    ReadOnlyLog,
    StoreBusy,
    UnknownEventType,
    UnknownMigrationHead,
    UnknownSchemaVersion,
    WrongExpectedVersion,
    connection_failed,
)
from eventstore.events import EVENT_TYPES, Event
from eventstore.records import AppendResult, ExpectedVersion, Fence, NewEvent, RecordedEvent, decode_events
from eventstore.store import ChainBreak, EventStore, UnitOfWork
from eventstore.subscription import Subscription

__all__ = [
    "EVENT_TYPES",
    "AppendOnlyViolation",
    "AppendOutcomeUnknown",
    "AppendResult",
    "BadDatabaseUrl",
    "ChainBreak",
    "DatabaseRefused",
    "DatabaseUnavailable",
    "Event",
    "EventIdConflict",
    "EventStore",
    "EventStoreError",
    "ExpectedVersion",
    "Fence",
    "Fenced",
    "InvalidEvent",
    "NewEvent",
    "NoSuchLog",
    "ReadOnlyLog",
    "RecordedEvent",
    "StoreBusy",
    "Subscription",
    "UnitOfWork",
    "UnknownEventType",
    "UnknownMigrationHead",
    "UnknownSchemaVersion",
    "WrongExpectedVersion",
    "check_reachable",
    "decode_events",
    "open_store",
    "upgrade_database",
]


def upgrade_database(url: str | None = None) -> str:
    """Brings the database to the migration head (`ledger db upgrade`); returns the revision."""
    resolved = resolve_url(url)
    writer, reader = create_engines(resolved, pool_size=1)
    try:
        refuse_a_newer_schema(resolved, check_reachable(resolved, reader))
        migrate.upgrade(writer)
        return migrate.head_revision()
    except DBAPIError as exc:
        raise connection_failed(mask_url(resolved), " ".join(str(exc.orig).split()), "failed") from None
    finally:
        writer.dispose()
        reader.dispose()


def open_store(
    url: str | None = None,
    *,
    migrate_schema: bool = False,
    notify: bool = False,
    pool_size: int = 5,
    read_only: bool = False,
) -> EventStore:
    """Opens the log at `url` (`--db`, else `LEDGER_DB`, else `sqlite:///ledger.db`).

    Refuses a database whose migration head this code does not know; with
    `migrate_schema=True` (the embedded default's first run) it upgrades first.  `read_only`: every
    write is refused by the database itself.  Only an open that migrates makes a new SQLite file: for
    any other, a file that does not exist is `NoSuchLog` (it could hold no schema), so a command on a
    mistyped path leaves nothing behind.
    """
    resolved = resolve_url(url)
    if read_only and migrate_schema:
        raise ValueError("a read-only store cannot migrate its schema")
    writer, reader = create_engines(resolved, pool_size=pool_size, read_only=read_only, create=migrate_schema)
    try:
        current = check_reachable(resolved, reader)
        refuse_a_newer_schema(resolved, current)
        head = migrate.head_revision()
        if current != head and migrate_schema:
            migrate.upgrade(writer)
            current = head
        if current != head:
            state = "has no ledger schema" if current is None else f"is at migration {current!r}"
            raise UnknownMigrationHead(
                f"database {mask_url(resolved)} {state}; this ledger expects migration {head!r}. "
                f"Run `ledger db upgrade --db {mask_url(resolved)}`"
            )
    except BaseException:
        writer.dispose()
        reader.dispose()
        raise
    return EventStore(resolved, writer, reader, recorder_for(resolved, notify), notify=notify)


def refuse_a_newer_schema(url: str, current: str | None) -> None:
    """`UnknownMigrationHead` in one line when the database is at a migration this code does not know:
    a newer rollout-ledger wrote it, and no `ledger db upgrade` of this one can bring it anywhere."""
    if current is not None and current not in migrate.known_revisions():
        raise UnknownMigrationHead(
            f"database {mask_url(url)} is at migration {current!r}, which this rollout-ledger does not "
            f"know (its newest is {migrate.head_revision()!r}): the log was written by a newer "
            "rollout-ledger; upgrade the rollout-ledger package to open it"
        )


def check_reachable(url: str, reader: object) -> str | None:
    """The database's migration revision (None: no ledger schema), read over `reader`; a connection
    that fails is one line, `DatabaseRefused` or `DatabaseUnavailable` (`connection_failed`)."""
    try:
        return migrate.current_revision(reader)  # type: ignore[arg-type]
    except DBAPIError as exc:
        # One line: libpq's messages run over several.
        raise connection_failed(mask_url(url), " ".join(str(exc.orig).split())) from None
