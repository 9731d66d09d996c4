"""`ledger simulate --explore SEEDS`: the protocol core driven through seeded schedules of faults.

One seed is one schedule: a few model agents (the reference agent's phase fence, retire and adopt-only
rules, with an in-memory half a restart loses and a durable half it keeps), tries running or finished
there, and a checkpoint decided commit or abort.  A seeded scheduler interleaves every participant's
checkpoint steps and every try's retire/adopt steps (`trainer.core`), on a virtual clock, and puts a
fault on each call: refused before any effect, a 5xx, garbage, the reply lost after the effect, the
agent restarting (its state kept or lost) before the call, and a stale coordinator aborting the
checkpoint at an agent behind the log's back.  The events the core decides go to an in-memory log.

Then an independent history checker (it reads only the log's event types and the agents' own records,
never the core's states) asserts: no try executed twice, no finished result stranded without a record
of why, every participant's outcome in the log equal to the agent's, `CheckpointResumed` only when every
agent resumed, no agent left paused on a checkpoint nobody is still driving, and every retry loop
within its bound.  A seed replays exactly: `ledger simulate --explore 1 --first-seed N`.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from eventstore.events import (
    AttemptRetired,
    CheckpointParticipantFinished,
    CheckpointParticipantStuck,
    CheckpointResumed,
    Event,
    RunFailed,
)
from trainer.core import attempt as tries
from trainer.core import checkpoint as ckpt

Fault = Literal[
    "none", "refused", "server_error", "garbage", "reply_lost", "restart", "restart_wiped", "sweep"
]
FAULTS: tuple[Fault, ...] = (
    "refused",
    "server_error",
    "garbage",
    "reply_lost",
    "restart",
    "restart_wiped",
    "sweep",
)
# Calls a stuck (decided) participant keeps making in a schedule before the run ends.
AFTER_STUCK_CALLS = 5
CHECKPOINT = "ck"


class CallFailedError(Exception):
    """The call had no usable answer (its effect may have happened: reply_lost)."""


class RefusedError(Exception):
    def __init__(self, kind: ckpt.RefusalKind, finished: Literal["resumed", "aborted"] | None = None) -> None:
        super().__init__(kind)
        self.kind = kind
        self.finished = finished


@dataclass
class ModelAgent:
    """The reference agent's rules.  `finished`, the phase and results are lost by a restart; the
    artefacts and the execution records (`started`) are durable; results too when `keep_state`."""

    name: str
    generation: int = 0
    phase: str = "idle"
    active: str | None = None
    finished: dict[str, str] = field(default_factory=dict)
    artefacts: set[str] = field(default_factory=set)
    # try -> "running" | "completed" | "cancelled"; the generation each completed in
    runs: dict[str, str] = field(default_factory=dict)
    completed_in: dict[str, int] = field(default_factory=dict)
    started: Counter[str] = field(default_factory=Counter)
    restarts: int = 0

    def restart(self, keep_state: bool) -> None:
        self.generation += 1
        self.restarts += 1
        self.phase, self.active, self.finished = "idle", None, {}
        kept = {k: v for k, v in self.runs.items() if v == "completed"} if keep_state else {}
        self.runs = kept
        self.completed_in = {k: g for k, g in self.completed_in.items() if k in kept}

    # --- checkpoint phases -------------------------------------------------------------------

    def _fence(self, op: str, cid: str) -> bool:
        outcome = self.finished.get(cid)
        if outcome is not None:
            if op == "abort" and outcome == "aborted":
                return False
            raise RefusedError("stale", outcome)  # type: ignore[arg-type]
        if self.active is None:
            if op == "abort":
                return False
            raise RefusedError("invalid_phase")
        if self.active != cid:
            raise RefusedError("conflict")
        valid = {"commit": ("prepared",), "resume": ("committed_paused",), "abort": ("preparing", "prepared")}
        if self.phase not in valid[op]:
            raise RefusedError("invalid_phase")
        return True

    def phase_call(self, op: str, cid: str) -> str:
        if op == "status":
            return self.phase
        if op == "commit":
            self._fence(op, cid)
            self.artefacts.add(cid)
            self.phase = "committed_paused"
        elif op == "resume":
            self._fence(op, cid)
            self.finished[cid], self.phase, self.active = "resumed", "idle", None
        elif self._fence("abort", cid):
            self.finished[cid], self.phase, self.active = "aborted", "idle", None
        return self.phase

    # --- tries ----------------------------------------------------------------------------------

    def retire(self, key: str) -> tries.RetireAnswer:
        if self.phase not in ("idle", "preparing", "prepared"):
            raise RefusedError("invalid_phase")
        state = self.runs.get(key)
        if state == "completed":
            held_by = self.completed_in[key]
            return tries.RetireAnswer(
                False, False, True, execution_generation=held_by, execution_incarnation=incarnation(held_by)
            )
        if state == "running":
            self.runs[key] = "cancelled"
            return tries.RetireAnswer(True, False, False)
        if state == "cancelled":
            return tries.RetireAnswer(False, False, False, done=True)
        self.runs[key] = "cancelled"  # never seen: tombstoned, it will never run
        return tries.RetireAnswer(False, True, False)

    def adopt(self, key: str) -> str:
        """An adopt-only re-POST: the stored result's incarnation, or not found; never a new run."""
        if self.runs.get(key) != "completed":
            raise RefusedError("stale")  # stands for 404 not_found
        return incarnation(self.completed_in[key])


