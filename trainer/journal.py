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

Threads do the I/O, the event loop folds.  The store's calls (appends, reads, decoding what was read)
run in a worker thread; the rows they hand back are folded into the projections on the event loop,
between two of its steps, so a coroutine that reads the ledger without awaiting (iterating its groups
or debts) never sees it change half way, and none has to copy it first.  A fold of the rows in hand
runs to its end without yielding; a catch-up folds a page at a time (each a prefix of the log).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from eventstore import (
    AppendResult,
    DatabaseRefused,
    DatabaseUnavailable,
    EventStore,
    ExpectedVersion,
    Fence,
    Fenced,
    NewEvent,
    RecordedEvent,
    WrongExpectedVersion,
)
from eventstore.events import Event
from eventstore.read_ahead import PAGE_SIZE
from eventstore.records import UNIT_SEPARATOR, uuid5_text
from projections.base import decode
from projections.checkpoints import CheckpointsProjection, CheckpointsState
from projections.ledger import LedgerProjection, LedgerState, lookahead
from protocol import mutants
from protocol.retry import RetryPolicy, RetryState, next_step
from protocol.streams import group_of_stream, group_stream, is_group_stream
from trainer.errors import CoordinatorStopped, FencedOff, StreamExists
from trainer.eventloop import wait_at_most
from trainer.telemetry import JOURNAL_BATCHES

log = logging.getLogger("trainer")

