"""`ledger simulate` runs on one log: each is its own trainer, an interrupted one winds down and leaves
nothing undecided, a later run never waits on (or claims) what an earlier one left, and `--resume`
drives every group it inherits to an end.  In process, on real agents over loopback HTTP; every step
waits for its gate (the coordinator's own state), never for a time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from eventstore import EventStore, open_store
from gym_agent.config import AgentConfig
from gym_agent.server import ThreadAgent, serve_in_thread
from projections.runner import rebuild
from simulation.run import RunInterrupted, RunStalled, SimConfig, run_simulation
from trainer import RolloutCoordinator
from trainer.checkpoints import CheckpointOutcome
from trainer.gym import GymClient

# Far above what any of these runs takes; reached only if a run waits for ever (the fault under test).
RUN_BOUND_S = 240.0
# The interrupted run's size: enough that its gate (a checkpoint in flight mid-run) comes long before it ends.
GROUPS = 60


def _pair(stack: ExitStack, folder: Path) -> dict[str, ThreadAgent]:
    return {
        name: stack.enter_context(
            serve_in_thread(
                AgentConfig(
                    name=name, state_dir=folder / name, log_level="warning", turns=(1, 2), delay_s=0.02
                )
            )
        )
        for name in ("agent-0", "agent-1")
    }


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[dict[str, ThreadAgent]]:
    with ExitStack() as stack:
        yield _pair(stack, tmp_path / "agents")


@pytest.fixture
def other_agents(tmp_path: Path) -> Iterator[dict[str, ThreadAgent]]:
    """Another run's own agents, with the same names (as every `ledger simulate` starts its own): an
    agent serves one trainer."""
    with ExitStack() as stack:
        yield _pair(stack, tmp_path / "other-agents")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EventStore]:
    s = open_store(f"sqlite:///{tmp_path / 'ledger.db'}", migrate_schema=True)
    yield s
    s.close()


def config(agents: dict[str, ThreadAgent], run_id: str, groups: int, **overrides: Any) -> SimConfig:
    values: dict[str, Any] = {
        "agent_urls": {n: a.url for n, a in agents.items()},
        "agent_state_dirs": {n: a.config.state_dir for n, a in agents.items()},
        "groups": groups,
        "siblings": 2,
        "faults": "",
        "checkpoint_every_s": 0.2,
        "turns": (1, 2),
        "run_id": run_id,
    }
    return SimConfig(**(values | overrides))


class Watched(RolloutCoordinator):
    """The real coordinator, kept where the test's gates can read its state."""

    made: list[RolloutCoordinator] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        Watched.made.append(self)


class HeldAtPrepare(Watched):
    """The real coordinator, whose first checkpoint taken once a group is decided stops at its
    prepared point (CheckpointPrepareStarted in the log, every agent prepared, nothing decided) and
    stays there until the run is interrupted: the gate the interrupt test waits for, reached however
    fast the run goes."""

    held: str | None = None

    async def checkpoint(
        self, checkpoint_id: str, participants: list[str] | None = None
    ) -> CheckpointOutcome:
        decided = any(g.status != "open" for g in self.ledger.groups.values()) or bool(self.ledger.archived)
        if self.held is not None or not decided:
            return await super().checkpoint(checkpoint_id, participants)
        prepared = await self.prepare_checkpoint(checkpoint_id, participants)
        if isinstance(prepared, CheckpointOutcome):  # aborted at a prepare: the next one is held
            return prepared
        self.held = checkpoint_id
        await asyncio.Event().wait()  # until the interrupt cancels the checkpoint loop
        raise AssertionError("unreachable")


def run_groups(store: EventStore, run_id: str) -> dict[str, str]:
    """Every group of the run in the log, and its status."""
    ledger = rebuild(store).state("ledger")
    groups = {g: s.status for g, s in ledger.groups.items()} | {
        g: a.status for g, a in ledger.archived.items()
    }
    return {g: s for g, s in groups.items() if g.startswith(f"{run_id}-")}


