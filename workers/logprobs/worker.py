"""The logprob worker loop: enqueue seals, claim a batch, score it, append one result per try.

Each try ends in one payload put (the logprob array, durable first) and exactly one transaction that
appends the `LogprobsComputed` event claiming it (or `LogprobsRefused`) to `logprobs-<group_id>` and
marks its lease done: all or nothing in the log, so a worker killed anywhere leaves either the whole
result or none of it (at most an unclaimed array, which collection removes), and a row that is not
done is claimed again when its lease expires.  The event id is derived from (rollout id, try, policy
version) (`claims.result_event_id`): a second worker that scored the same try anyway (its lease had
expired) gets the original positions back, or `EventIdConflict` if its numbers differ (another device,
say), and nothing of its own is written.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eventstore import DatabaseUnavailable, EventIdConflict, EventStore, NewEvent
from eventstore.events import (
    LOGPROBS_MEDIA_TYPE,
    LogprobsComputed,
    LogprobsRefused,
    PayloadsPruned,
    SiblingSealed,
)
from eventstore.payload_stores import payload_plane
from payloads import PayloadCorrupt, PayloadMissing, PayloadPlane, PayloadStoreUnavailable
from protocol.retry import RetryPolicy, RetryState, next_step
from protocol.streams import RETENTION_STREAM, group_of_stream, logprobs_stream
from workers.kernels import Backend
from workers.logprobs.claims import Claim, LeaseBoard, QueueCounts, result_event_id, work_key
from workers.logprobs.scoring import (
    AttemptInput,
    AttemptScore,
    TokenRecordError,
    prepare_attempt,
    score_attempts,
    verify_token_records,
)
from workers.policy import Policy

log = logging.getLogger(__name__)

# Backoff while the database is unavailable (a restart, a failover): doubled per failure, capped.
OUTAGE_BACKOFF_S = 0.1
OUTAGE_BACKOFF_MAX_S = 5.0


@dataclass(frozen=True)
class WorkerConfig:
    batch_tokens: int = 4096
    # Attempts per claim; a batch must finish well inside one lease.
    claim_size: int = 32
    lease_s: float = 60.0
    poll_interval_s: float = 1.0
    # Must be the agent's sampling temperature: the generation logprobs were taken at it.
    temperature: float = 1.0
    backend: Backend = "auto"
    device: str = "cpu"
    # How long one database outage is ridden out before the worker stops (`WorkerStopped`); its claims
    # return at lease expiry, so another worker (or this one, started again) carries on.
    outage_budget_s: float = 300.0

    def __post_init__(self) -> None:
        if self.batch_tokens < 1 or self.claim_size < 1:
            raise ValueError("batch_tokens and claim_size must be >= 1")
        if not self.lease_s > 0 or not self.poll_interval_s > 0:
            raise ValueError("lease_s and poll_interval_s must be > 0")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not self.outage_budget_s > 0:
            raise ValueError(f"outage_budget_s must be > 0, got {self.outage_budget_s}")


class WorkerStopped(RuntimeError):
    """The database stayed away longer than the worker's outage budget: the worker stopped."""


@dataclass
class WorkerStats:
    scored: int = 0
    refused: int = 0
    # Claimed rows whose result another worker had already appended.
    duplicates: int = 0
    tokens: int = 0
    max_abs_diff: float = 0.0
    refusals: list[str] = field(default_factory=list)

    @property
    def finished(self) -> int:
        return self.scored + self.refused + self.duplicates


@dataclass
class WorkerHooks:
    """Observation points for tests and progress displays; none of them may write to the store."""

    # Called inside each result's transaction, after the append and before the commit.
    in_transaction: Callable[[str], None] | None = None
    after_batch: Callable[[WorkerStats], None] | None = None


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class _Job:
    claim: Claim
    group_id: str
    seal: SiblingSealed


