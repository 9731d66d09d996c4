"""The two seams a schedule's faults go through: the store of a trainer process (appends counted:
crash points, the database outage; a recovering process's reads while it loads: the connection
killed) and its clients' connection pools (calls counted: crash points, agent restarts, a stale
owner's late /run, one fault per call)."""

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
from participant.evidence import read_evidence
from protocol.wire import ADOPT_ONLY_HEADER
from simulation.explore_store.agent import Agent, call_kind
from simulation.explore_store.process import INCARNATION, SEED_DEADLINE_S, Incarnation, ScheduleRun
from trainer.gym.transport import Origin, Reply, Timeouts

ADOPT_ONLY = ADOPT_ONLY_HEADER.encode()


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
            # Durable from here: the debts it records may be acknowledged (checked at each /acknowledge).
            self._run.owed_durable.update(_owed_in(result))
            self._inc.at_append("after_append", n)
            if _prepares(fn.__name__, args):
                inc = self._inc
                inc.prepares += 1
                if inc._hit("after_prepare", inc.prepares) and inc._stale():
                    self._run.counts["stale_prepares"] += 1
                inc.at_append("after_prepare", inc.prepares)
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

    def _read(self) -> None:
        """Before each read of the log (a page, a stream's version) by a recovering process that is
        still loading: the plan's `fold_break` kills the connection there."""
        inc, run = self._inc, self._run
        broken = run.plan.fold_break
        if broken is None or inc.number == 0 or inc.trainer != broken[0] or inc.ready.is_set():
            return
        inc.load_reads += 1
        if broken[1] <= inc.load_reads <= broken[2]:
            run.counts["fold_reads_broken"] += 1
            raise DatabaseUnavailable("the connection was killed while the log was read (injected)")

    def read_pages(self, *args: Any, **kwargs: Any) -> Any:
        self._read()
        for page in super().read_pages(*args, **kwargs):
            yield page
            self._read()

    def stream_version(self, stream_id: str) -> int:
        self._read()
        return super().stream_version(stream_id)

    def append(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(super().append, args, kwargs)

    def append_batch(self, *args: Any, **kwargs: Any) -> Any:
        return self._counted(super().append_batch, args, kwargs)

    def wait_idle(self, timeout_s: float) -> bool:
        with self.idle:
            return self.idle.wait_for(lambda: self.in_flight == 0, timeout_s)


_JSON = [(b"content-type", b"application/json")]
# How long a stale owner's late /run waits for the successor to retire its try at the agent.
LATE_RUN_GATE_S = 5.0


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
        if kind == "ack":
            _check_owed_first(run, body)
        if kind == "run":
            # It left the trainer's own queue (the checker: no lease runs out before this).
            run.runs_sent.add(_subject_of(body, agent.key))
            inc.runs += 1
            if inc.at_run(inc.runs):
                return await self._late_run(method, target, headers, body)
        run.agent_calls[agent.key] += 1
        keep = run.plan.restarts.get((agent.key, run.agent_calls[agent.key]))
        if keep is not None:
            agent.restart(keep)
            run.counts["agent_restarts_kept" if keep else "agent_restarts_lost"] += 1
            run.counts["agent_clock_jumps_back"] += agent.clock_back
        run.kind_calls[(agent.key, kind)] += 1
        if kind == "run" and run.plan.replay == (agent.key, run.kind_calls[(agent.key, kind)]):
            run.replays.setdefault(
                agent.key, (_subject_of(body, agent.key), method, target, tuple(headers), body)
            )
        fault = run.plan.faults.get((agent.key, kind, run.kind_calls[(agent.key, kind)]))
        run.per_try[(kind, _subject_of(body, agent.key))] += 1
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
        if kind == "run" and run.plan.tamper and (ADOPT_ONLY, b"1") in headers:
            reply = _altered(reply)
            run.counts["adopt_replies_altered"] += reply.status == 200
        await inc.at_call("after_call", n)
        if fault == "reply_lost":
            raise httpx.ReadError(f"{what}: connection lost after the agent acted")
        if fault == "non_json":
            return Reply(200, [(b"content-type", b"text/html")], b"<html>502 Bad Gateway</html>")
        inc.check()
        return reply

    async def _late_run(
        self, method: str, target: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> Reply:
        """A stale owner's /run held in the network: it arrives once the successor has recovered and
        retired the try at the agent (the agent's durable records say so; the wait is bounded, as
        the successor may have had no reason to), and the agent has restarted, on its state directory
        or (`late_run_lost`) on an empty one.
        It is on its way whatever becomes of the process that sent it (no trainer's task carries it)."""
        inc, agent, run = self.inc, self.agent, self.run
        rid, _, index = _subject_of(body, agent.key).partition("#")
        key = (rid, int(index)) if index.isdigit() else None

        async def arrive() -> Reply:
            await asyncio.to_thread(inc.released.wait, SEED_DEADLINE_S)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + LATE_RUN_GATE_S
            retired = False
            while key is not None and not retired and loop.time() < deadline:
                seen = (await asyncio.to_thread(read_evidence, agent.state_dirs[0])).tries.get(key)
                retired = seen is not None and seen.retired
                if not retired:
                    await asyncio.sleep(0.02)
            run.counts["late_runs_after_retire" if retired else "late_runs_not_retired"] += 1
            # With its state lost (the plan's `late_run_lost`) the agent forgot the retire and runs the
            # try: the result is a stray the trainer must release (docs/protocol.md, Stray results).
            keep = not run.plan.late_run_lost
            agent.restart(keep)
            run.counts["agent_restarts_kept" if keep else "agent_restarts_lost"] += 1
            if not keep:
                run.counts["late_runs_on_lost_state"] += 1
            return await agent.call(method, target, headers, body)

        context = contextvars.copy_context()
        context.run(INCARNATION.set, None)
        delivery = asyncio.get_running_loop().create_task(arrive(), context=context)
        delivery.add_done_callback(_consume)
        run.late_runs.add(delivery)
        return await asyncio.shield(delivery)

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


def _owed_in(result: Any) -> set[tuple[str, int]]:
    """The tries whose ACK debt (`AckOwed`) an append (`AppendResult`, or a batch's list of them) wrote."""
    results = result if isinstance(result, list) else [result]
    return {
        (r.data["receipt"]["rollout_id"], r.data["receipt"]["attempt_index"])
        for res in results
        for r in res.records
        if r.type == "AckOwed"
    }


def _check_owed_first(run: ScheduleRun, body: bytes) -> None:
    """The order rule of an ACK: the agent may forget a result only once the log durably owes its ACK
    (the seal and the debt in one append, before the ACK is sent).  An `/acknowledge` naming a try whose
    `AckOwed` no append has yet written is a violation, whatever becomes of the call."""
    try:
        items = json.loads(body)["executions"]
        named = [(i["receipt"]["rollout_id"], i["receipt"]["attempt_index"]) for i in items]
    except (ValueError, KeyError, TypeError):
        return  # not an ACK the checker can read: the agent refuses it
    for rid, n in named:
        if (rid, n) not in run.owed_durable:
            run.problems.append(f"the ACK of {rid}#{n} was sent before its AckOwed was durable in the log")


def _altered(reply: Reply) -> Reply:
    """An adopt-only /run's reply altered on its way back (a lying agent, a corrupting proxy): its
    reward changed, so it no longer hashes to the digest the agent's receipt names."""
    try:
        data = json.loads(reply.body)
    except ValueError:
        return reply
    if reply.status != 200 or not isinstance(data, dict):
        return reply
    data["reward"] = float(data.get("reward") or 0.0) + 1.0
    return Reply(reply.status, reply.headers, json.dumps(data).encode())


def _prepares(method: str, args: Any) -> bool:
    """Whether an append (`append(stream, events, ...)` or `append_batch(appends, ...)`) holds a
    `CheckpointPrepareStarted`."""
    appends = args[0] if method == "append_batch" else [args[:2]]
    return any(
        getattr(e, "type", type(e).__name__) == "CheckpointPrepareStarted"
        for append in appends
        for e in append[1]
    )


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