# Deterministic event ids make a retried append (after the database went away mid-commit) a no-op.
_EVENT_NS = uuid.UUID("6f1d7c1e-4d0e-4b55-9f0e-2b7a61c0a8d1")
# How long a database outage is ridden out (appends and reads retried) before the coordinator stops.
OUTAGE_BUDGET_S = 30.0
# Appends written together in one transaction at most (group commit).
MAX_BATCH = 256
# Events a catch-up reads (in a thread) and then folds (on the event loop) at a time: the longest
# the loop is held by one fold is one page's.
CATCH_UP_PAGE = PAGE_SIZE


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
    # The owner epoch: every append is refused by the store unless the trainer's stream is still
    # where this process's `TrainerEpochTaken` (or its own later append there) left it.
    owner: Fence | None = None
    appends: int = 0
    # Store transactions that wrote appends (group commit: one per batch, `appends / batches` per batch).
    batches: int = 0

    def __post_init__(self) -> None:
        self._nonce = uuid.uuid4()  # one per coordinator instance: its take-overs are its own
        # Who writes: part of every deterministic event id, so two writers never collapse into one.
        self.writer = f"{socket.gethostname()}/{os.getpid()}/{self._nonce.hex[:12]}"
        # The metadata of every row this process writes: its writer, so the auditor can tell a fenced
        # owner's claims and checkpoint events, and one trainer's write on another's group (acts-by-owner).
        self.metadata: dict[str, Any] = {"writer": self.writer}
        self.ledger = self.ledger_projection.initial()
        self.checkpoints = self.checkpoints_projection.initial()
        self._lock = asyncio.Lock()
        self._queue: deque[_Request] = deque()
        self._writer: asyncio.Task[None] | None = None
        # Set while a batch is being written: its appends' callers may have been cancelled meanwhile,
        # so their futures say nothing about when the write ends (`settle`).
        self._writing: asyncio.Event | None = None
        # The thread doing an append keeps running when its awaiting task is cancelled, so the versions
        # (and the owner fence) it sets are guarded by a thread lock, not only by the asyncio one.  The
        # projections are folded on the event loop alone (the module doc): no lock of theirs.
        self._thread_lock = threading.RLock()
        self.changed = asyncio.Condition()
        # Until `load`: the version of every group stream the folds have seen (its last event's), so
        # that archived groups, whose version the ledger does not keep, cost no read of their own.
        self._folded_versions: dict[str, int] | None = {}

    # --- reading --------------------------------------------------------------------------------

    def _read_page(self, after: int) -> tuple[list[tuple[RecordedEvent, Event]], Exception | None]:
        """In a worker thread: the log's next page after `after`, decoded; touches no state of the
        journal.  An event that cannot be decoded ends the page, its error handed back beside the rows
        before it (they are folded, then it is raised: the fold stops where the log cannot be read)."""
        rows: list[tuple[RecordedEvent, Event]] = []
        # One page: `islice` stops before the reader would ask for the next.
        for event in itertools.islice(self.store.read_all(after, batch_size=CATCH_UP_PAGE), CATCH_UP_PAGE):
            try:
                rows.append((event, decode(event)))
            except Exception as exc:
                return rows, exc
        return rows, None

    def _fold(self, rows: Sequence[tuple[RecordedEvent, Event]]) -> None:
        """On the event loop: folds `rows` (in log order) into the projections, skipping any the fold
        holds already (a page read before a write it raced with)."""
        folded = self._folded_versions
        for event, decoded in rows:
            if event.position <= self.position:
                continue
            self.ledger_projection.apply(self.ledger, event, decoded)
            self.checkpoints_projection.apply(self.checkpoints, event, decoded)
            # The position moves with every event folded, so a read that breaks off half way (the
            # database went away) resumes after the last event applied instead of folding it twice.
            self.position = event.position
            if folded is not None and is_group_stream(event.stream_id):
                folded[event.stream_id] = event.stream_version

    async def _catch_up(self, what: str) -> None:
        """Folds what the log holds past the fold's position: pages read in a thread, each ridden out
        through an outage, each folded on the loop.  The caller holds `_lock`."""
        while True:
            rows, error = await self._ride_out(functools.partial(self._read_page, self.position), what)
            self._fold(rows)
            if error is not None:
                raise error
            if len(rows) < CATCH_UP_PAGE:
                return

    async def catch_up(self) -> None:
        async with self._lock:
            await self._catch_up("reading the log")
        await self._notify()

    async def read(self, fn: Callable[[], _T], what: str) -> _T:
        """A read of the store (e.g. its head), retried through a database outage."""
        return await self._ride_out(fn, what)

    async def _ride_out(self, fn: Callable[[], _T], what: str) -> _T:
        """Runs `fn` in a thread, retrying `DatabaseUnavailable` for up to `outage_budget_s`.

        Past the budget the journal stops for good (`CoordinatorStopped`): a coordinator that cannot
        record its decisions must not make any; its debts stay in the log for the next one.  A
        connection the database refused (`DatabaseRefused`) stops it at the first try.
        """
        if self.stopped is not None:
            raise self.stopped
        failures = RetryState()
        while True:
            try:
                result = await asyncio.to_thread(fn)
                if failures.calls:
                    log.warning("the log is reachable again after %d retries while %s", failures.calls, what)
                return result
            except DatabaseRefused as exc:
                # A wrong password or a database gone (dropped): no outage, so no budget to wait out.
                self.stopped = CoordinatorStopped(
                    f"the log refused the connection while {what}; the coordinator stopped (nothing it "
                    f"decided is lost: recover from the log once the connection is mended): {exc}"
                )
                raise self.stopped from exc
            except DatabaseUnavailable as exc:
                self.outage_retries += 1
                now = time.monotonic()
                failures = failures.failed(now, str(exc))
                if failures.calls == 1:
                    log.warning("the log is unavailable while %s; reconnecting with backoff: %s", what, exc)
                # The outage budget as a retry budget: jittered backoff, no call past the deadline.
                budget = max(self.outage_budget_s, 1e-6)  # 0: give up at the first failure
                policy = RetryPolicy.within(budget, base_s=0.05, cap_s=1.0)
                verdict = next_step(policy, failures, now, random.random())
                if verdict.kind == "give_up":
                    self.stopped = CoordinatorStopped(
                        f"the log has been unavailable for more than {self.outage_budget_s:g} s while "
                        f"{what}; the coordinator stopped (nothing it decided is lost: recover from the "
                        f"log once the database is back): {exc}"
                    )
                    raise self.stopped from exc
                await asyncio.sleep(verdict.delay_s)

    async def load(self) -> None:
        """Folds the whole log and adopts every group stream's current version as this process's own.

        The versions come from the fold itself (an archived group's from the last event of its stream,
        which the ledger does not keep): no read per stream, so the whole load is reads of the log
        in pages, each ridden out through an outage like any other."""
        await self.catch_up()
        folded, self._folded_versions = self._folded_versions, None
        if folded is not None:  # the first load: later ones keep what it adopted
            for gid in self.ledger.archived:
                stream = group_stream(gid)
                self.versions[stream] = folded.get(stream, ExpectedVersion.NO_STREAM)
        for group in [*self.ledger.groups.values()]:
            self.versions[group_stream(group.group_id)] = group.stream_version

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_changed(self, timeout_s: float) -> None:
        """Until the next batch is recorded, or `timeout_s` has passed."""
        async with self.changed:
            await wait_at_most(self.changed.wait(), timeout_s)

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
        request = _Request(stream, build, blobs, asyncio.get_running_loop().create_future(), create=create)
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
        batch: list[_Request] = []
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
                    _fail(request, exc)
                elif not request.future.done():
                    request.future.cancel()
            self._queue.clear()
            if not isinstance(exc, Exception):
                raise

    def _next_batch(self) -> list[_Request]:
        """The queued appends, oldest first; a build only as the first of its stream (see the module doc)."""
        batch: list[_Request] = []
        streams: set[str] = set()
        deferred: set[str] = set()  # a stream with an append left waiting keeps its order: all wait
        waiting: deque[_Request] = deque()
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

    async def _write_batch(self, batch: list[_Request]) -> None:
        # Builds run in queue order against the ledger as folded after the previous batch; a fence
        # found before the write fails that append and every later one, as one at a time did.
        ready: list[_Request] = []
        ahead = _Lookahead(self)
        for i, request in enumerate(batch):
            try:
                if self.fenced is not None:
                    raise self.fenced
                if self.stopped is not None:
                    raise self.stopped
                build = request.build
                request.events = list(build(ahead.view(request.stream)) if callable(build) else build)
                if not request.events:
                    _resolve(request, [])
                    continue
                stream_stale = self._stream_moved(request.stream)
                if stream_stale and request.create:
                    raise StreamExists(request.stream, stream_stale.actual)
                if stream_stale:
                    self._fence(request.stream, stream_stale)
            except Exception as exc:
                _fail(request, exc)
                if self.fenced is not None or self.stopped is not None:
                    for later in batch[i + 1 :]:
                        _fail(later, self.fenced or self.stopped or exc)
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
            # deterministic event ids: if the first try committed, the retry is a no-op.
            results = await self._ride_out(lambda: self._write_sync(ready), what)
        except (CoordinatorStopped, FencedOff) as exc:
            for request in ready:
                _fail(request, exc)
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
                _fail(request, exc)
            return
        self.appends += len(ready)
        self.batches += 1
        JOURNAL_BATCHES.observe(len(ready), time.monotonic() - began)
        for request in ready:
            _resolve(request, request.events)

    async def _write_one_by_one(self, ready: list[_Request]) -> None:
        written: list[_Request] = []
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
                        _resolve(request, [])
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
                        _fail(later, self.fenced or self.stopped or exc)
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
                _fail(request, failed)
            else:
                _resolve(request, request.events)

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
                news = [_new_event(stream, -1, event, self.writer)]
                result = self.store.append(stream, news, ExpectedVersion.ANY, metadata=self.metadata)
                self.versions[stream] = result.stream_version
                self.owner = Fence(stream, result.stream_version)

        async with self._lock:
            await self._ride_out(write, f"taking the owner epoch of {stream!r}")
            await self._catch_up(f"reading the log after taking {stream!r}")
        await self._notify()

    def _settle_alone(self, request: _Request, exc: BaseException) -> None:
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
        _fail(request, exc)

    def _write_sync(self, batch: list[_Request]) -> list[AppendResult]:
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

    def _fold_written(self, batch: list[_Request], results: list[AppendResult]) -> bool:
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

    def _prepare_sync(self, request: _Request, after: int | None = None) -> tuple[int, list[NewEvent]]:
        """The version `request` expects (`after`: what an earlier append of its batch leaves) and its
        events with their deterministic ids (kept for retries)."""
        stream = request.stream
        if stream not in self.versions and not is_group_stream(stream):
            # Checkpoint and trainer streams are not fenced per group; start from what the log holds.
            self.versions[stream] = self.store.stream_version(stream)
        expected = after if after is not None else self.versions.get(stream, ExpectedVersion.NO_STREAM)
        start = expected + 1 if expected >= 0 else 0
        return expected, [_new_event(stream, start + i, e, self.writer) for i, e in enumerate(request.events)]

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


