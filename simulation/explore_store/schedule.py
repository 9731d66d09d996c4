"""Running one schedule: each trainer's processes (the first, a recovering one after a crash or an
outage, a successor beside a stale one), each doing its workload against the agents and the log."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path
from typing import Any

from eventstore import open_store
from eventstore.events import PromptRef
from participant.driver import DriverBinding
from projections.recovery import RestoreRefused
from simulation.explore_store.agent import Agent
from simulation.explore_store.plan import CheckpointKind, GroupPlan, Plan
from simulation.explore_store.process import (
    SEED_DEADLINE_S,
    Incarnation,
    ScheduleRun,
    TrainerCrashed,
    ended,
    settle,
    spawn,
    task_factory,
    waiting,
)
from simulation.explore_store.retention import prune_and_collect
from simulation.explore_store.seams import FaultyPool, FaultyStore
from trainer.checkpoint import PreparedCheckpoint
from trainer.coordinator import RolloutCoordinator
from trainer.errors import (
    AgentShared,
    AlreadyClaimed,
    ClaimWhilePrepared,
    CoordinatorStopped,
    FencedOff,
    GroupConflict,
)
from trainer.gym import GymClient
from trainer.gym.errors import GymError, TrainerConflictError

# The coordinator's settings in a schedule: short, so that a seed takes about a second.
SETTINGS: dict[str, Any] = {
    "rollout_timeout_s": 3.0,
    "prepare_timeout_s": 2.0,
    "park_grace_s": 0.3,
    "max_tries": 4,
    "outage_budget_s": 1.5,
    "reconcile_every_s": 0.25,
}
PAYLOAD: dict[str, Any] = {"responses_create_params": {"input": [{"role": "user", "content": "1+1?"}]}}
# How long a stale coordinator may go on once its successor finished before it is stopped here.
STALE_GRACE_S = 3.0


# A model call's extra seconds at the agents of a trainer with a small run pool, and that trainer's
# lease: with its tries at once behind one or two connections, the queue outlasts a try's lease.
SLOW_CALL_S = 0.12
POOLED_LEASE_S = 1.0
# How long a fleet gate (the owner started; the owner reserved the group) waits before giving up.
FLEET_GATE_S = 20.0


def _client(agent: Agent, inc: Incarnation, run: ScheduleRun, pool: int | None = None) -> GymClient:
    client = GymClient(
        f"http://{agent.key}.sim", agent.name, control_timeout_s=5.0, max_run_connections=pool or 1024
    )
    faulty = FaultyPool(agent, inc, run)
    client._run = client._control = client._phases = faulty  # type: ignore[assignment]
    return client


async def _workload(run: ScheduleRun, t: int, inc: Incarnation, recover: bool) -> None:
    """What one trainer process does: start (or recover), submit its groups, claim them for training as
    they seal, one checkpoint, wait until everything is done and paid, close."""
    plan = run.plan
    tp = plan.trainers[t]
    store = FaultyStore(await asyncio.to_thread(open_store, run.url), inc, run)
    pool = plan.pools.get(t)
    clients = {plan.name_of(key): _client(run.agents[key], inc, run, pool) for key in tp.agents}
    settings = {**SETTINGS, "mode": tp.mode, "trainer_id": tp.trainer_id}
    if pool is not None:
        settings["rollout_timeout_s"] = POOLED_LEASE_S
    try:
        if plan.intruder is not None and plan.intruder[1] == t and not recover and not run.intruded.is_set():
            try:
                await _intrude(run, t, inc, store, clients, settings)
            finally:
                run.intruded.set()  # tried, or never to be (this process died in it): the owner may close
        if recover:
            coord = await RolloutCoordinator.recover(store, dict(clients), **settings)
        else:
            coord = RolloutCoordinator(store, dict(clients), **settings)
            inc.coord = coord
            await coord.start()
        inc.coord = coord
        inc.ready.set()
        run.started(t).set()
        for g in tp.groups:
            if not coord.ledger.knows_group(g.group_id):
                prompt = PromptRef(sample_id=g.group_id, task_name="arith")
                await coord.submit(g.group_id, prompt, plan.name_of(g.agent), g.siblings, PAYLOAD)
            run.reserved_gate(g.group_id).set()
        if plan.collision is not None and plan.collision[1] == t and not run.collided:
            await _collide(run, t, coord)
        checkpointed = False
        claimed_here = 0
        while True:
            # A kill's cancellation can be lost in Python 3.11's `wait_for` (when the wait ends at the
            # same moment): a dead process must not go on looping here.
            inc.check()
            _raise_if_stopped(coord)
            sealed = coord.sealed_unclaimed()
            # Before a split checkpoint, the last group sealed is claimed while the trainer saves (the
            # claim is refused until the decision: ClaimWhilePrepared), and after it.
            due_with = claimed_here + len(sealed) - 1 >= tp.checkpoint_after or not coord.open_groups()
            held_back = sealed[-1:] if not checkpointed and tp.checkpoint != "one_call" and due_with else []
            for group in sealed[: len(sealed) - len(held_back)]:
                await coord.claim_for_training(group.group_id, run.claims[t])
                run.claims[t] += 1
                claimed_here += 1
            if not checkpointed and (
                held_back or claimed_here >= tp.checkpoint_after or not coord.open_groups()
            ):
                checkpointed = True
                await _checkpoint(run, t, coord, f"{tp.trainer_id}-ck{inc.number}", tp.checkpoint)
                continue
            if checkpointed and not coord.open_groups() and not coord.sealed_unclaimed():
                break
            await coord.journal.wait_changed(0.05)
        await coord.wait_idle(20.0)
        inc.work_done.set()
        await inc.may_close.wait()
        await _until_intruded(run, t)
        if inc is run.incarnations[t][-1]:
            await _replay_on_lost_state(run, t)
        await _late_runs_landed(run)
        await coord.checkpointer.recover()
        await _until_released(run, t, coord)
        _raise_if_stopped(coord)
        await coord.close()
    finally:
        if inc.coord is not None and not inc.crashed:
            with contextlib.suppress(BaseException):
                # A process stopped by an outage closes here, releasing its agents as any close does.
                await _until_intruded(run, t)
                await inc.coord.close()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(store.close)


async def _until_intruded(run: ScheduleRun, t: int) -> None:
    """Before trainer `t` closes: if another trainer is to try the agent `t` owns, its close would
    release the agent for that try (an owner stopped by an outage closes too), so not before it."""
    if run.plan.intruder is not None and run.plan.intruder[0] == t:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.intruded.wait(), FLEET_GATE_S)


async def _replay_on_lost_state(run: ScheduleRun, t: int) -> None:
    """The plan's replay, by trainer `t`'s last process once its work is done: its agent restarts with
    its state directory lost and gets the recorded /run again, so the try runs a second time and the
    agent holds a result of a try the log settled.  The reconciliation that follows must release it."""
    for key in run.plan.trainers[t].agents:
        recorded = run.replays.pop(key, None)
        if recorded is None:
            continue
        subject, method, target, headers, body = recorded
        agent = run.agents[key]
        agent.restart(False)
        run.counts["agent_restarts_lost"] += 1
        run.replayed.add(subject)
        with contextlib.suppress(Exception):
            await agent.call(method, target, headers, body)
        run.counts["replays_on_lost_state"] += 1


async def _late_runs_landed(run: ScheduleRun) -> None:
    """Before the owner's last reconciliation: every late /run has reached its agent (within
    FLEET_GATE_S), so a stray result one of them left is there to be found."""
    pending = [f for f in run.late_runs if not f.done()]
    if pending:
        await asyncio.wait(pending, timeout=FLEET_GATE_S)


async def _until_released(run: ScheduleRun, t: int, coord: RolloutCoordinator) -> None:
    """After the last reconciliation: the retires owed (stray results) paid and their ACKs accepted,
    and trainer `t`'s agents holding no finished result, within FLEET_GATE_S, before the close (a
    reconciliation whose `/status` call a fault broke is done again by the coordinator's own loop,
    every `reconcile_every_s`; what is still held at the deadline, the checker names)."""

    def holding() -> bool:
        agents = [run.agents[key] for key in run.plan.trainers[t].agents]
        return any(agent.registry.status().completed_unacknowledged for agent in agents)

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(FLEET_GATE_S):
            while coord.retires.owed_agents() or holding():
                await asyncio.sleep(0.02)
        await coord.wait_idle(FLEET_GATE_S)


async def _intrude(
    run: ScheduleRun,
    t: int,
    inc: Incarnation,
    store: FaultyStore,
    clients: dict[str, GymClient],
    settings: dict[str, Any],
) -> None:
    """One trainer per agent: once the owner has started and the agent is bound to it (at the owner's
    start, or at its first call when a fault kept the agent from answering the start), this trainer's
    first process starts with the owner's first agent among its own.  That start must be refused
    (`AgentShared`) with nothing written; the process then starts on its own agents alone."""
    assert run.plan.intruder is not None
    owner = run.plan.intruder[0]
    key = run.plan.trainers[owner].agents[0]
    foreign = run.agents[key]
    try:
        async with asyncio.timeout(FLEET_GATE_S):
            await run.started(owner).wait()
            while not _bound_to(foreign, run.plan.trainers[owner].trainer_id):
                await asyncio.sleep(0.01)
    except TimeoutError:
        run.problems.append(f"{key} never bound to trainer {owner}: trainer {t}'s intrusion was not tried")
        return
    intruding = RolloutCoordinator(store, {**clients, foreign.name: _client(foreign, inc, run)}, **settings)
    run.refused_writers.append(intruding.journal.writer)
    try:
        await intruding.start()
    except AgentShared:
        run.counts["shared_agent_refused"] += 1
    else:
        # The agent did not answer the start (a restart or a fault at that call: the plan's calls are
        # counted, so which one it hits is the threads' doing): a start goes on without an agent away,
        # and binds it at its first call.  So the start is no refusal (its rows are its own), and the
        # agent must refuse this trainer at that first call instead.
        run.refused_writers.remove(intruding.journal.writer)
        await _refused_at_first_call(run, t, key, owner, intruding.ctx.client(foreign.name))
    finally:
        # Not started (or started in error): closed without a word to the log.
        with contextlib.suppress(Exception):
            await intruding.close()


async def _refused_at_first_call(run: ScheduleRun, t: int, key: str, owner: int, client: GymClient) -> None:
    """The intruder's own call binding the agent (what its first call would do) is refused, once the
    agent answers at all (within FLEET_GATE_S, jittered retries)."""
    deadline = asyncio.get_running_loop().time() + FLEET_GATE_S
    while True:
        try:
            await client.bind_driver(run.plan.trainers[t].trainer_id)
        except TrainerConflictError:
            run.counts["shared_agent_refused_at_first_call"] += 1
            return
        except GymError as exc:
            if asyncio.get_running_loop().time() > deadline:
                run.problems.append(f"{key} never answered trainer {t}'s intrusion: {exc}")
                return
            await asyncio.sleep(random.uniform(0.02, 0.1))
            continue
        run.problems.append(f"trainer {t} bound {key}, an agent trainer {owner} drives")
        return


def _bound_to(agent: Agent, trainer_id: str | None) -> bool:
    """The agent's durable binding (participant.driver) names `trainer_id`."""
    binding = DriverBinding(agent.name, agent.config.resolved_state_dir)
    return binding.bound and binding.trainer_id == trainer_id


