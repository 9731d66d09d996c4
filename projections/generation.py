"""Generation kept and generation thrown away by checkpoints, folded from the log.

Every figure is the agents' own measure of a try's work (`protocol.wire.AttemptWork`: model-call seconds,
parked time excluded, and tokens generated), as the log recorded it:

- a finished try's work comes with its receipt (`ReceiptFetched`, once per try);
- a cancelled try's work comes with its retire (`AttemptRetired` outcome `cancelled`).

Their sum is the model time the run spent.  Thrown away by a checkpoint is the work of every try a
checkpoint's prepare retired as its last resort (`AttemptRetired` cause `checkpoint`, naming the
checkpoint) and, in prompt_group mode, of the other tries of the round it took down with it (the
`GroupAbandoned` whose tries include such a retire: held results discarded, running tries cancelled).
A try retired as `stalled` was stuck inside a model call: its work counts in the total, not as thrown
away by the checkpoint.  Rows written before agents reported work add nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from eventstore import RecordedEvent

# Checkpoints throwing away more than this share of the model time are worth an operator's look.
WARN_SHARE: Final = 0.03
# The event types the fold reads.
GENERATION_EVENTS: Final = frozenset({"ReceiptFetched", "AttemptRetired", "GroupAbandoned"})


@dataclass
class Work:
    model_s: float = 0.0
    tokens: int = 0
    tries: int = 0

    def add(self, model_s: float, tokens: int) -> None:
        self.model_s += model_s
        self.tokens += tokens
        self.tries += 1

    def copy(self) -> Work:
        return Work(self.model_s, self.tokens, self.tries)


def _work(data: dict[str, Any] | None) -> tuple[float, int] | None:
    if not data:
        return None
    return float(data.get("model_s") or 0.0), int(data.get("generated_tokens") or 0)


def _key(data: dict[str, Any]) -> tuple[str, int]:
    return (str(data["rollout_id"]), int(data["attempt_index"]))


@dataclass
class GenerationFigures:
    """The fold.  `apply(type, data)` takes one event's type and payload, in log order."""

    total: Work = field(default_factory=Work)
    thrown: Work = field(default_factory=Work)
    # checkpoint id -> what it threw away
    by_checkpoint: dict[str, Work] = field(default_factory=dict)
    # try -> its work, as far as the log knows it (for the rounds a checkpoint took down)
    _work: dict[tuple[str, int], tuple[float, int]] = field(default_factory=dict)
    # try -> the checkpoint it was lost to
    _lost: dict[tuple[str, int], str] = field(default_factory=dict)

    def apply(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "ReceiptFetched":
            receipt = data["receipt"]
            key = _key(receipt)
            work = _work(receipt.get("work"))
            if work is not None and key not in self._work:
                self._work[key] = work
                self.total.add(*work)
        elif kind == "AttemptRetired":
            key = _key(data)
            work = _work(data.get("work")) if data.get("outcome") == "cancelled" else None
            if work is not None and key not in self._work:
                self._work[key] = work
                self.total.add(*work)
            checkpoint = data.get("checkpoint_id")
            if data.get("cause") == "checkpoint" and checkpoint and key not in self._lost:
                self._lost[key] = checkpoint
                self._throw(checkpoint, self._work.get(key, (0.0, 0)))
        elif kind == "GroupAbandoned":
            keys = [_key(ref) for ref in data.get("attempts") or []]
            culprits = [self._lost[k] for k in keys if k in self._lost]
            if culprits:
                for key in keys:
                    if key not in self._lost:
                        self._lost[key] = culprits[0]
                        self._throw(culprits[0], self._work.get(key, (0.0, 0)))

    def _throw(self, checkpoint_id: str, work: tuple[float, int]) -> None:
        self.thrown.add(*work)
        self.by_checkpoint.setdefault(checkpoint_id, Work()).add(*work)

    @property
    def share(self) -> float:
        """Model time thrown away by checkpoints, as a share of all the model time recorded."""
        return self.thrown.model_s / self.total.model_s if self.total.model_s > 0 else 0.0

    def warning(self) -> str | None:
        """The operator's warning when checkpoints throw away more than WARN_SHARE of the model time."""
        if self.share <= WARN_SHARE:
            return None
        return (
            f"checkpoints threw away {100 * self.share:.1f} % of the model time "
            f"({self.thrown.model_s:.1f} of {self.total.model_s:.1f} s, {self.thrown.tokens} tokens, "
            f"{self.thrown.tries} tries): longer prepare timeouts, fewer checkpoints, or agents that "
            "park mid-call would keep it"
        )

    def totals(self) -> GenerationTotals:
        """The figures without the per-try bookkeeping (a copy, cheap: what a metrics scrape reads)."""
        return GenerationTotals(self.total.copy(), self.thrown.copy(), len(self.by_checkpoint))

    def worst(self, n: int) -> list[tuple[str, Work]]:
        """The `n` checkpoints that threw away the most model time, most first."""
        ranked = sorted(self.by_checkpoint.items(), key=lambda kv: (-kv[1].model_s, kv[0]))
        return ranked[:n]

    def summary(self) -> dict[str, Any]:
        return {
            "model_s": round(self.total.model_s, 3),
            "generated_tokens": self.total.tokens,
            "thrown_by_checkpoints_model_s": round(self.thrown.model_s, 3),
            "thrown_by_checkpoints_tokens": self.thrown.tokens,
            "thrown_by_checkpoints_tries": self.thrown.tries,
            "thrown_by_checkpoints_share": round(self.share, 5),
        }


@dataclass(frozen=True)
class GenerationTotals:
    total: Work
    thrown: Work
    # Checkpoints that threw generation away.
    checkpoints: int

    @property
    def share(self) -> float:
        return self.thrown.model_s / self.total.model_s if self.total.model_s > 0 else 0.0


def generation_figures(rows: Iterable[RecordedEvent]) -> GenerationFigures:
    """The fold over `rows` (in log order; rows of other types are passed over)."""
    figures = GenerationFigures()
    for row in rows:
        if row.type in GENERATION_EVENTS:
            figures.apply(row.type, row.data)
    return figures
