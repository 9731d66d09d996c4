"""The payload plane as a log's processes see it: the default store beside the log, and the log's
own blob table, read-only, for the payloads of events written before claims.

`payload_plane(store, url)` is what every command and the coordinator use: `url` (or
`LEDGER_PAYLOADS`) names the store to write to, else the default beside the log (a directory beside
a SQLite file; `ledger_payloads` in a PostgreSQL log's database, on the log's own connections).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Collection, Iterator, Mapping
from urllib.parse import urlsplit

from sqlalchemy import text

from eventstore.backends import mask_url
from eventstore.errors import DatabaseUnavailable, EventStoreError
from eventstore.store import EventStore
from payloads import (
    LOG_BLOBS_STORE,
    PAYLOADS_ENV,
    PayloadPlane,
    PayloadStore,
    PayloadStoreError,
    PayloadStoreUnavailable,
    StoredPayload,
    default_payload_url,
    open_payload_store,
    payload_url_beside,
)
from payloads._postgres import PostgresPayloadStore


class BlobTablePayloadStore(PayloadStore):
    """The log's `blobs` table behind the payload interface: read-only, and append-only below it."""

    kind = LOG_BLOBS_STORE

    def __init__(self, store: EventStore) -> None:
        super().__init__(LOG_BLOBS_STORE)
        self.store = store

    def put_many(self, items: Mapping[str, bytes]) -> None:
        raise PayloadStoreError("the log's blob table is read-only: payloads go to the payload store")

    def get_many(self, digests: Collection[str]) -> dict[str, bytes]:
        try:
            return self.store.get_blobs(digests)
        except DatabaseUnavailable as exc:
            raise PayloadStoreUnavailable(f"the log's blob table: {exc}") from None
        except EventStoreError as exc:  # e.g. a damaged database file: the reader says which blobs
            raise PayloadStoreError(f"the log's blob table: {exc}") from None

    def contains(self, digests: Collection[str]) -> set[str]:
        return set(self.store.get_blobs(digests))

    def delete(self, digests: Collection[str]) -> int:
        return 0  # append-only: an older log's blobs stay (retention records them as pruned all the same)

    def scan(self) -> Iterator[StoredPayload]:
        with self.store.read_connection() as conn:
            rows = conn.execute(text("SELECT digest, length(content), created_at FROM blobs")).all()
        for digest, size, created in rows:
            yield StoredPayload(str(digest), int(size), float(created))


def payload_store_for(store: EventStore, url: str | None = None) -> PayloadStore:
    """The store payloads of `store`'s log are written to (see the module doc)."""
    if url is None and not os.environ.get(PAYLOADS_ENV) and store._writer.dialect.name == "postgresql":
        return PostgresPayloadStore(engine=store._writer)  # the log's own database and connections
    chosen = url or default_payload_url(store.url)
    if urlsplit(chosen).scheme.lower() == "memory" and payload_url_beside(store.url) != "memory://":
        # Claims in a log that outlives the process to payloads that do not: every one lost at exit.
        raise PayloadStoreError(
            f"payload store {chosen!r} keeps nothing past this process, and the log {mask_url(store.url)} "
            "does: name a directory, a PostgreSQL database or an S3 bucket"
        )
    return open_payload_store(chosen)


_planes: weakref.WeakKeyDictionary[EventStore, dict[str | None, PayloadPlane]] = weakref.WeakKeyDictionary()
_planes_lock = threading.Lock()


def payload_plane(store: EventStore, url: str | None = None) -> PayloadPlane:
    """The plane of `store`'s processes: writes to `payload_store_for`, reads older logs' blob table too.

    One plane per store and URL, shared by everything in the process that uses the store (the
    coordinator, a worker, a command), and closed with the store: a `memory://` store beside an
    in-memory log is then one store, and connections to a remote one are not opened twice.
    """
    with _planes_lock:
        planes = _planes.setdefault(store, {})
        plane = planes.get(url)
        if plane is None:
            plane = PayloadPlane(payload_store_for(store, url), readers=[BlobTablePayloadStore(store)])
            planes[url] = plane

            def close(plane: PayloadPlane = plane) -> None:
                with _planes_lock:
                    _planes.get(store, {}).pop(url, None)
                plane.close()

            store.on_close(close)
        return plane


__all__ = ["BlobTablePayloadStore", "payload_plane", "payload_store_for"]