async def _collide(run: ScheduleRun, t: int, coord: RolloutCoordinator) -> None:
    """A group id another trainer reserved: once the owner's submit returned, this trainer submits
    the same id (to its own agent).  That submit alone is refused (`GroupConflict`)."""
    assert run.plan.collision is not None
    owner, _, index = run.plan.collision
    gid = run.plan.trainers[owner].groups[index].group_id
    try:
        await asyncio.wait_for(run.reserved_gate(gid).wait(), FLEET_GATE_S)
    except TimeoutError:
        run.problems.append(f"trainer {owner} never reserved {gid}: trainer {t}'s collision was not tried")
        run.collided = True
        return
    tp = run.plan.trainers[t]
    prompt = PromptRef(sample_id=gid, task_name="arith")
    try:
        await coord.submit(gid, prompt, run.plan.name_of(tp.agents[0]), 2, PAYLOAD)
    except GroupConflict:
        run.counts["group_conflicts"] += 1
    else:
        run.problems.append(f"trainer {t}'s submit of {gid}, which trainer {owner} reserved, was accepted")
    run.collided = True


def _raise_if_stopped(coord: RolloutCoordinator) -> None:
    if coord.journal.fenced is not None:
        raise coord.journal.fenced
    if coord.journal.stopped is not None:
        raise coord.journal.stopped
    if coord.errors:
        raise coord.errors[0]


