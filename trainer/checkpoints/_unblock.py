"""A prepare's 409, answered: what keeps an agent from being ready is paid, adopted or retired.

The agent names the finished, unACKed attempts it holds (ACK what is owed, adopt the rest: a prepare
never waits for a result the trainer could take) and the attempts still on their way to a turn
boundary (waited for while they progress; retired when stuck, or at the last resort:
trainer.core.blocking).  An attempt the agent names that this trainer does not own fails the prepare:
acting on it would act on another trainer's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from projections.ledger import debt_key
from protocol.ids import group_id_of
from protocol.wire import AttemptRef
from trainer.acks import AckRelay
from trainer.agents import Agents
from trainer.attempts import Attempts, RetireFor
from trainer.core.blocking import Blocking, Retire, judge, last_resort_s
from trainer.core.budget import checkpoint_losses
from trainer.gym.errors import NotReadyError
from trainer.journal import Journal
from trainer.settings import Settings, log


@dataclass
class PrepareState:
    """What one checkpoint's prepare found so far, per participant."""

    ready: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    adopted: int = 0
    retired: int = 0
    acked: int = 0
    # Per agent: the finished, unACKed attempts it carries across the checkpoint (its prepared answer's).
    carried: dict[str, list[AttemptRef]] = field(default_factory=dict)
    # Per agent: the blocking attempts the last resort may not retire (the prepare waits for them).
    protected: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)


class Unblocker:
    def __init__(
        self, journal: Journal, agents: Agents, settings: Settings, attempts: Attempts, acks: AckRelay
    ) -> None:
        self.journal = journal
        self.agents = agents
        self.settings = settings
        self.attempts = attempts
        self.acks = acks

    def _blocking(self, exc: NotReadyError) -> list[Blocking]:
        """The attempts the answer names as blocking, with their own progress and the log's count of the
        attempts their rollouts lost to checkpoints."""
        ledger = self.journal.ledger
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

    async def answer(
        self, checkpoint_id: str, name: str, exc: NotReadyError, deadline: float, state: PrepareState
    ) -> str | None:
        """Pays, adopts or retires what keeps `name` from being ready; the reason the prepare fails
        instead if the agent names an attempt this trainer does not own (it would act on another's)."""
        ledger = self.journal.ledger
        driver = self.agents.driver
        for ref in [*exc.attempts, *exc.status.blocking_attempts]:
            refusal = driver.refusal(ledger, ref.rollout_id, "settle")
            if refusal is not None and ledger.attempt(ref.rollout_id, ref.attempt_index) is not None:
                # An attempt of another trainer's group at this agent: two trainers drive one agent.
                return f"the agent holds an attempt this trainer may not settle ({refusal})"
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
        await self.acks.send(name)
        # The attempts still on their way to a boundary: waited for while they make progress of their
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
            park_grace_s=self.settings.park_grace_s,
            left_s=deadline - time.monotonic(),
            last_resort_at_s=last_resort_s(self.settings.prepare_timeout_s),
            max_checkpoint_retires=self.settings.max_checkpoint_retires,
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
        attempt = self.journal.ledger.attempt(rollout_id, attempt_index)
        if attempt is None:
            log.warning(
                "prepare names (%s, %d), an attempt this log never minted: cannot adopt it",
                rollout_id,
                attempt_index,
            )
            return False
        outcome = await self.attempts.resolve(group_id_of(rollout_id), rollout_id, attempt_index)
        return outcome.kind != "retired"

    async def _retire(self, checkpoint_id: str, retire: Retire) -> bool:
        rid, n = retire.rollout_id, retire.attempt_index
        if self.journal.ledger.attempt(rid, n) is None:
            log.warning("prepare blocked by (%s, %d), an attempt this log never minted", rid, n)
            return False
        log.warning("checkpoint %s retires (%s, %d): %s", checkpoint_id, rid, n, retire.reason)
        why = RetireFor(retire.cause, checkpoint_id, retire.reason)
        outcome = await self.attempts.resolve(group_id_of(rid), rid, n, why)
        return outcome.kind == "retired"
