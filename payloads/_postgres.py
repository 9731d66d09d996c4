"""`PostgresPayloadStore`: payloads as large values in a PostgreSQL table (`ledger_payloads`).

The table is created on first use.  Its content column is stored `EXTERNAL`: out of line (TOAST) and
uncompressed, since token arrays do not compress enough to pay for pglz on every write and read (see
docs/payloads.md).  A put of many payloads is one call (a statement per 1,000 of them), durable on
return (with the server's `synchronous_commit`), a digest already there left as it is.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Final

from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import DBAPIError, OperationalError

from payloads._errors import PayloadStoreError, PayloadStoreUnavailable
from payloads._store import PayloadStore, StoredPayload, check_digest
from protocol.connections import first_line, refused_for_good

TABLE: Final = "ledger_payloads"
CREATE_TABLE: Final = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    digest text PRIMARY KEY,
    size bigint NOT NULL,
    stored_at double precision NOT NULL,
    content bytea NOT NULL
);
ALTER TABLE {TABLE} ALTER COLUMN content SET STORAGE EXTERNAL;
"""
# Each payload is a parameter of its own, in psycopg's binary format (`%b`): the driver hands the
# bytes to libpq as they are.  In text, every payload travelled hex-escaped, 2x its size, escaped by the
# client and parsed by the server (a 145 KB payload: 3.7 ms of client CPU and 4.7 ms of the server's,
# against 0.2 and 0.8 in binary); as one `bytea[]` array the client copied every payload into the
# array and the server built the array and took it apart again (see docs/payloads.md).
_PUT_ROW: Final = "(%s, %s, %s, %b)"
_PUT_ROWS_PER_STATEMENT: Final = 1000  # 4 parameters a row: far below PostgreSQL's 65,535
_PUT_CONFLICT: Final = " ON CONFLICT (digest) DO UPDATE SET stored_at = EXCLUDED.stored_at"


@functools.cache
def _payload_dumper() -> type[Any]:
    """The dumper of a payload parameter: the bytes object itself, handed to libpq as it is.
    psycopg's C dumper for bytes (which stands in for `BytesBinaryDumper` itself, not for a subclass)
    copies every parameter into a fresh bytearray first: one more copy of each payload, and at 64 KiB
    or more one more buffer mapped and faulted in (the trainer pins glibc's mmap threshold).  Puts of
    16 payloads of 70 KB on a throwaway cluster: 107-164 -> 62-90 us of client CPU a payload."""
    from psycopg.types.string import BytesBinaryDumper

    class PayloadBytes(BytesBinaryDumper):
        pass

    return PayloadBytes


@functools.lru_cache(maxsize=64)
def _put_statement(rows: int) -> str:
    values = ", ".join([_PUT_ROW] * rows)
    return f"INSERT INTO {TABLE} (digest, size, stored_at, content) VALUES {values}{_PUT_CONFLICT}"


_BATCH: Final = 500  # digests per SELECT / DELETE
# Seconds a connection attempt may take (libpq's `connect_timeout`): a host that never answers is an
# outage to ride out, not a wait for ever.
CONNECT_TIMEOUT_S: Final = 10


def _url(url: str) -> str:
    if url.startswith("postgres://"):
        url = "postgresql://" + url.removeprefix("postgres://")
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return url


