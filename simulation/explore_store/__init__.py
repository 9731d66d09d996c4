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
`DatabaseUnavailable`); one checkpoint per coordinator (one call, or prepare then commit, or
prepare then abort); and the fleet: trainers whose agents share names, a trainer starting on another's
agent (refused), a group id two trainers submit (the second refused), a run pool smaller than the
tries at once (no lease may run out in that queue); and a trainer's state rewound once its work is done:
restored to an older checkpoint, then to one on the branch that restore abandoned (refused).

Two seams carry the faults, both outside production code: each `GymClient`'s connection pools are
replaced by `FaultyPool` (the same `exchange` the lean transport offers; the agent's ASGI app is called
in-process through httpx's ASGI transport), and each coordinator's store is a `FaultyStore` (the real
store, its appends counted).  A crash cancels every task the trainer process started (a task factory
records them per process) and makes its every later call fail; the agents' tasks are not the trainer's.

The independent checker (`check`) reads only the log's events and the agents' durable records
(`executions.jsonl` of every state directory an agent ever had, its checkpoint artefacts, its final
`/status`) and what the clients' pools saw leave, never the projections: nothing executed twice, nothing stranded, every group sealed or
dead-lettered, no group trained twice (claims rolled back by a restore excepted, and none trained
again by a state a restore brought back) nor claimed by a fenced owner, every checkpoint's outcome in the log equal to every participant's, no agent left paused,
no newest owner fenced, retries bounded, and `projections.audit.audit_log` finds nothing.

The plan is a pure function of the seed; asyncio's interleaving of the coordinator's tasks is not, so a
seed replays the same faults at the same call indexes, while which try a call index lands on may vary.

    plan.py      the plan of a seed            agent.py     a reference agent in this process
    process.py   one trainer process           seams.py     FaultyStore, FaultyPool
    schedule.py  running one schedule          checker.py   the history checker
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from eventstore import upgrade_database
from simulation.explore_store.checker import check
from simulation.explore_store.plan import FAULTS, Plan, plan_of
from simulation.explore_store.process import ScheduleRun
from simulation.explore_store.schedule import run_schedule


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
    seed: int, url: str | None = None, workdir: Path | None = None, fleet: bool = True
) -> tuple[list[str], ScheduleRun]:
    """One seed on a fresh SQLite file under `workdir` (or on the log at `url`); `fleet=False`: its plan
    without the fleet's draws (`plan_of`)."""
    with contextlib.ExitStack() as stack:
        base = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"explore-{seed}-")))
        base = base / f"seed-{seed}-{uuid.uuid4().hex[:6]}"
        base.mkdir(parents=True)
        db = url or f"sqlite:///{base / 'ledger.db'}"
        if url is None:
            await asyncio.to_thread(upgrade_database, db)
        plan = plan_of(seed, "" if url is None else f"r{uuid.uuid4().hex[:4]}", fleet)
        run = await run_schedule(plan, db, base)
        violations = await check(run)
        for agent in run.agents.values():
            agent.registry.close()
            agent.registry.evidence.close()
        return violations, run


async def explore_real(seeds: int, first_seed: int = 0, url: str | None = None) -> RealExploration:
    quiet = [
        logging.getLogger(n)
        for n in ("trainer", "gym_agent", "participant", "eventstore", "simulation", "asyncio")
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


__all__ = [
    "FAULTS",
    "Plan",
    "RealExploration",
    "ScheduleRun",
    "check",
    "explore_real",
    "explore_seed",
    "plan_of",
    "run_schedule",
]
