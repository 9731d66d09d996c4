"""OpenTelemetry spans per try, built from the log: `/run` -> receipt -> seal -> ACK.

Off by default (the optional extra `otel`).  The spans are made from the events' own timestamps
(`recorded_at`), after the fact, so tracing costs the hand-off nothing and shows what the log
recorded, crashes and restarts included.  Every try of a rollout shares one trace, whose id is derived
from the rollout id: a rollout's tries, replacements and adoptions line up in one trace view.

    from opentelemetry import trace
    emit_try_spans(store.read_all(0), trace.get_tracer("rollout-ledger"))

Per try: a `try` span (attributes `ledger.rollout_id`, `ledger.attempt_index`, `ledger.group_id`,
`ledger.agent`, `ledger.outcome`) with children `run` (dispatch to reply or failure), `receipt`
(reply to the fetched receipt), `seal` (receipt to the seal or hold) and `ack` (debt to its payment);
retires and adoptions are span events.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from eventstore import RecordedEvent
from protocol.ids import group_id_of


@dataclass
class TryTimeline:
    rollout_id: str
    attempt_index: int
    agent: str = ""
    # event type -> (recorded_at, data) of its first occurrence for this try
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


def fold_tries(events: Iterable[RecordedEvent]) -> dict[tuple[str, int], TryTimeline]:
    """Each try's marks, in log order (a pure fold)."""
    tries: dict[tuple[str, int], TryTimeline] = {}
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
        timeline = tries.setdefault(key, TryTimeline(*key))
        timeline.marks.setdefault(kind, (event.recorded_at, data))
        if kind == "RunDispatched":
            timeline.agent = data.get("agent_name", "")
    return tries


def trace_id_of(rollout_id: str) -> int:
    """A rollout's trace id: 128 bits of the SHA-256 of its id (never 0)."""
    return int(hashlib.sha256(rollout_id.encode()).hexdigest()[:32], 16) or 1


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def emit_try_spans(events: Iterable[RecordedEvent], tracer: Any) -> int:
    """Emits the spans of every try the events mention; returns how many tries were traced."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags

    count = 0
    for timeline in fold_tries(events).values():
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
            "try",
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
            span = tracer.start_span(name, context=inside, start_time=_ns(begin))
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
