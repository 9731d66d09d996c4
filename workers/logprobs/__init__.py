"""Logprob workers: score sealed tries under the current policy with the fused kernel.

    from workers.logprobs import LogprobWorker, WorkerConfig
    worker = LogprobWorker(open_store(url), load_policy("tiny"), WorkerConfig(batch_tokens=4096))
    worker.run(once=True)

Token records are payloads the seal claims, read as arrays (see `workers.logprobs.scoring`); the work
queue and its leases are the `work_leases` table (see `workers.logprobs.claims`); per try, the logprob
array is stored first, then one transaction writes the `LogprobsComputed`/`LogprobsRefused` event
claiming it and the lease's `done` (see `workers.logprobs.worker`).
"""

from eventstore.events import LOGPROBS_MEDIA_TYPE
from workers.logprobs.claims import (
    LOGPROBS_NAMESPACE,
    Claim,
    LeaseBoard,
    QueueCounts,
    result_event_id,
    work_key,
    work_kind,
)
from workers.logprobs.scoring import (
    AttemptInput,
    AttemptScore,
    CallInput,
    TokenRecordError,
    decode_logprobs,
    encode_logprobs,
    prepare_attempt,
    score_attempts,
    verify_token_records,
)
from workers.logprobs.worker import (
    LogprobWorker,
    WorkerConfig,
    WorkerHooks,
    WorkerStats,
    WorkerStopped,
    default_worker_id,
)

__all__ = [
    "LOGPROBS_MEDIA_TYPE",
    "LOGPROBS_NAMESPACE",
    "AttemptInput",
    "AttemptScore",
    "CallInput",
    "Claim",
    "LeaseBoard",
    "LogprobWorker",
    "QueueCounts",
    "TokenRecordError",
    "WorkerConfig",
    "WorkerHooks",
    "WorkerStats",
    "WorkerStopped",
    "decode_logprobs",
    "default_worker_id",
    "encode_logprobs",
    "prepare_attempt",
    "result_event_id",
    "score_attempts",
    "verify_token_records",
    "work_key",
    "work_kind",
]
