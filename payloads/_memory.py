"""`InMemoryPayloadStore`: a dict behind the interface; public, as a test helper (nothing is durable)."""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator, Mapping

from payloads._store import PayloadStore, StoredPayload, check_digest


class InMemoryPayloadStore(PayloadStore):
    kind = "memory"

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._items: dict[str, tuple[bytes, float]] = {}
        self._lock = threading.Lock()

    def put_many(self, items: Mapping[str, bytes]) -> None:
        now = time.time()
        with self._lock:
            for digest, content in items.items():
                kept = self._items.get(check_digest(digest))
                self._items[digest] = (kept[0] if kept is not None else bytes(content), now)

    def get_many(self, digests: Collection[str]) -> dict[str, bytes]:
        with self._lock:
            return {d: self._items[d][0] for d in digests if d in self._items}

    def contains(self, digests: Collection[str]) -> set[str]:
        with self._lock:
            return {d for d in digests if d in self._items}

    def delete(self, digests: Collection[str]) -> int:
        with self._lock:
            return sum(self._items.pop(d, None) is not None for d in set(digests))

    def scan(self) -> Iterator[StoredPayload]:
        with self._lock:
            rows = [StoredPayload(d, len(c), at) for d, (c, at) in self._items.items()]
        return iter(rows)

    def overwrite(self, digest: str, content: bytes) -> None:
        """Replaces what is stored under `digest` (tests: a damaged store)."""
        with self._lock:
            self._items[digest] = (content, time.time())


__all__ = ["InMemoryPayloadStore"]
