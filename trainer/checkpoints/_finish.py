"""After a checkpoint's decision: each participant driven to it, recovery, and reconciling an agent.

The log's decision is what each agent must reach (trainer.core.checkpoint's steps, performed here):
commit then resume, or abort, until each agent confirms; `CheckpointResumed` once every one did.  A
participant whose step is stuck keeps being driven in the background.  Recovery presumes abort for
what a dead coordinator left undecided and finishes what it committed; `reconcile` brings one agent's
phase in line with the log whenever it is found holding a checkpoint nobody drives.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import re
import time
from typing import Any

from eventstore.events import CheckpointResumed, Event
from protocol.retry import RetryState, next_step
from protocol.streams import checkpoint_stream
from trainer.agents import Agents
from trainer.core.checkpoint import (
    FINISH_POLICY,
    Accepted,
    Answer,
    Done,
    Failed,
    NotDriven,
    Op,
    Participant,
    Refused,
    StatusSeen,
    Target,
    first_call,
    leftover_call,
    presume_abort,
    resumed_event_due,
    step,
)
from trainer.core.retire_debt import owed_keys
from trainer.errors import CoordinatorStopped, FencedOff
from trainer.gate import Gate
from trainer.gym import GymClient
from trainer.gym.errors import (
    CheckpointConflictError,
    GymError,
    InvalidPhaseError,
    StaleCheckpointError,
    TrainerConflictError,
)
from trainer.journal import Journal
from trainer.retires import RetireRelay
from trainer.settings import Settings, log


class Finisher:
    def __init__(
        self, journal: Journal, agents: Agents, settings: Settings, gate: Gate, retires: RetireRelay
    ) -> None:
        self.journal = journal
        self.agents = agents
        self.settings = settings
        self.gate = gate
        self.retires = retires
        # Participants still being driven to a decided outcome, and the CheckpointResumed appenders.
        self._finishers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._completions: dict[str, asyncio.Task[None]] = {}
        # Set whenever a participant's step wrote to the log (a finish, a stuck).
        self._changed = asyncio.Event()

    def driving(self, checkpoint_id: str) -> bool:
        """Whether a participant of `checkpoint_id` is being driven to its decision now."""
        return any(key[0] == checkpoint_id for key in self._finishers)

    def busy(self) -> bool:
        """Whether any decided checkpoint is still being driven (a stuck participant, say)."""
        return bool(self._finishers)

    async def finish_commit(self, checkpoint_id: str, names: list[str]) -> dict[str, str]:
        """Commit and resume every agent; `CheckpointResumed` once every one confirmed.  Safe to
        repeat (recovery).  Returns when each agent finished or was reported stuck (a stuck one keeps
        being retried in the background: the commit is decided)."""
        return await self.finish(checkpoint_id, names, "resumed")

    async def abort_agents(self, checkpoint_id: str, names: list[str]) -> dict[str, str]:
        """Abort at every agent until each confirms (or is reported stuck, and retried in the
        background)."""
        return await self.finish(checkpoint_id, names, "aborted")

    async def finish(self, checkpoint_id: str, names: list[str], target: Target) -> dict[str, str]:
        """Drives each participant's steps (trainer.core.checkpoint) towards the log's decision.
        Returns when each has finished or is recorded stuck (the log says which), with each agent's
        outcome or "stuck"; a stuck one goes on being driven in the background."""
        drivers: list[asyncio.Task[None]] = []
        for name in names:
            if name in self._logged(checkpoint_id)[0]:
                continue
            key = (checkpoint_id, name)
            task = self._finishers.get(key)
            if task is None or task.done():
                task = asyncio.create_task(
                    self._drive_participant(Participant.finishing(checkpoint_id, name, target)),
                    name=f"checkpoint:{checkpoint_id}:{name}",
                )
                self._finishers[key] = task
                task.add_done_callback(functools.partial(_forget, self._finishers, key))
            drivers.append(task)
        if target == "resumed":
            completion = self._completions.get(checkpoint_id)
            if completion is None or completion.done():
                completion = asyncio.create_task(self._complete(checkpoint_id, names, drivers))
                self._completions[checkpoint_id] = completion
                completion.add_done_callback(functools.partial(_forget, self._completions, checkpoint_id))
        while True:
            finished, stuck = self._logged(checkpoint_id)
            if all(d.done() for d in drivers) or all(n in finished or n in stuck for n in names):
                break
            self._changed.clear()
            waiter = asyncio.create_task(self._changed.wait())
            await asyncio.wait(
                [waiter, *[d for d in drivers if not d.done()]], return_when=asyncio.FIRST_COMPLETED
            )
            waiter.cancel()
        for d in drivers:
            if d.done() and not d.cancelled():
                failure = d.exception()
                if failure is not None:
                    raise failure
        completion = self._completions.get(checkpoint_id)
        if target == "resumed" and completion is not None and all(d.done() for d in drivers):
            await completion
        finished, _ = self._logged(checkpoint_id)
        return {n: finished.get(n, "stuck") for n in names}

    def _logged(self, checkpoint_id: str) -> tuple[dict[str, str], dict[str, str]]:
        """The participants' outcomes and the stuck ones, as the log says."""
        known = self.journal.checkpoints.checkpoints.get(checkpoint_id)
        return (known.finished, known.stuck) if known is not None else ({}, {})

    async def _complete(
        self, checkpoint_id: str, names: list[str], drivers: list[asyncio.Task[None]]
    ) -> None:
        outcomes = await asyncio.gather(*drivers, return_exceptions=True)
        known = self.journal.checkpoints.checkpoints.get(checkpoint_id)
        finished = dict(known.finished) if known is not None else {}
        if resumed_event_due(finished, names):  # type: ignore[arg-type]
            await self.journal.append(
                checkpoint_stream(checkpoint_id),
                [CheckpointResumed(checkpoint_id=checkpoint_id, participants=names)],
            )
        elif (
            self.journal.stopped is not None
            or self.journal.fenced is not None
            or any(isinstance(o, (FencedOff, CoordinatorStopped)) for o in outcomes)
        ):
            # The coordinator stopped (fenced off, or the log gone) while it resumed the agents: its
            # stop says so, once, and whoever carries the run on finishes the commit.
            log.info("checkpoint %s: resuming left to the coordinator after this one", checkpoint_id)
        else:
            log.error(
                "checkpoint %s committed but not every participant resumed: %s", checkpoint_id, finished
            )

    async def _drive_participant(self, p: Participant) -> None:
        """Performs the calls `p`'s steps name and appends their events (the shell of the core)."""
        client = self.agents.client(p.agent_name)
        call = first_call(p)
        while True:
            if call.delay_s:
                await asyncio.sleep(call.delay_s)
            answer = await _phase_answer(client, call.op, p.checkpoint_id)
            if isinstance(answer, NotDriven):
                self.agents.refuse(p.agent_name, answer.message)
            result = step(p, answer, time.monotonic(), random.random())
            p = result.participant
            if result.events:
                await self.journal.append(checkpoint_stream(p.checkpoint_id), list(result.events))
                self._changed.set()
            if isinstance(result.action, Done):
                if result.action.outcome == "lost":
                    log.error(
                        "checkpoint %s: agent %s lost it: %s",
                        p.checkpoint_id,
                        p.agent_name,
                        result.action.reason,
                    )
                return
            call = result.action

    async def stop(self) -> None:
        """Cancels the participants still being driven (recovery drives them again from the log)."""
        tasks = [*self._finishers.values(), *self._completions.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def recover(
        self, to_abort: list[str] | None = None, to_resume: list[str] | None = None
    ) -> dict[str, int]:
        """Presumed abort for undecided checkpoints; finish committed ones; abort strays at agents.

        The ids come from the recovery plan; by default, from the checkpoints projection.
        """
        done = {"aborted": 0, "resumed": 0}
        known = self.journal.checkpoints.checkpoints
        mine = self.settings.trainer_id
        if to_abort is None:  # only this trainer's: another trainer's checkpoint may be in flight
            to_abort = [c.checkpoint_id for c in self.journal.checkpoints.in_doubt() if c.trainer_id == mine]
        if to_resume is None:
            to_resume = [
                c.checkpoint_id for c in self.journal.checkpoints.to_resume() if c.trainer_id == mine
            ]
        for c in [known[i] for i in to_abort]:
            await self.presume_abort_in_log(
                c.checkpoint_id, c.participants, "presumed abort: the coordinator died before deciding"
            )
            await self.abort_agents(c.checkpoint_id, [p for p in c.participants if p in self.agents])
            done["aborted"] += 1
        for c in [known[i] for i in to_resume]:
            await self.finish_commit(c.checkpoint_id, [p for p in c.participants if p in self.agents])
            done["resumed"] += 1
        for name, client in self.agents.items():
            await self.reconcile(name, client)
        return done

    async def presume_abort_in_log(self, checkpoint_id: str, participants: list[str], reason: str) -> None:
        """Appends the presumed abort unless the log has decided the checkpoint by the time the append
        is written (recovery and reconciliation may both find it in doubt: it is decided once)."""
        journal = self.journal

        def build(_: object) -> list[Event]:
            held = journal.checkpoints.checkpoints.get(checkpoint_id)
            return presume_abort(checkpoint_id, None if held is None else held.status, participants, reason)

        await journal.append(checkpoint_stream(checkpoint_id), build)

    async def _put_right(self, checkpoint_id: str, name: str, client: GymClient, phase: str) -> None:
        """The agent holds a checkpoint the log says it already finished: the leftover is undone at
        the agent (within FINISH_POLICY; the next reconciliation tries again), nothing is recorded."""
        op = leftover_call(phase)
        if op is None:
            return
        log.warning(
            "agent %s holds checkpoint %s (%s) that the log says it finished: %s it",
            name,
            checkpoint_id,
            phase,
            op,
        )
        await self._call_until_answered(checkpoint_id, name, client, op)

    async def _call_until_answered(self, checkpoint_id: str, name: str, client: GymClient, op: Op) -> None:
        """`op` at one agent until it answers (any answer but a transport failure), within FINISH_POLICY."""
        tries = RetryState()
        while True:
            answer = await _phase_answer(client, op, checkpoint_id)
            if not isinstance(answer, Failed):
                return
            tries = tries.failed(time.monotonic(), answer.error)
            verdict = next_step(FINISH_POLICY, tries, time.monotonic(), random.random())
            if verdict.kind == "give_up":
                log.error("%s of %s at %s gave up: %s", op, checkpoint_id, name, verdict.reason)
                return
            await asyncio.sleep(verdict.delay_s)

    async def reconcile(self, name: str, client: GymClient) -> None:
        """Brings one agent's checkpoint phase in line with the log (at recovery, and whenever the
        coordinator finds an agent with an active checkpoint it is not driving).

        A checkpoint the agent holds is looked up in the log as it is now (read again: its owner may
        have started it after this process last folded).  Decided: driven to the decision.  Started
        by this trainer and undecided: presumed abort, written to the log first, so that a live
        coordinator still preparing it fails its decision append instead of committing what the
        agent aborted.  Another trainer's checkpoint, in whatever state, is that trainer's: left alone.  Never
        started in this log: nobody can decide it, so it is aborted at the agent.  Already finished by
        this agent in the log (it restarted and forgot, then a stale process prepared it again): the
        leftover is undone at the agent and nothing is recorded.
        """
        owed_before = owed_keys(self.journal.ledger, name)
        try:
            status = await client.status()
        except GymError as exc:
            log.warning("reconcile: status of %s unavailable: %s", name, exc)
            return
        await self.retires.owe_strays(name, status, owed_before)
        active = status.active_checkpoint_id
        if (
            active is None
            or any(key[0] == active for key in self._finishers)
            or self.gate.checkpoint == active
        ):
            return
        await self.journal.catch_up()
        known = self.journal.checkpoints.checkpoints.get(active)
        if known is not None and known.trainer_id != self.settings.trainer_id:
            # Its participants are that trainer's agents (of the same name, perhaps): not this one's to
            # drive, whatever its state.  Found here, the agent is driven by two trainers.
            log.error(
                "agent %s holds checkpoint %s of trainer %r, not of this one (%r): left alone",
                name,
                active,
                known.trainer_id,
                self.settings.trainer_id,
            )
        elif known is not None and name in known.finished:
            await self._put_right(active, name, client, status.phase)
        elif known is None:
            await self.abort_agents(active, [name])
        elif known.status in ("committed", "resumed"):
            await self.finish_commit(active, [name])
        elif known.status == "aborted":
            await self.abort_agents(active, [name])
        else:
            await self.presume_abort_in_log(
                active,
                known.participants,
                "presumed abort: found active at an agent with no decision in the log",
            )
            await self.abort_agents(active, [p for p in known.participants if p in self.agents])

    async def commit_in_log(self, checkpoint_id: str) -> bool:
        """Whether the log holds this checkpoint's `CheckpointCommitted` (read from the store, not the
        fold: a fenced process folds nothing more).  Unreadable: assumed written (nothing undone)."""
        journal = self.journal
        try:
            events = await journal.read(
                lambda: list(journal.store.read_stream(checkpoint_stream(checkpoint_id))),
                f"reading checkpoint {checkpoint_id}",
            )
        except Exception as exc:
            log.error(
                "checkpoint %s: the log is unreadable after the fence (%s): left to recovery",
                checkpoint_id,
                exc,
            )
            return True
        return any(e.type == "CheckpointCommitted" for e in events)

    async def undo_at_agents(self, checkpoint_id: str, names: list[str], op: Op) -> None:
        """`op` (abort) at every agent, within FINISH_POLICY each, recording nothing (the log's record
        stands; this process may not write to it any more)."""
        clients = [(n, self.agents.client(n)) for n in names if n in self.agents]
        await asyncio.gather(
            *(self._call_until_answered(checkpoint_id, n, c, op) for n, c in clients), return_exceptions=True
        )


def _forget(tasks: dict[Any, asyncio.Task[None]], key: object, _task: asyncio.Task[None]) -> None:
    tasks.pop(key, None)


_FINISHED_AS = re.compile(r"already finished with outcome '(resumed|aborted)'")


async def _phase_answer(client: GymClient, op: Op, checkpoint_id: str) -> Answer:
    """One call of a participant's step, its answer in the core's terms."""
    try:
        if op == "status":
            status = await client.status()
            return StatusSeen(status.phase, status.active_checkpoint_id, status.execution_generation)
        response = await getattr(client, op)(checkpoint_id)
        return Accepted(response.phase)
    except StaleCheckpointError as exc:
        # The reference agent names the outcome it finished the checkpoint with; any other wording
        # (or an agent that forgot it) leaves the core to ask for the agent's status.
        found = _FINISHED_AS.search(exc.message)
        return Refused("stale", found.group(1) if found else None, exc.message)  # type: ignore[arg-type]
    except InvalidPhaseError as exc:
        return Refused("invalid_phase", None, exc.message)
    except CheckpointConflictError as exc:
        return Refused("conflict", None, exc.message)
    except TrainerConflictError as exc:
        return NotDriven(exc.message)
    except GymError as exc:
        return Failed(f"{type(exc).__name__}: {exc}"[:300])
