"""The rollout coordinator: the trainer's side of the hand-off protocol, driven only through the log.

    coord = RolloutCoordinator(store, agents={"math-agent": client}, mode="prompt_group")
    await coord.start()
    await coord.submit("p7", PromptRef(sample_id="s7", task_name="math"), "math-agent", 4, payload)
    async for group in coord.sealed_groups(): await coord.claim_for_training(group.group_id, step)
    outcome = await coord.checkpoint("ckpt-1")
    prepared = await coord.prepare_checkpoint("ckpt-2")           # split: save between the phases
    if isinstance(prepared, PreparedCheckpoint): save(); outcome = await coord.commit_checkpoint("ckpt-2")
    logger.log(await coord.metrics(), step)                       # a flat dict[str, float]
    coord = await RolloutCoordinator.recover(store, agents)   # after a crash

Every decision is an event appended with the stream version this process last saw; everything the
coordinator knows is folded back from the log (`self.ledger`).  One asyncio task drives each open
group; the ACK relay runs beside them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from eventstore import EventStore
from eventstore.events import (
    AttemptMinted,
    AttemptRetired,
    Event,
    GroupAbandoned,
    GroupClaimedForTraining,
    GroupDeadLettered,
    GroupReserved,
    Mode,
    PromptRef,
    ReplacementMinted,
    TrainerEpochTaken,
)
from eventstore.payload_stores import payload_plane
from payloads import PayloadClaim, PayloadCorrupt, PayloadMissing, PayloadPlane
from payloads.token_arrays import TokenArrays, decode_payload
from projections.figures import LogFigures
from projections.group_core import (
    Budget,
    continuation_to_resume,
    dead_letter_reason,
    round_exhausted,
    round_step,
    sibling_exhausted,
)
from projections.ledger import GroupState, LedgerState
from protocol import mutants
from protocol.ids import rollout_id_of
from protocol.levels import TargetLevel, effective_level
from protocol.retry import RetryPolicy
from protocol.streams import group_stream, trainer_stream
from protocol.wire import AttemptRef
from trainer.acks import AckRelay
from trainer.attempts import Attempts, check_row, resume_events
from trainer.checkpoint import Checkpointer, CheckpointOutcome, PreparedCheckpoint
from trainer.context import AttemptOutcome, Context, Settings, log
from trainer.core.attempt import RETIRE_POLICY
from trainer.core.debt import ACK_POLICY
from trainer.core.refusal import refusal_line
from trainer.core.retire_debt import RETIRE_OWED_POLICY
from trainer.errors import (
    AgentShared,
    AlreadyClaimed,
    ClaimWhilePrepared,
    CoordinatorStopped,
    FencedOff,
    GroupConflict,
    LogprobsMismatch,
    NotSealed,
    StreamExists,
    UnknownGroup,
)
from trainer.eventloop import wait_at_most
from trainer.gym import GymClient
from trainer.gym.errors import AgentIdentityError, GymError, TrainerConflictError
from trainer.journal import OUTAGE_BUDGET_S, Journal
from trainer.payload_io import PayloadIO
from trainer.retires import RetireRelay
from trainer.stops import log_stop

# How long `close()` waits for the agents to answer the release of their binding.
RELEASE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class SealedGroup:
    """What training consumes: the group and, per sibling, the sealed try, its reward, its reply and
    its token records.

    `replies` are the agents' `/run` replies (`response`, `reward`, the task fields) and `tokens` the
    token records as arrays (`payloads.token_arrays.TokenArrays`: views of the stored payload, no
    per-token Python object), both read back from the payload plane by their claims; `sealed_groups`
    fills them in, `sealed_unclaimed` does not (it does no I/O).  A try sealed before replies were
    kept has None there.  A reply that carried its records' token arrays (a real Gym agent's) is
    stored and read apart from them (`reply_claims[i].media_type` is `REPLY_APART_MEDIA_TYPE`): its
    arrays are in `tokens[i]`, and `payloads.replies.put_arrays_back(replies[i], tokens[i])` gives the
    agent's reply whole.
    """

    group_id: str
    agent_name: str
    attempts: list[AttemptRef]
    rewards: list[float]
    tokens_digests: list[str]
    reply_digests: list[str] = field(default_factory=list)
    replies: list[dict[str, Any] | None] = field(default_factory=list)
    token_claims: list[PayloadClaim | None] = field(default_factory=list)
    reply_claims: list[PayloadClaim | None] = field(default_factory=list)
    tokens: list[TokenArrays | None] = field(default_factory=list)


class RolloutCoordinator:
    def __init__(
        self,
        store: EventStore,
        agents: dict[str, GymClient],
        *,
        mode: Mode = "sibling",
        target_level: TargetLevel = "sibling",
        rollout_timeout_s: float = 600.0,
        prepare_timeout_s: float = 300.0,
        max_tries: int = 4,
        max_infra_failures: int | None = None,
        max_data_failures: int | None = None,
        park_grace_s: float = 1.0,
        max_checkpoint_retires: int = 1,
        carry_completed: bool = True,
        outage_budget_s: float = OUTAGE_BUDGET_S,
        trainer_id: str | None = None,
        retire_policy: RetryPolicy = RETIRE_POLICY,
        ack_policy: RetryPolicy = ACK_POLICY,
        retire_owed_policy: RetryPolicy = RETIRE_OWED_POLICY,
        reconcile_every_s: float = 5.0,
        mask_sample_retries: bool = False,
        payloads: PayloadPlane | None = None,
    ) -> None:
        """`payloads`: where token records and replies are stored (default: beside the log,
        `eventstore.payload_stores.payload_plane`)."""
        self.store = store
        self.mode: Mode = mode
        # The run's target level (docs/turns.md); each group's is lowered to what its agent supports.
        self.target_level: TargetLevel = target_level
        self.settings = Settings(
            rollout_timeout_s=rollout_timeout_s,
            prepare_timeout_s=prepare_timeout_s,
            max_tries=max_tries,
            max_infra_failures=max_infra_failures or max_tries,
            max_data_failures=max_data_failures or max_tries,
            park_grace_s=park_grace_s,
            max_checkpoint_retires=max_checkpoint_retires,
            carry_completed=carry_completed,
            trainer_id=trainer_id,
            retire_policy=retire_policy,
            ack_policy=ack_policy,
            retire_owed_policy=retire_owed_policy,
            reconcile_every_s=reconcile_every_s,
            mask_sample_retries=mask_sample_retries,
        )
        self.journal = Journal(store, outage_budget_s=outage_budget_s)
        self.ctx = Context(self.journal, dict(agents), self.settings)
        self.payloads = PayloadIO(payloads or payload_plane(store), outage_budget_s, self._stop_for_good)
        self.tries = Attempts(self.ctx, self.payloads)
        self.relay = AckRelay(self.ctx)
        self.retires = RetireRelay(self.ctx)
        self.checkpointer = Checkpointer(self.ctx, self.tries, self.relay, self.retires)
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._started = False
        self._epoch_reason: Literal["start", "recovery"] = "start"
        self._reconciler: asyncio.Task[None] | None = None
        self.errors: list[BaseException] = self.ctx.errors
        self.stats: dict[str, int] = {"replacements": 0, "abandoned": 0, "dead_lettered": 0}
        # What `metrics()` reports, folded from the log (so a restart does not reset a count).
        self.figures = LogFigures()

    # --- life ------------------------------------------------------------------------------------

    @property
    def ledger(self) -> LedgerState:
        return self.journal.ledger

    async def start(self) -> RolloutCoordinator:
        """Folds the log and starts the ACK relay (idempotent)."""
        if not self._started:
            # What each agent supports (a plain Gym agent is driven in reduced mode) and who it is.
            await asyncio.gather(*(client.connect_quietly() for client in self.ctx.agents.values()))
            # One trainer per agent, before anything is written: an agent another trainer drives is
            # refused here, with nothing in the log.
            await self._bind_agents()
            # The epoch first, then the fold: once the epoch is in the log no earlier owner's append is
            # accepted, so the fold (and the stream versions this process adopts from it) is final.
            # Folded before the epoch, an append the old owner made in between would leave this
            # process a version behind on that stream, and its next append there would fence it off.
            await self.journal.take_epoch(
                trainer_stream(self.settings.trainer_id),
                TrainerEpochTaken(
                    trainer_id=self.settings.trainer_id, reason=self._epoch_reason, writer=self.journal.writer
                ),
            )
            await self.journal.load()
            await self._check_agents()
            self.relay.start()
            self.retires.start()
            if self.settings.reconcile_every_s > 0:
                self._reconciler = asyncio.create_task(self._reconcile_loop(), name="reconcile")
            self._started = True
        return self

    async def _bind_agents(self) -> None:
        """Binds every agent to this trainer (participant.driver), or raises `AgentShared` naming the
        trainer that drives it.  An agent away now is bound by its first call (each names the trainer)."""
        me = self.settings.trainer_id
        for name, client in sorted(self.ctx.agents.items()):
            client.drive_as(me)
            if client.capabilities_seen is None:
                continue  # away now (connect_quietly said nothing): bound by its first call
            try:
                await client.bind_driver(me)
            except TrainerConflictError as exc:
                raise AgentShared(refusal_line(client.base_url, exc.message)) from None
            except GymError as exc:
                log.warning("agent %s not bound at start (bound at its first call): %s", name, exc)

    async def _release_agents(self) -> None:
        """At close: each agent that holds nothing of this trainer any more is free for another one.
        Not by a fenced process (its trainer's new owner drives the agents now)."""
        if self.journal.fenced is not None:
            return
        me = self.settings.trainer_id

        async def release(name: str, client: GymClient) -> None:
            try:
                await client.release_driver(me)
            except GymError as exc:
                log.info("agent %s: binding not released at close (kept for this trainer): %s", name, exc)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                await asyncio.gather(
                    *(release(n, c) for n, c in self.ctx.agents.items() if n not in self.ctx.refused)
                )

    async def _reconcile_loop(self) -> None:
        """An agent's checkpoint phase is compared with the log continuously, not only at recovery:
        an agent left preparing or paused by a checkpoint nobody drives any more (its coordinator
        died, an abort never reached it) is brought to the log's decision."""
        while not self.ctx.stopping:
            await asyncio.sleep(self.settings.reconcile_every_s)
            for name, client in sorted(self.ctx.agents.items()):
                if self.ctx.checkpoint_in_flight or self.ctx.stopping:
                    break
                if name in self.ctx.refused:  # another trainer's agent (trainer.core.refusal)
                    continue
                try:
                    if not await self._check_identity(name, client):
                        continue
                    self.ctx.answered(name)
                    await self.checkpointer.reconcile(name, client)
                except (FencedOff, CoordinatorStopped) as exc:
                    log_stop("reconciliation", exc)
                    return
                except Exception:
                    log.exception(
                        "reconciling %s failed; tried again in %.1f s", name, self.settings.reconcile_every_s
                    )

    async def _check_identity(self, name: str, client: GymClient) -> bool:
        """The agent behind `client` is still `name` (a reconnect may reach another process); a new
        incarnation (it restarted) is recorded.  False when it cannot be driven now."""
        try:
            health = await client.health()
        except GymError as exc:
            log.info("agent %s unreachable: %s", name, exc)
            return False
        if health.agent_name != name:
            error = AgentIdentityError(
                f"the agent at {client.base_url} is now {health.agent_name!r}, not {name!r}: not driven "
                "until it is (its receipts would be owed to the wrong agent)"
            )
            log.error("%s", error)
            if not any(isinstance(e, AgentIdentityError) and str(e) == str(error) for e in self.errors):
                self.errors.append(error)
            return False
        known = self.ctx.incarnations.get(name)
        if known is not None and health.execution_incarnation != known:
            log.warning(
                "agent %s restarted: incarnation %s -> %s (generation %d)",
                name,
                known,
                health.execution_incarnation,
                health.execution_generation,
            )
        self.ctx.incarnations[name] = health.execution_incarnation
        return True

    async def _check_agents(self) -> None:
        """Each agent must be who the coordinator calls it; its incarnation is recorded (a later change
        is a restart).  An agent away now is checked at the next reconcile."""
        for name, client in sorted(self.ctx.agents.items()):
            try:
                health = await client.health()
            except GymError as exc:
                log.warning("agent %s not reachable at start (identity checked later): %s", name, exc)
                continue
            if health.agent_name != name:
                raise AgentIdentityError(
                    f"the agent at {client.base_url} is {health.agent_name!r}, not {name!r}: fix the "
                    "coordinator's agents mapping (its receipts would be owed to the wrong agent)"
                )
            self.ctx.incarnations[name] = health.execution_incarnation

    async def __aenter__(self) -> RolloutCoordinator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Aborts a prepared checkpoint nobody decided, then stops the drivers and the relay (tries in
        flight stay at the agents, for recovery)."""
        if not self.ctx.stopping:
            try:
                await self.checkpointer.abort_undecided(
                    "the coordinator closed before the checkpoint was decided"
                )
            except Exception:  # the log is gone: recovery presumes the abort; the agents were aborted
                log.exception("aborting the undecided checkpoint at close failed")
        self.ctx.stopping = True
        drivers = list(self._drivers.values())  # a driver that ends removes itself
        for task in drivers:
            task.cancel()
        for task in drivers:
            with contextlib.suppress(BaseException):
                await task
        await self.retires.stop()
        await self.relay.stop()
        if self._reconciler is not None:
            self._reconciler.cancel()
            with contextlib.suppress(BaseException):
                await self._reconciler
        await self.checkpointer.stop()
        if self._started:
            await self._release_agents()

    @classmethod
    async def recover(
        cls,
        store: EventStore,
        agents: dict[str, GymClient],
        *,
        restore_to: str | None = None,
        claims_kept: bool = False,
        **kwargs: Any,
    ) -> RolloutCoordinator:
        """A coordinator rebuilt from the log, carrying on (trainer/recovery.py).  `restore_to`: the
        checkpoint the trainer loaded (None: its newest committed one), whose cut its claims roll
        back to; `claims_kept`: the trainer kept its state (only this process restarted), so none
        rolls back.  `RestoreRefused` for a checkpoint the log cannot restore it to (the coordinator
        took its owner epoch, then closes; nothing else is written)."""
        from trainer.recovery import recover

        coord = cls(store, agents, **kwargs)
        coord._epoch_reason = "recovery"
        return await recover(coord, restore_to=restore_to, claims_kept=claims_kept)

    def _check_alive(self) -> None:
        if self.journal.fenced is not None:
            raise self.journal.fenced
        if self.journal.stopped is not None:
            raise self.journal.stopped
        if self.ctx.stopping:
            raise CoordinatorStopped("the coordinator is closed")

    # --- submitting --------------------------------------------------------------------------------

    async def submit(
        self,
        group_id: str,
        prompt_ref: PromptRef,
        agent_name: str,
        expected_generations: int,
        payload: dict[str, Any] | None = None,
        *,
        mode: Mode | None = None,
        target_level: TargetLevel | None = None,
        target_step: int | None = None,
    ) -> GroupState | None:
        """Reserves the group with its first tries (one append), then dispatches every sibling.

        `target_level` (default: the coordinator's) is lowered to what the agent supports
        (`protocol.levels.effective_level` of its `/capabilities`); both are recorded.

        Idempotent: a group id the log already holds with the same request is not reserved again; an
        open one is driven (a retried call resumes it) and its state returned.  The same id with another
        request raises `GroupConflict`.  Returns the group as the ledger holds it (None once archived).
        """
        self._check_alive()
        refused = self.ctx.refused.get(agent_name)
        if refused is not None:  # as at start: nothing written for an agent that refused this trainer
            raise refused
        check_row(payload or {}, f"group {group_id!r}")
        await self.start()
        requested = target_level or self.target_level
        reserved = GroupReserved(
            group_id=group_id,
            prompt_ref=prompt_ref,
            agent_name=agent_name,
            expected_generations=expected_generations,
            mode=mode or self.mode,
            target_level=await self._level_at(agent_name, requested),
            requested_level=requested,
            target_step=target_step,
            max_tries=self.settings.max_tries,
            max_infra_failures=self.settings.max_infra_failures,
            max_data_failures=self.settings.max_data_failures,
            payload=payload or {},
            trainer_id=self.settings.trainer_id,
        )
        if self.ledger.knows_group(group_id):
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
        group = self.ledger.groups.get(group_id)
        if group is not None and group.status == "open" and self.owns(group):
            self._drive(group_id)
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
        client = self.ctx.client(agent_name)
        if effective_level(requested, ()) == requested:
            return requested  # a level that needs no feature: no need to ask the agent
        if client.capabilities_seen is None:
            await client.connect_quietly()
        seen = client.capabilities_seen
        level = effective_level(requested, seen.features if seen is not None else ())
        if level != requested:
            log.info("agent %s runs groups at level %s (asked: %s)", agent_name, level, requested)
        return level

    def _stop_for_good(self, stopped: CoordinatorStopped) -> None:
        """A payload store gone past the outage budget stops the coordinator as the log's outage does."""
        if self.journal.stopped is None:
            self.journal.stopped = stopped

    def _drive(self, group_id: str) -> None:
        if group_id not in self._drivers or self._drivers[group_id].done():
            self._drivers[group_id] = asyncio.create_task(self._run_group(group_id), name=f"group:{group_id}")

    async def _run_group(self, group_id: str) -> None:
        try:
            group = self.ledger.groups[group_id]
            if group.mode == "sibling":
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
            left = self.ledger.groups.get(group_id)
            if left is None or left.status != "open":
                self.ctx.forget_group(group_id)
                if self._drivers.get(group_id) is asyncio.current_task():
                    del self._drivers[group_id]

    # --- sibling mode --------------------------------------------------------------------------------

    async def _drive_siblings(self, group_id: str) -> None:
        group = self.ledger.groups[group_id]
        exhausted = await asyncio.gather(
            *(self._drive_sibling(group_id, gi) for gi in sorted(group.siblings))
        )
        group = self.ledger.groups.get(group_id)  # type: ignore[assignment]
        if group is None or group.status != "open":
            return
        spent = [e for e in exhausted if e is not None]
        if spent:
            await self._dead_letter(group, [], spent[0][0], spent[0][1])

    async def _drive_sibling(self, group_id: str, gi: int) -> tuple[str, Budget | None] | None:
        """Attempts one sibling until it is sealed (None) or it cannot go on: (why, the budget spent,
        None for a stranded try)."""
        while True:
            self._check_alive()
            group = self.ledger.groups.get(group_id)
            if group is None or group.status != "open":
                return None
            sibling = group.siblings[gi]
            if sibling.status == "sealed":
                return None
            n = sibling.current_attempt
            outcome = await self.tries.settle(group_id, gi, n)
            if outcome.kind == "finished":
                continue
            retired = await self._record_checkpoint_losses(
                group_id, _retired_event(sibling.rollout_id, n, outcome)
            )
            group = self.ledger.groups[group_id]
            # The same rule as the recovery plan's (projections.group_core).
            budget = sibling_exhausted(group, group.siblings[gi])
            # A stranded try may still be finished at the agent: never replaced (retire-before-replace).
            if budget is not None or outcome.kind == "stranded":
                if retired:
                    await self.journal.append(group_stream(group_id), retired)
                return (outcome.reason if budget is None else dead_letter_reason(budget, group)), budget
            replacement = ReplacementMinted(
                rollout_id=sibling.rollout_id,
                generation_index=gi,
                attempt_index=n + 1,
                replaces=n,
                reason=outcome.reason[:300] or outcome.kind,
                continues=continuation_to_resume(group, group.siblings[gi].attempts[n], outcome.continuation),
            )
            await self.journal.append(group_stream(group_id), [*retired, replacement])
            self.stats["replacements"] += 1

    # --- prompt_group mode ---------------------------------------------------------------------------

    async def _drive_prompt_group(self, group_id: str) -> None:
        while True:
            self._check_alive()
            group = self.ledger.groups.get(group_id)
            if group is None or group.status != "open":
                return
            siblings = sorted(group.siblings.values(), key=lambda s: s.generation_index)
            # A round whose siblings are all held was sealed in the same append as its last hold;
            # a log that stops in between (it cannot, but be safe) is sealed here.
            if all(s.status == "held" for s in siblings):
                seals = self.tries.seal_if_complete(group, "", None)
                if seals:
                    await self.journal.append(group_stream(group_id), seals)
                    continue
            # The plan's rule (projections.group_core.round_step): a round a crash interrupted between
            # its dispatches is not completed with tries sent now (its siblings would come from
            # different policy versions): its unsent tries count as retired and the round is rerun.
            interrupted = round_step(group).interrupted
            tasks = {
                s.generation_index: asyncio.create_task(
                    _never_sent()
                    if interrupted and s.current is not None and s.current.status == "minted"
                    else self.tries.settle(group_id, s.generation_index, s.current_attempt)
                )
                for s in siblings
            }
            outcomes = await self._round(group_id, tasks)
            group = self.ledger.groups[group_id]
            if group.status != "open":
                return
            failed = {gi: o for gi, o in outcomes.items() if o.kind != "finished"}
            if not failed:
                continue  # all held: sealed by the last hold's append
            current = {gi: group.siblings[gi].current_attempt for gi in outcomes}
            retired: list[Event] = []
            for gi, o in outcomes.items():
                retired += _retired_event(group.siblings[gi].rollout_id, current[gi], o)
            retired = await self._record_checkpoint_losses(group_id, retired)
            group = self.ledger.groups[group_id]
            reason = "; ".join(f"g{gi}: {o.reason}" for gi, o in sorted(failed.items()))[:500]
            refs = [
                AttemptRef(rollout_id=group.siblings[gi].rollout_id, attempt_index=n)
                for gi, n in sorted(current.items())
            ]
            budget = round_exhausted(group)
            if budget is not None or any(o.kind == "stranded" for o in failed.values()):
                why = reason if budget is None else f"{dead_letter_reason(budget, group)}; {reason}"
                await self._dead_letter(group, retired, why[:500], budget)
                return
            replacements = [
                ReplacementMinted(
                    rollout_id=group.siblings[gi].rollout_id,
                    generation_index=gi,
                    attempt_index=n + 1,
                    replaces=n,
                    reason=f"group abandoned: {reason}"[:300],
                    continues=continuation_to_resume(
                        group, group.siblings[gi].attempts[n], outcomes[gi].continuation
                    ),
                )
                for gi, n in sorted(current.items())
            ]
            await self.journal.append(
                group_stream(group_id),
                [*retired, GroupAbandoned(group_id=group_id, reason=reason, attempts=refs), *replacements],
            )
            self.stats["abandoned"] += 1
            self.stats["replacements"] += len(replacements)

    async def _record_checkpoint_losses(self, group_id: str, retired: list[Event]) -> list[Event]:
        """A try a checkpoint retired spends no budget, and the budget rule reads that from the log
        (projections.group_core): such retires are appended first, on their own (the rest are
        returned, to go with the replacement or the dead letter as before)."""
        lost = [e for e in retired if isinstance(e, AttemptRetired) and e.cause == "checkpoint"]
        if not lost:
            return retired
        await self.journal.append(group_stream(group_id), retired)
        return []

    async def _round(
        self, group_id: str, tasks: dict[int, asyncio.Task[AttemptOutcome]]
    ) -> dict[int, AttemptOutcome]:
        """Waits for every sibling; at the first failure retires (or adopts) the ones still running."""
        pending = set(tasks.values())
        giving_up = False
        helpers: list[asyncio.Task[AttemptOutcome]] = []
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if not giving_up and any(t.result().kind != "finished" for t in done):
                    giving_up = True
                    group = self.ledger.groups[group_id]
                    for gi, task in tasks.items():
                        if task in pending:
                            sibling = group.siblings[gi]
                            helpers.append(
                                asyncio.create_task(
                                    self.tries.resolve(group_id, sibling.rollout_id, sibling.current_attempt)
                                )
                            )
            await asyncio.gather(*helpers)
        except BaseException:
            for task in [*tasks.values(), *helpers]:
                task.cancel()
            raise
        return {gi: task.result() for gi, task in tasks.items()}

    async def _dead_letter(
        self, group: GroupState, retired: list[Event], reason: str, budget: Budget | None
    ) -> None:
        tries = [
            AttemptRef(rollout_id=s.rollout_id, attempt_index=a)
            for s in sorted(group.siblings.values(), key=lambda s: s.generation_index)
            for a in sorted(s.attempts)
        ]
        # Why first (the budget spent, or the stranded try), then every try's recorded failures.
        reasons = [
            reason,
            *(
                f"{s.rollout_id}#{a.attempt_index}: {f}"
                for s in group.siblings.values()
                for a in s.attempts.values()
                for f in a.failures
            ),
        ]
        await self.journal.append(
            group_stream(group.group_id),
            [
                *retired,
                GroupDeadLettered(
                    group_id=group.group_id,
                    tries=tries,
                    reasons=[r[:300] for r in reasons[:100]],
                    budget=budget,
                ),
            ],
        )
        self.stats["dead_lettered"] += 1

    # --- training -------------------------------------------------------------------------------------

    def owns(self, group: GroupState) -> bool:
        """Other trainers' groups share the log (and the fold) but are never driven or trained here."""
        return group.trainer_id == self.settings.trainer_id

    def sealed_unclaimed(self) -> list[SealedGroup]:
        return [_sealed(g) for g in self._unclaimed()]

    def _unclaimed(self) -> list[GroupState]:
        groups = self.ledger.groups
        return [g for g in map(groups.__getitem__, self.ledger.sealed_unclaimed_ids()) if self.owns(g)]

    def open_groups(self) -> list[str]:
        groups = self.ledger.groups
        return [gid for gid in self.ledger.open_group_ids() if self.owns(groups[gid])]

    async def sealed_groups(self, *, until_idle: bool = True) -> AsyncIterator[SealedGroup]:
        """Sealed, unclaimed groups as they seal.  With `until_idle`, ends once no group is open."""
        seen: set[str] = set()
        while True:
            # Each group's SealedGroup is built once, when it is handed out: groups handed out and not
            # yet claimed (a training step collecting its batch) are passed over at every batch.
            for group in self._unclaimed():
                if group.group_id not in seen:
                    seen.add(group.group_id)
                    yield await self.with_payloads(_sealed(group))
            if self.journal.fenced is not None:
                raise self.journal.fenced
            if self.journal.stopped is not None:
                raise self.journal.stopped
            waiting = self.open_groups()
            # Groups on an agent that refused this trainer wait open, undriven: nothing to wait for.
            stuck = [
                self.ctx.refused[a]
                for g in waiting
                if (a := self.ledger.groups[g].agent_name) in self.ctx.refused
            ]
            idle = len(stuck) == len(waiting) and all(t.done() for t in self._drivers.values())
            if until_idle and idle and all(g.group_id in seen for g in self._unclaimed()):
                if stuck:
                    raise stuck[0]
                return
            await self.journal.wait_changed(0.5)

    async def with_payloads(self, group: SealedGroup) -> SealedGroup:
        """The group with its siblings' replies and token records read by their claims (one read per
        store for the whole group), checked against them; the arrays are read-only views of the bytes
        read (not copied)."""
        claims = [c for c in (*group.reply_claims, *group.token_claims) if c is not None]
        found = await self.payloads.get_many(claims)
        replies = [orjson.loads(found[c.digest]) if c is not None else None for c in group.reply_claims]
        tokens = [
            decode_payload(found[c.digest], c.media_type, check_canonical=False, reply=reply)
            if c is not None
            else None
            for c, reply in zip(group.token_claims, replies, strict=True)
        ]
        return dataclasses.replace(group, replies=replies, tokens=tokens)

    async def claim_for_training(
        self, group_id: str, train_step: int | None = None, *, call_id: str | None = None
    ) -> None:
        """Records that training consumed the sealed group, at `train_step` when the trainer names
        one (None: it named none; nothing is made up), `call_id` the caller's own identity that a
        retry of it keeps (e.g. a Ray task id)."""
        self._check_alive()

        def build(ledger: LedgerState) -> list[Event]:
            # Checked when the append is built: the flag is raised before CheckpointPrepareStarted is
            # queued and lowered after the decision is written, so no claim lands between the two.
            held = None if mutants.active("claim_while_prepared") else self.ctx.active_checkpoint
            if held is not None:
                raise ClaimWhilePrepared(
                    f"group {group_id!r} cannot be claimed while checkpoint {held!r} is prepared and "
                    "undecided: claim it after the commit or abort"
                )
            group = ledger.groups.get(group_id)
            if group is None:
                if group_id in ledger.archived:
                    raise AlreadyClaimed(f"group {group_id!r} was trained on and archived")
                raise UnknownGroup(f"unknown group {group_id!r}")
            if not self.owns(group):
                raise UnknownGroup(
                    f"group {group_id!r} belongs to trainer {group.trainer_id!r}, not this one"
                )
            if group.status != "sealed":
                raise NotSealed(f"group {group_id!r} is {group.status}, not sealed")
            if group.claims:
                raise AlreadyClaimed(f"group {group_id!r} was claimed for step {group.claims[-1].train_step}")
            return [GroupClaimedForTraining(group_id=group_id, train_step=train_step, call_id=call_id)]

        await self.journal.append(group_stream(group_id), build)

    # --- checkpoints and waiting ------------------------------------------------------------------------

    async def checkpoint(
        self, checkpoint_id: str, participants: list[str] | None = None
    ) -> CheckpointOutcome:
        """Prepare, then commit at once: `prepare_checkpoint` and `commit_checkpoint` in one call."""
        self._check_alive()
        return await self.checkpointer.checkpoint(checkpoint_id, participants)

    async def prepare_checkpoint(
        self, checkpoint_id: str, participants: list[str] | None = None
    ) -> PreparedCheckpoint | CheckpointOutcome:
        """The first phase: returns a `PreparedCheckpoint` once every participant is prepared (its
        admission closed, nothing of it running or owed), or the aborted `CheckpointOutcome`.

        The trainer saves its own state, then calls `commit_checkpoint` or `abort_checkpoint` promptly:
        while prepared no rollout progresses at the participants and no other checkpoint may start
        (`CheckpointBusy`).  Never decided, it is presumed aborted: by `close()`, or by `recover` after
        the trainer died.
        """
        self._check_alive()
        return await self.checkpointer.prepare(checkpoint_id, participants)

    async def commit_checkpoint(self, checkpoint_id: str) -> CheckpointOutcome:
        """Commits the prepared checkpoint (the cut is taken now) and resumes every agent.
        `UnknownCheckpoint` / `CheckpointDecided` when `checkpoint_id` is not the prepared one."""
        self._check_alive()
        return await self.checkpointer.commit(checkpoint_id)

    async def abort_checkpoint(
        self, checkpoint_id: str, reason: str = "aborted by the trainer"
    ) -> CheckpointOutcome:
        """Aborts the prepared checkpoint (recorded with `reason`) at every agent, until each confirms."""
        self._check_alive()
        return await self.checkpointer.abort(checkpoint_id, reason)

    # --- what a trainer logs and records ------------------------------------------------------------------

    async def metrics(self) -> dict[str, float]:
        """A flat `dict[str, float]` for a trainer's logger (NeMo RL logs one per step).

        Counts are folded from the log, so they survive a restart; `journal/*` are this process's own.
        """
        await self.journal.read(lambda: self.figures.catch_up(self.store), "folding the log's figures")
        flat = self.figures.flat()
        batches = max(self.journal.batches, 1)
        flat["journal/appends"] = float(self.journal.appends)
        flat["journal/batches"] = float(self.journal.batches)
        flat["journal/appends_per_batch"] = self.journal.appends / batches
        flat["payloads/puts"] = float(self.payloads.puts)
        flat["payloads/store_calls"] = float(self.payloads.put_calls)
        flat["coordinator/open_groups"] = float(len(self.open_groups()))
        flat["coordinator/queued_tries"] = float(self.queued_tries())
        return flat

    def queued_tries(self) -> int:
        """Tries waiting for a connection of their agent's run pool (`max_run_connections`): minted,
        not yet dispatched, and spending none of their lease while they wait."""
        return sum(client.runs_waiting for client in self.ctx.agents.values())

    async def record_logprobs(
        self, rollout_id: str, attempt_index: int, logprobs: Sequence[float], policy_version: str
    ) -> bool:
        """Records logprobs the trainer computed for a sealed try as its `LogprobsComputed`.

        Checked against the try's token records like a logprob worker's; `LogprobsMismatch` when they
        do not fit (or the try is not sealed).  False when the log already holds this very result.
        """
        from trainer import own_logprobs

        self._check_alive()
        attempt = self.ledger.attempt(rollout_id, attempt_index)
        if attempt is None or attempt.status != "sealed" or attempt.rollout_receipt is None:
            state = "unknown" if attempt is None else attempt.status
            raise LogprobsMismatch(f"try ({rollout_id}, {attempt_index}) is {state}, not sealed")
        receipt = attempt.rollout_receipt
        claim = receipt.tokens_claim()
        content: bytes | None
        try:
            content = (await self.payloads.get_many([claim]))[claim.digest]
        except PayloadMissing:
            content = None  # decide names it
        except PayloadCorrupt as exc:
            raise LogprobsMismatch(f"({rollout_id}, {attempt_index}): {exc}") from None
        decided = own_logprobs.decide(
            receipt, content, claim.media_type, rollout_id, attempt_index, logprobs, policy_version
        )
        [decided_claim] = await self.payloads.put([(decided.content, decided.media_type)])
        decided = dataclasses.replace(
            decided, event=decided.event.model_copy(update={"logprobs": decided_claim})
        )
        source = f"trainer:{self.settings.trainer_id or ''}"
        # Idempotent by event id: a write retried after an outage that had committed is a no-op.
        return await self.journal.read(
            lambda: own_logprobs.write(self.store, decided, source), "recording trainer logprobs"
        )

    async def wait_checkpoint_decided(self, timeout_s: float) -> bool:
        """Waits (at most `timeout_s`) until no checkpoint of this coordinator is prepared and
        undecided; True when none is."""
        await wait_at_most(self.ctx.checkpoint_idle.wait(), timeout_s)
        return self.ctx.active_checkpoint is None

    async def wait_idle(self, timeout_s: float | None = None) -> None:
        """Until every group driver has finished and every debt is paid (or raises the first error)."""
        async with asyncio.timeout(timeout_s):
            while True:
                drivers = [t for t in list(self._drivers.values()) if not t.done()]
                if drivers:
                    await asyncio.wait(drivers)
                    continue
                if self.errors:
                    raise self.errors[0]
                owed = self.relay.owed_agents()
                if not owed:
                    return
                for agent in owed:
                    await self.relay.flush(agent, 5.0)
                await asyncio.sleep(0.05)


async def _never_sent() -> AttemptOutcome:
    return AttemptOutcome("retired", "never sent: its round was interrupted between its dispatches")


def _retired_event(rollout_id: str, attempt_index: int, outcome: AttemptOutcome) -> list[Event]:
    if outcome.kind != "retired" or outcome.recorded or outcome.retire_outcome is None:
        return []
    return [
        *resume_events(rollout_id, attempt_index, outcome.resume),
        AttemptRetired(
            rollout_id=rollout_id,
            attempt_index=attempt_index,
            outcome=outcome.retire_outcome,
            execution_generation=outcome.execution_generation,
            execution_incarnation=outcome.execution_incarnation,
            checkpoint_id=outcome.checkpoint_id,
            cause=outcome.cause,
            work=outcome.work,
            continuation=outcome.continuation,
        ),
    ]


def _sealed(group: GroupState) -> SealedGroup:
    siblings = sorted(group.siblings.values(), key=lambda s: s.generation_index)
    refs, rewards, digests, replies = [], [], [], []
    token_claims: list[PayloadClaim | None] = []
    reply_claims: list[PayloadClaim | None] = []
    for s in siblings:
        index = s.sealed_attempt if s.sealed_attempt is not None else s.current_attempt
        attempt = s.attempts[index]
        refs.append(AttemptRef(rollout_id=s.rollout_id, attempt_index=index))
        rewards.append(float(s.reward if s.reward is not None else 0.0))
        receipt = attempt.rollout_receipt
        digests.append(receipt.tokens_digest if receipt else "")
        replies.append(attempt.reply_digest or "")
        token_claims.append(receipt.tokens_claim() if receipt else None)
        reply_claims.append(attempt.reply_claim)
    return SealedGroup(
        group.group_id,
        group.agent_name,
        refs,
        rewards,
        digests,
        replies,
        token_claims=token_claims,
        reply_claims=reply_claims,
    )
