"""OpenTelemetry spans per attempt, built from the log: `/run` -> receipt -> seal -> ACK.

Off by default (the optional extra `otel`).  The spans are made from the events' own timestamps
(`recorded_at`), after the fact, so tracing costs the hand-off nothing and shows what the log
recorded, crashes and restarts included.  Every attempt of a rollout shares one trace, whose id is derived
from the rollout id: a rollout's attempts, replacements and adoptions line up in one trace view.

    from opentelemetry import trace
    emit_try_spans(store.read_all(0), trace.get_tracer("rollout-ledger"))

Per attempt: a `attempt` span (attributes `ledger.rollout_id`, `ledger.attempt_index`, `ledger.group_id`,
`ledger.agent`, `ledger.outcome`) with children `run` (dispatch to reply or failure), `receipt`
(reply to the fetched receipt), `seal` (receipt to the seal or hold) and `ack` (debt to its payment);
retires and adoptions are span events.  Each child carries the attempt's id and agent and what its step
recorded (`SEGMENT_ATTRIBUTES`); the provider's resource names the service (`tracer_resource`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from eventstore import RecordedEvent
from protocol.ids import group_id_of


@dataclass
class AttemptTimeline:
    rollout_id: str
    attempt_index: int
    agent: str = ""
    # event type -> (recorded_at, data) of its first occurrence for this attempt
    marks: dict[str, tuple[float, dict[str, Any]]] = field(default_factory=dict)

    def at(self, *types: str) -> float | None:
        found = [self.marks[t][0] for t in types if t in self.marks]
        return min(found) if found else None

    @property
    def outcome(self) -> str:
        for kind, name in (
            ("SiblingSealed", "sealed"),
            ("SiblingHeld", "held"),
            ("AttemptRetired", "retired"),
            ("RunFailed", "failed"),
            ("RunReplied", "replied"),
        ):
            if kind in self.marks:
                if kind == "AttemptRetired":
                    return f"retired:{self.marks[kind][1].get('outcome')}"
                return name
        return "in_flight"


_TRY_EVENTS = frozenset(
    {
        "RunDispatched",
        "RunReplied",
        "RunFailed",
        "SiblingHeld",
        "SiblingSealed",
        "AttemptRetired",
        "AttemptAdopted",
        "AckAccepted",
        "AckRejected",
    }
)


def fold_attempts(events: Iterable[RecordedEvent]) -> dict[tuple[str, int], AttemptTimeline]:
    """Each attempt's marks, in log order (a pure fold)."""
    attempts: dict[tuple[str, int], AttemptTimeline] = {}
    for event in events:
        kind = event.type
        if kind in _TRY_EVENTS:
            data = event.data
            key = (data["rollout_id"], data["attempt_index"])
        elif kind in ("ReceiptFetched", "AckOwed"):
            data = event.data
            receipt = data["receipt"]
            key = (receipt["rollout_id"], receipt["attempt_index"])
        else:
            continue
        timeline = attempts.setdefault(key, AttemptTimeline(*key))
        timeline.marks.setdefault(kind, (event.recorded_at, data))
        if kind == "RunDispatched":
            timeline.agent = data.get("agent_name", "")
    return attempts


SERVICE_NAME: Final = "rollout-ledger"


def tracer_resource(run_id: str | None = None) -> Any:
    """The resource of a tracer provider for the ledger's spans: `service.name` (unless
    $OTEL_SERVICE_NAME names another), the trainer's run id when there is one."""
    from opentelemetry.sdk.resources import Resource

    attributes: dict[str, str] = {}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = SERVICE_NAME
    if run_id:
        attributes["ledger.run_id"] = run_id
    return Resource.create(attributes)


Marks = dict[str, tuple[float, dict[str, Any]]]


def _data(marks: Marks, kind: str) -> dict[str, Any]:
    return marks[kind][1] if kind in marks else {}


def _run_attributes(marks: Marks) -> dict[str, Any]:
    replied, failed = _data(marks, "RunReplied"), _data(marks, "RunFailed")
    dispatched = _data(marks, "RunDispatched")
    found: dict[str, Any] = {"ledger.capture_key": dispatched.get("capture_key")}
    if dispatched.get("deadline_s") is not None:
        found["ledger.deadline_s"] = dispatched["deadline_s"]
    if replied:
        found |= {"ledger.reward": replied.get("reward"), "ledger.mask_sample": replied.get("mask_sample")}
    if failed:
        found |= {"ledger.failure_kind": failed.get("kind"), "ledger.failure_reason": failed.get("reason")}
    return found


