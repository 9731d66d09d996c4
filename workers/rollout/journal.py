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
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from eventstore import (
    DatabaseUnavailable,
    EventStore,
    ExpectedVersion,
    NewEvent,
    WrongExpectedVersion,
)
from eventstore.events import Event
from eventstore.records import canonical
from projections.base import decode
from projections.checkpoints import CheckpointsProjection, CheckpointsState
from projections.ledger import LedgerProjection, LedgerState
from workers.rollout.errors import CoordinatorStopped, FencedOff

# Deterministic event ids make a retried append (after the database went away mid-commit) a no-op.
_EVENT_NS = uuid.UUID("6f1d7c1e-4d0e-4b55-9f0e-2b7a61c0a8d1")
# How long a database outage is ridden out (appends and reads retried) before the coordinator stops.
OUTAGE_BUDGET_S = 30.0


@dataclass
class Journal:
    store: EventStore
    ledger_projection: LedgerProjection = field(default_factory=LedgerProjection)
    checkpoints_projection: CheckpointsProjection = field(default_factory=CheckpointsProjection)
    ledger: LedgerState = field(init=False)
    checkpoints: CheckpointsState = field(init=False)
    position: int = 0
    fenced: FencedOff | None = None
    # Set when the database stayed away longer than `outage_budget_s`: every later append raises it.
    stopped: CoordinatorStopped | None = None
    outage_budget_s: float = OUTAGE_BUDGET_S
    # Database calls that failed with DatabaseUnavailable and were retried.
    outage_retries: int = 0
    # Stream -> the version this process last saw (its fencing token).
    versions: dict[str, int] = field(default_factory=dict)
    appends: int = 0

    def __post_init__(self) -> None:
        self._nonce = uuid.uuid4()  # one per coordinator instance: its take-overs are its own
        self.ledger = self.ledger_projection.initial()
        self.checkpoints = self.checkpoints_projection.initial()
        self._lock = asyncio.Lock()
        # The thread doing an append or a fold keeps running when its awaiting task is cancelled, so
        # the versions and the fold are guarded by a thread lock, not only by the asyncio one.
        self._thread_lock = threading.RLock()
        self.changed = asyncio.Condition()

    # --- reading --------------------------------------------------------------------------------

    def _catch_up_sync(self) -> None:
        # The position moves with every event folded, so a read that breaks off half way (the database
        # went away) resumes after the last event applied instead of folding it twice.
        with self._thread_lock:
            for event in self.store.read_all(self.position):
                decoded = decode(event)
                self.ledger_projection.apply(self.ledger, event, decoded)
                self.checkpoints_projection.apply(self.checkpoints, event, decoded)
                self.position = event.position

    async def catch_up(self) -> None:
        async with self._lock:
            await self._ride_out(self._catch_up_sync, "reading the log")
        await self._notify()

    async def read(self, fn: Callable[[], int], what: str) -> int:
        """A read of the store (e.g. its head), retried through a database outage."""
        return await self._ride_out(fn, what)

    async def _ride_out(self, fn: Callable[[], _T], what: str) -> _T:
        """Runs `fn` in a thread, retrying `DatabaseUnavailable` for up to `outage_budget_s`.

        Past the budget the journal stops for good (`CoordinatorStopped`): a coordinator that cannot
        record its decisions must not make any; its debts stay in the log for the next one.
        """
        if self.stopped is not None:
            raise self.stopped
        deadline = time.monotonic() + self.outage_budget_s
        delay = 0.05
        while True:
            try:
                return await asyncio.to_thread(fn)
            except DatabaseUnavailable as exc:
                self.outage_retries += 1
                if time.monotonic() + delay > deadline:
                    self.stopped = CoordinatorStopped(
                        f"the log has been unavailable for more than {self.outage_budget_s:g} s while "
                        f"{what}; the coordinator stopped (nothing it decided is lost: recover from the "
                        f"log once the database is back): {exc}"
                    )
                    raise self.stopped from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

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
            if self.stopped is not None:
                raise self.stopped
            events = list(build(self.ledger) if callable(build) else build)
            if not events:
                return []
            stream_stale = self._stream_moved(stream)
            if stream_stale:
                self._fence(stream, stream_stale)
            if stream not in self.versions and not stream.startswith("group-"):
                # Checkpoint and trainer streams are not fenced per group; start from what the log holds.
                self.versions[stream] = await self._ride_out(
                    lambda: self.store.stream_version(stream), f"reading the version of {stream!r}"
                )
            what = f"appending {len(events)} event(s) to {stream!r}"
            try:
                # A retry after the database went away mid-commit names the same version and the same
                # deterministic event ids: if the first try committed, the retry is a no-op.
                await self._ride_out(lambda: self._append_sync(stream, events, blobs), what)
            except WrongExpectedVersion as exc:
                self._fence(stream, exc)
            self.appends += 1
            await self._ride_out(self._catch_up_sync, f"reading the log after {what}")
        await self._notify()
        return events

    async def take_over(self, stream: str, event: Event) -> None:
        """Appends at whatever version `stream` is at, and adopts the result as this process's version.

        A recovering coordinator does this on every open group it owns before it acts on it: the
        previous owner of the stream (a process presumed dead, maybe still alive) then fails its next
        append on the version and stops, however the two race.
        """
        event_id = uuid.uuid5(_EVENT_NS, f"take-over/{self._nonce}/{stream}")

        def write() -> None:
            with self._thread_lock:
                result = self.store.append(
                    stream, [NewEvent.of(event, event_id=event_id)], ExpectedVersion.ANY
                )
                self.versions[stream] = result.stream_version

        async with self._lock:
            await self._ride_out(write, f"taking over {stream!r}")
            await self._ride_out(self._catch_up_sync, f"reading the log after taking over {stream!r}")
        await self._notify()

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


_T = TypeVar("_T")


def _event_id(stream: str, version: int, event: Event) -> uuid.UUID:
    body = canonical(event.model_dump(mode="json"))
    digest = hashlib.sha256(f"{stream}\x1f{version}\x1f{event.event_type()}\x1f{body}".encode()).hexdigest()
    return uuid.uuid5(_EVENT_NS, digest)