async def _checkpoint(
    run: ScheduleRun, t: int, coord: RolloutCoordinator, cid: str, kind: CheckpointKind
) -> None:
    if kind == "one_call":
        await coord.checkpoint(cid)
        return
    prepared = await coord.prepare_checkpoint(cid)
    if isinstance(prepared, PreparedCheckpoint):
        await _claims_while_prepared(run, t, coord)
        if kind == "split_commit":
            await coord.commit_checkpoint(cid)
        else:
            await coord.abort_checkpoint(cid, "the trainer chose to abort (schedule)")


async def _claims_while_prepared(run: ScheduleRun, t: int, coord: RolloutCoordinator) -> None:
    """The trainer's training loop going on while it saves: a claim between the prepare and the
    decision must be refused (`ClaimWhilePrepared`), as the cut holds exactly the claims it saved with
    (the auditor's no-claim-while-prepared); the group is claimed after the decision."""
    for group in coord.sealed_unclaimed():
        try:
            await coord.claim_for_training(group.group_id, run.claims[t])
        except ClaimWhilePrepared:
            run.counts["claims_refused_while_prepared"] += 1
        else:
            run.claims[t] += 1


async def _drive_trainer(run: ScheduleRun, t: int) -> None:
    """Runs the trainer's processes: the first; after a crash (or a database outage that stopped it) a
    recovering one; at a stale crash point a recovering one while the first goes on."""
    loop = asyncio.get_running_loop()
    crash = run.plan.crash if run.plan.crash is not None and run.plan.crash.trainer == t else None
    incs = run.incarnations.setdefault(t, [])
    recover = False
    while True:
        if len(incs) > 4:
            run.problems.append(f"trainer {t}: more than 4 processes were needed")
            return
        inc = Incarnation(t, len(incs), crash if not incs else None, loop)
        inc.may_close.set()
        incs.append(inc)
        task = spawn(inc, _workload(run, t, inc, recover))
        stale_wait = asyncio.ensure_future(inc.stale_hit.wait())
        await asyncio.wait({task, stale_wait}, return_when=asyncio.FIRST_COMPLETED)
        stale_wait.cancel()
        recover = True
        if inc.stale_hit.is_set() and not task.done():
            run.counts["stale_coordinators"] += 1
            await _stale_takeover(run, t, inc, task)
            return
        error = ended(task)
        if error is None:
            return
        if isinstance(error, TrainerCrashed | asyncio.CancelledError):
            run.counts["trainer_crashes"] += 1
            inc.kill()
            await settle(inc)
            continue
        if isinstance(error, CoordinatorStopped):
            run.counts["outage_stops"] += 1
            continue
        run.problems.append(f"trainer {t} process {inc.number} failed: {type(error).__name__}: {error}"[:400])
        return


