"""A completion receipt replayed at the wrong agent, or from an earlier life of the same agent.

The ACK relay sends each debt to the agent named in its `AckOwed`; these tests send receipts where
they do not belong and check the answer and that neither agent changes: the try stays COMPLETED at
its own agent (so it still blocks that agent's checkpoint until the right ACK) and nothing is
deleted or marked done at the other.
"""

from __future__ import annotations

import httpx

from protocol.wire import CompletionReceipt, RunRequest
from trainer.gym import GymClient


async def _state(*clients: GymClient) -> list[object]:
    return [(await c.status(), await c.debug_runs()) for c in clients]


async def _finished(client: GymClient, rollout_id: str) -> CompletionReceipt:
    await client.run(RunRequest(rollout_id=rollout_id, attempt_index=0))
    return await client.completion_receipt(rollout_id, 0)


async def test_receipt_of_agent_a_sent_to_agent_b_is_unknown(clients: tuple[GymClient, GymClient]) -> None:
    a, b = clients
    receipt = await _finished(a, "replay-1")
    before = await _state(a, b)
    # As the relay would send it: the item names agent A (the debt's agent), the request goes to B.
    async with httpx.AsyncClient(
        base_url=b.base_url, headers={"Authorization": "Bearer hostile-token"}
    ) as raw:
        reply = await raw.post(
            "/acknowledge",
            json={"executions": [{"agent_name": "agent-a", "receipt": receipt.model_dump(mode="json")}]},
        )
    assert reply.status_code == 200
    [result] = reply.json()["results"]
    assert (result["acknowledged"], result["error"]) == (False, "unknown_execution")
    assert await _state(a, b) == before
    assert (await a.status()).completed_unacknowledged >= 1
    [ok] = await a.acknowledge([receipt])  # the right agent still takes it
    assert ok.acknowledged and not ok.idempotent


async def test_receipt_of_agent_a_under_agent_b_name_for_the_same_try_is_a_mismatch(
    clients: tuple[GymClient, GymClient],
) -> None:
    """Both agents ran a try with the same ids; B's own result differs (another seed): A's receipt is
    refused as a mismatch and B's try stays COMPLETED, A's too."""
    a, b = clients
    receipt_a = await _finished(a, "replay-2")
    receipt_b = await _finished(b, "replay-2")
    assert receipt_a.result_digest != receipt_b.result_digest
    before = await _state(a, b)
    [result] = await b.acknowledge([receipt_a])
    assert (result.acknowledged, result.error) == (False, "receipt_mismatch")
    assert await _state(a, b) == before
    assert [r.acknowledged for r in await a.acknowledge([receipt_a])] == [True]
    assert [r.acknowledged for r in await b.acknowledge([receipt_b])] == [True]


async def test_receipt_from_an_earlier_generation_is_a_mismatch(clients: tuple[GymClient, GymClient]) -> None:
    """A receipt from before a restart (lower execution_generation) never releases today's try."""
    a, _ = clients
    receipt = await _finished(a, "replay-3")
    stale = receipt.model_copy(update={"execution_generation": receipt.execution_generation - 1})
    before = await _state(a)
    [result] = await a.acknowledge([stale])
    assert (result.acknowledged, result.error) == (False, "receipt_mismatch")
    assert await _state(a) == before
    assert [r.acknowledged for r in await a.acknowledge([receipt])] == [True]


async def test_replayed_ack_after_acceptance_is_idempotent_and_changes_nothing(
    clients: tuple[GymClient, GymClient],
) -> None:
    a, b = clients
    receipt = await _finished(a, "replay-4")
    await a.acknowledge([receipt])
    before = await _state(a, b)
    for _ in range(3):
        [again] = await a.acknowledge([receipt])
        assert (again.acknowledged, again.idempotent) == (True, True)
    [at_b] = await b.acknowledge([receipt])
    assert (at_b.acknowledged, at_b.error) == (False, "unknown_execution")
    assert await _state(a, b) == before
