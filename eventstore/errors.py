"""Typed errors of the store: each says what went wrong and that nothing was written."""

from __future__ import annotations

from protocol.connections import refused_for_good


class EventStoreError(Exception):
    """Base of every error raised by the store."""


class WrongExpectedVersion(EventStoreError):
    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        self.stream_id, self.expected, self.actual = stream_id, expected, actual
        super().__init__(
            f"stream {stream_id!r} is at version {actual}, the append expected {_name(expected)}; nothing was written"
        )


class Fenced(EventStoreError):
    """An append's fence stream was not at the version the append was fenced on: a newer owner took over."""

    def __init__(self, stream_id: str, expected: int, actual: int, appending_to: str) -> None:
        self.stream_id, self.expected, self.actual = stream_id, expected, actual
        self.appending_to = appending_to
        super().__init__(
            f"append to {appending_to!r} fenced on {stream_id!r} at {_name(expected)}, which is at version "
            f"{actual}; nothing was written"
        )


class EventIdConflict(EventStoreError):
    """An event id was appended before with different content."""


class UnknownEventType(EventStoreError):
    pass


class UnknownSchemaVersion(EventStoreError):
    pass


class InvalidEvent(EventStoreError):
    """A payload failed its model, or a row could not be decoded."""


class DatabaseUnavailable(EventStoreError):
    """The database cannot be reached now (down, restarting, unreachable): worth retrying within a budget."""


class DatabaseRefused(EventStoreError):
    """The database answered and refused this connection (a wrong password, no such role or database,
    no pg_hba.conf entry): the next try would be refused the same way, so nothing retries it
    (`protocol.connections.refused_for_good`)."""


class ReadOnlyLog(DatabaseRefused):
    """A SQLite log this process must write whose file or folder it cannot write (its mode, a read-only
    mount): an answer no retry changes, so nothing waits it out."""


class StoreBusy(DatabaseUnavailable):
    """Too many appends already wait for the log, or none of its writes took this one in time;
    nothing was written."""


class AppendOutcomeUnknown(DatabaseUnavailable):
    """The write carrying an append did not answer in time: it may or may not have been written
    (a retry with the same event ids is answered from the log)."""


class UnknownMigrationHead(EventStoreError):
    pass


class BadDatabaseUrl(EventStoreError):
    """A database URL that names no log this code can open; the message says what to write instead."""


class NoSuchLog(EventStoreError):
    """A read-only open of a SQLite file that does not exist: it is never created (a mistyped path)."""


class AppendOnlyViolation(EventStoreError):
    pass


def _name(expected: int) -> str:
    return {-2: "any version", -1: "no stream"}.get(expected, f"version {expected}")


def connection_failed(url: str, reason: str, unavailable: str = "unavailable") -> EventStoreError:
    """The error for a database that failed this process's connection with `reason` (one line):
    `DatabaseRefused` when the server refused it for good, else `DatabaseUnavailable`, saying
    `database URL {unavailable}: REASON` (`url` shown masked)."""
    if refused_for_good(reason):
        return DatabaseRefused(f"database {url} refused the connection (not retried): {reason}")
    return DatabaseUnavailable(f"database {url} {unavailable}: {reason}")
