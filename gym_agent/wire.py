"""The Gym agent's HTTP contract: one pydantic model per wire shape.

The reference server (`gym_agent.app`) and the trainer's client (`workers.gym`)
both import these models; nothing else defines a wire shape.  The spec is
`gym-agent-api.md`.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

GYM_SCHEMA_VERSION: Final = 1
GymSchemaVersion = Literal[1]

# Feature names are constants on both sides, never bare strings.
FEATURE_CHECKPOINT_PARTICIPATION: Final = "checkpoint_participation"
FEATURE_COMPLETED_RESULT_ACKNOWLEDGEMENT: Final = "completed_result_acknowledgement"
FEATURE_RETIRE: Final = "retire"
FEATURE_TOKEN_CAPTURE: Final = "token_capture"
ALL_FEATURES: Final = (
    FEATURE_CHECKPOINT_PARTICIPATION,
    FEATURE_COMPLETED_RESULT_ACKNOWLEDGEMENT,
    FEATURE_RETIRE,
    FEATURE_TOKEN_CAPTURE,
)

# Error names of the phase fence, exactly as the real Gym spells them.
CHECKPOINT_CONFLICT: Final = "CheckpointConflictError"
INVALID_PHASE: Final = "InvalidPhaseError"
STALE_CHECKPOINT: Final = "StaleCheckpointError"
NOT_READY: Final = "not_ready"
GONE: Final = "gone"
RECEIPT_MISMATCH: Final = "receipt_mismatch"
UNKNOWN_EXECUTION: Final = "unknown_execution"

ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
ID_RE: Final = re.compile(ID_PATTERN)
MAX_ID_LENGTH: Final = 200
# Caps that keep one request from exhausting an agent or a trainer.
MAX_LIST_ITEMS: Final = 10_000
MAX_BODY_BYTES: Final = 8 * 1024 * 1024
# Nesting of the free-form task payload: deeper JSON parses but cannot be serialised back (pydantic and
# json stop near a few hundred levels), so it is refused at the door with a 422, never run.
MAX_JSON_DEPTH: Final = 64

Identifier = Annotated[str, StringConstraints(pattern=ID_PATTERN, min_length=1, max_length=MAX_ID_LENGTH)]
AttemptIndex = Annotated[int, Field(ge=0, le=1_000_000)]

Phase = Literal["idle", "preparing", "prepared", "committing", "committed_paused"]


def capture_key(rollout_id: str, attempt_index: int) -> str:
    """The key a Gym agent files a try under: the rollout id for try 0, `<id>-a<N>` after."""
    if not ID_RE.match(rollout_id) or attempt_index < 0:
        raise ValueError(f"invalid try ({rollout_id!r}, {attempt_index}); ids must match {ID_PATTERN}")
    return rollout_id if attempt_index == 0 else f"{rollout_id}-a{attempt_index}"


def canonical_json(value: Any) -> str:
    """UTF-8 JSON with sorted keys and no insignificant whitespace (protocol.md §2)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def reply_digest(reply: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical_json(reply).encode()).hexdigest()


