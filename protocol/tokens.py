"""Token records read off a `/run` reply, for agents that do not capture them call by call.

A Gym model server that returns token ids puts them on one output item per model call (the real
Gym's `...ForTraining` items: `prompt_token_ids`, `generation_token_ids`, `generation_log_probs`, and
for MoE backends `routed_experts`).  The agent's reply concatenates every call's output items with the
tool outputs between them, so the reply alone tells the model calls apart: a call's items run from
after the previous token-carrying item to its own token-carrying item, tool outputs (the next call's
input, not a model's output) left out.  The participant library (wrapping a plain Gym agent) and the
trainer's reduced mode both build the records here, in the real Gym's `TokenEntry` shape.
"""

from __future__ import annotations

from typing import Any, Final

from protocol.lineage import link_call
from protocol.wire import TOKEN_SCHEMA_VERSION, RunReply, TokenEntry

TOKEN_FIELDS: Final = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")
_REQUIRED: Final = TOKEN_FIELDS[:3]
# Output items the environment adds between model calls (tool results), never a model's output.
ENVIRONMENT_ITEM_TYPES: Final = frozenset({"function_call_output"})


class TokenRecordError(ValueError):
    """The reply carries token metadata that cannot make a record (part of the arrays missing)."""


def _carries_tokens(item: dict[str, Any]) -> bool:
    return any(item.get(name) is not None for name in _REQUIRED)


def model_call_id(index: int) -> str:
    """The id of the reply's `index`-th model call (0-based): `call-1`, `call-2`, ..."""
    return f"call-{index + 1}"


def request_input(responses_create_params: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a `/run`'s first model call is sent: its `input` items (a text input is one
    user message, as a Gym agent sends it)."""
    given = responses_create_params.get("input")
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    return [item for item in given if isinstance(item, dict)] if isinstance(given, list) else []


def with_token_arrays(output: list[Any], records: list[TokenEntry]) -> list[Any]:
    """A reply's `output` as a real Gym agent answers it: each record's arrays on the output item that
    carried them (`token_item_index` of its `output_items`, found by `id`), the inverse of
    `token_records_from_reply`.  New items where arrays are put; `output` and its items unchanged."""
    at = {item.get("id"): i for i, item in enumerate(output) if isinstance(item, dict)}
    out = list(output)
    for record in records:
        index = record.token_item_index or 0
        if not 0 <= index < len(record.output_items):
            continue  # a record that names no item of its own (nothing to put its arrays on)
        i = at.get(record.output_items[index].get("id"))
        if i is None:
            continue
        arrays = {name: getattr(record, name) for name in TOKEN_FIELDS if getattr(record, name) is not None}
        out[i] = {**out[i], **arrays}
    return out


def token_records_from_reply(reply: RunReply, capture_key: str, created_at: float) -> list[TokenEntry]:
    """One record per model call that carried token ids, in call order, with its lineage
    (`protocol.lineage.link_call`); [] when none did.  Each call was sent the reply's input and every
    output item before its own; the last call, when nothing a model wrote follows it, is the one the
    reply's `response.id` names.

    Raises `TokenRecordError` for an item with only part of the arrays, and pydantic's
    ValidationError for arrays that break `TokenEntry`'s rules (lengths that differ)."""
    output = reply.response.get("output")
    if not isinstance(output, list):
        return []
    conversation = request_input(reply.responses_create_params)
    records: list[TokenEntry] = []
    pending: list[dict[str, Any]] = []
    request: list[dict[str, Any]] = []
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") in ENVIRONMENT_ITEM_TYPES:
            conversation.append(item)
            continue
        if not pending:
            request = list(conversation)  # the call's own items start here
        conversation.append(item)
        if not _carries_tokens(item):
            pending.append(item)
            continue
        missing = [name for name in _REQUIRED if item.get(name) is None]
        if missing:
            raise TokenRecordError(f"output item {item.get('id')!r} lacks {', '.join(missing)}")
        stripped = {k: v for k, v in item.items() if k not in TOKEN_FIELDS}
        record = TokenEntry(
            schema_version=TOKEN_SCHEMA_VERSION,
            rollout_id=capture_key,
            model_call_id=model_call_id(len(records)),
            model=str(reply.response.get("model") or ""),
            prompt_token_ids=item["prompt_token_ids"],
            generation_token_ids=item["generation_token_ids"],
            generation_log_probs=item["generation_log_probs"],
            routed_experts=item.get("routed_experts"),
            output_items=[*pending, stripped],
            token_item_index=len(pending),
            response_id=None,
            created_at=created_at,
        )
        records.append(link_call(record, request, records))
        pending = []
    response_id = reply.response.get("id")
    if records and not pending and isinstance(response_id, str) and response_id:
        records[-1] = records[-1].model_copy(update={"response_id": response_id})
    return records
