"""What one batch of the journal's group commit is made of (`trainer.journal`): the queued appends
(`Request`), what a build sees of its group while earlier appends of the batch are not yet written
(`Lookahead`), and each event as stored, with the id that makes a retried append a no-op."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from eventstore import ExpectedVersion, NewEvent, RecordedEvent
from eventstore.events import Event
from eventstore.records import UNIT_SEPARATOR, uuid5_text
from projections.ledger import LedgerProjection, LedgerState, lookahead
from protocol.streams import group_of_stream

# Deterministic event ids make a retried append (after the database went away mid-commit) a no-op.
EVENT_NS = uuid.UUID("6f1d7c1e-4d0e-4b55-9f0e-2b7a61c0a8d1")


class Folded(Protocol):
    """The journal as a batch's builds read it: the log folded up to `position`."""

    ledger: LedgerState
    versions: dict[str, int]
    ledger_projection: LedgerProjection
    position: int


class Lookahead:
    """What a build sees in a batch: the ledger, or for a group stream with earlier appends in the
    batch, a copy of its group with their events folded in (at the positions they will most likely
    get: only `apply`'s bookkeeping reads them, no build does)."""

    def __init__(self, journal: Folded) -> None:
        self.journal = journal
        self.pending: dict[str, list[Event]] = {}
        self.views: dict[str, tuple[LedgerState, int]] = {}  # stream -> (copy, events folded into it)
        self.position = journal.position

    def written(self, request: Request) -> None:
        self.pending.setdefault(request.stream, []).extend(request.events)

    def view(self, stream: str) -> LedgerState:
        events = self.pending.get(stream)
        if not events:
            return self.journal.ledger
        state, folded = self.views.get(stream) or (
            lookahead(self.journal.ledger, group_of_stream(stream) or ""),
            0,
        )
        version = self.journal.versions.get(stream, ExpectedVersion.NO_STREAM) + folded
        project = self.journal.ledger_projection
        for event in events[folded:]:
            version += 1
            self.position += 1
            project.apply(state, _provisional(stream, version, self.position, event), event)
        self.views[stream] = (state, len(events))
        return state


def _provisional(stream: str, version: int, position: int, event: Event) -> RecordedEvent:
    return RecordedEvent(
        position, stream, version, "", event.event_type(), event.schema_version, "", "{}", 0.0, "", ""
    )


def new_event(stream: str, version: int, event: Event, writer: str) -> NewEvent:
    """The event as stored, with an id derived from who writes it, where it goes and what it says.

    The id hashes the event's own JSON (pydantic writes fields in declaration order, so equal events
    give equal text): a retry of the same append by the same writer names the same ids and is a
    no-op, while two writers appending the same event at the same version (two trainers claiming one
    group) name different ids, so the second is refused instead of told it succeeded.
    """
    text = event.model_dump_json()
    type_ = event.event_type()
    digest = hashlib.sha256(
        UNIT_SEPARATOR.join((writer, stream, str(version), type_, text)).encode()
    ).hexdigest()
    return NewEvent(
        type=type_,
        data={},  # the store writes `validated_json` and never reads the dict (a dump cost 2-5 us)
        event_id=uuid5_text(EVENT_NS.bytes, digest),
        schema_version=event.schema_version,
        validated_json=text,
    )


@dataclass(eq=False)
class Request:
    """One queued `append`: what its caller asked for and the future it awaits."""

    stream: str
    build: Sequence[Event] | Callable[[LedgerState], Sequence[Event]]
    blobs: Sequence[bytes]
    future: asyncio.Future[list[Event]]
    events: list[Event] = field(default_factory=list)
    # The append starts its stream: finding it there is `StreamExists`, not a fence.
    create: bool = False
    # (expected version, events with their ids), fixed on the first attempt so that retries repeat it.
    prepared: tuple[int, list[NewEvent]] | None = None


def resolve(request: Request, events: list[Event]) -> None:
    if not request.future.done():
        request.future.set_result(events)


def fail(request: Request, exc: BaseException) -> None:
    if not request.future.done():
        request.future.set_exception(exc)
