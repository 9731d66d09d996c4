"""The event catalogue (docs/events.md): one pydantic model per event type.

A model's class name is its `type` in the log, and its schema version is
written once, as the `version=` class keyword.  Older payload versions are
upgraded on read by the upcasters in `eventstore.upcasting`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from payloads import PayloadClaim
from payloads.replies import REPLY_APART_MEDIA_TYPE, REPLY_MEDIA_TYPE
from protocol.digests import Digest
from protocol.ids import AttemptIndex, Identifier, Incarnation
from protocol.levels import TargetLevel
from protocol.token_codec import REFERRING_MEDIA_TYPES, TOKENS_JSON_MEDIA_TYPE
from protocol.wire import AttemptRef, AttemptWork, CompletionReceipt, ContinuationRef, ResumeReport

# Media types of the payloads events claim (token records: protocol.token_codec; replies:
# payloads.replies).
LOGPROBS_MEDIA_TYPE = "application/vnd.rollout-ledger.logprobs+float32-le"

Mode = Literal["sibling", "prompt_group"]
# The retry budgets of a group: infrastructure failures, data failures, and the one budget of v1 groups.
RetryBudget = Literal["infra", "data", "tries"]
# Why a checkpoint's prepare retired a try: `checkpoint`, its last resort near the prepare deadline (the
# try was making progress; bounded per rollout); `stalled`, no progress of its own for longer than its
# agent promised to report it (stuck inside a model call).
RetireCause = Literal["checkpoint", "stalled"]

EVENT_TYPES: dict[str, type[Event]] = {}


class Event(BaseModel):
    """Base of every payload in the log.  A NaN or infinite number is refused when the event is made:
    the log's canonical JSON cannot hold one (pydantic would write it as `null`, an event that then
    fails to validate on every read of the log)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    schema_version: ClassVar[int]

    def __init_subclass__(cls, version: int = 1, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.schema_version = version
        if cls.__name__ in EVENT_TYPES:
            raise TypeError(f"event type {cls.__name__} defined twice")
        EVENT_TYPES[cls.__name__] = cls

    @classmethod
    def event_type(cls) -> str:
        return cls.__name__


class Payload(BaseModel):
    """A value nested inside an event."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PromptRef(Payload):
    sample_id: str
    task_name: str


class RolloutReceipt(Payload):
    """Built by the trainer from the try's token-capture list (not the agent's CompletionReceipt).

    The token records themselves are a payload (`tokens`, its claim: store, digest, size, media type),
    stored before the event that carries this receipt is appended, so they outlive the agent's copy
    after the ACK.  `tokens_digest` is the claim's digest.  Receipts written before claims have
    `tokens` None: their records are canonical JSON in the log's blob table (`tokens_claim()`).
    """

    rollout_id: Identifier
    attempt_index: AttemptIndex
    capture_key: Identifier
    model_call_ids: list[str]
    terminal_model_call_id: str
    token_count: int = Field(ge=0)
    tokens_digest: str
    reward: float
    mask_sample: bool
    tokens: PayloadClaim | None = None

    @model_validator(mode="after")
    def _claim_is_of_the_digest(self) -> RolloutReceipt:
        if self.tokens is not None and self.tokens.digest != self.tokens_digest:
            raise ValueError("the token records' claim names another digest than tokens_digest")
        return self

    def tokens_claim(self) -> PayloadClaim:
        """Where the token records are: the claim, or for older receipts the log's blob table."""
        return self.tokens or PayloadClaim.legacy(self.tokens_digest, TOKENS_JSON_MEDIA_TYPE)


# --- groups and tries -------------------------------------------------------


class GroupReserved(Event, version=3):
    """Version 2 added the two retry budgets (`max_infra_failures`, `max_data_failures`); version 1
    rows are upcast with both equal to `max_tries`, which then binds first, as it did.

    Version 3 added `requested_level`: the target level the run asked for, where `target_level` is the
    one the group runs at (lowered to what its agent supports, `protocol.levels`); version 2 rows are
    upcast with the one they had."""

    group_id: Identifier
    prompt_ref: PromptRef
    agent_name: Identifier
    expected_generations: int = Field(ge=1, le=10_000)
    mode: Mode
    target_level: TargetLevel = "sibling"
    requested_level: TargetLevel = "sibling"
    target_step: int | None = None
    start_weight_version: int | None = None
    max_tries: int = Field(default=4, ge=1)
    # Tries lost to the infrastructure (agent away, transport, deadline) before the group is
    # dead-lettered, and tries failed by the data (environment failure, unverifiable, masked).
    max_infra_failures: int = Field(default=4, ge=1)
    max_data_failures: int = Field(default=4, ge=1)
    # Kept so that a recovered trainer can dispatch the group again.
    payload: dict[str, Any] = Field(default_factory=dict)
    # The trainer process that owns the group; several trainers share one log, each with its own groups.
    trainer_id: Identifier | None = None