def check_depth(value: dict[str, Any], limit: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """`value` itself, or ValueError if its JSON nesting is deeper than `limit` (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            raise ValueError(f"nested deeper than {limit} levels")
        stack.extend((child, depth + 1) for child in children)
    return value


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)


class AttemptRef(WireModel):
    rollout_id: Identifier
    attempt_index: AttemptIndex


class RunRequest(WireModel):
    """Body of `POST /run`: the try's identity plus the task payload."""

    rollout_id: Identifier = Field(alias="_ng_rollout_id")
    attempt_index: AttemptIndex = Field(alias="_ng_attempt_index")
    responses_create_params: dict[str, Any] = Field(default_factory=dict)
    # Environment fields of the task (prompt, sample id, ...), echoed back in the reply.
    task: dict[str, Any] = Field(default_factory=dict)

    @field_validator("responses_create_params", "task")
    @classmethod
    def _not_too_deep(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_depth(value)


class RunReply(RunRequest):
    """`BaseVerifyResponse`: the only way the reward reaches the trainer."""

    id: str
    response: dict[str, Any]
    reward: float
    mask_sample: bool


class CompletionReceipt(WireModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: GymSchemaVersion = Field(default=GYM_SCHEMA_VERSION, validate_default=True)
    rollout_id: Identifier
    attempt_index: AttemptIndex
    execution_generation: int = Field(ge=0)
    result_identity: str
    result_digest: Annotated[str, StringConstraints(pattern=r"^sha256:[0-9a-f]{64}$")]
    manifest_capture_key: Identifier
    terminal_model_call_id: str

    @property
    def attempt(self) -> tuple[str, int]:
        return (self.rollout_id, self.attempt_index)


class TokenEntry(WireModel):
    """One record per model call, in the shape of Gym's `TokenEntry`."""

    schema_version: GymSchemaVersion = Field(default=GYM_SCHEMA_VERSION, validate_default=True)
    rollout_id: Identifier  # the capture key of the try
    model_call_id: str
    model: str
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    output_items: list[dict[str, Any]]
    token_item_index: int = Field(ge=0)
    created_at: float

    @model_validator(mode="after")
    def _lengths_match(self) -> TokenEntry:
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError("generation_token_ids and generation_log_probs differ in length")
        return self


class AcknowledgeItem(WireModel):
    agent_name: Identifier
    receipt: CompletionReceipt


class AcknowledgeRequest(WireModel):
    executions: list[AcknowledgeItem] = Field(max_length=MAX_LIST_ITEMS)


class AcknowledgeResult(WireModel):
    rollout_id: str
    attempt_index: int
    acknowledged: bool
    idempotent: bool = False
    error: Literal["receipt_mismatch", "unknown_execution"] | None = None


class AcknowledgeResponse(WireModel):
    results: list[AcknowledgeResult]


class RetireRequest(WireModel):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    checkpoint_id: Identifier | None = None


class RetireResponse(WireModel):
    retired: bool
    tombstoned: bool
    completed_unacknowledged: bool
    done: bool = False


class PrepareRequest(WireModel):
    checkpoint_id: Identifier
    timeout_s: float = Field(default=300.0, gt=0, le=86_400)


class CheckpointRequest(WireModel):
    checkpoint_id: Identifier


class AgentStatus(WireModel):
    phase: Phase
    active_checkpoint_id: str | None
    execution_generation: int
    running: int
    park_requested: int
    parked: int
    completed_unacknowledged: int
    blocking_attempts: list[AttemptRef]
    parked_without_boundary: int
    ready_to_commit: bool


class PhaseResponse(WireModel):
    """200 answer of prepare/commit/resume/abort."""

    phase: Phase
    status: AgentStatus


class NotReadyResponse(WireModel):
    """409 answer of prepare while the agent is not ready to commit."""

    error: Literal["not_ready"] = NOT_READY
    status: AgentStatus
    completed_unacknowledged_attempts: list[AttemptRef]


class ErrorResponse(WireModel):
    error: str
    message: str


class Capabilities(WireModel):
    schema_version: GymSchemaVersion = Field(default=GYM_SCHEMA_VERSION, validate_default=True)
    agent_name: Identifier
    features: list[str]


class TryFault(WireModel):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    drop_reply: bool = False
    fail: bool = False
    delay_s: float = Field(default=0.0, ge=0, le=3600)
    hang: bool = False


class FaultRates(WireModel):
    drop_reply: float = Field(default=0.0, ge=0, le=1)
    fail: float = Field(default=0.0, ge=0, le=1)
    hang: float = Field(default=0.0, ge=0, le=1)


class RateFaults(WireModel):
    rates: FaultRates
    seed: int = 0


class CrashAfter(WireModel):
    crash_after: int = Field(ge=0)


class OkResponse(WireModel):
    ok: bool = True


class DebugRuns(WireModel):
    runs: dict[str, int]


class Health(WireModel):
    ok: bool = True
    agent_name: str
    execution_generation: int
