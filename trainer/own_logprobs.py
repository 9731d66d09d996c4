"""Logprobs the trainer computed on its own policy workers, recorded as a `LogprobsComputed`.

NeMo RL computes `prev_logprobs` itself; recording them in the log (instead of running a second model in
a logprob worker) keeps one result per try and policy version either way.  The token records are
checked against the sealed receipt exactly as a worker checks them (`verify_token_records`), the array
is stored in the worker's encoding and media type, and the event id is the worker's
(`result_event_id`): a worker that later scores the same try under the same version gets this result
back, or `EventIdConflict` when its numbers differ, and nothing is scored twice.

The worker modules need torch and numpy (the `workers` extra), so they are imported when a trainer
records logprobs, not when the coordinator is imported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from eventstore import EventIdConflict, EventStore, NewEvent
from eventstore.events import LogprobsComputed, RolloutReceipt
from protocol.digests import sha256_digest
from protocol.ids import group_id_of
from protocol.streams import logprobs_stream
from trainer.errors import LogprobsMismatch


@dataclass(frozen=True)
class OwnLogprobs:
    """The decision: the event and the array to write (or the reason it is refused, raised)."""

    event: LogprobsComputed
    content: bytes
    media_type: str


def decide(
    receipt: RolloutReceipt,
    blob: bytes | None,
    rollout_id: str,
    attempt_index: int,
    logprobs: Sequence[float],
    policy_version: str,
) -> OwnLogprobs:
    """Checks `logprobs` against the try's token records; `LogprobsMismatch` names the first misfit."""
    import torch

    from workers.logprobs import (
        LOGPROBS_MEDIA_TYPE,
        TokenRecordError,
        encode_logprobs,
        verify_token_records,
    )

    try:
        records = verify_token_records(blob, receipt, rollout_id, attempt_index)
    except TokenRecordError as exc:
        raise LogprobsMismatch(f"({rollout_id}, {attempt_index}): {exc}") from None
    reference = [v for r in records for v in r.generation_log_probs]
    values = [float(v) for v in logprobs]
    if len(values) != len(reference):
        raise LogprobsMismatch(
            f"({rollout_id}, {attempt_index}): {len(values)} logprobs for {len(reference)} generated tokens"
        )
    if not all(math.isfinite(v) for v in values):
        raise LogprobsMismatch(f"({rollout_id}, {attempt_index}): a logprob is not finite")
    if any(v > 0 for v in values):
        raise LogprobsMismatch(f"({rollout_id}, {attempt_index}): a logprob is above 0")
    array = torch.tensor(values, dtype=torch.float32)
    # The drift is measured on the stored (float32) values, as the worker measures its own.
    stored = array.double()
    diff = (stored - torch.tensor(reference, dtype=torch.float64)).abs()
    content = encode_logprobs(array)
    event = LogprobsComputed(
        rollout_id=rollout_id,
        attempt_index=attempt_index,
        policy_version=policy_version,
        token_count=len(values),
        logprob_sum=float(stored.sum().item()),
        max_abs_diff=float(diff.max().item()) if values else 0.0,
        mean_abs_diff=float(diff.mean().item()) if values else 0.0,
        blob_digest=sha256_digest(content),
    )
    return OwnLogprobs(event, content, LOGPROBS_MEDIA_TYPE)


def write(store: EventStore, decided: OwnLogprobs, source: str) -> bool:
    """Array and event in one transaction; False when the log already holds this try's result."""
    from workers.logprobs import result_event_id

    event = decided.event
    event_id = result_event_id(event.rollout_id, event.attempt_index, event.policy_version)
    try:
        with store.transaction() as tx:
            tx.put_blob(decided.content, decided.media_type)
            result = tx.append(
                logprobs_stream(group_id_of(event.rollout_id)),
                [NewEvent.of(event, event_id=event_id)],
                metadata={"source": source},
            )
    except EventIdConflict:
        raise LogprobsMismatch(
            f"({event.rollout_id}, {event.attempt_index}) already has another result under policy "
            f"{event.policy_version!r}"
        ) from None
    return not result.idempotent
