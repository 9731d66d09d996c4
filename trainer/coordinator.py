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

The coordinator wires one part per concern and keeps the public API (in the manner of Temporal's
`Worker`): the agents (`agents.py`), the groups and their drivers (`groups.py`), one attempt's life
(`attempts.py`, `keep.py`), the two relays (`acks.py`, `retires.py`), the checkpoint's phases
(`checkpoints/`), recovery (`recovery.py`); what a caller reads of them is `reads.py`'s.  Each part gets what it needs in its constructor; the
only state they share is the log (`journal.py`) and the checkpoint gate (`gate.py`).  Every decision
is an event appended with the stream version this process last saw; everything the coordinator knows
is folded back from the log (`ledger`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, TypeVar

from eventstore import EventStore
from eventstore.events import Mode, PromptRef, TrainerEpochTaken
from eventstore.payload_stores import payload_plane
from payloads import PayloadClaim, PayloadPlane
from payloads.token_arrays import TokenArrays
from projections.figures import LogFigures
from projections.ledger import GroupState
from projections.recovery import RestoreRefused
from protocol.levels import TargetLevel
from protocol.retry import RetryPolicy
from protocol.streams import trainer_stream
from trainer import own_logprobs
from trainer.acks import AckRelay
from trainer.agents import Agents
from trainer.attempts import Attempts
from trainer.checkpoints import CheckpointOutcome, Checkpoints, Finisher, PreparedCheckpoint, Unblocker
from trainer.core.attempt import RETIRE_POLICY
from trainer.core.debt import ACK_POLICY
from trainer.core.retire_debt import RETIRE_OWED_POLICY
from trainer.errors import (
    CoordinatorStopped,
)
from trainer.gate import Gate
from trainer.groups import Groups
from trainer.gym import GymClient
from trainer.journal import Journal
from trainer.keep import Keeper
from trainer.logview import OUTAGE_BUDGET_S
from trainer.payload_io import PayloadIO
from trainer.reads import CoordinatorReads
from trainer.recovery import recover
from trainer.retires import RetireRelay
from trainer.rows import check_row
from trainer.sealed import SealedGroup, Training, read_payloads, with_payloads
from trainer.settings import Settings, log

_T = TypeVar("_T")


class RolloutCoordinator(CoordinatorReads):
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
        self.settings = settings = Settings(
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
        self.errors: list[BaseException] = []
        self._journal = journal = Journal(store, outage_budget_s=outage_budget_s)
        self._gate = gate = Gate()
        self._payloads = PayloadIO(payloads or payload_plane(store), outage_budget_s, self._stop_for_good)
        self._agents = Agents(agents, settings, gate, self.errors)
        self._retires = RetireRelay(journal, self._agents, settings, gate, self._wake_acks)
        self._acks = AckRelay(journal, self._agents, settings, gate, self._retires.answered)
        keeper = Keeper(journal, self._agents, settings, self._payloads, self._acks.wake)
        self._attempts = Attempts(
            journal, self._agents, settings, gate, keeper, self._acks.wake, self._retires.wake
        )
        self._finisher = Finisher(journal, self._agents, settings, gate, self._retires)
        unblocker = Unblocker(journal, self._agents, settings, self._attempts, self._acks)
        self._checkpoints = Checkpoints(
            journal, self._agents, settings, gate, self._acks, unblocker, self._finisher
        )
        self._groups = Groups(
            store, journal, self._agents, settings, self._attempts, self.errors, self.check_alive
        )
        self._training = Training(journal, self._groups, gate, self._payloads)
        self._started = False
        self._epoch_reason: Literal["start", "recovery"] = "start"
        # What `metrics()` reports, folded from the log (so a restart does not reset a count).
        self.figures = LogFigures()

    def _wake_acks(self) -> None:
        self._acks.wake()

    # --- life ------------------------------------------------------------------------------------

    async def start(self) -> RolloutCoordinator:
        """Binds the agents, takes this trainer's owner epoch, folds the log and starts the relays
        (idempotent)."""
        if not self._started:
            await self._agents.connect()
            # The epoch first, then the fold: once the epoch is in the log no earlier owner's append is
            # accepted, so the fold (and the stream versions this process adopts from it) is final.
            # Folded before the epoch, an append the old owner made in between would leave this
            # process a version behind on that stream, and its next append there would fence it off.
            await self._journal.take_epoch(
                trainer_stream(self.settings.trainer_id),
                TrainerEpochTaken(
                    trainer_id=self.settings.trainer_id,
                    reason=self._epoch_reason,
                    writer=self._journal.writer,
                ),
            )
            await self._journal.load()
            await self._agents.check_identities()
            self._acks.start()
            self._retires.start()
            self._agents.start_reconciling(self._finisher.reconcile, self._retires.answered)
            self._started = True
        return self

    async def __aenter__(self) -> RolloutCoordinator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Aborts a prepared checkpoint nobody decided, then stops the drivers and the relays (attempts in
        flight stay at the agents, for recovery); the agents are released unless this process was
        fenced off (its trainer's new owner drives them now)."""
        if not self._gate.closing:
            try:
                await self._checkpoints.abort_undecided(
                    "the coordinator closed before the checkpoint was decided"
                )
            except Exception:  # the log is gone: recovery presumes the abort; the agents were aborted
                log.exception("aborting the undecided checkpoint at close failed")
        self._gate.closing = True
        await self._groups.stop()
        await self._retires.stop()
        await self._acks.stop()
        await self._agents.stop_reconciling()
        await self._finisher.stop()
        if self._started and self._journal.fenced is None:
            await self._agents.release()

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
        coord = cls(store, agents, **kwargs)
        coord._epoch_reason = "recovery"
        await coord.start()
        try:
            await recover(
                coord._journal,
                coord.settings,
                coord._groups,
                coord._finisher,
                coord._acks,
                restore_to=restore_to,
                claims_kept=claims_kept,
            )
        except RestoreRefused:
            await coord.close()
            raise
        return coord

    def check_alive(self) -> None:
        """Raises why this coordinator can do nothing more: fenced off by a newer owner, stopped by an
        outage past its budget, or closed."""
        if self._journal.fenced is not None:
            raise self._journal.fenced
        if self._journal.stopped is not None:
            raise self._journal.stopped
        if self._gate.closing:
            raise CoordinatorStopped("the coordinator is closed")

    def _stop_for_good(self, stopped: CoordinatorStopped) -> None:
        """A payload store gone past the outage budget stops the coordinator as the log's outage does."""
        if self._journal.stopped is None:
            self._journal.stopped = stopped

    # --- submitting ------------------------------------------------------------------------------

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
        """Reserves the group with its first attempts (one append), then drives it.

        `target_level` (default: the coordinator's) is lowered to what the agent supports
        (`protocol.levels.effective_level` of its `/capabilities`); both are recorded.

        Idempotent: a group id the log already holds with the same request is not reserved again; an
        open one is driven (a retried call resumes it) and its state returned.  The same id with another
        request raises `GroupConflict`.  Returns the group as the ledger holds it (None once archived).
        """
        self.check_alive()
        refused = self._agents.refused.get(agent_name)
        if refused is not None:  # as at start: nothing written for an agent that refused this trainer
            raise refused
        check_row(payload or {}, f"group {group_id!r}")
        await self.start()
        return await self._groups.submit(
            group_id,
            prompt_ref,
            agent_name,
            expected_generations,
            payload or {},
            mode=mode or self.mode,
            target_level=target_level or self.target_level,
            target_step=target_step,
        )

    # --- training ---------------------------------------------------------------------------------

    def sealed_groups(self, *, until_idle: bool = True) -> AsyncIterator[SealedGroup]:
        """Sealed, unclaimed groups as they seal, their payloads read.  With `until_idle`, ends once
        no group is open."""
        return self._training.sealed_groups(until_idle=until_idle)

    async def with_payloads(self, group: SealedGroup) -> SealedGroup:
        """The group with its siblings' replies and token records read by their claims, checked
        against them (trainer.sealed)."""
        return await with_payloads(self._payloads, group)

    async def read_payloads(
        self, siblings: Sequence[tuple[PayloadClaim | None, PayloadClaim | None]]
    ) -> list[tuple[dict[str, Any] | None, TokenArrays | None]]:
        """Each sibling's (reply, token records) by their (reply claim, token claim) (trainer.sealed)."""
        return await read_payloads(self._payloads, siblings)

    async def claim_for_training(
        self, group_id: str, train_step: int | None = None, *, call_id: str | None = None
    ) -> None:
        """Records that training consumed the sealed group, at `train_step` when the trainer names
        one (None: it named none; nothing is made up), `call_id` the caller's own identity that a
        retry of it keeps (e.g. a Ray task id).  `ClaimWhilePrepared` while a checkpoint is prepared
        and undecided; `AlreadyClaimed`, `NotSealed`, `UnknownGroup` for a group it cannot claim."""
        self.check_alive()
        await self._training.claim(group_id, train_step, call_id)

    # --- checkpoints ------------------------------------------------------------------------------

    async def checkpoint(
        self, checkpoint_id: str, participants: list[str] | None = None
    ) -> CheckpointOutcome:
        """Prepare, then commit at once: `prepare_checkpoint` and `commit_checkpoint` in one call."""
        self.check_alive()
        return await self._checkpoints.checkpoint(checkpoint_id, participants)

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
        self.check_alive()
        return await self._checkpoints.prepare(checkpoint_id, participants)

    async def commit_checkpoint(self, checkpoint_id: str) -> CheckpointOutcome:
        """Commits the prepared checkpoint (the cut is taken now) and resumes every agent.
        `UnknownCheckpoint` / `CheckpointDecided` when `checkpoint_id` is not the prepared one."""
        self.check_alive()
        return await self._checkpoints.commit(checkpoint_id)

    async def abort_checkpoint(
        self, checkpoint_id: str, reason: str = "aborted by the trainer"
    ) -> CheckpointOutcome:
        """Aborts the prepared checkpoint (recorded with `reason`) at every agent, until each confirms."""
        self.check_alive()
        return await self._checkpoints.abort(checkpoint_id, reason)

    async def finish_checkpoints(self) -> dict[str, int]:
        """Every checkpoint of this trainer the log holds undecided is aborted there and at its agents,
        every committed one finished, and each agent's phase brought in line with the log: none is
        left open and no agent keeps its admission closed."""
        return await self._finisher.recover()

    async def wait_checkpoint_decided(self, timeout_s: float) -> bool:
        """Waits (at most `timeout_s`) until no checkpoint of this coordinator is prepared and
        undecided; True when none is."""
        return await self._gate.wait_decided(timeout_s)

    # --- what a trainer logs and records ----------------------------------------------------------

    async def metrics(self) -> dict[str, float]:
        """A flat `dict[str, float]` for a trainer's logger (NeMo RL logs one per step).

        Counts are folded from the log, so they survive a restart; `journal/*` are this process's own.
        """
        await self._journal.read(lambda: self.figures.catch_up(self.store), "folding the log's figures")
        flat = self.figures.flat()
        own = self.journal_figures()
        flat["journal/appends"] = float(own["appends"])
        flat["journal/batches"] = float(own["batches"])
        flat["journal/appends_per_batch"] = own["appends"] / max(own["batches"], 1)
        flat["payloads/puts"] = float(own["payload_puts"])
        flat["payloads/store_calls"] = float(own["payload_store_calls"])
        flat["coordinator/open_groups"] = float(len(self.open_groups()))
        flat["coordinator/queued_attempts"] = float(self.queued_attempts())
        return flat

    async def record_logprobs(
        self, rollout_id: str, attempt_index: int, logprobs: Sequence[float], policy_version: str
    ) -> bool:
        """Records logprobs the trainer computed for a sealed attempt as its `LogprobsComputed`.

        Checked against the attempt's token records like a logprob worker's; `LogprobsMismatch` when
        they do not fit (or the attempt is not sealed).  False when the log already holds this result.
        """
        self.check_alive()
        return await own_logprobs.record(
            self._journal, self._payloads, self.store, self.settings.trainer_id,
            rollout_id, attempt_index, logprobs, policy_version,
        )  # fmt: skip

    async def wait_idle(self, timeout_s: float | None = None) -> None:
        """Until every group driver has finished and every debt is paid (or raises the first error)."""
        async with asyncio.timeout(timeout_s):
            while True:
                await self._groups.wait_drivers()
                if self.errors:
                    raise self.errors[0]
                owed = self._acks.owed_agents()
                if not owed:
                    return
                for agent in owed:
                    await self._acks.flush(agent, 5.0)
                await asyncio.sleep(0.05)


__all__ = ["CheckpointOutcome", "PreparedCheckpoint", "RolloutCoordinator", "SealedGroup"]
