"""Upcasters: old payload versions are upgraded when read; stored rows are never rewritten.

An upcaster takes the payload of `(type, version)` and returns the payload of
`version + 1`.  Reading applies them in a chain up to the model's version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eventstore.errors import UnknownSchemaVersion

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    def register(fn: Upcaster) -> Upcaster:
        UPCASTERS[(event_type, from_version)] = fn
        return fn

    return register


def upcast(event_type: str, version: int, target: int, data: dict[str, Any]) -> dict[str, Any]:
    while version < target:
        step = UPCASTERS.get((event_type, version))
        if step is None:
            raise UnknownSchemaVersion(f"no upcaster for {event_type} v{version} -> v{version + 1}")
        data = step(data)
        version += 1
    return data


_KIND_BY_PREFIX = (
    ("deadline", "deadline"),
    ("stream", "stream_closed"),
    ("receipt", "receipt"),
    ("verify", "verify"),
    ("digest", "verify"),
    ("http", "http"),
    ("connect", "http"),
    ("env", "env"),
    ("mask", "env"),
)


@upcaster("RunFailed", 1)
def _run_failed_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 carried only a free-text reason; v2 classifies it so retries can be counted by kind."""
    reason = str(data.get("reason", "")).lower()
    kind = next((k for prefix, k in _KIND_BY_PREFIX if reason.startswith(prefix)), "unknown")
    return {**data, "kind": kind}


@upcaster("GroupDeadLettered", 1)
def _group_dead_lettered_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 named the group's attempts `tries`."""
    rest = {k: v for k, v in data.items() if k != "tries"}
    return {**rest, "attempts": data.get("tries", [])}


@upcaster("RunDispatched", 1)
def _run_dispatched_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 recorded neither the try's prompt digest nor a continuation to resume."""
    return {**data, "prompt_digest": None, "continue_from": None}


@upcaster("RunReplied", 1)
def _run_replied_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 did not keep the reply's failure_kind."""
    return {**data, "failure_kind": None}


@upcaster("AckRejected", 1)
def _ack_rejected_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 did not record the agent's generation (its unknown_execution dropped the debt unchecked)."""
    return {**data, "agent_generation": None}


@upcaster("AckRejected", 2)
def _ack_rejected_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 had no operator drops: no operator's mark."""
    return {**data, "operator": None}


@upcaster("AttemptRetired", 1)
def _attempt_retired_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 recorded neither why a checkpoint retired the try nor what the cancelled execution had done."""
    return {**data, "cause": None, "work": None}


@upcaster("AckRejected", 3)
def _ack_rejected_v3(data: dict[str, Any]) -> dict[str, Any]:
    """v3 did not record the agent's incarnation: the row keeps its generation rule."""
    return {**data, "agent_incarnation": None}


@upcaster("RetirePaid", 1)
def _retire_paid_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 had no operator drops: no operator's mark."""
    return {**data, "operator": None}


@upcaster("AttemptRetired", 2)
def _attempt_retired_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 recorded no continuation offered with the retire."""
    return {**data, "continuation": None}


@upcaster("ReplacementMinted", 1)
def _replacement_minted_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 replacements all played from their prompt."""
    return {**data, "continues": None}


@upcaster("GroupClaimedForTraining", 1)
def _group_claimed_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 did not name the call that delivered the group."""
    return {**data, "call_id": None}


@upcaster("GroupClaimedForTraining", 2)
def _group_claimed_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 always named a step; v3 only allows None as well."""
    return dict(data)


@upcaster("TrainerRestored", 1)
def _trainer_restored_v1(data: dict[str, Any]) -> dict[str, Any]:
    """Every v1 restore rolled back the claims after its cut."""
    return {**data, "claims_kept": False}


@upcaster("CheckpointCommitted", 1)
def _checkpoint_committed_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 did not name its trainer: read as the unnamed trainer's."""
    return {**data, "trainer_id": None}


@upcaster("CheckpointCommitted", 2)
def _checkpoint_committed_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 commits carried no finished try across their checkpoint."""
    return {**data, "carried": {}}


@upcaster("GroupReserved", 1)
def _group_reserved_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 had one budget, `max_tries`: both failure budgets equal it (so it binds first, as before)."""
    tries = data.get("max_tries", 4)
    return {**data, "max_infra_failures": tries, "max_data_failures": tries}


@upcaster("GroupReserved", 2)
def _group_reserved_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 recorded one target level (never lowered, never read): the one asked for is the same."""
    return {**data, "requested_level": data.get("target_level", "sibling")}


@upcaster("RunReplied", 2)
def _run_replied_v2(data: dict[str, Any]) -> dict[str, Any]:
    """v2 named its reply by digest only (stored in the log's blob table): no claim."""
    return {**data, "reply": None}


@upcaster("RunReplied", 3)
def _run_replied_v3(data: dict[str, Any]) -> dict[str, Any]:
    """v3 stored every reply whole (its claim of `reply_digest`): the same fields, read as they are."""
    return data


def _receipt_without_claim(data: dict[str, Any]) -> dict[str, Any]:
    """v1 receipts named their token records by digest only (the log's blob table): no claim.  A row
    without a receipt object is left as it is, for its model to refuse by name."""
    receipt = data.get("receipt")
    if not isinstance(receipt, dict):
        return data
    return {**data, "receipt": {**receipt, "tokens": None}}


upcaster("SiblingHeld", 1)(_receipt_without_claim)
upcaster("SiblingSealed", 1)(_receipt_without_claim)


@upcaster("LogprobsComputed", 1)
def _logprobs_computed_v1(data: dict[str, Any]) -> dict[str, Any]:
    """v1 named its array by digest only (the log's blob table): no claim."""
    return {**data, "logprobs": None}
