"""The payload plane's share of `ledger audit`.

Three rules (docs/events.md, Invariants):

- `payload-stored`: every payload an event claims is in the store the claim names.
- `payload-intact`: every payload read back hashes to its digest and has its claimed size; so does
  every row of the log's own blob table (older logs), referenced or not.  Token records stored
  beside their reply (form version 2) also read back whole with the reply their try's `RunReplied`
  claims: every output item they refer to is in it.  A reply stored apart from its records' arrays
  (`payloads.replies`) made whole with them is the reply its receipt names (its canonical JSON has
  the try's `reply_digest`).
- `database-integrity`: the database's own check (SQLite's `PRAGMA integrity_check`; PostgreSQL's
  data-checksum failure count) finds nothing.

The claims are gathered in the auditor's one pass over the log (`PayloadFacts`);
`check_payloads` then reads the payloads back through the plane, a batch at a time, and is the only
part that touches the payload stores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import orjson

from eventstore import EventStore
from eventstore.errors import EventStoreError
from eventstore.events import Event, LogprobsComputed, RunReplied, SiblingHeld, SiblingSealed
from payloads import (
    LOG_BLOBS_STORE,
    PayloadClaim,
    PayloadPlane,
    PayloadStoreError,
    PayloadStoreUnavailable,
)
from payloads.replies import put_arrays_back
from protocol.digests import canonical_bytes, sha256_digest
from protocol.token_codec import REFERRING_MEDIA_TYPES, TokenCodecError, decode_any

PAYLOAD_STORED: Final = "payload-stored"
PAYLOAD_INTACT: Final = "payload-intact"
DATABASE_INTEGRITY: Final = "database-integrity"
PAYLOAD_RULES: Final = (PAYLOAD_STORED, PAYLOAD_INTACT, DATABASE_INTEGRITY)

_T = TypeVar("_T")
_BATCH: Final = 256  # payloads per read (a sealed group's worth or more; bounded memory)
_MAX_LISTED: Final = 20


@dataclass(frozen=True, slots=True)
class ClaimedPayload:
    """The first claim of a digest in the log, and where it is."""

    claim: PayloadClaim
    position: int


@dataclass(slots=True)
class PayloadFacts:
    claimed: dict[str, ClaimedPayload] = field(default_factory=dict)
    last_claimed: dict[str, int] = field(default_factory=dict)  # digest -> its latest claim's position
    pruned: dict[str, int] = field(default_factory=dict)  # digest -> the PayloadsPruned that named it
    # A try's reply claim, and the try of each token records claim stored beside its reply (version 2).
    replies: dict[tuple[str, int], PayloadClaim] = field(default_factory=dict)
    beside_reply: dict[str, tuple[str, int]] = field(default_factory=dict)
    # A reply stored apart from its records' arrays: (its claim, the records', the receipt's digest).
    apart: list[tuple[PayloadClaim, PayloadClaim, str, int]] = field(default_factory=list)

    def see(self, position: int, claims: Iterable[PayloadClaim]) -> None:
        for claim in claims:
            if claim.digest not in self.claimed:
                self.claimed[claim.digest] = ClaimedPayload(claim, position)
            self.last_claimed[claim.digest] = position

    def see_try(self, event: Event, position: int) -> None:
        """Which reply a try's token records are stored beside (RunReplied, SiblingHeld/Sealed), and
        which replies are stored apart from them."""
        if isinstance(event, RunReplied):
            reply = event.reply_claim()
            if reply is not None:
                self.replies[(event.rollout_id, event.attempt_index)] = reply
                if event.apart_from is not None:
                    self.apart.append((reply, event.apart_from, event.reply_digest, position))
        elif isinstance(event, SiblingHeld | SiblingSealed):
            claim = event.receipt.tokens_claim()
            if claim.media_type in REFERRING_MEDIA_TYPES:
                self.beside_reply[claim.digest] = (event.receipt.rollout_id, event.receipt.attempt_index)

    def see_pruned(self, position: int, digests: Iterable[str]) -> None:
        for digest in digests:
            self.pruned[digest] = position

    def is_pruned(self, digest: str) -> bool:
        """Named by retention after its last claim: deleted on purpose, not lost."""
        return self.pruned.get(digest, -1) > self.last_claimed.get(digest, -1)


@dataclass(slots=True)
class PayloadAuditSummary:
    """What the payload checks saw (printed by `ledger audit`, in its JSON report)."""

    claimed: int = 0
    pruned: int = 0  # claimed payloads retention deleted (not missing)
    checked: int = 0
    checked_bytes: int = 0
    missing: int = 0
    corrupt: int = 0
    log_blobs: int = 0
    database: str = ""

    def as_json(self) -> dict[str, object]:
        return {
            "claimed": self.claimed,
            "pruned": self.pruned,
            "checked": self.checked,
            "checked_bytes": self.checked_bytes,
            "missing": self.missing,
            "corrupt": self.corrupt,
            "log_blobs": self.log_blobs,
            "database": self.database,
        }


Violate = Callable[[str, list[int], str], None]


def _reply(e: RunReplied) -> tuple[PayloadClaim, ...]:
    reply = e.reply_claim()
    return tuple(c for c in (reply, e.apart_from) if c is not None)


# The events that name payloads, by class (a lookup per event: the audit's pass is a hot loop).
CLAIMS_OF: Final[dict[type[Event], Callable[[Any], tuple[PayloadClaim, ...]]]] = {
    SiblingHeld: lambda e: (e.receipt.tokens_claim(),),
    SiblingSealed: lambda e: (e.receipt.tokens_claim(),),
    RunReplied: _reply,
    LogprobsComputed: lambda e: (e.logprobs_claim(),),
}


def _batches(items: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(items), _BATCH):
        yield items[start : start + _BATCH]


def check_payloads(
    facts: PayloadFacts, plane: PayloadPlane, violate: Violate, summary: PayloadAuditSummary
) -> None:
    """Reads back every claimed payload (a batch per store at a time) and checks it against its claim."""
    summary.claimed = len(facts.claimed)
    by_store: dict[str, list[str]] = {}
    for digest, known in facts.claimed.items():
        by_store.setdefault(known.claim.store, []).append(digest)
    missing: list[tuple[int, str]] = []
    looked: list[str] = []  # where the missing ones were looked for
    intact: set[str] = set()  # read back and matching their claims
    for name, digests in sorted(by_store.items()):
        store = plane.stores.get(name)
        if store is None:
            positions = sorted(facts.claimed[d].position for d in digests)
            violate(
                PAYLOAD_STORED,
                positions[:_MAX_LISTED],
                f"{len(digests)} payload(s) are claimed in store {name!r}, which the audit was not given "
                f"(it has {sorted(plane.stores)}): pass it with --payloads",
            )
            continue
        for batch in _batches(sorted(digests)):
            try:
                got = store.get_many(batch)
            except PayloadStoreUnavailable:
                raise
            except PayloadStoreError as exc:
                violate(PAYLOAD_STORED, [facts.claimed[batch[0]].position], f"store {name!r}: {exc}")
                continue
            for digest in batch:
                known = facts.claimed[digest]
                content = got.get(digest)
                if content is None:
                    if facts.is_pruned(digest):
                        summary.pruned += 1
                    else:
                        missing.append((known.position, digest))
                        if f"{name!r} ({store.where})" not in looked:
                            looked.append(f"{name!r} ({store.where})")
                    continue
                summary.checked += 1
                summary.checked_bytes += len(content)
                actual = sha256_digest(content)
                size = known.claim.size
                if actual == digest and (size is None or size == len(content)):
                    intact.add(digest)
                else:
                    summary.corrupt += 1
                    what = (
                        f"hash to {actual}" if actual != digest else f"are {len(content)} bytes, not {size}"
                    )
                    violate(
                        PAYLOAD_INTACT,
                        [known.position],
                        f"the payload {digest} claimed at {known.position} ({known.claim.media_type}, store "
                        f"{name!r}) was altered: its stored bytes {what}",
                    )
    _check_beside_reply(facts, plane, intact, violate)
    _check_apart(facts, plane, intact, violate)
    if missing:
        summary.missing = len(missing)
        missing.sort()
        first_position, first = missing[0]
        violate(
            PAYLOAD_STORED,
            [p for p, _ in missing[:_MAX_LISTED]],
            f"{len(missing)} claimed payload(s) are not stored in store {', '.join(looked)}, "
            f"the first {first} (claimed at {first_position})",
        )


def _read_in_batches(
    plane: PayloadPlane,
    items: list[_T],
    claims: Callable[[_T], tuple[PayloadClaim, ...]],
    position: Callable[[_T], int],
    what: str,
    violate: Violate,
) -> Iterator[tuple[_T, dict[str, bytes]]]:
    """Each item with the payloads read by its claims, a batch of items per read; a batch the plane
    refuses (changed since it was read back) is said where it is read, as `what`."""
    for start in range(0, len(items), _BATCH // 2):
        batch = items[start : start + _BATCH // 2]
        try:
            got = plane.get_many([c for item in batch for c in claims(item)])
        except PayloadStoreUnavailable:
            raise
        except PayloadStoreError as exc:
            violate(PAYLOAD_INTACT, [position(batch[0])], f"{what}: {exc}")
            continue
        for item in batch:
            yield item, got


def _check_beside_reply(facts: PayloadFacts, plane: PayloadPlane, intact: set[str], violate: Violate) -> None:
    """Token records stored beside their reply, each read with it (both intact: a damaged one is
    reported already): the output items they refer to are the reply's."""
    pairs = [
        (digest, reply)
        for digest, attempt in sorted(facts.beside_reply.items())
        if digest in intact and (reply := facts.replies.get(attempt)) is not None and reply.digest in intact
    ]
    for (digest, reply), got in _read_in_batches(
        plane,
        pairs,
        lambda pair: (facts.claimed[pair[0]].claim, pair[1]),
        lambda pair: facts.claimed[pair[0]].position,
        "token records beside replies",
        violate,
    ):
        try:
            decode_any(got[digest], facts.claimed[digest].claim.media_type, orjson.loads(got[reply.digest]))
        except (TokenCodecError, orjson.JSONDecodeError) as exc:
            known = facts.claimed[digest]
            violate(
                PAYLOAD_INTACT,
                [known.position],
                f"the token records {digest} claimed at {known.position} do not read back with their "
                f"try's reply {reply.digest}: {exc}",
            )


