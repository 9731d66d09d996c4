"""The `/run` row an attempt sends, built from its group's payload as NeMo RL builds one."""

from __future__ import annotations

from typing import Any, Final

from pydantic import ValidationError

from projections.ledger import GroupState
from protocol.ids import rollout_id_of
from protocol.wire import RunRequest, validation_line
from trainer.errors import InvalidRow

# The attempt's identity is the log's, never the payload's.
_IDENTITY = frozenset({"_ng_rollout_id", "_ng_attempt_index", "rollout_id", "attempt_index"})


def run_request(group: GroupState, rollout_id: str, attempt_index: int) -> RunRequest:
    """The attempt's `/run` row as NeMo RL sends one (`request_row` of the group's payload)."""
    return request_row(group.payload, rollout_id, attempt_index)


def request_row(payload: dict[str, Any], rollout_id: str, attempt_index: int) -> RunRequest:
    """An attempt's `/run` row as NeMo RL sends one: its identity, `responses_create_params`, and the
    payload's other fields (a NeMo RL row's `agent_ref`, `_ng_task_index`, environment fields such as
    `expected_answer`) at the row's top level; a payload's `task` object, if it has one, is spread
    there too (its fields never override the row's own)."""
    payload = {k: v for k, v in payload.items() if k not in _IDENTITY}
    task = payload.pop("task", None)
    if isinstance(task, dict):
        payload = {k: v for k, v in task.items() if k not in _IDENTITY} | payload
    return RunRequest(
        rollout_id=rollout_id,
        attempt_index=attempt_index,
        responses_create_params=payload.pop("responses_create_params", {}),
        **payload,
    )


def check_row(payload: dict[str, Any], what: str) -> None:
    """`InvalidRow`, in one line naming `what`, when `payload` makes no row an agent takes:
    `RunRequest`'s rules (a number JSON cannot carry, nesting past the cap) and canonical JSON's
    (text no JSON can carry, such as a lone surrogate).  Asked before a group is reserved: a row
    refused later would leave its group reserved and never dispatched."""
    try:
        request_row(payload, _ANY_ATTEMPT, 0).prompt_digest()
    except ValidationError as exc:
        raise InvalidRow(f"{what}: its payload is no /run row: {validation_line(exc, 'row')}") from None
    except ValueError as exc:  # UnicodeEncodeError among them
        raise InvalidRow(f"{what}: its payload is no /run row: {exc}") from None


# An attempt's identity for `check_row`: the row's rules do not depend on it.
_ANY_ATTEMPT: Final = rollout_id_of("row", 0)
