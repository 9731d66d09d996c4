"""The history of one sibling across its tries (for `ledger show`), and one-line event summaries (`ledger tail`).

Each entry says which party the event came from and went to, on three
lanes: the trainer, the log and the Gym agent.  Trainer decisions go from
the trainer to the log; what the agent answered (a reply, a receipt, an ACK
or retire answer) goes from the agent to the log; a dispatch goes from the
trainer to the agent.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from eventstore import EventStore, RecordedEvent
from eventstore.errors import EventStoreError
from eventstore.events import (
    AckAccepted,
    AckOwed,
    AckRejected,
    AttemptAdopted,
    AttemptRetired,
    Event,
    GroupAbandoned,
    GroupClaimedForTraining,
    GroupDeadLettered,
    GroupReserved,
    GroupSealed,
    LogprobsComputed,
    LogprobsRefused,
    ReceiptFetched,
    RunDispatched,
    RunFailed,
    RunReplied,
    SiblingHeld,
    SiblingSealed,
)
from protocol.ids import group_id_of
from protocol.streams import group_stream, logprobs_stream

Lane = Literal["trainer", "log", "agent"]
LANES: Final[tuple[Lane, ...]] = ("trainer", "log", "agent")

# (from, to) per event type; anything not listed is a trainer decision recorded in the log.
_ARROWS: Final[dict[type[Event], tuple[Lane, Lane]]] = {
    RunDispatched: ("trainer", "agent"),
    AttemptAdopted: ("trainer", "agent"),
    RunReplied: ("agent", "log"),
    RunFailed: ("agent", "log"),
    ReceiptFetched: ("agent", "log"),
    AckAccepted: ("agent", "log"),
    AckRejected: ("agent", "log"),
    AttemptRetired: ("agent", "log"),
    LogprobsComputed: ("log", "log"),
    LogprobsRefused: ("log", "log"),
}
# Events of the sibling's own group that concern every sibling.
_GROUP_EVENTS: Final = (
    GroupReserved,
    GroupSealed,
    GroupAbandoned,
    GroupDeadLettered,
    GroupClaimedForTraining,
)
# Event types that may be appended outside the group's streams (by an ACK relay with its own stream).
_ELSEWHERE: Final = ("AckAccepted", "AckRejected")


@dataclass(frozen=True, slots=True)
class Entry:
    position: int
    recorded_at: float
    stream_id: str
    stream_version: int
    type: str
    attempt: int | None  # None: an event of the whole group
    source: Lane
    target: Lane
    summary: str


@dataclass(slots=True)
class Timeline:
    rollout_id: str
    group_id: str
    entries: list[Entry] = field(default_factory=list)

    def attempts(self) -> list[int]:
        return sorted({e.attempt for e in self.entries if e.attempt is not None})


def attempt_of(event: Event) -> tuple[str, int] | None:
    """The try an event is about, if it is about one."""
    receipt = getattr(event, "receipt", None)
    if isinstance(event, ReceiptFetched | AckOwed) and receipt is not None:
        return (receipt.rollout_id, receipt.attempt_index)
    rollout_id = getattr(event, "rollout_id", None)
    attempt_index = getattr(event, "attempt_index", None)
    if isinstance(rollout_id, str) and isinstance(attempt_index, int):
        return (rollout_id, attempt_index)
    return None


def describe(event: Event) -> str:
    """The key fields of an event, in one short line."""
    about = attempt_of(event)
    head = f"{about[0]}#{about[1]}" if about is not None else ""
    data = event.model_dump(mode="json")
    for noisy in ("rollout_id", "attempt_index", "receipt", "payload", "prompt_ref", "attempts", "tries"):
        data.pop(noisy, None)
    if isinstance(event, SiblingSealed | SiblingHeld):
        data["tokens"] = event.receipt.token_count
    if isinstance(event, ReceiptFetched | AckOwed):
        data["digest"] = event.receipt.result_digest[:19] + "…"
        data["generation"] = event.receipt.execution_generation
        if event.receipt.execution_incarnation is not None:
            data["incarnation"] = event.receipt.execution_incarnation[:8]
    if isinstance(event, RunReplied):
        data["reply_digest"] = event.reply_digest[:19] + "…"
    if isinstance(event, LogprobsComputed):
        data["blob_digest"] = event.blob_digest[:19] + "…"
    fields = " ".join(f"{k}={_short(v)}" for k, v in data.items() if v is not None)
    return f"{head} {fields}".strip()


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:39] + "…"


def timeline(store: EventStore, rollout_id: str) -> Timeline:
    """Every event about `rollout_id` or its whole group, in log order."""
    group_id = group_id_of(rollout_id) or rollout_id
    candidates: dict[int, RecordedEvent] = {}
    for stream in (group_stream(group_id), logprobs_stream(group_id)):
        for ev in store.read_stream(stream):
            candidates[ev.position] = ev
    if candidates:  # nothing about a group comes before its first event
        for ev in store.read_all(min(candidates) - 1, types=_ELSEWHERE):
            candidates.setdefault(ev.position, ev)
    return build_timeline(rollout_id, group_id, (candidates[p] for p in sorted(candidates)))


def build_timeline(rollout_id: str, group_id: str, events: Iterable[RecordedEvent]) -> Timeline:
    out = Timeline(rollout_id, group_id)
    for ev in events:
        try:
            decoded = ev.decode()
        except EventStoreError:
            continue  # `ledger audit` names unreadable rows; a timeline shows what can be read
        about = attempt_of(decoded)
        if about is not None and about[0] != rollout_id:
            continue
        if about is None and not (
            isinstance(decoded, _GROUP_EVENTS) and getattr(decoded, "group_id", None) == group_id
        ):
            continue
        source, target = _ARROWS.get(type(decoded), ("trainer", "log"))
        out.entries.append(
            Entry(
                position=ev.position,
                recorded_at=ev.recorded_at,
                stream_id=ev.stream_id,
                stream_version=ev.stream_version,
                type=ev.type,
                attempt=about[1] if about is not None else None,
                source=source,
                target=target,
                summary=describe(decoded),
            )
        )
    return out
