"""Progress under frequent checkpoints: seeded schedules of groups whose model calls are longer than
the checkpoint interval, on a virtual clock.

One seed is one schedule: a few groups (sibling or prompt_group mode) of tries, each a few model calls
drawn from a gamma distribution with a mean of one to three checkpoint intervals; now and then a try
hangs inside a call (no progress, no heartbeat); the agent promises a heartbeat or nothing, and cuts
its model calls at token boundaries or not (a generation-safe cut).  A checkpoint starts every
interval: running tries are asked to park (at their next boundary, or within a slice with cuts), and
the trainer judges the ones still blocking on every poll with the real decision
(`trainer.core.blocking.judge`), retiring what it says, until nothing blocks (committed) or the prepare
deadline passes (aborted).  Tries the trainer loses are replaced, and groups dead-lettered, by the real
group rules (`trainer.core.budget`: budgets, a try lost to a checkpoint spending none, the losses
a rollout has had).  A try's rollout deadline runs only outside prepares.

The checker then asserts progress, however often the trainer checkpoints: every group sealed, or
dead-lettered for a reason other than checkpoints (its budget spent by tries that failed on their
own); no rollout lost more tries to checkpoints than the bound; no try that hung was sealed.  It counts
the model time checkpoints threw away, and how long prepares waited.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from typing import Literal

from eventstore.events import PromptRef, RetireCause
from gym_agent.durations import Durations
from projections.ledger import AttemptState, GroupState, SiblingState
from trainer.core.blocking import Blocking, judge, last_resort_s
from trainer.core.budget import checkpoint_losses, round_exhausted, sibling_exhausted

# The virtual clock's tick: the reference agent's heartbeat and decode slice.
TICK_S = 0.5
HEARTBEAT_S = 0.5
PARK_GRACE_S = 1.0
MAX_CHECKPOINT_RETIRES = 1
Mode = Literal["sibling", "prompt_group"]


@dataclass
class Try:
    group_id: str
    sibling: int
    attempt_index: int
    calls: list[float]
    # The call it hangs in (None: it never hangs).
    hangs_at: int | None
    call: int = 0
    left_s: float = 0.0
    model_s: float = 0.0
    active_s: float = 0.0
    last_progress: float = 0.0
    park_requested: bool = False
    parked: bool = False
    ended: Literal["completed", "stalled", "checkpoint", "timeout", "abandoned"] | None = None

    def __post_init__(self) -> None:
        self.left_s = self.calls[0]

    @property
    def rollout_id(self) -> str:
        return f"{self.group_id}_g{self.sibling}"

    @property
    def hung(self) -> bool:
        return self.hangs_at == self.call


@dataclass
class ProgressSchedule:
    seed: int
    mode: Mode
    interval_s: float
    prepare_timeout_s: float
    call_mean_s: float
    heartbeat_s: float | None
    cuts: bool
    groups: dict[str, GroupState] = field(default_factory=dict)
    tries: list[Try] = field(default_factory=list)
    # Per checkpoint: (committed, seconds its prepare waited).
    checkpoints: list[tuple[bool, float]] = field(default_factory=list)
    clock_s: float = 0.0
    timed_out: bool = False

    @property
    def model_s(self) -> float:
        return sum(t.model_s for t in self.tries)

    @property
    def thrown_s(self) -> float:
        """Model time of the tries checkpoints retired, and of the rounds they took down with them."""
        lost_rounds = {(t.group_id, t.attempt_index) for t in self.tries if t.ended == "checkpoint"}
        return sum(
            t.model_s
            for t in self.tries
            if t.ended == "checkpoint"
            or (t.ended == "abandoned" and (t.group_id, t.attempt_index) in lost_rounds)
        )


def _attempt(group: GroupState, t: Try) -> AttemptState:
    return group.siblings[t.sibling].attempts[t.attempt_index]


def run_progress_schedule(seed: int) -> ProgressSchedule:
    rng = random.Random(f"progress|{seed}")
    interval = rng.uniform(5.0, 15.0)
    s = ProgressSchedule(
        seed=seed,
        mode=rng.choice(("sibling", "prompt_group")),
        interval_s=interval,
        prepare_timeout_s=rng.uniform(10.0, 90.0),
        call_mean_s=interval * rng.uniform(1.2, 3.0),
        heartbeat_s=HEARTBEAT_S if rng.random() < 0.8 else None,
        cuts=rng.random() < 0.5,
    )
    calls = Durations(mean_s=s.call_mean_s, spread_s=s.call_mean_s * 0.3)
    turns = (1, rng.randint(1, 3))
    hang_p = rng.choice((0.0, 0.03, 0.1))
    n_siblings = rng.randint(1, 4)
    window = rng.randint(1, 3)
    pending = [f"p{seed}x{i}" for i in range(rng.randint(2, 5))]
    max_tries = rng.randint(3, 8)
    longest = turns[1] * calls.longest_s()
    rollout_timeout = 2 * longest + 5.0

    preparing = False

    def new_try(group: GroupState, sibling: int, attempt_index: int) -> None:
        n = rng.randint(*turns)
        durations = [calls.draw(f"{seed}|{group.group_id}|{sibling}|{attempt_index}|{c}") for c in range(n)]
        hangs_at = rng.randrange(n) if rng.random() < hang_p else None
        t = Try(group.group_id, sibling, attempt_index, durations, hangs_at, last_progress=s.clock_s)
        # Dispatched while a prepare has the agent's admission closed: it waits there, blocking nothing.
        t.park_requested = t.parked = preparing
        s.tries.append(t)
        sib = group.siblings[sibling]
        sib.current_attempt = attempt_index
        sib.attempts[attempt_index] = AttemptState(
            rollout_id=t.rollout_id, attempt_index=attempt_index, status="dispatched"
        )

    def open_group(gid: str) -> None:
        group = GroupState(
            group_id=gid,
            agent_name="agent",
            mode=s.mode,
            expected_generations=n_siblings,
            max_tries=max_tries,
            prompt_ref=PromptRef(sample_id=gid, task_name="explore"),
        )
        group.siblings = {
            i: SiblingState(rollout_id=f"{gid}_g{i}", generation_index=i) for i in range(n_siblings)
        }
        s.groups[gid] = group
        group.attempts_used = 1
        for i in range(n_siblings):
            new_try(group, i, 0)

    def live() -> list[Try]:
        return [t for t in s.tries if t.ended is None]

    def end(t: Try, how: Literal["stalled", "checkpoint", "timeout", "abandoned"]) -> None:
        t.ended = how
        a = _attempt(s.groups[t.group_id], t)
        a.status = "retired"
        a.retire_cause = how if how in ("stalled", "checkpoint") else None

    def settle(group: GroupState) -> None:
        """The group rules after a try ended without a result: a replacement, or the dead letter."""
        failed = [
            (i, sib)
            for i, sib in group.siblings.items()
            if sib.current is not None and sib.current.status == "retired" and sib.status == "pending"
        ]
        if not failed or group.status != "open":
            return
        if s.mode == "sibling":
            for i, sib in failed:
                if sibling_exhausted(group, sib) is not None:
                    group.status = "dead_lettered"
                    for t in live():
                        if t.group_id == group.group_id:
                            end(t, "abandoned")
                    return
                group.attempts_used = max(group.attempts_used, sib.current_attempt + 2)
                new_try(group, i, sib.current_attempt + 1)
            return
        # prompt_group: the round is abandoned whole and rerun, unless the budget is spent.
        for t in live():
            if t.group_id == group.group_id:
                end(t, "abandoned")
        for sib in group.siblings.values():
            sib.status = "pending"
        if round_exhausted(group) is not None:
            group.status = "dead_lettered"
            return
        group.attempts_used += 1
        for i in group.siblings:
            new_try(group, i, group.attempts_used - 1)

    def step_tries(paused: bool) -> None:
        for t in live():
            if t.parked:
                continue
            if not paused:
                t.active_s += TICK_S
            t.model_s += TICK_S
            if t.hung:
                continue  # inside a call that never returns: no progress, no heartbeat
            t.left_s -= TICK_S
            t.last_progress = s.clock_s
            if t.left_s <= 0:  # the call's token record, then the boundary
                t.call += 1
                if t.call == len(t.calls):
                    t.ended = "completed"
                    group = s.groups[t.group_id]
                    _attempt(group, t).status = "held"
                    group.siblings[t.sibling].status = "held"
                    if all(sib.status == "held" for sib in group.siblings.values()):
                        group.status = "sealed"
                    continue
                t.left_s = t.calls[t.call]
                t.parked = t.park_requested
            elif t.park_requested and s.cuts:
                t.parked = True  # a generation-safe cut at the slice's token boundary

    # Past this the schedule made no progress: every try of every group, one after another, waited
    # out its rollout deadline, which runs only between prepares (each lasting up to its deadline).
    per_try = rollout_timeout * (2 + s.prepare_timeout_s / interval) + 2 * (s.prepare_timeout_s + interval)
    limit_s = len(pending) * (max_tries + 1) * per_try
    next_checkpoint = interval
    while (pending or any(g.status == "open" for g in s.groups.values())) and s.clock_s < limit_s:
        while pending and sum(1 for g in s.groups.values() if g.status == "open") < window:
            open_group(pending.pop(0))
        s.clock_s += TICK_S
        step_tries(paused=False)
        for t in live():
            if t.active_s > rollout_timeout:
                end(t, "timeout")
        for group in list(s.groups.values()):
            settle(group)
        if s.clock_s < next_checkpoint:
            continue
        # A checkpoint: admission closed, every running try asked to park, judged on every poll.
        started = s.clock_s
        preparing = True
        for t in live():
            t.park_requested = True
        committed = False
        while True:
            blocking = [t for t in live() if not t.parked]
            if not blocking:
                committed = True
                break
            waited = s.clock_s - started
            if waited >= s.prepare_timeout_s:
                break
            verdict = judge(
                [
                    Blocking(
                        t.rollout_id,
                        t.attempt_index,
                        None if s.heartbeat_s is None else s.clock_s - t.last_progress,
                        checkpoint_losses(s.groups[t.group_id], s.groups[t.group_id].siblings[t.sibling]),
                    )
                    for t in blocking
                ],
                heartbeat_s=s.heartbeat_s,
                park_grace_s=PARK_GRACE_S,
                left_s=s.prepare_timeout_s - waited,
                last_resort_at_s=last_resort_s(s.prepare_timeout_s),
                max_checkpoint_retires=MAX_CHECKPOINT_RETIRES,
                checkpoint_id=f"ck{len(s.checkpoints)}",
            )
            retired = {(r.rollout_id, r.attempt_index): r.cause for r in verdict.retire}
            for t in blocking:
                cause: RetireCause | None = retired.get((t.rollout_id, t.attempt_index))
                if cause is not None:
                    end(t, cause)
            for group in list(s.groups.values()):
                settle(group)
            s.clock_s += TICK_S
            step_tries(paused=True)
        s.checkpoints.append((committed, s.clock_s - started))
        preparing = False
        for t in live():
            t.park_requested = t.parked = False
        next_checkpoint = s.clock_s + interval
    s.timed_out = s.clock_s >= limit_s
    return s


def check_progress(s: ProgressSchedule) -> list[str]:
    """What went wrong with the schedule's progress (nothing, when every group got somewhere).  Judged
    from what each try really did (whether it hung), not from the causes the trainer recorded."""
    violations: list[str] = []
    if s.timed_out:
        violations.append(f"no end within {s.clock_s:.0f} virtual s")
    for gid, group in s.groups.items():
        mine = [t for t in s.tries if t.group_id == gid]
        if group.status == "open":
            violations.append(f"{gid} still open")
        elif group.status == "dead_lettered":
            # A budget is spent only by tries that failed on their own (a round: by its first failure):
            # one that hung, or ran out its rollout deadline.
            lost_rounds = {t.attempt_index for t in mine if t.ended == "checkpoint"}
            own = [
                t
                for t in mine
                if (t.ended == "timeout" or (t.ended == "stalled" and t.hung))
                and t.attempt_index not in lost_rounds
            ]
            per = (
                [len({t.attempt_index for t in own})]
                if s.mode == "prompt_group"
                else [sum(1 for t in own if t.sibling == i) for i in group.siblings]
            )
            if max(per) < min(group.max_tries, group.max_infra_failures):
                violations.append(
                    f"{gid} dead-lettered by checkpoints ({max(per)} tries failed on their own)"
                )
        for sib in group.siblings.values():
            lost = checkpoint_losses(group, sib)
            if lost > MAX_CHECKPOINT_RETIRES:
                violations.append(f"{sib.rollout_id} lost {lost} tries to checkpoints")
        for t in mine:
            if t.ended == "completed" and t.hangs_at is not None:
                violations.append(f"{t.rollout_id}#{t.attempt_index} hung but completed")
            if t.ended == "stalled" and not t.hung:
                violations.append(
                    f"{t.rollout_id}#{t.attempt_index} retired as stalled while it made progress"
                )
    return violations


@dataclass
class ProgressExploration:
    seeds: int
    first_seed: int
    violations: dict[int, list[str]]
    groups_sealed: int
    groups_dead_lettered: int
    checkpoints: int
    checkpoints_aborted: int
    model_s: float
    thrown_s: float
    # The median wait of a committed prepare, with and without generation-safe cuts (virtual seconds).
    prepare_wait_p50_s: dict[str, float | None]

    @property
    def ok(self) -> bool:
        return not self.violations


def explore_progress(seeds: int, first_seed: int = 0) -> ProgressExploration:
    violations: dict[int, list[str]] = {}
    sealed = dead = checkpoints = aborted = 0
    model = thrown = 0.0
    waits: dict[str, list[float]] = {"cuts": [], "no_cuts": []}
    for seed in range(first_seed, first_seed + seeds):
        s = run_progress_schedule(seed)
        found = check_progress(s)
        if found:
            violations[seed] = found
        sealed += sum(1 for g in s.groups.values() if g.status == "sealed")
        dead += sum(1 for g in s.groups.values() if g.status == "dead_lettered")
        checkpoints += len(s.checkpoints)
        aborted += sum(1 for committed, _ in s.checkpoints if not committed)
        model += s.model_s
        thrown += s.thrown_s
        kind = "cuts" if s.cuts else "no_cuts"
        waits[kind] += [w for committed, w in s.checkpoints if committed]
    return ProgressExploration(
        seeds,
        first_seed,
        violations,
        sealed,
        dead,
        checkpoints,
        aborted,
        round(model, 1),
        round(thrown, 1),
        {k: statistics.median(v) if v else None for k, v in waits.items()},
    )
