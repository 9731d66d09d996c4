"""Against the real NeMo Gym 0.7.0 (its own Python 3.13.0 environment, built and cached by
`benchmarks/realgym/environment.py`; never skipped: the first run builds it): `simple_agent` + `example_single_tool_call`
+ a stub model, on loopback, and the Gym's own token capture (`real_gym.py`).

The coordinator runs the `ledger simulate` workload against the agent with the participant mounted,
with faults: replies of /run lost after the agent answered (the trainer's connection drops them),
model failures (the stub answers 500 to every Nth call, the agent's /run fails), and a checkpoint
every second; through a `legacy_agent` environment server with the participant mounted on it (the
path a 0.7.0 deployment uses); and against the plain agent (reduced mode).  Every token record that
reaches the log is read by the real `TokenEntry` (none refused, none changed by the trip) and every
sealed rollout is handed to the real `trajectories_for_rollout` with its reply's response: trainable
(not masked) with every call on the delivered chain.  Both ways: records written by the real Gym's
own capture path (delta prompts on) are served to our trainer and arrive in the log whole, and our
reader refuses exactly what the real reader refuses.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError

from benchmarks.realgym.servers import RealGym, real_gym
from eventstore import EventStore, open_store, upgrade_database
from eventstore.events import PromptRef, RolloutReceipt, RunReplied
from eventstore.payload_stores import payload_plane
from gym_agent.config import AgentConfig
from gym_agent.server import serve_in_thread
from participant import mount_participant, read_evidence
from participant.executions import RunSession
from payloads.replies import REPLY_APART_MEDIA_TYPE, put_arrays_back
from payloads.token_arrays import decode_payload
from protocol.digests import canonical_bytes, sha256_digest
from protocol.lineage import (
    assistant_fingerprint,
    conversation_digest,
    full_prompts,
    link_calls,
    token_digest,
)
from protocol.wire import RunReply, RunRequest, TokenEntry, gym_reply
from simulation.run import SimConfig, run_simulation
from tests.gates import HeldUntilPrepared
from tests.gym.test_token_records import CONVERSATIONS, REAL_RECORD, REFUSED, TOKEN_GOLDEN
from tests.realgym.servers import HERE, serve_app
from trainer import RolloutCoordinator
from trainer.gym import ConnectionLostError, GymClient

# One worker runs them all (`--dist=loadgroup`): one set of servers, one environment build.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("realgym")]

# Every 29th model call fails: with two model calls per try, about one try in fifteen fails, and a
# prompt group (whose siblings are replaced together when one fails) seals within a few rounds.
FAIL_EVERY = 29
NEMO_RL_ROW = {"agent_ref": {"type": "responses_api_agents", "name": "simple_agent"}, "_ng_task_index": 0}


def _dropped(rollout_id: str) -> bool:
    """About one rollout in eight loses the reply of its first `/run`, decided by its id (the same in
    every run), whichever attempt that `/run` is for: a checkpoint may retire a first attempt before
    it runs, and the loss must happen all the same."""
    return hashlib.sha256(rollout_id.encode()).digest()[0] % 8 == 0


class DroppingClient(GymClient):
    """A real client whose first `/run` of some tries loses the reply after the agent answered it:
    the connection breaks on the way back, as the reference agent's drop_reply fault does."""

    dropped: int = 0
    # Every /run that reached the agent, per try (reduced mode: the agent keeps no evidence).
    posted: Counter[tuple[str, int]] = Counter()
    # The rollouts whose reply was lost once already.
    lost: ClassVar[set[str]] = set()

    @classmethod
    def reset(cls) -> None:
        cls.dropped = 0
        cls.posted.clear()
        cls.lost.clear()

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
            and _dropped(body.rollout_id)
            and body.rollout_id not in DroppingClient.lost
        ):
            DroppingClient.lost.add(body.rollout_id)
            DroppingClient.dropped += 1
            raise ConnectionLostError(f"POST {self.base_url}/run: reply lost on the way back (injected)")
        return payload


