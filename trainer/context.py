"""What the coordinator's parts share: the log, the agents, the settings and the checkpoint gate."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from eventstore.events import RetireCause
from projections.ownership import Driver
from protocol.ids import group_id_of
from protocol.retry import RetryPolicy
from protocol.wire import ContinuationRef, ResumeReport, TryWork
from trainer.core.attempt import RETIRE_POLICY
from trainer.core.debt import ACK_POLICY
from trainer.core.refusal import driven, on_trainer_conflict
from trainer.core.retire_debt import RETIRE_OWED_POLICY
from trainer.errors import AgentShared
from trainer.gym import GymClient
from trainer.journal import Journal

log = logging.getLogger("trainer")

OutcomeKind = Literal["finished", "owed", "retired", "stranded"]


@dataclass(frozen=True)
class Settings:
    rollout_timeout_s: float = 600.0
    prepare_timeout_s: float = 300.0
    max_tries: int = 4
    max_infra_failures: int = 4
    max_data_failures: int = 4
    # A reply with `mask_sample` set is a result like any other (sealed, its mask recorded and passed
    # on to training); True makes it a failed try instead, replaced within the data budget.
    mask_sample_retries: bool = False
    # A try that reports no progress of its own for this long (and STALL_BEATS of its agent's heartbeat
    # intervals) is stuck inside a model call: a prepare retires it (trainer.core.blocking).
    park_grace_s: float = 1.0
    # Tries one rollout may lose to checkpoints' last resort; past it a prepare waits for its try.
    max_checkpoint_retires: int = 1
    # A prepare asks each agent that can to carry its finished, unACKed tries across the checkpoint
    # (answer `prepared` once nothing runs) instead of waiting until the trainer has taken them in.
    carry_completed: bool = True
    # Server-side wait of one prepare call before it answers 409 and the coordinator acts on it.
    prepare_poll_s: float = 0.5
    adopt_timeout_s: float = 60.0
    # Several trainers may share one log; each owns the groups and checkpoints it started.
    trainer_id: str | None = None
    # How often each agent's checkpoint phase is compared with the log (0: only at recovery).
    reconcile_every_s: float = 5.0
    # Transport failures of one try's retire/adopt calls before the try is declared lost.
    retire_policy: RetryPolicy = RETIRE_POLICY
    # Transport failures of one agent's /acknowledge before it is reported stuck (then retried at the cap).
    ack_policy: RetryPolicy = ACK_POLICY
    # Failures of one agent's owed retires (tries declared lost there) before it is reported stuck
    # (then called at the cap).
    retire_owed_policy: RetryPolicy = RETIRE_OWED_POLICY


@dataclass(frozen=True)
class AttemptOutcome:
    """How a try ended, as far as its group is concerned.

    finished: held or sealed (debt recorded); owed: the agent finished it but it is not usable
    (masked, unverifiable, or adopted after its group gave up) and its debt is recorded;
    retired: the agent cancelled or tombstoned it; stranded: the agent holds a finished result that
    answers garbage to every adoption, so it can be neither sealed, nor owed, nor replaced (the group
    is dead-lettered).  `recorded` says whether the AttemptRetired is
    in the log already (the caller appends it together with the replacement otherwise).
    """

    kind: OutcomeKind
    reason: str = ""
    retire_outcome: Literal["cancelled", "tombstoned", "done"] | None = None
    recorded: bool = False
    # The agent process that answered the retire (recorded with the `AttemptRetired`).
    execution_generation: int | None = None
    execution_incarnation: str | None = None
    # Set when a checkpoint's prepare retired it while running (recorded with the `AttemptRetired`).
    cause: RetireCause | None = None
    checkpoint_id: str | None = None
    # What the cancelled execution had done, as its agent measured it.
    work: TryWork | None = None
    # The try's latest committed turn boundary its agent offered with the retire, and what the try
    # did with the continuation it was asked to resume (docs/turns.md).
    continuation: ContinuationRef | None = None
    resume: ResumeReport | None = None


@dataclass(frozen=True)
class RetireFor:
    """Why the trainer retires a try that did not fail: a checkpoint's prepare needs it gone."""

    cause: RetireCause
    checkpoint_id: str
    reason: str


