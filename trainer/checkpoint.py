"""Checkpoints: a two-phase commit with presumed abort across the trainer and every agent (protocol.md §6).

The `CheckpointCommitted` append is the decision.  Before it, anything that goes wrong aborts; after
it, the commit is finished and the agents resumed, now or by recovery.  A prepare never waits for a
result the trainer could ACK or adopt: a 409 is answered by paying what is owed and adopting the
rest, then prepare is called again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Literal

from eventstore.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPrepareStarted,
    CheckpointResumed,
)
from projections.ledger import debt_key
from protocol.streams import checkpoint_stream
from trainer.acks import AckRelay
from trainer.attempts import Attempts, group_id_of
from trainer.context import Context, log
from trainer.gym.errors import (
    AgentUnavailableError,
    CheckpointConflictError,
    GymError,
    InvalidPhaseError,
    NotReadyError,
    StaleCheckpointError,
)

PHASE_RETRIES = 20


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

    @property
    def committed(self) -> bool:
        return self.outcome == "committed"


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


@dataclass
class _Progress:
    since: float
    blocking: set[tuple[str, int]] | None = None


class Checkpointer:
    def __init__(self, ctx: Context, tries: Attempts, relay: AckRelay) -> None:
        self.ctx = ctx
        self.tries = tries
        self.relay = relay
        self._lock = asyncio.Lock()

    async def checkpoint(
        self, checkpoint_id: str, participants: list[str] | None = None
    ) -> CheckpointOutcome:
        ctx = self.ctx
        if participants is None:
            # An agent without the participant routes (reduced mode) cannot pause: it is left out.
            participants = [n for n, c in ctx.agents.items() if c.checkpoint_participant]
            left_out = sorted(set(ctx.agents) - set(participants))
            if left_out:
                log.warning("checkpoint %s cannot include %s (reduced mode)", checkpoint_id, left_out)
        names = sorted(participants)
        async with self._lock:
            stream = checkpoint_stream(checkpoint_id)
            await ctx.journal.append(
                stream,
                [
                    CheckpointPrepareStarted(
                        checkpoint_id=checkpoint_id, participants=names, trainer_id=ctx.settings.trainer_id
                    )
                ],
            )
            ctx.active_checkpoint = checkpoint_id
            ctx.checkpoint_idle.clear()
            decided = False
            try:
                state = _Prepare()
                deadline = time.monotonic() + ctx.settings.prepare_timeout_s
                try:
                    # The deadline bounds everything prepare does, adoptions included: an adoption
                    # whose replay waits on a try parked by this very checkpoint must not hold it open.
                    async with asyncio.timeout_at(_loop_time_at(deadline) + PREPARE_GRACE_S):
                        await asyncio.gather(
                            *(self._prepare(checkpoint_id, n, deadline, state) for n in names)
                        )
                except TimeoutError:
                    for name in names:
                        if name not in state.ready:
                            state.failures.setdefault(name, "prepare deadline passed")
                if not state.failures:
                    # Every ACK the agents accepted must be in the log before the cut is taken.
                    for name in names:
                        if not await self.relay.flush(name, max(1.0, deadline - time.monotonic())):
                            state.failures[name] = "debts still unpaid in the log at the decision"
                if state.failures:
                    reason = "; ".join(f"{a}: {r}" for a, r in sorted(state.failures.items()))
                    await ctx.journal.append(
                        stream,
                        [
                            CheckpointAborted(
                                checkpoint_id=checkpoint_id,
                                participants=names,
                                reason=reason[:1000],
                                prepare_wait_s=state.ready,
                            )
                        ],
                    )
                    await self.abort_agents(checkpoint_id, names)
                    return CheckpointOutcome(
                        checkpoint_id,
                        "aborted",
                        None,
                        state.ready,
                        reason,
                        state.adopted,
                        state.retired,
                        state.acked,
                    )
                cut = await ctx.journal.read(ctx.journal.store.head, "reading the head for the cut")
                # From here the decision may be in the log even if the append raises: recovery decides.
                decided = True
                await ctx.journal.append(
                    stream,
                    [
                        CheckpointCommitted(
                            checkpoint_id=checkpoint_id,
                            participants=names,
                            cut_position=cut,
                            prepare_wait_s=state.ready,
                        )
                    ],
                )
                await self.finish_commit(checkpoint_id, names)
                return CheckpointOutcome(
                    checkpoint_id,
                    "committed",
                    cut,
                    state.ready,
                    "",
                    state.adopted,
                    state.retired,
                    state.acked,
                )
            except BaseException:
                if not decided:
                    # No decision is in the log: presumed abort, so no agent stays prepared with its
                    # admission closed because this coordinator failed (the log lost, a cancel).
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self.abort_agents(checkpoint_id, names))
                raise
            finally:
                ctx.active_checkpoint = None
                ctx.checkpoint_idle.set()

    async def _prepare(self, checkpoint_id: str, name: str, deadline: float, state: _Prepare) -> None:
        ctx = self.ctx
        client = ctx.client(name)
        started = time.monotonic()
        progress = _Progress(time.monotonic())
        delay = 0.05
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                state.failures[name] = (
                    f"not ready within the {ctx.settings.prepare_timeout_s} s prepare deadline"
                )
                return
            try:
                await client.prepare(
                    checkpoint_id,
                    # Back at least once per grace period, so a stuck try is retired on time.
                    timeout_s=max(
                        0.05, min(remaining, ctx.settings.prepare_poll_s, ctx.settings.park_grace_s)
                    ),
                )
                state.ready[name] = round(time.monotonic() - started, 4)
                return
            except NotReadyError as exc:
                await self._unblock(name, exc, progress, state)
            except (CheckpointConflictError, StaleCheckpointError, InvalidPhaseError) as exc:
                state.failures[name] = f"{type(exc).__name__}: {exc}"
                return
            except GymError as exc:
                log.info("prepare %s on %s failed, retrying: %s", checkpoint_id, name, exc)
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 1.0)

    async def _unblock(self, name: str, exc: NotReadyError, progress: _Progress, state: _Prepare) -> None:
        ctx = self.ctx
        ledger = ctx.journal.ledger
        owed = ledger.debts.get(name, {})
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
        # Parking takes as long as the agent needs to finish the model calls in progress; while the
        # blocking set keeps shrinking the agent is making progress.  Attempts still blocking after
        # park_grace_s without any progress are stuck inside a model call: retire them.
        now = time.monotonic()
        blocking = {(b.rollout_id, b.attempt_index) for b in exc.status.blocking_attempts}
        previous = progress.blocking
        log.debug(
            "prepare %s: blocking %d parked %d completed %d adopt %d",
            name,
            len(blocking),
            exc.status.parked,
            exc.status.completed_unacknowledged,
            len(to_adopt),
        )
        # The grace runs from the prepare's start: a try blocking from the first answer on has had
        # the whole wait to park.
        if previous is not None and (not blocking or (blocking - previous) or len(blocking) < len(previous)):
            progress.since = now
        progress.blocking = blocking
        if blocking and now - progress.since >= ctx.settings.park_grace_s:
            outcomes = await asyncio.gather(*(self._retire(rid, n) for rid, n in sorted(blocking)))
            state.retired += sum(outcomes)
            progress.since = time.monotonic()
        elif not to_adopt and not blocking:
            await asyncio.sleep(0.02)

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

    async def _retire(self, rollout_id: str, attempt_index: int) -> bool:
        if self.ctx.journal.ledger.attempt(rollout_id, attempt_index) is None:
            log.warning("prepare blocked by (%s, %d), a try this log never minted", rollout_id, attempt_index)
            return False
        outcome = await self.tries.resolve(group_id_of(rollout_id), rollout_id, attempt_index)
        return outcome.kind == "retired"

    # --- after the decision ----------------------------------------------------------------------

    async def finish_commit(self, checkpoint_id: str, names: list[str]) -> None:
        """Commit and resume every agent, then record the resume.  Safe to repeat (recovery)."""
        await asyncio.gather(*(self._commit_and_resume(checkpoint_id, n) for n in names))
        await self.ctx.journal.append(
            checkpoint_stream(checkpoint_id),
            [CheckpointResumed(checkpoint_id=checkpoint_id, participants=names)],
        )

    async def _commit_and_resume(self, checkpoint_id: str, name: str) -> None:
        client = self.ctx.client(name)
        for op in (client.commit, client.resume):
            for attempt in range(PHASE_RETRIES):
                try:
                    await op(checkpoint_id)
                    break
                except (InvalidPhaseError, StaleCheckpointError, CheckpointConflictError) as exc:
                    # Already past this step, or the agent restarted and lost the checkpoint: nothing
                    # of it is left paused.
                    log.info("%s %s on %s: %s", op.__name__, checkpoint_id, name, exc)
                    break
                except GymError as exc:
                    if attempt == PHASE_RETRIES - 1:
                        log.error("%s %s on %s gave up: %s", op.__name__, checkpoint_id, name, exc)
                        return
                    await asyncio.sleep(min(0.05 * 2**attempt, 1.0))

    async def abort_agents(self, checkpoint_id: str, names: list[str]) -> None:
        async def one(name: str) -> None:
            client = self.ctx.client(name)
            for attempt in range(PHASE_RETRIES):
                try:
                    await client.abort(checkpoint_id)
                    return
                except (InvalidPhaseError, StaleCheckpointError, CheckpointConflictError) as exc:
                    log.info("abort %s on %s: %s", checkpoint_id, name, exc)
                    return
                except AgentUnavailableError as exc:
                    if attempt == PHASE_RETRIES - 1:
                        log.error("abort %s on %s gave up: %s", checkpoint_id, name, exc)
                        return
                    await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
                except GymError as exc:
                    log.error("abort %s on %s: %s", checkpoint_id, name, exc)
                    return

        await asyncio.gather(*(one(n) for n in names))

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
            await ctx.journal.append(
                checkpoint_stream(c.checkpoint_id),
                [
                    CheckpointAborted(
                        checkpoint_id=c.checkpoint_id,
                        participants=c.participants,
                        reason="presumed abort: the coordinator died before deciding",
                    )
                ],
            )
            await self.abort_agents(c.checkpoint_id, [p for p in c.participants if p in ctx.agents])
            done["aborted"] += 1
        for c in [known[i] for i in to_resume]:
            await self.finish_commit(c.checkpoint_id, [p for p in c.participants if p in ctx.agents])
            done["resumed"] += 1
        for name, client in ctx.agents.items():
            try:
                status = await client.status()
            except GymError as exc:
                log.warning("recovery: status of %s unavailable: %s", name, exc)
                continue
            active = status.active_checkpoint_id
            if active is None:
                continue
            decided = known.get(active)
            if decided is not None and decided.status in ("committed", "resumed"):
                await self._commit_and_resume(active, name)
            else:
                await self.abort_agents(active, [name])
        return done