class HeldUntilPreparedClient(HeldUntilPrepared, DroppingClient):
    """The gate (tests.gates) in front of the client that loses replies."""


class CheckpointOpensTheGate(RolloutCoordinator):
    """The real coordinator; its first checkpoint (however it ends) lets the held `/run`s go."""

    started: asyncio.Event | None = None

    async def checkpoint(self, checkpoint_id: str, participants: list[str] | None = None) -> Any:
        gate = CheckpointOpensTheGate.started
        assert gate is not None, "set CheckpointOpensTheGate.started in the test's loop first"
        try:
            return await super().checkpoint(checkpoint_id, participants)
        finally:
            gate.set()


class HeldUntilCheckpointedClient(DroppingClient):
    """The gate for a reduced-mode run that must see a checkpoint: no prepare goes to a plain agent,
    so no `/run` leaves the trainer until the coordinator's first checkpoint has run (or `HOLD_S`
    passed), and the run cannot end before it."""

    HOLD_S = 60.0

    async def _send(self, pool: Any, method: str, path: str, **kwargs: Any) -> Any:
        gate = CheckpointOpensTheGate.started
        assert gate is not None, "set CheckpointOpensTheGate.started in the test's loop first"
        if path == "/run":
            async with asyncio.timeout(self.HOLD_S):
                await gate.wait()
        return await super()._send(pool, method, path, **kwargs)


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


