"""The console's own reads of the log: each by an index (a position, a stream, a type), never a scan.

Every page reads what it shows and no more: a rollout's streams, the times of the rows it lists, a
range of positions.  All of it on the store's read-only engine (`EventStore.read_connection`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Final

from sqlalchemy import bindparam, text

from eventstore import EventStore, RecordedEvent
from protocol.streams import group_stream, logprobs_stream, operator_stream

_TIMES = text("SELECT position, recorded_at FROM events WHERE position IN :positions").bindparams(
    bindparam("positions", expanding=True)
)
_TIME_AT = text("SELECT recorded_at FROM events WHERE position = :p")
# A binary search over positions by time reads this many rows at most (2**40 positions).
_SEARCH_STEPS: Final = 40


def recorded_at(store: EventStore, positions: Iterable[int]) -> dict[int, float]:
    """When each of `positions` was recorded (the writer's clock), one query for all."""
    wanted = sorted({p for p in positions if p > 0})
    if not wanted:
        return {}
    with store.read_connection() as conn:
        rows = conn.execute(_TIMES, {"positions": wanted}).all()
    return {int(p): float(t) for p, t in rows}


def first_position_at(store: EventStore, when: float, head: int) -> int:
    """The first position recorded at or after `when` (head + 1 when none is): a binary search by the
    primary key (positions are recorded in time order, up to the writers' clocks)."""
    low, high = 1, head + 1
    with store.read_connection() as conn:
        for _ in range(_SEARCH_STEPS):
            if low >= high:
                break
            middle = (low + high) // 2
            value = conn.execute(_TIME_AT, {"p": middle}).scalar()
            if value is None or float(value) >= when:
                high = middle
            else:
                low = middle + 1
    return low


def event_at(store: EventStore, position: int) -> RecordedEvent | None:
    found = list(store.read_all(position - 1, position)) if position > 0 else []
    return found[0] if found else None


def events_between(
    store: EventStore, after: int, to: int, types: Collection[str], limit: int
) -> list[RecordedEvent]:
    """Up to `limit` events of `types` with `after < position <= to` (by the type index)."""
    out: list[RecordedEvent] = []
    for page in store.read_pages(after, to, types=types, batch_size=min(limit, 1000), read_ahead=False):
        out.extend(page[: limit - len(out)])
        if len(out) >= limit:
            break
    return out


def rollout_events(store: EventStore, group_id: str, agents: Iterable[str]) -> list[RecordedEvent]:
    """Every event a sibling's history is made of, in log order: its group's stream, the group's
    logprobs stream, and what operators decided by hand for the group's agents (`ledger debt drop`
    writes on its own stream).  `ledger show` finds the same events by reading every ACK answer
    after the group began; here each stream is read by its index."""
    found: dict[int, RecordedEvent] = {}
    streams = [
        group_stream(group_id),
        logprobs_stream(group_id),
        *(operator_stream(a) for a in sorted(set(agents))),
    ]
    for stream in streams:
        for event in store.read_stream(stream):
            found[event.position] = event
    return [found[p] for p in sorted(found)]


__all__ = ["event_at", "events_between", "first_position_at", "recorded_at", "rollout_events"]
