"""A checkpoint's prepare and decision: a two-phase commit with presumed abort across the trainer and
every agent (docs/protocol.md, Checkpoints).

The `CheckpointCommitted` append is the decision.  Before it, anything that goes wrong aborts; after
it, the commit is finished and the agents resumed, now or by recovery (`_finish.py`).  A prepare never
waits for a result the trainer could ACK or adopt: a 409 is answered by paying what is owed and
adopting the rest (`_unblock.py`), then prepare is called again.

Split-phase: `prepare` returns a `PreparedCheckpoint` (every agent prepared, no decision yet) so the
trainer can save its own state before `commit` or `abort`; `checkpoint` is prepare then commit.  One
lock serialises the phases: the one-call `checkpoint` holds it across prepare and commit, so no other
checkpoint comes between them; the split calls take it per phase, and while a checkpoint is prepared
and undecided (`_held`) no other one may start.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

from eventstore.events import CheckpointAborted, CheckpointCommitted, CheckpointPrepareStarted, Event
from projections.ledger import LedgerState
from protocol import mutants
from protocol.retry import RetryState
from protocol.streams import checkpoint_stream
from trainer.acks import AckRelay
from trainer.agents import Agents
from trainer.checkpoints._finish import Finisher
from trainer.checkpoints._outcomes import CheckpointOutcome, PreparedCheckpoint
from trainer.checkpoints._unblock import PrepareState, Unblocker
from trainer.core.blocking import last_resort_s
from trainer.core.checkpoint import not_ready_wait, prepare_retry, unpaid_at_decision
from trainer.errors import CheckpointBusy, CheckpointDecided, FencedOff, UnknownCheckpoint
from trainer.gate import Gate
from trainer.gym.errors import (
    CheckpointConflictError,
    GymError,
    InvalidPhaseError,
    NotReadyError,
    StaleCheckpointError,
    TrainerConflictError,
)
from trainer.journal import Journal
from trainer.settings import Settings, log

PREPARE_GRACE_S = 2.0


class Checkpoints:
    def __init__(
        self,
        journal: Journal,
        agents: Agents,
        settings: Settings,
        gate: Gate,
        acks: AckRelay,
        unblocker: Unblocker,
        finisher: Finisher,
    ) -> None:
        self.journal = journal
        self.agents = agents
        self.settings = settings
        self.gate = gate
        self.acks = acks
        self.unblocker = unblocker
        self.finisher = finisher
        self._lock = asyncio.Lock()
        # The checkpoint prepared and not yet decided (split-phase: the trainer saves meanwhile).
        self._held: PreparedCheckpoint | None = None

    async def checkpoint(
        self, checkpoint_id: str, participants: list[str] | None = None
    ) -> CheckpointOutcome:
        """Prepare, then commit at once (nothing to save in between)."""
        async with self._lock:
            prepared = await self._prepare_all(checkpoint_id, participants)
            if isinstance(prepared, CheckpointOutcome):
                return prepared
            return await self._commit(self._take(checkpoint_id))

    async def prepare(
        self, checkpoint_id: str, participants: list[str] | None = None
    ) -> PreparedCheckpoint | CheckpointOutcome:
        """Every participant prepared (admission closed, nothing owed or running), or aborted."""
        async with self._lock:
            return await self._prepare_all(checkpoint_id, participants)

    async def commit(self, checkpoint_id: str) -> CheckpointOutcome:
        """Decides commit for the prepared checkpoint and drives every agent to resume."""
        async with self._lock:
            return await self._commit(self._take(checkpoint_id))

    async def abort(self, checkpoint_id: str, reason: str) -> CheckpointOutcome:
        """Decides abort for the prepared checkpoint and aborts it at every agent."""
        async with self._lock:
            return await self._abort(self._take(checkpoint_id), reason)

    async def abort_undecided(self, reason: str) -> CheckpointOutcome | None:
        """Aborts the prepared checkpoint nobody decided (the coordinator is closing), so no agent
        stays prepared with its admission closed.  Not under the lock: taking the handle is atomic,
        and a commit waiting for the lock then finds the checkpoint aborted."""
        held, self._held = self._held, None
        if held is None:
            return None
        if self.journal.fenced is not None:
            # Another process owns this trainer's log now; its recovery presumes the checkpoint aborted,
            # perhaps before these agents were prepared: undo the prepare, recording nothing.
            try:
                await self.finisher.undo_at_agents(held.checkpoint_id, held.participants, "abort")
            finally:
                self._release()
            return None
        return await self._abort(held, reason)

    def _participants(self, checkpoint_id: str, participants: list[str] | None) -> list[str]:
        if participants is None:
            # An agent without the participant routes (reduced mode) cannot pause: it is left out.
            participants = [n for n, c in self.agents.items() if c.checkpoint_participant]
            left_out = sorted(set(self.agents.names) - set(participants))
            if left_out:
                log.warning("checkpoint %s cannot include %s (reduced mode)", checkpoint_id, left_out)
            # Nor an agent that refused this trainer: it holds nothing of it (trainer.core.refusal).
            participants = [n for n in participants if n not in self.agents.refused]
        return sorted(participants)

    def _refuse_new(self, checkpoint_id: str) -> None:
        """A checkpoint may start only when none is prepared here and its id is new to the log."""
        held = self._held
        if held is not None:
            raise CheckpointBusy(
                f"checkpoint {held.checkpoint_id!r} is prepared and undecided: commit or abort it "
                f"before starting {checkpoint_id!r}"
            )
        known = self.journal.checkpoints.checkpoints.get(checkpoint_id)
        if known is not None:
            error = CheckpointDecided if known.status != "preparing" else CheckpointBusy
            raise error(
                f"checkpoint {checkpoint_id!r} is already in the log ({known.status}); "
                "checkpoint ids are never reused"
            )

    def _take(self, checkpoint_id: str) -> PreparedCheckpoint:
        """The prepared checkpoint `checkpoint_id`, handed to its decision (it is no longer held)."""
        held = self._held
        if held is not None and held.checkpoint_id == checkpoint_id:
            self._held = None
            return held
        known = self.journal.checkpoints.checkpoints.get(checkpoint_id)
        if known is not None and known.status != "preparing":
            raise CheckpointDecided(f"checkpoint {checkpoint_id!r} is already decided: {known.status}")
        if held is not None:
            raise UnknownCheckpoint(
                f"checkpoint {checkpoint_id!r} is not prepared here; the prepared one is "
                f"{held.checkpoint_id!r}"
            )
        raise UnknownCheckpoint(f"checkpoint {checkpoint_id!r} is not prepared by this coordinator")

    def _release(self) -> None:
        """Ends the checkpoint at the trainer: attempts' deadlines run again, reconciliation resumes."""
        self._held = None
        self.gate.release()

    async def _presume_abort(self, checkpoint_id: str, names: list[str]) -> None:
        """No decision is in the log and this call failed (the log lost, a cancel): presumed abort,
        so no agent stays prepared with its admission closed because this coordinator failed."""
        with contextlib.suppress(Exception):
            if self.journal.fenced is not None:  # nothing can be recorded: undo at the agents only
                await asyncio.shield(self.finisher.undo_at_agents(checkpoint_id, names, "abort"))
            else:
                await asyncio.shield(self.finisher.abort_agents(checkpoint_id, names))

    async def _prepare_all(
        self, checkpoint_id: str, participants: list[str] | None
    ) -> PreparedCheckpoint | CheckpointOutcome:
        self._refuse_new(checkpoint_id)
        names = self._participants(checkpoint_id, participants)
        # Raised before CheckpointPrepareStarted is queued: from here to the decision no claim is
        # accepted (ClaimWhilePrepared), so the cut holds exactly the claims the trainer saved with.
        self.gate.hold(checkpoint_id)
        try:
            await self.journal.append(
                checkpoint_stream(checkpoint_id),
                [
                    CheckpointPrepareStarted(
                        checkpoint_id=checkpoint_id, participants=names, trainer_id=self.settings.trainer_id
                    )
                ],
            )
        except BaseException:
            self._release()
            raise
        try:
            state = PrepareState()
            deadline = time.monotonic() + self.settings.prepare_timeout_s
            try:
                # The deadline bounds everything prepare does, adoptions included: an adoption
                # whose replay waits on an attempt parked by this very checkpoint must not hold it open.
                async with asyncio.timeout_at(_loop_time_at(deadline) + PREPARE_GRACE_S):
                    await asyncio.gather(*(self._prepare(checkpoint_id, n, deadline, state) for n in names))
            except TimeoutError:
                for name in names:
                    if name not in state.ready:
                        state.failures.setdefault(name, "prepare deadline passed")
            prepared = PreparedCheckpoint(
                checkpoint_id, names, state.ready, state.adopted, state.retired, state.acked, state.carried
            )
            carried = prepared.carried_keys()
            if not state.failures and not mutants.active("commit_with_unpaid_debt"):
                # Every ACK the agents accepted must be in the log before the cut is taken; a debt
                # the agent carries may stay unpaid at the cut (paid after the decision).
                for name in names:
                    if not await self.acks.flush(
                        name, max(1.0, deadline - time.monotonic()), carried.get(name, frozenset())
                    ):
                        state.failures[name] = "debts still unpaid in the log at the decision"
            if not state.failures:
                # A debt the relay keeps owed and no longer sends is unpaid all the same.  Only this
                # trainer's: another trainer's debt to an agent of the same name is not this cut's.
                owed = self.agents.driver.unpaid(self.journal.ledger, names, excluding=carried)
                state.failures.update(unpaid_at_decision(owed, names))
        except BaseException:
            await self._presume_abort(checkpoint_id, names)
            self._release()
            raise
        if state.failures:
            reason = "; ".join(f"{a}: {r}" for a, r in sorted(state.failures.items()))
            return await self._abort(prepared, reason)
        if self.gate.closing:  # closed while preparing: nobody is left to decide
            return await self._abort(prepared, "the coordinator closed before the checkpoint was decided")
        self._held = prepared
        return prepared

    async def _commit(self, prepared: PreparedCheckpoint) -> CheckpointOutcome:
        checkpoint_id, names = prepared.checkpoint_id, prepared.participants
        decided = False
        try:
            cut = await self.journal.read(self.journal.store.head, "reading the head for the cut")
            refused: dict[str, str] = {}

            def decide(ledger: LedgerState) -> list[Event]:
                # The prepare checked for unpaid debts, but one may have been recorded since (an agent
                # restarted after answering prepared, and the reply it had held was adopted): the cut
                # would hold it unpaid, so the checkpoint aborts instead.  Decided on the fold the
                # writer has when it builds, which holds every append of this process up to the cut.
                owed = self.agents.driver.unpaid(ledger, names, excluding=prepared.carried_keys())
                refused.update(unpaid_at_decision(owed, names))
                if refused:
                    return []
                return [
                    CheckpointCommitted(
                        checkpoint_id=checkpoint_id,
                        participants=names,
                        cut_position=cut,
                        prepare_wait_s=prepared.prepare_wait_s,
                        trainer_id=self.settings.trainer_id,
                        carried={a: refs for a, refs in sorted(prepared.carried.items()) if refs},
                    )
                ]

            # From here the decision may be in the log even if the append raises: recovery decides.
            decided = True
            if not await self.journal.append(checkpoint_stream(checkpoint_id), decide):
                decided = False
                reason = "; ".join(f"{a}: {r}" for a, r in sorted(refused.items()))
                return await self._abort(prepared, f"after the prepare: {reason}")
            ends = await self.finisher.finish_commit(checkpoint_id, names)
        except FencedOff:
            # Another process owns this trainer now, and its recovery presumed this checkpoint aborted
            # (maybe before these agents were prepared, so its abort found nothing to undo).  Unless the
            # log shows this decision written after all, undo the prepare before stopping: no agent
            # stays prepared, admission closed, on a checkpoint the log says aborted.
            if not await self.finisher.commit_in_log(checkpoint_id):
                await self.finisher.undo_at_agents(checkpoint_id, names, "abort")
            raise
        except BaseException:
            if not decided:
                await self._presume_abort(checkpoint_id, names)
            raise
        finally:
            self._release()
        return prepared.outcome("committed", cut, "", ends)

    async def _abort(self, prepared: PreparedCheckpoint, reason: str) -> CheckpointOutcome:
        checkpoint_id, names = prepared.checkpoint_id, prepared.participants
        try:
            await self.journal.append(
                checkpoint_stream(checkpoint_id),
                [
                    CheckpointAborted(
                        checkpoint_id=checkpoint_id,
                        participants=names,
                        reason=reason[:1000],
                        prepare_wait_s=prepared.prepare_wait_s,
                    )
                ],
            )
            ends = await self.finisher.abort_agents(checkpoint_id, names)
        except BaseException:
            await self._presume_abort(checkpoint_id, names)
            raise
        finally:
            self._release()
        return prepared.outcome("aborted", None, reason, ends)

    # --- prepare, one participant ----------------------------------------------------------------

    async def _prepare(self, checkpoint_id: str, name: str, deadline: float, state: PrepareState) -> None:
        client = self.agents.client(name)
        started = time.monotonic()
        last_resort_at = last_resort_s(self.settings.prepare_timeout_s)
        failures = RetryState()
        unchanged = RetryState()
        last_owed: frozenset[tuple[str, int]] | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                state.failures[name] = self._not_ready_reason(name, state)
                return
            # Back at least once per poll (and grace) period, and at the last resort's moment.
            until_last_resort = remaining - last_resort_at
            poll = min(remaining, self.settings.prepare_poll_s, self.settings.park_grace_s)
            if until_last_resort > 0:
                poll = min(poll, until_last_resort)
            try:
                answer = await client.prepare(
                    checkpoint_id, timeout_s=max(0.05, poll), carry=self.settings.carry_completed
                )
                state.ready[name] = round(time.monotonic() - started, 4)
                if answer.carried:
                    state.carried[name] = list(answer.carried)
                return
            except NotReadyError as exc:
                refused = await self.unblocker.answer(checkpoint_id, name, exc, deadline, state)
                if refused is not None:
                    state.failures[name] = refused
                    return
                now = time.monotonic()
                if exc.status.blocking_attempts:
                    # The agent waited for its attempts to park before answering: it paces this loop.
                    unchanged, last_owed = RetryState(), None
                    continue
                owed = frozenset((a.rollout_id, a.attempt_index) for a in exc.attempts)
                if owed == last_owed:
                    # Only the trainer can unblock it (finished attempts to ACK or adopt) and nothing changed.
                    unchanged = unchanged.failed(now, "not ready, the same attempts blocking")
                    await asyncio.sleep(not_ready_wait(unchanged, now, random.random(), deadline - now))
                else:
                    unchanged = RetryState()
                last_owed = owed
            except (CheckpointConflictError, StaleCheckpointError, InvalidPhaseError) as exc:
                state.failures[name] = f"{type(exc).__name__}: {exc}"
                return
            except TrainerConflictError as exc:  # not driven any more: fails now (trainer.core.refusal)
                state.failures[name] = str(self.agents.refuse(name, exc.message))
                return
            except GymError as exc:
                now = time.monotonic()
                failures = failures.failed(now, f"{type(exc).__name__}: {exc}")
                delay = prepare_retry(failures, now, random.random(), deadline - now)
                if delay is None:  # no time left for another call: the deadline names the last error
                    state.failures[name] = (
                        f"not ready within the {self.settings.prepare_timeout_s} s prepare deadline "
                        f"({failures.calls} prepare calls failed, the last: {failures.last_error})"
                    )
                    return
                log.info("prepare %s on %s failed, retrying in %.2f s: %s", checkpoint_id, name, delay, exc)
                await asyncio.sleep(delay)

    def _not_ready_reason(self, name: str, state: PrepareState) -> str:
        reason = f"not ready within the {self.settings.prepare_timeout_s} s prepare deadline"
        protected = state.protected.get(name, ())
        if protected:
            named = ", ".join(f"{rid}#{n}" for rid, n in protected[:5])
            reason += (
                f": {len(protected)} tries still short of a boundary whose rollouts already lost "
                f"{self.settings.max_checkpoint_retires} to checkpoints were waited for ({named})"
            )
        return reason


def _loop_time_at(monotonic_deadline: float) -> float:
    """A `time.monotonic()` deadline on the event loop's clock."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())
