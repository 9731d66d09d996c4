"""The payloads' share of `ledger audit` (`audit_log(store, payloads=True)`).

Three rules (docs/events.md, Invariants):

- `payload-stored`: every payload an event names by digest (a sibling's token records, a kept reply,
  a logprobs array) is in the log's blob table.
- `payload-intact`: every blob read back hashes to its digest, named or not.
- `database-integrity`: the database's own check (SQLite's `PRAGMA integrity_check`; PostgreSQL's
  data-checksum failure count) finds nothing.

The digests are gathered in the auditor's one pass over the log (`PayloadFacts`); the checks then read
the blobs a batch at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from eventstore import EventStore
from eventstore.errors import EventStoreError
from eventstore.events import Event, LogprobsComputed, RunReplied, SiblingHeld, SiblingSealed
from protocol.digests import sha256_digest

PAYLOAD_STORED: Final = "payload-stored"
PAYLOAD_INTACT: Final = "payload-intact"
DATABASE_INTEGRITY: Final = "database-integrity"
PAYLOAD_RULES: Final = (PAYLOAD_STORED, PAYLOAD_INTACT, DATABASE_INTEGRITY)

_BATCH: Final = 256  # blobs per read: bounded memory
_MAX_LISTED: Final = 20


def _reply(e: RunReplied) -> tuple[str, ...]:
    return () if e.mask_sample else (e.reply_digest,)  # a masked reply is never stored


# The events that name payloads, by class (a lookup per event: the audit's pass is a hot loop).
DIGESTS_OF: Final[dict[type[Event], Callable[[Any], tuple[str, ...]]]] = {
    SiblingHeld: lambda e: (e.receipt.tokens_digest,),
    SiblingSealed: lambda e: (e.receipt.tokens_digest,),
    RunReplied: _reply,
    LogprobsComputed: lambda e: (e.blob_digest,),
}


@dataclass(slots=True)
class PayloadFacts:
    named: dict[str, int] = field(default_factory=dict)  # digest -> the first position naming it

    def see(self, position: int, digests: tuple[str, ...]) -> None:
        for digest in digests:
            self.named.setdefault(digest, position)


@dataclass(slots=True)
class PayloadAuditSummary:
    """What the payload checks read (printed by `ledger audit`, in its JSON report)."""

    named: int = 0
    checked: int = 0
    checked_bytes: int = 0
    missing: int = 0
    corrupt: int = 0
    blobs: int = 0
    database: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "named": self.named,
            "checked": self.checked,
            "checked_bytes": self.checked_bytes,
            "missing": self.missing,
            "corrupt": self.corrupt,
            "blobs": self.blobs,
            "database": self.database,
        }


Violate = Callable[[str, list[int], str], None]


def check_payloads(
    store: EventStore, facts: PayloadFacts, violate: Violate, summary: PayloadAuditSummary
) -> None:
    """Every named digest stored; every blob of the table intact (each read once, in digest order)."""
    summary.named = len(facts.named)
    seen: set[str] = set()
    try:
        for digest, content in store.iter_blobs(_BATCH):
            summary.blobs += 1
            seen.add(digest)
            actual = sha256_digest(content)
            if digest in facts.named:
                summary.checked += 1
                summary.checked_bytes += len(content)
            if actual != digest:
                summary.corrupt += 1
                at = facts.named.get(digest)
                where = f" named at {at}" if at is not None else ""
                violate(
                    PAYLOAD_INTACT,
                    [at] if at is not None else [],
                    f"the blob {digest}{where} was altered: its stored bytes hash to {actual}",
                )
    except EventStoreError as exc:  # a damaged file: database-integrity says more
        violate(PAYLOAD_INTACT, [], f"the log's blob table cannot be read whole: {exc}")
        return
    missing = sorted((at, d) for d, at in facts.named.items() if d not in seen)
    if missing:
        summary.missing = len(missing)
        at, first = missing[0]
        violate(
            PAYLOAD_STORED,
            [p for p, _ in missing[:_MAX_LISTED]],
            f"{len(missing)} payload(s) named by events are not stored, the first {first} (named at {at})",
        )


def check_database(store: EventStore, violate: Violate, summary: PayloadAuditSummary) -> None:
    ok, report = store.integrity_check()
    summary.database = report
    if not ok:
        violate(DATABASE_INTEGRITY, [], f"the database's own integrity check failed: {report}")


__all__ = [
    "DATABASE_INTEGRITY",
    "DIGESTS_OF",
    "PAYLOAD_INTACT",
    "PAYLOAD_RULES",
    "PAYLOAD_STORED",
    "PayloadAuditSummary",
    "PayloadFacts",
    "check_database",
    "check_payloads",
]