def _check_apart(facts: PayloadFacts, plane: PayloadPlane, intact: set[str], violate: Violate) -> None:
    """Replies stored apart from their records' arrays, each made whole with them (both intact: a
    damaged or pruned one is counted already): the reply its receipt names."""
    tries = [t for t in facts.apart if t[0].digest in intact and t[1].digest in intact]
    for (reply, tokens, digest, position), got in _read_in_batches(
        plane, tries, lambda t: (t[0], t[1]), lambda t: t[3], "replies stored apart", violate
    ):
        try:
            whole = put_arrays_back(orjson.loads(got[reply.digest]), got[tokens.digest])
            made = sha256_digest(canonical_bytes(whole))
        except (TokenCodecError, orjson.JSONDecodeError, TypeError, ValueError) as exc:
            made = f"nothing ({exc})"
        if made != digest:
            violate(
                PAYLOAD_INTACT,
                [position],
                f"the reply {reply.digest} stored apart at {position}, made whole with its token "
                f"records {tokens.digest}, is not the reply its receipt names ({digest}): it makes {made}",
            )


def check_log_blobs(
    store: EventStore, facts: PayloadFacts, violate: Violate, summary: PayloadAuditSummary
) -> None:
    """Every row of the log's own blob table against its digest, claimed or not (older logs)."""
    try:
        _check_log_blobs(store, facts, violate, summary)
    except EventStoreError as exc:  # a damaged file: database-integrity says more
        violate(PAYLOAD_INTACT, [], f"the log's blob table cannot be read whole: {exc}")


