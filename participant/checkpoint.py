"""The agent's half of a checkpoint: its parked continuations (never its stored replies)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from participant.durable import replace_file
from participant.records import FileDamaged, read_document, seal_json
from protocol.ids import AttemptIndex, Identifier
from protocol.wire import GYM_SCHEMA_VERSION, GymSchemaVersion


class ActivePrefix(BaseModel):
    """A model call cut at a token boundary (a generation-safe cut): the tokens it had generated
    when its try parked, kept in the checkpoint's artefact; the call goes on from them after the
    resume, so nothing it generated is thrown away or generated twice."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_call_id: str = Field(min_length=1, max_length=256)
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    # Model-call seconds the call had spent when it was cut.
    model_s: float = Field(ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _aligned(self) -> ActivePrefix:
        if len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError("a prefix has one log probability per token")
        return self


class ParkedContinuation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollout_id: Identifier
    attempt_index: AttemptIndex
    capture_key: Identifier
    model_calls_done: int = Field(ge=0)
    # Parked inside a model call, at a cut: the call's durable prefix (None: at a boundary).
    active_prefix: ActivePrefix | None = None


class AgentCheckpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: GymSchemaVersion = Field(default=GYM_SCHEMA_VERSION, validate_default=True)
    agent_name: Identifier
    checkpoint_id: Identifier
    execution_generation: int
    parked: list[ParkedContinuation]


def checkpoint_path(state_dir: Path, checkpoint_id: str) -> Path:
    return state_dir / "checkpoints" / f"{checkpoint_id}.json"


def write_checkpoint(state_dir: Path, checkpoint: AgentCheckpoint) -> Path:
    """Writes `<state dir>/checkpoints/<id>.json` atomically (`participant.durable.replace_file`), one
    checksummed record (`participant.records`)."""
    path = checkpoint_path(state_dir, checkpoint.checkpoint_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, seal_json(checkpoint.model_dump_json()))
    return path


def read_checkpoint(path: Path) -> AgentCheckpoint:
    """The artefact at `path`, checked; FileDamaged when it is not whole (an artefact written before
    artefacts carried a checksum is read as it was, its JSON alone checked)."""
    record, _ = read_document(path, path.read_bytes())
    try:
        return AgentCheckpoint.model_validate_json(record)
    except ValidationError as exc:
        raise FileDamaged(path, 0, f"not a checkpoint artefact ({exc.errors()[0]['msg']})") from None
