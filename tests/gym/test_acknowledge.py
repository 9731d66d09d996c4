"""/acknowledge: accepted, idempotent, mismatched, unknown; one request per agent."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import httpx
import pytest

from gym_agent.server import ThreadAgent
from protocol.wire import AcknowledgeRequest, CompletionReceipt
from tests.gym.conftest import fresh_id, run_request
from trainer.gym import GoneError, GymClient


async def _finished(client: GymClient) -> CompletionReceipt:
    rid = fresh_id()
    await client.run(run_request(rid))
    return await client.completion_receipt(rid, 0)


async def test_ack_accepted_then_idempotent(client: GymClient) -> None:
    receipt = await _finished(client)
    [first] = await client.acknowledge([receipt])
    assert (first.acknowledged, first.idempotent, first.error) == (True, False, None)
    [second] = await client.acknowledge([receipt])
    assert (second.acknowledged, second.idempotent, second.error) == (True, True, None)


async def test_a_mismatched_receipt_after_the_ack_is_still_refused(client: GymClient) -> None:
    receipt = await _finished(client)
    assert (await client.acknowledge([receipt]))[0].acknowledged
    [late] = await client.acknowledge([receipt.model_copy(update={"execution_generation": 999})])
    assert (late.acknowledged, late.error) == (False, "receipt_mismatch")
    [again] = await client.acknowledge([receipt])
    assert (again.acknowledged, again.idempotent) == (True, True)
    with pytest.raises(GoneError):
        await client.token_capture(receipt.manifest_capture_key)


async def test_memory_kept_per_finished_try_is_small(client: GymClient) -> None:
    """A long-running agent remembers every try done for good (to answer 410), compacted."""
    for _ in range(20):  # warm up: pools, caches, first-call allocations
        await client.acknowledge([await _finished(client)])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        tries = 300
        for _ in range(tries):
            await client.acknowledge([await _finished(client)])
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    # An Execution with its request, receipt, events and reply is several KiB; what is kept is ids,
    # the receipt's digest and the capture key.
    assert grown / tries < 1024, f"{grown / tries:.0f} bytes kept per finished try"


@pytest.mark.parametrize(
    "change",
    [
        {"result_digest": "sha256:" + "0" * 64},
        {"execution_generation": 999},
        {"result_identity": "r-someone-else"},
        {"terminal_model_call_id": "call-99"},
    ],
)
async def test_mismatched_receipt_changes_nothing(client: GymClient, change: dict[str, object]) -> None:
    receipt = await _finished(client)
    before = await client.status()
    [result] = await client.acknowledge([receipt.model_copy(update=change)])
    assert (result.acknowledged, result.error) == (False, "receipt_mismatch")
    assert await client.status() == before
    # Still COMPLETED: the stored reply is replayed and the real receipt is accepted.
    await client.run(run_request(receipt.rollout_id))
    [ok] = await client.acknowledge([receipt])
    assert ok.acknowledged and not ok.idempotent


async def test_mismatch_against_an_acknowledged_try(client: GymClient) -> None:
    receipt = await _finished(client)
    await client.acknowledge([receipt])
    [result] = await client.acknowledge([receipt.model_copy(update={"execution_generation": 0})])
    assert (result.acknowledged, result.error) == (False, "receipt_mismatch")


async def test_unknown_try(client: GymClient) -> None:
    receipt = (await _finished(client)).model_copy(update={"rollout_id": fresh_id("ghost")})
    [result] = await client.acknowledge([receipt])
    assert (result.acknowledged, result.error) == (False, "unknown_execution")


async def test_one_request_for_many_receipts(client: GymClient) -> None:
    receipts = [await _finished(client) for _ in range(5)]
    sent: list[bytes] = []
    exchange = client._control.exchange

    async def count(method: str, origin: Any, target: bytes, *rest: Any) -> Any:
        sent.append(target)
        return await exchange(method, origin, target, *rest)

    client._control.exchange = count  # type: ignore[method-assign, assignment]
    results = await client.acknowledge([*receipts, receipts[0]])
    assert sent == [b"/acknowledge"]
    assert [(r.rollout_id, r.acknowledged, r.idempotent) for r in results] == [
        *((r.rollout_id, True, False) for r in receipts),
        (receipts[0].rollout_id, True, True),
    ]
    for r in receipts:
        with pytest.raises(GoneError):
            await client.completion_receipt(r.rollout_id, 0)


async def test_ack_naming_another_agent_is_unknown(shared_agent: ThreadAgent) -> None:
    async with GymClient(shared_agent.url, "shared") as real:
        receipt = await _finished(real)
    async with GymClient(shared_agent.url, "not-shared") as wrong:
        [result] = await wrong.acknowledge([receipt])
    assert result.error == "unknown_execution"


async def test_empty_ack_sends_nothing(client: GymClient) -> None:
    assert await client.acknowledge([]) == []
    # The wire accepts an empty list too.
    body = AcknowledgeRequest(executions=[]).model_dump(mode="json")
    async with httpx.AsyncClient(base_url=client.base_url, verify=False) as raw:
        answer = await raw.post("/acknowledge", json=body)
    assert answer.json() == {"results": []}