def incarnation(generation: int) -> str:
    """A model agent's incarnation: one per generation (a process start), as a real agent mints one."""
    return f"{generation:032x}"


@dataclass
class Schedule:
    seed: int
    rng: random.Random
    agents: dict[str, ModelAgent]
    log: list[tuple[str, Event]] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)
    target: ckpt.Target = "resumed"
    adopted: set[str] = field(default_factory=set)
    keys: dict[str, str] = field(default_factory=dict)  # try key -> agent
    fault_rate: float = 0.3
    # An agent away for a stretch of virtual time: every call to it fails (agent, from, until).
    outage: tuple[str, float, float] | None = None

    def away(self, agent: str, now: float) -> bool:
        return self.outage is not None and self.outage[0] == agent and self.outage[1] <= now < self.outage[2]

    def fault(self, allow_sweep: bool) -> Fault:
        if self.rng.random() >= self.fault_rate:
            return "none"
        choices = FAULTS if allow_sweep else FAULTS[:-1]
        return self.rng.choice(choices)


def _apply_fault(s: Schedule, agent: ModelAgent, fault: Fault) -> None:
    """Faults that act before the call reaches the agent."""
    if fault == "restart":
        agent.restart(keep_state=True)
    elif fault == "restart_wiped":
        agent.restart(keep_state=False)
    elif fault == "sweep" and agent.active == CHECKPOINT and agent.phase in ("preparing", "prepared"):
        # A stale coordinator aborts the checkpoint at this agent without writing to the log.
        agent.finished[CHECKPOINT], agent.phase, agent.active = "aborted", "idle", None


def _checkpoint_answer(s: Schedule, agent: ModelAgent, op: ckpt.Op, now: float) -> ckpt.Answer:
    if s.away(agent.name, now):
        return ckpt.Failed("connection refused")
    fault = s.fault(allow_sweep=True)
    _apply_fault(s, agent, fault)
    if fault in ("refused", "server_error"):
        return ckpt.Failed(fault)
    if fault == "garbage":
        return ckpt.Failed("garbage")
    try:
        phase = agent.phase_call(op, CHECKPOINT)
    except RefusedError as exc:
        return ckpt.Refused(exc.kind, exc.finished)
    if fault == "reply_lost":
        return ckpt.Failed("reply lost")
    if op == "status":
        return ckpt.StatusSeen(phase, agent.active, agent.generation)  # type: ignore[arg-type]
    return ckpt.Accepted(phase)  # type: ignore[arg-type]


def _attempt_answer(
    s: Schedule, agent: ModelAgent, key: str, action: tries.CallRetire | tries.CallAdopt, now: float
) -> tries.Input:
    if s.away(agent.name, now):
        return tries.CallFailed("connection refused")
    fault = s.fault(allow_sweep=False)
    _apply_fault(s, agent, fault)
    if fault in ("refused", "server_error"):
        return tries.CallFailed(fault)
    if isinstance(action, tries.CallAdopt):
        if fault == "garbage":
            return tries.AdoptResult("garbage", "not a receipt")
        try:
            held_by = agent.adopt(key)
        except RefusedError:
            return tries.AdoptResult("not_found")
        if fault == "reply_lost":
            return tries.CallFailed("reply lost")
        if action.expect_incarnation is not None and held_by != action.expect_incarnation:
            return tries.AdoptResult("other_incarnation", f"incarnation {held_by}")
        return tries.AdoptResult("adopted", held_by)
    if fault == "garbage":
        return tries.CallFailed("garbage")
    try:
        answer = agent.retire(key)
    except RefusedError as exc:
        return tries.RetireRefused(exc.kind)
    if fault == "reply_lost":
        return tries.CallFailed("reply lost")
    return answer


