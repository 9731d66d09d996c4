"""`ledger simulate --explore N --real`: seeded fault schedules over the real coordinator and a real store.

`simulation/explore.py` drives the pure protocol core against model agents.  This mode drives the whole
async shell instead (`RolloutCoordinator`: journal, tries, ACK relay, checkpoints, recovery) against
reference agents (`gym_agent.app`, the participant mounted) running in this process, over a real log
(an SQLite file per seed, or a PostgreSQL database).

One seed is one plan (`plan_of(seed)`, a pure function of the seed): one to three trainers on one log,
each with its own agents and a few small groups; a fault for some (agent, call kind, call index)
(refused, 5xx, non-JSON, timeout, the reply lost after the effect, delivered twice); agent restarts
before some call, with the state directory kept or lost; one trainer crash point (before or after its
k-th append, before or after its k-th call), after which a new coordinator with the same trainer id
recovers, and sometimes the crashed one is not stopped (it carries on as a stale coordinator once the
new one has taken over); a database outage (appends m..n of one trainer fail with the store's
`DatabaseUnavailable`); and one checkpoint per coordinator (one call, or prepare then commit, or
prepare then abort).

Two seams carry the faults, both outside production code: each `GymClient`'s connection pools are
replaced by `FaultyPool` (the same `exchange` the lean transport offers; the agent's ASGI app is called
in-process through httpx's ASGI transport), and each coordinator's store is a `FaultyStore` (the real
store, its appends counted).  A crash cancels every task the trainer process started (a task factory
records them per process) and makes its every later call fail; the agents' tasks are not the trainer's.

The independent checker (`check`) reads only the log's events and the agents' durable records
(`executions.jsonl` of every state directory an agent ever had, its checkpoint artefacts, its final
`/status`), never the projections: nothing executed twice, nothing stranded, every group sealed or
dead-lettered, no group trained twice (claims rolled back by a restore excepted) nor claimed by a
fenced owner, every checkpoint's outcome in the log equal to every participant's, no agent left paused,
no newest owner fenced, retries bounded, and `projections.audit.audit_log` finds nothing.

The plan is a pure function of the seed; asyncio's interleaving of the coordinator's tasks is not, so a
seed replays the same faults at the same call indexes, while which try a call index lands on may vary.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from eventstore import DatabaseUnavailable, EventStore, open_store, upgrade_database
from eventstore.events import PromptRef
from gym_agent.app import create_app
from gym_agent.config import AgentConfig
from participant import ExecutionRegistry
from participant.evidence import read_evidence
from trainer.checkpoint import PreparedCheckpoint
from trainer.coordinator import RolloutCoordinator
from trainer.core.attempt import RETIRE_POLICY
from trainer.errors import AlreadyClaimed, CoordinatorStopped, FencedOff
from trainer.gym import GymClient
from trainer.gym.transport import Origin, Reply, Timeouts

log = logging.getLogger("simulation")

CallKind = Literal[
    "run", "receipt", "tokens", "ack", "retire", "prepare", "commit", "resume", "abort", "status", "other"
]
CALL_KINDS: tuple[CallKind, ...] = (
    "run", "receipt", "tokens", "ack", "retire", "prepare", "commit", "resume", "abort", "status",
)  # fmt: skip
Fault = Literal["refused", "server_error", "non_json", "timeout", "reply_lost", "duplicate"]
FAULTS: tuple[Fault, ...] = ("refused", "server_error", "non_json", "timeout", "reply_lost", "duplicate")
CrashWhere = Literal["before_append", "after_append", "before_call", "after_call"]
CheckpointKind = Literal["one_call", "split_commit", "split_abort"]

# The coordinator's settings in a schedule: short, so that a seed takes about a second.
SETTINGS: dict[str, Any] = {
    "rollout_timeout_s": 3.0,
    "prepare_timeout_s": 2.0,
    "park_grace_s": 0.3,
    "max_tries": 4,
    "outage_budget_s": 1.5,
    "reconcile_every_s": 0.25,
}
# A schedule that has not ended after this long is a violation (something waits for ever).
SEED_DEADLINE_S = 45.0
# How long a stale coordinator may go on once its successor finished before it is stopped here.
STALE_GRACE_S = 3.0
# Calls of one kind for one try, at most: each retry loop has a budget (RETIRE_POLICY and the
# coordinator's own); a few recoveries may each spend one.
MAX_CALLS_PER_TRY = 4 * RETIRE_POLICY.max_calls


# --- the plan: a pure function of the seed --------------------------------------------------------


@dataclass(frozen=True)
class CrashPoint:
    trainer: int
    where: CrashWhere
    k: int
    stale: bool  # the crashed process is not stopped: it carries on after its successor took over


@dataclass(frozen=True)
class GroupPlan:
    group_id: str
    agent: str
    siblings: int


@dataclass(frozen=True)
class TrainerPlan:
    trainer_id: str
    agents: tuple[str, ...]
    groups: tuple[GroupPlan, ...]
    mode: Literal["sibling", "prompt_group"]
    checkpoint: CheckpointKind
    checkpoint_after: int  # groups claimed before the checkpoint starts


@dataclass(frozen=True)
class Plan:
    seed: int
    prefix: str  # of every id in the schedule
    trainers: tuple[TrainerPlan, ...]
    # (agent, call kind, n-th call of that kind to that agent) -> the fault it suffers
    faults: dict[tuple[str, CallKind, int], Fault]
    # (agent, n-th call to that agent) -> restart before it, keeping (True) or losing its state dir
    restarts: dict[tuple[str, int], bool]
    crash: CrashPoint | None
    # (trainer, first append, last append): those appends of that trainer find the database away
    outage: tuple[int, int, int] | None

    def describe(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "trainers": [
                {
                    "id": t.trainer_id,
                    "agents": list(t.agents),
                    "groups": [(g.group_id, g.agent, g.siblings) for g in t.groups],
                    "mode": t.mode,
                    "checkpoint": t.checkpoint,
                    "checkpoint_after": t.checkpoint_after,
                }
                for t in self.trainers
            ],
            "faults": {f"{a}/{k}#{n}": f for (a, k, n), f in sorted(self.faults.items())},
            "restarts": {
                f"{a}#{n}": ("kept" if keep else "lost") for (a, n), keep in sorted(self.restarts.items())
            },
            "crash": None if self.crash is None else self.crash.__dict__,
            "outage": self.outage,
        }


def plan_of(seed: int, tag: str = "") -> Plan:
    """The schedule of `seed`: every number drawn from `random.Random(seed)`, nothing else.  `tag` goes
    into every id (trainers, agents, groups, checkpoints), so seeds replayed on one log do not meet."""
    rng = random.Random(seed)
    trainers: list[TrainerPlan] = []
    for t in range(rng.choice((1, 1, 2, 3))):
        tid = f"x{seed}{tag}-t{t}"
        agents = tuple(f"{tid}-a{j}" for j in range(rng.choice((1, 1, 2))))
        groups = tuple(
            GroupPlan(f"{tid}-g{j}", agents[j % len(agents)], rng.randint(2, 4))
            for j in range(rng.randint(2, 4))
        )
        trainers.append(
            TrainerPlan(
                tid,
                agents,
                groups,
                rng.choice(("sibling", "prompt_group")),
                rng.choice(("one_call", "split_commit", "split_abort")),
                rng.randint(0, len(groups)),
            )
        )
    names = [a for tp in trainers for a in tp.agents]
    faults: dict[tuple[str, CallKind, int], Fault] = {}
    for _ in range(rng.randint(0, 6)):
        faults[(rng.choice(names), rng.choice(CALL_KINDS), rng.randint(1, 6))] = rng.choice(FAULTS)
    restarts: dict[tuple[str, int], bool] = {}
    for _ in range(rng.choice((0, 0, 1, 1, 2))):
        restarts[(rng.choice(names), rng.randint(2, 40))] = rng.random() < 0.6
    crash: CrashPoint | None = None
    if rng.random() < 0.75:
        where: CrashWhere = rng.choice(("before_append", "after_append", "before_call", "after_call"))
        k = rng.randint(1, 14) if where.endswith("append") else rng.randint(1, 40)
        crash = CrashPoint(rng.randrange(len(trainers)), where, k, rng.random() < 0.35)
    outage: tuple[int, int, int] | None = None
    if rng.random() < 0.2:
        first = rng.randint(1, 10)
        outage = (rng.randrange(len(trainers)), first, first + rng.randint(0, 3))
    return Plan(seed, f"x{seed}{tag}-", tuple(trainers), faults, restarts, crash, outage)


# --- the agents: reference agents in this process --------------------------------------------------


_INCARNATION: contextvars.ContextVar[Incarnation | None] = contextvars.ContextVar("incarnation", default=None)


class Agent:
    """One reference agent served in-process: its app is called through httpx's ASGI transport.  A
    restart closes its registry (runs in flight end), starts a new app on the same state directory
    (kept) or on an empty one (lost: the old one is moved aside, its evidence still read by the
    checker), and breaks every call in flight to the old one."""

    def __init__(self, name: str, base: Path, seed: int) -> None:
        self.name = name
        self.base = base
        self.config = AgentConfig(
            name=name, state_dir=base / "state", zero_work=True, seed=seed, turns=(1, 2), log_level="error"
        )
        self.lives = 0
        self.restarts = 0
        self.state_dirs = [base / "state"]
        self._start()

    def _start(self) -> None:
        app, registry = create_app(self.config)
        self.registry: ExecutionRegistry = registry
        self.transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self.lives += 1

    def restart(self, keep_state: bool) -> None:
        self.registry.close()
        self.registry.evidence.close()
        self.restarts += 1
        if not keep_state:
            lost = self.base / f"lost-{self.restarts}"
            shutil.move(str(self.config.resolved_state_dir), lost)
            self.state_dirs.append(lost)
        self._start()

    async def call(
        self, method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> Reply:
        """One request to the app, in a task of no trainer's (the agent's work is not the trainer's)."""
        life, transport = self.lives, self.transport
        request = httpx.Request(method, "http://agent" + target.decode(), headers=list(headers), content=body)

        async def send() -> Reply:
            response = await transport.handle_async_request(request)
            data = await response.aread()
            return Reply(response.status_code, response.headers.raw, data)

        context = contextvars.copy_context()
        context.run(_INCARNATION.set, None)
        reply = await asyncio.shield(asyncio.get_running_loop().create_task(send(), context=context))
        if self.lives != life:
            raise httpx.ReadError("the agent restarted while the call was in flight")
        return reply