class PostgresPayloadStore(PayloadStore):
    kind = "postgres"

    def __init__(
        self,
        url: str | None = None,
        name: str | None = None,
        *,
        pool_size: int = 4,
        engine: Engine | None = None,
    ) -> None:
        """On the database at `url`, or on an `engine` another part of the process already holds (the
        log's own, when payloads live beside the events): then `close` leaves it open."""
        super().__init__(name)
        self._owns_engine = engine is None
        if engine is None:
            if url is None:
                raise PayloadStoreError("a PostgreSQL payload store needs a URL or an engine")
            try:
                engine = create_engine(
                    _url(url),
                    pool_size=pool_size,
                    pool_pre_ping=True,
                    connect_args={
                        "connect_timeout": CONNECT_TIMEOUT_S,
                        "application_name": "ledger-payloads",
                    },
                )
            except Exception as exc:  # a bad URL, a missing driver
                raise PayloadStoreError(f"payload store {url!r}: {exc}") from None
        self.engine: Engine = engine
        self._ready = False
        self._ready_lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"{TABLE} in {self.engine.url.render_as_string(hide_password=True)}"

    def _ensure_table(self, raw: Any) -> None:
        import psycopg

        with self._ready_lock:
            if self._ready:
                return
            try:
                with raw.cursor() as cur:
                    cur.execute(CREATE_TABLE)
                raw.commit()
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable):
                raw.rollback()  # another process created it at the same moment
            self._ready = True

    def _run(self, fn: Any, what: str, *, write: bool = False) -> Any:
        import psycopg

        try:
            with self.engine.connect() as conn:
                raw: Any = conn.connection.dbapi_connection
                try:
                    if write and not self._ready:
                        self._ensure_table(raw)
                    try:
                        with raw.cursor() as cur:
                            result = fn(cur)
                    except psycopg.errors.UndefinedTable:
                        raw.rollback()
                        if write:
                            raise
                        return []  # nothing was ever stored here
                    raw.commit()
                    return result
                except (psycopg.OperationalError, psycopg.InterfaceError):
                    # A session the server dropped is discarded, never reset back into the pool (the
                    # pool's reset would fail again and log a traceback for it).
                    conn.invalidate()
                    raise
        except OperationalError as exc:
            raise _failed(what, first_line(exc.orig)) from None
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise PayloadStoreUnavailable(f"{what}: {first_line(exc.orig)}") from None
            raise PayloadStoreError(f"{what}: {first_line(exc.orig)}") from None
        except Exception as exc:
            import psycopg

            if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                raise _failed(what, first_line(exc)) from None
            if isinstance(exc, psycopg.Error):
                raise PayloadStoreError(f"{what}: {first_line(exc)}") from None
            raise

    def put_many(self, items: Mapping[str, bytes]) -> None:
        if not items:
            return
        now = time.time()
        rows = [(check_digest(d), bytes(c)) for d, c in items.items()]

        def put(cur: Any) -> None:
            cur.adapters.register_dumper(bytes, _payload_dumper())  # this cursor's own map
            for i in range(0, len(rows), _PUT_ROWS_PER_STATEMENT):
                chunk = rows[i : i + _PUT_ROWS_PER_STATEMENT]
                params: list[Any] = []
                for digest, content in chunk:
                    params += (digest, len(content), now, content)
                cur.execute(_put_statement(len(chunk)), params)

        self._run(put, "storing payloads", write=True)

    def get_many(self, digests: Collection[str]) -> dict[str, bytes]:
        wanted = sorted(set(digests))
        found: dict[str, bytes] = {}
        for i in range(0, len(wanted), _BATCH):
            chunk = wanted[i : i + _BATCH]

            def read(cur: Any, chunk: list[str] = chunk) -> list[tuple[str, bytes]]:
                # Rows in the binary format: the content as it is stored, not hex to decode.
                cur.execute(
                    f"SELECT digest, content FROM {TABLE} WHERE digest = ANY(%s)", (chunk,), binary=True
                )
                return list(cur.fetchall())

            found.update((str(d), bytes(c)) for d, c in self._run(read, "reading payloads"))
        return found

    def contains(self, digests: Collection[str]) -> set[str]:
        wanted = sorted(set(digests))
        found: set[str] = set()
        for i in range(0, len(wanted), _BATCH):
            chunk = wanted[i : i + _BATCH]

            def read(cur: Any, chunk: list[str] = chunk) -> list[tuple[str]]:
                cur.execute(f"SELECT digest FROM {TABLE} WHERE digest = ANY(%s)", (chunk,))
                return list(cur.fetchall())

            found.update(str(row[0]) for row in self._run(read, "looking up payloads"))
        return found

    def delete(self, digests: Collection[str]) -> int:
        wanted = sorted(set(digests))
        removed = 0
        for i in range(0, len(wanted), _BATCH):
            chunk = wanted[i : i + _BATCH]

            def drop(cur: Any, chunk: list[str] = chunk) -> int:
                cur.execute(f"DELETE FROM {TABLE} WHERE digest = ANY(%s)", (chunk,))
                return int(cur.rowcount)

            removed += self._run(drop, "deleting payloads") or 0
        return removed

    def scan(self) -> Iterator[StoredPayload]:
        def read(cur: Any) -> list[tuple[str, int, float]]:
            cur.execute(f"SELECT digest, size, stored_at FROM {TABLE}")
            return list(cur.fetchall())

        for digest, size, stored_at in self._run(read, "listing payloads"):
            yield StoredPayload(str(digest), int(size), float(stored_at))

    def close(self) -> None:
        if self._owns_engine:
            self.engine.dispose()


def _failed(what: str, reason: str) -> PayloadStoreError:
    """A connection or session that failed: an outage to ride out (`PayloadStoreUnavailable`), or, when
    the server refused this connection itself (a wrong password, no such database), refused for good."""
    if refused_for_good(reason):
        return PayloadStoreError(f"{what}: the database refused the connection (not retried): {reason}")
    return PayloadStoreUnavailable(f"{what}: {reason}")


__all__ = ["CREATE_TABLE", "TABLE", "PostgresPayloadStore"]
