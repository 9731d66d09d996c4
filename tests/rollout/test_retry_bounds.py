"""The trainer's retry loops against real agents that never answer usefully: each gives up (or is
reported stuck) within its budget, and says so."""

from __future__ import annotations

import asyncio
import itertools
import re
from pathlib import Path
from typing import Any

import pytest

from eventstore import EventStore
from eventstore.events import AckDeliveryStuck, GroupDeadLettered, ReplacementMinted, RunFailed
from gym_agent.config import AgentConfig
from projections.base import decode
from protocol.retry import RetryPolicy
from protocol.streams import trainer_stream
from tests.rollout.conftest import PAYLOAD, PROMPT, coordinator, gid
from tests.rollout.hostile_agent import Rule, serve_hostile
from trainer.acks import MAX_REFETCHES
from trainer.gym import GymClient


def _config(tmp_path: Path) -> AgentConfig:
    return AgentConfig(name="h", state_dir=tmp_path / "h", log_level="warning", turns=(2, 2), delay_s=0.01)


async def test_an_ack_relay_that_keeps_failing_reports_the_agent_stuck_and_pays_once_it_answers(
    store: EventStore, tmp_path: Path
) -> None:
    """Every /acknowledge answers garbage: after ACK_POLICY's calls the agent is reported stuck, its
    debts stay owed in the log; once the agent answers again they are paid and the report cleared."""
    garbage = Rule("/acknowledge", lambda _p, _b: True, "garbage")
    policy = RetryPolicy(max_calls=3, deadline_s=60.0, base_s=0.01, cap_s=0.05)
    g = gid("ack")
    with serve_hostile(_config(tmp_path), [garbage]) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(store, {"h": client}, mode="sibling", ack_policy=policy)
            async with coord:
                await coord.submit(g, PROMPT, "h", 2, PAYLOAD)
                async with asyncio.timeout(60):  # a bound, not a speed: the gate is the report
                    while "h" not in coord._acks.stuck:
                        await asyncio.sleep(0.02)
                assert "3 calls failed" in coord._acks.stuck["h"] and "not JSON" in coord._acks.stuck["h"]
                assert garbage.hits >= policy.max_calls
                assert len(coord.ledger.unpaid_debts("h")) == 2  # never dropped by giving up
                garbage.times = garbage.hits  # the agent answers again
                await coord.wait_idle(60)
                assert coord.ledger.unpaid_debts("h") == [] and "h" not in coord._acks.stuck
            assert (await client.status()).completed_unacknowledged == 0
    # The durable evidence, once for the spell: the agent, its debts, the calls spent and why.
    events = [decode(e) for e in store.read_stream(trainer_stream(None))]
    stuck = [e for e in events if isinstance(e, AckDeliveryStuck)]
    assert [(e.agent_name, e.debts, e.calls) for e in stuck] == [("h", 2, policy.max_calls)]
    assert "not JSON" in stuck[0].reason


async def test_a_prepare_that_keeps_failing_aborts_at_its_deadline_naming_the_last_error(
    store: EventStore, tmp_path: Path
) -> None:
    """Every /checkpoint/prepare answers garbage: retried with jittered backoff until the prepare
    deadline leaves no time for another call, then the checkpoint aborts with the reason, which counts
    every call the agent answered.  The deadline is the behaviour under test, so it cannot be a gate:
    it is long enough (3 s) for a second call on a loaded machine (a first answer taking 1 s
    still leaves two more; with 1 s it left none), and the backoff keeps the calls few."""
    garbage = Rule("/checkpoint/prepare", lambda _p, _b: True, "garbage")
    with serve_hostile(_config(tmp_path), [garbage]) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(store, {"h": client}, mode="sibling", prepare_timeout_s=3.0)
            async with coord:
                outcome = await coord.checkpoint(gid("ck"))
                assert not outcome.committed
                assert "prepare deadline" in outcome.reason and "not JSON" in outcome.reason
                calls = re.search(r"\((\d+) prepare calls failed", outcome.reason)
                assert calls is not None, outcome.reason
                # Retried, not given up at the first failure; and every answer was counted.
                assert int(calls.group(1)) == garbage.hits >= 2
            status = await client.status()
            assert status.phase == "idle", status  # the abort reached the agent


async def test_a_receipt_the_agent_keeps_changing_is_refetched_at_most_max_refetches_times(
    store: EventStore, tmp_path: Path
) -> None:
    """The agent describes try 0 with another generation at every fetch: each ACK is refused for real
    (receipt_mismatch) and the receipt fetched again, MAX_REFETCHES times; then the debt is left
    unpaid in the log and no longer sent (the agent still holds the result: an operator's case)."""
    drift = itertools.count(5)
    g = gid("drift")

    def drifting(receipt: Any) -> Any:
        return {**receipt, "execution_generation": receipt["execution_generation"] + next(drift)}

    receipts = Rule("/completion_receipt", lambda path, _b: path == f"/completion_receipt/{g}_g0/0", drifting)
    acks = Rule("/acknowledge", lambda _p, _b: True, lambda body: body)  # counts the calls only
    with serve_hostile(_config(tmp_path), [receipts, acks]) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(store, {"h": client}, mode="sibling")
            async with coord:
                await coord.submit(g, PROMPT, "h", 1, PAYLOAD)
                async with asyncio.timeout(60):  # a bound; the gate: owed in the log, no longer sent
                    while not (coord.ledger.unpaid_debts("h") and not coord.owed_ack_agents()):
                        await asyncio.sleep(0.02)
                sent = acks.hits
                assert await coord._acks.send("h")  # nothing left to send: no call
                assert acks.hits == sent == MAX_REFETCHES + 1
            assert (await client.status()).completed_unacknowledged == 1
    rejected = [e.data["error"] for e in store.read_stream(f"group-{g}") if e.type == "AckRejected"]
    assert rejected == ["receipt_mismatch"] * (MAX_REFETCHES + 1)


@pytest.mark.parametrize("mode", ["sibling", "prompt_group"])
async def test_a_run_the_agent_refuses_as_too_large_is_one_data_failure_never_retried(
    store: EventStore, tmp_path: Path, mode: str
) -> None:
    """An 8.4 MB prompt over the agent's 8 MiB body cap: the first answer (413 payload_too_large) is a
    deterministic refusal, so the group is dead-lettered on its data budget after that one try; a
    retry would send the very same request."""
    from gym_agent.server import serve_in_thread

    huge = {"responses_create_params": {"input": [{"role": "user", "content": "x" * 8_400_000}]}}
    g = gid("big")
    with serve_in_thread(_config(tmp_path)) as agent:
        async with GymClient(agent.url, "h") as client:
            coord = coordinator(store, {"h": client}, mode=mode)
            async with coord:
                await coord.submit(g, PROMPT, "h", 2, huge)
                await coord.wait_idle(60)
                assert coord.ledger.groups[g].status == "dead_lettered"
            assert await client.debug_runs() == {}  # nothing ever ran at the agent
    events = [decode(e) for e in store.read_stream(f"group-{g}")]
    failed = [e for e in events if isinstance(e, RunFailed)]
    assert {e.kind for e in failed} <= {"refused"} and any(e.kind == "refused" for e in failed)
    assert "413" in failed[0].reason
    assert not [e for e in events if isinstance(e, ReplacementMinted)]
    (dead,) = [e for e in events if isinstance(e, GroupDeadLettered)]
    assert dead.budget == "data" and "refused" in dead.reasons[0]