class GroupTakenOver(Event):
    """A recovering trainer took an open group over: the previous owner's next append fails (fencing)."""

    group_id: Identifier
    trainer_id: Identifier | None
    reason: str


class AttemptMinted(Event):
    rollout_id: Identifier
    generation_index: int = Field(ge=0)
    attempt_index: Literal[0] = 0


class ReplacementMinted(Event, version=2):
    """Version 2 added `continues`: at target level `turn`, the continuation the replaced try's agent
    offered (its `AttemptRetired.continuation`) that the replacement resumes (docs/turns.md); None:
    it plays from its prompt.  Version 1 rows are upcast with None."""

    rollout_id: Identifier
    generation_index: int = Field(ge=0)
    attempt_index: AttemptIndex
    replaces: AttemptIndex
    reason: str
    continues: ContinuationRef | None = None


class RunDispatched(Event, version=2):
    """Version 2 added `prompt_digest` (the digest of the try's row without its identity,
    `RunRequest.prompt_digest`: what a resumed continuation must have begun from) and `continue_from`
    (the continuation the `/run` asks the agent to resume, its `x-ledger-continue-from`); version 1
    rows are upcast with None for both."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    capture_key: Identifier
    agent_name: Identifier
    deadline_s: float | None = None
    prompt_digest: Digest | None = None
    continue_from: Digest | None = None


class RunReplied(Event, version=4):
    """Version 2 added `failure_kind` (the reply's own, in the Gym's vocabulary); version 1 rows are
    upcast with none.  `reply_digest` is the digest the agent's receipt names; `reply` (version 3) the
    claim of the stored reply, None when it was not kept: its canonical JSON (`REPLY_MEDIA_TYPE`, of
    `reply_digest`) or, from version 4, the reply apart from the token arrays its try's records hold
    (`REPLY_APART_MEDIA_TYPE`, of its own digest; made whole, `payloads.replies.put_arrays_back`, of
    `reply_digest`), with `apart_from` the claim of those records (stored beside the reply, form
    version 2), so the event alone names all it is made whole from, whether a seal follows or not.
    Version 3 rows read as they are.  Rows written before claims have None: their replies are in the
    log's blob table, except a masked one's, which was never stored."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    reward: float
    mask_sample: bool
    reply_digest: str
    failure_kind: str | None = None
    reply: PayloadClaim | None = None
    apart_from: PayloadClaim | None = None

    @model_validator(mode="after")
    def _claim_is_of_the_digest(self) -> RunReplied:
        apart = self.reply is not None and self.reply.media_type == REPLY_APART_MEDIA_TYPE
        if self.reply is not None and not apart and self.reply.digest != self.reply_digest:
            raise ValueError("the reply's claim names another digest than reply_digest")
        if apart != (self.apart_from is not None):
            raise ValueError("a reply stored apart names the token records it is apart from, and only it")
        if self.apart_from is not None and self.apart_from.media_type not in REFERRING_MEDIA_TYPES:
            raise ValueError(
                f"a reply is stored apart only from token records of {' or '.join(sorted(REFERRING_MEDIA_TYPES))}"
            )
        return self

    def reply_claim(self) -> PayloadClaim | None:
        if self.reply is not None:
            return self.reply
        return None if self.mask_sample else PayloadClaim.legacy(self.reply_digest, REPLY_MEDIA_TYPE)


# `refused`: the agent refused the request itself (HTTP 400, 413, 422): deterministic, so no try of the
# same request can ever pass (a data failure that ends the group's retries at once).
FailureKind = Literal[
    "env", "http", "deadline", "stream_closed", "receipt", "verify", "agent_lost", "refused", "unknown"
]


