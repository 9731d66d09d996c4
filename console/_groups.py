"""The groups page and the samples of a train step: filters parsed from a query, rows off the fold.

Pure: `parse_filter` turns query parameters into a `GroupFilter` (or one sentence saying what is
wrong with them), `list_groups` filters the groups in play and archived and cuts out one page, newest
activity first; `step_groups` finds what a train step was given.  Times are turned into positions by
the caller (`console._reads.first_position_at`): a group's time is its last event's.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from console._fold import GROUP_STATUSES
from projections.ledger import ArchivedGroup, GroupState, LedgerState
from protocol.levels import TARGET_LEVELS

PER_PAGE: Final = 50
FILTERS: Final = ("status", "agent", "trainer", "step", "level", "since", "until", "q")
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNIT_S: Final = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_MAX_TEXT: Final = 200


@dataclass(frozen=True, slots=True)
class GroupFilter:
    status: str | None = None  # a group status, or "claimed" / "unclaimed"
    agent: str | None = None
    trainer: str | None = None
    step: int | None = None
    level: str | None = None
    since: float | None = None  # seconds since the epoch
    until: float | None = None
    q: str | None = None

    def query(self, raw: Mapping[str, str]) -> dict[str, str]:
        """The filter's parameters as given (for the links of other pages)."""
        return {k: v for k, v in raw.items() if k in FILTERS and v}


@dataclass(frozen=True, slots=True)
class GroupRow:
    group_id: str
    status: str
    archived: bool
    agent: str
    trainer: str | None
    mode: str
    target_level: str | None  # None: archived groups keep no level
    siblings: int
    tries: int
    claimed_steps: tuple[int | None, ...]
    position: int  # its last event