@dataclass(frozen=True)
class _CheckpointTask:
    participant: ckpt.Participant
    call: ckpt.Call
    after_stuck: int


@dataclass(frozen=True)
class _TryTask:
    state: tries.Retiring
    action: tries.CallRetire | tries.CallAdopt
    agent: str


def run_schedule(seed: int, fault_rate: float = 0.3) -> Schedule:
    """One seeded schedule: the decisions the core makes, performed against model agents."""
    rng = random.Random(seed)
    names = [f"agent-{i}" for i in range(rng.randint(1, 3))]
    s = Schedule(seed, rng, {n: ModelAgent(n) for n in names}, fault_rate=fault_rate)
    s.target = rng.choice(("resumed", "aborted"))
    if rng.random() < 0.15:  # one agent away for up to a minute, from some moment on
        start = rng.uniform(0.0, 5.0)
        s.outage = (rng.choice(names), start, start + rng.uniform(1.0, 60.0))
    for agent in s.agents.values():
        agent.phase, agent.active = (
            rng.choice(("prepared", "preparing")) if s.target == "aborted" else "prepared",
            CHECKPOINT,
        )
        for i in range(rng.randint(0, 3)):
            key = f"{agent.name}-t{i}"
            s.keys[key] = agent.name
            if rng.random() < 0.5:
                agent.runs[key] = "completed"
                agent.completed_in[key] = agent.generation
            else:
                agent.runs[key] = "running"
            agent.started[key] += 1
    # The scheduler: the next call of every machine, by virtual time, ties broken by a seeded draw.
    queue: list[tuple[float, float, int, _CheckpointTask | _TryTask]] = []
    order = 0

    def push(at: float, task: _CheckpointTask | _TryTask) -> None:
        nonlocal order
        order += 1
        heapq.heappush(queue, (at, rng.random(), order, task))

    for name in names:
        first = ckpt.Participant.finishing(CHECKPOINT, name, s.target)
        push(0.0, _CheckpointTask(first, ckpt.first_call(first), 0))
    for key, name in s.keys.items():
        push(rng.random(), _TryTask(tries.Retiring(key, 0), tries.CallRetire(), name))
    while queue:
        now, _, _, task = heapq.heappop(queue)
        if isinstance(task, _CheckpointTask):
            p = task.participant
            agent = s.agents[p.agent_name]
            s.calls[f"ckpt:{p.agent_name}"] += 1
            step = ckpt.step(p, _checkpoint_answer(s, agent, task.call.op, now), now, rng.random())
            s.log += [(p.agent_name, e) for e in step.events]
            if isinstance(step.action, ckpt.Done):
                continue
            after_stuck = task.after_stuck + (1 if step.participant.stuck_reported else 0)
            if after_stuck > AFTER_STUCK_CALLS:
                continue  # the run ends with it stuck (recorded): recovery would go on
            push(now + step.action.delay_s, _CheckpointTask(step.participant, step.action, after_stuck))
        else:
            state, action, name = task.state, task.action, task.agent
            agent = s.agents[name]
            s.calls[f"try:{state.rollout_id}"] += 1
            got = _attempt_answer(s, agent, state.rollout_id, action, now)
            nxt = tries.on(state, got, now=now, jitter=rng.random(), checkpoint_id=None)
            s.log += [(state.rollout_id, e) for e in nxt.events]
            if isinstance(nxt.action, tries.Settled):
                if nxt.action.kind == "finished":
                    s.adopted.add(state.rollout_id)
                    # The trainer seals it and owes the ACK; the ACK (not modelled) releases it.
                    agent.runs[state.rollout_id] = "acknowledged"
                continue
            push(now + nxt.action.delay_s, _TryTask(nxt.state, nxt.action, name))
    if s.target == "resumed":
        finished = {
            n for n, e in s.log if isinstance(e, CheckpointParticipantFinished) and e.outcome == "resumed"
        }
        if finished >= set(names):
            s.log.append(("", CheckpointResumed(checkpoint_id=CHECKPOINT, participants=names)))
    return s


