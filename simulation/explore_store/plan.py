"""One schedule's plan: trainers, agents, groups, faults, restarts, a crash point, an outage, drawn
from `random.Random(seed)` alone."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

CallKind = Literal[
    "run", "receipt", "tokens", "ack", "retire", "prepare", "commit", "resume", "abort", "status", "other"
]
# The calls a fault may be placed on, in declaration order (a seed's draws index into it).
CALL_KINDS: tuple[CallKind, ...] = tuple(k for k in get_args(CallKind) if k != "other")
Fault = Literal["refused", "server_error", "non_json", "timeout", "reply_lost", "duplicate"]
FAULTS: tuple[Fault, ...] = get_args(Fault)
# `before_run` (stale only): the process's k-th /run is held on its way to the agent until the
# successor has retired that try there and the agent has restarted on its state directory (a late /run).
# `after_prepare` (stale only): the process is held right after its first `CheckpointPrepareStarted`
# append, until the successor has recovered (presuming that checkpoint aborted); then it goes on to
# prepare it at the agents (a stale prepare after a presumed abort).
CrashWhere = Literal[
    "before_append", "after_append", "before_call", "after_call", "before_run", "after_prepare"
]
CheckpointKind = Literal["one_call", "split_commit", "split_abort"]

# --- the plan: a pure function of the seed --------------------------------------------------------


@dataclass(frozen=True)
class CrashPoint:
    trainer: int
    where: CrashWhere
    k: int
    stale: bool  # the crashed process is not stopped: it carries on after its successor took over


@dataclass(frozen=True)
class GroupPlan:
    group_id: str
    agent: str
    siblings: int


@dataclass(frozen=True)
class TrainerPlan:
    trainer_id: str
    agents: tuple[str, ...]
    groups: tuple[GroupPlan, ...]
    mode: Literal["sibling", "prompt_group"]
    checkpoint: CheckpointKind
    checkpoint_after: int  # groups claimed before the checkpoint starts


@dataclass(frozen=True)
class Plan:
    seed: int
    prefix: str  # of every id in the schedule
    trainers: tuple[TrainerPlan, ...]
    # (agent, call kind, n-th call of that kind to that agent) -> the fault it suffers
    faults: dict[tuple[str, CallKind, int], Fault]
    # (agent, n-th call to that agent) -> restart before it, keeping (True) or losing its state dir
    restarts: dict[tuple[str, int], bool]
    crash: CrashPoint | None
    # (trainer, first append, last append): those appends of that trainer find the database away
    outage: tuple[int, int, int] | None
    # (trainer, first read, last read): those reads of the log by a recovering process of that trainer
    # while it loads (pages of its fold, stream versions) find the connection killed
    fold_break: tuple[int, int, int] | None = None
    # The fleet (several trainers on one fleet of agents; issue 28).  `names`: agent key -> the name its
    # trainer and the agent itself know it by, where trainers' agents share names (each trainer's `ag0`
    # is its own agent); agents not in it are named by their key.
    names: dict[str, str] = field(default_factory=dict)
    # (owner, intruder): the intruder's first process tries to start with the owner's first agent among
    # its own, once the owner has started, and must be refused (one trainer per agent).
    intruder: tuple[int, int] | None = None
    # (owner, other, group index): once the owner reserved that group, the other submits its id too,
    # and that submit alone must be refused (GroupConflict).
    collision: tuple[int, int, int] | None = None
    # trainer -> its run pool (`max_run_connections`), smaller than its tries at once, on agents whose
    # model calls take a while: tries wait for a connection, and no lease may run out in that queue.
    pools: dict[int, int] = field(default_factory=dict)
    # Agents whose wall clock steps back a day at each of their restarts (their records' times go back).
    clock_back: frozenset[str] = frozenset()
    # The late /run's agent (`before_run`) restarts with its state directory lost, not kept: it forgot
    # the retire, runs the try, and holds a result of a try the log retired (a stray result).
    late_run_lost: bool = False
    # (agent, n-th /run to it): that /run is delivered to it again once its trainer's work is done,
    # the agent restarted with its state lost first (a duplicate delivery after a lost restart): the try
    # runs again, and its result is a stray of a try the log settled.
    replay: tuple[str, int] | None = None
    # The trainer whose state is rewound once its work is done: its processes restore to its newest
    # checkpoint, then to an older one (abandoning the newest's branch), then to the abandoned one
    # (which must be refused), then to its newest again; claims and checkpoints between.
    rewind: int | None = None
    # Every adopt-only /run reply is altered on its way back (its reward changed: a lying agent, a
    # corrupting proxy), so it no longer hashes to the digest its agent's receipt names.
    tamper: bool = False

    def name_of(self, key: str) -> str:
        return self.names.get(key, key)

    def describe(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "trainers": [
                {
                    "id": t.trainer_id,
                    "agents": list(t.agents),
                    "groups": [(g.group_id, g.agent, g.siblings) for g in t.groups],
                    "mode": t.mode,
                    "checkpoint": t.checkpoint,
                    "checkpoint_after": t.checkpoint_after,
                }
                for t in self.trainers
            ],
            "faults": {f"{a}/{k}#{n}": f for (a, k, n), f in sorted(self.faults.items())},
            "restarts": {
                f"{a}#{n}": ("kept" if keep else "lost") for (a, n), keep in sorted(self.restarts.items())
            },
            "crash": None if self.crash is None else self.crash.__dict__,
            "outage": self.outage,
            "fold_break": self.fold_break,
            "names": dict(sorted(self.names.items())),
            "intruder": self.intruder,
            "collision": self.collision,
            "pools": dict(sorted(self.pools.items())),
            "clock_back": sorted(self.clock_back),
            "late_run_lost": self.late_run_lost,
            "replay": self.replay,
            "rewind": self.rewind,
            "tamper": self.tamper,
        }


def plan_of(seed: int, tag: str = "", fleet: bool = True) -> Plan:
    """The schedule of `seed`: every number drawn from `random.Random(seed)`, nothing else.  `tag` goes
    into every id (trainers, agents, groups, checkpoints), so seeds replayed on one log do not meet.
    `fleet=False` leaves out the draws of several trainers on one fleet (shared names, an intruder, a
    group id collision, a small run pool, a stale prepare after a presumed abort, agent clocks stepped
    back at a restart, a late /run's agent restarted with its state lost, a /run delivered again after
    a lost restart, a trainer's state rewound to older and abandoned checkpoints, adopt replies altered
    in flight): the plans as they
    were before those existed, so the seeds that found bugs before them replay what found them."""
    rng = random.Random(seed)
    trainers: list[TrainerPlan] = []
    for t in range(rng.choice((1, 1, 2, 3))):
        tid = f"x{seed}{tag}-t{t}"
        agents = tuple(f"{tid}-a{j}" for j in range(rng.choice((1, 1, 2))))
        groups = tuple(
            GroupPlan(f"{tid}-g{j}", agents[j % len(agents)], rng.randint(2, 4))
            for j in range(rng.randint(2, 4))
        )
        trainers.append(
            TrainerPlan(
                tid,
                agents,
                groups,
                rng.choice(("sibling", "prompt_group")),
                rng.choice(("one_call", "split_commit", "split_abort")),
                rng.randint(0, len(groups)),
            )
        )
    names = [a for tp in trainers for a in tp.agents]
    faults: dict[tuple[str, CallKind, int], Fault] = {}
    for _ in range(rng.randint(0, 6)):
        faults[(rng.choice(names), rng.choice(CALL_KINDS), rng.randint(1, 6))] = rng.choice(FAULTS)
    restarts: dict[tuple[str, int], bool] = {}
    for _ in range(rng.choice((0, 0, 1, 1, 2))):
        restarts[(rng.choice(names), rng.randint(2, 40))] = rng.random() < 0.6
    crash: CrashPoint | None = None
    if rng.random() < 0.75:
        where: CrashWhere = rng.choice(("before_append", "after_append", "before_call", "after_call"))
        k = rng.randint(1, 14) if where.endswith("append") else rng.randint(1, 40)
        crash = CrashPoint(rng.randrange(len(trainers)), where, k, rng.random() < 0.35)
    outage: tuple[int, int, int] | None = None
    if rng.random() < 0.2:
        first = rng.randint(1, 10)
        outage = (rng.randrange(len(trainers)), first, first + rng.randint(0, 3))
        if rng.random() < 0.25:
            # Longer than the journal's outage budget: the coordinator stops and is recovered.  (Drawn
            # last, so the rest of every plan is what it was before this draw existed.)
            outage = (outage[0], first, outage[2] + 6)
    if crash is None and rng.random() < 0.6:
        # A stale owner's late /run after the agent restarted: the restarted agent must refuse a try
        # an earlier process of it retired.  (Drawn last, and only for plans with no crash point, so
        # every other plan is what it was before this draw existed.)
        crash = CrashPoint(rng.randrange(len(trainers)), "before_run", rng.randint(1, 4), True)
    fold_break: tuple[int, int, int] | None = None
    if rng.random() < 0.35:
        # The connection killed while a recovering process loads the log (drawn last, as above).
        first = rng.randint(1, 6)
        fold_break = (rng.randrange(len(trainers)), first, first + rng.randint(0, 2))
    shared_names, intruder, collision, pools = (
        _fleet(rng, f"x{seed}{tag}-", trainers, restarts) if fleet else ({}, None, None, {})
    )
    if fleet and crash is None and rng.random() < 0.8:
        crash = CrashPoint(rng.randrange(len(trainers)), "after_prepare", 1, True)
    restarted = sorted({a for a, _ in restarts})
    clock_back = frozenset(a for a in restarted if rng.random() < 0.5) if fleet else frozenset()
    # Drawn last, as above.
    late_run_lost = fleet and crash is not None and crash.where == "before_run" and rng.random() < 0.5
    # Drawn last, as above; not where an intruder tries an agent (a lost state directory loses the
    # agent's binding too, and the refusal is not what the schedule can ask for then).
    replay = (rng.choice(names), rng.randint(1, 3)) if fleet and rng.random() < 0.25 else None
    if intruder is not None:
        replay = None
    # Drawn last, as above.
    rewind = rng.randrange(len(trainers)) if fleet and rng.random() < 0.3 else None
    tamper = fleet and rng.random() < 0.5  # drawn last, as above
    return Plan(
        seed,
        f"x{seed}{tag}-",
        tuple(trainers),
        faults,
        restarts,
        crash,
        outage,
        fold_break,
        shared_names,
        intruder,
        collision,
        pools,
        clock_back,
        late_run_lost,
        replay,
        rewind,
        tamper,
    )


def _fleet(
    rng: random.Random, prefix: str, trainers: list[TrainerPlan], restarts: dict[tuple[str, int], bool]
) -> tuple[dict[str, str], tuple[int, int] | None, tuple[int, int, int] | None, dict[int, int]]:
    """The fleet's draws (drawn last, so the rest of every plan is what it was before they existed):
    trainers whose agents share names, or one that tries to drive another's agent; a group id two
    trainers submit; a run pool smaller than the tries at once."""
    names: dict[str, str] = {}
    intruder: tuple[int, int] | None = None
    collision: tuple[int, int, int] | None = None
    if len(trainers) >= 2:
        roll = rng.random()
        if roll < 0.3:
            names = {a: f"{prefix}ag{j}" for tp in trainers for j, a in enumerate(tp.agents)}
        elif roll < 0.55:
            owner, other = rng.sample(range(len(trainers)), 2)
            shared = trainers[owner].agents[0]
            # An agent that loses its state directory loses its binding too (docs/protocol.md): then
            # another trainer may bind it, and the refusal is not what the schedule can ask for.
            if not any(a == shared and not keep for (a, _), keep in restarts.items()):
                intruder = (owner, other)
        if rng.random() < 0.3:
            owner, other = rng.sample(range(len(trainers)), 2)
            collision = (owner, other, rng.randrange(len(trainers[owner].groups)))
    pools: dict[int, int] = {}
    if rng.random() < 0.15:
        pools[rng.randrange(len(trainers))] = rng.choice((1, 2))
    return names, intruder, collision, pools
