"""The event catalogue (docs/events.md): one pydantic model per event type.

A model's class name is its `type` in the log, and its schema version is
written once, as the `version=` class keyword.  Older payload versions are
upgraded on read by the upcasters in `eventstore.upcasting`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocol.ids import AttemptIndex, Identifier
from protocol.wire import AttemptRef, CompletionReceipt

Mode = Literal["sibling", "prompt_group"]
TargetLevel = Literal["turn", "sibling", "prompt_group"]

EVENT_TYPES: dict[str, type[Event]] = {}


class Event(BaseModel):
    """Base of every payload in the log."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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

    The token records themselves are stored in the content-addressed blob table
    under `tokens_digest`, written in the same transaction as the event that
    carries this receipt, so they outlive the agent's copy after the ACK.
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


# --- groups and tries -------------------------------------------------------


class GroupReserved(Event):
    group_id: Identifier
    prompt_ref: PromptRef
    agent_name: Identifier
    expected_generations: int = Field(ge=1, le=10_000)
    mode: Mode
    target_level: TargetLevel = "sibling"
    target_step: int | None = None
    start_weight_version: int | None = None
    max_tries: int = Field(default=4, ge=1)
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


class ReplacementMinted(Event):
    rollout_id: Identifier
    generation_index: int = Field(ge=0)
    attempt_index: AttemptIndex
    replaces: AttemptIndex
    reason: str


class RunDispatched(Event):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    capture_key: Identifier
    agent_name: Identifier
    deadline_s: float | None = None


class RunReplied(Event):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    reward: float
    mask_sample: bool
    reply_digest: str


FailureKind = Literal[
    "env", "http", "deadline", "stream_closed", "receipt", "verify", "agent_lost", "unknown"
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


class SiblingHeld(Event):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    receipt: RolloutReceipt


class SiblingSealed(Event):
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


class AckRejected(Event):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    error: Literal["receipt_mismatch", "unknown_execution"]


class AttemptRetired(Event):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    outcome: Literal["cancelled", "tombstoned", "completed_unacknowledged", "done"]
    checkpoint_id: Identifier | None = None


class AttemptAdopted(Event):
    rollout_id: Identifier
    attempt_index: AttemptIndex


class GroupDeadLettered(Event):
    group_id: Identifier
    tries: list[AttemptRef]
    reasons: list[str]


class GroupClaimedForTraining(Event):
    group_id: Identifier
    train_step: int = Field(ge=0)


# --- checkpoints -------------------------------------------------------------


class CheckpointPrepareStarted(Event):
    checkpoint_id: Identifier
    participants: list[Identifier]
    trainer_id: Identifier | None = None


class CheckpointCommitted(Event):
    checkpoint_id: Identifier
    participants: list[Identifier]
    cut_position: int = Field(ge=0)
    prepare_wait_s: dict[str, float]


class CheckpointResumed(Event):
    checkpoint_id: Identifier
    participants: list[Identifier]


class CheckpointAborted(Event):
    checkpoint_id: Identifier
    participants: list[Identifier]
    reason: str
    prepare_wait_s: dict[str, float] = Field(default_factory=dict)


class TrainerRestored(Event):
    cut_position: int | None
    checkpoint_id: Identifier | None
    plan: dict[str, int]
    trainer_id: Identifier | None = None


# --- workers -----------------------------------------------------------------


class LogprobsComputed(Event):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    policy_version: str
    token_count: int = Field(ge=0)
    logprob_sum: float
    max_abs_diff: float
    mean_abs_diff: float
    blob_digest: str


class LogprobsRefused(Event):
    """A token record that does not match its receipt is recorded, never scored."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    policy_version: str
    reason: str
