"""What goes into the log (`NewEvent`) and what comes out of it (`RecordedEvent`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import partial
from typing import Any, NamedTuple

from pydantic import TypeAdapter, ValidationError

from eventstore.errors import EventStoreError, InvalidEvent, UnknownEventType, UnknownSchemaVersion
from eventstore.events import EVENT_TYPES, Event
from eventstore.upcasting import upcast
from protocol.digests import canonical_json
from protocol.wire import validation_line

GENESIS_HASH = "0" * 64
# The unit separator never occurs unescaped in JSON text nor in a UUID, a valid stream id or an event
# type: the hash chain joins an event's fields with it, and so does the PostgreSQL append's packing.
UNIT_SEPARATOR = "\x1f"


def new_event_ids(n: int) -> list[str]:
    """`n` random (version 4, RFC 4122) UUIDs as text, from one read of the OS's random source.

    `str(uuid.uuid4())` costs 2.7 us an id, most of it `UUID.__init__`'s checks; this costs 0.8 us an
    id at 10 (one append's ids; measured with timeit, both round-tripping through `uuid.UUID`)."""
    raw = bytearray(os.urandom(16 * n))
    for i in range(6, 16 * n, 16):
        raw[i] = raw[i] & 0x0F | 0x40  # version 4
        raw[i + 2] = raw[i + 2] & 0x3F | 0x80  # the RFC 4122 variant
    h = raw.hex()
    return [
        f"{h[i : i + 8]}-{h[i + 8 : i + 12]}-{h[i + 12 : i + 16]}-{h[i + 16 : i + 20]}-{h[i + 20 : i + 32]}"
        for i in range(0, 32 * n, 32)
    ]


def uuid5_text(namespace: bytes, name: str) -> str:
    """`str(uuid.uuid5(uuid.UUID(bytes=namespace), name))` without building the UUID objects (2 us of
    its 3: `UUID.__init__`'s checks, then `__str__`)."""
    raw = bytearray(hashlib.sha1(namespace + name.encode()).digest()[:16])
    raw[6] = raw[6] & 0x0F | 0x50  # version 5
    raw[8] = raw[8] & 0x3F | 0x80  # the RFC 4122 variant
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# A UUID as `str(uuid.UUID(...))` writes it: a chosen id in this form is stored as it is, unparsed.
_UUID_TEXT = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def canonical_uuid(text: str) -> str:
    """`text` as `str(uuid.UUID(text))` writes it; ValueError when it is no UUID.  Text already in
    that form is returned as it is (a match, not a parse: 0.3 us instead of 1.5)."""
    if _UUID_TEXT.fullmatch(text):
        return text
    return str(uuid.UUID(text))


class ExpectedVersion(IntEnum):
    """Expected version of a stream before an append; an int >= 0 names an exact version."""

    ANY = -2
    NO_STREAM = -1


# The one canonical JSON (docs/protocol.md, Canonical JSON and digests), defined beside the wire models that hash with it.
canonical = canonical_json


def chain_hash(
    prev_hash: str,
    stream_id: str,
    stream_version: int,
    event_id: str,
    type_: str,
    schema_version: int,
    data_json: str,
    metadata_json: str,
) -> str:
    """`sha256(prev_hash ‖ canonical(event))`, over the exact stored JSON text."""
    body = UNIT_SEPARATOR.join(
        (
            prev_hash,
            stream_id,
            str(stream_version),
            event_id,
            type_,
            str(schema_version),
            data_json,
            metadata_json,
        )
    )
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append, untyped: `type` and `data` as they will be stored."""

    type: str
    # Left empty where `validated_json` is given: the store writes that text and never reads the dict.
    data: dict[str, Any]
    event_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    schema_version: int | None = None
    # Set by `of()`: the JSON text of an already-validated typed event, stored as is.
    validated_json: str | None = field(default=None, repr=False)

    @classmethod
    def of(
        cls, event: Event, event_id: str | uuid.UUID | None = None, metadata: dict[str, Any] | None = None
    ) -> NewEvent:
        """A typed catalogue event with a chosen id (e.g. a deterministic uuid5 for idempotency)."""
        return cls(
            type=event.event_type(),
            data=event.model_dump(mode="json"),
            event_id=str(event_id) if event_id is not None else None,
            metadata=metadata or {},
            schema_version=event.schema_version,
            validated_json=event.model_dump_json(),
        )


class RecordedEvent(NamedTuple):
    """One row of the log.  `data`/`metadata` are parsed from the stored JSON on access.

    A named tuple, not a model: replay builds millions of these straight from
    driver rows, and `decode()` validates the payload against its pydantic model.
    """

    position: int
    stream_id: str
    stream_version: int
    event_id: str
    type: str
    schema_version: int
    data_json: str
    metadata_json: str
    recorded_at: float  # seconds since the epoch, the writer's clock
    prev_hash: str
    hash: str

    @property
    def data(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.data_json)
        return value

    @property
    def metadata(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.metadata_json)
        return value

    def decode(self) -> Event:
        """The typed catalogue event, upcast to the current schema version."""
        # Fast path (replay decodes millions): the current version of a known type, straight to the
        # model's compiled validator.
        current = _CURRENT.get(self.type)
        if current is not None and current[0] == self.schema_version:
            try:
                event: Event = current[1](self.data_json)
                return event
            except ValueError:  # ValidationError is a ValueError; _decode_slowly says which
                pass
        return self._decode_slowly()

    def _decode_slowly(self) -> Event:
        cls = EVENT_TYPES.get(self.type)
        if cls is None:
            raise UnknownEventType(f"position {self.position}: unknown event type {self.type!r}")
        try:
            if self.schema_version == cls.schema_version:
                return cls.model_validate_json(self.data_json)
            if self.schema_version > cls.schema_version:
                raise UnknownSchemaVersion(
                    f"position {self.position}: {self.type} has schema version {self.schema_version}, "
                    f"newer than this reader's {cls.schema_version}; upgrade the reader"
                )
            old = json.loads(self.data_json)
            if not isinstance(old, dict):
                raise InvalidEvent(f"position {self.position}: {self.type} payload is not a JSON object")
            return cls.model_validate(upcast(self.type, self.schema_version, cls.schema_version, old))
        except UnknownSchemaVersion as exc:
            if str(exc).startswith("position"):
                raise
            raise UnknownSchemaVersion(f"position {self.position}: {exc}") from None
        except ValidationError as exc:
            raise InvalidEvent(
                f"position {self.position}: {self.type} payload does not validate: {validation_line(exc, 'event')}"
            ) from exc
        except ValueError as exc:  # malformed JSON text
            raise InvalidEvent(
                f"position {self.position}: {self.type} payload is not valid JSON: {exc}"
            ) from exc

    def expected_hash(self) -> str:
        return chain_hash(
            self.prev_hash,
            self.stream_id,
            self.stream_version,
            self.event_id,
            self.type,
            self.schema_version,
            self.data_json,
            self.metadata_json,
        )


# type -> (its current schema version, the model's compiled JSON validator).  Keyed by the type
# alone: a (type, version) key built and hashed per event cost 5% of decoding (one run side by side).
_CURRENT: dict[str, tuple[int, Callable[[str], Any]]] = {
    name: (cls.schema_version, cls.__pydantic_validator__.validate_json) for name, cls in EVENT_TYPES.items()
}
_LIST_ADAPTERS: dict[tuple[str, int], TypeAdapter[list[Any]]] = {
    (name, cls.schema_version): TypeAdapter(list[cls])  # type: ignore[valid-type]
    for name, cls in EVENT_TYPES.items()
}


def decode_events(events: Sequence[RecordedEvent]) -> tuple[list[Event], EventStoreError | None]:
    """The typed events of a page, in order, up to the first one that cannot be decoded, and why not.

    Replay's one decode path (the store's typed reads and every projection rebuild): the current
    version of a known type goes straight to its model's compiled JSON validator; anything else
    (an upcast, or an event that fails) takes `RecordedEvent.decode`'s full path, whose error
    names the position.  One model call per event measured faster than validating a page's JSON
    array per type in one call (benchmarks/eventstore.py prints both).
    """
    current = _CURRENT
    decoded: list[Event] = []
    keep = decoded.append
    for event in events:
        entry = current.get(event.type)
        if entry is not None and entry[0] == event.schema_version:
            try:
                keep(entry[1](event.data_json))
                continue
            except ValueError:  # ValidationError is a ValueError; the full path words the error
                pass
        try:
            keep(event._decode_slowly())
        except (UnknownEventType, UnknownSchemaVersion, InvalidEvent) as exc:
            return decoded, exc
    return decoded, None


def decode_in_bulk(events: Sequence[RecordedEvent]) -> list[Event]:
    """The same events validated per type as one JSON array each (pydantic-core's list validator);
    kept to measure against `decode_events`, which replay uses.  Raises on the first bad event."""
    by_type: dict[tuple[str, int], list[int]] = {}
    for i, event in enumerate(events):
        by_type.setdefault((event.type, event.schema_version), []).append(i)
    out: list[Event | None] = [None] * len(events)
    for key, indexes in by_type.items():
        adapter = _LIST_ADAPTERS.get(key)
        if adapter is None:
            for i in indexes:
                out[i] = events[i].decode()
            continue
        values = adapter.validate_json("[" + ",".join(events[i].data_json for i in indexes) + "]")
        for i, value in zip(indexes, values, strict=True):
            out[i] = value
    return [e for e in out if e is not None]


# Builds a RecordedEvent from a driver row without a Python frame per row (replay's hot path).
from_row: Callable[[Sequence[Any]], RecordedEvent] = partial(tuple.__new__, RecordedEvent)


@dataclass(frozen=True, slots=True)
class Fence:
    """An append's precondition on another stream: `stream_id` must be at exactly `version`.

    An owner takes an epoch by appending to its own stream (e.g. `trainer-<id>`) and fences every
    later append on the version that left; a newer owner appends there too, and the stale owner's
    next fenced append is refused (`Fenced`) under the same lock that orders the write.
    """

    stream_id: str
    version: int

    def __post_init__(self) -> None:
        if not self.stream_id or self.version < ExpectedVersion.NO_STREAM:
            raise ValueError(f"invalid fence {self.stream_id!r} at version {self.version}")


@dataclass(frozen=True, slots=True)
class AppendResult:
    positions: list[int]
    stream_version: int
    idempotent: bool = False
    # The rows as written, hashes included (a writer folds them without reading them back); empty
    # for an idempotent append, whose rows the log already held.
    records: list[RecordedEvent] = field(default_factory=list)
