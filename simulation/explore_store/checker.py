"""The independent history checker: reads the log's events and the agents' durable records only."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from eventstore import open_store
from eventstore.payload_stores import payload_plane
from participant.evidence import read_evidence
from projections.ownership import AgentRef
from protocol.wire import AgentStatus
from simulation.agent_audit import AgentSeen, audit_agents
from simulation.explore_store.process import ScheduleRun
from simulation.explore_store.retention import live_payloads_gone
from trainer.core.attempt import RETIRE_POLICY

# Calls of one kind about one try (or one checkpoint at one agent), at most: each retry loop has a
# budget (RETIRE_POLICY, FINISH_POLICY, the prepare deadline); a few processes may each spend one.
MAX_CALLS_PER_TRY = 4 * RETIRE_POLICY.max_calls


async def check(run: ScheduleRun) -> list[str]:
    """What the log and the agents' durable records show went wrong (empty when everything holds)."""
    plan = run.plan
    violations = list(run.problems)
    store = await asyncio.to_thread(open_store, run.url)
    try:
        events = await asyncio.to_thread(lambda: list(store.read_all(0)))
        from projections.audit import audit_log

        # With the payload plane: every payload an event claims is stored (or pruned) and intact.
        report = await asyncio.to_thread(audit_log, store, None, payload_plane(store))
        mine = [e for e in events if plan.prefix in e.stream_id]
        # The operator's prune and collect took nothing a group still in play needs.
        groups = {g.group_id for tp in plan.trainers for g in tp.groups}
        violations += await asyncio.to_thread(live_payloads_gone, store, mine, groups)
    finally:
        await asyncio.to_thread(store.close)
    by_type: dict[str, list[Any]] = {}
    for e in mine:
        by_type.setdefault(e.type, []).append(e)
    if not report.ok:
        violations += [f"audit: {v}"[:300] for v in report.as_json()["violations"][:10]]
    # Every group sealed or dead-lettered, each once.
    ends: Counter[str] = Counter(
        e.data["group_id"] for e in mine if e.type in ("GroupSealed", "GroupDeadLettered")
    )
    for tp in plan.trainers:
        for g in tp.groups:
            if ends[g.group_id] != 1:
                violations.append(
                    f"group {g.group_id} ended {ends[g.group_id]} times (sealed or dead-lettered)"
                )
    sealed = {e.data["group_id"] for e in by_type.get("GroupSealed", [])}
    # Claims: never by a writer whose epoch was superseded; at most one that no restore rolled back;
    # every sealed group trained on.
    epochs: dict[str, str] = {}  # trainer id -> the writer of its newest epoch
    live_claims: dict[str, list[int]] = {}
    owners: dict[
        str, str | None
    ] = {}  # group id -> the trainer that reserved it (another may submit its id too)
    for e in mine:
        if e.type == "GroupReserved":
            owners.setdefault(e.data["group_id"], e.data.get("trainer_id"))
        elif e.type == "TrainerEpochTaken":
            epochs[e.data["trainer_id"] or ""] = e.data["writer"]
        elif e.type == "TrainerRestored":
            cut = e.data.get("cut_position") or 0
            tid = e.data.get("trainer_id")
            for gid, positions in live_claims.items():
                if owners.get(gid) == tid:
                    positions[:] = [p for p in positions if p <= cut]
        elif e.type == "GroupClaimedForTraining":
            gid = e.data["group_id"]
            tid = owners.get(gid)
            writer = e.metadata.get("writer")
            if writer is not None and epochs.get(tid or "") not in (None, writer):
                violations.append(f"group {gid} claimed by a superseded owner ({writer})")
            live_claims.setdefault(gid, []).append(e.position)
    for gid in sealed:
        n = len(live_claims.get(gid, []))
        if n != 1:
            violations.append(f"sealed group {gid} trained on {n} times")
    violations += _trained_twice_across_restores(mine, owners)
    # The fleet: the group id another trainer reserved stays its owner's; a refused start wrote nothing;
    # no try's lease ran out while its /run waited in the trainer's own queue.
    if plan.collision is not None:
        owner, _, index = plan.collision
        gid = plan.trainers[owner].groups[index].group_id
        if owners.get(gid, plan.trainers[owner].trainer_id) != plan.trainers[owner].trainer_id:
            violations.append(f"group {gid} is reserved by {owners.get(gid)}, not by its owner")
    refused = set(run.refused_writers)
    wrote = sorted({e.position for e in events if e.metadata.get("writer") in refused})
    if wrote:
        violations.append(f"a start refused for a shared agent wrote rows at {wrote[:5]}")
    for e in by_type.get("RunFailed", []):
        subject = f"{e.data['rollout_id']}#{e.data['attempt_index']}"
        if e.data.get("kind") == "deadline" and subject not in run.runs_sent:
            violations.append(
                f"{subject}'s lease ran out before its /run left the trainer's own queue: "
                f"{e.data.get('reason')}"[:300]
            )
    # Executions and results, from every state directory each agent ever had.
    for agent in run.agents.values():
        started: Counter[tuple[str, int]] = Counter()
        stranded = 0
        for d in agent.state_dirs:
            # Judged in order: what a try's last record says holds, and a start after a retire by an
            # earlier process of that state directory is a try run that the log had replaced.
            ev = await asyncio.to_thread(read_evidence, d)
            for key, t in ev.tries.items():
                started[key] += t.executions
                if t.run_after_retired:
                    violations.append(
                        f"{t.rollout_id}#{t.attempt_index} ran at {agent.key} (generation {t.started[-1]}) "
                        f"after generation {t.retired_in[0]} retired it"
                    )
            if d == agent.state_dirs[0]:
                stranded = len(ev.stranded)
        for (rid, n), count in started.items():
            # A replayed try (the plan's replay) ran again at an agent that had lost its state.
            if count > (2 if f"{rid}#{n}" in run.replayed else 1):
                violations.append(f"{rid}#{n} executed {count} times at {agent.key}")
        if stranded:
            violations.append(f"{agent.key} holds {stranded} finished result(s) nobody released")
    # Checkpoints: the log's outcome equals each participant's.
    participants: dict[str, list[str]] = {}
    trainer_of: dict[str, str | None] = {}  # checkpoint -> the trainer that prepared it
    decided: dict[str, str] = {}
    finished: dict[tuple[str, str], str] = {}
    resumed: set[str] = set()
    for e in mine:
        cid = str(e.data.get("checkpoint_id"))
        if e.type == "CheckpointPrepareStarted":
            participants[cid] = list(e.data["participants"])
            trainer_of[cid] = e.data.get("trainer_id")
        elif e.type in ("CheckpointCommitted", "CheckpointAborted"):
            if cid in decided:
                violations.append(f"checkpoint {cid} decided twice")
            decided[cid] = "committed" if e.type == "CheckpointCommitted" else "aborted"
        elif e.type == "CheckpointParticipantFinished":
            finished[(cid, e.data["agent_name"])] = e.data["outcome"]
        elif e.type == "CheckpointResumed":
            resumed.add(cid)
    for cid, names in participants.items():
        outcome = decided.get(cid)
        if outcome is None:
            violations.append(f"checkpoint {cid} was never decided")
            continue
        for name in names:
            found = run.agent_of(trainer_of.get(cid), name)
            if found is None:
                continue
            agent = found
            artefact = any((d / "checkpoints" / f"{cid}.json").exists() for d in agent.state_dirs)
            own = finished.get((cid, name))
            if outcome == "aborted" and artefact:
                violations.append(f"{agent.key} holds an artefact of {cid}, which the log aborted")
            if outcome == "committed" and own == "resumed" and not artefact:
                violations.append(f"{agent.key} recorded resumed for {cid} but holds no artefact")
            if outcome == "committed" and own is None:
                violations.append(f"{agent.key}'s part of committed {cid} never finished")
        if cid in resumed and any(finished.get((cid, n)) != "resumed" for n in names):
            violations.append(f"CheckpointResumed for {cid} without every participant resumed")
    # No agent left paused or closed; nothing of it still owed.
    seen: dict[AgentRef, AgentSeen] = {}
    for tp in plan.trainers:
        for agent_key in tp.agents:
            agent = run.agents[agent_key]
            reply = await agent.call("GET", b"/status", [(b"host", b"agent")], b"")
            status = json.loads(reply.body)
            if status.get("phase") != "idle":
                violations.append(
                    f"{agent.key} left {status.get('phase')} ({status.get('active_checkpoint_id')})"
                )
            ref = AgentRef(tp.trainer_id, plan.name_of(agent_key))
            seen[ref] = AgentSeen(agent.state_dirs[0], AgentStatus.model_validate(status))
    # The fleet audit (simulation.agent_audit): the log beside each agent's evidence, binding and phase.
    if url_is_own_log(run):
        fleet = await asyncio.to_thread(_audit_fleet, run.url, seen)
        violations += [f"fleet audit: {v}"[:300] for v in fleet[:10]]
    # Every retry bounded.
    for (kind, what), n in run.per_try.items():
        if what and n > MAX_CALLS_PER_TRY:
            violations.append(f"{n} {kind} calls for {what} (bound {MAX_CALLS_PER_TRY})")
    return violations


