"""One simulated trainer process (`Incarnation`): what it counts, where it crashes, the tasks it
started (what every process of a schedule shares is `simulation.explore_store.shared.ScheduleRun`)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from simulation.explore_store.plan import CrashPoint, CrashWhere
from trainer.coordinator import RolloutCoordinator


class IdleStore(Protocol):
    """The process's store (`seams.FaultyStore`), as settling a dead process waits on it."""

    def wait_idle(self, timeout_s: float) -> bool: ...


# A schedule that has not ended after this long is a violation (something waits for ever).
SEED_DEADLINE_S = 45.0

T = TypeVar("T")

INCARNATION: contextvars.ContextVar[Incarnation | None] = contextvars.ContextVar("incarnation", default=None)


class TrainerCrashed(BaseException):
    """The simulated trainer process died here.  A BaseException, so no retry loop catches it."""


@dataclass
class Incarnation:
    """One trainer process: its counts of appends and calls, its crash point, the tasks it started."""

    trainer: int
    number: int
    crash: CrashPoint | None
    loop: asyncio.AbstractEventLoop
    appends: int = 0
    calls: int = 0
    runs: int = 0  # its /run calls (`before_run`)
    prepares: int = 0  # its appends of a CheckpointPrepareStarted (`after_prepare`)
    load_reads: int = 0  # its reads of the log before it was ready (`Plan.fold_break`)
    crashed: bool = False
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    coord: RolloutCoordinator | None = None
    store: IdleStore | None = None
    # Stale variant: the crash point was reached (the harness starts the successor), and the successor
    # has taken over (this process goes on).
    stale_hit: asyncio.Event = field(default_factory=asyncio.Event)
    released: threading.Event = field(default_factory=threading.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # started (or recovered)
    # Its work is done (it is about to reconcile every agent and close), and it may go on: a successor
    # beside a stale process waits until that one has stopped, as a live owner would outlast it.
    work_done: asyncio.Event = field(default_factory=asyncio.Event)
    may_close: asyncio.Event = field(default_factory=asyncio.Event)

    def check(self) -> None:
        if self.crashed:
            raise TrainerCrashed(f"trainer {self.trainer} (process {self.number}) is dead")

    def kill(self) -> None:
        self.crashed = True
        for task in list(self.tasks):
            task.cancel()

    def _hit(self, where: CrashWhere, n: int) -> bool:
        c = self.crash
        return c is not None and c.where == where and c.k == n and not self.crashed

    def _stale(self) -> bool:
        """The stale variant needs an owner epoch to be stale about: a process stopped before it took
        one and then released would be the newest owner, so there it is a plain crash."""
        assert self.crash is not None
        return self.crash.stale and self.coord is not None and self.coord.owns_epoch

    def at_append(self, where: CrashWhere, n: int) -> None:
        """In the store's thread, before or after the n-th append."""
        self.check()
        if not self._hit(where, n):
            return
        if self._stale():
            self.loop.call_soon_threadsafe(self.stale_hit.set)
            self.released.wait(SEED_DEADLINE_S)
            return
        self.crashed = True
        self.loop.call_soon_threadsafe(self.kill)
        raise TrainerCrashed(f"trainer {self.trainer} crashed {where.replace('_', ' ')} #{n}")

    def at_run(self, n: int) -> bool:
        """Before the n-th /run: True when it is held as a late one (`before_run`, the process stale;
        the harness starts the successor), a crash when the process has no epoch to be stale about."""
        self.check()
        if not self._hit("before_run", n):
            return False
        if self._stale():
            self.stale_hit.set()
            return True
        self.kill()
        raise TrainerCrashed(f"trainer {self.trainer} crashed before its /run #{n}")

    async def at_call(self, where: CrashWhere, n: int) -> None:
        self.check()
        if not self._hit(where, n):
            return
        if self._stale():
            self.stale_hit.set()
            await asyncio.to_thread(self.released.wait, SEED_DEADLINE_S)
            return
        self.kill()
        raise TrainerCrashed(f"trainer {self.trainer} crashed {where.replace('_', ' ')} #{n}")


def _retrieved(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


def task_factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
    task = asyncio.Task(coro, loop=loop, **kwargs)
    context = kwargs.get("context")  # uvloop passes None where asyncio passes nothing
    inc = INCARNATION.get() if context is None else context.get(INCARNATION)
    if inc is not None:
        inc.tasks.add(task)
        task.add_done_callback(inc.tasks.discard)
        # A killed or fenced process's tasks end in errors nobody awaits: they are the schedule's
        # expected ends, read by the harness from the process's root task, not asyncio's to report.
        task.add_done_callback(_retrieved)
    return task


def spawn(inc: Incarnation, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    context = contextvars.copy_context()
    context.run(INCARNATION.set, inc)
    return asyncio.get_running_loop().create_task(coro, context=context)


def ended(task: asyncio.Task[Any]) -> BaseException | None:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception()


async def settle(inc: Incarnation) -> None:
    """Until the dead process's tasks have all ended (they were cancelled)."""
    for _ in range(200):
        live = [t for t in inc.tasks if not t.done()]
        if not live:
            break
        for t in live:
            t.cancel()
        await asyncio.wait(live, timeout=0.05)
    if inc.store is not None:
        await asyncio.to_thread(inc.store.wait_idle, 10.0)