def _check_log_blobs(
    store: EventStore, facts: PayloadFacts, violate: Violate, summary: PayloadAuditSummary
) -> None:
    for digest, content in store.iter_blobs():
        summary.log_blobs += 1
        actual = sha256_digest(content)
        if actual != digest:
            known = facts.claimed.get(digest)
            if known is not None and known.claim.store == LOG_BLOBS_STORE:
                continue  # check_payloads reports it at the event that claims it
            summary.corrupt += 1
            violate(
                PAYLOAD_INTACT,
                [known.position] if known is not None else [],
                f"the log's blob {digest} was altered: its stored bytes hash to {actual}",
            )


def check_database(store: EventStore, violate: Violate, summary: PayloadAuditSummary) -> None:
    ok, report = store.integrity_check()
    summary.database = report
    if not ok:
        violate(DATABASE_INTEGRITY, [], f"the database's own integrity check failed: {report}")


__all__ = [
    "CLAIMS_OF",
    "DATABASE_INTEGRITY",
    "PAYLOAD_INTACT",
    "PAYLOAD_RULES",
    "PAYLOAD_STORED",
    "ClaimedPayload",
    "PayloadAuditSummary",
    "PayloadFacts",
    "check_database",
    "check_log_blobs",
    "check_payloads",
]
