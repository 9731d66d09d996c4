"""Typed failures of calls to a Gym agent.  Every refusal the agent names has its own class."""

from __future__ import annotations

from protocol.wire import AgentStatus, AttemptRef


class GymError(Exception):
    """Base of every failure a `GymClient` call raises."""

    def __init__(self, message: str, *, status_code: int | None = None, error: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error = error


class AgentUnavailableError(GymError):
    """No answer: connection refused, timed out, or broken before a complete reply."""


class ConnectionLostError(AgentUnavailableError):
    """The connection broke mid-exchange (e.g. the drop_reply fault); the attempt may well have finished."""


class AgentTimeoutError(AgentUnavailableError):
    """The call did not finish within its client-side timeout."""


class BadResponseError(GymError):
    """A reply that is not what the contract promises (not JSON, or fails its wire model)."""


class AgentIdentityError(BadResponseError):
    """The agent answers with another name than the one the trainer drives it under: every receipt and
    ACK would be owed to the wrong agent, so it is not driven (a coordinator refuses to start)."""


class UnauthorizedError(GymError):
    """401: missing or wrong bearer token."""


class NotFoundError(GymError):
    """404: the attempt (or capture) is unknown to the agent, or not finished yet."""


class GoneError(GymError):
    """410: the attempt is ACKNOWLEDGED, CANCELLED or tombstoned; it will never run or answer again."""


class InvalidRequestError(GymError):
    """422/413/400: the agent refused the request itself (a caller bug); nothing changed."""


class AgentServerError(GymError):
    """5xx: the agent failed (or is shutting down)."""


class PhaseFenceError(GymError):
    """409 from the checkpoint phase fence; the subclass says which rule."""


class CheckpointConflictError(PhaseFenceError):
    """Another checkpoint is active, and the call does not name it."""


class InvalidPhaseError(PhaseFenceError):
    """The call is not valid in the agent's current phase (e.g. retire while committed_paused)."""


class StaleCheckpointError(PhaseFenceError):
    """The named checkpoint already finished: this caller is a stale coordinator."""


class TrainerConflictError(GymError):
    """409 trainer_conflict: the agent is driven by another trainer (one trainer per agent)."""


class NotReadyError(GymError):
    """409 not_ready from prepare: ACK or adopt `attempts`, then prepare again."""

    def __init__(self, message: str, *, status: AgentStatus, attempts: list[AttemptRef]) -> None:
        super().__init__(message, status_code=409, error="not_ready")
        self.status = status
        self.attempts = attempts


class ReceiptMismatchError(GymError):
    """A completion receipt that does not describe the reply the trainer holds."""
