"""Against the real NeMo Gym: `simple_agent` + `example_single_tool_call` + a stub model, on loopback,
from nemo-gym 0.4.0 in its own Python 3.12 environment (built and cached by `environment.py`; never
skipped: the first run builds it).

The coordinator runs the `ledger simulate` workload against the agent with the participant mounted,
with faults: replies of /run lost after the agent answered (the trainer's connection drops them), model
failures (the stub answers 500 to every Nth call, the agent's /run fails), and a checkpoint every
second; then against the same real agent without the participant (reduced mode).  Every token record
the participant and the reference agent wrote is checked with the real Gym's own models.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from eventstore import EventStore, open_store, upgrade_database
from gym_agent.config import AgentConfig
from gym_agent.server import serve_in_thread
from participant import read_evidence
from protocol.wire import RunRequest
from simulation.run import SimConfig, run_simulation
from tests.realgym.servers import RealGym, real_gym
from trainer.gym import ConnectionLostError, GymClient

# One worker runs them all (`--dist=loadgroup`): one set of servers, one environment build.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("realgym")]

# Every 29th model call fails: with two model calls per try, about one try in fifteen fails, and a
# prompt group (whose siblings are replaced together when one fails) seals within a few rounds.
FAIL_EVERY = 29
NEMO_RL_ROW = {"agent_ref": {"type": "responses_api_agents", "name": "simple_agent"}, "_ng_task_index": 0}


def _dropped(rollout_id: str, attempt_index: int) -> bool:
    """About one try in eight loses its reply, decided by its identity (the same in every run)."""
    return hashlib.sha256(f"{rollout_id}|{attempt_index}".encode()).digest()[0] % 8 == 0


class DroppingClient(GymClient):
    """A real client whose first `/run` of some tries loses the reply after the agent answered it:
    the connection breaks on the way back, as the reference agent's drop_reply fault does."""

    dropped: int = 0
    # Every /run that reached the agent, per try (reduced mode: the agent keeps no evidence).
    posted: Counter[tuple[str, int]] = Counter()

    async def _send(self, pool: Any, method: str, path: str, **kwargs: Any) -> Any:
        body = kwargs.get("body")
        if path == "/run" and isinstance(body, RunRequest):
            DroppingClient.posted[(body.rollout_id, body.attempt_index)] += 1
        payload = await super()._send(pool, method, path, **kwargs)
        adopt = any(name.lower() == b"x-ledger-adopt-only" for name, _ in kwargs.get("extra_headers", ()))
        if (
            path == "/run"
            and isinstance(body, RunRequest)
            and not adopt
            and _dropped(body.rollout_id, body.attempt_index)
        ):
            DroppingClient.dropped += 1
            raise ConnectionLostError(f"POST {self.base_url}/run: reply lost on the way back (injected)")
        return payload


@pytest.fixture(scope="module")
def gym(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealGym]:
    with real_gym(tmp_path_factory.mktemp("realgym"), fail_every=FAIL_EVERY) as running:
        yield running


@pytest.fixture
def store(pg_url: str) -> Iterator[EventStore]:
    upgrade_database(pg_url)
    s = open_store(pg_url)
    try:
        yield s
    finally:
        s.close()


