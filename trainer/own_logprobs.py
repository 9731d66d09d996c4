"""Logprobs the trainer computed on its own policy workers, recorded as a `LogprobsComputed`.

NeMo RL computes `prev_logprobs` itself; recording them in the log (instead of running a second model in
a logprob worker) keeps one result per attempt and policy version either way.  The token records are
checked against the sealed receipt exactly as a worker checks them (`verify_token_records`), the array
is stored in the worker's encoding and media type, and the event id is the worker's
(`result_event_id`): a worker that later scores the same attempt under the same version gets this result
back, or `EventIdConflict` when its numbers differ, and nothing is scored twice.

The worker modules need torch and numpy (the `workers` extra), so they are imported when a trainer
records logprobs, not when the coordinator is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from eventstore import EventIdConflict, EventStore, NewEvent
from eventstore.events import LogprobsComputed, RolloutReceipt
from payloads import PayloadCorrupt, PayloadMissing
from protocol.digests import sha256_digest
from protocol.ids import group_id_of
from protocol.streams import logprobs_stream
from trainer.errors import LogprobsMismatch
from trainer.journal import Journal
from trainer.payload_io import PayloadIO


@dataclass(frozen=True)
class OwnLogprobs:
    """The decision: the event and the array to write (or the reason it is refused, raised)."""

    event: LogprobsComputed
    content: bytes
    media_type: str


def decide(
    receipt: RolloutReceipt,
    content: bytes | None,
    media_type: str,
    rollout_id: str,
    attempt_index: int,
    logprobs: Sequence[float],
    policy_version: str,
) -> OwnLogprobs:
    """Checks `logprobs` against the attempt's token records (`content`, the payload the receipt claims);
    `LogprobsMismatch` names the first misfit."""
    import numpy as np
    import torch

    from workers.logprobs import (
        LOGPROBS_MEDIA_TYPE,
        TokenRecordError,
        encode_logprobs,
        verify_token_records,
    )

    try:
        records = verify_token_records(content, media_type, receipt, rollout_id, attempt_index)
    except TokenRecordError as exc:
        raise LogprobsMismatch(f"({rollout_id}, {attempt_index}): {exc}") from None
    parts = [records.logprobs(r) for r in range(len(records))]
    reference = torch.from_numpy(np.concatenate(parts).astype(np.float64) if parts else np.zeros(0))
    array = torch.as_tensor(np.asarray(logprobs, dtype=np.float64)).float()
    if array.shape[0] != reference.shape[0]:
        raise LogprobsMismatch(
            f"({rollout_id}, {attempt_index}): {array.shape[0]} logprobs for {reference.shape[0]} generated tokens"
        )
    if not bool(torch.isfinite(array).all()):
        raise LogprobsMismatch(f"({rollout_id}, {attempt_index}): a logprob is not finite")
    if bool((array > 0).any()):
        raise LogprobsMismatch(f"({rollout_id}, {attempt_index}): a logprob is above 0")
    values = array
    # The drift is measured on the stored (float32) values, as the worker measures its own.
    stored = array.double()
    diff = (stored - reference).abs()
    content = encode_logprobs(array)
    event = LogprobsComputed(
        rollout_id=rollout_id,
        attempt_index=attempt_index,
        policy_version=policy_version,
        token_count=int(values.shape[0]),
        logprob_sum=float(stored.sum().item()),
        max_abs_diff=float(diff.max().item()) if values.shape[0] else 0.0,
        mean_abs_diff=float(diff.mean().item()) if values.shape[0] else 0.0,
        blob_digest=sha256_digest(content),
    )
    return OwnLogprobs(event, content, LOGPROBS_MEDIA_TYPE)


def write(store: EventStore, decided: OwnLogprobs, source: str) -> bool:
    """The event, whose claim names the array already stored; False when the log already holds this
    attempt's result."""
    from workers.logprobs import result_event_id

    event = decided.event
    event_id = result_event_id(event.rollout_id, event.attempt_index, event.policy_version)
    try:
        with store.transaction() as tx:
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


async def record(
    journal: Journal,
    payloads: PayloadIO,
    store: EventStore,
    trainer_id: str | None,
    rollout_id: str,
    attempt_index: int,
    logprobs: Sequence[float],
    policy_version: str,
) -> bool:
    """Checks `logprobs` against the sealed attempt's token records, stores them and records their
    `LogprobsComputed` (`RolloutCoordinator.record_logprobs`).  False when the log already holds this
    very result."""
    attempt = journal.ledger.attempt(rollout_id, attempt_index)
    if attempt is None or attempt.status != "sealed" or attempt.rollout_receipt is None:
        state = "unknown" if attempt is None else attempt.status
        raise LogprobsMismatch(f"attempt ({rollout_id}, {attempt_index}) is {state}, not sealed")
    receipt = attempt.rollout_receipt
    claim = receipt.tokens_claim()
    content: bytes | None
    try:
        content = (await payloads.get_many([claim]))[claim.digest]
    except PayloadMissing:
        content = None  # decide names it
    except PayloadCorrupt as exc:
        raise LogprobsMismatch(f"({rollout_id}, {attempt_index}): {exc}") from None
    decided = decide(receipt, content, claim.media_type, rollout_id, attempt_index, logprobs, policy_version)
    [decided_claim] = await payloads.put([(decided.content, decided.media_type)])
    decided = replace(decided, event=decided.event.model_copy(update={"logprobs": decided_claim}))
    source = f"trainer:{trainer_id or ''}"
    # Idempotent by event id: a write retried after an outage that had committed is a no-op.
    return await journal.read(lambda: write(store, decided, source), "recording trainer logprobs")
