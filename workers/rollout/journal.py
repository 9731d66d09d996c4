"""The coordinator's only memory: appends to the log and the projections folded back from it.

Every append names the version this process last saw of its stream (fencing, protocol.md §7): a
second coordinator's write makes this one's next append fail, and this one stops for good.  After
each append the projections catch up from the log (not from the events in hand), so what the
coordinator knows is always what the log says, including other writers' events.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from eventstore import (
    DatabaseUnavailable,
    EventStore,
    ExpectedVersion,
    NewEvent,
    WrongExpectedVersion,
)
from eventstore.events import Event
from eventstore.records import canonical
from projections.base import fold_many
from projections.checkpoints import CheckpointsProjection, CheckpointsState
from projections.ledger import LedgerProjection, LedgerState
from workers.rollout.errors import CoordinatorStopped, FencedOff

# Deterministic event ids make a retried append (after the database went away mid-commit) a no-op.
_EVENT_NS = uuid.UUID("6f1d7c1e-4d0e-4b55-9f0e-2b7a61c0a8d1")
APPEND_RETRIES = 5


@dataclass
class Journal:
    store: EventStore
    ledger_projection: LedgerProjection = field(default_factory=LedgerProjection)
    checkpoints_projection: CheckpointsProjection = field(default_factory=CheckpointsProjection)
    ledger: LedgerState = field(init=False)
    checkpoints: CheckpointsState = field(init=False)
    position: int = 0
    fenced: FencedOff | None = None
    # Stream -> the version this process last saw (its fencing token).
    versions: dict[str, int] = field(default_factory=dict)
    appends: int = 0

    def __post_init__(self) -> None:
        self.ledger = self.ledger_projection.initial()
        self.checkpoints = self.checkpoints_projection.initial()
        self._lock = asyncio.Lock()
        # The thread doing an append or a fold keeps running when its awaiting task is cancelled, so
        # the versions and the fold are guarded by a thread lock, not only by the asyncio one.
        self._thread_lock = threading.RLock()
        self.changed = asyncio.Condition()

    # --- reading --------------------------------------------------------------------------------

    def _catch_up_sync(self) -> None:
        with self._thread_lock:
            _, last = fold_many(
                [self.ledger_projection, self.checkpoints_projection],
                self.store.read_all(self.position),
                [self.ledger, self.checkpoints],
            )
            if last:
                self.position = last

    async def catch_up(self) -> None:
        async with self._lock:
            await asyncio.to_thread(self._catch_up_sync)
        await self._notify()

    async def load(self) -> None:
        """Folds the whole log and adopts every stream's current version as this process's own."""
        await self.catch_up()
        for group in [*self.ledger.groups.values()]:
            self.versions[f"group-{group.group_id}"] = group.stream_version
        for gid in self.ledger.archived:
            stream = f"group-{gid}"
            self.versions[stream] = await asyncio.to_thread(self.store.stream_version, stream)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    # --- writing --------------------------------------------------------------------------------

    async def append(
        self,
        stream: str,
        build: Sequence[Event] | Callable[[LedgerState], Sequence[Event]],
        blobs: Sequence[bytes] = (),
    ) -> list[Event]:
        """Appends to `stream` at the version last seen; `build` may look at the current ledger first.

        Returns the events written (empty if `build` decided there was nothing to write).
        """
        async with self._lock:
            if self.fenced is not None:
                raise self.fenced
            events = list(build(self.ledger) if callable(build) else build)
            if not events:
                return []
            stream_stale = self._stream_moved(stream)
            if stream_stale:
                self._fence(stream, stream_stale)
            if stream not in self.versions and not stream.startswith("group-"):
                # Checkpoint and trainer streams are not fenced per group; start from what the log holds.
                self.versions[stream] = await asyncio.to_thread(self.store.stream_version, stream)
            delay = 0.05
            for attempt in range(APPEND_RETRIES):
                try:
                    await asyncio.to_thread(self._append_sync, stream, events, blobs)
                    break
                except WrongExpectedVersion as exc:
                    self._fence(stream, exc)
                except DatabaseUnavailable as exc:
                    if attempt == APPEND_RETRIES - 1:
                        raise CoordinatorStopped(
                            f"the log is unavailable; {len(events)} event(s) for {stream!r} were not "
                            f"written after {APPEND_RETRIES} tries: {exc}"
                        ) from exc
                    await asyncio.sleep(delay)
                    delay = min(delay * 4, 2.0)
            self.appends += 1
        await self._notify()
        return events

    def _stream_moved(self, stream: str) -> WrongExpectedVersion | None:
        # The fold may already hold another writer's events on this stream: then this process is stale.
        group = self.ledger.groups.get(stream[len("group-") :]) if stream.startswith("group-") else None
        mine = self.versions.get(stream, ExpectedVersion.NO_STREAM)
        if group is not None and group.stream_version > mine:
            return WrongExpectedVersion(stream, mine, group.stream_version)
        return None

    def _fence(self, stream: str, exc: WrongExpectedVersion) -> None:
        self.fenced = FencedOff(
            f"another coordinator wrote to {stream!r} (now at version {exc.actual}, this coordinator "
            f"last saw {exc.expected}); this coordinator is stale and has stopped"
        )
        raise self.fenced from exc

    def _append_sync(self, stream: str, events: list[Event], blobs: Sequence[bytes]) -> None:
        with self._thread_lock:
            expected = self.versions.get(stream, ExpectedVersion.NO_STREAM)
            start = expected + 1 if expected >= 0 else 0
            news = [NewEvent.of(e, event_id=_event_id(stream, start + i, e)) for i, e in enumerate(events)]
            with self.store.transaction() as tx:
                for blob in blobs:
                    tx.put_blob(blob)
                result = tx.append(stream, news, expected)
            self.versions[stream] = result.stream_version
            self._catch_up_sync()


def _event_id(stream: str, version: int, event: Event) -> uuid.UUID:
    body = canonical(event.model_dump(mode="json"))
    digest = hashlib.sha256(f"{stream}\x1f{version}\x1f{event.event_type()}\x1f{body}".encode()).hexdigest()
    return uuid.uuid5(_EVENT_NS, digest)
