"""What an agent's answer other than 200 means: the typed `GymError` of its status and `error` code.

One place maps the contract's refusals (docs/protocol.md, Errors) to exceptions, so every call of the
client raises the same class for the same answer.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from pydantic import ValidationError

from protocol.errors import (
    CHECKPOINT_CONFLICT,
    GONE,
    INVALID_PHASE,
    NOT_READY,
    STALE_CHECKPOINT,
    TRAINER_CONFLICT,
)
from protocol.wire import NotReadyResponse, validation_line
from trainer.gym.errors import (
    AgentServerError,
    BadResponseError,
    CheckpointConflictError,
    GoneError,
    GymError,
    InvalidPhaseError,
    InvalidRequestError,
    NotFoundError,
    NotReadyError,
    StaleCheckpointError,
    TrainerConflictError,
    UnauthorizedError,
)
from trainer.gym.http_types import Reply

_FENCE_ERRORS: dict[str, type[GymError]] = {
    CHECKPOINT_CONFLICT: CheckpointConflictError,
    INVALID_PHASE: InvalidPhaseError,
    STALE_CHECKPOINT: StaleCheckpointError,
}


def raise_refused(what: str, reply: Reply) -> NoReturn:
    """Raises the typed error of a reply whose status is not 200 (`what`: the call, for the message);
    a body that is not JSON is a `BadResponseError`."""
    try:
        payload = json.loads(reply.body)
    except ValueError:
        raise BadResponseError(
            f"{what}: HTTP {reply.status} with a body that is not JSON: {bytes(reply.body[:200])!r}",
            status_code=reply.status,
        ) from None
    raise_refusal(what, reply.status, payload)


def raise_refusal(what: str, code: int, payload: Any) -> NoReturn:
    error = payload.get("error") if isinstance(payload, dict) else None
    message = payload.get("message") if isinstance(payload, dict) else None
    text = f"{what}: HTTP {code} {error or ''}: {message or payload!r}"
    if code == 409 and error == NOT_READY:
        try:
            nr = NotReadyResponse.model_validate(payload)
        except ValidationError as exc:
            raise BadResponseError(
                f"{what}: malformed not_ready answer: {validation_line(exc, 'answer')}", status_code=code
            ) from None
        raise NotReadyError(text, status=nr.status, attempts=nr.completed_unacknowledged_attempts)
    if code == 409 and error in _FENCE_ERRORS:
        raise _FENCE_ERRORS[error](str(message), status_code=code, error=error)
    if code == 409 and error == TRAINER_CONFLICT:
        raise TrainerConflictError(str(message), status_code=code, error=error)
    cls: type[GymError]
    if code == 401:
        cls = UnauthorizedError
    elif code == 404:
        cls = NotFoundError
    elif code == 410 and error == GONE:
        cls = GoneError
    elif code in (400, 413, 422):
        cls = InvalidRequestError
    elif code >= 500:
        cls = AgentServerError
    else:
        cls = BadResponseError
    raise cls(text, status_code=code, error=error)
