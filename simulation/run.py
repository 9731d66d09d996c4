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
import dataclasses
import functools
import statistics
import tempfile
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
from gym_resources.book import SideEffects, side_effects
from gym_resources.server import serve_in_thread as serve_resources
from participant.continuations import TurnFigures, read_index, turn_figures
from participant.evidence import read_evidence
from projections.generation import GENERATION_EVENTS, GenerationFigures, generation_figures
from protocol.streams import checkpoint_stream, group_stream, trainer_stream
from protocol.wire import CrashAfter, RateFaults
from simulation.config import DEFAULT_FAULTS, RUN_ID, Fault, SimConfig, parse_faults
from trainer.checkpoint import CheckpointOutcome
from trainer.context import log
from trainer.coordinator import RolloutCoordinator
from trainer.errors import ClaimWhilePrepared, CoordinatorStopped
from trainer.eventloop import wait_at_most
from trainer.gym import GymClient
from trainer.gym.errors import AgentUnavailableError, GymError, NotFoundError, UnauthorizedError

# A claim that meets a prepared checkpoint waits for its decision (each one bounded by the prepare
# deadline), a few checkpoints in a row at most.
CLAIM_WAIT_S = 900.0
CLAIM_TRIES = 8
# Claims of the simulated training loop waiting for the log at once.
CLAIMS_IN_FLIGHT = 32


class SimulationError(Exception):
    """A run that cannot start or carry on, said in one line (the command prints it)."""


class RunStalled(SimulationError):
    """No group of the run moved for the stall timeout: the run stops instead of waiting for ever."""


