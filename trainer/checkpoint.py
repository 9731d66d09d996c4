"""Checkpoints: a two-phase commit with presumed abort across the trainer and every agent (docs/protocol.md, Checkpoints).

The `CheckpointCommitted` append is the decision.  Before it, anything that goes wrong aborts; after
it, the commit is finished and the agents resumed, now or by recovery.  A prepare never waits for a
result the trainer could ACK or adopt: a 409 is answered by paying what is owed and adopting the
rest, then prepare is called again.

Split-phase: `prepare` returns a `PreparedCheckpoint` (every agent prepared, no decision yet) so the
trainer can save its own state before `commit` or `abort`; `checkpoint` is prepare then commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from eventstore.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPrepareStarted,
    CheckpointResumed,
    Event,
)
from projections.group_core import checkpoint_losses
from projections.ledger import LedgerState, debt_key
from protocol import mutants
from protocol.retry import RetryState, next_step
from protocol.streams import checkpoint_stream
from protocol.wire import AttemptRef
from trainer.acks import AckRelay
from trainer.attempts import Attempts, group_id_of
from trainer.context import Context, RetireFor, log
from trainer.core.blocking import Blocking, Retire, judge, last_resort_s
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
    not_ready_wait,
    prepare_retry,
    presume_abort,
    resumed_event_due,
    step,
    unpaid_at_decision,
)
from trainer.core.retire_debt import owed_keys
from trainer.errors import CheckpointBusy, CheckpointDecided, CoordinatorStopped, FencedOff, UnknownCheckpoint
from trainer.gym import GymClient
from trainer.gym.errors import (
    CheckpointConflictError,
    GymError,
    InvalidPhaseError,
    NotReadyError,
    StaleCheckpointError,
    TrainerConflictError,
)
from trainer.retires import RetireRelay


@dataclass
class CheckpointOutcome:
    checkpoint_id: str
    outcome: Literal["committed", "aborted"]
    cut_position: int | None
    prepare_wait_s: dict[str, float]
    reason: str = ""
    adopted: int = 0
    retired: int = 0
    acked_during_prepare: int = 0
    # Finished, unACKed tries the agents carried across the checkpoint (paid after the decision).
    carried: int = 0
    # Participants still being driven to the decision in the background (their step is stuck).
    stuck: list[str] = field(default_factory=list)
    # Participants that showed they lost the checkpoint (the log keeps it committed, not resumed).
    lost: list[str] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        return self.outcome == "committed"


@dataclass(frozen=True)
class PreparedCheckpoint:
    """A checkpoint every participant prepared, with no decision in the log yet.

    Each agent is `prepared`: its admission is closed and nothing of it runs or is owed.  The trainer
    saves its own state now and then decides promptly (`commit` or `abort`): until then no rollout
    progresses at the participants.  Never decided, it is presumed aborted (when the coordinator closes,
    or by recovery after a crash).
    """

    checkpoint_id: str
    participants: list[str]
    prepare_wait_s: dict[str, float]
    adopted: int = 0
    retired: int = 0
    acked_during_prepare: int = 0
    # Per participant: the finished, unACKed tries its prepare carried (CheckpointCommitted.carried).
    carried: dict[str, list[AttemptRef]] = field(default_factory=dict)

    def carried_keys(self) -> dict[str, frozenset[str]]:
        return {
            a: frozenset(debt_key(r.rollout_id, r.attempt_index) for r in refs)
            for a, refs in self.carried.items()
        }

    def outcome(
        self,
        outcome: Literal["committed", "aborted"],
        cut_position: int | None,
        reason: str,
        ends: dict[str, str],
    ) -> CheckpointOutcome:
        return CheckpointOutcome(
            self.checkpoint_id,
            outcome,
            cut_position,
            self.prepare_wait_s,
            reason,
            self.adopted,
            self.retired,
            self.acked_during_prepare,
            sum(len(refs) for refs in self.carried.values()),
            stuck=sorted(a for a, e in ends.items() if e == "stuck"),
            lost=sorted(a for a, e in ends.items() if e == "lost"),
        )


PREPARE_GRACE_S = 2.0


def _loop_time_at(monotonic_deadline: float) -> float:
    """A `time.monotonic()` deadline on the event loop's clock."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())


