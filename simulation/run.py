"""`ledger simulate`: K reference agents, a faulty workload, checkpoints, and a summary of what happened.

Used by `cli/simulate.py` and `benchmarks/checkpoint_stall.py`.  Counts come from the log (the
events of this run's streams), the agents' durable execution evidence where their state directory
is known (agents started here, or `agent_state_dirs`): duplicate executions and stranded results
across restarts; otherwise the agents' /status and /debug/runs.  Agents given by URL may be real
Gym agents: one without fault injection (/debug/faults) runs without injected faults, one without
the participant routes in reduced mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eventstore import EventStore
from eventstore.events import PromptRef
from gym_agent.launcher import AgentProcess
from participant.evidence import read_evidence
from protocol.streams import checkpoint_stream, group_stream
from protocol.wire import CrashAfter, FaultRates, RateFaults
from trainer.checkpoint import CheckpointOutcome
from trainer.context import log
from trainer.coordinator import RolloutCoordinator
from trainer.eventloop import wait_at_most
from trainer.gym import GymClient
from trainer.gym.errors import GymError, NotFoundError

DEFAULT_FAULTS = "drop_reply=0.05,fail=0.05,hang=0.01"


@dataclass
class SimConfig:
    agents: int = 2
    agent_urls: dict[str, str] = field(default_factory=dict)
    groups: int = 24
    siblings: int = 4
    mode: str = "prompt_group"
    faults: str = DEFAULT_FAULTS
    checkpoint_every_s: float = 2.0
    prepare_timeout_s: float = 30.0
    rollout_timeout_s: float = 10.0
    park_grace_s: float = 1.0
    seed: int = 0
    # Groups open at once per agent: keeps the agents (one model thread each) responsive.
    window_per_agent: int = 3
    turns: tuple[int, int] = (1, 3)
    agent_delay_s: float = 0.02
    # Rounds (and failures of each kind) a group may spend.  The default fault mix fails about one
    # prompt-group round in five (5 % environment failures and 1 % hangs over 4 siblings), so 4 rounds
    # dead-lettered a group in about one run of 48 groups in ten; 8 makes that about one in 40,000.
    max_tries: int = 8
    run_id: str = ""
    # State directories of agents given by URL, for their durable execution evidence.
    agent_state_dirs: dict[str, Path] = field(default_factory=dict)
    # Fields every `/run` row carries besides the prompt (e.g. a NeMo RL row's `agent_ref`).
    row_fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Fault:
    rates: FaultRates
    crash_after: int | None


def parse_faults(text: str) -> Fault:
    values: dict[str, float] = {}
    crash: int | None = None
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"fault {part!r} is not NAME=VALUE")
        if name == "crash_after":
            crash = int(value)
        elif name in ("drop_reply", "fail", "hang"):
            values[name] = float(value)
        else:
            raise ValueError(f"unknown fault {name!r} (drop_reply, fail, hang, crash_after)")
    return Fault(FaultRates(**values), crash)


class CheckpointLoop:
    """A checkpoint every `every_s` (none when it is 0) while a workload runs, from its creation until
    `finish`."""

    def __init__(
        self,
        coord: RolloutCoordinator,
        every_s: float,
        checkpoint_id: Callable[[int], str],
        outcomes: list[CheckpointOutcome],
    ) -> None:
        self.coord = coord
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run(every_s, checkpoint_id, outcomes)) if every_s > 0 else None

    async def _run(
        self, every_s: float, checkpoint_id: Callable[[int], str], outcomes: list[CheckpointOutcome]
    ) -> None:
        k = 0
        while True:
            await wait_at_most(self._stop.wait(), every_s)
            if self._stop.is_set():
                return
            outcomes.append(await self.coord.checkpoint(checkpoint_id(k)))
            k += 1

    async def finish(self) -> None:
        """Lets the checkpoint in flight (if any) finish: cancelling it would leave it undecided, and
        recovery would presume it aborted (a CheckpointAborted the workload did not cause).  Then
        leaves none of this coordinator's agents paused (a no-op when every checkpoint was decided;
        another trainer's checkpoints are not its own)."""
        if self._task is None:
            return
        self._stop.set()
        await self._task
        await self.coord.checkpointer.recover()


async def claim_as_sealed(coord: RolloutCoordinator, claimed: list[str]) -> None:
    """The training loop: claims each group as it seals, at steps 0, 1, 2, ..., until cancelled."""
    async for group in coord.sealed_groups(until_idle=False):
        await coord.claim_for_training(group.group_id, len(claimed))
        claimed.append(group.group_id)


