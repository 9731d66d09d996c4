"""What every simulated process of one schedule shares (`ScheduleRun`): the plan, the agents, the counts
the checker reads, and the gates between processes."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from simulation.explore_store.agent import Agent
from simulation.explore_store.plan import CallKind, Plan
from simulation.explore_store.process import Incarnation


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
