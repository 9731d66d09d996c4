"""The trainer's rollout coordinator: the hand-off protocol driven only through the event log."""

from trainer.checkpoint import CheckpointOutcome
from trainer.coordinator import RolloutCoordinator, SealedGroup
from trainer.errors import (
    AlreadyClaimed,
    CoordinatorStopped,
    FencedOff,
    NotSealed,
    RolloutError,
    UnknownGroup,
)

__all__ = [
    "AlreadyClaimed",
    "CheckpointOutcome",
    "CoordinatorStopped",
    "FencedOff",
    "NotSealed",
    "RolloutCoordinator",
    "RolloutError",
    "SealedGroup",
    "UnknownGroup",
]
