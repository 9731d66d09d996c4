"""Group commit: concurrent `EventStore.append` calls of one process share one statement and one fsync.

Leader/follower, as PostgreSQL's WAL flush and InnoDB's binlog group commit do it: the first
appender that finds no write in flight leads; it takes what is queued (`take_batch`), writes it as one
transaction in which each append is checked, written or refused on its own (`Recorder.append_each`),
and hands every waiter its own answer; then the oldest append still queued leads the next write.
Appends that arrive while a write is in flight queue up and go together in the next one, so the batch
grows with the load and no append waits on a timer.  Each waiter sleeps on a condition of its own,
so a write's end wakes only the threads it concerns (8 writers x 1 event: 3,500 -> 4,300 events/s,
`benchmarks.eventstore`'s case run alone, against one condition every thread slept on).

Bounded: at most `max_waiting` appends wait (a newcomer past that waits for room until its
deadline, then is refused with nothing written), a batch holds at most `max_batch` appends, and
every wait has a deadline.  A waiter whose deadline passes while its append is in flight gets
`AppendOutcomeUnknown` (as when a commit's answer is lost): a retry with the same event ids is
answered from the log.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from eventstore.errors import AppendOutcomeUnknown, StoreBusy
from eventstore.recorder import CheckedAppend
from eventstore.records import AppendResult

Outcome = AppendResult | BaseException
WriteEach = Callable[[list[CheckedAppend]], list[AppendResult | Exception]]


@dataclass(eq=False, slots=True)
class Waiter:
    append: CheckedAppend
    ids: list[str] = field(default_factory=list)
    # Its own condition on the group commit's lock, made when it first has to wait (a lone writer
    # leads at once and never needs one): a write's end wakes exactly the waiters it answered and
    # the next leader, never every thread (with a notify_all to 8 writers, their threads' kernel
    # time, mostly futex wake-ups, was 16% of all CPU against 24% for PostgreSQL's whole work).
    wake: threading.Condition | None = None
    taken: bool = False
    outcome: Outcome | None = None
    shared: bool = False  # the outcome is one failure of the whole write
    lead: bool = False  # handed the next write by the leader before it


def take_batch(queue: deque[Waiter], max_batch: int) -> list[Waiter]:
    """The waiters the next write carries, oldest first: up to `max_batch`, and never two appends
    naming one event id (the log's unique id would fail the whole statement, not just the repeat;
    the later one waits for the next write, where it is answered as the retry it is)."""
    batch: list[Waiter] = []
    ids: set[str] = set()
    while queue and len(batch) < max_batch:
        own = queue[0].ids
        unique = set(own)
        if len(unique) < len(own) or not ids.isdisjoint(unique):
            if not batch:  # alone in its write, its own duplicate ids fail only itself
                batch.append(queue.popleft())
            break
        ids |= unique
        batch.append(queue.popleft())
    return batch


@dataclass
class GroupCommitStats:
    """What the group commit did (counts, read by the benchmark and tests)."""

    writes: int = 0
    appends: int = 0
    largest: int = 0
    timed_out: int = 0
    busy: int = 0


def worth_waiting(queued: int, arriving: int, last_write: int, max_batch: int) -> bool:
    """Whether a leader holds its write (for at most `commit_delay_s`) for more appends: while some are
    being prepared, or fewer are queued than the last write carried (their writers are likely on
    their way back).  PostgreSQL's commit_delay with commit_siblings: wait only when others are
    about to commit too, so a lone writer never waits."""
    return queued < max_batch and (arriving > 0 or queued < last_write)


class GroupCommit:
    def __init__(
        self,
        write_each: WriteEach,
        max_batch: int = 128,
        max_waiting: int = 1024,
        wait_s: float = 60.0,
        commit_delay_s: float = 0.002,
    ) -> None:
        if max_batch < 1 or max_waiting < 1 or wait_s <= 0 or commit_delay_s < 0:
            raise ValueError(
                "group commit needs max_batch >= 1, max_waiting >= 1, wait_s > 0 and commit_delay_s >= 0"
            )
        self._write_each = write_each
        self.max_batch, self.max_waiting, self.wait_s = max_batch, max_waiting, wait_s
        self.commit_delay_s = commit_delay_s
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # newcomers waiting for a place in the queue
        self._arrivals = threading.Condition(self._lock)  # the leader holding its write for more
        self._queue: deque[Waiter] = deque()
        self._leading = False  # a leader holds or writes a batch, or has been handed the next one
        self._holding = False  # the leader waits on `_arrivals`
        self._arriving = 0  # appends being checked and rendered, about to queue
        self._last_write = 1  # appends the last write carried
        self.stats = GroupCommitStats()

    @property
    def waiting(self) -> int:
        """Appends queued for the next write (not counting those in flight)."""
        with self._lock:
            return len(self._queue)

    def append(self, prepare: Callable[[], CheckedAppend]) -> AppendResult:
        """The append `prepare` checks and renders, written in the next group write, or its own
        refusal raised.  A leader may hold its write up to `commit_delay_s` for appends being prepared."""
        with self._lock:
            self._arriving += 1
        try:
            append = prepare()
        except BaseException:
            with self._lock:
                self._arriving -= 1
                if self._holding:
                    self._arrivals.notify()
            raise
        deadline = time.monotonic() + self.wait_s
        waiter = Waiter(append, [row.event_id for row in append.rows])
        with self._lock:
            self._arriving -= 1
            while len(self._queue) >= self.max_waiting:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.stats.busy += 1
                    if self._holding:
                        self._arrivals.notify()
                    raise StoreBusy(
                        f"{len(self._queue)} appends already wait for the log; nothing was written"
                    )
                self._room.wait(remaining)
            self._queue.append(waiter)
            if self._holding:
                self._arrivals.notify()
            if self._leading:
                self._follow(waiter, deadline)
                if waiter.outcome is not None:
                    return _answer(waiter.outcome, waiter.shared)
            # This waiter leads: it is the oldest queued, so the batch it takes carries it.
            self._leading, waiter.lead = True, False
            hold_until = time.monotonic() + self.commit_delay_s
            self._holding = True
            while worth_waiting(len(self._queue), self._arriving, self._last_write, self.max_batch):
                remaining = hold_until - time.monotonic()
                if remaining <= 0:
                    break
                self._arrivals.wait(remaining)
            self._holding = False
            batch = take_batch(self._queue, self.max_batch)
            for taken in batch:
                taken.taken = True
            self._room.notify(len(batch))
        self._lead(batch)
        assert waiter.outcome is not None, "a leader's batch carries the leader"
        return _answer(waiter.outcome, waiter.shared)

    def _follow(self, waiter: Waiter, deadline: float) -> None:
        """Waits (holding the lock) until a write answers `waiter` or hands it the next write."""
        if waiter.wake is None:
            waiter.wake = threading.Condition(self._lock)
        while waiter.outcome is None and not waiter.lead:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._give_up(waiter)
            waiter.wake.wait(remaining)

    def _lead(self, batch: list[Waiter]) -> None:
        outcomes: list[AppendResult | Exception] | None = None
        failure: BaseException | None = None
        try:
            outcomes = self._write_each([w.append for w in batch])
        except BaseException as exc:  # every waiter of the write gets it (KeyboardInterrupt included)
            failure = exc
        with self._lock:
            for i, waiter in enumerate(batch):
                waiter.outcome = outcomes[i] if outcomes is not None else failure
                waiter.shared = outcomes is None
                if waiter.wake is not None:
                    waiter.wake.notify()
            self._last_write = len(batch)
            self.stats.writes += 1
            self.stats.appends += len(batch)
            self.stats.largest = max(self.stats.largest, len(batch))
            self._hand_on()

    def _hand_on(self) -> None:
        """Leadership passes to the oldest queued append, or lapses (called holding the lock)."""
        if self._queue:
            nxt = self._queue[0]
            nxt.lead = True
            if nxt.wake is not None:
                nxt.wake.notify()
        else:
            self._leading = False

    def _give_up(self, waiter: Waiter) -> None:
        """Past the deadline (called holding the lock): raise, saying whether anything may be written."""
        self.stats.timed_out += 1
        if not waiter.taken:
            self._queue.remove(waiter)
            self._room.notify()  # never the designated leader: `_follow` leaves as soon as it is handed one
            raise StoreBusy(
                f"no write of the log took this append within {self.wait_s}s; nothing was written"
            )
        raise AppendOutcomeUnknown(
            f"the write carrying this append to {waiter.append.stream_id!r} did not answer within "
            f"{self.wait_s}s; it may have been written (retry with the same event ids to find out)"
        )


def _answer(outcome: Outcome, shared: bool) -> AppendResult:
    if isinstance(outcome, AppendResult):
        return outcome
    if shared:  # one failure raised in every waiter's thread: each raises its own copy where it can
        with contextlib.suppress(Exception):
            outcome = copy.copy(outcome)
    raise outcome
