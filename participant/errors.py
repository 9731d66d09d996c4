"""Refusals the participant answers with a JSON body `{"error": <name>, "message": ...}`."""

from __future__ import annotations

from collections.abc import Iterable

from protocol.errors import (
    CHECKPOINT_CONFLICT,
    CHECKPOINT_WRITE_FAILED,
    EXECUTION_FAILED,
    GONE,
    INTERNAL_ERROR,
    INVALID_PHASE,
    INVALID_REQUEST,
    NOT_FOUND,
    NOT_READY,
    SHUTTING_DOWN,
    STALE_CHECKPOINT,
)
from protocol.wire import AgentStatus, AttemptRef, ErrorResponse, NotReadyResponse


class AgentError(Exception):
    status_code = 500
    error = INTERNAL_ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, object]:
        return ErrorResponse(error=self.error, message=self.message).model_dump(mode="json")


class GoneError(AgentError):
    status_code = 410
    error = GONE


class NotFoundError(AgentError):
    status_code = 404
    error = NOT_FOUND


class InvalidRequestError(AgentError):
    status_code = 422
    error = INVALID_REQUEST


class ExecutionFailedError(AgentError):
    status_code = 500
    error = EXECUTION_FAILED


class CheckpointWriteError(AgentError):
    """The checkpoint artefact could not be written (its directory cannot be made, the disk is full):
    nothing was published and the phase stays `prepared`, so commit can be retried or aborted."""

    status_code = 500
    error = CHECKPOINT_WRITE_FAILED


class ShuttingDownError(AgentError):
    status_code = 503
    error = SHUTTING_DOWN


class CheckpointConflictError(AgentError):
    status_code = 409
    error = CHECKPOINT_CONFLICT

    def __init__(self, active: str, phase: str, target: str) -> None:
        super().__init__(
            f"checkpoint '{active}' is active in phase '{phase}'; refusing operation for '{target}'"
        )


class InvalidPhaseError(AgentError):
    status_code = 409
    error = INVALID_PHASE

    def __init__(self, phase: str, valid_from: Iterable[str]) -> None:
        super().__init__(f"operation not valid in phase '{phase}' (valid from: {sorted(valid_from)!r})")


class StaleCheckpointError(AgentError):
    status_code = 409
    error = STALE_CHECKPOINT

    @classmethod
    def finished(cls, checkpoint_id: str, outcome: str) -> StaleCheckpointError:
        return cls(
            f"checkpoint '{checkpoint_id}' already finished with outcome '{outcome}'; "
            "this call is from a stale coordinator"
        )

    @classmethod
    def unknown(cls, checkpoint_id: str) -> StaleCheckpointError:
        return cls(
            f"checkpoint '{checkpoint_id}' is not active and unknown to this agent (phase 'idle'); "
            "this call is from a stale coordinator"
        )


class NotReadyError(AgentError):
    status_code = 409
    error = NOT_READY

    def __init__(self, status: AgentStatus, attempts: list[AttemptRef]) -> None:
        super().__init__("agent is not ready to commit")
        self.response = NotReadyResponse(status=status, completed_unacknowledged_attempts=attempts)

    def body(self) -> dict[str, object]:
        return self.response.model_dump(mode="json")


class RunnerFailed(RuntimeError):
    """The runner answered no reply (its agent raised, answered an error, or a body that is no
    reply): the try failed as its agent said, logged as one line, not as a bug of ours."""
