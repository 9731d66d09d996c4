"""The Gym agent's HTTP contract: one pydantic model per wire shape.

The Gym side (`participant`, the reference agent) and the trainer's client (`trainer.gym`) both
import these models; nothing else defines a wire shape.  `docs/protocol.md` describes the routes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from protocol.digests import (
    Digest,
    canonical_bytes,
    canonical_json,
    nesting,
    numbers_alone,
    reply_digest,
    sha256_digest,
)
from protocol.errors import NOT_READY
from protocol.ids import AttemptIndex, Generation, Identifier, Incarnation, capture_key
from protocol.routes import RoutesText

GYM_SCHEMA_VERSION: Final = 1
GymSchemaVersion = Literal[1]

# Feature names are constants on both sides, never bare strings.
FEATURE_CHECKPOINT_PARTICIPATION: Final = "checkpoint_participation"
FEATURE_COMPLETED_RESULT_ACKNOWLEDGEMENT: Final = "completed_result_acknowledgement"
FEATURE_RETIRE: Final = "retire"
FEATURE_TOKEN_CAPTURE: Final = "token_capture"
# The agent saves a continuation at each turn boundary and resumes a replacement try from one
# (`x-ledger-continue-from`): what lets a group run at target level `turn` (protocol.levels).
FEATURE_TURN_CONTINUATION: Final = "turn_continuation"
# The agent's runner cuts a model call in progress at a durable token boundary when a checkpoint asks
# its try to park (`RunSession.at_cut`), and continues the call from that prefix after the resume.
FEATURE_GENERATION_CUT: Final = "generation_cut"
# The agent answers a prepare that asks it to (`PrepareRequest.carry_completed`) `prepared` as soon as
# nothing runs, its finished, unACKed tries named in the answer (`PhaseResponse.carried`) and kept
# across the checkpoint, instead of `409 not_ready` until the trainer has taken each in.
FEATURE_CARRY_COMPLETED: Final = "carry_completed"
# A completed try's `/run` answers, when asked by media type, with its receipt and token records in
# the same body (`protocol.completion`): one exchange per try instead of three.
FEATURE_COMPLETION_IN_RUN: Final = "completion_in_run"
ALL_FEATURES: Final = (
    FEATURE_CHECKPOINT_PARTICIPATION,
    FEATURE_COMPLETED_RESULT_ACKNOWLEDGEMENT,
    FEATURE_RETIRE,
    FEATURE_TOKEN_CAPTURE,
    FEATURE_COMPLETION_IN_RUN,
)

# Caps that keep one request from exhausting an agent or a trainer.
MAX_LIST_ITEMS: Final = 10_000
MAX_BODY_BYTES: Final = 8 * 1024 * 1024
# Nesting of the free-form task payload: deeper JSON parses but cannot be serialised back (pydantic and
# json stop near a few hundred levels), so it is refused at the door with a 422, never run.
MAX_JSON_DEPTH: Final = 64

# The trainer re-POSTs `/run` with this header set to "1" to adopt a try that retire said finished: the
# agent replays the stored reply, or answers 404 `not_found` when it has no record of the try (it
# restarted), and never starts a new execution for such a request.
ADOPT_ONLY_HEADER: Final = "x-ledger-adopt-only"
# Every call of a coordinator that changes what the agent holds (/run, /acknowledge, /retire,
# /checkpoint/*) names its trainer here ("" for the unnamed trainer): an agent is driven by one trainer
# at a time and refuses another's calls with 409 trainer_conflict (participant.driver).
TRAINER_HEADER: Final = "x-ledger-trainer"
# A replacement try's `POST /run` carries this header set to a continuation's digest to resume from it
# (docs/turns.md): the agent resumes from that continuation, or declines and starts from the prompt.
CONTINUE_FROM_HEADER: Final = "x-ledger-continue-from"

Phase = Literal["idle", "preparing", "prepared", "committing", "committed_paused"]


class _Refusal(Protocol):
    def errors(self) -> Sequence[Mapping[str, Any]]: ...


def validation_line(exc: _Refusal, whole: str = "value") -> str:
    """What pydantic (or FastAPI, for a request) refused, field by field on one line: its own text
    spans several lines, with a link.  `whole` names a refusal of the value itself."""
    parts = [
        f"{'.'.join(str(p) for p in err.get('loc', ())) or whole}: {err.get('msg', 'invalid')}"
        for err in exc.errors()
    ]
    return "; ".join(parts) or f"invalid {whole}"


# The integers orjson writes: signed 64-bit down, unsigned 64-bit up.
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1


def check_depth(
    value: dict[str, Any], limit: int = MAX_JSON_DEPTH, *, finite: bool = False
) -> dict[str, Any]:
    """`value` itself, or ValueError if its JSON nesting is deeper than `limit` (iterative: no recursion)
    or, with `finite`, if it holds a number JSON cannot carry: `NaN`, `Infinity`, or one past a double's
    range such as `1e999` (which a JSON parser reads as infinity), or an integer outside the 64-bit
    range (orjson, which writes every reply and frame, refuses it; a parser reads it as a float).

    Level by level, keeping only the containers of the next level.  A list of numbers alone (a
    reply's token ids and logprobs, thousands a model call) is settled in C (`_numbers_fit`), and so
    is a list of lists of numbers (a MoE reply's `routed_experts`, a list per token: its text in
    orjson, `numbers_alone`, and that text's nesting); any other container is walked item by item.
    A list settled so is as deep as its text says: the levels below it are counted, not walked, and
    the verdict is the walk's, at the level the walk would give it.  Router choices held as their
    text (`protocol.routes.RoutesText`, checked when made) are three levels of such integers."""
    level: list[Any] = [value]
    depth = 1
    deepest = 0  # the deepest level reached by a list settled by its text
    while level or depth <= deepest:
        if depth > limit:
            raise ValueError(f"nested deeper than {limit} levels")
        below: list[Any] = []
        for item in level:
            if type(item) is list:
                if _numbers_fit(item, finite):
                    continue
                if item and type(item[0]) is list:
                    text = numbers_alone(item)
                    if text is not None:
                        deepest = max(deepest, depth - 1 + nesting(text, limit - depth + 1))
                        continue
            for child in item.values() if isinstance(item, dict) else item:
                if isinstance(child, (dict, list)):
                    below.append(child)
                elif type(child) is RoutesText:  # three levels of integers within int32, in its text
                    deepest = max(deepest, depth + 3)
                elif finite and isinstance(child, float) and not math.isfinite(child):
                    raise ValueError(
                        f"holds the number {child}, which JSON cannot carry (NaN, infinite or out of range)"
                    )
                elif finite and type(child) is int and not _INT_MIN <= child <= _INT_MAX:
                    raise ValueError(
                        f"holds an integer of {child.bit_length()} bits, outside the 64-bit range"
                    )
        level = below
        depth += 1
    return value


def _numbers_fit(items: list[Any], finite: bool) -> bool:
    """Whether `items` are numbers alone (a sum takes no container or string) and, with `finite`,
    each one JSON carries: their Euclidean norm (`math.hypot`, one pass in C), at least each one's
    size, NaN or infinite exactly when one is, bounds them all when it stays below 2^63.  False where
    the walk must decide and name the culprit: a string or container among them, a norm past that
    bound (a number past the range, or large ones), one too large for a float.  (A sum of their sizes
    said the same, 3x slower: `abs` makes a new float of every negative logprob.)"""
    try:
        if not finite:
            sum(items, 0.0)
            return True
        return math.hypot(*items) < _SIZES_BELOW
    except (TypeError, OverflowError):
        return False


# A norm below it bounds each number within the 64-bit integers orjson writes.
_SIZES_BELOW: Final = float(2**63)


class WireModel(BaseModel):
    """A shape this project owns: unknown fields are refused, and so is a number JSON cannot carry
    (`NaN`, `Infinity`, `1e999`), which a parser would take and no canonical JSON, digest or echo back
    to the peer could write (an `Infinity` in a receipt's work made every ACK of it a 422)."""

    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, serialize_by_alias=True, allow_inf_nan=False
    )


class GymModel(BaseModel):
    """A shape the real NeMo Gym owns (`/run` rows and replies): fields it or NeMo RL add are kept,
    nested no deeper than MAX_JSON_DEPTH like the free-form fields we name, and like them holding only
    numbers JSON carries (`check_depth(finite=True)`): a `NaN`, `Infinity`, `1e999` or an integer past
    64 bits anywhere makes a `/run` body a 422 before anything runs, and a reply no reply (the
    participant could not deliver it, and pydantic would write a NaN as `null`, another reply)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, serialize_by_alias=True)

    @model_validator(mode="after")
    def _extras_not_too_deep(self) -> GymModel:
        if self.model_extra:
            check_depth(self.model_extra, MAX_JSON_DEPTH - 1, finite=True)
        return self


class AttemptRef(WireModel):
    rollout_id: Identifier
    attempt_index: AttemptIndex


class RunRequest(GymModel):
    """Body of `POST /run`, a row as NeMo RL sends it: the try's identity, `responses_create_params`,
    and the task's own fields at the top level (`agent_ref`, `_ng_task_index`, `_ng_rollout_index`, an
    environment's fields such as `expected_answer`), kept as extras and reaching the agent unchanged:
    a Gym agent forwards its body as it is to its resources server's `/verify`, which reads them there.
    Every number in it is one JSON carries (`GymModel`)."""

    rollout_id: Identifier = Field(alias="_ng_rollout_id")
    attempt_index: AttemptIndex = Field(alias="_ng_attempt_index")
    responses_create_params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("responses_create_params")
    @classmethod
    def _not_too_deep(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_depth(value, finite=True)

    def prompt_digest(self) -> str:
        """The digest of the row without the try's identity: equal for every try of one sibling, and
        what a continuation names as the prompt its lineage began from."""
        row = self.model_dump(mode="json", by_alias=True, exclude_unset=True)
        row.pop("_ng_rollout_id", None)
        row.pop("_ng_attempt_index", None)
        return sha256_digest(canonical_json(row).encode())

    def task_fields(self) -> dict[str, Any]:
        """The row's own fields: everything but the try's identity and `responses_create_params`."""
        return dict(self.model_extra or {})


# RunReply's fields that hold JSON as given (`dict[str, Any]`).
_JSON_VALUED: Final = frozenset({"responses_create_params", "response"})


class RunReply(GymModel):
    """`BaseVerifyResponse`: the only way the reward reaches the trainer.

    The real Gym answers `{responses_create_params, response, reward, mask_sample, failure_kind,
    failure_reason}`; `gym_reply` fills in the try's identity where it is missing.  `mask_sample` says
    the reward is no valid measurement (the environment or its infrastructure failed), `failure_kind`
    (the Gym's vocabulary, `protocol.failures`) and `failure_reason` say what went wrong, with or
    without a mask.  `payload()` is the reply as it travels (exactly the fields that were set), and the
    one thing `digest()` is taken of, on every side.  Every number in it is one JSON carries
    (`GymModel`).
    """

    rollout_id: Identifier = Field(alias="_ng_rollout_id")
    attempt_index: AttemptIndex = Field(alias="_ng_attempt_index")
    responses_create_params: dict[str, Any] = Field(default_factory=dict)
    id: str
    response: dict[str, Any]
    # A NaN or infinite reward would poison the batch, and no JSON can carry it (canonical JSON, the
    # digest's form, refuses it): refused at the parse, as a reply that is no reply.
    reward: float = Field(allow_inf_nan=False)
    mask_sample: bool = False
    failure_kind: str | None = Field(default=None, max_length=200)
    failure_reason: str | None = None

    @field_validator("responses_create_params", "response")
    @classmethod
    def _not_too_deep(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_depth(value, finite=True)

    def masked(self) -> bool:
        """The reply's mask, where the Gym or NeMo RL put it: `mask_sample`, or `mask_sample` in the
        row's `instance_config`."""
        config = (self.model_extra or {}).get("instance_config")
        return self.mask_sample or (isinstance(config, dict) and config.get("mask_sample") is True)

    def payload(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def parsed_payload(self) -> dict[str, Any]:
        """`payload()` of a reply validated from JSON (the trainer's, read off a `/run` body): the same
        value, its two JSON-valued fields shared, not copied.  Parsed from JSON they hold JSON values
        already, which a dump copies into equal ones, item by item: a real Gym reply's `response`
        carries its token arrays, 17,000 numbers at 9k tokens and 0.4-0.5 ms to copy.  A reply built
        from Python objects (the agent side's) takes `payload()`."""
        out = self.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude=set(_JSON_VALUED))
        for name in _JSON_VALUED & self.model_fields_set:
            out[name] = getattr(self, name)
        return out

    def parsed_from(self, payload: Any) -> bool:
        """Whether this reply, validated from `payload` (a `/run` body's JSON, parsed), dumps
        (`parsed_payload`) to that same JSON, so the body's canonical JSON is the reply's: its
        JSON-valued fields hold `payload`'s own values (validated as given, never copied), and
        validation changed none of the rest (an integer reward made a float is written otherwise)."""
        if not isinstance(payload, dict):
            return False
        mine = self.parsed_payload()
        if mine.keys() != payload.keys():
            return False
        for name in _JSON_VALUED & mine.keys():
            given, held = payload[name], mine[name]
            if given is not held and not (
                isinstance(given, dict)
                and given.keys() == held.keys()
                and all(value is held[key] for key, value in given.items())
            ):
                return False
        rest = [{k: v for k, v in d.items() if k not in _JSON_VALUED} for d in (mine, payload)]
        return canonical_bytes(rest[0]) == canonical_bytes(rest[1])

    def digest(self) -> str:
        return reply_digest(self.payload())


def gym_reply(
    payload: Any, rollout_id: str, attempt_index: int, *, as_type: type[RunReply] = RunReply
) -> RunReply:
    """A `/run` reply as the trainer keeps it: the try's identity and a result id filled in where the
    agent (a plain Gym agent) left them out; ValidationError when it is no reply at all.  A reply that
    names another try keeps that name, so the caller can refuse it.  `as_type`: a subclass of
    `RunReply` to validate it as (the participant's `ParsedReply`)."""
    if not isinstance(payload, dict):
        return as_type.model_validate(payload)  # raises: not an object
    data = dict(payload)
    data.setdefault("_ng_rollout_id", rollout_id)
    data.setdefault("_ng_attempt_index", attempt_index)
    if "id" not in data:
        response = data.get("response")
        response_id = response.get("id") if isinstance(response, dict) else None
        data["id"] = response_id if isinstance(response_id, str) else capture_key(rollout_id, attempt_index)
    return as_type.model_validate(data)


class AttemptWork(WireModel):
    """What one try has cost the agent so far: seconds inside model calls (parked time not counted)
    and tokens generated (the current call's partial count included).  Reported by the agent, so the
    log can say how much generation a retire threw away and how much a seal kept."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_s: float = Field(default=0.0, ge=0)
    generated_tokens: int = Field(default=0, ge=0)


# --- turn-level resume (docs/turns.md) ----------------------------------------------------------

ResourceClass = Literal["export_restore", "restart_only", "stateless"]


class ResourceRevision(WireModel):
    """A resource a continuation touched: its class, its session (one per lineage) and its revision at
    the boundary (0 for the classes that export nothing).  The protocol is `protocol.resources`."""

    name: Identifier
    resource_class: ResourceClass
    session: Identifier
    revision: int = Field(default=0, ge=0)


class ContinuationRef(WireModel):
    """A continuation an agent holds: what a retire answer offers and a replacement try resumes from.

    `lineage` is the capture key of the try whose prompt began the conversation; `source_attempt` the
    try that committed this boundary; `turn` the turns done (model calls recorded); `digest` the
    sha256 of the stored continuation (its claim); `model_call_ids` the calls a resume reuses, and
    `generated_tokens` their generated tokens (what resuming does not generate again)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: Identifier
    source_attempt: AttemptIndex
    lineage: Identifier
    turn: int = Field(ge=1)
    digest: Digest
    prompt_digest: Digest
    model_call_ids: list[str] = Field(max_length=MAX_LIST_ITEMS)
    generated_tokens: int = Field(ge=0)
    resources: list[ResourceRevision] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)


DeclineReason = Literal[
    "unknown_continuation",  # the agent holds no committed continuation with that digest (state lost)
    "continuation_lost",  # its index names it, the payload store does not have it
    "continuation_corrupt",  # the bytes read back do not hash to the digest, or do not parse
    "prompt_mismatch",  # the try's row is not the prompt the lineage began from
    "restart_only_resource",  # it touched a resource whose state cannot be restored
    "already_resumed",  # another try resumed it already
    "superseded",  # a later boundary of its lineage was committed (a stale owner's late resume)
    "source_live",  # the try that committed it is still running here
    "restore_failed",  # a resource could not be restored at its revision
    "not_resumable",  # the agent's runner does not resume (it plays every try from its prompt)
]


class ResumeReport(WireModel):
    """What the agent did with a `continue-from`: resumed (which calls it reused, which resources it
    restored at which revision) or declined (why; the try then ran from its prompt)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    continuation: Digest
    outcome: Literal["resumed", "declined"]
    reason: DeclineReason | None = None
    detail: str = Field(default="", max_length=500)
    source_attempt: AttemptIndex | None = None
    lineage: Identifier | None = None
    turn: int = Field(default=0, ge=0)
    reused_model_calls: list[str] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)
    reused_tokens: int = Field(default=0, ge=0)
    restored: list[ResourceRevision] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)
    prompt_digest: Digest | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ResumeReport:
        if (self.outcome == "declined") != (self.reason is not None):
            raise ValueError("a declined resume names its reason, and only a declined one does")
        if self.outcome == "resumed" and (
            self.turn < 1 or self.lineage is None or self.source_attempt is None
        ):
            raise ValueError("a resumed continuation names its lineage, source try and turn")
        return self


class CompletionReceipt(WireModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: GymSchemaVersion = Field(default=GYM_SCHEMA_VERSION, validate_default=True)
    rollout_id: Identifier
    attempt_index: AttemptIndex
    execution_generation: Generation
    # The agent process that made the receipt (None in receipts recorded before incarnations existed):
    # a later denial of it from another incarnation is the evidence that the result was lost.
    execution_incarnation: Incarnation | None = None
    result_identity: str
    result_digest: Digest
    manifest_capture_key: Identifier
    terminal_model_call_id: str
    # The execution's work (None from agents that do not report it).
    work: AttemptWork | None = None
    # The try was asked to resume a continuation: what the agent did (None: it was not asked).
    resume: ResumeReport | None = None

    @property
    def attempt(self) -> tuple[str, int]:
        return (self.rollout_id, self.attempt_index)


# Token records (`TokenEntry`) are the real Gym's shape, read by its rule: the schema versions a reader
# understands, from the oldest it still accepts to the newest (nemo-gym 0.7.0 writes and reads 1 only).
TOKEN_SCHEMA_MIN: Final = 1
TOKEN_SCHEMA_VERSION: Final = 1
# The request-time verdict on a model call's parent: no model-authored history (root), a verified
# earlier call (resolved, `parent_call_id` names it), or history no recorded call accounts for.
ParentResolution = Literal["root", "resolved", "unresolved"]
# One token array in the binary form (`protocol.token_codec`): its dtype and little-endian bytes.
PackedArray = tuple[str, bytes]


@dataclass(frozen=True, slots=True, eq=False)
class PackedArrays:
    """A record's three token arrays already in the binary form (`protocol.token_codec.with_arrays`
    makes them, by the form's dtype rules; None: that one is packed from its list), kept beside the
    lists they hold the values of.  They count only while the record's lists are those very lists
    (`lists`, by identity: a copy that replaces one drops them), and they never make two records
    differ: a record is its fields, these are a cache of three of them."""

    lists: tuple[object, object, object]
    arrays: tuple[PackedArray | None, PackedArray | None, PackedArray | None]

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, PackedArrays)

    def __hash__(self) -> int:
        return 0


class TokenEntry(BaseModel):
    """One record per model call, the real Gym's `TokenEntry` (`nemo_gym.token_id_capture.records`) in
    our own words and by its reader's rules, so a record either side writes reads the same on both.

    Fields a newer writer adds are kept as they came (`extra="allow"`, the owner's rule: what keeps a
    newer record's new meaning out is its `schema_version`, refused outside TOKEN_SCHEMA_MIN..
    TOKEN_SCHEMA_VERSION); `record()` gives back every field that was set, extras included.

    `output_items` are the call's output items without their token arrays, `token_item_index` the one
    that carried them; `routed_experts` is the MoE router's choice per token (router replay), kept as
    the model server gave it.  The lineage fields (protocol.lineage writes them) let a consumer chain a
    try's calls into one token sequence: `parent_resolution` and `parent_call_id` (with its
    `parent_resolution_reason`), `cum_len` and `digest` of the full prompt + generation (also for a
    `prompt_is_delta` record, whose `prompt_token_ids` hold only the suffix after its parent's
    sequence), `response_id` (the served response's id), and the continuation fingerprint of the
    request + output with the request context's length and digest.
    """

    model_config = ConfigDict(extra="allow")

    schema_version: int = TOKEN_SCHEMA_VERSION
    rollout_id: str  # the capture key of the try
    model_call_id: str
    model: str = ""
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    routed_experts: Any | None = None
    output_items: list[dict[str, Any]] = Field(default_factory=list)
    token_item_index: int | None = None
    response_id: str | None = None
    # Finite: the Gym's own model would take "INF" (lax str -> float), but no JSON can carry the
    # infinity back (pydantic writes it null, which its reader refuses), so it is refused here.
    created_at: float = Field(default=0.0, allow_inf_nan=False)
    parent_call_id: str | None = None
    cum_len: int | None = None
    digest: str | None = None
    parent_resolution: ParentResolution | None = None
    continuation_fingerprint: str = ""
    continuation_context_len: int = 0
    continuation_context_digest: str = ""
    parent_resolution_reason: str = ""
    fingerprint_version: int | None = None
    prompt_is_delta: bool = False
    prefix_requested: bool = False
    prefix_supplied: bool = False
    # The arrays in the binary form, when the writer held them as arrays (`packed_arrays`).
    _packed: PackedArrays | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _consistent(self) -> TokenEntry:
        if not TOKEN_SCHEMA_MIN <= self.schema_version <= TOKEN_SCHEMA_VERSION:
            raise ValueError(
                f"token record is schema_version {self.schema_version}; this reader understands "
                f"{TOKEN_SCHEMA_MIN}..{TOKEN_SCHEMA_VERSION}"
            )
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError("generation_token_ids and generation_log_probs differ in length")
        if self.token_item_index is not None and not 0 <= self.token_item_index < len(self.output_items):
            raise ValueError(
                f"token_item_index {self.token_item_index} is outside output_items "
                f"of length {len(self.output_items)}"
            )
        if self.parent_resolution == "resolved" and not self.parent_call_id:
            raise ValueError("a resolved parent needs parent_call_id")
        if self.parent_resolution in ("root", "unresolved") and self.parent_call_id is not None:
            raise ValueError(f"a {self.parent_resolution} record names no parent_call_id")
        if self.prompt_is_delta and (self.parent_call_id is None or self.parent_resolution != "resolved"):
            raise ValueError("a delta prompt needs a resolved parent_call_id to rebuild from")
        return self

    def record(self) -> dict[str, Any]:
        """The record as it travels and is stored: every field that was set, extras included."""
        return self.model_dump(mode="json", exclude_unset=True)

    def packed_arrays(self) -> tuple[PackedArray | None, PackedArray | None, PackedArray | None]:
        """`prompt_token_ids`, `generation_token_ids` and `generation_log_probs` in the binary form as
        `protocol.token_codec.with_arrays` packed them beside these very lists; (None, None, None)
        when it did not, or a copy replaced a list since, or a list grew or shrank in place (each
        array is 4 bytes a value: a list changed so cannot be given its old bytes)."""
        packed = self._packed
        if packed is None:
            return (None, None, None)
        lists: tuple[Sized, Sized, Sized] = (
            self.prompt_token_ids,
            self.generation_token_ids,
            self.generation_log_probs,
        )
        for kept, now, array in zip(packed.lists, lists, packed.arrays, strict=True):
            if kept is not now or (array is not None and len(array[1]) != 4 * len(now)):
                return (None, None, None)
        return packed.arrays


class AcknowledgeItem(WireModel):
    agent_name: Identifier
    receipt: CompletionReceipt


class AcknowledgeRequest(WireModel):
    executions: list[AcknowledgeItem] = Field(max_length=MAX_LIST_ITEMS)


class AcknowledgeResult(WireModel):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    acknowledged: bool
    idempotent: bool = False
    error: Literal["receipt_mismatch", "unknown_execution"] | None = (
        None  # RECEIPT_MISMATCH, UNKNOWN_EXECUTION
    )


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
    # The agent process that answered: an adoption accepts a receipt only from the same incarnation.
    execution_generation: Generation | None = None
    # What the cancelled execution had done when it was cancelled (`retired`), as the agent measured it.
    work: AttemptWork | None = None
    # The try's latest committed turn boundary, offered to a replacement (None: none to offer).
    continuation: ContinuationRef | None = None
    # The try had been asked to resume a continuation: what the agent did.
    resume: ResumeReport | None = None
    execution_incarnation: Incarnation


class PrepareRequest(WireModel):
    checkpoint_id: Identifier
    timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    # Carry the finished, unACKed tries across the checkpoint (FEATURE_CARRY_COMPLETED).
    carry_completed: bool = False


class CheckpointRequest(WireModel):
    checkpoint_id: Identifier


class AttemptProgress(WireModel):
    """A try a prepare asked to park that has not reached a boundary yet, and how recently it made
    progress of its own (a boundary, a token record, a heartbeat from its runner)."""

    rollout_id: Identifier
    attempt_index: AttemptIndex
    model_calls_done: int = Field(ge=0)
    work: AttemptWork
    since_progress_s: float = Field(ge=0)
    in_model_call: bool


class AgentStatus(WireModel):
    phase: Phase
    active_checkpoint_id: str | None
    execution_generation: Generation
    execution_incarnation: Incarnation
    running: int
    park_requested: int
    parked: int
    completed_unacknowledged: int
    blocking_attempts: list[AttemptRef]
    parked_without_boundary: int
    ready_to_commit: bool
    # The runner's promise: the longest it goes without reporting progress of a live try (None: no
    # promise, and a try is never judged stuck from the agent's side).
    heartbeat_s: float | None = Field(default=None, gt=0)
    # One per try asked to park that is still on its way to a boundary (PARK_REQUESTED).
    progress: list[AttemptProgress] = Field(default_factory=list)
    # The finished tries it holds unacknowledged (the first MAX_LIST_ITEMS): the trainer releases any
    # its log has settled, a stray result (docs/protocol.md, Stray results).
    completed_attempts: list[AttemptRef] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)


class DriverRequest(WireModel):
    """Body of `POST /driver` and `POST /driver/release`: the trainer that binds (or releases) the agent."""

    trainer_id: Identifier | None


class DriverResponse(WireModel):
    """Which trainer drives the agent now (`bound` false: none)."""

    agent_name: str
    bound: bool
    trainer_id: Identifier | None


class PhaseResponse(WireModel):
    """200 answer of prepare/commit/resume/abort."""

    phase: Phase
    status: AgentStatus
    # A prepare that carried finished, unACKed tries (PrepareRequest.carry_completed): which.
    carried: list[AttemptRef] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)


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
    execution_incarnation: Incarnation
    features: list[str]


class AttemptFault(WireModel):
    rollout_id: Identifier
    attempt_index: AttemptIndex
    drop_reply: bool = False
    fail: bool = False
    delay_s: float = Field(default=0.0, ge=0, le=3600)
    hang: bool = False
    # Hang inside this turn's model call (1-based), after the turns before it completed (and committed
    # their boundaries); `hang` hangs in the first.
    hang_at_turn: int | None = Field(default=None, ge=1, le=10_000)


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
    execution_generation: Generation
    execution_incarnation: Incarnation
