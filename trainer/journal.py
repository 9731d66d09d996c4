"""The coordinator's only memory: appends to the log and the projections folded back from it.

Every append names the version this process last saw of its stream (fencing: docs/protocol.md, Deadlines and fencing): a
second coordinator's write makes this one's next append fail, and this one stops for good.  After
each append the projections catch up with the log, so what the coordinator knows is always what the
log says, including other writers' events: from the rows the store reports it wrote when they are
all the log gained since the last fold (they are the log's rows, hashes and all), else by reading.

Group commit: concurrent appends are queued and one writer task writes all those pending in one
store transaction (one thread hop, one `ledger_append_batch` statement, one commit), folds the log once, then
answers every caller.  Builds (appends whose events depend on the ledger) run in queue order before
the write.  A build sees its own stream as it will be after every earlier append to it, in the log or
earlier in the same batch: for a group stream the batch's earlier events are folded into a copy of
the group first (`projections.ledger.lookahead`), so the eight replies of a prompt group can hold,
and seal, in one transaction instead of eight; a build on any other stream waits for the next batch
behind an earlier append of its stream.  Builds of one batch see the other streams of that batch as
they were before it; every build reads only its own group's part of the ledger (its group, its
group's debts; a `CheckpointCommitted` in the same batch archives only groups whose claim is already
in the log, which such a build treats the same either way), so that changes no decision.
If the transaction is refused (a version conflict or any other error), it is rolled back and the
batch is written again one append per transaction, in queue order, so each caller gets its own
answer and a fence fails exactly the appends it failed before; a build that looked ahead at an
earlier append of its stream is built again on the log as it then is.

The projections and the reads of the log (ridden out through an outage) are `trainer.logview`'s.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from eventstore import (
    AppendResult,
    ExpectedVersion,
    Fence,
    Fenced,
    NewEvent,
    WrongExpectedVersion,
)
from eventstore.events import Event
from projections.ledger import LedgerState
from protocol import mutants
from protocol.streams import group_of_stream, is_group_stream
from trainer.errors import CoordinatorStopped, FencedOff, StreamExists
from trainer.journal_batch import EVENT_NS, Lookahead, Request, fail, new_event, resolve
from trainer.logview import LogView
from trainer.telemetry import JOURNAL_BATCHES

log = logging.getLogger("trainer")

# Appends written together in one transaction at most (group commit).
MAX_BATCH = 256


@dataclass
class Journal(LogView):
    # The owner epoch: every append is refused by the store unless the trainer's stream is still
    # where this process's `TrainerEpochTaken` (or its own later append there) left it.
    owner: Fence | None = None
    appends: int = 0
    # Store transactions that wrote appends (group commit: one per batch, `appends / batches` per batch).
    batches: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._nonce = uuid.uuid4()  # one per coordinator instance: its take-overs are its own
        # Who writes: part of every deterministic event id, so two writers never collapse into one.
        self.writer = f"{socket.gethostname()}/{os.getpid()}/{self._nonce.hex[:12]}"
        # The metadata of every row this process writes: its writer, so the auditor can tell a fenced
        # owner's claims and checkpoint events, and one trainer's write on another's group (acts-by-owner).
        self.metadata: dict[str, Any] = {"writer": self.writer}
        self._queue: deque[Request] = deque()
        self._writer: asyncio.Task[None] | None = None
        # Set while a batch is being written: its appends' callers may have been cancelled meanwhile,
        # so their futures say nothing about when the write ends (`settle`).
        self._writing: asyncio.Event | None = None
        # The thread doing an append keeps running when its awaiting task is cancelled, so the versions
        # (and the owner fence) it sets are guarded by a thread lock, not only by the asyncio one.  The
        # projections are folded on the event loop alone (the module doc): no lock of theirs.
        self._thread_lock = threading.RLock()

    # --- writing --------------------------------------------------------------------------------

    async def append(
        self,
        stream: str,
        build: Sequence[Event] | Callable[[LedgerState], Sequence[Event]],
        blobs: Sequence[bytes] = (),
        *,
        create: bool = False,
    ) -> list[Event]:
        """Appends to `stream` at the version last seen; `build` may look at the current ledger first.

        Returns the events written (empty if `build` decided there was nothing to write).

        `create`: the append starts the stream (a group's reservation).  If the stream exists already
        (another writer created it, whether or not this process has folded that yet), the append is
        refused with `StreamExists` and nothing else happens: this process never saw the stream, so
        its view of it cannot be stale and it is not fenced off.

        Group commit: the call is queued and one writer task writes every append queued meanwhile
        in one store transaction, then folds the log once (see the module doc).  `build` always sees
        its own stream as it is after the previous append to it; it must look only at its own
        stream's part of the ledger.
        """
        if self.fenced is not None:
            raise self.fenced
        if self.stopped is not None:
            raise self.stopped
        if create and stream in self.versions:
            raise StreamExists(stream, self.versions[stream])
        request = Request(stream, build, blobs, asyncio.get_running_loop().create_future(), create=create)
        self._queue.append(request)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_batches(), name="journal-writer")
        return await request.future

    async def drain(self) -> None:
        """Until every append queued so far is written or failed.  A closed coordinator's cancelled
        drivers leave their appends queued; a process handing the log to another waits for them."""
        while self._writer is not None and not self._writer.done():
            await asyncio.wait({self._writer})

    async def settle(self) -> None:
        """Until every append queued so far is written or failed, including those whose callers were
        cancelled after their batch began (their write goes on).  Appends queued later are not waited
        for, so drivers still appending do not hold it up (`drain` waits for the writer to go idle).
        What was cancelled before its batch began is never written, and is not waited for."""
        writing = self._writing
        queued = [r.future for r in self._queue if not r.future.done()]
        if writing is not None:
            await writing.wait()
        if queued:
            await asyncio.wait(queued)

    async def _write_batches(self) -> None:
        """The writer: while appends are queued, writes them a batch (one transaction) at a time."""
        batch: list[Request] = []
        try:
            while self._queue:
                batch = self._next_batch()
                if batch:
                    self._writing = writing = asyncio.Event()
                    try:
                        async with self._lock:
                            await self._write_batch(batch)
                    finally:
                        self._writing = None
                        writing.set()
                    await self._notify()
        except BaseException as exc:  # cancelled (the loop is closing), or a bug: nobody waits for ever
            for request in [*batch, *self._queue]:
                if isinstance(exc, Exception):
                    fail(request, exc)
                elif not request.future.done():
                    request.future.cancel()
            self._queue.clear()
            if not isinstance(exc, Exception):
                raise

    def _next_batch(self) -> list[Request]:
        """The queued appends, oldest first; a build only as the first of its stream (see the module doc)."""
        batch: list[Request] = []
        streams: set[str] = set()
        deferred: set[str] = set()  # a stream with an append left waiting keeps its order: all wait
        waiting: deque[Request] = deque()
        while self._queue:
            request = self._queue.popleft()
            if request.future.done():  # its caller was cancelled before it was written
                continue
            stream = request.stream
            # A build after an earlier append of its stream sees that append through a look-ahead
            # (group streams) or waits for it to be folded (others, which no build writes today).
            needs_fold = callable(request.build) and stream in streams and not is_group_stream(stream)
            if stream in deferred or needs_fold or len(batch) >= MAX_BATCH:
                deferred.add(stream)
                waiting.append(request)
                continue
            streams.add(stream)
            batch.append(request)
        self._queue = waiting
        return batch

    async def _write_batch(self, batch: list[Request]) -> None:
        # Builds run in queue order against the ledger as folded after the previous batch; a fence
        # found before the write fails that append and every later one, as one at a time did.
        ready: list[Request] = []
        ahead = Lookahead(self)
        for i, request in enumerate(batch):
            try:
                if self.fenced is not None:
                    raise self.fenced
                if self.stopped is not None:
                    raise self.stopped
                build = request.build
                request.events = list(build(ahead.view(request.stream)) if callable(build) else build)
                if not request.events:
                    resolve(request, [])
                    continue
                stream_stale = self._stream_moved(request.stream)
                if stream_stale and request.create:
                    raise StreamExists(request.stream, stream_stale.actual)
                if stream_stale:
                    self._fence(request.stream, stream_stale)
            except Exception as exc:
                fail(request, exc)
                if self.fenced is not None or self.stopped is not None:
                    for later in batch[i + 1 :]:
                        fail(later, self.fenced or self.stopped or exc)
                    break
                continue
            ready.append(request)
            ahead.written(request)
        if not ready:
            return
        what = (
            f"appending {len(ready[0].events)} event(s) to {ready[0].stream!r}"
            if len(ready) == 1
            else f"appending {sum(len(r.events) for r in ready)} event(s) to {len(ready)} streams"
        )
        began = time.monotonic()
        try:
            # A retry after the database went away mid-commit names the same versions and the same
            # deterministic event ids: if the first attempt committed, the retry is a no-op.
            results = await self._ride_out(lambda: self._write_sync(ready), what)
        except (CoordinatorStopped, FencedOff) as exc:
            for request in ready:
                fail(request, exc)
            return
        except Exception as exc:
            if len(ready) == 1:
                self._settle_alone(ready[0], exc)
                return
            # One append of the batch was refused (and the transaction rolled back): one transaction
            # per append, in order, so each caller gets its own answer and a fence stops exactly the
            # appends it stopped when they were written one at a time.
            await self._write_one_by_one(ready)
            return
        try:
            if not self._fold_written(ready, results):
                await self._catch_up("reading the log after appending")
        except Exception as exc:  # folding the log failed after the commit: as after one append
            for request in ready:
                fail(request, exc)
            return
        self.appends += len(ready)
        self.batches += 1
        JOURNAL_BATCHES.observe(len(ready), time.monotonic() - began)
        for request in ready:
            resolve(request, request.events)

    async def _write_one_by_one(self, ready: list[Request]) -> None:
        written: list[Request] = []
        failed: BaseException | None = None
        for request in ready:
            # Nothing of the batch was written: each expects what the appends before it really left.
            request.prepared = None
        streams: set[str] = set()
        for i, request in enumerate(ready):
            began = time.monotonic()
            try:
                if callable(request.build) and request.stream in streams:
                    # Built against the appends before it in the batch, which may not have been
                    # written: build again on the log as it now is, as one at a time would have.
                    await self._catch_up("reading the log before a build")
                    request.events = list(request.build(self.ledger))
                    if not request.events:
                        resolve(request, [])
                        continue
                streams.add(request.stream)
                await self._ride_out(
                    functools.partial(self._write_sync, [request]),
                    f"appending {len(request.events)} event(s) to {request.stream!r}",
                )
            except Exception as exc:
                self._settle_alone(request, exc)
                if self.fenced is not None or self.stopped is not None:
                    for later in ready[i + 1 :]:
                        fail(later, self.fenced or self.stopped or exc)
                    break
                continue
            self.appends += 1
            self.batches += 1
            JOURNAL_BATCHES.observe(1, time.monotonic() - began)
            written.append(request)
        if written:
            try:
                await self._catch_up("reading the log after appending")
            except Exception as exc:
                failed = exc
        for request in written:
            if failed is not None:
                fail(request, failed)
            else:
                resolve(request, request.events)

    def _fence_of(self, stream: str, chain: dict[str, int]) -> Fence | None:
        """The owner fence of an append to `stream` (`chain`: the batch's earlier appends).  An append
        to the trainer's own stream is fenced by its expected version already; one after it in the
        same batch expects the version that append leaves."""
        owner = self.owner
        if owner is None or stream == owner.stream_id or mutants.active("stale_owner_unfenced"):
            return None
        return Fence(owner.stream_id, chain.get(owner.stream_id, owner.version))

    async def take_epoch(self, stream: str, event: Event) -> None:
        """Becomes the owner of the trainer whose stream is `stream`: appends `event` there at whatever
        version it is, and fences every later append of this process on the version that leaves."""

        def write() -> None:
            with self._thread_lock:
                news = [new_event(stream, -1, event, self.writer)]
                result = self.store.append(stream, news, ExpectedVersion.ANY, metadata=self.metadata)
                self.versions[stream] = result.stream_version
                self.owner = Fence(stream, result.stream_version)

        async with self._lock:
            await self._ride_out(write, f"taking the owner epoch of {stream!r}")
            await self._catch_up(f"reading the log after taking {stream!r}")
        await self._notify()

    def _settle_alone(self, request: Request, exc: BaseException) -> None:
        """The answer of one append that failed on its own, as `append` gave it one at a time."""
        if isinstance(exc, Fenced):
            self.fenced = FencedOff(
                f"another coordinator took over trainer stream {exc.stream_id!r} (now at version "
                f"{exc.actual}, this coordinator's epoch is {exc.expected}); this coordinator is stale "
                "and has stopped"
            )
            exc = self.fenced
        elif isinstance(exc, WrongExpectedVersion) and request.create:
            exc = StreamExists(request.stream, exc.actual)
        elif isinstance(exc, WrongExpectedVersion):
            try:
                self._fence(request.stream, exc)
            except FencedOff as fenced:
                exc = fenced
        fail(request, exc)

    def _write_sync(self, batch: list[Request]) -> list[AppendResult]:
        """In a worker thread: one transaction holding every append of `batch` (and their blobs).
        The caller folds what it wrote, on the event loop."""
        with self._thread_lock:
            chain: dict[str, int] = {}  # a stream's version after the batch's earlier appends to it
            appends: list[tuple[str, Sequence[NewEvent], int, Fence | None]] = []
            for request in batch:
                if request.prepared is None:
                    request.prepared = self._prepare_sync(request, chain.get(request.stream))
                expected, news = request.prepared
                appends.append((request.stream, news, expected, self._fence_of(request.stream, chain)))
                chain[request.stream] = (
                    expected + len(news) if expected >= ExpectedVersion.NO_STREAM else expected
                )
            results = self.store.append_batch(
                appends, [blob for r in batch for blob in r.blobs], metadata=self.metadata
            )
            for request, result in zip(batch, results, strict=True):
                self.versions[request.stream] = result.stream_version
                if self.owner is not None and request.stream == self.owner.stream_id:
                    self.owner = Fence(request.stream, result.stream_version)
            return results

    def _fold_written(self, batch: list[Request], results: list[AppendResult]) -> bool:
        """On the event loop: folds the rows the batch wrote, as the store handed them back, if they are
        all the log gained since the last fold (no other writer's row among or before them); else
        False, and the log is read instead.  Saves reading back and decoding what is in hand."""
        records = [record for result in results for record in result.records]
        if not records or records[0].position != self.position + 1:
            return False
        if len(records) != sum(len(request.events) for request in batch):  # an idempotent append
            return False
        events = [event for request in batch for event in request.events]
        self._fold(list(zip(records, events, strict=True)))
        return True

    def _prepare_sync(self, request: Request, after: int | None = None) -> tuple[int, list[NewEvent]]:
        """The version `request` expects (`after`: what an earlier append of its batch leaves) and its
        events with their deterministic ids (kept for retries)."""
        stream = request.stream
        if stream not in self.versions and not is_group_stream(stream):
            # Checkpoint and trainer streams are not fenced per group; start from what the log holds.
            self.versions[stream] = self.store.stream_version(stream)
        expected = after if after is not None else self.versions.get(stream, ExpectedVersion.NO_STREAM)
        start = expected + 1 if expected >= 0 else 0
        return expected, [new_event(stream, start + i, e, self.writer) for i, e in enumerate(request.events)]

    async def take_over(self, stream: str, event: Event) -> None:
        """Appends at whatever version `stream` is at, and adopts the result as this process's version.

        A recovering coordinator does this on every open group it owns before it acts on it: the
        previous owner of the stream (a process presumed dead, maybe still alive) then fails its next
        append on the version and stops, however the two race.
        """
        event_id = uuid.uuid5(EVENT_NS, f"take-over/{self._nonce}/{stream}")

        def write() -> None:
            with self._thread_lock:
                result = self.store.append(
                    stream,
                    [NewEvent.of(event, event_id=event_id)],
                    ExpectedVersion.ANY,
                    metadata=self.metadata,
                    fence=self._fence_of(stream, {}),
                )
                self.versions[stream] = result.stream_version

        async with self._lock:
            await self._ride_out(write, f"taking over {stream!r}")
            await self._catch_up(f"reading the log after taking over {stream!r}")
        await self._notify()

    def _stream_moved(self, stream: str) -> WrongExpectedVersion | None:
        # The fold may already hold another writer's events on this stream: then this process is stale.
        group = self.ledger.groups.get(group_of_stream(stream) or "")
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


_T = TypeVar("_T")