# --- the independent history checker --------------------------------------------------------------


def check(s: Schedule) -> list[str]:
    """What the schedule's log and the agents' records show went wrong (nothing, when it holds)."""
    violations: list[str] = []
    finished: dict[str, str] = {}
    stuck: set[str] = set()
    lost_tries: set[str] = set()
    retired: set[str] = set()
    resumed_in_log = False
    for who, event in s.log:
        if isinstance(event, CheckpointParticipantFinished):
            if event.agent_name in finished:
                violations.append(f"{event.agent_name} finished twice")
            finished[event.agent_name] = event.outcome
        elif isinstance(event, CheckpointParticipantStuck):
            stuck.add(event.agent_name)
        elif isinstance(event, CheckpointResumed):
            resumed_in_log = True
        elif isinstance(event, RunFailed) and event.kind in ("agent_lost", "receipt"):
            lost_tries.add(who)
        elif isinstance(event, AttemptRetired):
            retired.add(who)
    for name, agent in s.agents.items():
        # Nothing executed twice: adoption never starts an execution.
        for key, n in agent.started.items():
            if n > 1:
                violations.append(f"{key} executed {n} times at {name}")
        # Nothing stranded: a result the agent still holds was adopted, or its loss is on record.
        for key, state in agent.runs.items():
            if state == "completed" and key not in s.adopted and key not in lost_tries:
                violations.append(
                    f"{key}: {name} holds a finished result the log neither adopted nor declared lost"
                )
        outcome = finished.get(name)
        if outcome == "resumed":
            if CHECKPOINT not in agent.artefacts:
                violations.append(f"{name} recorded resumed but holds no artefact of {CHECKPOINT}")
            if s.target != "resumed":
                violations.append(f"{name} resumed a checkpoint the log aborted")
        elif outcome == "aborted":
            if s.target != "aborted":
                violations.append(f"{name} recorded aborted for a committed checkpoint")
        elif outcome == "lost":
            if s.target == "resumed" and agent.finished.get(CHECKPOINT) == "resumed":
                violations.append(f"{name} recorded lost but resumed {CHECKPOINT}")
        elif name not in stuck:
            violations.append(f"{name} neither finished nor recorded stuck")
        # No agent left paused or closed on a checkpoint nobody is still driving.
        if agent.active == CHECKPOINT and name not in stuck:
            violations.append(f"{name} left {agent.phase} on {CHECKPOINT} with nothing recorded")
    if resumed_in_log and any(finished.get(n) != "resumed" for n in s.agents):
        violations.append("CheckpointResumed without every participant resumed")
    if s.target == "resumed" and not resumed_in_log and not (stuck or "lost" in finished.values()):
        violations.append("every participant resumed but CheckpointResumed was not appended")
    # Every retry loop within its bound.
    bound_try = tries.RETIRE_POLICY.max_calls * (tries.ADOPT_GARBAGE_LIMIT + 1) + 8
    bound_ckpt = ckpt.FINISH_POLICY.max_calls + AFTER_STUCK_CALLS + 8
    for what, n in s.calls.items():
        limit = bound_try if what.startswith("try:") else bound_ckpt
        if n > limit:
            violations.append(f"{what} made {n} calls (bound {limit})")
    return violations


@dataclass
class Exploration:
    seeds: int
    first_seed: int
    violations: dict[int, list[str]]
    calls: int
    lost: int
    stuck: int
    restarts: int
    tries_lost: int

    @property
    def ok(self) -> bool:
        return not self.violations


def explore(seeds: int, first_seed: int = 0, fault_rate: float = 0.3) -> Exploration:
    violations: dict[int, list[str]] = {}
    lost = stuck = restarts = calls = tries_lost = 0
    for seed in range(first_seed, first_seed + seeds):
        s = run_schedule(seed, fault_rate)
        found = check(s)
        if found:
            violations[seed] = found
        lost += sum(
            1 for _, e in s.log if isinstance(e, CheckpointParticipantFinished) and e.outcome == "lost"
        )
        stuck += sum(1 for _, e in s.log if isinstance(e, CheckpointParticipantStuck))
        restarts += sum(a.restarts for a in s.agents.values())
        calls += sum(s.calls.values())
        tries_lost += sum(1 for _, e in s.log if isinstance(e, RunFailed) and e.kind == "agent_lost")
    return Exploration(seeds, first_seed, violations, calls, lost, stuck, restarts, tries_lost)
