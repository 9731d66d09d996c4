"""The operators' figures of the hand-off, folded from the log: what the metrics export and `metrics()` show.

Every count here is durable evidence: it is read back from the events, so a trainer, worker or exporter
that restarts reports the same numbers it would have reported before.  The fold is incremental
(`catch_up` reads from the last position folded) and thread-safe (a Prometheus scrape runs in the
exporter's thread while the trainer's loop asks for `flat()`).

What each figure is computed from:

- unpaid ACK debts per agent: the ledger's own debt rule (`AckOwed` adds, `AckAccepted` and an
  `AckRejected` of kind `unknown_execution` pay), applied by the ledger projection itself;
- prepare waits: the per-agent `prepare_wait_s` of every `CheckpointCommitted` and `CheckpointAborted`;
- checkpoints by outcome: `CheckpointPrepareStarted` (started), `CheckpointCommitted`,
  `CheckpointAborted`, `CheckpointResumed`;
- stranded results: tries the log shows finished at the agent (`AttemptRetired` with outcome
  `completed_unacknowledged`) that were never owed an ACK (no `AckOwed` of theirs) and whose owed
  retire, if one was owed, was not answered with the agent holding nothing (`RetirePaid` other than
  `released`): nobody has released them;
- duplicate executions: tries whose receipts (`ReceiptFetched`, `AckOwed`) name more than one
  `result_identity`: the agent ran them more than once;
- retires by outcome (`AttemptRetired`), adoptions (`AttemptAdopted`), replacements
  (`ReplacementMinted`), abandoned rounds (`GroupAbandoned`);
- dead-lettered groups: `GroupDeadLettered`, by the retry budget its `budget` field names (`none`
  when it names none: a stranded try, or a group dead-lettered before budgets were recorded);
- groups reserved, sealed, claimed; logprob results computed and refused;
- model time and tokens generated, and what checkpoints threw away of them: the agents' own measure
  of each try's work, from its receipt or its cancelled retire (`projections.generation`).
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final

from eventstore import EventStore, RecordedEvent
from eventstore.events import AckAccepted, AckOwed, AckRejected
from projections.base import decode
from projections.generation import GENERATION_EVENTS, GenerationFigures, GenerationTotals
from projections.ledger import LedgerProjection, LedgerState, debt_key

# Upper bounds (seconds) of the prepare-wait histogram's buckets; +Inf is implied.
PREPARE_WAIT_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# The label of a `GroupDeadLettered` that names no retry budget.
NO_BUDGET: Final = "none"

_DEBT_EVENTS: Final = frozenset(t.event_type() for t in (AckOwed, AckAccepted, AckRejected))
_CHECKPOINT_OUTCOMES: Final = {
    "CheckpointPrepareStarted": "started",
    "CheckpointCommitted": "committed",
    "CheckpointAborted": "aborted",
    "CheckpointResumed": "resumed",
}


@dataclass
class Histogram:
    """Cumulative-on-export bucket counts, a sum and a count (Prometheus' histogram shape)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0
    largest: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1
        self.largest = max(self.largest, value)

    def copy(self) -> Histogram:
        other = Histogram(self.bounds)
        other.counts = list(self.counts)
        other.total, other.count, other.largest = self.total, self.count, self.largest
        return other

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), +Inf last."""
        out, running = [], 0
        for bound, n in zip([*self.bounds, float("inf")], self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass
class Snapshot:
    """The figures at one position of the log (a copy: safe to read while the fold goes on)."""

    position: int
    events: dict[str, int]
    unpaid_debts: dict[str, int]
    checkpoints: dict[str, int]
    prepare_wait: Histogram
    retires: dict[str, int]
    dead_letters: dict[str, int]
    stranded: int
    duplicate_executions: int
    logprobs: dict[str, int]
    generation: GenerationTotals


class LogFigures:
    def __init__(self) -> None:
        self.position = 0
        self._lock = threading.Lock()
        self._ledger_projection = LedgerProjection()
        self._debts: LedgerState = self._ledger_projection.initial()
        self._events: Counter[str] = Counter()
        self._checkpoints: Counter[str] = Counter()
        self._retires: Counter[str] = Counter()
        self._dead: Counter[str] = Counter()
        self._logprobs: Counter[str] = Counter()
        self._prepare = Histogram(PREPARE_WAIT_BUCKETS)
        self._finished_at_agent: set[str] = set()
        self._owed: set[str] = set()
        # Tries whose owed retire the agent answered holding nothing of them (`RetirePaid`).
        self._held_nothing: set[str] = set()
        self._identities: dict[str, set[str]] = {}
        self._duplicates = 0
        self._generation = GenerationFigures()

    # --- folding ---------------------------------------------------------------------------------

    def catch_up(self, store: EventStore) -> Snapshot:
        """Folds what the log holds past the last position folded; returns the figures."""
        with self._lock:
            for event in store.read_all(self.position):
                self._apply(event)
            return self._snapshot()

    def apply(self, event: RecordedEvent) -> None:
        with self._lock:
            self._apply(event)

    def _apply(self, event: RecordedEvent) -> None:
        self.position = event.position
        kind = event.type
        self._events[kind] += 1
        if kind in _DEBT_EVENTS:
            self._ledger_projection.apply(self._debts, event, decode(event))
        if kind in GENERATION_EVENTS:
            self._generation.apply(kind, event.data)
        data: dict[str, Any] | None = None
        if kind in _CHECKPOINT_OUTCOMES:
            self._checkpoints[_CHECKPOINT_OUTCOMES[kind]] += 1
            if kind in ("CheckpointCommitted", "CheckpointAborted"):
                data = event.data
                for wait in (data.get("prepare_wait_s") or {}).values():
                    self._prepare.observe(float(wait))
        elif kind == "AttemptRetired":
            data = event.data
            self._retires[data["outcome"]] += 1
            if data["outcome"] == "completed_unacknowledged":
                self._finished_at_agent.add(debt_key(data["rollout_id"], data["attempt_index"]))
        elif kind in ("ReceiptFetched", "AckOwed"):
            receipt = event.data["receipt"]
            key = debt_key(receipt["rollout_id"], receipt["attempt_index"])
            if kind == "AckOwed":
                self._owed.add(key)
            seen = self._identities.setdefault(key, set())
            if receipt["result_identity"] not in seen:
                seen.add(receipt["result_identity"])
                if len(seen) > 1:
                    self._duplicates += 1
        elif kind == "RetirePaid":
            data = event.data
            if data["outcome"] != "released":
                self._held_nothing.add(debt_key(data["rollout_id"], data["attempt_index"]))
        elif kind == "GroupDeadLettered":
            self._dead[str(event.data.get("budget") or NO_BUDGET)] += 1
        elif kind == "LogprobsComputed":
            self._logprobs["computed"] += 1
        elif kind == "LogprobsRefused":
            self._logprobs["refused"] += 1

    def _snapshot(self) -> Snapshot:
        return Snapshot(
            position=self.position,
            events=dict(self._events),
            unpaid_debts={agent: len(owed) for agent, owed in self._debts.debts.items() if owed},
            checkpoints=dict(self._checkpoints),
            prepare_wait=self._prepare.copy(),
            retires=dict(self._retires),
            dead_letters=dict(self._dead),
            stranded=len(self._finished_at_agent - self._owed - self._held_nothing),
            duplicate_executions=self._duplicates,
            logprobs=dict(self._logprobs),
            generation=self._generation.totals(),
        )

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snapshot()

    # --- a trainer's logger ------------------------------------------------------------------------

    def flat(self) -> dict[str, float]:
        """The figures as one flat `dict[str, float]` (`ledger/...` keys), for a per-step logger."""
        s = self.snapshot()
        ev = s.events
        out: dict[str, float] = {
            "ledger/position": float(s.position),
            "ledger/groups_reserved": float(ev.get("GroupReserved", 0)),
            "ledger/groups_sealed": float(ev.get("GroupSealed", 0)),
            "ledger/groups_claimed": float(ev.get("GroupClaimedForTraining", 0)),
            "ledger/groups_abandoned": float(ev.get("GroupAbandoned", 0)),
            "ledger/groups_dead_lettered": float(ev.get("GroupDeadLettered", 0)),
            "ledger/tries": float(ev.get("AttemptMinted", 0) + ev.get("ReplacementMinted", 0)),
            "ledger/replacements": float(ev.get("ReplacementMinted", 0)),
            "ledger/adoptions": float(ev.get("AttemptAdopted", 0)),
            "ledger/acks_accepted": float(ev.get("AckAccepted", 0)),
            "ledger/acks_rejected": float(ev.get("AckRejected", 0)),
            "ledger/unpaid_debts": float(sum(s.unpaid_debts.values())),
            "ledger/stranded": float(s.stranded),
            "ledger/duplicate_executions": float(s.duplicate_executions),
            "ledger/prepare_wait_count": float(s.prepare_wait.count),
            "ledger/prepare_wait_mean_s": s.prepare_wait.total / s.prepare_wait.count
            if s.prepare_wait.count
            else 0.0,
            "ledger/prepare_wait_max_s": s.prepare_wait.largest,
            "ledger/model_s": s.generation.total.model_s,
            "ledger/generated_tokens": float(s.generation.total.tokens),
            "ledger/thrown_by_checkpoints_model_s": s.generation.thrown.model_s,
            "ledger/thrown_by_checkpoints_tokens": float(s.generation.thrown.tokens),
            "ledger/thrown_by_checkpoints_tries": float(s.generation.thrown.tries),
            "ledger/thrown_by_checkpoints_share": s.generation.share,
        }
        for agent, n in s.unpaid_debts.items():
            out[f"ledger/unpaid_debts/{agent}"] = float(n)
        for outcome in ("started", "committed", "aborted", "resumed"):
            out[f"ledger/checkpoints_{outcome}"] = float(s.checkpoints.get(outcome, 0))
        for outcome, n in s.retires.items():
            out[f"ledger/retires/{outcome}"] = float(n)
        for budget, n in s.dead_letters.items():
            out[f"ledger/retry_budget_exhausted/{budget}"] = float(n)
        for outcome, n in s.logprobs.items():
            out[f"ledger/logprobs_{outcome}"] = float(n)
        return out