def call_kind(method: str, target: bytes) -> CallKind:
    path = target.decode()
    if path == "/run":
        return "run"
    for prefix, kind in (
        ("/completion_receipt/", "receipt"),
        ("/token_capture/", "tokens"),
        ("/acknowledge", "ack"),
        ("/retire", "retire"),
        ("/checkpoint/prepare", "prepare"),
        ("/checkpoint/commit", "commit"),
        ("/checkpoint/resume", "resume"),
        ("/checkpoint/abort", "abort"),
        ("/status", "status"),
    ):
        if path.startswith(prefix):
            return kind  # type: ignore[return-value]
    return "other"


# --- one trainer process, and the seams it is driven through -----------------------------------------


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
    crashed: bool = False
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    coord: RolloutCoordinator | None = None
    store: FaultyStore | None = None
    # Stale variant: the crash point was reached (the harness starts the successor), and the successor
    # has taken over (this process goes on).
    stale_hit: asyncio.Event = field(default_factory=asyncio.Event)
    released: threading.Event = field(default_factory=threading.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # started (or recovered)
    ended: str = ""

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


class FaultyStore(EventStore):
    """The real store of one trainer process (its own connections), its appends counted: the crash
    points and the database outage are placed by that count."""

    def __init__(self, inner: EventStore, inc: Incarnation, run: ScheduleRun) -> None:
        self.__dict__.update(inner.__dict__)
        self._inc, self._run = inc, run
        self.in_flight = 0
        self.idle = threading.Condition()
        inc.store = self

    def _counted(self, fn: Any, args: Any, kwargs: Any) -> Any:
        # An append in flight when the process is killed may still commit (its COMMIT was sent);
        # the successor starts only once none is (a real successor starts after the process died).
        with self.idle:
            self.in_flight += 1
        try:
            n = self._before()
            result = fn(*args, **kwargs)
            self._inc.at_append("after_append", n)
            return result
        finally:
            with self.idle:
                self.in_flight -= 1
                self.idle.notify_all()

    def _before(self) -> int:
        inc = self._inc
        inc.check()
        inc.appends += 1
        n = inc.appends
        inc.at_append("before_append", n)
        run = self._run
        outage = run.plan.outage
        if outage is not None and outage[0] == inc.trainer:
            run.trainer_appends[inc.trainer] += 1
            if outage[1] <= run.trainer_appends[inc.trainer] <= outage[2]:
                run.counts["outage_appends"] += 1
                raise DatabaseUnavailable("the database is away (injected outage)")
        return n

    def append(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(super().append, args, kwargs)

    def append_batch(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(super().append_batch, args, kwargs)

    def wait_idle(self, timeout_s: float) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.in_flight == 0, timeout_s)


_JSON = [(b"content-type", b"application/json")]


class FaultyPool:
    """Stands in for a `GymClient`'s connection pools (`exchange`, as `LeanTransport` offers it): counts
    the call, places the trainer's crash point, the agent's restarts and the call's fault, and hands the
    request to the agent's app in-process."""

    def __init__(self, agent: Agent, inc: Incarnation, run: ScheduleRun) -> None:
        self.agent, self.inc, self.run = agent, inc, run

    async def aclose(self) -> None:
        pass

    async def exchange(
        self,
        method: str,
        origin: Origin,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        timeouts: Timeouts,
    ) -> Reply:
        inc, run, agent = self.inc, self.run, self.agent
        inc.check()
        inc.calls += 1
        n = inc.calls
        await inc.at_call("before_call", n)
        kind = call_kind(method, target)
        run.agent_calls[agent.name] += 1
        keep = run.plan.restarts.get((agent.name, run.agent_calls[agent.name]))
        if keep is not None:
            agent.restart(keep)
            run.counts["agent_restarts_kept" if keep else "agent_restarts_lost"] += 1
        run.kind_calls[(agent.name, kind)] += 1
        fault = run.plan.faults.get((agent.name, kind, run.kind_calls[(agent.name, kind)]))
        run.per_try[(kind, _try_of(body))] += 1
        if fault is not None:
            run.counts[f"fault_{fault}"] += 1
        what = f"{method} {target.decode()} (injected)"
        if fault == "refused":
            raise httpx.ConnectError(f"{what}: connection refused")
        if fault == "server_error":
            return Reply(503, _JSON, b'{"error": "injected", "message": "service unavailable"}')
        if fault == "timeout":
            # The request reached the agent, whose work goes on; the answer never comes in time.
            context = contextvars.copy_context()
            context.run(_INCARNATION.set, None)
            asyncio.get_running_loop().create_task(
                _quietly(agent.call(method, target, headers, body)), context=context
            )
            await asyncio.sleep(0)
            raise httpx.ReadTimeout(f"{what}: no complete response in time")
        reply = await self._deliver(method, target, headers, body, timeouts)
        if fault == "duplicate":
            reply = await self._deliver(method, target, headers, body, timeouts)
        await inc.at_call("after_call", n)
        if fault == "reply_lost":
            raise httpx.ReadError(f"{what}: connection lost after the agent acted")
        if fault == "non_json":
            return Reply(200, [(b"content-type", b"text/html")], b"<html>502 Bad Gateway</html>")
        inc.check()
        return reply

    async def _deliver(
        self,
        method: str,
        target: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        timeouts: Timeouts,
    ) -> Reply:
        call = self.agent.call(method, target, headers, body)
        if timeouts.read is None:
            return await call
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeouts.read)
        except TimeoutError:
            task.add_done_callback(_consume)
            raise httpx.ReadTimeout("no complete response in time") from None


async def _quietly(call: Coroutine[Any, Any, Reply]) -> None:
    with contextlib.suppress(Exception):
        await call


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _try_of(body: bytes) -> str:
    """The try a request body names (for the per-try call counts), or ''."""
    if not body or b"rollout_id" not in body:
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if isinstance(data, dict) and "rollout_id" in data:
        return f"{data['rollout_id']}#{data.get('attempt_index')}"
    return ""


# --- one schedule ---------------------------------------------------------------------------------------


@dataclass
class ScheduleRun:
    plan: Plan
    url: str
    agents: dict[str, Agent]
    agent_calls: Counter[str] = field(default_factory=Counter)
    kind_calls: Counter[tuple[str, CallKind]] = field(default_factory=Counter)
    per_try: Counter[tuple[CallKind, str]] = field(default_factory=Counter)
    trainer_appends: Counter[int] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    # trainer -> the incarnations it had (the last one is the owner)
    incarnations: dict[int, list[Incarnation]] = field(default_factory=dict)
    claims: Counter[int] = field(default_factory=Counter)


def _task_factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
    task = asyncio.Task(coro, loop=loop, **kwargs)
    inc = _INCARNATION.get() if "context" not in kwargs else kwargs["context"].get(_INCARNATION)
    if inc is not None:
        inc.tasks.add(task)
        task.add_done_callback(inc.tasks.discard)
    return task


def _client(agent: Agent, inc: Incarnation, run: ScheduleRun) -> GymClient:
    client = GymClient(f"http://{agent.name}.sim", agent.name, control_timeout_s=5.0)
    pool = FaultyPool(agent, inc, run)
    client._run = client._control = pool  # type: ignore[assignment]
    return client


async def _workload(run: ScheduleRun, t: int, inc: Incarnation, recover: bool) -> None:
    """What one trainer process does: start (or recover), submit its groups, claim them for training as
    they seal, one checkpoint, wait until everything is done and paid, close."""
    tp = run.plan.trainers[t]
    store = FaultyStore(await asyncio.to_thread(open_store, run.url), inc, run)
    clients = {name: _client(run.agents[name], inc, run) for name in tp.agents}
    settings = {**SETTINGS, "mode": tp.mode, "trainer_id": tp.trainer_id}
    try:
        if recover:
            coord = await RolloutCoordinator.recover(store, dict(clients), **settings)
        else:
            coord = RolloutCoordinator(store, dict(clients), **settings)
            inc.coord = coord
            await coord.start()
        inc.coord = coord
        inc.ready.set()
        for g in tp.groups:
            if not coord.ledger.knows_group(g.group_id):
                await coord.submit(g.group_id, PromptRef(sample_id=g.group_id, task_name="arith"), g.agent,
                                   g.siblings, {"responses_create_params": {"input": [{"role": "user", "content": "1+1?"}]}})  # fmt: skip
        checkpointed = False
        claimed_here = 0
        while True:
            # A kill's cancellation can be lost in Python 3.11's `wait_for` (when the wait ends at the
            # same moment): a dead process must not go on looping here.
            inc.check()
            _raise_if_stopped(coord)
            for group in coord.sealed_unclaimed():
                await coord.claim_for_training(group.group_id, run.claims[t])
                run.claims[t] += 1
                claimed_here += 1
            if not checkpointed and (claimed_here >= tp.checkpoint_after or not coord.open_groups()):
                checkpointed = True
                await _checkpoint(coord, f"{tp.trainer_id}-ck{inc.number}", tp.checkpoint)
                continue
            if checkpointed and not coord.open_groups() and not coord.sealed_unclaimed():
                break
            async with coord.journal.changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(coord.journal.changed.wait(), 0.05)
        await coord.wait_idle(20.0)
        await coord.checkpointer.recover()
        _raise_if_stopped(coord)
        await coord.close()
        inc.ended = "finished"
    finally:
        if inc.coord is not None and not inc.crashed:
            with contextlib.suppress(BaseException):
                await inc.coord.close()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(store.close)


def _raise_if_stopped(coord: RolloutCoordinator) -> None:
    if coord.journal.fenced is not None:
        raise coord.journal.fenced
    if coord.journal.stopped is not None:
        raise coord.journal.stopped
    if coord.errors:
        raise coord.errors[0]


async def _checkpoint(coord: RolloutCoordinator, cid: str, kind: CheckpointKind) -> None:
    if kind == "one_call":
        await coord.checkpoint(cid)
        return
    prepared = await coord.prepare_checkpoint(cid)
    if isinstance(prepared, PreparedCheckpoint):
        if kind == "split_commit":
            await coord.commit_checkpoint(cid)
        else:
            await coord.abort_checkpoint(cid, "the trainer chose to abort (schedule)")


async def _drive_trainer(run: ScheduleRun, t: int) -> None:
    """Runs the trainer's processes: the first; after a crash (or a database outage that stopped it) a
    recovering one; at a stale crash point a recovering one while the first goes on."""
    loop = asyncio.get_running_loop()
    crash = run.plan.crash if run.plan.crash is not None and run.plan.crash.trainer == t else None
    incs = run.incarnations.setdefault(t, [])
    recover = False
    while True:
        if len(incs) > 4:
            run.problems.append(f"trainer {t}: more than 4 processes were needed")
            return
        inc = Incarnation(t, len(incs), crash if not incs else None, loop)
        incs.append(inc)
        task = _spawn(inc, _workload(run, t, inc, recover))
        stale_wait = asyncio.ensure_future(inc.stale_hit.wait())
        await asyncio.wait({task, stale_wait}, return_when=asyncio.FIRST_COMPLETED)
        stale_wait.cancel()
        recover = True
        if inc.stale_hit.is_set() and not task.done():
            run.counts["stale_coordinators"] += 1
            await _stale_takeover(run, t, inc, task)
            return
        error = _ended(task)
        if error is None:
            return
        if isinstance(error, TrainerCrashed | asyncio.CancelledError):
            run.counts["trainer_crashes"] += 1
            inc.kill()
            await _settle(inc)
            continue
        if isinstance(error, CoordinatorStopped):
            run.counts["outage_stops"] += 1
            continue
        run.problems.append(f"trainer {t} process {inc.number} failed: {type(error).__name__}: {error}"[:400])
        return


async def _stale_takeover(
    run: ScheduleRun, t: int, stale: Incarnation, stale_task: asyncio.Task[None]
) -> None:
    """The successor recovers while `stale` is held at its crash point; then `stale` goes on.  The
    successor must finish; the stale one must be fenced (or finish harmlessly)."""
    loop = asyncio.get_running_loop()
    incs = run.incarnations[t]
    successor = Incarnation(t, len(incs), None, loop)
    incs.append(successor)
    task = _spawn(successor, _workload(run, t, successor, True))
    # The stale process goes on once its successor has taken the owner epoch and recovered.
    ready = asyncio.ensure_future(successor.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    stale.released.set()
    await asyncio.wait({task})
    error = _ended(task)
    if error is not None:
        if isinstance(error, FencedOff):
            run.problems.append(f"trainer {t}: the newest owner was fenced off: {error}"[:400])
        elif isinstance(error, CoordinatorStopped):
            run.counts["outage_stops"] += 1
            await _finish_after(run, t)
        else:
            run.problems.append(f"trainer {t}: the successor failed: {type(error).__name__}: {error}"[:400])
    done, _ = await asyncio.wait({stale_task}, timeout=STALE_GRACE_S)
    if stale_task in done:
        stale_error = _ended(stale_task)
        if isinstance(stale_error, FencedOff):
            run.counts["stale_fenced"] += 1
        elif isinstance(stale_error, AlreadyClaimed):
            # Its claim was refused before its append: the fold already showed the successor's claim.
            run.counts["stale_refused_claim"] += 1
        elif stale_error is None:
            run.counts["stale_finished"] += 1
        elif not isinstance(stale_error, CoordinatorStopped):
            run.problems.append(
                f"trainer {t}: the stale process failed: {type(stale_error).__name__}: {stale_error}"[:400]
            )
    else:
        run.counts["stale_stopped_idle"] += 1
    stale.kill()
    await _settle(stale)


async def _finish_after(run: ScheduleRun, t: int) -> None:
    loop = asyncio.get_running_loop()
    incs = run.incarnations[t]
    inc = Incarnation(t, len(incs), None, loop)
    incs.append(inc)
    task = _spawn(inc, _workload(run, t, inc, True))
    await asyncio.wait({task})
    error = _ended(task)
    if error is not None:
        run.problems.append(f"trainer {t}: the last process failed: {type(error).__name__}: {error}"[:400])


def _spawn(inc: Incarnation, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    context = contextvars.copy_context()
    context.run(_INCARNATION.set, inc)
    return asyncio.get_running_loop().create_task(coro, context=context)


def _ended(task: asyncio.Task[None]) -> BaseException | None:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception()


async def _settle(inc: Incarnation) -> None:
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


def _waiting(run: ScheduleRun) -> str:
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


async def run_schedule(plan: Plan, url: str, workdir: Path) -> ScheduleRun:
    """Runs `plan` on the log at `url` with its agents' state under `workdir`; returns what happened
    (the checker reads the log and the agents afterwards)."""
    agents = {name: Agent(name, workdir / name, plan.seed) for tp in plan.trainers for name in tp.agents}
    run = ScheduleRun(plan, url, agents)
    loop = asyncio.get_running_loop()
    previous = loop.get_task_factory()
    loop.set_task_factory(_task_factory)
    try:
        drivers = [asyncio.create_task(_drive_trainer(run, t)) for t in range(len(plan.trainers))]
        done, pending = await asyncio.wait(drivers, timeout=SEED_DEADLINE_S)
        for task in pending:
            task.cancel()
        if pending:
            run.problems.append(
                f"the schedule did not end within {SEED_DEADLINE_S:g} s: {_waiting(run)}"[:1500]
            )
        for incs in run.incarnations.values():
            for inc in incs:
                inc.released.set()
                if pending:
                    inc.kill()
                await _settle(inc)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                run.problems.append(f"harness error: {task.exception()!r}")
    finally:
        loop.set_task_factory(previous)
    return run


# --- the independent history checker --------------------------------------------------------------------


async def check(run: ScheduleRun) -> list[str]:
    """What the log and the agents' durable records show went wrong (empty when everything holds)."""
    plan = run.plan
    violations = list(run.problems)
    store = await asyncio.to_thread(open_store, run.url)
    try:
        events = await asyncio.to_thread(lambda: list(store.read_all(0)))
        from projections.audit import audit_log

        report = await asyncio.to_thread(audit_log, store)
    finally:
        await asyncio.to_thread(store.close)
    mine = [e for e in events if plan.prefix in e.stream_id]
    by_type: dict[str, list[Any]] = {}
    for e in mine:
        by_type.setdefault(e.type, []).append(e)
    if not report.ok:
        violations += [f"audit: {v}"[:300] for v in report.as_json()["violations"][:10]]
    # Every group sealed or dead-lettered, each once.
    ends: Counter[str] = Counter(
        e.data["group_id"] for e in mine if e.type in ("GroupSealed", "GroupDeadLettered")
    )
    for tp in plan.trainers:
        for g in tp.groups:
            if ends[g.group_id] != 1:
                violations.append(
                    f"group {g.group_id} ended {ends[g.group_id]} times (sealed or dead-lettered)"
                )
    sealed = {e.data["group_id"] for e in by_type.get("GroupSealed", [])}
    # Claims: never by a writer whose epoch was superseded; at most one that no restore rolled back;
    # every sealed group trained on.
    epochs: dict[str, str] = {}  # trainer id -> the writer of its newest epoch
    live_claims: dict[str, list[int]] = {}
    for e in mine:
        if e.type == "TrainerEpochTaken":
            epochs[e.data["trainer_id"]] = e.data["writer"]
        elif e.type == "TrainerRestored":
            cut = e.data.get("cut_position") or 0
            tid = e.data.get("trainer_id")
            for gid, positions in live_claims.items():
                if gid.startswith(f"{tid}-g"):
                    positions[:] = [p for p in positions if p <= cut]
        elif e.type == "GroupClaimedForTraining":
            gid = e.data["group_id"]
            tid = gid.rsplit("-g", 1)[0]
            writer = e.metadata.get("writer")
            if writer is not None and epochs.get(tid) not in (None, writer):
                violations.append(f"group {gid} claimed by a superseded owner ({writer})")
            live_claims.setdefault(gid, []).append(e.position)
    for gid in sealed:
        n = len(live_claims.get(gid, []))
        if n != 1:
            violations.append(f"sealed group {gid} trained on {n} times")
    # Executions and results, from every state directory each agent ever had.
    for agent in run.agents.values():
        started: Counter[tuple[str, int]] = Counter()
        stranded = 0
        for d in agent.state_dirs:
            ev = await asyncio.to_thread(read_evidence, d)
            for key, t in ev.tries.items():
                started[key] += t.executions
            if d == agent.state_dirs[0]:
                stranded = len(ev.stranded)
        for (rid, n), count in started.items():
            if count > 1:
                violations.append(f"{rid}#{n} executed {count} times at {agent.name}")
        if stranded:
            violations.append(f"{agent.name} holds {stranded} finished result(s) nobody released")
    # Checkpoints: the log's outcome equals each participant's.
    participants: dict[str, list[str]] = {}
    decided: dict[str, str] = {}
    finished: dict[tuple[str, str], str] = {}
    resumed: set[str] = set()
    for e in mine:
        cid = str(e.data.get("checkpoint_id"))
        if e.type == "CheckpointPrepareStarted":
            participants[cid] = list(e.data["participants"])
        elif e.type in ("CheckpointCommitted", "CheckpointAborted"):
            if cid in decided:
                violations.append(f"checkpoint {cid} decided twice")
            decided[cid] = "committed" if e.type == "CheckpointCommitted" else "aborted"
        elif e.type == "CheckpointParticipantFinished":
            finished[(cid, e.data["agent_name"])] = e.data["outcome"]
        elif e.type == "CheckpointResumed":
            resumed.add(cid)
    for cid, names in participants.items():
        outcome = decided.get(cid)
        if outcome is None:
            violations.append(f"checkpoint {cid} was never decided")
            continue
        for name in names:
            if name not in run.agents:
                continue
            agent = run.agents[name]
            artefact = any((d / "checkpoints" / f"{cid}.json").exists() for d in agent.state_dirs)
            own = finished.get((cid, name))
            if outcome == "aborted" and artefact:
                violations.append(f"{name} holds an artefact of {cid}, which the log aborted")
            if outcome == "committed" and own == "resumed" and not artefact:
                violations.append(f"{name} recorded resumed for {cid} but holds no artefact")
            if outcome == "committed" and own is None:
                violations.append(f"{name}'s part of committed {cid} never finished")
        if cid in resumed and any(finished.get((cid, n)) != "resumed" for n in names):
            violations.append(f"CheckpointResumed for {cid} without every participant resumed")
    # No agent left paused or closed; nothing of it still owed.
    for agent in run.agents.values():
        reply = await agent.call("GET", b"/status", [(b"host", b"agent")], b"")
        status = json.loads(reply.body)
        if status.get("phase") != "idle":
            violations.append(f"{agent.name} left {status.get('phase')}")
    # Every retry bounded.
    for (kind, what), n in run.per_try.items():
        if what and n > MAX_CALLS_PER_TRY:
            violations.append(f"{n} {kind} calls for {what} (bound {MAX_CALLS_PER_TRY})")
    return violations


# --- exploring many seeds ----------------------------------------------------------------------------------


@dataclass
class RealExploration:
    seeds: int
    first_seed: int
    violations: dict[int, list[str]]
    counts: Counter[str]
    wall_s: float

    @property
    def ok(self) -> bool:
        return not self.violations


async def explore_seed(
    seed: int, url: str | None = None, workdir: Path | None = None
) -> tuple[list[str], ScheduleRun]:
    """One seed on a fresh SQLite file under `workdir` (or on the log at `url`)."""
    with contextlib.ExitStack() as stack:
        base = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"explore-{seed}-")))
        base = base / f"seed-{seed}-{uuid.uuid4().hex[:6]}"
        base.mkdir(parents=True)
        db = url or f"sqlite:///{base / 'ledger.db'}"
        if url is None:
            await asyncio.to_thread(upgrade_database, db)
        run = await run_schedule(plan_of(seed, "" if url is None else f"r{uuid.uuid4().hex[:4]}"), db, base)
        violations = await check(run)
        for agent in run.agents.values():
            agent.registry.close()
            agent.registry.evidence.close()
        return violations, run


async def explore_real(seeds: int, first_seed: int = 0, url: str | None = None) -> RealExploration:
    quiet = [
        logging.getLogger(n) for n in ("trainer", "gym_agent", "participant", "eventstore", "simulation")
    ]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    started = time.monotonic()
    violations: dict[int, list[str]] = {}
    counts: Counter[str] = Counter()
    if url is not None:
        await asyncio.to_thread(upgrade_database, url)
    try:
        for seed in range(first_seed, first_seed + seeds):
            found, run = await explore_seed(seed, url)
            counts.update(run.counts)
            counts["trainers"] += len(run.plan.trainers)
            counts["groups"] += sum(len(t.groups) for t in run.plan.trainers)
            counts["calls"] += sum(run.agent_calls.values())
            if found:
                violations[seed] = found
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)
    return RealExploration(seeds, first_seed, violations, counts, time.monotonic() - started)


__all__ = ["Plan", "RealExploration", "check", "explore_real", "explore_seed", "plan_of", "run_schedule"]
