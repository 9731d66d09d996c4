"""The adapter on a real local Ray: NeMo RL's streaming call, an actor killed mid-run, logprob actors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from eventstore import open_store
from projections.audit import audit_log
from protocol.streams import group_stream
from tests.ray.conftest import nemo_rows
from tests.rollout.conftest import MakeAgent
from tests.userenv import user_env
from trainer.gym import GymClient
from trainer.ray_gym import LedgerGymConfig, ledger_gym_actor
from trainer.ray_gym.local import init_local_ray, prepare_loopback
from trainer.ray_gym.rows import call_digest, group_id

prepare_loopback()  # as a driver with a Ray of its own does, before Ray's import (docs/nemo-rl.md)
import ray  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    init_local_ray(
        num_cpus=2,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", os.getcwd())}},
    )
    try:
        yield
    finally:
        ray.shutdown()


async def _stream(gym: Any, rows: list[dict[str, Any]], kill_after: int | None = None) -> list[Any]:
    """NeMo RL's call site (`run_async_nemo_gym_rollout`), killing the actor after `kill_after` items."""
    got = []
    async for ref in gym.run_rollouts.options(num_returns="streaming").remote(rows, "timing/rollout"):
        got.append(await ref)
        if kill_after is not None and len(got) == kill_after:
            ray.kill(gym, no_restart=False)  # a crash: Ray restarts the actor and retries the call
    return got


async def test_an_actor_killed_mid_run_recovers_with_nothing_lost(
    local_ray: None, sqlite_url: str, make_agent: MakeAgent
) -> None:
    a, b = make_agent("a"), make_agent("b")
    rows = nemo_rows(6, 2, ["a", "b"])
    config = LedgerGymConfig(
        db_url=sqlite_url, agents={"a": a.url, "b": b.url}, rollout_timeout_s=60.0, prepare_timeout_s=60.0
    )
    gym = ledger_gym_actor().remote(config)
    await gym._spinup.remote()
    got = await _stream(gym, rows, kill_after=3)
    await gym.wait_idle.remote(60)
    assert ray.get(gym.health_check.remote()) is None
    await gym.shutdown.remote()

    # Every row exactly once, each with its own reply.
    assert Counter(i for i, _, _ in got) == Counter(range(12))
    for rowidx, result, _ in got:
        assert result["full_result"]["responses_create_params"] == rows[rowidx]["responses_create_params"]
    store = open_store(sqlite_url)
    try:
        digest = call_digest(rows)
        for k in range(6):
            types = Counter(e.type for e in store.read_stream(group_stream(group_id("nrl-", digest, 0, k))))
            assert types["GroupReserved"] == 1 and types["GroupSealed"] == 1
        # Recovered from the log twice: at the trainer's spin-up (to its checkpoint: none here) and
        # after the kill, keeping every claim (the trainer kept its state; only its actor died).
        restored = [e.data for e in store.read_all(0) if e.type == "TrainerRestored"]
        assert [r["claims_kept"] for r in restored] == [False, True]
        assert restored[1]["plan"]["claims_to_roll_back"] == 0
        claims = Counter(e.stream_id for e in store.read_all(0) if e.type == "GroupClaimedForTraining")
        assert sorted(claims.values()) == [1] * 6  # each group claimed once, none again by the replay
        assert audit_log(store).violations == []
    finally:
        store.close()
    for agent, name in ((a, "a"), (b, "b")):
        async with GymClient(agent.url, name) as client:
            assert all(n == 1 for n in (await client.debug_runs()).values())  # nothing ran twice
            assert (await client.status()).completed_unacknowledged == 0  # nothing stranded


def _pid_of(self: Any) -> int:
    return os.getpid()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


async def test_an_actor_stopped_by_sigterm_aborts_the_checkpoint_it_prepared(
    local_ray: None, sqlite_url: str, make_agent: MakeAgent
) -> None:
    """SIGTERM is how Ray and a job's supervisor stop an actor: it closes its coordinator on the way
    out, so a checkpoint it prepared and nobody decided is aborted at the agent (which admits work
    again) and in the log, instead of holding the agent until the next recovery."""
    agent = make_agent("a")
    gym = ledger_gym_actor(max_restarts=0).remote(LedgerGymConfig(db_url=sqlite_url, agents={"a": agent.url}))
    assert len(await _stream(gym, nemo_rows(1, 2, ["a"]))) == 2
    assert (await gym.prepare_checkpoint.remote("ck-sigterm"))["prepared"] is True
    async with GymClient(agent.url, "a") as client:
        assert (await client.status()).phase == "prepared"
        pid = await gym.__ray_call__.remote(_pid_of)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _running(pid) and time.monotonic() < deadline:  # the gate: it exited
            await asyncio.sleep(0.1)
        assert not _running(pid), "the actor did not exit within 60 s of SIGTERM"
        assert (await client.status()).phase == "idle"
    store = open_store(sqlite_url)
    try:
        types = [e.type for e in store.read_all(0) if e.stream_id.endswith("ck-sigterm")]
    finally:
        store.close()
    assert "CheckpointAborted" in types and "CheckpointCommitted" not in types, types