class _Lookahead:
    """What a build sees in a batch: the ledger, or for a group stream with earlier appends in the
    batch, a copy of its group with their events folded in (at the positions they will most likely
    get: only `apply`'s bookkeeping reads them, no build does)."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.pending: dict[str, list[Event]] = {}
        self.views: dict[str, tuple[LedgerState, int]] = {}  # stream -> (copy, events folded into it)
        self.position = journal.position

    def written(self, request: _Request) -> None:
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


def _new_event(stream: str, version: int, event: Event, writer: str) -> NewEvent:
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
        event_id=uuid5_text(_EVENT_NS.bytes, digest),
        schema_version=event.schema_version,
        validated_json=text,
    )


@dataclass(eq=False)
class _Request:
    """One queued `append`: what its caller asked for and the future it awaits."""

    stream: str
    build: Sequence[Event] | Callable[[LedgerState], Sequence[Event]]
    blobs: Sequence[bytes]
    future: asyncio.Future[list[Event]]
    events: list[Event] = field(default_factory=list)
    # The append starts its stream: finding it there is `StreamExists`, not a fence.
    create: bool = False
    # (expected version, events with their ids), fixed on the first try so that retries repeat it.
    prepared: tuple[int, list[NewEvent]] | None = None


def _resolve(request: _Request, events: list[Event]) -> None:
    if not request.future.done():
        request.future.set_result(events)


def _fail(request: _Request, exc: BaseException) -> None:
    if not request.future.done():
        request.future.set_exception(exc)
