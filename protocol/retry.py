"""One retry budget: how many calls, until when, and how long to wait between them.

A budget is data; `next_step` is the only place that decides "retry after d seconds" or "give up".
The caller passes the time (`now`) and a jitter draw in [0, 1) it took from its own random source, so
the decision is reproducible (a simulation seeds the draws; a test names them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class RetryPolicy:
    """`max_calls` calls at most, none started after `deadline_s` from the first; waits grow from
    `base_s` doubling up to `cap_s`, each drawn uniformly from [half, whole] of that (jitter keeps a
    crowd of retriers from calling in step)."""

    max_calls: int
    deadline_s: float
    base_s: float = 0.05
    cap_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_calls < 1 or self.deadline_s <= 0 or self.base_s <= 0 or self.cap_s < self.base_s:
            raise ValueError(f"not a usable retry policy: {self}")

    @classmethod
    def within(cls, deadline_s: float, base_s: float, cap_s: float) -> RetryPolicy:
        """Bounded by its deadline alone (an outage ridden out: as many calls as fit in it)."""
        return cls(max_calls=1 << 30, deadline_s=deadline_s, base_s=base_s, cap_s=cap_s)


@dataclass(frozen=True)
class RetryState:
    """The calls made so far under one budget and when the first was made (None before any)."""

    calls: int = 0
    started_at: float | None = None
    last_error: str = ""

    def failed(self, now: float, error: str) -> RetryState:
        """One more failed call, made at `now`."""
        return replace(
            self,
            calls=self.calls + 1,
            started_at=self.started_at if self.started_at is not None else now,
            last_error=error,
        )


@dataclass(frozen=True)
class Retry:
    kind: Literal["retry"]
    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    kind: Literal["give_up"]
    reason: str


def backoff_s(policy: RetryPolicy, calls: int, jitter: float) -> float:
    """The wait after the `calls`-th failed call: base * 2^(calls-1), capped, scaled into [1/2, 1]."""
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter draw {jitter} is not in [0, 1)")
    ceiling = min(policy.cap_s, policy.base_s * 2 ** max(0, min(calls - 1, 30)))
    return float(ceiling * (0.5 + jitter / 2))


def next_step(policy: RetryPolicy, state: RetryState, now: float, jitter: float) -> Retry | GiveUp:
    """After a failed call: wait and call again, or give up (the budget's calls or time are spent)."""
    if state.calls >= policy.max_calls:
        return GiveUp(
            "give_up", f"{state.calls} calls failed (budget {policy.max_calls}): {state.last_error}"
        )
    delay = backoff_s(policy, state.calls, jitter)
    started = state.started_at if state.started_at is not None else now
    if now + delay - started > policy.deadline_s:
        return GiveUp(
            "give_up",
            f"{state.calls} calls failed within the {policy.deadline_s:g} s deadline: {state.last_error}",
        )
    return Retry("retry", delay)
