"""`PayloadPlane`: writes payloads to one store and reads them back by claim, checked.

The plane holds the stores a process knows by name: the default one it writes to, and any it only
reads (the log's blob table of older logs, say).  Every read is checked against the claim: the bytes
must hash to the claimed digest and have the claimed size, else `PayloadCorrupt`; a claim naming a
store the plane does not hold is a `PayloadStoreError` that says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from payloads._claim import PayloadClaim
from payloads._errors import PayloadCorrupt, PayloadMissing, PayloadStoreError
from payloads._store import PayloadStore
from protocol.digests import sha256_digest


def verify(claim: PayloadClaim, content: bytes) -> bytes:
    """`content` itself if it is what `claim` describes, else PayloadCorrupt."""
    if claim.size is not None and len(content) != claim.size:
        raise PayloadCorrupt(claim.digest, f"{len(content)} bytes stored, the claim says {claim.size}")
    actual = sha256_digest(content)
    if actual != claim.digest:
        raise PayloadCorrupt(claim.digest, f"the stored bytes hash to {actual}")
    return content


class PayloadPlane:
    def __init__(self, default: PayloadStore, readers: Iterable[PayloadStore] = ()) -> None:
        self.default = default
        self.stores: dict[str, PayloadStore] = {default.name: default}
        for store in readers:
            self.stores.setdefault(store.name, store)

    def store_of(self, claim: PayloadClaim) -> PayloadStore:
        store = self.stores.get(claim.store)
        if store is None:
            raise PayloadStoreError(
                f"payload {claim.digest} is in store {claim.store!r}, which this process is not configured "
                f"with (it has {sorted(self.stores)})"
            )
        return store

    def claim(self, content: bytes, media_type: str) -> PayloadClaim:
        """The claim `put` would return for `content` (no I/O)."""
        return PayloadClaim.of(content, media_type, self.default.name)

    def put(self, items: Sequence[tuple[bytes, str]]) -> list[PayloadClaim]:
        """Stores each `(content, media_type)` in the default store; durable on return."""
        claims = [self.claim(content, media_type) for content, media_type in items]
        self.put_claimed(list(zip(claims, (content for content, _ in items), strict=True)))
        return claims

    def put_claimed(self, items: Sequence[tuple[PayloadClaim, bytes]]) -> None:
        """Stores each `(claim, content)`, its claim made by `claim` (so the bytes are hashed once, by
        whoever needed the digest first); durable on return."""
        for claim, content in items:
            if claim.store != self.default.name or claim.size != len(content):
                raise PayloadStoreError(
                    f"payload {claim.digest} is claimed for store {claim.store!r} with {claim.size} bytes; "
                    f"this plane writes to {self.default.name!r} and was given {len(content)} bytes"
                )
        self.default.put_many({claim.digest: content for claim, content in items})

    def get(self, claim: PayloadClaim) -> bytes:
        """The payload of `claim`, checked; PayloadMissing or PayloadCorrupt."""
        content = self.store_of(claim).get_many([claim.digest]).get(claim.digest)
        if content is None:
            raise PayloadMissing(claim.digest, claim.store)
        return verify(claim, content)

    def get_many(self, claims: Iterable[PayloadClaim]) -> dict[str, bytes]:
        """The checked payload of every claim, by digest: one call per store; PayloadMissing for the
        first that is not stored, PayloadCorrupt for the first that does not verify."""
        by_store: dict[str, dict[str, PayloadClaim]] = {}
        for claim in claims:
            by_store.setdefault(claim.store, {})[claim.digest] = claim
        found: dict[str, bytes] = {}
        for name, wanted in by_store.items():
            store = self.store_of(next(iter(wanted.values())))
            got = store.get_many(list(wanted))
            for digest, claim in wanted.items():
                content = got.get(digest)
                if content is None:
                    raise PayloadMissing(digest, name)
                found[digest] = verify(claim, content)
        return found

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


__all__ = ["PayloadPlane", "verify"]