async def test_an_interrupted_run_winds_down_another_run_ends_and_a_resumed_one_finishes(
    store: EventStore, agents: dict[str, ThreadAgent], other_agents: dict[str, ThreadAgent]
) -> None:
    stop = asyncio.Event()
    seen: list[tuple[int, int]] = []
    open_at_gate: set[str] = set()

    def interrupt_mid_run(decided: int, total: int) -> None:
        # The gate: a group decided, others open, more not yet submitted, and a checkpoint in flight
        # whose prepare is in the log (the interrupt must decide it; one only begun in this process,
        # its CheckpointPrepareStarted not yet written, leaves nothing to decide).
        coord = Watched.made[-1]
        assert isinstance(coord, HeldAtPrepare)
        submitted = sum(1 for g in [*coord.ledger.groups, *coord.ledger.archived] if g.startswith("first-"))
        seen.append((decided, submitted))
        preparing = (coord.active_checkpoint is not None) and any(
            c.status == "preparing" and c.checkpoint_id.startswith("first-")
            for c in coord.checkpoints.checkpoints.values()
        )
        if coord.held is not None:
            assert decided >= 1 and coord.open_groups() and submitted < total and preparing, (
                decided,
                submitted,
                coord.open_groups(),
            )
            open_at_gate.update(coord.open_groups())
            stop.set()

    Watched.made.clear()
    with pytest.raises(RunInterrupted) as interrupted:
        async with asyncio.timeout(RUN_BOUND_S):
            await run_simulation(
                store,
                config(agents, "first", GROUPS, window_per_agent=2),
                coordinator_factory=HeldAtPrepare,
                progress=interrupt_mid_run,
                stop=stop,
            )
    left = interrupted.value
    # Submitting stops at the interrupt; the tries in flight may finish while the run winds down (how
    # many depends on the machine's speed), so the groups open at the gate are each left open for the
    # resume or decided, none lost either way.
    assert left.run_id == "first" and left.unsubmitted >= 1 and open_at_gate
    assert open_at_gate <= run_groups(store, "first").keys()
    assert "ledger simulate --resume first" in left.line()
    # The progress moved while groups were still being submitted.
    assert any(decided >= 1 and submitted < GROUPS for decided, submitted in seen), seen
    # Nothing undecided: every checkpoint of the run is committed or aborted, and no agent is left
    # paused or preparing by it.
    checkpoints = rebuild(store).state("checkpoints")
    mine = [c for c in checkpoints.checkpoints.values() if c.checkpoint_id.startswith("first-")]
    assert mine and all(c.status in ("resumed", "aborted") for c in mine), [c.status for c in mine]
    assert not [c for c in [*checkpoints.in_doubt(), *checkpoints.to_resume()] if c.trainer_id == "first"]
    for name, agent in agents.items():
        async with GymClient(agent.url, name) as client:
            status = await client.status()
            assert status.phase == "idle" and status.active_checkpoint_id is None, (name, status)
    open_before = {g for g, s in run_groups(store, "first").items() if s == "open"}
    assert len(open_before) == left.open_groups, (open_before, Watched.made[-1].open_groups())

    # A new run on the same log is its own trainer: it ends, and claims only its own groups.
    async with asyncio.timeout(RUN_BOUND_S):
        second = await run_simulation(store, config(other_agents, "second", 3))
    assert second["groups_sealed"] == 3 and second["groups_claimed"] == 3
    assert {g for g, s in run_groups(store, "first").items() if s == "open"} == open_before

    # Resumed, the first run drives every group it left open to an end, and submits the rest.
    async with asyncio.timeout(RUN_BOUND_S):
        resumed = await run_simulation(store, config(agents, "first", GROUPS, resume=True))
    groups = run_groups(store, "first")
    assert len(groups) == GROUPS and "open" not in groups.values(), groups
    assert resumed["groups_sealed"] + resumed["groups_dead_lettered"] == GROUPS
    assert resumed["stranded"] == 0 and resumed["duplicate_executions"] == 0
    assert resumed["audit_violations"] == 0


async def test_a_run_to_resume_must_be_in_the_log(store: EventStore, agents: dict[str, ThreadAgent]) -> None:
    from simulation.run import SimulationError

    with pytest.raises(SimulationError, match="holds no run 'nosuch'"):
        await run_simulation(store, config(agents, "nosuch", 2, resume=True))


async def test_a_run_whose_groups_never_move_stops_as_stalled(
    store: EventStore, agents: dict[str, ThreadAgent]
) -> None:
    """Every try hangs and the rollout deadline is far away: nothing moves, and the run says so within
    its stall timeout instead of waiting for ever."""
    with pytest.raises(RunStalled, match="no group moved for 2 s"):
        async with asyncio.timeout(RUN_BOUND_S):
            await run_simulation(
                store,
                config(agents, "stuck", 2, faults="hang=1", checkpoint_every_s=0, rollout_timeout_s=3600.0,
                       stall_timeout_s=2.0),
            )  # fmt: skip


class _NoSuchRoute(BaseHTTPRequestHandler):
    """An HTTP server that has none of the reference agent's extra routes, as a real Gym agent or a
    plain one: 404 (FastAPI's body) to every request, /health included."""

    def _answer(self) -> None:
        body = b'{"detail":"Not Found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: Any) -> None:
        pass


async def test_an_agent_that_answers_http_without_a_health_route_is_reachable() -> None:
    """Reachable means it answered HTTP at all: a 404 at /health is an agent to drive (without
    injected faults), not the one-line 'nothing listening' error."""
    from simulation.run import Agents

    server = ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRoute)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        agents = Agents(SimConfig(agent_urls={"gym": url}, groups=1, faults="drop_reply=0.1"))
        async with agents:
            assert list(agents.clients) == ["gym"] and agents.injectable == []
    finally:
        server.shutdown()
        server.server_close()


async def test_a_run_drives_agents_that_want_a_token_with_its_token_and_says_so_without(
    store: EventStore, tmp_path: Path
) -> None:
    """Agents listening beyond loopback want a token (compose's do): a run given it drives them; a run
    without it stops before anything is submitted, in one line."""
    from pydantic import SecretStr

    from simulation.run import SimulationError

    token = "s3cret-token"
    with serve_in_thread(
        AgentConfig(name="agent-0", state_dir=tmp_path / "a0", log_level="warning", turns=(1, 1),
                    token=SecretStr(token))
    ) as agent:  # fmt: skip
        agents = {"agent-0": agent}
        with pytest.raises(SimulationError, match=r"agent-0 at .* refuses a call without a token"):
            await run_simulation(store, config(agents, "notoken", 2, checkpoint_every_s=0))
        assert run_groups(store, "notoken") == {}
        async with asyncio.timeout(RUN_BOUND_S):
            summary = await run_simulation(store, config(agents, "withtoken", 2, agent_token=token))
    assert summary["groups_sealed"] == 2 and summary["stranded"] == 0, summary
