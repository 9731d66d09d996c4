"""`PayloadClaim`: what an event carries in place of a payload, and describes the payload by itself.

The claim names the store the payload went to, its digest (`sha256:<hex>`: the hash algorithm is the
prefix, the one digest format of the project), its size in bytes and its media type, so a reader can
check what it fetched and refuse a mismatch, and knows how to decode it without asking anyone.
"""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, ConfigDict, Field

from protocol.digests import Digest, sha256_digest

#: Claims of payloads written before claims existed, kept in the log's own blob table.
LOG_BLOBS_STORE: Final = "log"
_STORE_NAME = r"^[a-z][a-z0-9_.-]{0,63}$"


class PayloadClaim(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    store: str = Field(pattern=_STORE_NAME)
    digest: Digest
    # None only in claims upcast from events written before claims recorded a size.
    size: int | None = Field(ge=0)
    media_type: str = Field(min_length=1, max_length=200)

    @property
    def algorithm(self) -> str:
        return self.digest.partition(":")[0]

    @classmethod
    def of(cls, content: bytes, media_type: str, store: str) -> PayloadClaim:
        """The claim of `content` as it will be stored in `store` (no I/O)."""
        return cls(store=store, digest=sha256_digest(content), size=len(content), media_type=media_type)

    @classmethod
    def legacy(cls, digest: str, media_type: str) -> PayloadClaim:
        """The claim of a payload an older event named by digest alone: in the log's blob table."""
        return cls(store=LOG_BLOBS_STORE, digest=digest, size=None, media_type=media_type)


__all__ = ["LOG_BLOBS_STORE", "PayloadClaim"]