def _receipt_attributes(marks: Marks) -> dict[str, Any]:
    receipt = _data(marks, "ReceiptFetched").get("receipt", {})
    return {
        "ledger.execution_generation": receipt.get("execution_generation"),
        "ledger.result_digest": receipt.get("result_digest"),
    }


def _seal_attributes(marks: Marks) -> dict[str, Any]:
    step = "sealed" if "SiblingSealed" in marks else "held" if "SiblingHeld" in marks else None
    receipt = _data(marks, "SiblingSealed" if step == "sealed" else "SiblingHeld").get("receipt", {})
    return {
        "ledger.seal": step,
        "ledger.token_count": receipt.get("token_count"),
        "ledger.tokens_digest": receipt.get("tokens_digest"),
        "ledger.reward": _data(marks, "SiblingSealed").get("reward"),
    }


def _ack_attributes(marks: Marks) -> dict[str, Any]:
    if "AckAccepted" in marks:
        return {
            "ledger.ack": "accepted",
            "ledger.ack_idempotent": _data(marks, "AckAccepted").get("idempotent"),
        }
    if "AckRejected" in marks:
        return {"ledger.ack": "rejected", "ledger.ack_error": _data(marks, "AckRejected").get("error")}
    return {"ledger.ack": "owed"}


# What each child span says beyond the attempt's id and agent, from the events of its step.
SEGMENT_ATTRIBUTES: Final[dict[str, Callable[[Marks], dict[str, Any]]]] = {
    "run": _run_attributes,
    "receipt": _receipt_attributes,
    "seal": _seal_attributes,
    "ack": _ack_attributes,
}


def trace_id_of(rollout_id: str) -> int:
    """A rollout's trace id: 128 bits of the SHA-256 of its id (never 0)."""
    return int(hashlib.sha256(rollout_id.encode()).hexdigest()[:32], 16) or 1


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def emit_try_spans(events: Iterable[RecordedEvent], tracer: Any) -> int:
    """Emits the spans of every try the events mention; returns how many attempts were traced."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

    count = 0
    for timeline in fold_attempts(events).values():
        start = timeline.at(*timeline.marks)
        if start is None:
            continue
        end = max(t for t, _ in timeline.marks.values())
        rid = timeline.rollout_id
        parent = trace.set_span_in_context(
            NonRecordingSpan(
                SpanContext(
                    trace_id=trace_id_of(rid),
                    span_id=(trace_id_of(f"{rid}#root") & ((1 << 64) - 1)) or 1,
                    is_remote=True,
                    trace_flags=TraceFlags(TraceFlags.SAMPLED),
                )
            )
        )
        root = tracer.start_span(
            "attempt",
            context=parent,
            start_time=_ns(start),
            attributes={
                "ledger.rollout_id": rid,
                "ledger.attempt_index": timeline.attempt_index,
                "ledger.group_id": group_id_of(rid),
                "ledger.agent": timeline.agent,
                "ledger.outcome": timeline.outcome,
            },
        )
        inside = trace.set_span_in_context(root)
        segments = (
            ("run", ("RunDispatched",), ("RunReplied", "RunFailed")),
            ("receipt", ("RunReplied",), ("ReceiptFetched",)),
            ("seal", ("ReceiptFetched",), ("SiblingSealed", "SiblingHeld")),
            ("ack", ("AckOwed",), ("AckAccepted", "AckRejected")),
        )
        for name, begins, ends in segments:
            begin, finish = timeline.at(*begins), timeline.at(*ends)
            if begin is None:
                continue
            attributes = {
                "ledger.rollout_id": rid,
                "ledger.attempt_index": timeline.attempt_index,
                "ledger.agent": timeline.agent,
                **SEGMENT_ATTRIBUTES[name](timeline.marks),
            }
            span = tracer.start_span(
                name,
                context=inside,
                start_time=_ns(begin),
                # OpenTelemetry takes no None: a field the step did not record is left out.
                attributes={k: v for k, v in attributes.items() if v is not None},
            )
            if name == "run" and "RunFailed" in timeline.marks:
                span.set_status(
                    Status(StatusCode.ERROR, str(timeline.marks["RunFailed"][1].get("reason", "")))
                )
            if name == "ack" and "AckRejected" in timeline.marks:
                span.set_status(
                    Status(StatusCode.ERROR, str(timeline.marks["AckRejected"][1].get("error", "")))
                )
            span.end(end_time=_ns(finish if finish is not None else begin))
        for kind in ("AttemptRetired", "AttemptAdopted"):
            if kind in timeline.marks:
                at, data = timeline.marks[kind]
                root.add_event(kind, attributes={"outcome": str(data.get("outcome", ""))}, timestamp=_ns(at))
        root.end(end_time=_ns(end))
        count += 1
    return count
