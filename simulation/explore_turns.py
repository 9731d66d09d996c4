"""Turn-level resume under faults: seeded schedules of multi-turn rollouts at target level `turn`.

One seed is one schedule: a few rollouts of 3 to 6 turns, each turn a model call, then a tool call on
each resource the rollout uses (the reference resources server's `bank`, export/restore, and for some
rollouts its `mailer`, restart-only), then the boundary's commit.  A seeded scheduler steps the live
tries one step at a time and, between any two steps (so at every turn boundary and inside a turn),
may put a fault: the trainer crashing (recovery retires each live try and mints its replacement,
which resumes the offered boundary), a checkpoint retiring one try (also while it is taking a
continuation up), the agent restarting with its state kept or lost, a continuation's payload lost or
corrupted, and a stale owner (an earlier trainer's late `/run`) asking to resume an earlier boundary
of a rollout under a try of its own.

The agent's decisions are the real ones (`participant.continuations`: the index fold, `decide_resume`,
`check_continuation`; `participant.states.resume_decision`), the trainer's too
(`projections.group_core.continuation_to_resume`), and the resources are the reference server's own
book (`gym_resources.book.Book`).  Then a checker that reads only what happened (model calls made,
boundaries committed, the resources' journal) asserts: no completed turn of a lineage was generated
again on it; no side effect stands twice; every bank session a finished try played holds exactly one
deposit per turn it carried; every resume read one continuation; every rollout finished or ran out
of its budget.  A seed replays exactly: `ledger simulate --explore 1 --first-seed N`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from eventstore.events import PromptRef
from gym_resources.book import Book, ClassError
from participant.continuations import (
    Continuation,
    ContinuationIndex,
    ContinuationReadError,
    Declined,
    IndexRecord,
    check_continuation,
    decide_resume,
    turn_figures,
)
from participant.states import RestartFromPrompt, resume_decision
from projections.group_core import continuation_to_resume
from projections.ledger import AttemptState, GroupState
from protocol.digests import sha256_digest
from protocol.ids import capture_key
from protocol.resources import MutationKey
from protocol.wire import ContinuationRef, ResourceRevision, TokenEntry

MAX_TRIES = 12
STEP_BOUND = 3000
PROMPT = sha256_digest(b"the prompt of every rollout of the schedule")
Phase = Literal["resuming", "call", "tools", "commit"]
Fault = Literal[
    "trainer_crash",
    "checkpoint",
    "agent_restart",
    "agent_wiped",
    "payload_lost",
    "payload_corrupt",
    "stale_owner",
]
FAULT_P: dict[Fault, float] = {
    "trainer_crash": 0.02,
    "checkpoint": 0.03,
    "agent_restart": 0.01,
    "agent_wiped": 0.005,
    "payload_lost": 0.01,
    "payload_corrupt": 0.01,
    "stale_owner": 0.02,
}


@dataclass
class Run:
    """A try at the agent."""

    rollout_id: str
    attempt_index: int
    lineage: str
    turn_done: int = 0
    phase: Phase = "call"
    stale: bool = False
    resuming: ContinuationRef | None = None
    resumed: ContinuationRef | None = None
    tokens: list[TokenEntry] = field(default_factory=list)
    last: str | None = None


@dataclass
class Rollout:
    rollout_id: str
    n_turns: int
    resources: tuple[str, ...]
    group: GroupState
    current: int = 0
    finished_by: int | None = None
    dead: bool = False


@dataclass
class TurnSchedule:
    seed: int
    rollouts: dict[str, Rollout] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    # Every model call made: (lineage, turn) -> how many times; and the boundaries committed.
    generated: dict[tuple[str, int], int] = field(default_factory=dict)
    committed: set[tuple[str, int]] = field(default_factory=set)
    regenerated: list[str] = field(default_factory=list)
    # Lineages whose try finished: lineage -> turns it carried (n_turns), for the bank check.
    finished_lineages: dict[str, tuple[str, int]] = field(default_factory=dict)
    resumes: int = 0
    reads: int = 0
    declined: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    book: Book = field(default_factory=Book)
    index: ContinuationIndex = field(default_factory=ContinuationIndex)
    turns_resumed: int = 0
    turns_redone: int = 0
    late_tool_calls: int = 0


def _group(rollout_id: str) -> GroupState:
    return GroupState(
        group_id=rollout_id.rpartition("_g")[0],
        agent_name="agent",
        mode="sibling",
        expected_generations=1,
        max_tries=MAX_TRIES,
        prompt_ref=PromptRef(sample_id=rollout_id, task_name="turns"),
        target_level="turn",
    )


def run_turn_schedule(seed: int) -> TurnSchedule:
    rng = random.Random(f"turns|{seed}")
    s = TurnSchedule(seed=seed)
    for i in range(rng.randint(1, 3)):
        rid = f"t{seed}x{i}_g0"
        uses = ("bank", "mailer") if rng.random() < 0.25 else ("bank",)
        s.rollouts[rid] = Rollout(rid, rng.randint(3, 6), uses, _group(rid))
    payloads: dict[str, bytes] = {}
    live: dict[tuple[str, int], Run] = {}
    taking: set[str] = set()
    stale_index = 100

    def line(kind: str, run: Run, digest: str, **extra: object) -> None:
        rec = IndexRecord.model_validate(
            {
                "kind": kind,
                "rollout_id": run.rollout_id,
                "attempt_index": run.attempt_index,
                "digest": digest,
                "execution_generation": 1,
                "at": float(s.steps),
                **extra,
            }
        )
        s.index.apply(rec)

    def dispatch(
        rollout: Rollout, n: int, continue_from: ContinuationRef | None, stale: bool = False
    ) -> None:
        run = Run(rollout.rollout_id, n, capture_key(rollout.rollout_id, n), stale=stale)
        live[(run.rollout_id, n)] = run
        if continue_from is None:
            return
        decided = decide_resume(
            continue_from.digest,
            rollout_id=run.rollout_id,
            prompt_digest=PROMPT,
            index=s.index,
            live={k for k in live if k != (run.rollout_id, n)},
        )
        if isinstance(decided, ContinuationRef) and decided.digest in taking:
            decided = Declined("already_resumed", "another try is taking it up now")
        if isinstance(decided, Declined):
            decline(run, continue_from.digest, decided)
            return
        taking.add(decided.digest)
        run.resuming, run.phase = decided, "resuming"

    def decline(run: Run, digest: str, declined: Declined) -> None:
        s.declined[declined.reason] = s.declined.get(declined.reason, 0) + 1
        line("declined", run, digest, reason=declined.reason)
        run.phase = "call"

    def take_up(run: Run) -> None:
        """The rest of a resume (one read, the restore, the durable `resumed` line)."""
        ref = run.resuming
        assert ref is not None
        run.resuming = None
        try:
            s.reads += 1
            content = payloads.get(ref.digest)
            if content is None:
                raise ContinuationReadError("continuation_lost", "not in the payload store")
            continuation = check_continuation(ref, content)
            restore = resume_decision(continuation.resources)
            assert not isinstance(restore, RestartFromPrompt)
            for r in restore.restore:
                try:
                    s.book.restore(r.name, r.session, r.revision)
                except ClassError as exc:
                    raise ContinuationReadError("restore_failed", str(exc)) from None
        except ContinuationReadError as exc:
            taking.discard(ref.digest)
            decline(run, ref.digest, Declined(exc.reason, exc.detail))
            return
        taking.discard(ref.digest)
        line("resumed", run, ref.digest)
        s.resumes += 1
        run.lineage, run.turn_done, run.resumed, run.last = ref.lineage, ref.turn, ref, ref.digest
        run.tokens = continuation.token_entries()
        run.phase = "call"

    def step(run: Run) -> None:
        rollout = s.rollouts[run.rollout_id]
        turn = run.turn_done + 1
        if run.phase == "resuming":
            take_up(run)
        elif run.phase == "call":
            where = (run.lineage, turn)
            if where in s.committed:
                s.regenerated.append(f"{run.lineage} turn {turn} generated again by try #{run.attempt_index}")
            s.generated[where] = s.generated.get(where, 0) + 1
            run.tokens.append(
                TokenEntry(
                    rollout_id=capture_key(run.rollout_id, run.attempt_index),
                    model_call_id=f"call-{turn}",
                    prompt_token_ids=[turn],
                    generation_token_ids=[turn, turn],
                    generation_log_probs=[-1.0, -1.0],
                )
            )
            if turn == rollout.n_turns:
                finish(run)
            else:
                run.phase = "tools"
        elif run.phase == "tools":
            tools(run, turn)
            run.phase = "commit"
        else:
            resources = [
                ResourceRevision(
                    name=name,
                    resource_class=s.book.resource(name).resource_class,
                    session=run.lineage,
                    revision=s.book.export(name, run.lineage) if name == "bank" else 0,
                )
                for name in rollout.resources
            ]
            continuation = Continuation(
                rollout_id=run.rollout_id,
                lineage=run.lineage,
                source_attempt=run.attempt_index,
                turn=turn,
                prompt_digest=PROMPT,
                tokens=[t.record() for t in run.tokens],
                state={"turns_done": turn},
                resources=resources,
                previous=run.last,
            )
            content = continuation.encode()
            digest = sha256_digest(content)
            payloads[digest] = content
            line("committed", run, digest, ref=continuation.ref(digest).model_dump(mode="json"))
            s.committed.add((run.lineage, turn))
            run.turn_done, run.phase, run.last = turn, "call", digest

    def tools(run: Run, turn: int) -> None:
        for i, name in enumerate(s.rollouts[run.rollout_id].resources):
            key = MutationKey(rollout_id=run.rollout_id, lineage=run.lineage, turn=turn, call=i)
            args = {"amount": 10 * turn} if name == "bank" else {"to": "u", "body": f"turn {turn}"}
            s.book.call(
                name, run.lineage, key, "deposit" if name == "bank" else "send", args, run.attempt_index
            )

    # Tool calls in flight when their try was retired or its agent restarted: the resources server
    # still gets them, at some later step, after the try's replacement may have restored the session
    # and run that turn again.  Drawn from a stream of their own (every other draw of a seed is what it
    # was); the calls' keys make each mutation land once, whichever comes first.
    late = random.Random(f"turns-late|{seed}")
    in_flight: list[tuple[Run, int]] = []

    def abandoned(run: Run) -> None:
        if run.phase == "tools" and late.random() < 0.5:
            in_flight.append((run, run.turn_done + 1))

    def finish(run: Run) -> None:
        del live[(run.rollout_id, run.attempt_index)]
        rollout = s.rollouts[run.rollout_id]
        s.finished_lineages[f"{run.lineage}@{run.attempt_index}"] = (run.lineage, rollout.n_turns)
        if not run.stale and rollout.current == run.attempt_index and rollout.finished_by is None:
            rollout.finished_by = run.attempt_index

    def retire(rollout: Rollout, agent_has_state: bool = True) -> None:
        """The trainer retires the rollout's current try (cancelled if it runs) and mints its
        replacement, which resumes what the agent offered (the real decision)."""
        n = rollout.current
        gone = live.pop((rollout.rollout_id, n), None)
        if gone is not None:
            abandoned(gone)
        if gone is not None and gone.resuming is not None:
            taking.discard(gone.resuming.digest)
        offer = s.index.offer(rollout.rollout_id, n) if agent_has_state else None
        attempt = AttemptState(rollout_id=rollout.rollout_id, attempt_index=n, offered=offer)
        if n + 1 >= MAX_TRIES:
            rollout.dead = True
            return
        rollout.current = n + 1
        dispatch(rollout, n + 1, continuation_to_resume(rollout.group, attempt, offer))

    for rollout in s.rollouts.values():
        dispatch(rollout, 0, None)

    def open_rollouts() -> list[Rollout]:
        return [r for r in s.rollouts.values() if r.finished_by is None and not r.dead]

    while open_rollouts() and s.steps < STEP_BOUND:
        s.steps += 1
        fault = next((f for f, p in FAULT_P.items() if rng.random() < p), None)
        if fault is not None:
            s.faults[fault] = s.faults.get(fault, 0) + 1
        if fault == "trainer_crash":  # recovery retires every open rollout's try and replaces it
            for rollout in open_rollouts():
                retire(rollout)
        elif fault == "checkpoint":
            # Retires one try: preferably one taking a continuation up (a checkpoint racing a resume).
            runs = [r for r in live.values() if not r.stale]
            racing = [r for r in runs if r.phase == "resuming"]
            if runs:
                retire(s.rollouts[rng.choice(racing or runs).rollout_id])
        elif fault in ("agent_restart", "agent_wiped"):
            for run in live.values():
                abandoned(run)
            live.clear()
            taking.clear()
            if fault == "agent_wiped":
                payloads.clear()
                s.index = ContinuationIndex()
            for rollout in open_rollouts():  # each try's /run failed: retired, replaced
                retire(rollout)
        elif fault == "payload_lost" and payloads:
            del payloads[rng.choice(sorted(payloads))]
        elif fault == "payload_corrupt" and payloads:
            digest = rng.choice(sorted(payloads))
            payloads[digest] = payloads[digest][:-2] + b"}}"
        elif fault == "stale_owner":
            # A late /run of an earlier trainer: a boundary of the rollout the log once offered.
            refs = sorted(
                (ref for ref in s.index.committed.values() if ref.rollout_id in s.rollouts),
                key=lambda r: r.digest,
            )
            if refs:
                ref = rng.choice(refs)
                stale_index += 1
                dispatch(s.rollouts[ref.rollout_id], stale_index, ref, stale=True)
        if in_flight and late.random() < 0.2:
            gone_run, turn = in_flight.pop(late.randrange(len(in_flight)))
            tools(gone_run, turn)
            s.late_tool_calls += 1
        runs = sorted(live.values(), key=lambda r: (r.rollout_id, r.attempt_index))
        if runs:
            step(rng.choice(runs))
    figures = turn_figures(s.index)
    s.turns_resumed, s.turns_redone = figures.turns_resumed, figures.turns_redone
    return s


def check_turns(s: TurnSchedule) -> list[str]:
    found = list(s.regenerated)
    found += [f"side effect twice: {k}" for k in s.book.effects.twice]
    for lineage, n_turns in s.finished_lineages.values():
        session = s.book.sessions.get(("bank", lineage))
        if session is None:
            continue
        want = sum(10 * t for t in range(1, n_turns))
        got = session.states[-1].get("balance", 0)
        if got != want:
            found.append(f"bank session {lineage} holds {got}, not one deposit per turn ({want})")
    if s.reads != s.resumes + sum(
        n
        for reason, n in s.declined.items()
        if reason in ("continuation_lost", "continuation_corrupt", "restore_failed")
    ):
        found.append(f"{s.reads} continuation reads for {s.resumes} resumes: one read each")
    for rollout in s.rollouts.values():
        if rollout.finished_by is None and not rollout.dead:
            found.append(f"{rollout.rollout_id} neither finished nor dead-lettered after {s.steps} steps")
    return found


@dataclass
class TurnExploration:
    seeds: int
    first_seed: int
    rollouts: int = 0
    finished: int = 0
    dead_lettered: int = 0
    resumes: int = 0
    turns_resumed: int = 0
    turns_redone: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    declined: dict[str, int] = field(default_factory=dict)
    side_effects: int = 0
    # Tool calls of retired tries that landed late, and calls answered from the record (their key seen).
    late_tool_calls: int = 0
    repeats: int = 0
    violations: dict[int, list[str]] = field(default_factory=dict)


def explore_turns(seeds: int, first_seed: int = 0) -> TurnExploration:
    result = TurnExploration(seeds=seeds, first_seed=first_seed)
    for seed in range(first_seed, first_seed + seeds):
        s = run_turn_schedule(seed)
        result.rollouts += len(s.rollouts)
        result.finished += sum(1 for r in s.rollouts.values() if r.finished_by is not None)
        result.dead_lettered += sum(1 for r in s.rollouts.values() if r.dead)
        result.resumes += s.resumes
        result.turns_resumed += s.turns_resumed
        result.turns_redone += s.turns_redone
        result.side_effects += s.book.effects.applied
        result.late_tool_calls += s.late_tool_calls
        result.repeats += s.book.effects.repeats
        for k, v in s.faults.items():
            result.faults[k] = result.faults.get(k, 0) + v
        for k, v in s.declined.items():
            result.declined[k] = result.declined.get(k, 0) + v
        found = check_turns(s)
        if found:
            result.violations[seed] = found
    return result