class RunFailed(Event, version=2):
    """Version 2 added `kind`; version 1 rows are upcast from their reason text."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    reason: str
    kind: FailureKind


class ReceiptFetched(Event):
    agent_name: Identifier
    receipt: CompletionReceipt


class SiblingHeld(Event, version=2):
    """Version 2's receipt may carry its token records' claim (`RolloutReceipt.tokens`); version 1
    receipts are upcast with none."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    receipt: RolloutReceipt


class SiblingSealed(Event, version=2):
    """Version 2's receipt may carry its token records' claim (`RolloutReceipt.tokens`); version 1
    receipts are upcast with none."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    reward: float
    receipt: RolloutReceipt


class GroupSealed(Event):
    group_id: Identifier
    attempts: list[AttemptRef]


class GroupAbandoned(Event):
    group_id: Identifier
    reason: str
    attempts: list[AttemptRef] = Field(default_factory=list)


class AckOwed(Event):
    agent_name: Identifier
    receipt: CompletionReceipt


class AckAccepted(Event):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    idempotent: bool


class OperatorMark(Payload):
    """Who decided by hand, and why: the operator's own words are the evidence the log keeps."""

    operator: str = Field(min_length=1, max_length=200)
    reason: str = Field(min_length=1, max_length=2000)


AckRejectedError = Literal["receipt_mismatch", "unknown_execution", "dropped_by_operator"]


class AckRejected(Event, version=4):
    """Version 2 added `agent_generation`: the agent's execution generation when it refused.  An
    `unknown_execution` drops the debt only if that generation is newer than the receipt's (the agent
    restarted and lost the result); otherwise the debt stays owed.  Version 1 rows (no generation
    checked) are upcast with None and keep their old meaning: dropped.

    Version 3 added `operator`: error `dropped_by_operator` is a debt an operator dropped
    (`ledger debt drop`), the other evidence a debt may leave on; it carries the operator's mark, and
    only it does.  Version 2 rows are upcast with None.

    Version 4 added `agent_incarnation`: the agent process that refused.  An `unknown_execution` drops
    the debt exactly when it differs from the owed receipt's incarnation (another process denies it:
    the one that held the result is gone); from the same incarnation the debt stays owed.  Version 3
    rows are upcast with None and keep the rule they were decided under (`agent_generation` newer)."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    error: AckRejectedError
    agent_generation: int | None = Field(default=None, ge=0)
    agent_incarnation: Incarnation | None = None
    operator: OperatorMark | None = None

    @model_validator(mode="after")
    def _operator_marks_only_an_operator_drop(self) -> AckRejected:
        if (self.error == "dropped_by_operator") != (self.operator is not None):
            raise ValueError("an operator's mark goes with error dropped_by_operator, and only with it")
        return self


class AckDeliveryStuck(Event):
    """One agent's `/acknowledge` kept failing past the ACK retry budget (`ACK_POLICY`).  Its debts stay
    owed: a debt ends only on the agent's answer, its restart (another incarnation), or an operator's drop; the
    trainer keeps sending them at the longest wait.  Recorded once per spell, on the trainer's stream."""

    agent_name: Identifier
    debts: int = Field(ge=0)
    calls: int = Field(ge=0)
    reason: str


class RetireOwed(Event):
    """A try declared lost at its agent (`RunFailed` agent_lost, in the same append): the trainer owes
    that agent a retire of it, because the agent may still hold a finished result of it (it answered
    `completed_unacknowledged`, or finished while away) that nothing else would ever release.  Paid by
    `RetirePaid` once the agent answers again (docs/protocol.md, Retire debts); the result is released,
    never adopted: the group is already dead-lettered.  Also owed for a stray result: the agent's
    status shows it holding a finished result of a try the log settled (it restarted on an empty
    state directory and a late `/run` ran the try again); released the same way, never sealed."""

    agent_name: Identifier
    rollout_id: Identifier
    attempt_index: AttemptIndex
    # The agent process that answered retire with `completed_unacknowledged`, or that reported the
    # stray result (None: none did).
    execution_incarnation: Incarnation | None = None


RetirePaidOutcome = Literal["cancelled", "tombstoned", "done", "released", "dropped_by_operator"]


