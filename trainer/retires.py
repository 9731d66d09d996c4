"""The retire relay: pays the retires the log says are owed (docs/protocol.md, Retire debts).

A try declared lost at its agent (`RunFailed` agent_lost) leaves a `RetireOwed` in the log: the agent
may still hold a finished result of it, which only a retire (then the ACK of its receipt) releases.
This relay reads the owed retires from the ledger projection (so they survive any crash and are paid by
whichever process of the trainer runs next), calls `/retire` for each, and records what the answer
proves (trainer.core.retire_debt): `RetirePaid`, with `ReceiptFetched` + `AckOwed` when the agent
still held the result (the ACK relay then pays that debt and the agent discards it; nothing is
adopted).  Failures back off per agent with jitter within `RETIRE_OWED_POLICY`; spent, the agent is
reported stuck (`RetireDeliveryStuck`, once per spell) and called at the longest wait: a retire owed is
never dropped here.  Any successful exchange with the agent meanwhile (an accepted `/acknowledge`, a
reconcile's `/health`: `Context.answered`) lifts the wait, so its owed retires are called at once.  Nothing is called while a checkpoint is in flight (its prepare fences retires).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from eventstore.events import AckOwed, Event, RetireDeliveryStuck
from projections.ledger import LedgerState, RetireDebt, debt_key
from protocol.ids import group_id_of
from protocol.retry import RetryState
from protocol.streams import group_stream, trainer_stream
from protocol.wire import AgentStatus, AttemptRef
from trainer.attempts import retire_answer
from trainer.context import Context, log
from trainer.core import retire_debt as core
from trainer.errors import CoordinatorStopped, FencedOff
from trainer.eventloop import wait_at_most
from trainer.gym import GymClient
from trainer.gym.errors import GymError
from trainer.stops import log_stop

IDLE_POLL_S = 0.5
# Retires paid per agent per pass: a pass never holds an agent's lock for an unbounded list.
MAX_BATCH = 200


class RetireRelay:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # Per agent: the failed owed retires of the current spell (RETIRE_OWED_POLICY).
        self._failures: dict[str, RetryState] = {}
        self._not_before: dict[str, float] = {}
        # Agents whose budget is spent (reason), until one of their owed retires is answered.
        self.stuck: dict[str, str] = {}
        self.paid = 0
        self.released = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="retire-relay")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def owed(self, agent_name: str) -> list[RetireDebt]:
        return self.ctx.driver.retires(self.ctx.journal.ledger, agent_name)

    def owed_agents(self) -> list[str]:
        """Agents this trainer owes a retire (of a try of its own groups)."""
        return [a for a in self.ctx.journal.ledger.retires if self.owed(a)]

    async def owe_strays(self, agent_name: str, status: AgentStatus, owed_before: frozenset[str]) -> int:
        """Owes a retire for each stray result in the agent's status (trainer.core.retire_debt.strays):
        a try the log settled that the agent holds finished again.  `owed_before`: the debts owed to
        the agent before its status was asked for.  Returns how many."""
        ctx = self.ctx
        incarnation = status.execution_incarnation
        found = core.strays(
            ctx.journal.ledger, ctx.driver, agent_name, incarnation, status.completed_attempts, owed_before
        )
        by_group: dict[str, list[AttemptRef]] = defaultdict(list)
        for owed in found:
            by_group[group_id_of(owed.rollout_id)].append(
                AttemptRef(rollout_id=owed.rollout_id, attempt_index=owed.attempt_index)
            )
        written = 0
        for gid, refs in by_group.items():
            # Built again on the ledger the append is written against: owed once, whoever gets there first.
            def build(ledger: LedgerState, refs: list[AttemptRef] = refs) -> list[Event]:
                return list(core.strays(ledger, ctx.driver, agent_name, incarnation, refs, owed_before))

            written += len(await ctx.journal.append(group_stream(gid), build))
        if written:
            log.warning(
                "agent %s holds %d result(s) of tries the log settled (it lost its state and ran them "
                "again): retires owed to release them",
                agent_name,
                written,
            )
            ctx.retire_wakeup.set()
        return written

    async def _run(self) -> None:
        ctx = self.ctx
        while not ctx.stopping:
            await wait_at_most(ctx.retire_wakeup.wait(), IDLE_POLL_S)
            ctx.retire_wakeup.clear()
            for agent in ctx.answered_agents:
                # Back: called now, not after the backoff of its last failure (the spell goes on).
                self._not_before.pop(agent, None)
            ctx.answered_agents.clear()
            if ctx.active_checkpoint is not None:
                continue
            now = time.monotonic()
            agents = [a for a in self.owed_agents() if now >= self._not_before.get(a, 0.0)]
            try:
                await asyncio.gather(*(self.pay(a) for a in agents))
            except (FencedOff, CoordinatorStopped) as exc:
                log_stop("retire relay", exc)
                return

    async def pay(self, agent_name: str) -> bool:
        """One retire for each try owed to `agent_name`, oldest first; False once one fails."""
        async with self._locks[agent_name]:
            client = self.ctx.agents.get(agent_name)
            if client is None:
                log.error("retires owed to unknown agent %s: no client to call", agent_name)
                return False
            for debt in self.owed(agent_name)[:MAX_BATCH]:
                if self.ctx.stopping or self.ctx.active_checkpoint is not None:
                    return False
                if not await self._pay_one(agent_name, client, debt):
                    return False
            return True

    async def _pay_one(self, agent_name: str, client: GymClient, debt: RetireDebt) -> bool:
        rid, n = debt.rollout_id, debt.attempt_index
        owed = core.OwedRetire(agent_name, rid, n)
        got = await retire_answer(client, rid, n, None)
        step = core.on_retire(owed, got)
        if step.verdict == "refused":  # the agent is another trainer's now (trainer.core.refusal)
            self.ctx.refuse(agent_name, step.reason)
            return False
        if step.verdict == "fetch_receipt":
            try:
                receipt = await client.completion_receipt(rid, n)
            except GymError as exc:
                step = core.RetireDebtStep(
                    "failed", reason=f"completion receipt: {type(exc).__name__}: {exc}"
                )
            else:
                step = core.on_receipt(owed, step.incarnation, receipt)
        if step.verdict == "failed":
            await self._failed(agent_name, step.reason)
            return False
        self._failures.pop(agent_name, None)
        self._not_before.pop(agent_name, None)
        self.stuck.pop(agent_name, None)
        written = await self.ctx.journal.append(
            group_stream(group_id_of(rid)), _still_owed(agent_name, debt_key(rid, n), step.events)
        )
        if written:
            self.paid += 1
            if any(isinstance(e, AckOwed) for e in written):
                # The ACK is what makes the agent discard the result: sent now, not at the next poll.
                self.released += 1
                self.ctx.ack_wakeup.set()
            log.info("retire owed to %s for %s#%d paid: %s", agent_name, rid, n, written[-1])
        return True

    async def _failed(self, agent_name: str, reason: str) -> None:
        now = time.monotonic()
        retry = core.on_failure(
            self._failures.get(agent_name, RetryState()),
            now,
            random.random(),
            reason,
            self.ctx.settings.retire_owed_policy,
        )
        self._failures[agent_name] = retry.state
        self._not_before[agent_name] = now + retry.delay_s
        if not retry.stuck or agent_name in self.stuck:
            log.info(
                "retire owed to %s failed, called again in %.2f s: %s", agent_name, retry.delay_s, reason
            )
            return
        # Reported once per spell; the retires stay owed in the log and are called on at the cap.
        self.stuck[agent_name] = retry.reason
        owed = len(self.owed(agent_name))
        await self.ctx.journal.append(
            trainer_stream(self.ctx.settings.trainer_id),
            [
                RetireDeliveryStuck(
                    agent_name=agent_name, retires=owed, calls=retry.state.calls, reason=retry.reason[:500]
                )
            ],
        )
        log.error(
            "retires owed to %s stuck (%d tries, still called every ~%.0f s): %s",
            agent_name,
            owed,
            self.ctx.settings.retire_owed_policy.cap_s,
            retry.reason,
        )


def _still_owed(agent_name: str, key: str, events: Sequence[Event]) -> Callable[[LedgerState], list[Event]]:
    def build(ledger: LedgerState) -> list[Event]:
        # Another pass (or process) may have paid it meanwhile: recorded once.
        return list(events) if key in ledger.retires.get(agent_name, {}) else []

    return build