def summarize(store: EventStore, run_id: str) -> Counter[str]:
    prefixes = (group_stream(run_id), checkpoint_stream(run_id))
    return Counter(e.type for e in store.read_all(0) if e.stream_id.startswith(prefixes))


class Agents:
    """The workload's agents: K reference agents started on loopback (or the running ones named by
    URL), the fault mix set on them, and a supervisor that starts again one that crashed (as a real
    deployment would).  `final_counts` reads what only the agents know: stranded results and
    duplicate executions."""

    def __init__(
        self, config: SimConfig, client_factory: Callable[[str, str], GymClient] = GymClient
    ) -> None:
        self.config = config
        self.client_factory = client_factory
        self.processes: list[AgentProcess] = []
        self.clients: dict[str, GymClient] = {}
        self.state_dirs: dict[str, Path] = {}
        # Agents that take injected faults (the reference agent; a real Gym agent has no /debug/faults).
        self.injectable: list[str] = []
        self.restarts = 0
        self._stop = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Agents:
        config = self.config
        fault = parse_faults(config.faults)
        urls = dict(config.agent_urls)
        if not urls:
            self.processes = [
                AgentProcess(
                    f"agent-{i}", seed=config.seed + i, turns=config.turns, delay_s=config.agent_delay_s
                )
                for i in range(config.agents)
            ]
            await asyncio.gather(*(asyncio.to_thread(p.start) for p in self.processes))
            urls = {p.name: p.url for p in self.processes}
        self.state_dirs = {p.name: p.state_dir for p in self.processes} | dict(config.agent_state_dirs)
        self.clients = {name: self.client_factory(url, name) for name, url in urls.items()}
        try:
            for i, (name, client) in enumerate(self.clients.items()):
                try:
                    await client.set_faults(RateFaults(rates=fault.rates, seed=config.seed * 1000 + i))
                    self.injectable.append(name)
                except NotFoundError:
                    log.warning(
                        "agent %s has no fault injection (a real Gym agent): no faults injected", name
                    )
            if fault.crash_after is not None and self.injectable:
                await self.clients[self.injectable[0]].set_faults(CrashAfter(crash_after=fault.crash_after))
        except BaseException:
            await self.__aexit__()
            raise
        self._supervisor = asyncio.create_task(self._supervise())
        return self

    async def _supervise(self) -> None:
        while not self._stop.is_set():
            for p in self.processes:
                if not p.is_running():
                    self.restarts += 1
                    await asyncio.to_thread(p.start)
            await asyncio.sleep(0.1)

    async def stop_supervising(self) -> None:
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor

    async def final_counts(self) -> tuple[int, int]:
        """(stranded results, duplicate executions): from an agent's durable execution evidence where
        its state directory is known (counts across restarts), else as the agent reports them."""
        stranded, duplicates = 0, 0
        for name, client in self.clients.items():
            state_dir = self.state_dirs.get(name)
            if state_dir is not None:
                evidence = await asyncio.to_thread(read_evidence, state_dir)
                stranded += len(evidence.stranded)
                duplicates += evidence.duplicate_executions
                continue
            try:
                status = await client.status()
                stranded += status.completed_unacknowledged
                if name in self.injectable:  # the reference agent's in-memory counters
                    runs = await client.debug_runs()
                    duplicates += sum(v - 1 for v in runs.values() if v > 1)
            except GymError as exc:
                log.error("final status of %s unavailable: %s", name, exc)
        return stranded, duplicates

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_supervising()
        for client in self.clients.values():
            await client.aclose()
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in self.processes))


