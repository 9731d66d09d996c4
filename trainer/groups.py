"""Driving the groups: one asyncio task per open group settles its attempts and performs what the
group's pure decision (`trainer.core.group`) says: replace, resume, rerun, seal, dead-letter.

A group comes here through one door, `drive`: from `submit` (after its reservation) and from
recovery alike.  The driver appends an attempt's unrecorded end (its `AttemptRetired`) before it asks
the decision, so the budget rules read it from the log; each decision's events are then one append.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

from eventstore import EventStore
from eventstore.events import AttemptMinted, Event, GroupReserved, Mode, PromptRef
from projections.ledger import GroupState
from protocol.ids import rollout_id_of
from protocol.levels import TargetLevel, effective_level
from protocol.streams import group_stream
from trainer.agents import Agents
from trainer.attempts import Attempts
from trainer.core import group as core
from trainer.core.budget import AttemptAction
from trainer.core.group import NEVER_SENT, AttemptOutcome, Decision
from trainer.errors import AgentShared, CoordinatorStopped, FencedOff, GroupConflict, StreamExists
from trainer.journal import Journal
from trainer.settings import Settings, log
from trainer.stops import log_stop


async def _ended(outcome: AttemptOutcome) -> AttemptOutcome:
    return outcome


class Groups:
    def __init__(
        self,
        store: EventStore,
        journal: Journal,
        agents: Agents,
        settings: Settings,
        attempts: Attempts,
        errors: list[BaseException],
        check_alive: Callable[[], None],
    ) -> None:
        self.store = store
        self.journal = journal
        self.agents = agents
        self.settings = settings
        self.attempts = attempts
        # The coordinator's errors: a driver that fails records why there.
        self.errors = errors
        self._check_alive = check_alive
        self._drivers: dict[str, asyncio.Task[None]] = {}

    # --- what is in play --------------------------------------------------------------------------

    def owns(self, group: GroupState) -> bool:
        """Other trainers' groups share the log (and the fold) but are never driven or trained here."""
        return group.trainer_id == self.settings.trainer_id

    def open_groups(self) -> list[str]:
        groups = self.journal.ledger.groups
        return [gid for gid in self.journal.ledger.open_group_ids() if self.owns(groups[gid])]

    def attempts_in_flight(self) -> int:
        """Siblings of this trainer's open groups still without a result (held or sealed): the attempts
        a caller's concurrency window counts."""
        groups = self.journal.ledger.groups
        return sum(
            1
            for gid in self.journal.ledger.open_group_ids()
            if self.owns(groups[gid])
            for s in groups[gid].siblings.values()
            if s.status == "pending"
        )

    def idle(self) -> bool:
        """No group open here but those waiting on an agent that refused this trainer, and no driver
        running."""
        refused = self.agents.refused
        waiting = [g for g in self.open_groups() if self.journal.ledger.groups[g].agent_name not in refused]
        return not waiting and all(t.done() for t in self._drivers.values())

    def stuck_on_refusal(self) -> AgentShared | None:
        """The refusal an open group of this trainer waits on, undriven (its agent refused this trainer)."""
        groups, refused = self.journal.ledger.groups, self.agents.refused
        return next((refused[a] for g in self.open_groups() if (a := groups[g].agent_name) in refused), None)

    async def wait_drivers(self) -> None:
        """Until every driver running now (and any started meanwhile) has finished."""
        while drivers := [t for t in list(self._drivers.values()) if not t.done()]:
            await asyncio.wait(drivers)

    async def stop(self) -> None:
        """Cancels every driver (the attempts in flight stay at the agents, for recovery)."""
        drivers = list(self._drivers.values())  # a driver that ends removes itself
        for task in drivers:
            task.cancel()
        for task in drivers:
            with contextlib.suppress(BaseException):
                await task

    # --- submitting --------------------------------------------------------------------------------

    async def submit(
        self,
        group_id: str,
        prompt_ref: PromptRef,
        agent_name: str,
        expected_generations: int,
        payload: dict[str, Any],
        *,
        mode: Mode,
        target_level: TargetLevel,
        target_step: int | None,
    ) -> GroupState | None:
        """Reserves the group with its first attempts (one append), then drives it (see
        `RolloutCoordinator.submit`)."""
        reserved = GroupReserved(
            group_id=group_id,
            prompt_ref=prompt_ref,
            agent_name=agent_name,
            expected_generations=expected_generations,
            mode=mode,
            target_level=await self._level_at(agent_name, target_level),
            requested_level=target_level,
            target_step=target_step,
            max_tries=self.settings.max_tries,
            max_infra_failures=self.settings.max_infra_failures,
            max_data_failures=self.settings.max_data_failures,
            payload=payload,
            trainer_id=self.settings.trainer_id,
        )
        if self.journal.ledger.knows_group(group_id):
            await self._check_same_request(reserved)
        else:
            events: list[Event] = [
                reserved,
                *(
                    AttemptMinted(rollout_id=rollout_id_of(group_id, i), generation_index=i)
                    for i in range(expected_generations)
                ),
            ]
            try:
                await self.journal.append(group_stream(group_id), events, create=True)
            except StreamExists:
                # Reserved by another writer after this process last folded the log (another trainer
                # sharing it): the same request is this one, anything else refuses this submit alone.
                await self.journal.catch_up()
                await self._check_same_request(reserved)
        group = self.journal.ledger.groups.get(group_id)
        if group is not None and group.status == "open" and self.owns(group):
            self.drive(group_id)
        return group

    async def _check_same_request(self, reserved: GroupReserved) -> None:
        """A resubmission must be the request the log holds (the retry budgets may differ: they are this
        process's settings, and the group keeps the ones it was reserved with)."""
        stream = group_stream(reserved.group_id)
        first = await self.journal.read(
            lambda: next(iter(self.store.read_stream(stream)), None), "reading a group's reservation"
        )
        if first is None or first.type != GroupReserved.event_type():
            raise GroupConflict(f"group {reserved.group_id!r} is in the log but its reservation is not")
        held = first.decode()
        assert isinstance(held, GroupReserved)
        # The level run at follows the agent's capabilities at the time; the one asked for must match.
        budgets = {"max_tries", "max_infra_failures", "max_data_failures", "target_level"}
        mine = reserved.model_dump(mode="json", exclude=budgets)
        theirs = held.model_dump(mode="json", exclude=budgets)
        if held.trainer_id != reserved.trainer_id:
            raise GroupConflict(
                f"group {reserved.group_id!r} is reserved by trainer {held.trainer_id!r}, not this one "
                f"({reserved.trainer_id!r}): group ids are unique across every trainer sharing the log"
            )
        if mine != theirs:
            fields = sorted(k for k in mine if mine[k] != theirs.get(k))
            raise GroupConflict(
                f"group {reserved.group_id!r} already exists in the log with another request "
                f"(differs in {', '.join(fields)}); group ids are never reused"
            )

    async def _level_at(self, agent_name: str, requested: TargetLevel) -> TargetLevel:
        """The finest level at or below `requested` the agent declares it supports.  An agent whose
        capabilities are not known (away since the start) gets the level that needs none."""
        client = self.agents.client(agent_name)
        if effective_level(requested, ()) == requested:
            return requested  # a level that needs no feature: no need to ask the agent
        if client.capabilities_seen is None:
            await client.connect_quietly()
        seen = client.capabilities_seen
        level = effective_level(requested, seen.features if seen is not None else ())
        if level != requested:
            log.info("agent %s runs groups at level %s (asked: %s)", agent_name, level, requested)
        return level

    # --- the one door ----------------------------------------------------------------------------

    def drive(self, group_id: str) -> None:
        """Starts the group's driver (once: a group driven already keeps its task)."""
        if group_id not in self._drivers or self._drivers[group_id].done():
            self._drivers[group_id] = asyncio.create_task(self._run(group_id), name=f"group:{group_id}")

    async def _run(self, group_id: str) -> None:
        try:
            if self.journal.ledger.groups[group_id].mode == "sibling":
                await self._drive_siblings(group_id)
            else:
                await self._drive_prompt_group(group_id)
        except asyncio.CancelledError:
            raise
        except (FencedOff, CoordinatorStopped) as exc:
            if not any(e is exc for e in self.errors):  # one stop, said once, however many groups it ends
                log_stop(f"group {group_id}", exc)
            self.errors.append(exc)
        except AgentShared:
            pass  # its agent refused this trainer: said once, where it did; the group waits open
        except Exception as exc:
            log.exception("group %s failed", group_id)
            self.errors.append(exc)
        else:
            left = self.journal.ledger.groups.get(group_id)
            if left is None or left.status != "open":
                self.attempts.forget_group(group_id)
                if self._drivers.get(group_id) is asyncio.current_task():
                    del self._drivers[group_id]

    def _open(self, group_id: str) -> GroupState | None:
        group = self.journal.ledger.groups.get(group_id)
        return group if group is not None and group.status == "open" else None

    async def _append(self, group_id: str, events: tuple[Event, ...] | list[Event]) -> None:
        if events:
            await self.journal.append(group_stream(group_id), list(events))

    async def _settled(self, group_id: str, gi: int, n: int, outcome: AttemptOutcome) -> GroupState | None:
        """An attempt's end as the log must hold it before the group's next move is asked."""
        group = self.journal.ledger.groups[group_id]
        await self._append(group_id, core.retire_events(group.siblings[gi].rollout_id, n, outcome))
        return self._open(group_id)

    # --- sibling mode --------------------------------------------------------------------------------

    async def _drive_siblings(self, group_id: str) -> None:
        group = self.journal.ledger.groups[group_id]
        ends = await asyncio.gather(*(self._drive_sibling(group_id, gi) for gi in sorted(group.siblings)))
        # A sibling that cannot go on leaves the others to finish first; the group is dead-lettered then.
        group_now = self._open(group_id)
        spent = [d for d in ends if d is not None]
        if group_now is not None and spent:
            await self._append(group_id, core.dead_letter(group_now, spent[0].reason, spent[0].budget).events)

    async def _drive_sibling(self, group_id: str, gi: int) -> Decision | None:
        """Settles one sibling's attempts until it is sealed (None) or it cannot go on (the
        dead-letter decision)."""
        while True:
            self._check_alive()
            group = self._open(group_id)
            if group is None:
                return None
            decision = core.sibling_next(group, gi)
            if decision.move == "settle":
                n = group.siblings[gi].current_attempt
                outcome = await self.attempts.settle(group_id, gi, n)
                group = await self._settled(group_id, gi, n, outcome)
                if group is None:
                    return None
                decision = core.on_attempt(group, gi, outcome)
            if decision.move == "dead_letter":
                return decision
            if decision.move in ("done",):
                return None
            await self._append(group_id, decision.events)  # a replacement (or nothing: `wait`)

    # --- prompt_group mode ---------------------------------------------------------------------------

    async def _drive_prompt_group(self, group_id: str) -> None:
        while True:
            self._check_alive()
            group = self._open(group_id)
            if group is None:
                return
            decision = core.round_next(group)
            if decision.done:
                return
            if decision.move == "seal" and not decision.events:
                log.error("group %s: every sibling held, but not every hold carries its receipt", group_id)
                return
            if decision.move in ("seal", "replace", "resume"):
                await self._append(group_id, decision.events)
                continue
            outcomes = await self._round(group_id, decision)
            group = self._open(group_id)
            if group is None:
                return
            ended = core.on_round(group, outcomes)
            await self._append(group_id, ended.events)
            if ended.move == "dead_letter":
                return

    async def _round(self, group_id: str, decision: Decision) -> dict[int, AttemptOutcome]:
        """Settles a round's attempts, as each ends asking the group's next move: at level turn an
        interrupted sibling is replaced alone and its replacement settled within the round; the first
        end that gives the round up has every attempt still running retired or adopted.  Returns each
        sibling's final outcome."""
        giving_up = decision.move == "give_up"
        group = self.journal.ledger.groups[group_id]
        outcomes: dict[int, AttemptOutcome] = {}
        for gi, sibling in group.siblings.items():
            current = sibling.current
            outcomes[gi] = (core.recorded_outcome(current) if current is not None else None) or core.FINISHED
        tasks: dict[asyncio.Task[AttemptOutcome], tuple[int, int]] = {}
        helpers: list[asyncio.Task[AttemptOutcome]] = []

        def start(gi: int, action: AttemptAction) -> None:
            n = self.journal.ledger.groups[group_id].siblings[gi].current_attempt
            work: Coroutine[Any, Any, AttemptOutcome]
            if giving_up and action == "dispatch":
                work = _ended(NEVER_SENT)  # never left the trainer: nothing to settle at the agent
            else:
                work = self.attempts.settle(group_id, gi, n)
            tasks[asyncio.create_task(work)] = (gi, n)

        def give_up() -> None:
            rerun = self.journal.ledger.groups[group_id]
            for gi, n in tasks.values():
                rid = rerun.siblings[gi].rollout_id
                helpers.append(asyncio.create_task(self.attempts.resolve(group_id, rid, n)))

        try:
            for gi, action in decision.settle:
                start(gi, action)
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    gi, n = tasks.pop(task)
                    outcome = outcomes[gi] = task.result()
                    now = await self._settled(group_id, gi, n, outcome)
                    if giving_up or now is None:
                        continue
                    step = core.on_attempt(now, gi, outcome)
                    if step.move in ("replace", "resume"):
                        await self._append(group_id, step.events)
                        start(gi, "dispatch")
                    elif step.move == "give_up":
                        giving_up = True
                        give_up()
            await asyncio.gather(*helpers)
        except BaseException:
            for task in [*tasks, *helpers]:
                task.cancel()
            raise
        return outcomes
