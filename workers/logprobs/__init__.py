"""Logprob workers: score sealed tries under the current policy with the fused kernel.

    from workers.logprobs import LogprobWorker, WorkerConfig
    worker = LogprobWorker(open_store(url), load_policy("tiny"), WorkerConfig(batch_tokens=4096))
    worker.run(once=True)

Token records live in the log's blob table (see `workers.logprobs.scoring`); the work queue and its
leases are the `work_leases` table (see `workers.logprobs.claims`); one transaction per try writes the
logprob array, the `LogprobsComputed`/`LogprobsRefused` event and the lease's `done` (see
`workers.logprobs.worker`).
"""

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
    LOGPROBS_MEDIA_TYPE,
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
