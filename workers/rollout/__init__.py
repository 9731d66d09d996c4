"""The trainer's rollout coordinator: the hand-off protocol driven only through the event log."""

from workers.rollout.checkpoint import CheckpointOutcome
from workers.rollout.coordinator import RolloutCoordinator, SealedGroup
from workers.rollout.errors import (
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
