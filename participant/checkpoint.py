"""The agent's half of a checkpoint: its parked continuations (never its stored replies)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from protocol.ids import AttemptIndex, Identifier
from protocol.wire import GYM_SCHEMA_VERSION, GymSchemaVersion


class ParkedContinuation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rollout_id: Identifier
    attempt_index: AttemptIndex
    capture_key: Identifier
    model_calls_done: int = Field(ge=0)


class AgentCheckpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: GymSchemaVersion = Field(default=GYM_SCHEMA_VERSION, validate_default=True)
    agent_name: Identifier
    checkpoint_id: Identifier
    execution_generation: int
    parked: list[ParkedContinuation]


def write_checkpoint(state_dir: Path, checkpoint: AgentCheckpoint) -> Path:
    """Writes `<state dir>/checkpoints/<id>.json` atomically (temporary file, fsync, rename)."""
    directory = state_dir / "checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{checkpoint.checkpoint_id}.json"
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        json.dump(checkpoint.model_dump(mode="json"), f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