def _trained_twice_across_restores(mine: list[Any], owners: dict[str, str | None]) -> list[str]:
    """No group trained twice by one trainer's state: the groups its state holds are those it claimed,
    and a restore (not `claims_kept`) brings back the state as it stood at the restore's cut, whatever
    the log's claims say since (a restore to a checkpoint an earlier restore left behind brings back
    claims the log let go of)."""
    found: list[str] = []
    # trainer id -> its state's groups after each change, by position (the state at any past cut)
    states: dict[str, list[tuple[int, frozenset[str]]]] = {}
    for e in mine:
        if e.type == "TrainerRestored" and not e.data.get("claims_kept"):
            tid = e.data.get("trainer_id") or ""
            cut = e.data.get("cut_position") or 0
            past = [held for at, held in states.get(tid, []) if at <= cut]
            states.setdefault(tid, []).append((e.position, past[-1] if past else frozenset()))
        elif e.type == "GroupClaimedForTraining":
            gid = e.data["group_id"]
            tid = owners.get(gid) or ""
            history = states.setdefault(tid, [])
            held = history[-1][1] if history else frozenset()
            if gid in held:
                found.append(
                    f"group {gid} trained twice: claimed at {e.position} by a state that trained on it"
                )
            history.append((e.position, held | {gid}))
    return found


def url_is_own_log(run: ScheduleRun) -> bool:
    """The fleet audit folds the whole log: a seed's own SQLite file, not a database many seeds share
    (there another seed's agents, not in this one's fleet, hold tries of the log's groups)."""
    return run.url.startswith("sqlite")


def _audit_fleet(url: str, seen: dict[AgentRef, AgentSeen]) -> list[str]:
    store = open_store(url)
    try:
        return [v.line() for v in audit_agents(store, seen)]
    finally:
        store.close()
