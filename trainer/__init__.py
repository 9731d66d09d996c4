"""The trainer's rollout coordinator: the hand-off protocol driven only through the event log."""

from trainer.checkpoints import CheckpointOutcome, PreparedCheckpoint
from trainer.coordinator import RolloutCoordinator
from trainer.errors import (
    AgentShared,
    AlreadyClaimed,
    CheckpointBusy,
    CheckpointDecided,
    CheckpointRefused,
    ClaimWhilePrepared,
    CoordinatorStopped,
    FencedOff,
    InvalidRow,
    NotSealed,
    RolloutError,
    UnknownCheckpoint,
    UnknownGroup,
)
from trainer.sealed import SealedGroup

__all__ = [
    "AgentShared",
    "AlreadyClaimed",
    "CheckpointBusy",
    "CheckpointDecided",
    "CheckpointOutcome",
    "CheckpointRefused",
    "ClaimWhilePrepared",
    "CoordinatorStopped",
    "FencedOff",
    "InvalidRow",
    "NotSealed",
    "PreparedCheckpoint",
    "RolloutCoordinator",
    "RolloutError",
    "SealedGroup",
    "UnknownCheckpoint",
    "UnknownGroup",
]
