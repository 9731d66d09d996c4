"""`PayloadStore`: the one interface every payload backend implements, in bytes and digests only.

A payload is stored under its digest (`sha256:<hex>`, the project's one digest format) and never
changes: storing the same digest twice is a no-op, and a reader checks what it fetched against the
digest it asked for (`PayloadPlane.get`).  `put_many` returns only once every payload is durable (a
crash after it returns keeps them), which is what lets an event name a payload as soon as the put
returned: the seal is the claim check.

No driver type appears here; each backend is one module (`_memory`, `_local`, `_postgres`, `_s3`) and
maps its own errors onto `payloads._errors`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping
from typing import ClassVar, Final, NamedTuple

from payloads._errors import PayloadMissing, PayloadStoreError
from protocol.digests import DIGEST_PATTERN

_DIGEST_RE: Final = re.compile(DIGEST_PATTERN)


class StoredPayload(NamedTuple):
    """One payload as a store lists it (`scan`): for collection and retention, never for reading."""

    digest: str
    size: int
    stored_at: float  # seconds since the epoch, by the store's clock


def check_digest(digest: str) -> str:
    """`digest` itself, or PayloadStoreError when it is not `sha256:<64 hex>` (it names a file or key)."""
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise PayloadStoreError(f"not a payload digest: {digest!r}")
    return digest


class PayloadStore(ABC):
    """Content-addressed bytes.  Thread-safe: one instance per process is plenty."""

    #: The backend's kind, and the default `name` claims carry: memory, local, postgres, s3, log.
    kind: ClassVar[str]

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.kind

    @abstractmethod
    def put_many(self, items: Mapping[str, bytes]) -> None:
        """Stores each `digest -> content` (the caller computed the digests); durable on return.

        A digest already stored keeps its bytes but has its time (`StoredPayload.stored_at`) renewed:
        collection and retention spare what was put within their grace, counted from the newest put,
        so bytes put again for an append about to claim them are never deleted from under it."""

    @abstractmethod
    def get_many(self, digests: Collection[str]) -> dict[str, bytes]:
        """The content of each of `digests` that is stored; those that are not are left out."""

    @abstractmethod
    def contains(self, digests: Collection[str]) -> set[str]:
        """Which of `digests` are stored."""

    @abstractmethod
    def delete(self, digests: Collection[str]) -> int:
        """Removes each of `digests` that is stored; returns how many were."""

    @abstractmethod
    def scan(self) -> Iterator[StoredPayload]:
        """Every stored payload, in no particular order."""

    def close(self) -> None:  # noqa: B027 (most backends hold nothing to release)
        """Releases connections or clients the store holds."""

    @property
    def where(self) -> str:
        """Where the payloads are, for a message (a directory, a bucket, a database; no password)."""
        return self.name

    def put(self, digest: str, content: bytes) -> None:
        self.put_many({digest: content})

    def get(self, digest: str) -> bytes:
        """The content under `digest`, or PayloadMissing."""
        found = self.get_many([digest]).get(digest)
        if found is None:
            raise PayloadMissing(digest, self.name)
        return found

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


__all__ = ["PayloadStore", "StoredPayload", "check_digest"]