def _real(gym: RealGym, command: str, given: Any, name: str) -> Any:
    """`real_gym.py COMMAND` on `given`, in the real Gym's environment."""
    path = gym.workdir / f"{name}.{command}.json"
    path.write_text(json.dumps(given))
    done = gym.run_script(HERE / "real_gym.py", command, str(path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_trainable(gym: RealGym, rollouts: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """Every record read by the real `TokenEntry` as it came, every rollout trainable by the real
    consumer with all of its calls on the delivered chain."""
    result: dict[str, Any] = _real(gym, "consume", list(rollouts), name)
    assert result["records"] == sum(len(r["records"]) for r in rollouts) > 0
    assert result["refused"] == [] and result["changed"] == [], result
    for rollout in rollouts:
        built = result["rollouts"][rollout["rollout_id"]]
        assert built["mask_sample"] is False and built["error"] is None, (rollout["rollout_id"], built)
        metrics = built["metrics"]
        assert metrics["delivered_fraction"] == 1.0 and metrics["quarantined_calls"] == 0, built
        assert metrics["unresolved_parent_calls"] == 0 and metrics["roots"] == 1, built
        assert metrics["terminal_attribution"]["chain"] == "delivered", built
    return result


def _sealed_rollouts(store: EventStore, run_id: str, *, apart: bool = True) -> list[dict[str, Any]]:
    """Each sealed try of the run: its token records and its reply's response, read by their claims.
    `apart`: whether every reply was stored apart from its records' arrays (the real Gym's replies
    carry them; records the Gym wrote itself are not the reply's, so theirs is stored whole)."""
    plane = payload_plane(store)
    replies: dict[tuple[str, int], RunReplied] = {}
    for event in store.read_all(0, types=["RunReplied"]):
        if run_id in event.stream_id:
            replied = RunReplied.model_validate(event.data)
            replies[(replied.rollout_id, replied.attempt_index)] = replied
    rollouts = []
    for event in store.read_all(0, types=["SiblingSealed"]):
        if run_id not in event.stream_id:
            continue
        receipt = RolloutReceipt.model_validate(event.data["receipt"])
        claim = receipt.tokens_claim()
        replied = replies[(receipt.rollout_id, receipt.attempt_index)]
        reply_claim = replied.reply_claim()
        assert reply_claim is not None
        reply = json.loads(plane.get(reply_claim))
        tokens = plane.get(claim)
        assert (reply_claim.media_type == REPLY_APART_MEDIA_TYPE) is apart, reply_claim.media_type
        if apart:  # stored without the arrays its records hold: the Gym's reply made whole
            reply = put_arrays_back(reply, tokens)
            assert sha256_digest(canonical_bytes(reply)) == replied.reply_digest
        rollouts.append(
            {
                "rollout_id": receipt.capture_key,
                # Stored beside the reply: the records' output items are put back from it.
                "records": decode_payload(tokens, claim.media_type, reply=reply).to_records(),
                "response": reply["response"],
            }
        )
    return rollouts


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
    assert tokens[-1]["response_id"] == mounted["response"]["id"]
    _assert_trainable(
        gym, [{"rollout_id": "probe", "records": tokens, "response": mounted["response"]}], "probe"
    )


async def test_coordinator_with_faults_against_the_participant(gym: RealGym, store: EventStore) -> None:
    DroppingClient.reset()
    HeldUntilPreparedClient.prepared = asyncio.Event()  # a committed checkpoint by a gate, not by timing
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
    summary = await run_simulation(store, config, client_factory=HeldUntilPreparedClient)
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
    rollouts = _sealed_rollouts(store, "rgp")
    assert len(rollouts) == 16 * 4
    # The MoE router's choices reached the log with the token arrays.
    assert all(r["routed_experts"] for rollout in rollouts for r in rollout["records"])
    _assert_trainable(gym, rollouts, "participant")


async def test_coordinator_through_the_legacy_agent_environment_server(
    gym: RealGym, store: EventStore
) -> None:
    """The 0.7.0 path: the trainer talks to a `legacy_agent` environment server (the participant mounted
    on it) that relays `/run` to the plain agent; checkpoints and lost replies as against an agent."""
    DroppingClient.reset()
    HeldUntilPreparedClient.prepared = asyncio.Event()
    config = SimConfig(
        agent_urls={"legacy_agent": gym.servers["environment"].url},
        agent_state_dirs={"legacy_agent": gym.environment_state_dir},
        groups=6,
        siblings=4,
        checkpoint_every_s=1.0,
        rollout_timeout_s=60.0,
        prepare_timeout_s=30.0,
        park_grace_s=5.0,
        max_tries=8,
        row_fields=NEMO_RL_ROW,
        run_id="rge",
    )
    summary = await run_simulation(store, config, client_factory=HeldUntilPreparedClient)
    assert summary["reduced_mode_agents"] == []
    assert summary["groups_sealed"] == 6 and summary["groups_dead_lettered"] == 0, summary
    assert summary["stranded"] == 0 and summary["duplicate_executions"] == 0, summary
    assert summary["audit_violations"] == 0 and summary["debts_outstanding"] == 0, summary
    # The gate held every /run until the first prepare went out: a checkpoint went through the relay
    # before any try ran, and it was decided (the relay answers the phases as the participant does).
    assert DroppingClient.dropped > 0 and summary["adopted"] > 0, summary
    evidence = read_evidence(gym.environment_state_dir)
    assert evidence.duplicate_executions == 0 and not evidence.stranded
    started = [e for e in store.read_all(0, types=["CheckpointPrepareStarted"]) if "rge" in e.stream_id]
    assert started and all(e.data["participants"] == ["legacy_agent"] for e in started)
    decided = {e.stream_id for e in store.read_all(0, types=["CheckpointCommitted", "CheckpointAborted"])}
    assert {e.stream_id for e in started} <= decided
    assert summary["checkpoints_committed"] >= 1, summary  # the first: no try was running at the agent
    _assert_trainable(gym, _sealed_rollouts(store, "rge"), "environment")


async def test_coordinator_in_reduced_mode_against_the_plain_agent(gym: RealGym, store: EventStore) -> None:
    DroppingClient.reset()
    # A checkpoint started by a gate, not by a 12-group run outlasting the 1 s checkpoint timer.
    CheckpointOpensTheGate.started = asyncio.Event()
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
    summary = await run_simulation(
        store, config, coordinator_factory=CheckpointOpensTheGate, client_factory=HeldUntilCheckpointedClient
    )
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
    # A POSTed try that failed (the agent's 500) is never called "never started" (tombstoned).
    failed = [e for e in store.read_all(0, types=["RunFailed"]) if "rgr" in e.stream_id]
    assert failed and not any("never started" in e.data["reason"] for e in failed)
    _assert_trainable(gym, _sealed_rollouts(store, "rgr"), "reduced")


async def test_reference_agent_token_records_pass_the_real_gym(gym: RealGym, tmp_path: Path) -> None:
    config = AgentConfig(name="reference", state_dir=tmp_path / "ref", turns=(2, 3), log_level="warning")
    rollouts: list[dict[str, Any]] = []
    with serve_in_thread(config) as agent:
        async with GymClient(agent.url, "reference") as client:
            for i in range(4):
                request = RunRequest(rollout_id=f"ref{i}_g0", attempt_index=0, task={"i": i})
                reply = await client.run(request)
                records = (await client.token_capture(f"ref{i}_g0")).to_records()
                rollouts.append({"rollout_id": f"ref{i}_g0", "records": records, "response": reply.response})
    _assert_trainable(gym, rollouts, "reference")


def test_lineage_hashes_match_the_real_gym(gym: RealGym) -> None:
    tokens = [ids for ids, _ in TOKEN_GOLDEN] + [list(range(5000))]
    real = _real(gym, "hashes", {"tokens": tokens, "conversations": CONVERSATIONS}, "hashes")
    assert real["tokens"] == [token_digest(ids) for ids in tokens]
    assert real["fingerprints"] == [assistant_fingerprint(c) for c in CONVERSATIONS]
    assert real["contexts"] == [conversation_digest(c) for c in CONVERSATIONS]


def test_our_reader_refuses_exactly_what_the_real_reader_refuses(gym: RealGym) -> None:
    records = [REAL_RECORD, {k: v for k, v in REAL_RECORD.items() if k != "future_field"}]
    records += [REAL_RECORD | change for change, _ in REFUSED]
    verdicts = _real(gym, "read", records, "read")
    for record, verdict in zip(records, verdicts, strict=True):
        try:
            ours: dict[str, Any] | None = TokenEntry.model_validate(record).record()
        except ValidationError:
            ours = None
        assert (ours is not None) == verdict["ok"], (record, verdict)
        if ours is not None:
            assert ours == verdict["dump"] == record  # read whole, given back as it came
    assert [v["ok"] for v in verdicts] == [True, True] + [False] * len(REFUSED)


# --- records the real Gym writes, served to our trainer ------------------------------------------

USER = {"role": "user", "content": "weather in sf?"}
TOOL_OUTPUT = {"type": "function_call_output", "call_id": "call-1", "output": '{"weather": "cold"}'}


def _calls(n: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Two model calls of one try (a tool call, then the answer), whole prompts; and its /run reply."""
    call = {"type": "function_call", "id": f"fc-{n}", "call_id": "call-1", "name": "get_weather",
            "arguments": '{"city": "sf"}', "status": "completed"}  # fmt: skip
    answer = {"type": "message", "id": f"msg-{n}", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "cold", "annotations": []}]}  # fmt: skip
    user = USER | {"content": f"weather in sf? ({n})"}
    p1, g1 = [1, 7, 7 + n], [40, 41, 42]
    p2, g2 = [*p1, *g1, 50, 51], [60, 61]

    def served(rid: str, item: dict[str, Any], prompt: list[int], gen: list[int]) -> dict[str, Any]:
        arrays = {"prompt_token_ids": prompt, "generation_token_ids": gen,
                  "generation_log_probs": [-0.5] * len(gen), "routed_experts": [[[1, 2]]] * len(gen)}  # fmt: skip
        return {"id": rid, "model": "stub-policy", "output": [item | arrays]}

    calls = [
        {"request": [user], "response": served(f"resp-{n}-1", call, p1, g1)},
        {"request": [user, call, TOOL_OUTPUT], "response": served(f"resp-{n}-2", answer, p2, g2)},
    ]
    reply = {
        "responses_create_params": {"input": [user]},
        "response": {"id": f"resp-{n}-2", "model": "stub-policy", "output": [call, TOOL_OUTPUT, answer]},
        "reward": 1.0,
    }
    return calls, reply


async def test_records_the_real_gym_writes_reach_the_log_whole(gym: RealGym, store: EventStore) -> None:
    group = "rwriter"
    tries = {f"{group}_g{i}": _calls(i) for i in range(2)}
    written: dict[str, list[dict[str, Any]]] = _real(
        gym, "write", [{"rollout_id": rid, "calls": calls} for rid, (calls, _) in tries.items()], "write"
    )
    # The real writer stored the second call as a delta after its parent.
    assert all(records[1]["prompt_is_delta"] for records in written.values())

    async def replay_the_real_records(request: RunRequest, session: RunSession) -> RunReply:
        for raw in written[request.rollout_id]:
            session.record(TokenEntry.model_validate(raw))
        return gym_reply(tries[request.rollout_id][1], request.rollout_id, request.attempt_index)

    app = FastAPI()
    mount_participant(
        app, agent_name="writer", state_dir=gym.workdir / "writer", runner=replay_the_real_records
    )
    with serve_app(app) as url:
        async with GymClient(url, "writer") as client:
            coordinator = RolloutCoordinator(store, {"writer": client}, rollout_timeout_s=60.0)
            async with coordinator:
                prompt = PromptRef(sample_id="w", task_name="weather")
                await coordinator.submit(
                    group, prompt, "writer", 2, {"responses_create_params": {"input": [USER]}}
                )
                [sealed] = [s async for s in coordinator.sealed_groups()]
                assert sealed.group_id == group
                await coordinator.claim_for_training(group, 0)
                await coordinator.wait_idle(60.0)
    rollouts = _sealed_rollouts(store, group, apart=False)
    assert sorted(r["rollout_id"] for r in rollouts) == sorted(written)
    for rollout in rollouts:
        # Whole: every record exactly as the real Gym wrote it, lineage and all.
        assert rollout["records"] == written[rollout["rollout_id"]]
        calls, _ = tries[rollout["rollout_id"]]
        whole = [c["response"]["output"][0]["prompt_token_ids"] for c in calls]
        assert full_prompts([TokenEntry.model_validate(r) for r in rollout["records"]]) == whole
    result = _assert_trainable(gym, rollouts, "written")
    # And the lineage we write for the same calls is the one the real Gym wrote.
    for rid, (calls, _) in tries.items():
        ours = link_calls(
            [
                TokenEntry.model_validate(
                    {k: v for k, v in raw.items() if not k.startswith(("parent_", "continuation_", "cum_"))}
                    | {
                        "prompt_token_ids": c["response"]["output"][0]["prompt_token_ids"],
                        "prompt_is_delta": False,
                    }
                )
                for raw, c in zip(written[rid], calls, strict=True)
            ],
            [c["request"] for c in calls],
        )
        for mine, real in zip(ours, written[rid], strict=True):
            for name in ("parent_call_id", "parent_resolution", "parent_resolution_reason", "cum_len", "digest",
                         "continuation_fingerprint", "continuation_context_len", "continuation_context_digest",
                         "fingerprint_version", "response_id"):  # fmt: skip
                assert mine.record()[name] == real[name], (rid, mine.model_call_id, name)
        assert result["rollouts"][rid]["prompts"] == [
            c["response"]["output"][0]["prompt_token_ids"] for c in calls
        ]
