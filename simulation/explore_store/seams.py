"""The two seams a schedule's faults go through: the store of a trainer process (appends counted:
crash points, the database outage) and its clients' connection pools (calls counted: crash points,
agent restarts, one fault per call)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import threading
from collections.abc import Coroutine, Sequence
from typing import Any

import httpx

from eventstore import DatabaseUnavailable, EventStore
from simulation.explore_store.agent import Agent, call_kind
from simulation.explore_store.process import INCARNATION, Incarnation, ScheduleRun
from trainer.gym.transport import Origin, Reply, Timeouts


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
        run.per_try[(kind, _subject_of(body, agent.name))] += 1
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
            context.run(INCARNATION.set, None)
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


def _subject_of(body: bytes, agent: str) -> str:
    """What a request body is about, for the per-subject call counts: a try, or a checkpoint at this
    agent, or ''."""
    if not body or (b"rollout_id" not in body and b"checkpoint_id" not in body):
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    for prefix in ("", "_ng_"):  # a control call's body, or a /run row (the Gym's field names)
        if f"{prefix}rollout_id" in data:
            return f"{data[f'{prefix}rollout_id']}#{data.get(f'{prefix}attempt_index')}"
    if data.get("checkpoint_id"):
        return f"checkpoint {data['checkpoint_id']} at {agent}"
    return ""
