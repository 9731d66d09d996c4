"""The running digest of the log that projection checkpoints record (docs/events.md, The hash chain).

The per-stream hash chain cannot see a row removed from the end of a stream,
nor a whole stream removed; a digest over every event's `hash` in position
order can.  A plain chain `d_p = sha256(d_{p-1} ‖ hash_p)` costs one sha256
call per event, a fifth of a replay's budget, so the chain is taken per
block of `BLOCK` positions instead:

    D_k = sha256(D_{k-1} ‖ hash_{(k-1)B+1} ‖ … ‖ hash_{kB})          (D_0 = 64 zeros)
    digest(p) = sha256(D_{⌊p/B⌋} ‖ hash_{⌊p/B⌋B+1} ‖ … ‖ hash_p)

A checkpoint at p stores `"<B>:<⌊p/B⌋B>:<D_⌊p/B⌋>:<digest(p)>"`; whoever resumes
from it re-reads the at most B-1 rows after the block start, checks them
against `digest(p)`, and carries on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

BLOCK = 1024  # a power of two
GENESIS = "0" * 64


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredDigest:
    block: int
    block_position: int
    block_digest: str
    digest: str

    def encode(self) -> str:
        return f"{self.block}:{self.block_position}:{self.block_digest}:{self.digest}"

    @classmethod
    def decode(cls, text: str) -> StoredDigest:
        block, start, block_digest, digest = text.split(":")
        return cls(int(block), int(start), block_digest, digest)


@dataclass(slots=True)
class LogDigest:
    """The running digest; `add` every event's hash in position order (positions are contiguous)."""

    block_position: int = 0
    block_digest: str = GENESIS
    pending: list[str] = field(default_factory=list)

    def add(self, position: int, event_hash: str) -> None:
        self.pending.append(event_hash)
        if position % BLOCK == 0:
            self.close_block(position)

    def close_block(self, position: int) -> None:
        self.block_digest = _sha(self.block_digest + "".join(self.pending))
        self.block_position = position
        self.pending.clear()

    def value(self) -> str:
        return _sha(self.block_digest + "".join(self.pending))

    def stored(self) -> StoredDigest:
        return StoredDigest(BLOCK, self.block_position, self.block_digest, self.value())

    @classmethod
    def resume(cls, stored: StoredDigest, hashes_after_block: list[str]) -> LogDigest:
        """The digest at a checkpoint, from its stored value and the rows since its block start."""
        if stored.block != BLOCK:
            raise ValueError(f"digest block size {stored.block} differs from this reader's {BLOCK}")
        resumed = cls(stored.block_position, stored.block_digest, list(hashes_after_block))
        if resumed.value() != stored.digest:
            raise ValueError(
                f"the log between positions {stored.block_position} and the checkpoint no longer matches its digest"
            )
        return resumed
