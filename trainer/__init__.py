"""The trainer's rollout coordinator: the hand-off protocol driven only through the event log."""

from trainer.checkpoint import CheckpointOutcome
from trainer.coordinator import RolloutCoordinator, SealedGroup
from trainer.errors import (
    AgentMismatch,
    AlreadyClaimed,
    CoordinatorStopped,
    FencedOff,
    NotSealed,
    RolloutError,
    UnknownGroup,
)

__all__ = [
    "AgentMismatch",
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
