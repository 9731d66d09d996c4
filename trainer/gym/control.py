"""The control calls of a `GymClient`: what the agent is and holds, an attempt's receipt and token
records, the ACKs and retires that settle attempts, the driver binding and the reference agent's
debug routes.

They go through the control pool (its own connections and a default timeout, so they never queue
behind open runs), and each reply is read against its wire model.  In reduced mode (a plain Gym agent)
the ones the agent cannot answer are answered from what the client keeps (`trainer.gym.reduced`).
The `GymClient` method of each name is the public call and says what it does.
"""

from __future__ import annotations

from collections.abc import Sequence

from payloads.token_arrays import TokenArrays, decode_arrays
from protocol.token_codec import TOKENS_MEDIA_TYPE, TokenCodecError, encode_entries
from protocol.wire import (
    AcknowledgeItem,
    AcknowledgeRequest,
    AcknowledgeResponse,
    AcknowledgeResult,
    AgentStatus,
    AttemptFault,
    Capabilities,
    CompletionReceipt,
    CrashAfter,
    DebugRuns,
    DriverRequest,
    DriverResponse,
    Health,
    OkResponse,
    RateFaults,
    RetireRequest,
    RetireResponse,
)
from trainer.gym.answers import media_type, parse, validated
from trainer.gym.completed import TOKEN_LIST, binary_tokens
from trainer.gym.errors import BadResponseError, NotFoundError
from trainer.gym.facade import Facade

_TOKENS_MEDIA = TOKENS_MEDIA_TYPE.encode()
# The binary form first; JSON from agents that do not speak it.
_ACCEPT_TOKENS = ((b"Accept", _TOKENS_MEDIA + b", application/json;q=0.5"),)


async def health(client: Facade) -> Health:
    return parse(client.base_url, Health, await client._send(client._control, "GET", "/health"), "/health")


async def capabilities(client: Facade) -> Capabilities:
    return parse(
        client.base_url,
        Capabilities,
        await client._send(client._control, "GET", "/capabilities"),
        "/capabilities",
    )


async def status(client: Facade) -> AgentStatus:
    if client.reduced is not None:
        return client.reduced.status()
    return parse(
        client.base_url, AgentStatus, await client._send(client._control, "GET", "/status"), "/status"
    )


async def completion_receipt(client: Facade, rollout_id: str, attempt_index: int) -> CompletionReceipt:
    if client.reduced is not None:
        return client.reduced.completion_receipt(rollout_id, attempt_index)
    path = f"/completion_receipt/{rollout_id}/{attempt_index}"
    receipt = parse(
        client.base_url, CompletionReceipt, await client._send(client._control, "GET", path), path
    )
    if receipt.attempt != (rollout_id, attempt_index):
        raise BadResponseError(f"{client.base_url}{path}: receipt names {receipt.attempt}")
    return receipt


async def token_capture(client: Facade, capture_key: str) -> TokenArrays:
    if client.reduced is not None:
        return decode_arrays(client.reduced.token_bytes(capture_key), check_canonical=False)
    path = f"/token_capture/{capture_key}"
    # Through `_exchange`, not `_send`: the answer's media type says which form its body is in.
    reply = await client._exchange(client._control, "GET", path, extra_headers=_ACCEPT_TOKENS)
    if media_type(reply) == _TOKENS_MEDIA:
        # A body read in place is a bytearray: the arrays over it stay read-only all the same.
        return binary_tokens(client.base_url, memoryview(reply.body).toreadonly(), path, capture_key)
    entries = validated(client.base_url, TOKEN_LIST.validate_json, "list[TokenEntry]", reply.body, path)
    try:
        arrays = decode_arrays(encode_entries(entries))
    except TokenCodecError as exc:
        raise BadResponseError(f"{client.base_url}{path}: {exc}") from None
    if any(e.rollout_id != capture_key for e in entries):
        raise BadResponseError(f"{client.base_url}{path}: token records of another capture key")
    return arrays


async def acknowledge(client: Facade, receipts: Sequence[CompletionReceipt]) -> list[AcknowledgeResult]:
    if not receipts:
        return []
    if client.reduced is not None:
        return client.reduced.acknowledge(receipts)
    body = AcknowledgeRequest(
        executions=[AcknowledgeItem(agent_name=client.agent_name, receipt=r) for r in receipts]
    )
    answer = parse(
        client.base_url,
        AcknowledgeResponse,
        await client._send(client._control, "POST", "/acknowledge", body=body, extra_headers=client._trainer),
        "/acknowledge",
    )
    if [(r.rollout_id, r.attempt_index) for r in answer.results] != [r.attempt for r in receipts]:
        raise BadResponseError(f"{client.base_url}/acknowledge: results do not match the receipts sent")
    return answer.results


async def retire(
    client: Facade, rollout_id: str, attempt_index: int, checkpoint_id: str | None
) -> RetireResponse:
    if client.reduced is not None:
        return client.reduced.retire(rollout_id, attempt_index)
    body = RetireRequest(rollout_id=rollout_id, attempt_index=attempt_index, checkpoint_id=checkpoint_id)
    return parse(
        client.base_url,
        RetireResponse,
        await client._send(client._control, "POST", "/retire", body=body, extra_headers=client._trainer),
        "/retire",
    )


async def driver_call(client: Facade, path: str, trainer_id: str | None) -> DriverResponse | None:
    """`POST /driver` or `/driver/release`; None for an agent without the route (it cannot tell
    trainers apart)."""
    if client.reduced is not None:
        return None
    try:
        payload = await client._send(client._control, "POST", path, body=DriverRequest(trainer_id=trainer_id))
    except NotFoundError:
        return None
    return parse(client.base_url, DriverResponse, payload, path)


async def set_faults(client: Facade, fault: AttemptFault | RateFaults | CrashAfter) -> None:
    parse(
        client.base_url,
        OkResponse,
        await client._send(client._control, "POST", "/debug/faults", body=fault),
        "/debug/faults",
    )


async def debug_runs(client: Facade) -> dict[str, int]:
    return parse(
        client.base_url, DebugRuns, await client._send(client._control, "GET", "/debug/runs"), "/debug/runs"
    ).runs