async def _stale_takeover(
    run: ScheduleRun, t: int, stale: Incarnation, stale_task: asyncio.Task[None]
) -> None:
    """The successor recovers while `stale` is held at its crash point; then `stale` goes on.  The
    successor must finish; the stale one must be fenced (or finish harmlessly)."""
    loop = asyncio.get_running_loop()
    incs = run.incarnations[t]
    successor = Incarnation(t, len(incs), None, loop)
    incs.append(successor)
    task = spawn(successor, _workload(run, t, successor, True))
    # The stale process goes on once its successor has taken the owner epoch and recovered.
    ready = asyncio.ensure_future(successor.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    stale.released.set()
    # The successor works while the stale one goes on; it reconciles every agent and closes only once
    # the stale one has stopped (a live owner outlasts a stale process: whatever that one did at an
    # agent before its fence stopped it, e.g. prepared a checkpoint the log aborted, is put right).
    work_done = asyncio.ensure_future(successor.work_done.wait())
    await asyncio.wait({task, work_done}, return_when=asyncio.FIRST_COMPLETED)
    work_done.cancel()
    done, _ = await asyncio.wait({stale_task}, timeout=STALE_GRACE_S)
    if stale_task in done:
        stale_error = ended(stale_task)
        if isinstance(stale_error, FencedOff):
            run.counts["stale_fenced"] += 1
        elif isinstance(stale_error, AlreadyClaimed):
            # Its claim was refused before its append: the fold already showed the successor's claim.
            run.counts["stale_refused_claim"] += 1
        elif stale_error is None:
            run.counts["stale_finished"] += 1
        elif not isinstance(stale_error, CoordinatorStopped):
            run.problems.append(
                f"trainer {t}: the stale process failed: {type(stale_error).__name__}: {stale_error}"[:400]
            )
    else:
        run.counts["stale_stopped_idle"] += 1
    stale.kill()
    await settle(stale)
    successor.may_close.set()
    await asyncio.wait({task})
    error = ended(task)
    if error is not None:
        if isinstance(error, FencedOff):
            run.problems.append(f"trainer {t}: the newest owner was fenced off: {error}"[:400])
        elif isinstance(error, CoordinatorStopped):
            run.counts["outage_stops"] += 1
            await _finish_after(run, t)
        else:
            run.problems.append(f"trainer {t}: the successor failed: {type(error).__name__}: {error}"[:400])


async def _finish_after(run: ScheduleRun, t: int) -> None:
    loop = asyncio.get_running_loop()
    incs = run.incarnations[t]
    inc = Incarnation(t, len(incs), None, loop)
    inc.may_close.set()
    incs.append(inc)
    task = spawn(inc, _workload(run, t, inc, True))
    await asyncio.wait({task})
    error = ended(task)
    if error is not None:
        run.problems.append(f"trainer {t}: the last process failed: {type(error).__name__}: {error}"[:400])


async def _trainer(run: ScheduleRun, t: int) -> None:
    """Trainer `t`'s processes, then (the plan's rewind) its state rewound."""
    await _drive_trainer(run, t)
    if run.plan.rewind == t and not run.problems:
        await _rewind(run, t)


async def _rewind(run: ScheduleRun, t: int) -> None:
    """Trainer `t`'s state rewound, once its work is done, as a trainer loading older checkpoints
    would: a process restores to its newest checkpoint, claims what that rolled back, checkpoints
    (`rw1`), trains one more group and checkpoints again (`rw2`); the next restores to `rw1` (older:
    `rw2`'s branch is abandoned, the group's claim rolled back) and claims the group again, legally,
    then checkpoints (`rw3`); the next names `rw2`, a state that trained the group on the abandoned
    branch, and must be refused (`RestoreRefused`); the last restores to the newest (`rw3`).  The
    checker finds any group a state trained that is claimed again after a restore."""
    tid = run.plan.trainers[t].trainer_id
    extra = GroupPlan(f"{tid}-rw-g0", run.plan.trainers[t].agents[0], 2)
    rw1 = await _rewind_process(run, t, None, f"{tid}-rw1")
    rw2 = await _rewind_process(run, t, None, f"{tid}-rw2", extra) if rw1 is not None else None
    if rw1 is None or rw2 is None:
        run.counts["rewinds_without_checkpoints"] += 1  # a fault aborted every try of one of them
        return
    await _rewind_process(run, t, rw1, f"{tid}-rw3")
    run.counts["restores_to_older"] += 1
    try:
        await _rewind_process(run, t, rw2, None)
    except RestoreRefused:
        run.counts["abandoned_restores_refused"] += 1
    else:
        run.counts["abandoned_restores_accepted"] += 1  # the checker judges what that trained
    await _rewind_process(run, t, None, None)


async def _rewind_process(
    run: ScheduleRun, t: int, restore_to: str | None, checkpoint: str | None, extra: GroupPlan | None = None
) -> str | None:
    """One process of the rewind: recovers trainer `t` restoring to `restore_to` (None: its newest),
    claims every sealed group left unclaimed, submits `extra` and claims it once sealed, then commits
    a checkpoint named `checkpoint` (tried under two more ids if a fault aborts it); its id, or None.  A
    process a database outage stopped is followed by another doing the same (at most 3)."""
    loop = asyncio.get_running_loop()
    incs = run.incarnations[t]
    for _ in range(3):
        inc = Incarnation(t, len(incs), None, loop)
        inc.may_close.set()
        incs.append(inc)
        task = spawn(inc, _rewound(run, t, inc, restore_to, checkpoint, extra))
        await asyncio.wait({task})
        error = ended(task)
        if error is None:
            return task.result()
        if isinstance(error, RestoreRefused):
            raise error
        if not isinstance(error, CoordinatorStopped):
            what = f"trainer {t}: rewind process {inc.number} failed: {type(error).__name__}: {error}"
            run.problems.append(what[:400])
            return None
        run.counts["outage_stops"] += 1
    run.problems.append(f"trainer {t}: the rewind stopped three times")
    return None


async def _rewound(
    run: ScheduleRun,
    t: int,
    inc: Incarnation,
    restore_to: str | None,
    checkpoint: str | None,
    extra: GroupPlan | None,
) -> str | None:
    plan = run.plan
    tp = plan.trainers[t]
    store = FaultyStore(await asyncio.to_thread(open_store, run.url), inc, run)
    clients = {plan.name_of(key): _client(run.agents[key], inc, run) for key in tp.agents}
    settings = {**SETTINGS, "mode": tp.mode, "trainer_id": tp.trainer_id}
    try:
        coord = await RolloutCoordinator.recover(store, dict(clients), restore_to=restore_to, **settings)
        inc.coord = coord
        if extra is not None and not coord.ledger.knows_group(extra.group_id):
            prompt = PromptRef(sample_id=extra.group_id, task_name="arith")
            await coord.submit(extra.group_id, prompt, plan.name_of(extra.agent), extra.siblings, PAYLOAD)
        async with asyncio.timeout(FLEET_GATE_S):
            while True:
                _raise_if_stopped(coord)
                for group in coord.sealed_unclaimed():
                    await coord.claim_for_training(group.group_id, run.claims[t])
                    run.claims[t] += 1
                if not coord.open_groups() and not coord.sealed_unclaimed():
                    break
                await coord.journal.wait_changed(0.05)
        committed = None
        for cid in [] if checkpoint is None else [checkpoint, *(f"{checkpoint}-{k}" for k in range(1, 3))]:
            if (await coord.checkpoint(cid)).committed:
                committed = cid
                break
        await coord.wait_idle(FLEET_GATE_S)
        await coord.checkpointer.recover()
        await _until_released(run, t, coord)
        _raise_if_stopped(coord)
        await coord.close()
        return committed
    finally:
        if inc.coord is not None and not inc.crashed:
            with contextlib.suppress(BaseException):
                await inc.coord.close()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(store.close)


async def run_schedule(plan: Plan, url: str, workdir: Path) -> ScheduleRun:
    """Runs `plan` on the log at `url` with its agents' state under `workdir`; returns what happened
    (the checker reads the log and the agents afterwards)."""
    agents = {
        key: Agent(
            key,
            plan.name_of(key),
            workdir / key,
            plan.seed,
            SLOW_CALL_S if t in plan.pools else 0.0,
            key in plan.clock_back,
        )
        for t, tp in enumerate(plan.trainers)
        for key in tp.agents
    }
    run = ScheduleRun(plan, url, agents)
    run.counts["shared_name_plans"] += bool(plan.names)
    run.counts["pooled_trainers"] += len(plan.pools)
    loop = asyncio.get_running_loop()
    previous = loop.get_task_factory()
    loop.set_task_factory(task_factory)
    try:
        drivers = [asyncio.create_task(_trainer(run, t)) for t in range(len(plan.trainers))]
        done, pending = await asyncio.wait(drivers, timeout=SEED_DEADLINE_S)
        for task in pending:
            task.cancel()
        if pending:
            run.problems.append(
                f"the schedule did not end within {SEED_DEADLINE_S:g} s: {waiting(run)}"[:1500]
            )
        for incs in run.incarnations.values():
            for inc in incs:
                inc.released.set()
                if pending:
                    inc.kill()
                await settle(inc)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                run.problems.append(f"harness error: {task.exception()!r}")
    finally:
        loop.set_task_factory(previous)
    # The trainers are done: an operator prunes the done groups' payloads and collects the rest.
    pruned, collected = await asyncio.to_thread(prune_and_collect, url)
    run.counts["payloads_pruned"] += pruned
    run.counts["payloads_collected"] += collected
    return run