@dataclass
class RunInterrupted(Exception):
    """The run was asked to stop (Ctrl-C, SIGTERM) and stopped cleanly: its checkpoint in flight was
    decided or aborted, its coordinator closed, its agents stopped.  What it left for `--resume`."""

    run_id: str
    groups: int
    open_groups: int
    unsubmitted: int
    tries_in_flight: int
    # The signal that asked for the stop (the command's exit status is 128 + it), when known.
    signum: int | None = None

    def line(self) -> str:
        left = f"{self.open_groups} of {self.groups} groups open ({self.tries_in_flight} tries in flight)"
        if self.unsubmitted:
            left += f", {self.unsubmitted} never submitted"
        if not self.open_groups and not self.unsubmitted:
            return f"interrupted: run {self.run_id} had nothing left open"
        return f"interrupted: run {self.run_id} left {left}; carry on with: ledger simulate --resume {self.run_id}"


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

    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def check(self) -> None:
        """Raises what ended the loop, if it failed (the run stops then, instead of going on without
        checkpoints and reporting it at the end)."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            error = self._task.exception()
            if error is not None:
                raise error

    async def interrupt(self) -> None:
        """Stops at once (the run was interrupted): a checkpoint in flight is cancelled (its prepare
        is presumed aborted at the agents), then every checkpoint of this trainer the log holds
        undecided is aborted there and at the agents, and a committed one is finished, so none is
        left open and no agent keeps its admission closed."""
        if self._task is not None:
            self._stop.set()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            # What the cancelled checkpoint had already handed to the writer is written after it was
            # cancelled: recovery reads the log once that is in, or it misses a started prepare.
            await self.coord.journal.settle()
        await self.coord.checkpointer.recover()

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
    """The training loop: claims each group as it seals, at steps 0, 1, 2, ... in the order they
    sealed, until cancelled.  Up to CLAIMS_IN_FLIGHT claims wait for the log at once (they go into
    the journal's batches together): one at a time, a claim's round trip behind the journal's large
    batches made the loop fall behind the seals of real-sized rollouts, and the backlog outlast the
    run's end."""
    slots = asyncio.Semaphore(CLAIMS_IN_FLIGHT)
    pending: set[asyncio.Task[None]] = set()
    failed: list[BaseException] = []
    loop_task = asyncio.current_task()

    async def claim(group_id: str, step: int) -> None:
        try:
            for tries_left in range(CLAIM_TRIES - 1, -1, -1):
                try:
                    await coord.claim_for_training(group_id, step)
                    break
                except ClaimWhilePrepared:
                    # The periodic checkpoint is prepared: the claim goes in after its decision.
                    if not await coord.wait_checkpoint_decided(CLAIM_WAIT_S) or not tries_left:
                        raise
            claimed.append(group_id)
        except Exception as exc:
            if isinstance(exc, CoordinatorStopped) and coord.ctx.stopping and coord.journal.stopped is None:
                # The run closed its coordinator (its end, or an interrupt) while this claim waited:
                # the group stays sealed and unclaimed for the resumed run, not a failure of the loop.
                return
            failed.append(exc)
            if loop_task is not None:
                loop_task.cancel()  # the loop ends with this error (below), not when the next group seals
        finally:
            slots.release()

    step = 0
    try:
        async for group in coord.sealed_groups(until_idle=False):
            await slots.acquire()
            if failed:
                raise failed[0]
            task = asyncio.create_task(claim(group.group_id, step), name=f"claim-{group.group_id}")
            pending.add(task)
            task.add_done_callback(pending.discard)
            step += 1
    except asyncio.CancelledError:
        if failed:
            raise failed[0] from None
        raise
    finally:
        for task in list(pending):
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def summarize(store: EventStore, run_id: str) -> Counter[str]:
    prefixes = (group_stream(run_id), checkpoint_stream(run_id))
    return Counter(e.type for e in store.read_all(0) if e.stream_id.startswith(prefixes))


class Agents:
    """The workload's agents: K reference agents started on loopback (or the running ones named by
    URL), the fault mix set on them, and a supervisor that starts again one that crashed (as a real
    deployment would).  `final_counts` reads what only the agents know: stranded results and
    duplicate executions."""

    def __init__(self, config: SimConfig, client_factory: Callable[..., GymClient] = GymClient) -> None:
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
        # The resources server the run's tools call (config.resources), with its journal's folder.
        self._resources = contextlib.ExitStack()
        self.resources_dir: Path | None = None

    def _start_resources(self, root: Path | None) -> list[str]:
        """Starts the resources server (state kept under the run's folder, so a resumed run's server
        answers repeats from its journal) and returns the agents' options that point them at it."""
        if self.config.resources is None:
            return []
        if root is None:
            root = Path(self._resources.enter_context(tempfile.TemporaryDirectory(prefix="resources-")))
        self.resources_dir = root / "resources"
        served = self._resources.enter_context(serve_resources(self.resources_dir))
        return ["--resources-url", served.url, "--resources", self.config.resources]

    def side_effects(self) -> SideEffects | None:
        """What the resources server's journal shows (durable evidence), if the run had one."""
        return side_effects(self.resources_dir) if self.resources_dir is not None else None

    async def __aenter__(self) -> Agents:
        config = self.config
        fault = parse_faults(config.faults)
        urls = dict(config.agent_urls)
        if not urls:
            root = config.agent_state_root
            tools = await asyncio.to_thread(self._start_resources, root)
            self.processes = [
                AgentProcess(
                    f"agent-{i}",
                    seed=config.seed + i,
                    turns=config.turns,
                    delay_s=config.agent_delay_s,
                    state_dir=None if root is None else root / f"agent-{i}",
                    token=config.agent_token,
                    extra_args=[*config.agent_args(), *tools],
                )
                for i in range(config.agents)
            ]
            try:
                await asyncio.gather(*(asyncio.to_thread(p.start) for p in self.processes))
            except BaseException:
                await asyncio.gather(*(asyncio.to_thread(p.close) for p in self.processes))
                await asyncio.to_thread(self._resources.close)
                raise
            urls = {p.name: p.url for p in self.processes}
        self.state_dirs = {p.name: p.state_dir for p in self.processes} | dict(config.agent_state_dirs)
        self.clients = {name: self._client(url, name) for name, url in urls.items()}
        try:
            await self._check_reachable(urls)
            for i, (name, client) in enumerate(self.clients.items()):
                try:
                    await client.set_faults(RateFaults(rates=fault.rates, seed=config.seed * 1000 + i))
                    self.injectable.append(name)
                except NotFoundError:
                    log.warning(
                        "agent %s has no fault injection (a real Gym agent): no faults injected", name
                    )
                except UnauthorizedError:
                    raise SimulationError(
                        f"agent {name} at {urls[name]} refuses "
                        + ("this run's token" if config.agent_token else "a call without a token")
                        + " (401): give its token with --agent-token or $LEDGER_GYM_TOKEN"
                    ) from None
            if fault.crash_after is not None and self.injectable:
                await self.clients[self.injectable[0]].set_faults(CrashAfter(crash_after=fault.crash_after))
        except BaseException:
            await self.__aexit__()
            raise
        self._supervisor = asyncio.create_task(self._supervise())
        return self

    def _client(self, url: str, name: str) -> GymClient:
        if self.config.agent_token is None:
            return self.client_factory(url, name)
        return self.client_factory(url, name, token=self.config.agent_token)

    async def _check_reachable(self, urls: dict[str, str]) -> None:
        """Every agent answers HTTP before the run starts: one named by URL with nothing listening (or
        that never answers) is a mistake the user fixes (one line), not a run that fails try by try.
        Any answer counts, whatever its status: a real Gym agent or a plain one has no /health (404)."""
        for name, client in self.clients.items():
            try:
                await client.health()
            except AgentUnavailableError as exc:
                raise SimulationError(
                    f"agent {name} at {urls[name]} does not answer ({exc}): start it "
                    f"(ledger gym serve --name {name} --port PORT) or fix --agent-url"
                ) from None
            except GymError:
                pass  # it answered HTTP: reachable

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

    async def turn_counts(self) -> TurnFigures:
        """What turn-level resume saved and what was done twice, from the agents' continuation
        indexes (durable evidence; agents whose state directory is unknown count nothing)."""
        total = TurnFigures()
        for state_dir in self.state_dirs.values():
            index = await asyncio.to_thread(read_index, state_dir)
            total = total + turn_figures(index)
        return total

    async def __aexit__(self, *exc: object) -> None:
        await self.stop_supervising()
        for client in self.clients.values():
            await client.aclose()
        await asyncio.gather(*(asyncio.to_thread(p.close) for p in self.processes))
        await asyncio.to_thread(self._resources.close)


async def run_simulation(
    store: EventStore,
    config: SimConfig,
    *,
    coordinator_factory: type[RolloutCoordinator] = RolloutCoordinator,
    client_factory: Callable[..., GymClient] = GymClient,
    progress: Callable[[int, int], None] | None = None,
    stop: asyncio.Event | None = None,
    stop_after_s: float | None = None,
) -> dict[str, Any]:
    """Runs the workload and returns its summary (`stop_after_s`: `stop` is set that long after the
    coordinator started, the agents up).  `progress(decided, total)` is called as groups are
    decided; once `stop` is set the run winds down (`RunInterrupted`).  `SimulationError` when it
    cannot start (a run to resume the log does not hold, an agent away) or stalls."""
    run_id = config.run_id or f"s{uuid.uuid4().hex[:6]}"
    if not RUN_ID.fullmatch(run_id):
        raise SimulationError(f"run id {run_id!r} is not 1-24 letters, digits, '.', '_' or '-'")
    if config.resume and await asyncio.to_thread(store.stream_version, trainer_stream(run_id)) < 0:
        raise SimulationError(
            f"this log holds no run {run_id!r} to resume (ledger status lists the trainers)"
        )
    stop = stop if stop is not None else asyncio.Event()
    started = time.monotonic()
    async with Agents(config, client_factory) as agents:
        clients = agents.clients
        settings: dict[str, Any] = {
            "mode": config.mode,
            "rollout_timeout_s": config.rollout_timeout_s,
            "prepare_timeout_s": config.prepare_timeout_s,
            "park_grace_s": config.park_grace_s,
            "max_tries": config.max_tries,
            "target_level": config.target_level,
            "mask_sample_retries": config.mask_sample_retries,
            # Each run is its own trainer: another run's groups on this log are never driven or claimed.
            "trainer_id": run_id,
        }
        if (
            config.resume
        ):  # every group the run left open is driven (retired or adopted first) or dead-lettered
            coord = await coordinator_factory.recover(store, clients, **settings)
        else:
            coord = coordinator_factory(store, clients, **settings)
            await coord.start()
        timer = (
            None if stop_after_s is None else asyncio.get_running_loop().call_later(stop_after_s, stop.set)
        )
        try:
            facts = await _drive_run(coord, config, run_id, agents, started, progress, stop)
        finally:
            if timer is not None:
                timer.cancel()
            await coord.close()
            await coord.journal.drain()
            await agents.stop_supervising()
    return await summarize_run(store, config, run_id, agents, facts)


# Parts a run with trainer kills may take before it is declared stalled (each kill is one part).
MAX_TRAINER_KILLS = 1000


async def run_with_trainer_kills(
    store: EventStore,
    config: SimConfig,
    every_s: float,
    *,
    progress: Callable[[int, int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Runs the workload, stopping its trainer every `every_s` seconds and recovering it from the log
    (`resume`), until the run ends.  Each stop closes the coordinator wherever its drivers are (tries
    in flight stay at the agents) and restarts the agents it started, their state directories kept;
    the next part recovers every open group (retire or adopt, then a replacement).  The summary is
    the whole run's, with `trainer_kills`."""
    stop = stop if stop is not None else asyncio.Event()
    kills = 0
    while True:
        part_stop = asyncio.Event()
        relay = asyncio.create_task(stop.wait())
        relay.add_done_callback(functools.partial(_set_on_done, part_stop))
        try:
            summary = await run_simulation(
                store, config, progress=progress, stop=part_stop, stop_after_s=every_s
            )
        except RunInterrupted:
            if stop.is_set() or kills >= MAX_TRAINER_KILLS:
                raise
            kills += 1
            config = dataclasses.replace(config, resume=True)
            continue
        finally:
            relay.cancel()
        summary["trainer_kills"] = kills
        return summary


def _set_on_done(event: asyncio.Event, _: object) -> None:
    event.set()


async def _drive_run(
    coord: RolloutCoordinator,
    config: SimConfig,
    run_id: str,
    agents: Agents,
    started: float,
    progress: Callable[[int, int], None] | None,
    stop: asyncio.Event,
) -> RunFacts:
    names = sorted(agents.clients)
    window = max(1, config.window_per_agent * len(names))
    outcomes: list[CheckpointOutcome] = []
    claimed: list[str] = []
    group_ids = [f"{run_id}-p{i}" for i in range(config.groups)]

    async def feed() -> None:
        for i, group_id in enumerate(group_ids):
            while len(coord.open_groups()) >= window:
                await asyncio.sleep(0.02)
            # Idempotent: a resumed run's groups already in the log are not reserved again.
            await coord.submit(
                group_id,
                PromptRef(sample_id=f"sample-{i}", task_name="arith"),
                names[i % len(names)],
                config.siblings,
                {**config.row_fields, **workload_payload(i)},
            )

    def decided() -> int:
        ledger = coord.ledger
        return sum(
            1
            for g in group_ids
            if g in ledger.archived or (g in ledger.groups and ledger.groups[g].status != "open")
        )

    async def run_to_the_end() -> None:
        feeder = asyncio.create_task(feed(), name="feed")
        stall_s = config.stall_after_s()
        moved_at, last = time.monotonic(), _movement(coord)
        try:
            while True:
                if feeder.done():
                    feeder.result()  # its error, if it failed
                    if not coord.open_groups():
                        return
                if coord.errors:
                    raise coord.errors[0]
                checkpoints.check()
                if progress is not None:
                    progress(decided(), config.groups)
                now, seen = time.monotonic(), _movement(coord)
                if seen != last:
                    moved_at, last = now, seen
                elif now - moved_at > stall_s:
                    open_ = coord.open_groups()
                    raise RunStalled(
                        f"run {run_id}: no group moved for {stall_s:.0f} s with {len(open_)} open "
                        f"({', '.join(open_[:5])}{', ...' if len(open_) > 5 else ''}); stopped"
                    )
                await asyncio.sleep(0.1)
        finally:
            if not feeder.done():
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder

    # A resumed run numbers its checkpoints on from those its earlier part took (ids are never reused).
    taken = sum(1 for c in coord.journal.checkpoints.checkpoints if c.startswith(f"{run_id}-ckpt-"))
    checkpoints = CheckpointLoop(
        coord, config.checkpoint_every_s, lambda k: f"{run_id}-ckpt-{taken + k}", outcomes
    )
    trainer = asyncio.create_task(claim_as_sealed(coord, claimed), name="train")
    work = asyncio.create_task(run_to_the_end(), name="run")
    stopping = asyncio.create_task(stop.wait(), name="stop")
    try:
        await asyncio.wait({work, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
            await checkpoints.interrupt()
            await coord.close()  # its drivers stop: what is open now stays open
            await coord.journal.drain()  # and what they had queued is in the log
            ledger = coord.ledger
            open_ = coord.open_groups()
            known = sum(1 for g in group_ids if ledger.knows_group(g))
            raise RunInterrupted(
                run_id=run_id,
                groups=config.groups,
                open_groups=len(open_),
                unsubmitted=config.groups - known,
                tries_in_flight=sum(
                    1
                    for g in open_
                    for s in ledger.groups[g].siblings.values()
                    if s.current is not None and s.current.status in ("dispatched", "replied")
                ),
            )
        await work
        await checkpoints.finish()
        await coord.wait_idle(60)
        if progress is not None:
            progress(decided(), config.groups)
        # The training loop claims what sealed last (bounded: it claims on every change of the log).
        async with asyncio.timeout(30):
            while coord.sealed_unclaimed() and not trainer.done():
                await asyncio.sleep(0.05)
    finally:
        stopping.cancel()
        for task in (work, trainer):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if checkpoints.running():
            await checkpoints.interrupt()
    elapsed = time.monotonic() - started
    stranded, duplicates = await agents.final_counts()
    turns = await agents.turn_counts()
    effects = await asyncio.to_thread(agents.side_effects)
    ledger = coord.ledger
    return RunFacts(
        wall_s=elapsed,
        groups_claimed=len(claimed),
        prepare_waits=[w for o in outcomes for w in o.prepare_wait_s.values()],
        stranded=stranded,
        duplicate_executions=duplicates,
        debts_outstanding=sum(
            1 for a, r in ledger.unpaid_debts() if r.rollout_id.startswith(run_id) and a in agents.clients
        ),
        journal_appends=coord.journal.appends,
        journal_batches=coord.journal.batches,
        payload_puts=coord.payloads.puts,
        payload_store_calls=coord.payloads.put_calls,
        turns=turns,
        side_effects=effects,
    )


def _movement(coord: RolloutCoordinator) -> tuple[int, int]:
    """What changes whenever a group of the coordinator moves: how many are open, and the sum of
    their stream versions (every mint, dispatch, reply, seal and retire appends to its group)."""
    groups = coord.ledger.groups
    open_ = coord.open_groups()
    return len(open_), sum(groups[g].stream_version for g in open_)


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
    payload_puts: int = 0
    payload_store_calls: int = 0
    turns: TurnFigures = field(default_factory=TurnFigures)
    side_effects: SideEffects | None = None


async def summarize_run(
    store: EventStore, config: SimConfig, run_id: str, agents: Agents, facts: RunFacts
) -> dict[str, Any]:
    """The summary `ledger simulate` prints: counts from the log, the agents' own, the audit."""
    counts = await asyncio.to_thread(summarize, store, run_id)
    generation = await asyncio.to_thread(run_generation, store, run_id)
    waits = facts.prepare_waits
    audit: int | None = None
    rules: list[str] = []
    broken: list[str] = []
    try:
        from eventstore.payload_stores import payload_plane
        from projections.audit import audit_log

        # `ledger audit`'s whole audit: every rule of the log and the payload rules (every claimed
        # payload read back from the store the run wrote to, the database's own integrity check).
        report = await asyncio.to_thread(audit_log, store, None, payload_plane(store))
        audit, rules = len(report.violations), report.rules_checked
        broken = sorted({v.rule for v in report.violations})
    except ImportError:
        audit = None
    return {
        "run_id": run_id,
        "mode": config.mode,
        "target_level": config.target_level,
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
        **generation.summary(),
        "thrown_by_checkpoints_warning": generation.warning(),
        "turns_resumed": facts.turns.turns_resumed,
        "turns_redone": facts.turns.turns_redone,
        "model_tokens_saved": facts.turns.model_tokens_saved,
        "continuations_resumed": facts.turns.resumes,
        "continuations_declined": facts.turns.declines,
        # From the resources server's journal (None: the run called no tools): mutations applied,
        # undone by restores, and keys whose effect stands twice (none, if the protocol holds).
        "side_effects_applied": None if facts.side_effects is None else facts.side_effects.applied,
        "side_effects_reverted": None if facts.side_effects is None else facts.side_effects.reverted,
        "side_effects_twice": None if facts.side_effects is None else len(facts.side_effects.twice),
        "agent_restarts": agents.restarts,
        "reduced_mode_agents": sorted(n for n, c in agents.clients.items() if c.reduced is not None),
        "stranded": facts.stranded,
        "duplicate_executions": facts.duplicate_executions,
        "audit_violations": audit,
        "audit_rules": len(rules),
        "audit_rules_broken": broken,
        "events": sum(counts.values()),
        # Group commit: appends written, and the store transactions (append-lock holds) they took.
        "journal_appends": facts.journal_appends,
        "journal_batches": facts.journal_batches,
        # The same for payload puts: the puts, and the store calls (thread hops, statements) they took.
        "payload_puts": facts.payload_puts,
        "payload_store_calls": facts.payload_store_calls,
    }


def run_generation(store: EventStore, run_id: str) -> GenerationFigures:
    """The run's model time and what its checkpoints threw away (projections.generation), from its
    groups' streams."""
    prefix = group_stream(run_id)
    return generation_figures(
        e for e in store.read_all(0, types=GENERATION_EVENTS) if e.stream_id.startswith(prefix)
    )


def _completed_answers(store: EventStore, run_id: str) -> int:
    return sum(
        1
        for e in store.read_all(0, types=["AttemptRetired"])
        if e.stream_id.startswith(group_stream(run_id))
        and e.data.get("outcome") == "completed_unacknowledged"
    )


def failed(summary: dict[str, Any]) -> bool:
    return bool(
        summary["stranded"]
        or summary["duplicate_executions"]
        or (summary["audit_violations"] or 0)
        or (summary.get("side_effects_twice") or 0)
    )


__all__ = [
    "DEFAULT_FAULTS",
    "Agents",
    "CheckpointLoop",
    "Fault",
    "RunFacts",
    "RunInterrupted",
    "RunStalled",
    "SimConfig",
    "SimulationError",
    "failed",
    "parse_faults",
    "run_simulation",
    "run_with_trainer_kills",
    "summarize_run",
    "workload_payload",
]