class LogprobWorker:
    """Scores sealed tries under one policy version; many of these may share one PostgreSQL log."""

    def __init__(
        self,
        store: EventStore,
        policy: Policy,
        config: WorkerConfig | None = None,
        *,
        worker_id: str | None = None,
        hooks: WorkerHooks | None = None,
        payloads: PayloadPlane | None = None,
    ) -> None:
        self.store = store
        self.payloads = payloads or payload_plane(store)
        self.policy = policy
        self.config = config or WorkerConfig()
        self.worker_id = worker_id or default_worker_id()
        self.hooks = hooks or WorkerHooks()
        self.device = torch.device(self.config.device)
        # The policy runs where the kernel runs; moving a module is in place, so this is the caller's policy.
        policy.model.to(self.device)
        self.board = LeaseBoard(store, policy.policy_version, self.worker_id, self.config.lease_s)
        self.stats = WorkerStats()
        self._stop = False
        # What retention recorded as pruned (digest -> position), read on from `_retention_read`.
        self._pruned: dict[str, int] = {}
        self._retention_read = -1

    @property
    def policy_version(self) -> str:
        return self.policy.policy_version

    def stop(self) -> None:
        self._stop = True

    def counts(self) -> QueueCounts:
        return self.board.counts()

    # --- the loop ----------------------------------------------------------

    def run(
        self, once: bool = False, on_progress: Callable[[QueueCounts, WorkerStats], None] | None = None
    ) -> WorkerStats:
        """Works until stopped; with `once`, until every enqueued try has its result in the log.

        A `once` worker also waits out leases other workers hold, so a try whose worker died is still
        finished before it exits.
        """
        # The database's absences, one budget each (`outage_budget_s`): jittered backoff so workers do
        # not reconnect in step, no wait past the budget.
        policy = RetryPolicy.within(self.config.outage_budget_s, OUTAGE_BACKOFF_S, OUTAGE_BACKOFF_MAX_S)
        outage: RetryState | None = None  # the failed rounds while the database is away
        while not self._stop:
            try:
                self.board.enqueue()
                processed = self.run_batch()
                counts = self.board.counts()
            except (DatabaseUnavailable, PayloadStoreUnavailable) as exc:
                # Ride out a database restart: what finished is in the log, unfinished claims were
                # given back (or return at lease expiry), so the next round simply claims again.
                now = time.monotonic()
                outage = (outage or RetryState()).failed(now, str(exc))
                verdict = next_step(policy, outage, now, random.random())
                if verdict.kind == "give_up":
                    raise WorkerStopped(
                        f"worker {self.worker_id}: the database has been unavailable for more than "
                        f"{self.config.outage_budget_s:g} s ({outage.calls} rounds); stopped, its claims "
                        f"return at lease expiry: {exc}"
                    ) from exc
                log.warning(
                    "worker %s: database unavailable, reconnecting in %.2f s: %s",
                    self.worker_id,
                    verdict.delay_s,
                    exc,
                )
                time.sleep(verdict.delay_s)
                continue
            if outage is not None:
                log.warning("worker %s: database reachable again, resuming", self.worker_id)
                outage = None
            if on_progress is not None:
                on_progress(counts, self.stats)
            if processed:
                continue
            if once and counts.open == 0:
                break
            wait = self.config.poll_interval_s
            if counts.next_expiry_s is not None:
                wait = min(wait, counts.next_expiry_s + 0.01)
            time.sleep(max(wait, 0.01))
        return self.stats

    def run_batch(self) -> int:
        """Claims up to `claim_size` tries and finishes them; returns how many were claimed."""
        claims = self.board.claim(self.config.claim_size)
        if not claims:
            return 0
        finished: set[str] = set()
        try:
            self._process(claims, finished)
        except BaseException:
            # Give the rest back now rather than at lease expiry; the log already has what finished.
            try:
                self.board.release([c.work_key for c in claims if c.work_key not in finished])
            except Exception:
                log.exception("could not release claims; they return when their lease expires")
            raise
        if self.hooks.after_batch is not None:
            self.hooks.after_batch(self.stats)
        return len(claims)

    # --- one batch ---------------------------------------------------------

    def _process(self, claims: list[Claim], finished: set[str]) -> None:
        ready: list[tuple[_Job, AttemptInput]] = []
        for claim in claims:
            job = self._load_job(claim)
            if job is None:
                self._finish_orphan(claim)
                finished.add(claim.work_key)
                continue
            seal = job.seal
            tokens = seal.receipt.tokens_claim()
            try:
                try:
                    content: bytes | None = self.payloads.get(tokens)
                except PayloadMissing:
                    pruned_at = self._pruned_since(tokens.digest, claim.source_position)
                    if pruned_at is not None:
                        raise TokenRecordError(
                            f"token records {tokens.digest} were removed by retention (`ledger payloads "
                            f"prune`, PayloadsPruned at position {pruned_at}) before this try was scored"
                        ) from None
                    content = None
                except PayloadCorrupt as exc:
                    raise TokenRecordError(f"token records stored under {tokens.digest}: {exc}") from None
                records = verify_token_records(
                    content, tokens.media_type, seal.receipt, seal.rollout_id, seal.attempt_index
                )
                ready.append(
                    (
                        job,
                        prepare_attempt(
                            records, self.policy, seal.rollout_id, seal.attempt_index, self.device
                        ),
                    )
                )
            except TokenRecordError as exc:
                self._refuse(job, str(exc))
                finished.add(claim.work_key)
        if not ready:
            return
        scores = score_attempts(
            [t for _, t in ready],
            self.policy,
            batch_tokens=self.config.batch_tokens,
            temperature=self.config.temperature,
            backend=self.config.backend,
        )
        for (job, _), score in zip(ready, scores, strict=True):
            if score.non_finite:
                self._refuse(
                    job,
                    f"the policy scored {score.non_finite} of the try's {score.token_count} tokens NaN or "
                    "infinite (a diverged policy?): no array stored",
                )
            else:
                self._record(job, score)
            finished.add(job.claim.work_key)

    def _pruned_since(self, digest: str, claimed_at: int) -> int | None:
        """The position of the `PayloadsPruned` that named `digest` after `claimed_at` (retention
        removed it), from the log's retention stream, read on from where this worker last read it."""
        for event in self.store.read_stream(RETENTION_STREAM, self._retention_read + 1):
            decoded = event.decode()
            if isinstance(decoded, PayloadsPruned):
                self._pruned.update(dict.fromkeys(decoded.digests, event.position))
            self._retention_read = event.stream_version
        at = self._pruned.get(digest)
        return at if at is not None and at > claimed_at else None

    def _load_job(self, claim: Claim) -> _Job | None:
        event = next(self.store.read_all(claim.source_position - 1, claim.source_position), None)
        if event is None or event.type != SiblingSealed.event_type():
            return None
        seal = event.decode()
        assert isinstance(seal, SiblingSealed)
        if work_key(seal.rollout_id, seal.attempt_index, self.policy_version) != claim.work_key:
            return None
        group_id = group_of_stream(event.stream_id)
        if group_id is None:
            return None
        return _Job(claim, group_id, seal)

    def _finish_orphan(self, claim: Claim) -> None:
        # Only a hand-edited lease table gets here: nothing in the log to score, so close the row.
        log.warning(
            "lease %s points at position %d, which is not its seal; closed",
            claim.work_key,
            claim.source_position,
        )
        with self.store.transaction() as tx:
            self.board.mark_done(tx.connection, claim.work_key)

    def _refuse(self, job: _Job, reason: str) -> None:
        seal = job.seal
        event = LogprobsRefused(
            rollout_id=seal.rollout_id,
            attempt_index=seal.attempt_index,
            policy_version=self.policy_version,
            reason=reason,
        )
        log.warning("refused (%s, %d): %s", seal.rollout_id, seal.attempt_index, reason)
        if self._commit(job, event):
            self.stats.refused += 1
            self.stats.refusals.append(f"{seal.rollout_id}/{seal.attempt_index}: {reason}")

    def _record(self, job: _Job, score: AttemptScore) -> None:
        content = score.array_bytes()
        [claim] = self.payloads.put([(content, LOGPROBS_MEDIA_TYPE)])  # durable before the event
        event = LogprobsComputed(
            rollout_id=score.rollout_id,
            attempt_index=score.attempt_index,
            policy_version=self.policy_version,
            token_count=score.token_count,
            logprob_sum=score.logprob_sum,
            max_abs_diff=score.max_abs_diff,
            mean_abs_diff=score.mean_abs_diff,
            blob_digest=claim.digest,
            logprobs=claim,
        )
        if self._commit(job, event):
            self.stats.scored += 1
            self.stats.tokens += score.token_count
            self.stats.max_abs_diff = max(self.stats.max_abs_diff, score.max_abs_diff)

    def _commit(self, job: _Job, event: LogprobsComputed | LogprobsRefused) -> bool:
        """Event + lease done in one transaction; False when another worker's result was there first."""
        seal = job.seal
        event_id = result_event_id(seal.rollout_id, seal.attempt_index, self.policy_version)
        try:
            with self.store.transaction() as tx:
                result = tx.append(
                    logprobs_stream(job.group_id),
                    [NewEvent.of(event, event_id=event_id)],
                    metadata={"worker": self.worker_id, "source_position": job.claim.source_position},
                )
                if self.hooks.in_transaction is not None:
                    self.hooks.in_transaction(job.claim.work_key)
                self.board.mark_done(tx.connection, job.claim.work_key)
        except EventIdConflict:
            log.info("(%s, %d) already has another result in the log", seal.rollout_id, seal.attempt_index)
            with self.store.transaction() as tx:
                self.board.mark_done(tx.connection, job.claim.work_key)
            self.stats.duplicates += 1
            return False
        if result.idempotent:
            self.stats.duplicates += 1
            return False
        return True
