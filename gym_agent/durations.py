"""How long the reference agent's model calls and tools take: drawn per call from a distribution.

Real model calls take seconds to minutes and vary widely (a long answer, a queue in front of the
inference server); so do tools.  `Durations(mean_s, spread_s)` draws from a gamma distribution with
that mean and standard deviation: positive, skewed to the right like real latencies, and a constant
when the spread is 0.  Each draw is seeded by the call it is for, so a try replayed with the same seed
takes the same time.
"""

from __future__ import annotations

import hashlib
import random

from pydantic import BaseModel, ConfigDict, Field


class Durations(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mean_s: float = Field(ge=0, allow_inf_nan=False)
    spread_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)

    def draw(self, key: str) -> float:
        """The duration of the call `key` names (seconds, >= 0)."""
        if self.mean_s == 0:
            return 0.0
        if self.spread_s == 0:
            return self.mean_s
        rng = random.Random(hashlib.sha256(f"duration|{key}".encode()).digest())
        shape = (self.mean_s / self.spread_s) ** 2
        return rng.gammavariate(shape, self.mean_s / shape)

    def longest_s(self) -> float:
        """A bound the draws stay under but for about one in 10,000 (mean + 4 spreads): what a
        timeout derived from these durations allows."""
        return self.mean_s + 4 * self.spread_s

    def __str__(self) -> str:
        return f"{self.mean_s:g}:{self.spread_s:g}"


def parse_durations(text: str, option: str = "--call-seconds") -> Durations:
    """`"20"` -> mean 20 s, no spread; `"20:5"` -> mean 20 s, standard deviation 5 s."""
    mean, sep, spread = text.partition(":")
    try:
        found = Durations(mean_s=float(mean), spread_s=float(spread) if sep else 0.0)
    except ValueError:
        raise ValueError(f"{option} must be MEAN[:SPREAD] in seconds, each >= 0, got {text!r}") from None
    return found
