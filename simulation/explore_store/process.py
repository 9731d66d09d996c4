"""One simulated trainer process (`Incarnation`): what it counts, where it crashes, the tasks it
started; and what every process of a schedule shares (`ScheduleRun`)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from simulation.explore_store.plan import CallKind, CrashPoint, CrashWhere, Plan
from trainer.coordinator import RolloutCoordinator

if TYPE_CHECKING:
    from simulation.explore_store.agent import Agent
    from simulation.explore_store.seams import FaultyStore

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
    store: FaultyStore | None = None
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
        return self.crash.stale and self.coord is not None and self.coord.journal.owner is not None

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


# --- one schedule ---------------------------------------------------------------------------------------


@dataclass
class ScheduleRun:
    plan: Plan
    url: str
    agents: dict[str, Agent]
    agent_calls: Counter[str] = field(default_factory=Counter)
    kind_calls: Counter[tuple[str, CallKind]] = field(default_factory=Counter)
    # (call kind, the try or the checkpoint at an agent it is about) -> calls made
    per_try: Counter[tuple[CallKind, str]] = field(default_factory=Counter)
    trainer_appends: Counter[int] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    # trainer -> the incarnations it had (the last one is the owner)
    incarnations: dict[int, list[Incarnation]] = field(default_factory=dict)
    claims: Counter[int] = field(default_factory=Counter)
    # The /run calls that left a trainer's own queue ("rollout_id#attempt_index"), whatever became of them.
    runs_sent: set[str] = field(default_factory=set)
    # group id -> set once its owner's submit returned (the gate of the plan's group id collision).
    reserved: dict[str, asyncio.Event] = field(default_factory=dict)
    # The plan's intrusion and collision, once played (by whichever process of the trainer got there);
    # the owner of the agent intruded on keeps its binding (does not close) until the intrusion is done.
    intruded: asyncio.Event = field(default_factory=asyncio.Event)
    collided: bool = False
    # The writers of refused starts (the intrusion): none of them may have written a row.
    refused_writers: list[str] = field(default_factory=list)
    # The late /runs on their way (`before_run`): the owner's last reconciliation waits for them, so a
    # result one of them leaves at a restarted agent is the trainer's to release, not left for its next run.
    late_runs: set[asyncio.Future[Any]] = field(default_factory=set)
    # The plan's replay: agent key -> the /run to deliver again (its try "rollout_id#attempt_index",
    # method, target, headers, body), and the tries so delivered (the checker allows them a second run).
    replays: dict[str, tuple[str, str, bytes, tuple[tuple[bytes, bytes], ...], bytes]] = field(
        default_factory=dict
    )
    replayed: set[str] = field(default_factory=set)
    # The tries whose AckOwed an append has written (an /acknowledge may name only these).
    owed_durable: set[tuple[str, int]] = field(default_factory=set)
    _started: dict[int, asyncio.Event] = field(default_factory=dict)

    def started(self, t: int) -> asyncio.Event:
        """Set once a process of trainer `t` has started (or recovered).  Its agents are bound to it
        only if each answered at the start; one a fault kept from answering is bound at its first call."""
        return self._started.setdefault(t, asyncio.Event())

    def reserved_gate(self, group_id: str) -> asyncio.Event:
        return self.reserved.setdefault(group_id, asyncio.Event())

    def agent_of(self, trainer_id: str | None, name: str) -> Agent | None:
        """The agent a trainer calls `name` (several trainers' agents may share a name)."""
        for tp in self.plan.trainers:
            if tp.trainer_id == trainer_id:
                for key in tp.agents:
                    if self.plan.name_of(key) == name:
                        return self.agents[key]
        return None


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


def waiting(run: ScheduleRun) -> str:
    """Where the live processes' tasks wait (for the report of a schedule that did not end)."""
    where: Counter[str] = Counter()
    for incs in run.incarnations.values():
        for inc in incs:
            for task in inc.tasks:
                if task.done():
                    continue
                frames = task.get_stack(limit=3)
                line = " <- ".join(f"{f.f_code.co_name}:{f.f_lineno}" for f in reversed(frames))
                where[f"t{inc.trainer}p{inc.number} {task.get_name()} @ {line}"] += 1
    return "; ".join(f"{k} x{n}" for k, n in where.most_common(8))
