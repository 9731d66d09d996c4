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
    ContinuationDeclined,
    ContinuationResumed,
    Event,
    GroupAbandoned,
    GroupClaimedForTraining,
    GroupDeadLettered,
    GroupReserved,
    GroupSealed,
    LogprobsComputed,
    LogprobsRefused,
    ReceiptFetched,
    ReplacementMinted,
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
    ContinuationResumed: ("agent", "log"),
    ContinuationDeclined: ("agent", "log"),
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


@dataclass(frozen=True, slots=True)
class Carry:
    """Turns a try carried on from an earlier one instead of generating them again (its
    `ContinuationResumed`), and where the log recorded the boundary it resumed (the source try's offer
    with its `AttemptRetired`, if the timeline holds it)."""

    attempt: int
    source_attempt: int
    turn: int
    lineage: str
    reused_model_calls: int
    reused_tokens: int
    restored: tuple[str, ...]  # "name@revision"
    position: int
    offered_at: int | None

    def text(self) -> str:
        restored = f"; restored {', '.join(self.restored)}" if self.restored else ""
        return (
            f"try #{self.attempt} carries turns 1..{self.turn} of try #{self.source_attempt} "
            f"({self.reused_model_calls} model calls, {self.reused_tokens} generated tokens reused{restored})"
        )


@dataclass(slots=True)
class Timeline:
    rollout_id: str
    group_id: str
    entries: list[Entry] = field(default_factory=list)
    carried: list[Carry] = field(default_factory=list)
    # try -> (turn, position) of the boundary its agent offered when it was retired
    offered: dict[int, tuple[int, int]] = field(default_factory=dict)
    # try -> (reason, position) of a resume its agent declined (it played from its prompt)
    declined: dict[int, tuple[str, int]] = field(default_factory=dict)

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
    if isinstance(event, AttemptRetired) and event.continuation is not None:
        data["continuation"] = f"offers turn {event.continuation.turn}"
    if isinstance(event, ReplacementMinted) and event.continues is not None:
        data["continues"] = f"#{event.continues.source_attempt} at turn {event.continues.turn}"
    if isinstance(event, RunDispatched):
        for name in ("prompt_digest", "continue_from"):
            if data.get(name):
                data[name] = str(data[name])[:19] + "…"
    if isinstance(event, ContinuationResumed | ContinuationDeclined):
        r = event.resume
        data = {"continuation": r.continuation[:19] + "…"}
        if r.outcome == "resumed":
            data |= {
                "from": f"#{r.source_attempt} at turn {r.turn}",
                "reused_calls": len(r.reused_model_calls),
                "reused_tokens": r.reused_tokens,
            }
            if r.restored:
                data["restored"] = ",".join(f"{x.name}@{x.revision}" for x in r.restored)
        else:
            data["reason"] = r.reason
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
        if about is not None:
            _turns(out, ev.position, about[1], decoded)
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


def _turns(out: Timeline, position: int, attempt: int, event: Event) -> None:
    """What the event says of turns carried across tries."""
    if isinstance(event, AttemptRetired) and event.continuation is not None:
        out.offered[attempt] = (event.continuation.turn, position)
    elif isinstance(event, ContinuationDeclined) and event.resume.reason is not None:
        out.declined[attempt] = (event.resume.reason, position)
    elif isinstance(event, ContinuationResumed):
        r = event.resume
        source = r.source_attempt if r.source_attempt is not None else attempt
        offer = out.offered.get(source)
        out.carried.append(
            Carry(
                attempt=attempt,
                source_attempt=source,
                turn=r.turn,
                lineage=r.lineage or "",
                reused_model_calls=len(r.reused_model_calls),
                reused_tokens=r.reused_tokens,
                restored=tuple(f"{x.name}@{x.revision}" for x in r.restored),
                position=position,
                offered_at=offer[1] if offer is not None and offer[0] == r.turn else None,
            )
        )
