"""The overview of a run, read off the live fold: what an operator keeps open during a run.

Two steps, both pure: `wanted` says which times the overview needs that the fold does not hold (when
the oldest debt of each agent was recorded, when the current checkpoint's prepare started), the
console looks them up (`console._reads`), and `build_overview` makes the view.  Neither walks the
groups: the cost is in the number of agents and of the current checkpoint's participants, whatever
the log's length.
"""

from __future__ import annotations

from dataclasses import dataclass

from console._fold import CHECKPOINT_STATUSES, GROUP_STATUSES, FoldStopped, LiveFold
from projections.checkpoints import CheckpointState
from projections.generation import GenerationTotals
from protocol.ids import group_id_of


@dataclass(frozen=True, slots=True)
class Wanted:
    positions: frozenset[int]
    # debt keys ("rollout/attempt") whose AckOwed the fold did not see (loaded from a checkpoint)
    debts: frozenset[str]


@dataclass(frozen=True, slots=True)
class AgentDebts:
    agent: str
    unpaid: int
    oldest_rollout: str
    oldest_attempt: int
    oldest_at: float | None


@dataclass(frozen=True, slots=True)
class AgentRetires:
    agent: str
    owed: int
    oldest_rollout: str
    oldest_attempt: int
    since_position: int
    since_at: float | None


@dataclass(frozen=True, slots=True)
class Participant:
    agent: str
    phase: str
    prepare_wait_s: float | None
    # True while the phase waits on this agent (prepare undecided, a decided step not confirmed)
    waiting: bool


@dataclass(frozen=True, slots=True)
class CheckpointNow:
    checkpoint_id: str
    status: str
    trainer_id: str | None
    cut_position: int | None
    started_position: int | None
    started_at: float | None
    abort_reason: str | None
    participants: tuple[Participant, ...]


@dataclass(frozen=True, slots=True)
class Verdict:
    """The last run of a check started from the console (the audit, or replay --verify)."""

    ok: bool
    summary: str
    finished_at: float


@dataclass(frozen=True, slots=True)
class Overview:
    phase: str
    position: int
    target: int
    note: str
    stopped: FoldStopped | None
    groups: dict[str, tuple[int, int]]
    claimed: tuple[int, int]
    groups_per_s: float
    rollouts_per_s: float
    debts: tuple[AgentDebts, ...]
    retires: tuple[AgentRetires, ...]
    checkpoint: CheckpointNow | None
    checkpoint_counts: dict[str, int]
    generation: GenerationTotals
    generation_warning: str | None
    runner_position: int | None
    audit: Verdict | None
    verify: Verdict | None
    now: float

    @property
    def runner_lag(self) -> int | None:
        return None if self.runner_position is None else max(0, self.position - self.runner_position)


def wanted(fold: LiveFold) -> Wanted:
    positions: set[int] = set()
    debts: set[str] = set()
    for owed in fold.ledger.debts.values():
        oldest = next(iter(owed), None)
        if oldest is not None and oldest not in fold.owed_at:
            debts.add(oldest)
    for retires in fold.ledger.retires.values():
        if retires:
            positions.add(min(d.position for d in retires.values()))
    current = _current(fold)
    if current is not None and current.started_position is not None:
        positions.add(current.started_position)
    return Wanted(frozenset(positions), frozenset(debts))


def build_overview(
    fold: LiveFold,
    *,
    phase: str,
    target: int,
    note: str,
    times: dict[int, float],
    runner_position: int | None,
    audit: Verdict | None,
    verify: Verdict | None,
    now: float,
) -> Overview:
    ledger = fold.ledger
    debts = []
    for agent, owed in sorted(ledger.debts.items()):
        if not owed:
            continue
        key = next(iter(owed))
        rollout_id, _, attempt = key.rpartition("/")
        debts.append(AgentDebts(agent, len(owed), rollout_id, int(attempt), fold.owed_at.get(key)))
    retires = []
    for agent, owed_retires in sorted(ledger.retires.items()):
        if not owed_retires:
            continue
        oldest = min(owed_retires.values(), key=lambda d: d.position)
        retires.append(
            AgentRetires(
                agent,
                len(owed_retires),
                oldest.rollout_id,
                oldest.attempt_index,
                oldest.position,
                times.get(oldest.position),
            )
        )
    current = _current(fold)
    groups_per_s, rollouts_per_s = fold.sealed_per_s(now)
    counts = fold.status_counts()
    return Overview(
        phase=phase,
        position=fold.position,
        target=target,
        note=note,
        stopped=fold.stopped,
        groups={s: counts[s] for s in GROUP_STATUSES},
        claimed=fold.claimed_counts(),
        groups_per_s=groups_per_s,
        rollouts_per_s=rollouts_per_s,
        debts=tuple(debts),
        retires=tuple(retires),
        checkpoint=None if current is None else checkpoint_now(current, times, now),
        checkpoint_counts={s: fold.checkpoint_counts[s] for s in CHECKPOINT_STATUSES},
        generation=fold.generation.totals(),
        generation_warning=fold.generation.warning(),
        runner_position=runner_position,
        audit=audit,
        verify=verify,
        now=now,
    )


def checkpoint_now(c: CheckpointState, times: dict[int, float], now: float) -> CheckpointNow:
    started_at = times.get(c.started_position) if c.started_position is not None else None
    return CheckpointNow(
        checkpoint_id=c.checkpoint_id,
        status=c.status,
        trainer_id=c.trainer_id,
        cut_position=c.cut_position,
        started_position=c.started_position,
        started_at=started_at,
        abort_reason=c.abort_reason,
        participants=tuple(participant_phases(c, started_at, now)),
    )


def participant_phases(c: CheckpointState, started_at: float | None, now: float) -> list[Participant]:
    """Each participant's phase of checkpoint `c` and how long its prepare waited (still waiting:
    since the prepare started)."""
    out = []
    for agent in c.participants:
        finished = c.finished.get(agent)
        stuck = c.stuck.get(agent)
        wait = c.prepare_wait_s.get(agent)
        if c.status == "preparing":
            phase, waiting = "preparing", True
            wait = None if started_at is None else max(0.0, now - started_at)
        elif finished is not None:
            phase, waiting = finished, False
        elif stuck is not None:
            phase, waiting = f"stuck at {stuck}", True
        elif c.status == "committed":
            phase, waiting = "committed, resume not confirmed", True
        elif c.status == "aborted":
            phase, waiting = "aborted, abort not confirmed", True
        else:
            phase, waiting = c.status, False
        out.append(Participant(agent, phase, wait, waiting))
    return out


def _current(fold: LiveFold) -> CheckpointState | None:
    if fold.current_checkpoint is None:
        return None
    return fold.checkpoints.checkpoints.get(fold.current_checkpoint)


def debt_group(key: str) -> str:
    """The group a debt key ("rollout/attempt") belongs to."""
    rollout_id = key.rpartition("/")[0]
    return group_id_of(rollout_id) or rollout_id


__all__ = [
    "AgentDebts",
    "AgentRetires",
    "CheckpointNow",
    "Overview",
    "Participant",
    "Verdict",
    "Wanted",
    "build_overview",
    "checkpoint_now",
    "debt_group",
    "participant_phases",
    "wanted",
]