def parse_time(text: str, now: float) -> float:
    """`2026-01-31 12:00[:00]` (UTC; `T` between works too) or a time before now: `90s`, `15m`,
    `2h`, `1d`.  ValueError says which forms are taken."""
    value = text.strip()
    relative = _RELATIVE.match(value)
    if relative:
        return now - float(relative.group(1)) * _UNIT_S[relative.group(2)]
    try:
        parsed = dt.datetime.fromisoformat(value.replace(" ", "T", 1))
    except ValueError:
        raise ValueError(
            f"{value[:40]!r} is not a time: write 2026-01-31 12:00 (UTC) or a time before now, 90s, 15m, 2h, 1d"
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp()


def parse_filter(params: Mapping[str, str], now: float) -> GroupFilter | str:
    """The filter, or one sentence naming the parameter that is wrong and what it takes."""
    values = {k: params.get(k, "").strip() for k in FILTERS}
    for name, value in values.items():
        if len(value) > _MAX_TEXT:
            return f"{name} is longer than {_MAX_TEXT} characters"
    status = values["status"] or None
    if status is not None and status not in (*GROUP_STATUSES, "claimed", "unclaimed"):
        return f"status takes one of {', '.join((*GROUP_STATUSES, 'claimed', 'unclaimed'))}"
    level = values["level"] or None
    if level is not None and level not in TARGET_LEVELS:
        return f"level takes one of {', '.join(TARGET_LEVELS)}"
    step: int | None = None
    if values["step"]:
        try:
            step = int(values["step"])
        except ValueError:
            return "step takes a whole number (a train step)"
    times: dict[str, float | None] = {"since": None, "until": None}
    for name in times:
        if values[name]:
            try:
                times[name] = parse_time(values[name], now)
            except ValueError as exc:
                return f"{name}: {exc}"
    return GroupFilter(
        status=status,
        agent=values["agent"] or None,
        trainer=values["trainer"] or None,
        step=step,
        level=level,
        since=times["since"],
        until=times["until"],
        q=values["q"] or None,
    )


def row_of(group: GroupState | ArchivedGroup) -> GroupRow:
    if isinstance(group, GroupState):
        return GroupRow(
            group_id=group.group_id,
            status=group.status,
            archived=False,
            agent=group.agent_name,
            trainer=group.trainer_id,
            mode=group.mode,
            target_level=group.target_level,
            siblings=group.expected_generations,
            tries=group.attempts_used,
            claimed_steps=tuple(group.claimed_steps),
            position=group.last_position,
        )
    return GroupRow(
        group_id=group.group_id,
        status=group.status,
        archived=True,
        agent=group.agent_name,
        trainer=group.trainer_id,
        mode=group.mode,
        target_level=None,
        siblings=group.expected_generations,
        tries=group.attempts_used,
        claimed_steps=tuple(group.claimed_steps),
        position=group.last_position,
    )


def _matches(g: GroupState | ArchivedGroup, f: GroupFilter, after: int | None, before: int | None) -> bool:
    if f.status is not None:
        if f.status == "claimed":
            if not g.claims:
                return False
        elif f.status == "unclaimed":
            if g.claims:
                return False
        elif g.status != f.status:
            return False
    if f.agent is not None and g.agent_name != f.agent:
        return False
    if f.trainer is not None and (g.trainer_id or "") != f.trainer:
        return False
    if f.step is not None and not any(c.train_step == f.step for c in g.claims):
        return False
    if f.level is not None and (not isinstance(g, GroupState) or g.target_level != f.level):
        return False
    if after is not None and g.last_position < after:
        return False
    if before is not None and g.last_position >= before:
        return False
    return not (f.q is not None and f.q not in g.group_id)


def list_groups(
    ledger: LedgerState, f: GroupFilter, page: int, after: int | None = None, before: int | None = None
) -> tuple[list[GroupRow], int]:
    """One page (from 1) of the groups that match, newest activity first, and how many match.
    `after`/`before`: the positions the filter's `since`/`until` begin at."""
    found: list[GroupState | ArchivedGroup] = [
        g for g in ledger.groups.values() if _matches(g, f, after, before)
    ]
    if f.level is None:
        found += [a for a in ledger.archived.values() if _matches(a, f, after, before)]
    found.sort(key=lambda g: g.last_position, reverse=True)
    start = (max(page, 1) - 1) * PER_PAGE
    return [row_of(g) for g in found[start : start + PER_PAGE]], len(found)


def group_summary(ledger: LedgerState, group_id: str) -> GroupRow | None:
    group: GroupState | ArchivedGroup | None = ledger.groups.get(group_id) or ledger.archived.get(group_id)
    return None if group is None else row_of(group)


@dataclass(frozen=True, slots=True)
class StepCount:
    step: int | None
    groups: int


def train_steps(steps: dict[int | None, dict[str, None]], page: int) -> tuple[list[StepCount], int]:
    """One page (from 1) of the train steps groups were claimed for (the fold's index), each with
    how many, newest step first (None, claims that named no step, last); and how many steps there
    are.  Only the page is made into rows: a step per group is thousands of steps."""
    ordered = sorted((step for step, ids in steps.items() if ids), key=lambda k: (k is None, -(k or 0)))
    start = (max(page, 1) - 1) * PER_PAGE
    return [StepCount(step, len(steps[step])) for step in ordered[start : start + PER_PAGE]], len(ordered)


def step_groups(
    ledger: LedgerState, steps: dict[int | None, dict[str, None]], step: int | None
) -> list[tuple[GroupRow, int]]:
    """The groups claimed for `step`, each with the position of that claim, in claim order."""
    out = []
    for group_id in steps.get(step, {}):
        group: GroupState | ArchivedGroup | None = ledger.groups.get(group_id) or ledger.archived.get(
            group_id
        )
        if group is None:
            continue
        position = next((c.position for c in group.claims if c.train_step == step), None)
        if position is not None:
            out.append((row_of(group), position))
    out.sort(key=lambda pair: pair[1])
    return out


__all__ = [
    "FILTERS",
    "PER_PAGE",
    "GroupFilter",
    "GroupRow",
    "StepCount",
    "group_summary",
    "list_groups",
    "parse_filter",
    "parse_time",
    "row_of",
    "step_groups",
    "train_steps",
]
