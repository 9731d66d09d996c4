"""The trainer's side of the Gym agent HTTP contract (docs/protocol.md, The HTTP contract)."""

from trainer.gym.client import GymClient
from trainer.gym.completed import Completed, verify_receipt
from trainer.gym.errors import (
    AgentIdentityError,
    AgentServerError,
    AgentTimeoutError,
    AgentUnavailableError,
    BadResponseError,
    CheckpointConflictError,
    ConnectionLostError,
    GoneError,
    GymError,
    InvalidPhaseError,
    InvalidRequestError,
    NotFoundError,
    NotReadyError,
    PhaseFenceError,
    ReceiptMismatchError,
    StaleCheckpointError,
    TrainerConflictError,
    UnauthorizedError,
)

__all__ = [
    "AgentIdentityError",
    "AgentServerError",
    "AgentTimeoutError",
    "AgentUnavailableError",
    "BadResponseError",
    "CheckpointConflictError",
    "Completed",
    "ConnectionLostError",
    "GoneError",
    "GymClient",
    "GymError",
    "InvalidPhaseError",
    "InvalidRequestError",
    "NotFoundError",
    "NotReadyError",
    "PhaseFenceError",
    "ReceiptMismatchError",
    "StaleCheckpointError",
    "TrainerConflictError",
    "UnauthorizedError",
    "verify_receipt",
]