@dataclass
class _Prepare:
    ready: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    adopted: int = 0
    retired: int = 0
    acked: int = 0
    # Per agent: the finished, unACKed tries it carries across the checkpoint (its prepared answer's).
    carried: dict[str, list[AttemptRef]] = field(default_factory=dict)
    # Per agent: the blocking tries the last resort may not retire (the prepare waits for them).
    protected: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)


class Checkpointer:
    def __init__(self, ctx: Context, tries: Attempts, relay: AckRelay, retires: RetireRelay) -> None:
        self.ctx = ctx
        self.tries = tries
        self.relay = relay
        self.retires = retires
        self._lock = asyncio.Lock()
        # Participants still being driven to a decided outcome, and the CheckpointResumed appenders.
        self._finishers: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._completions: dict[str, asyncio.Task[None]] = {}
        # Set whenever a participant's step wrote to the log (a finish, a stuck).
        self._changed = asyncio.Event()
        # The checkpoint prepared and not yet decided (split-phase: the trainer saves meanwhile).
        self._held: PreparedCheckpoint | None = None

    # --- the phases ------------------------------------------------------------------------------
    # One lock serialises the phases: the one-call `checkpoint` holds it across prepare and commit, so
    # no other checkpoint comes between them; the split calls take it per phase, and while a checkpoint
    # is prepared and undecided (`_held`) no other one may start.

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
        if self.ctx.journal.fenced is not None:
            # Another process owns this trainer's log now; its recovery presumes the checkpoint aborted,
            # perhaps before these agents were prepared: undo the prepare, recording nothing.
            try:
                await self._undo_at_agents(held.checkpoint_id, held.participants, "abort")
            finally:
                self._release()
            return None
        return await self._abort(held, reason)

    def _participants(self, checkpoint_id: str, participants: list[str] | None) -> list[str]:
        ctx = self.ctx
        if participants is None:
            # An agent without the participant routes (reduced mode) cannot pause: it is left out.
            participants = [n for n, c in ctx.agents.items() if c.checkpoint_participant]
            left_out = sorted(set(ctx.agents) - set(participants))
            if left_out:
                log.warning("checkpoint %s cannot include %s (reduced mode)", checkpoint_id, left_out)
            # Nor an agent that refused this trainer: it holds nothing of it (trainer.core.refusal).
            participants = [n for n in participants if n not in ctx.refused]
        return sorted(participants)

    def _refuse_new(self, checkpoint_id: str) -> None:
        """A checkpoint may start only when none is prepared here and its id is new to the log."""
        held = self._held
        if held is not None:
            raise CheckpointBusy(
                f"checkpoint {held.checkpoint_id!r} is prepared and undecided: commit or abort it "
                f"before starting {checkpoint_id!r}"
            )
        known = self.ctx.journal.checkpoints.checkpoints.get(checkpoint_id)
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
        known = self.ctx.journal.checkpoints.checkpoints.get(checkpoint_id)
        if known is not None and known.status != "preparing":
            raise CheckpointDecided(f"checkpoint {checkpoint_id!r} is already decided: {known.status}")
        if held is not None:
            raise UnknownCheckpoint(
                f"checkpoint {checkpoint_id!r} is not prepared here; the prepared one is "
                f"{held.checkpoint_id!r}"
            )
        raise UnknownCheckpoint(f"checkpoint {checkpoint_id!r} is not prepared by this coordinator")

    def _release(self) -> None:
        """Ends the checkpoint at the trainer: tries' deadlines run again, reconciliation resumes."""
        self._held = None
        self.ctx.active_checkpoint = None
        self.ctx.checkpoint_idle.set()

    async def _presume_abort(self, checkpoint_id: str, names: list[str]) -> None:
        """No decision is in the log and this call failed (the log lost, a cancel): presumed abort,
        so no agent stays prepared with its admission closed because this coordinator failed."""
        with contextlib.suppress(Exception):
            if self.ctx.journal.fenced is not None:  # nothing can be recorded: undo at the agents only
                await asyncio.shield(self._undo_at_agents(checkpoint_id, names, "abort"))
            else:
                await asyncio.shield(self.abort_agents(checkpoint_id, names))

    async def _prepare_all(
        self, checkpoint_id: str, participants: list[str] | None
    ) -> PreparedCheckpoint | CheckpointOutcome:
        ctx = self.ctx
        self._refuse_new(checkpoint_id)
        names = self._participants(checkpoint_id, participants)
        # Raised before CheckpointPrepareStarted is queued: from here to the decision no claim is
        # accepted (ClaimWhilePrepared), so the cut holds exactly the claims the trainer saved with.
        ctx.active_checkpoint = checkpoint_id
        ctx.checkpoint_idle.clear()
        try:
            await ctx.journal.append(
                checkpoint_stream(checkpoint_id),
                [
                    CheckpointPrepareStarted(
                        checkpoint_id=checkpoint_id, participants=names, trainer_id=ctx.settings.trainer_id
                    )
                ],
            )
        except BaseException:
            self._release()
            raise
        try:
            state = _Prepare()
            deadline = time.monotonic() + ctx.settings.prepare_timeout_s
            try:
                # The deadline bounds everything prepare does, adoptions included: an adoption
                # whose replay waits on a try parked by this very checkpoint must not hold it open.
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
                    if not await self.relay.flush(
                        name, max(1.0, deadline - time.monotonic()), carried.get(name, frozenset())
                    ):
                        state.failures[name] = "debts still unpaid in the log at the decision"
            if not state.failures:
                # A debt the relay keeps owed and no longer sends is unpaid all the same.  Only this
                # trainer's: another trainer's debt to an agent of the same name is not this cut's.
                owed = ctx.driver.unpaid(ctx.journal.ledger, names, excluding=carried)
                state.failures.update(unpaid_at_decision(owed, names))
        except BaseException:
            await self._presume_abort(checkpoint_id, names)
            self._release()
            raise
        if state.failures:
            reason = "; ".join(f"{a}: {r}" for a, r in sorted(state.failures.items()))
            return await self._abort(prepared, reason)
        if ctx.stopping:  # closed while preparing: nobody is left to decide
            return await self._abort(prepared, "the coordinator closed before the checkpoint was decided")
        self._held = prepared
        return prepared

    async def _commit(self, prepared: PreparedCheckpoint) -> CheckpointOutcome:
        ctx = self.ctx
        checkpoint_id, names = prepared.checkpoint_id, prepared.participants
        decided = False
        try:
            cut = await ctx.journal.read(ctx.journal.store.head, "reading the head for the cut")
            refused: dict[str, str] = {}

            def decide(ledger: LedgerState) -> list[Event]:
                # The prepare checked for unpaid debts, but one may have been recorded since (an agent
                # restarted after answering prepared, and the reply it had held was adopted): the cut
                # would hold it unpaid, so the checkpoint aborts instead.  Decided on the fold the
                # writer has when it builds, which holds every append of this process up to the cut.
                owed = ctx.driver.unpaid(ledger, names, excluding=prepared.carried_keys())
                refused.update(unpaid_at_decision(owed, names))
                if refused:
                    return []
                return [
                    CheckpointCommitted(
                        checkpoint_id=checkpoint_id,
                        participants=names,
                        cut_position=cut,
                        prepare_wait_s=prepared.prepare_wait_s,
                        trainer_id=ctx.settings.trainer_id,
                        carried={a: refs for a, refs in sorted(prepared.carried.items()) if refs},
                    )
                ]

            # From here the decision may be in the log even if the append raises: recovery decides.
            decided = True
            if not await ctx.journal.append(checkpoint_stream(checkpoint_id), decide):
                decided = False
                reason = "; ".join(f"{a}: {r}" for a, r in sorted(refused.items()))
                return await self._abort(prepared, f"after the prepare: {reason}")
            ends = await self.finish_commit(checkpoint_id, names)
        except FencedOff:
            # Another process owns this trainer now, and its recovery presumed this checkpoint aborted
            # (maybe before these agents were prepared, so its abort found nothing to undo).  Unless the
            # log shows this decision written after all, undo the prepare before stopping: no agent
            # stays prepared, admission closed, on a checkpoint the log says aborted.
            if not await self._commit_in_log(checkpoint_id):
                await self._undo_at_agents(checkpoint_id, names, "abort")
            raise
        except BaseException:
            if not decided:
                await self._presume_abort(checkpoint_id, names)
            raise
        finally:
            self._release()
        return prepared.outcome("committed", cut, "", ends)

    async def _commit_in_log(self, checkpoint_id: str) -> bool:
        """Whether the log holds this checkpoint's `CheckpointCommitted` (read from the store, not the
        fold: a fenced process folds nothing more).  Unreadable: assumed written (nothing undone)."""
        journal = self.ctx.journal
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

    async def _undo_at_agents(self, checkpoint_id: str, names: list[str], op: Op) -> None:
        """`op` (abort) at every agent, within FINISH_POLICY each, recording nothing (the log's record
        stands; this process may not write to it any more)."""
        clients = [(n, self.ctx.agents[n]) for n in names if n in self.ctx.agents]
        await asyncio.gather(
            *(self._call_until_answered(checkpoint_id, n, c, op) for n, c in clients), return_exceptions=True
        )

    async def _abort(self, prepared: PreparedCheckpoint, reason: str) -> CheckpointOutcome:
        checkpoint_id, names = prepared.checkpoint_id, prepared.participants
        try:
            await self.ctx.journal.append(
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
            ends = await self.abort_agents(checkpoint_id, names)
        except BaseException:
            await self._presume_abort(checkpoint_id, names)
            raise
        finally:
            self._release()
        return prepared.outcome("aborted", None, reason, ends)

    # --- prepare, one participant ----------------------------------------------------------------

    async def _prepare(self, checkpoint_id: str, name: str, deadline: float, state: _Prepare) -> None:
        ctx = self.ctx
        client = ctx.client(name)
        started = time.monotonic()
        last_resort_at = last_resort_s(ctx.settings.prepare_timeout_s)
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
            poll = min(remaining, ctx.settings.prepare_poll_s, ctx.settings.park_grace_s)
            if until_last_resort > 0:
                poll = min(poll, until_last_resort)
            try:
                answer = await client.prepare(
                    checkpoint_id, timeout_s=max(0.05, poll), carry=ctx.settings.carry_completed
                )
                state.ready[name] = round(time.monotonic() - started, 4)
                if answer.carried:
                    state.carried[name] = list(answer.carried)
                return
            except NotReadyError as exc:
                refused = await self._unblock(checkpoint_id, name, exc, deadline, state)
                if refused is not None:
                    state.failures[name] = refused
                    return
                now = time.monotonic()
                if exc.status.blocking_attempts:
                    # The agent waited for its tries to park before answering: it paces this loop.
                    unchanged, last_owed = RetryState(), None
                    continue
                owed = frozenset((a.rollout_id, a.attempt_index) for a in exc.attempts)
                if owed == last_owed:
                    # Only the trainer can unblock it (finished tries to ACK or adopt) and nothing changed.
                    unchanged = unchanged.failed(now, "not ready, the same tries blocking")
                    await asyncio.sleep(not_ready_wait(unchanged, now, random.random(), deadline - now))
                else:
                    unchanged = RetryState()
                last_owed = owed
            except (CheckpointConflictError, StaleCheckpointError, InvalidPhaseError) as exc:
                state.failures[name] = f"{type(exc).__name__}: {exc}"
                return
            except TrainerConflictError as exc:  # not driven any more: fails now (trainer.core.refusal)
                state.failures[name] = str(ctx.refuse(name, exc.message))
                return
            except GymError as exc:
                now = time.monotonic()
                failures = failures.failed(now, f"{type(exc).__name__}: {exc}")
                delay = prepare_retry(failures, now, random.random(), deadline - now)
                if delay is None:  # no time left for another call: the deadline names the last error
                    state.failures[name] = (
                        f"not ready within the {ctx.settings.prepare_timeout_s} s prepare deadline "
                        f"({failures.calls} prepare calls failed, the last: {failures.last_error})"
                    )
                    return
                log.info("prepare %s on %s failed, retrying in %.2f s: %s", checkpoint_id, name, delay, exc)
                await asyncio.sleep(delay)

    def _not_ready_reason(self, name: str, state: _Prepare) -> str:
        reason = f"not ready within the {self.ctx.settings.prepare_timeout_s} s prepare deadline"
        protected = state.protected.get(name, ())
        if protected:
            named = ", ".join(f"{rid}#{n}" for rid, n in protected[:5])
            reason += (
                f": {len(protected)} tries still short of a boundary whose rollouts already lost "
                f"{self.ctx.settings.max_checkpoint_retires} to checkpoints were waited for ({named})"
            )
        return reason

    def _blocking(self, exc: NotReadyError) -> list[Blocking]:
        """The tries the answer names as blocking, with their own progress and the log's count of the
        tries their rollouts lost to checkpoints."""
        ledger = self.ctx.journal.ledger
        progress = {(p.rollout_id, p.attempt_index): p for p in exc.status.progress}
        found = []
        for ref in exc.status.blocking_attempts:
            group = ledger.groups.get(group_id_of(ref.rollout_id))
            sibling = group.sibling_of(ref.rollout_id) if group is not None else None
            seen = progress.get((ref.rollout_id, ref.attempt_index))
            found.append(
                Blocking(
                    ref.rollout_id,
                    ref.attempt_index,
                    seen.since_progress_s if seen is not None else None,
                    checkpoint_losses(group, sibling) if group is not None and sibling is not None else 0,
                )
            )
        return found

    async def _unblock(
        self, checkpoint_id: str, name: str, exc: NotReadyError, deadline: float, state: _Prepare
    ) -> str | None:
        """Pays, adopts or retires what keeps `name` from being ready; the reason the prepare fails
        instead if the agent names a try this trainer does not own (it would act on another's)."""
        ctx = self.ctx
        ledger = ctx.journal.ledger
        driver = ctx.driver
        for ref in [*exc.attempts, *exc.status.blocking_attempts]:
            refusal = driver.refusal(ledger, ref.rollout_id, "settle")
            if refusal is not None and ledger.attempt(ref.rollout_id, ref.attempt_index) is not None:
                # A try of another trainer's group at this agent: two trainers drive one agent.
                return f"the agent holds a try this trainer may not settle ({refusal})"
        owed = {key for key, _ in driver.debts(ledger, name)}
        to_adopt = []
        for ref in exc.attempts:
            if debt_key(ref.rollout_id, ref.attempt_index) in owed:
                state.acked += 1
            else:
                to_adopt.append(ref)
        adopt = [self._adopt(ref.rollout_id, ref.attempt_index) for ref in to_adopt]
        results = await asyncio.gather(*adopt)
        state.adopted += sum(results)
        await self.relay.send(name)
        # The tries still on their way to a boundary: waited for while they make progress of their
        # own; retired when stuck, or at the last resort (trainer.core.blocking).
        blocking = self._blocking(exc)
        log.debug(
            "prepare %s: blocking %d parked %d completed %d adopt %d",
            name,
            len(blocking),
            exc.status.parked,
            exc.status.completed_unacknowledged,
            len(to_adopt),
        )
        verdict = judge(
            blocking,
            heartbeat_s=exc.status.heartbeat_s,
            park_grace_s=ctx.settings.park_grace_s,
            left_s=deadline - time.monotonic(),
            last_resort_at_s=last_resort_s(ctx.settings.prepare_timeout_s),
            max_checkpoint_retires=ctx.settings.max_checkpoint_retires,
            checkpoint_id=checkpoint_id,
        )
        state.protected[name] = verdict.protected
        if verdict.retire:
            outcomes = await asyncio.gather(*(self._retire(checkpoint_id, r) for r in verdict.retire))
            state.retired += sum(outcomes)
        elif not to_adopt and not blocking:
            await asyncio.sleep(0.02)
        return None

    async def _adopt(self, rollout_id: str, attempt_index: int) -> bool:
        attempt = self.ctx.journal.ledger.attempt(rollout_id, attempt_index)
        if attempt is None:
            log.warning(
                "prepare names (%s, %d), a try this log never minted: cannot adopt it",
                rollout_id,
                attempt_index,
            )
            return False
        outcome = await self.tries.resolve(group_id_of(rollout_id), rollout_id, attempt_index)
        return outcome.kind != "retired"

    async def _retire(self, checkpoint_id: str, retire: Retire) -> bool:
        rid, n = retire.rollout_id, retire.attempt_index
        if self.ctx.journal.ledger.attempt(rid, n) is None:
            log.warning("prepare blocked by (%s, %d), a try this log never minted", rid, n)
            return False
        log.warning("checkpoint %s retires (%s, %d): %s", checkpoint_id, rid, n, retire.reason)
        why = RetireFor(retire.cause, checkpoint_id, retire.reason)
        outcome = await self.tries.resolve(group_id_of(rid), rid, n, why)
        return outcome.kind == "retired"

    # --- after the decision ----------------------------------------------------------------------

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
        known = self.ctx.journal.checkpoints.checkpoints.get(checkpoint_id)
        return (known.finished, known.stuck) if known is not None else ({}, {})

    async def _complete(
        self, checkpoint_id: str, names: list[str], drivers: list[asyncio.Task[None]]
    ) -> None:
        outcomes = await asyncio.gather(*drivers, return_exceptions=True)
        known = self.ctx.journal.checkpoints.checkpoints.get(checkpoint_id)
        finished = dict(known.finished) if known is not None else {}
        if resumed_event_due(finished, names):  # type: ignore[arg-type]
            await self.ctx.journal.append(
                checkpoint_stream(checkpoint_id),
                [CheckpointResumed(checkpoint_id=checkpoint_id, participants=names)],
            )
        elif (
            self.ctx.journal.stopped is not None
            or self.ctx.journal.fenced is not None
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
        client = self.ctx.client(p.agent_name)
        call = first_call(p)
        while True:
            if call.delay_s:
                await asyncio.sleep(call.delay_s)
            answer = await _phase_answer(client, call.op, p.checkpoint_id)
            if isinstance(answer, NotDriven):
                self.ctx.refuse(p.agent_name, answer.message)
            result = step(p, answer, time.monotonic(), random.random())
            p = result.participant
            if result.events:
                await self.ctx.journal.append(checkpoint_stream(p.checkpoint_id), list(result.events))
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
        ctx = self.ctx
        done = {"aborted": 0, "resumed": 0}
        known = ctx.journal.checkpoints.checkpoints
        mine = ctx.settings.trainer_id
        if to_abort is None:  # only this trainer's: another trainer's checkpoint may be in flight
            to_abort = [c.checkpoint_id for c in ctx.journal.checkpoints.in_doubt() if c.trainer_id == mine]
        if to_resume is None:
            to_resume = [c.checkpoint_id for c in ctx.journal.checkpoints.to_resume() if c.trainer_id == mine]
        for c in [known[i] for i in to_abort]:
            await self._presume_abort_in_log(
                c.checkpoint_id, c.participants, "presumed abort: the coordinator died before deciding"
            )
            await self.abort_agents(c.checkpoint_id, [p for p in c.participants if p in ctx.agents])
            done["aborted"] += 1
        for c in [known[i] for i in to_resume]:
            await self.finish_commit(c.checkpoint_id, [p for p in c.participants if p in ctx.agents])
            done["resumed"] += 1
        for name, client in ctx.agents.items():
            await self.reconcile(name, client)
        return done

    async def _presume_abort_in_log(self, checkpoint_id: str, participants: list[str], reason: str) -> None:
        """Appends the presumed abort unless the log has decided the checkpoint by the time the append
        is written (recovery and reconciliation may both find it in doubt: it is decided once)."""
        journal = self.ctx.journal

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
        ctx = self.ctx
        owed_before = owed_keys(ctx.journal.ledger, name)
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
            or ctx.active_checkpoint == active
        ):
            return
        await ctx.journal.catch_up()
        known = ctx.journal.checkpoints.checkpoints.get(active)
        if known is not None and known.trainer_id != ctx.settings.trainer_id:
            # Its participants are that trainer's agents (of the same name, perhaps): not this one's to
            # drive, whatever its state.  Found here, the agent is driven by two trainers.
            log.error(
                "agent %s holds checkpoint %s of trainer %r, not of this one (%r): left alone",
                name,
                active,
                known.trainer_id,
                ctx.settings.trainer_id,
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
            await self._presume_abort_in_log(
                active,
                known.participants,
                "presumed abort: found active at an agent with no decision in the log",
            )
            await self.abort_agents(active, [p for p in known.participants if p in ctx.agents])


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
