"""The checkpoint phase calls of a `GymClient`: prepare, then commit and resume, or abort.

They have a pool of their own (`PHASE_CONNECTIONS`): a prepare never queues behind the receipts, token
records and ACKs of a burst of results, since it holds every agent's admission.  A plain Gym agent is
not in checkpoints: in reduced mode each call is refused here, before anything is sent.
"""

from __future__ import annotations

from protocol.wire import CheckpointRequest, PhaseResponse, PrepareRequest
from trainer.gym.answers import parse
from trainer.gym.facade import Facade

# Connections of the checkpoint phase pool (one checkpoint at a time: a prepare, or a commit then resume).
PHASE_CONNECTIONS = 2
# prepare waits server-side up to its own timeout_s; the HTTP call gets this much on top.
PREPARE_MARGIN_S = 15.0


async def prepare(client: Facade, checkpoint_id: str, timeout_s: float, carry: bool) -> PhaseResponse:
    if client.reduced is not None:
        raise client.reduced.refuse_checkpoint("prepare", checkpoint_id)
    body = PrepareRequest(
        checkpoint_id=checkpoint_id, timeout_s=timeout_s, carry_completed=carry and client.carries_completed
    )
    http_timeout = max(client.control_timeout_s, timeout_s + PREPARE_MARGIN_S)
    payload = await client._send(
        client._phases,
        "POST",
        "/checkpoint/prepare",
        body=body,
        timeout_s=http_timeout,
        extra_headers=client._trainer,
    )
    return parse(client.base_url, PhaseResponse, payload, "/checkpoint/prepare")


async def phase_call(client: Facade, op: str, checkpoint_id: str) -> PhaseResponse:
    """`commit`, `resume` or `abort` of `checkpoint_id`."""
    if client.reduced is not None:
        raise client.reduced.refuse_checkpoint(op, checkpoint_id)
    path = f"/checkpoint/{op}"
    payload = await client._send(
        client._phases,
        "POST",
        path,
        body=CheckpointRequest(checkpoint_id=checkpoint_id),
        extra_headers=client._trainer,
    )
    return parse(client.base_url, PhaseResponse, payload, path)
