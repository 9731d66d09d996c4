"""Validates token records with the real Gym's own models (runs in the nemo-gym 3.12 env).

Every record is checked twice: with the real `TokenEntry` when this nemo-gym has it
(`nemo_gym.token_id_capture.records`, newer than 0.4.0), and always by putting its token arrays back
on the output item `token_item_index` names and validating that item with nemo-gym's own training
item models (`...ForTraining`, which carry `routed_experts`), after checking `token_item_index` points
into the record's own `output_items`.  Prints one JSON line: {"checked": N, "entry_model": bool,
"errors": [...]}; exits 1 on any error.

    python check_tokens.py RECORDS_JSON
"""

from __future__ import annotations

import json
import sys
from typing import Any

from nemo_gym.openai_utils import (
    NeMoGymResponseFunctionToolCallForTraining,
    NeMoGymResponseOutputMessageForTraining,
    NeMoGymResponseReasoningItemForTraining,
)
from pydantic import TypeAdapter, ValidationError

TRAINING_ITEMS: dict[str, Any] = {
    "message": NeMoGymResponseOutputMessageForTraining,
    "function_call": NeMoGymResponseFunctionToolCallForTraining,
    "reasoning": NeMoGymResponseReasoningItemForTraining,
}
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")

try:
    from nemo_gym.token_id_capture.records import TokenEntry as RealTokenEntry  # newer nemo-gym
except ImportError:
    RealTokenEntry = None


def check(record: dict[str, Any]) -> str | None:
    if RealTokenEntry is not None:
        try:
            RealTokenEntry.model_validate(record)
        except ValidationError as exc:
            return f"TokenEntry: {exc}"
    if record.get("schema_version", 1) > 1:
        return "schema_version above 1"
    items = record.get("output_items") or []
    index = record.get("token_item_index")
    if index is None:
        return "no token_item_index"
    if not 0 <= index < len(items):
        return f"token_item_index {index} outside output_items of length {len(items)}"
    if any(name in item for item in items for name in TOKEN_FIELDS):
        return "token arrays left on an output item"
    carrier = dict(items[index]) | {
        name: record.get(name) for name in TOKEN_FIELDS if record.get(name) is not None
    }
    model = TRAINING_ITEMS.get(carrier.get("type", ""))
    if model is None:
        return f"carrier item of type {carrier.get('type')!r} is no training item"
    try:
        TypeAdapter(model).validate_python(carrier)
    except ValidationError as exc:
        return f"{model.__name__}: {exc}"
    return None


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        records = json.load(f)
    errors = [f"{r.get('rollout_id')}/{r.get('model_call_id')}: {e}" for r in records if (e := check(r))]
    print(
        json.dumps(
            {"checked": len(records), "entry_model": RealTokenEntry is not None, "errors": errors[:20]}
        )
    )
    sys.exit(1 if errors else 0)