async def run_simulation(
    store: EventStore,
    config: SimConfig,
    *,
    coordinator_factory: Callable[..., RolloutCoordinator] = RolloutCoordinator,
    client_factory: Callable[[str, str], GymClient] = GymClient,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    run_id = config.run_id or f"s{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    async with Agents(config, client_factory) as agents:
        clients = agents.clients
        coord = coordinator_factory(
            store,
            clients,
            mode=config.mode,
            rollout_timeout_s=config.rollout_timeout_s,
            prepare_timeout_s=config.prepare_timeout_s,
            park_grace_s=config.park_grace_s,
            max_tries=config.max_tries,
        )
        await coord.start()
        names = sorted(clients)
        window = max(1, config.window_per_agent * len(names))
        outcomes: list[CheckpointOutcome] = []
        claimed: list[str] = []

        async def feed() -> None:
            for i in range(config.groups):
                while len(coord.open_groups()) >= window:
                    await asyncio.sleep(0.02)
                await coord.submit(
                    f"{run_id}-p{i}",
                    PromptRef(sample_id=f"sample-{i}", task_name="arith"),
                    names[i % len(names)],
                    config.siblings,
                    {**config.row_fields, **workload_payload(i)},
                )

        feeder = asyncio.create_task(feed())
        checkpoints = CheckpointLoop(
            coord, config.checkpoint_every_s, lambda k: f"{run_id}-ckpt-{k}", outcomes
        )
        trainer = asyncio.create_task(claim_as_sealed(coord, claimed))
        await feeder
        while coord.open_groups():
            if coord.errors:
                raise coord.errors[0]
            if progress is not None:
                progress(config.groups - len(coord.open_groups()), config.groups)
            await asyncio.sleep(0.1)
        await checkpoints.finish()
        await coord.wait_idle(60)
        if progress is not None:
            progress(config.groups, config.groups)
        await asyncio.sleep(0.2)
        trainer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await trainer
        elapsed = time.monotonic() - started
        stranded, duplicates = await agents.final_counts()
        await coord.close()
        await agents.stop_supervising()

    ledger = coord.ledger
    return await summarize_run(
        store,
        config,
        run_id,
        agents,
        RunFacts(
            wall_s=elapsed,
            groups_claimed=len(claimed),
            prepare_waits=[w for o in outcomes for w in o.prepare_wait_s.values()],
            stranded=stranded,
            duplicate_executions=duplicates,
            debts_outstanding=sum(
                1 for a, r in ledger.unpaid_debts() if r.rollout_id.startswith(run_id) and a in clients
            ),
            journal_appends=coord.journal.appends,
            journal_batches=coord.journal.batches,
        ),
    )


def workload_payload(i: int) -> dict[str, Any]:
    """The task of prompt `i`: a sum the reference agent's arithmetic environment checks."""
    return {"responses_create_params": {"input": [{"role": "user", "content": f"{i}+{i}?"}]}}


@dataclass(frozen=True)
class RunFacts:
    """What the driver of a run knows beyond the log and the agents."""

    wall_s: float
    groups_claimed: int
    prepare_waits: list[float]
    stranded: int
    duplicate_executions: int
    debts_outstanding: int
    journal_appends: int
    journal_batches: int


async def summarize_run(
    store: EventStore, config: SimConfig, run_id: str, agents: Agents, facts: RunFacts
) -> dict[str, Any]:
    """The summary `ledger simulate` prints: counts from the log, the agents' own, the audit."""
    counts = await asyncio.to_thread(summarize, store, run_id)
    waits = facts.prepare_waits
    audit: int | None = None
    try:
        from projections.audit import audit_log

        audit = len((await asyncio.to_thread(audit_log, store)).violations)
    except ImportError:
        audit = None
    return {
        "run_id": run_id,
        "mode": config.mode,
        "agents": len(agents.clients),
        "groups": config.groups,
        "siblings": config.siblings,
        "wall_s": round(facts.wall_s, 2),
        "groups_sealed": counts["GroupSealed"],
        "groups_claimed": facts.groups_claimed,
        "groups_abandoned": counts["GroupAbandoned"],
        "groups_dead_lettered": counts["GroupDeadLettered"],
        "tries": counts["AttemptMinted"] + counts["ReplacementMinted"],
        "replacements": counts["ReplacementMinted"],
        "retired": counts["AttemptRetired"] - _completed_answers(store, run_id),
        "adopted": counts["AttemptAdopted"],
        "acks_accepted": counts["AckAccepted"],
        "acks_rejected": counts["AckRejected"],
        "debts_outstanding": facts.debts_outstanding,
        "checkpoints_committed": counts["CheckpointCommitted"],
        "checkpoints_aborted": counts["CheckpointAborted"],
        "prepare_wait_p50_s": round(statistics.median(waits), 3) if waits else None,
        "prepare_wait_max_s": round(max(waits), 3) if waits else None,
        "agent_restarts": agents.restarts,
        "reduced_mode_agents": sorted(n for n, c in agents.clients.items() if c.reduced is not None),
        "stranded": facts.stranded,
        "duplicate_executions": facts.duplicate_executions,
        "audit_violations": audit,
        "events": sum(counts.values()),
        # Group commit: appends written, and the store transactions (append-lock holds) they took.
        "journal_appends": facts.journal_appends,
        "journal_batches": facts.journal_batches,
    }


def _completed_answers(store: EventStore, run_id: str) -> int:
    return sum(
        1
        for e in store.read_all(0, types=["AttemptRetired"])
        if e.stream_id.startswith(group_stream(run_id))
        and e.data.get("outcome") == "completed_unacknowledged"
    )


def failed(summary: dict[str, Any]) -> bool:
    return bool(summary["stranded"] or summary["duplicate_executions"] or (summary["audit_violations"] or 0))