async def test_logprob_workers_run_as_ray_actors(
    local_ray: None, sqlite_url: str, make_agent: MakeAgent
) -> None:
    pytest.importorskip("torch")
    from trainer.ray_gym.logprobs import start_logprob_workers

    agent = make_agent("a")
    rows = nemo_rows(2, 2, ["a"])
    gym = ledger_gym_actor().remote(LedgerGymConfig(db_url=sqlite_url, agents={"a": agent.url}))
    got = await _stream(gym, rows)
    await gym.wait_idle.remote(60)
    await gym.shutdown.remote()
    assert len(got) == 4
    [worker] = start_logprob_workers(sqlite_url, 1, config={"poll_interval_s": 0.05})
    stats = ray.get(worker.run.remote(once=True), timeout=300)
    ray.get(worker.close.remote())
    assert stats["scored"] == 4 and stats["refused"] == 0
    store = open_store(sqlite_url)
    try:
        computed = [e for e in store.read_all(0) if e.type == "LogprobsComputed"]
        sealed = {
            (e.data["rollout_id"], e.data["attempt_index"])
            for e in store.read_all(0)
            if e.type == "SiblingSealed"
        }
        assert {(e.data["rollout_id"], e.data["attempt_index"]) for e in computed} == sealed
    finally:
        store.close()


def _descendants(root: int) -> set[int]:
    """Every process below `root` (Ray's GCS and raylet are the driver's children, its workers the
    raylet's), read from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue  # it ended
            parents[int(entry)] = int(stat.rpartition(")")[2].split()[1])
    found, frontier = set[int](), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


async def test_the_local_ray_listens_on_loopback_only(
    local_ray: None, sqlite_url: str, make_agent: MakeAgent
) -> None:
    agent = make_agent("a")
    gym = ledger_gym_actor().remote(LedgerGymConfig(db_url=sqlite_url, agents={"a": agent.url}))
    assert len(await _stream(gym, nemo_rows(1, 2, ["a"]))) == 2  # an actor and its worker are up
    ours = _descendants(os.getpid()) | {os.getpid()}
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30, check=True)
    listening: list[tuple[str, str]] = []  # (local address, process)
    for line in listing.stdout.splitlines():
        pids = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if pids & ours:
            listening.append((line.split()[3], line.split("users:")[-1]))
    await gym.shutdown.remote()
    names = " ".join(p for _, p in listening)
    assert "gcs_server" in names and "raylet" in names, listening  # the check saw Ray's daemons
    outward = [(a, p) for a, p in listening if a.rpartition(":")[0] not in _LOOPBACK]
    assert outward == [], f"listening beyond loopback: {outward}"


_LOOPBACK = {"127.0.0.1", "[::1]", "[::ffff:127.0.0.1]"}


def test_the_runnable_example_of_docs_nemo_rl(tmp_path: Path) -> None:
    """docs/nemo-rl.md's example, run as its command (`python -m simulation.nemo_rl_example`) in the
    environment a user has, so it starts its own local Ray (it once imported Ray before keeping it on
    loopback and died on any machine with an outward interface): NeMo RL's setup, streamed steps and
    save block on the real actor; the first run dies after the log's commit of its last step, before
    the rename; the second comes back on the step before, as NeMo RL does, and trains every row once."""
    command = [sys.executable, "-m", "simulation.nemo_rl_example", "--dir", str(tmp_path / "run")]
    done = subprocess.run(
        [*command, "--steps", "2", "--prompts", "1"],
        capture_output=True, text=True, env=user_env(), cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == {
        "steps": 2,
        "rows_trained": 4,  # 2 steps x 1 prompt x 2 generations
        "rows_trained_twice": 0,
        "tries_run_twice": 0,
        "checkpoints": ["step_1", "step_2"],  # the crashed tmp_step_2 saved again and finished
        "audit_violations": 0,
    }