class RetirePaid(Event, version=2):
    """An owed retire paid: the agent answered it.  `cancelled`, `tombstoned`, `done`: it holds no
    result of the try any more (its retire answer).  `released`: it held a finished result
    (`completed_unacknowledged`); the trainer fetched its receipt and owes it the ACK (`ReceiptFetched`
    and `AckOwed` in the same append), so the agent discards it once the ACK is accepted.  Nothing of it
    is sealed or trained on.

    Version 2 added `operator`: outcome `dropped_by_operator` is a retire an operator dropped (`ledger
    debt drop`: the agent is gone for good, nothing left to release), with the operator's mark, and only
    it carries one.  Version 1 rows are upcast with None."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    outcome: RetirePaidOutcome
    # The agent process that answered the retire.
    execution_incarnation: Incarnation | None = None
    operator: OperatorMark | None = None

    @model_validator(mode="after")
    def _operator_marks_only_an_operator_drop(self) -> RetirePaid:
        if (self.outcome == "dropped_by_operator") != (self.operator is not None):
            raise ValueError("an operator's mark goes with outcome dropped_by_operator, and only with it")
        return self


class RetireDeliveryStuck(Event):
    """One agent's owed retires kept failing in transport past their budget (`RETIRE_OWED_POLICY`).
    They stay owed and are still called at the longest wait; recorded once per spell, on the trainer's
    stream (like `AckDeliveryStuck`)."""

    agent_name: Identifier
    retires: int = Field(ge=0)
    calls: int = Field(ge=0)
    reason: str


class AttemptRetired(Event, version=3):
    """Version 2 added `cause` (set when a checkpoint's prepare retired the try: RetireCause) and
    `work` (what the cancelled execution had done, as its agent measured it: the generation the retire
    threw away).  Version 1 rows are upcast with None for both.

    Version 3 added `continuation`: the try's latest committed turn boundary its agent offered with
    the retire (docs/turns.md), which a replacement at target level `turn` may resume; version 2 rows
    are upcast with None."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    outcome: Literal["cancelled", "tombstoned", "completed_unacknowledged", "done"]
    checkpoint_id: Identifier | None = None
    # The agent process that answered (None in rows written before each was recorded): a `done` from
    # another incarnation than the one that held the finished result is the log's evidence that the
    # result went with that process.
    execution_generation: int | None = Field(default=None, ge=0)
    execution_incarnation: Incarnation | None = None
    cause: RetireCause | None = None
    work: AttemptWork | None = None
    continuation: ContinuationRef | None = None


class ContinuationResumed(Event):
    """A try asked to resume a continuation did (its agent's `ResumeReport`, from the try's completion
    receipt or retire answer): which try and turn it carried on from, the model calls and generated
    tokens it reused, the resources it restored at which revision, the prompt its lineage began from."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    resume: ResumeReport

    @model_validator(mode="after")
    def _resumed(self) -> ContinuationResumed:
        if self.resume.outcome != "resumed":
            raise ValueError("ContinuationResumed carries a resumed report")
        return self


class ContinuationDeclined(Event):
    """A try asked to resume a continuation did not (the report names why): it played from its
    prompt, on a lineage of its own."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    resume: ResumeReport

    @model_validator(mode="after")
    def _declined(self) -> ContinuationDeclined:
        if self.resume.outcome != "declined":
            raise ValueError("ContinuationDeclined carries a declined report")
        return self


class AttemptAdopted(Event):
    rollout_id: Identifier
    attempt_index: AttemptIndex


class GroupDeadLettered(Event, version=2):
    """Version 2 renamed `tries` to `attempts` (one name per idea, as on the wire); version 1 rows are
    upcast with the same list under the new name."""

    group_id: Identifier
    attempts: list[AttemptRef]
    reasons: list[str]
    # The retry budget that ran out ("infra", "data", or "tries" for the one-budget groups of v1
    # reservations); None when the group stopped for another reason (a stranded try).
    budget: RetryBudget | None = None


class GroupClaimedForTraining(Event, version=3):
    """Version 2 added `call_id`: the call that delivered the group to training, when it has an
    identity a retry of it keeps (a Ray task id).  Version 3 lets `train_step` be None: the trainer
    named no step (NeMo RL's Gym call names none), and none is made up.  Older rows are upcast as
    they are (v1 with `call_id` None; every v1 and v2 row holds a step)."""

    group_id: Identifier
    train_step: int | None = Field(default=None, ge=0)
    call_id: str | None = Field(default=None, max_length=200)


# --- checkpoints -------------------------------------------------------------


class CheckpointPrepareStarted(Event):
    checkpoint_id: Identifier
    participants: list[Identifier]
    trainer_id: Identifier | None = None


class CheckpointCommitted(Event, version=3):
    """Version 2 added `trainer_id`: a commit archives only its own trainer's groups (several
    trainers share one log; another's cut says nothing of where this one may restore to).  Version 3
    added `carried`: per participant, the finished, unACKed tries its prepare carried across the
    checkpoint (their debts may be unpaid at the cut, and are paid after it); older rows carried none."""

    checkpoint_id: Identifier
    participants: list[Identifier]
    cut_position: int = Field(ge=0)
    prepare_wait_s: dict[str, float]
    trainer_id: Identifier | None = None
    carried: dict[Identifier, list[AttemptRef]] = Field(default_factory=dict)


class CheckpointResumed(Event):
    checkpoint_id: Identifier
    participants: list[Identifier]


class CheckpointAborted(Event):
    checkpoint_id: Identifier
    participants: list[Identifier]
    reason: str
    prepare_wait_s: dict[str, float] = Field(default_factory=dict)


ParticipantOutcome = Literal["resumed", "aborted", "lost"]
PhaseStep = Literal["commit", "resume", "abort"]


class CheckpointParticipantFinished(Event):
    """One participant confirmed the log's decision (resumed after a commit, or aborted), or showed
    it lost the checkpoint (it restarted, or aborted what the log committed).  `CheckpointResumed`
    follows only once every participant of a committed checkpoint finished `resumed`."""

    checkpoint_id: Identifier
    agent_name: Identifier
    outcome: ParticipantOutcome
    reason: str = ""


class CheckpointParticipantStuck(Event):
    """A decided step (commit, resume or abort) spent its retry budget at one agent.  The trainer
    keeps calling (the step is decided); this is what the operator sees until the agent finishes."""

    checkpoint_id: Identifier
    agent_name: Identifier
    step: PhaseStep
    calls: int = Field(ge=0)
    reason: str


class TrainerEpochTaken(Event):
    """A coordinator process became the owner of `trainer_id`: every later append of that process is
    fenced on the version of the trainer's stream this event left, so an earlier owner still running
    fails its next append (and stops) instead of writing beside the new one."""

    trainer_id: Identifier | None
    reason: Literal["start", "recovery"]
    writer: str


class TrainerRestored(Event, version=2):
    """A trainer's coordinator rebuilt from the log.  `checkpoint_id`/`cut_position`: the checkpoint
    the trainer restored to (its claims after that cut roll back).  Version 2 added `claims_kept`:
    True when the trainer itself did not restore (only the process holding its coordinator restarted,
    e.g. NeMo RL's Gym actor under Ray), so every claim stands; v1 rows are upcast with False."""

    cut_position: int | None
    checkpoint_id: Identifier | None
    plan: dict[str, int]
    trainer_id: Identifier | None = None
    claims_kept: bool = False


# --- workers -----------------------------------------------------------------


class LogprobsComputed(Event, version=2):
    """Version 2 added `logprobs`, the claim of the stored array; version 1 rows are upcast with none."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    policy_version: str
    token_count: int = Field(ge=0)
    logprob_sum: float
    max_abs_diff: float
    mean_abs_diff: float
    blob_digest: str
    # The claim of the stored array (float32, little-endian); None in rows written before claims,
    # whose array is in the log's blob table under `blob_digest`.
    logprobs: PayloadClaim | None = None

    @model_validator(mode="after")
    def _claim_is_of_the_digest(self) -> LogprobsComputed:
        if self.logprobs is not None and self.logprobs.digest != self.blob_digest:
            raise ValueError("the logprobs' claim names another digest than blob_digest")
        return self

    def logprobs_claim(self) -> PayloadClaim:
        return self.logprobs or PayloadClaim.legacy(self.blob_digest, LOGPROBS_MEDIA_TYPE)


# --- payload retention ---------------------------------------------------


class PayloadsPruned(Event):
    """Retention deleted these payloads of groups done for good from `store`, after appending this:
    a claimed payload this names after its last claim is pruned, not missing (docs/payloads.md)."""

    store: str = Field(min_length=1, max_length=200)
    groups: list[Identifier] = Field(default_factory=list)
    digests: list[Digest] = Field(default_factory=list, max_length=2000)


class LogprobsRefused(Event):
    """A token record that does not match its receipt is recorded, never scored."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    policy_version: str
    reason: str
