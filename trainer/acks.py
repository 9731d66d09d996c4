"""The ACK relay: an outbox that pays the debts the log says are unpaid (docs/protocol.md, ACK debts).

It reads unpaid debts from the ledger projection (so they survive any crash), sends ONE
`/acknowledge` per agent carrying every receipt owed to it, and appends `AckAccepted` only after the
agent accepted, `AckRejected` with the agent's reason otherwise.  Transport failures back off with
jitter within `ACK_POLICY` (trainer/core/debt.py); once it is spent the agent is reported stuck
(`AckDeliveryStuck` on the trainer's stream, once per spell, and an error log; `AckRelay.stuck`) and
called at the longest wait: a debt is never dropped here.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from collections.abc import Callable

from eventstore.events import (
    AckAccepted,
    AckDeliveryStuck,
    AckOwed,
    AckRejected,
    Event,
    ReceiptFetched,
    RunFailed,
)
from projections.ledger import LedgerState, debt_key
from protocol.ids import capture_key
from protocol.retry import RetryState
from protocol.streams import group_stream, trainer_stream
from protocol.wire import CompletionReceipt
from trainer.attempts import group_id_of
from trainer.context import Context, log
from trainer.core import debt as debt_core
from trainer.errors import CoordinatorStopped, FencedOff
from trainer.eventloop import wait_at_most
from trainer.gym import GymClient
from trainer.gym.errors import (
    AgentTimeoutError,
    AgentUnavailableError,
    ConnectionLostError,
    GymError,
    TrainerConflictError,
)
from trainer.stops import log_stop

IDLE_POLL_S = 0.5
MAX_BATCH = 2000
# A try whose receipt the agent keeps changing is re-fetched this often, then left unpaid and logged.
MAX_REFETCHES = 3


class AckRelay:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # Per agent: the failed /acknowledge calls of the current spell (trainer.core.debt.ACK_POLICY).
        self._failures: dict[str, RetryState] = {}
        # Agents whose ACK budget is spent (reason), until one of their /acknowledge calls succeeds.
        self.stuck: dict[str, str] = {}
        self._not_before: dict[str, float] = {}
        # Receipts the agent called mismatched: kept as unpaid (the ledger keeps them) but not resent
        # in a loop by this process.
        self._mismatched: set[str] = set()
        self._refetches: dict[str, int] = defaultdict(int)
        self.accepted = 0
        self.rejected = 0
        self.requests = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ack-relay")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def owed_agents(self) -> list[str]:
        """Agents this trainer owes an ACK.  A debt belongs to its group's trainer
        (projections.ownership): another trainer's debt to an agent of the same name is that trainer's
        to pay, to its own agent."""
        ledger = self.ctx.journal.ledger
        driver = self.ctx.driver
        return [a for a in ledger.debts if any(k not in self._mismatched for k, _ in driver.debts(ledger, a))]

    async def _run(self) -> None:
        ctx = self.ctx
        while not ctx.stopping:
            await wait_at_most(ctx.ack_wakeup.wait(), IDLE_POLL_S)
            ctx.ack_wakeup.clear()
            agents = [a for a in self.owed_agents() if time.monotonic() >= self._not_before.get(a, 0.0)]
            try:
                await asyncio.gather(*(self.send(a) for a in agents))
            except (FencedOff, CoordinatorStopped) as exc:
                log_stop("ack relay", exc)
                return

    async def send(self, agent_name: str) -> bool:
        """One /acknowledge for everything owed to `agent_name`; False on a transport failure."""
        async with self._locks[agent_name]:
            owed = [
                r
                for key, r in self.ctx.driver.debts(self.ctx.journal.ledger, agent_name)
                if key not in self._mismatched
            ][:MAX_BATCH]
            if not owed:
                return True
            client = self.ctx.agents.get(agent_name)
            if client is None:
                log.error("debts owed to unknown agent %s: no client to send them", agent_name)
                return False
            self.requests += 1
            try:
                results = await client.acknowledge(owed)
            except TrainerConflictError as exc:  # another trainer's agent now (trainer.core.refusal)
                self.ctx.refuse(agent_name, exc.message)
                return False
            except GymError as exc:
                now = time.monotonic()
                retry = debt_core.on_ack_failure(
                    self._failures.get(agent_name, RetryState()),
                    now,
                    random.random(),
                    f"{type(exc).__name__}: {exc}",
                    self.ctx.settings.ack_policy,
                )
                self._failures[agent_name] = retry.state
                self._not_before[agent_name] = now + retry.delay_s
                if retry.stuck and agent_name not in self.stuck:
                    # Reported once per spell; the debts stay owed in the log and are sent on.
                    self.stuck[agent_name] = retry.reason
                    await self.ctx.journal.append(
                        trainer_stream(self.ctx.settings.trainer_id),
                        [
                            AckDeliveryStuck(
                                agent_name=agent_name,
                                debts=len(owed),
                                calls=retry.state.calls,
                                reason=retry.reason[:500],
                            )
                        ],
                    )
                    log.error(
                        "ACK to %s stuck (%d receipts owed, still retried every ~%.0f s; "
                        "`ledger debt list`): %s",
                        agent_name,
                        len(owed),
                        self.ctx.settings.ack_policy.cap_s,
                        retry.reason,
                    )
                else:
                    log.info(
                        "ACK to %s failed (%d receipts), retry in %.2f s: %s",
                        agent_name,
                        len(owed),
                        retry.delay_s,
                        exc,
                    )
                return False
            self._failures.pop(agent_name, None)
            self.ctx.answered(agent_name)
            self.stuck.pop(agent_name, None)
            self._not_before.pop(agent_name, None)
            by_group: dict[str, list[tuple[CompletionReceipt, list[Event]]]] = defaultdict(list)
            agent: debt_core.AgentSeen | None = None
            if any(not r.acknowledged and r.error == "unknown_execution" for r in results):
                # A debt drops only on evidence: the agent's incarnation now, against the receipt's.
                try:
                    status = await client.status()
                    agent = debt_core.AgentSeen(status.execution_incarnation, status.execution_generation)
                except GymError as exc:
                    log.info(
                        "ACK to %s: unknown_execution, agent's incarnation unavailable (kept owed): %s",
                        agent_name,
                        exc,
                    )
            for receipt, result in zip(owed, results, strict=True):
                decided = debt_core.on_ack(receipt, result, agent)
                events: list[Event] = list(decided.events)
                if decided.verdict == "refetch":
                    events += await self._refetch(agent_name, client, receipt)
                elif decided.verdict == "kept":
                    self._mismatched.add(debt_key(receipt.rollout_id, receipt.attempt_index))
                    log.error("ACK to %s: %s", agent_name, decided.reason)
                if events:
                    by_group[group_id_of(receipt.rollout_id)].append((receipt, events))
            # Concurrently, so the journal writes them all in one batch.
            appended = await asyncio.gather(
                *(
                    self.ctx.journal.append(group_stream(group_id), _still_owed(agent_name, items))
                    for group_id, items in by_group.items()
                )
            )
            for event in (e for written in appended for e in written):
                if isinstance(event, AckAccepted):
                    self.accepted += 1
                elif isinstance(event, AckRejected):
                    self.rejected += 1
            return True

    async def _refetch(self, agent_name: str, client: GymClient, sent: CompletionReceipt) -> list[Event]:
        """The agent refused the receipt we owe it: ask it for its current receipt of that try.

        Owed again (ReceiptFetched + AckOwed, so the next pass ACKs it) only if it names the same try,
        its token list and the very reply we recorded (identity and digest): then only our record of
        the receipt was off (e.g. its execution generation or terminal call).  A receipt for another
        reply is a verify failure, recorded as such; it is owed all the same, so the agent's copy is
        released rather than stranded, but nothing new is sealed from it.  Anything else (the agent
        repeats the receipt it refused, answers garbage, or keeps changing it) leaves the debt unpaid
        in the log, not resent in a loop by this process, and logged.
        """
        rid, n = sent.rollout_id, sent.attempt_index
        key = debt_key(rid, n)
        self._refetches[key] += 1
        if self._refetches[key] > MAX_REFETCHES:
            self._mismatched.add(key)
            log.error("agent %s keeps refusing the ACK of %s: left unpaid", agent_name, sent.attempt)
            return []
        try:
            fresh = await client.completion_receipt(rid, n)
        except GymError as exc:
            # Away for now (transport): the next pass resends, is refused again and re-fetches, within
            # MAX_REFETCHES.  Anything else (garbage, gone, unknown) is left unpaid for good.
            if not isinstance(exc, AgentTimeoutError | AgentUnavailableError | ConnectionLostError):
                self._mismatched.add(key)
            log.error(
                "agent %s refused the ACK of %s (receipt_mismatch) and its receipt is unavailable: %s",
                agent_name,
                sent.attempt,
                exc,
            )
            return []
        if fresh == sent or fresh.manifest_capture_key != capture_key(rid, n):
            self._mismatched.add(key)
            log.error(
                "agent %s refused the ACK of %s (receipt_mismatch) but describes it as %s",
                agent_name,
                sent.attempt,
                fresh,
            )
            return []
        attempt = self.ctx.journal.ledger.attempt(rid, n)
        recorded_digest = attempt.reply_digest if attempt is not None and attempt.reply_digest else None
        same_reply = fresh.result_identity == sent.result_identity and fresh.result_digest == (
            recorded_digest or sent.result_digest
        )
        events: list[Event] = []
        if not same_reply:
            events.append(
                RunFailed(
                    rollout_id=rid,
                    attempt_index=n,
                    kind="verify",
                    reason=(
                        f"the agent refused the ACK of a receipt for reply {sent.result_identity} "
                        f"({sent.result_digest}) and now describes reply {fresh.result_identity} "
                        f"({fresh.result_digest}); ACKed only to release its copy"
                    )[:500],
                )
            )
            log.error("agent %s changed the result of %s after it was recorded", agent_name, sent.attempt)
        return [
            *events,
            ReceiptFetched(agent_name=agent_name, receipt=fresh),
            AckOwed(agent_name=agent_name, receipt=fresh),
        ]

    async def flush(self, agent_name: str, timeout_s: float, carried: frozenset[str] = frozenset()) -> bool:
        """Sends until nothing is owed to `agent_name` (in the log) but the `carried` debts (a
        checkpoint carries them: they are sent, not waited for); False if the time ran out."""
        deadline = time.monotonic() + timeout_s
        while True:
            owed = self.ctx.driver.debts(self.ctx.journal.ledger, agent_name)
            if not any(k not in self._mismatched and k not in carried for k, _ in owed):
                return True
            if time.monotonic() >= deadline:
                return False
            if not await self.send(agent_name):
                now = time.monotonic()
                # Until the failed call's backoff has passed (0.05 s when no failure set one).
                await asyncio.sleep(
                    min(self._not_before.get(agent_name, now + 0.05) - now, max(0.0, deadline - now))
                )


def _still_owed(
    agent_name: str, items: list[tuple[CompletionReceipt, list[Event]]]
) -> Callable[[LedgerState], list[Event]]:
    def build(ledger: LedgerState) -> list[Event]:
        owed = ledger.debts.get(agent_name, {})
        # Another relay pass (or coordinator) may have paid or replaced it meanwhile: record each once.
        return [
            e for r, events in items if owed.get(debt_key(r.rollout_id, r.attempt_index)) == r for e in events
        ]

    return build