@dataclass
class LiveAttempt:
    """Serialises everyone who may settle one try (its /run task, a group abandoning it, a prepare)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    outcome: AttemptOutcome | None = None


class Context:
    def __init__(self, journal: Journal, agents: dict[str, GymClient], settings: Settings) -> None:
        self.journal = journal
        self.agents = agents
        self.settings = settings
        self.live: dict[tuple[str, int], LiveAttempt] = {}
        self._live_by_group: dict[str, list[tuple[str, int]]] = {}
        self.active_checkpoint: str | None = None
        self.checkpoint_idle = asyncio.Event()
        self.checkpoint_idle.set()
        self.stopping = False
        self.ack_wakeup = asyncio.Event()
        # Set when a retire is owed (a try declared lost), or an agent answered (`answered`): the retire
        # relay tries the agent's owed retires at once.
        self.retire_wakeup = asyncio.Event()
        self.answered_agents: set[str] = set()
        # Each agent's incarnation as last seen (at start and at each reconcile): a change is a restart.
        self.incarnations: dict[str, str] = {}
        # What the coordinator reports (`RolloutCoordinator.errors`), and the agents that refused this
        # trainer at a call after its start (trainer.core.refusal): name -> the error, not driven since.
        self.errors: list[BaseException] = []
        self.refused: dict[str, AgentShared] = {}

    def refuse(self, agent_name: str, message: str) -> AgentShared:
        """`agent_name` answered `409 trainer_conflict`: it is not driven from now on, and the refusal
        is reported once (in `errors` and the log); returns the error to raise."""
        decided = on_trainer_conflict(self.refused, agent_name, self.client(agent_name).base_url, message)
        if decided.first:
            error = self.refused[agent_name] = AgentShared(decided.line)
            self.errors.append(error)
            log.error("agent %s is not driven any more: %s", agent_name, decided.line)
        return self.refused[agent_name]

    def answered(self, agent_name: str) -> None:
        """An exchange with the agent succeeded: it is reachable again, so the retires owed to it are
        called now rather than after the backoff of their last failure."""
        self.answered_agents.add(agent_name)
        self.retire_wakeup.set()

    def live_attempt(self, rollout_id: str, attempt_index: int) -> LiveAttempt:
        key = (rollout_id, attempt_index)
        found = self.live.get(key)
        if found is None:
            found = self.live[key] = LiveAttempt()
            self._live_by_group.setdefault(group_id_of(rollout_id), []).append(key)
        return found

    def forget_group(self, group_id: str) -> None:
        """Drops the settled tries of a group that left play (the log holds their outcomes), so the
        trainer's memory follows the groups in play, not its history; a try still held stays."""
        for key in self._live_by_group.pop(group_id, []):
            live = self.live.get(key)
            if live is not None and not live.lock.locked():
                del self.live[key]

    @property
    def driver(self) -> Driver:
        """This coordinator as the log sees it: its trainer and the agents it drives (every act at an
        agent on a try or debt is checked against it: projections.ownership)."""
        return Driver.of(self.settings.trainer_id, driven(self.agents, self.refused))

    def client(self, agent_name: str) -> GymClient:
        try:
            return self.agents[agent_name]
        except KeyError:
            raise KeyError(f"no client for agent {agent_name!r}; known: {sorted(self.agents)}") from None

    @property
    def checkpoint_in_flight(self) -> bool:
        return self.active_checkpoint is not None


class Lease:
    """A try's deadline: a clock that does not run while a checkpoint is in flight (docs/protocol.md, Deadlines and fencing)."""

    def __init__(self, ctx: Context, budget_s: float) -> None:
        self.ctx = ctx
        self.remaining = budget_s
        self._last = time.monotonic()

    def tick(self) -> float:
        now = time.monotonic()
        if not self.ctx.checkpoint_in_flight:
            self.remaining -= now - self._last
        self._last = now
        return self.remaining
