"""Injected faults of the reference agent: per try, as seeded random rates, or a crash countdown."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from protocol.wire import AttemptFault, CrashAfter, FaultRates, RateFaults

FaultRequest = AttemptFault | RateFaults | CrashAfter


@dataclass(frozen=True)
class ResolvedFault:
    """What one try will suffer, fixed when the try starts."""

    drop_reply: bool = False
    fail: bool = False
    delay_s: float = 0.0
    hang: bool = False


NO_FAULT = ResolvedFault()


def _uniform(seed: int, kind: str, rollout_id: str, attempt_index: int) -> float:
    """A draw in [0, 1) that depends only on its inputs, so a rate fault hits the same tries in every run."""
    digest = hashlib.sha256(f"{seed}|{kind}|{rollout_id}|{attempt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class FaultTable:
    def __init__(self) -> None:
        self._per_attempt: dict[tuple[str, int], AttemptFault] = {}
        self._rates = FaultRates()
        self._rate_seed = 0
        self._crash_remaining: int | None = None

    def apply(self, request: FaultRequest) -> None:
        if isinstance(request, AttemptFault):
            key = (request.rollout_id, request.attempt_index)
            if request.drop_reply or request.fail or request.hang or request.delay_s:
                self._per_attempt[key] = request
            else:
                self._per_attempt.pop(key, None)  # an all-clear body removes the entry
        elif isinstance(request, RateFaults):
            self._rates, self._rate_seed = request.rates, request.seed
        else:
            self._crash_remaining = request.crash_after

    def for_attempt(self, rollout_id: str, attempt_index: int) -> ResolvedFault:
        explicit = self._per_attempt.get((rollout_id, attempt_index))
        if explicit is not None:
            return ResolvedFault(
                drop_reply=explicit.drop_reply,
                fail=explicit.fail,
                delay_s=explicit.delay_s,
                hang=explicit.hang,
            )
        rates = self._rates
        return ResolvedFault(
            drop_reply=_uniform(self._rate_seed, "drop_reply", rollout_id, attempt_index) < rates.drop_reply,
            fail=_uniform(self._rate_seed, "fail", rollout_id, attempt_index) < rates.fail,
            hang=_uniform(self._rate_seed, "hang", rollout_id, attempt_index) < rates.hang,
        )

    @property
    def crash_pending_now(self) -> bool:
        """`crash_after: 0` means: exit at once."""
        return self._crash_remaining == 0

    def count_completion(self) -> bool:
        """Counts one completion; True when the process must exit now."""
        if self._crash_remaining is None:
            return False
        self._crash_remaining -= 1
        return self._crash_remaining <= 0
