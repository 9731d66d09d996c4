"""What every projection is: a named, versioned, pure fold over the log with a state hash.

"Pure" here means `apply` depends only on the state and the event: no I/O, no
clock, no randomness.  `apply` mutates the state in place (a fresh copy per
event would cost more than the whole decode), so a caller that needs an
unchanged state keeps a dump of it.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import TypeAdapter

from eventstore import RecordedEvent
from eventstore.errors import InvalidEvent, UnknownEventType, UnknownSchemaVersion
from eventstore.events import EVENT_TYPES, Event
from protocol.digests import canonical_json

S = TypeVar("S")

# What `RecordedEvent.decode` raises for a row the reader cannot trust or understand.
DECODE_ERRORS = (UnknownEventType, UnknownSchemaVersion, InvalidEvent)


class ReplayRefused(Exception):
    """A projection will not be built past an event it cannot decode."""

    def __init__(self, position: int, reason: str) -> None:
        self.position, self.reason = position, reason
        super().__init__(f"replay stopped before position {position}: {reason}")


canonical = canonical_json  # the one canonical JSON (docs/protocol.md, Canonical JSON and digests)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Projection(ABC, Generic[S]):
    name: ClassVar[str]
    version: ClassVar[int]
    # The event types `apply` reacts to; None: every event (e.g. to track the position).  A fold
    # skips the call for the others, which is most of the log for a narrow projection.
    handles: ClassVar[frozenset[type[Event]] | None] = None

    @abstractmethod
    def initial(self) -> S: ...

    @abstractmethod
    def apply(self, state: S, event: RecordedEvent, decoded: Event) -> None: ...

    @abstractmethod
    def dump(self, state: S) -> dict[str, Any]:
        """The state as JSON-ready data (what a projection checkpoint stores)."""

    @abstractmethod
    def load(self, data: dict[str, Any]) -> S: ...

    def dumps(self, state: S) -> str:
        return canonical(self.dump(state))

    def loads(self, text: str) -> S:
        return self.load(json.loads(text))

    def state_hash(self, state: S) -> str:
        """sha256 of the canonical JSON of the dump: equal states hash equal, however they were built."""
        return sha256_text(self.dumps(state))


class TypedProjection(Projection[S]):
    """A projection whose state type (a pydantic model or a dataclass with pydantic config) is its shape.

    The type is the single source of truth: checkpoints are dumped and
    validated through one TypeAdapter over it, so a stored state that does not
    fit the shape fails loudly on load.
    """

    state_type: ClassVar[Any]

    @classmethod
    def adapter(cls) -> TypeAdapter[Any]:
        found = cls.__dict__.get("_adapter")
        if found is None:
            found = TypeAdapter(cls.state_type)
            cls._adapter = found  # type: ignore[attr-defined]
        return found

    def dump(self, state: S) -> dict[str, Any]:
        data: dict[str, Any] = self.adapter().dump_python(state, mode="json")
        return data

    def load(self, data: dict[str, Any]) -> S:
        return self.adapter().validate_python(data)  # type: ignore[no-any-return]

    def loads(self, text: str) -> S:
        # Parsing and validating in one pass in pydantic-core beats json.loads + validate_python.
        return self.adapter().validate_json(text)  # type: ignore[no-any-return]


# type name -> (schema version, the model's validator): `decode` calls pydantic-core directly on the
# stored JSON text, skipping two layers of Python wrappers that cost a third of a decode.
FAST_DECODERS: dict[str, tuple[int, Any]] = {}


def decode(event: RecordedEvent) -> Event:
    """The typed event, or ReplayRefused saying where and why it cannot be read."""
    fast = FAST_DECODERS.get(event.type)
    if fast is None:
        cls = EVENT_TYPES.get(event.type)
        if cls is not None:
            fast = FAST_DECODERS[event.type] = (cls.schema_version, cls.__pydantic_validator__)
    if fast is not None and fast[0] == event.schema_version:
        try:
            decoded: Event = fast[1].validate_json(event.data_json)
            return decoded
        except ValueError:
            pass  # the full path below words the error
    try:
        return event.decode()
    except DECODE_ERRORS as exc:
        raise ReplayRefused(event.position, str(exc)) from exc


def fold(projection: Projection[S], events: Iterable[RecordedEvent], state: S | None = None) -> S:
    """Applies `events` to `state` (or a fresh one); refuses to go past an undecodable event."""
    current = projection.initial() if state is None else state
    apply = projection.apply
    for event in events:
        apply(current, event, decode(event))
    return current


def fold_many(
    projections: Sequence[Projection[Any]], events: Iterable[RecordedEvent], states: list[Any] | None = None
) -> tuple[list[Any], int]:
    """Decodes each event once and feeds it to every projection; returns the states and the last position."""
    current = [p.initial() for p in projections] if states is None else states
    routes = Routes(projections, current)
    position = 0
    for event in events:
        decoded = decode(event)
        for apply, state in routes.get(decoded):
            apply(state, event, decoded)
        position = event.position
    return current, position


class Routes:
    """Which (apply, state) pairs each event type goes to, built once per type as the fold meets it."""

    def __init__(self, projections: Sequence[Projection[Any]], states: Sequence[Any]) -> None:
        self._pairs = list(zip(projections, states, strict=True))
        self.by_type: dict[type[Event], list[tuple[Callable[[Any, RecordedEvent, Event], None], Any]]] = {}

    def get(self, decoded: Event) -> list[tuple[Callable[[Any, RecordedEvent, Event], None], Any]]:
        kind = type(decoded)
        found = self.by_type.get(kind)
        if found is None:
            found = self.by_type[kind] = [
                (p.apply, s) for p, s in self._pairs if p.handles is None or kind in p.handles
            ]
        return found