def _check_tokens(gym: RealGym, records: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    path = gym.workdir / f"{name}.json"
    path.write_text(json.dumps(list(records)))
    done = gym.run_script("check_tokens.py", str(path))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["checked"] == len(records) > 0
    return result


def _sealed_token_records(store: EventStore, run_id: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for event in store.read_all(0, types=["SiblingSealed"]):
        if run_id in event.stream_id:
            blob = store.get_blob(event.data["receipt"]["tokens_digest"])
            assert blob is not None
            records += json.loads(blob)
    return records


async def test_plain_agents_answer_run_and_only_the_mounted_one_participates(gym: RealGym) -> None:
    agent, plain = gym.servers["agent"].url, gym.servers["plain_agent"].url
    row = {"_ng_rollout_id": "probe", "_ng_attempt_index": 0, **NEMO_RL_ROW,
           "responses_create_params": {"input": [{"role": "user", "content": "weather in sf?"}]}}  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as http:
        assert (await http.get(plain + "/capabilities")).status_code == 404
        real = (await http.post(plain + "/run", json=row)).json()
        assert {"responses_create_params", "response", "reward"} <= set(real)
        caps = (await http.get(agent + "/capabilities")).json()
        assert caps["agent_name"] == "simple_agent"
        mounted = (await http.post(agent + "/run", json=row)).json()
        assert mounted["_ng_rollout_id"] == "probe" and mounted["reward"] == real["reward"] == 1.0
        tokens = (await http.get(agent + "/token_capture/probe")).json()
    # Released, so the probe does not hold up the workloads' checkpoints (a result the log never
    # minted blocks a prepare until it is gone).
    async with GymClient(agent, "simple_agent") as client:
        [ack] = await client.acknowledge([await client.completion_receipt("probe", 0)])
        assert ack.acknowledged
    assert [t["model_call_id"] for t in tokens] == ["call-1", "call-2"]
    assert all(t["routed_experts"] for t in tokens)
    _check_tokens(gym, tokens, "probe")


async def test_coordinator_with_faults_against_the_participant(gym: RealGym, store: EventStore) -> None:
    DroppingClient.dropped = 0
    config = SimConfig(
        agent_urls={"simple_agent": gym.servers["agent"].url},
        agent_state_dirs={"simple_agent": gym.state_dir},
        groups=16,
        siblings=4,
        checkpoint_every_s=1.0,
        rollout_timeout_s=60.0,
        prepare_timeout_s=30.0,
        park_grace_s=5.0,
        max_tries=8,
        row_fields=NEMO_RL_ROW,
        run_id="rgp",
    )
    summary = await run_simulation(store, config, client_factory=DroppingClient)
    assert summary["reduced_mode_agents"] == []
    assert summary["groups_sealed"] == 16 and summary["groups_dead_lettered"] == 0, summary
    assert summary["stranded"] == 0 and summary["duplicate_executions"] == 0, summary
    assert summary["audit_violations"] == 0, summary
    assert summary["checkpoints_committed"] >= 1, summary
    assert summary["debts_outstanding"] == 0, summary
    # The faults happened: lost replies were adopted, failed tries replaced.
    assert DroppingClient.dropped > 0 and summary["adopted"] > 0, summary
    assert summary["replacements"] > 0, summary
    evidence = read_evidence(gym.state_dir)
    assert evidence.duplicate_executions == 0 and not evidence.stranded
    records = _sealed_token_records(store, "rgp")
    # The MoE router's choices reached the log with the token arrays.
    assert records and all(r["routed_experts"] for r in records)
    result = _check_tokens(gym, records, "participant")
    assert not result["errors"]


async def test_coordinator_in_reduced_mode_against_the_plain_agent(gym: RealGym, store: EventStore) -> None:
    DroppingClient.dropped = 0
    DroppingClient.posted.clear()
    config = SimConfig(
        agent_urls={"simple_agent_plain": gym.servers["plain_agent"].url},
        groups=12,
        siblings=4,
        checkpoint_every_s=1.0,
        rollout_timeout_s=60.0,
        max_tries=8,
        row_fields=NEMO_RL_ROW,
        run_id="rgr",
    )
    summary = await run_simulation(store, config, client_factory=DroppingClient)
    assert summary["reduced_mode_agents"] == ["simple_agent_plain"]
    assert summary["groups_sealed"] == 12 and summary["groups_dead_lettered"] == 0, summary
    assert summary["stranded"] == 0 and summary["audit_violations"] == 0, summary
    # Lost replies cannot be adopted in reduced mode: they are replaced.  An adoption replays the
    # trainer's own copy of a reply it holds: no try reached the agent twice.
    assert DroppingClient.dropped > 0 and summary["replacements"] > 0, summary
    assert DroppingClient.posted and max(DroppingClient.posted.values()) == 1
    # Checkpoints ran without the agent: none lists it as a participant.
    started = [e for e in store.read_all(0, types=["CheckpointPrepareStarted"]) if "rgr" in e.stream_id]
    assert started and all(e.data["participants"] == [] for e in started)
    receipts = [e for e in store.read_all(0, types=["ReceiptFetched"]) if "rgr" in e.stream_id]
    assert receipts and all(e.data["receipt"]["execution_generation"] == 0 for e in receipts)
    assert not _check_tokens(gym, _sealed_token_records(store, "rgr"), "reduced")["errors"]


async def test_reference_agent_token_records_pass_the_real_gym(gym: RealGym, tmp_path: Path) -> None:
    config = AgentConfig(name="reference", state_dir=tmp_path / "ref", turns=(2, 3), log_level="warning")
    records: list[dict[str, Any]] = []
    with serve_in_thread(config) as agent:
        async with GymClient(agent.url, "reference") as client:
            for i in range(4):
                request = RunRequest(rollout_id=f"ref{i}_g0", attempt_index=0, task={"i": i})
                await client.run(request)
                records += [t.model_dump(mode="json") for t in await client.token_capture(f"ref{i}_g0")]
    assert not _check_tokens(gym, records, "reference")["errors"]
