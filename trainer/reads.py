"""What a caller reads of a `RolloutCoordinator`: the log as this process has folded it, and the live
counts of its parts.  Nothing here changes the log or a part; the coordinator (`trainer.coordinator`)
adds what does (start, submit, claims, checkpoints, recovery) over the parts it wires."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from projections.checkpoints import CheckpointsState
from projections.ledger import GroupState, LedgerState
from trainer.acks import AckRelay
from trainer.agents import Agents
from trainer.errors import CoordinatorStopped, FencedOff
from trainer.gate import Gate
from trainer.groups import Groups
from trainer.journal import Journal
from trainer.payload_io import PayloadIO
from trainer.retires import RetireRelay
from trainer.sealed import SealedGroup, Training

_T = TypeVar("_T")


class CoordinatorReads:
    """The coordinator's parts, as its reads reach them (set by `RolloutCoordinator.__init__`)."""

    _journal: Journal
    _gate: Gate
    _agents: Agents
    _payloads: PayloadIO
    _groups: Groups
    _training: Training
    _acks: AckRelay
    _retires: RetireRelay

    # --- what the log says ------------------------------------------------------------------------

    @property
    def ledger(self) -> LedgerState:
        return self._journal.ledger

    @property
    def checkpoints(self) -> CheckpointsState:
        return self._journal.checkpoints

    @property
    def position(self) -> int:
        """The log position this process has folded up to."""
        return self._journal.position

    @property
    def fenced(self) -> FencedOff | None:
        return self._journal.fenced

    @property
    def stopped(self) -> CoordinatorStopped | None:
        """The outage that stopped this coordinator for good, if one did."""
        return self._journal.stopped

    @property
    def writer(self) -> str:
        """This process as the log's rows name their writer (`host/pid/nonce`)."""
        return self._journal.writer

    @property
    def owns_epoch(self) -> bool:
        """Whether this process has taken its trainer's owner epoch (its appends carry the fence)."""
        return self._journal.owner is not None

    @property
    def closing(self) -> bool:
        return self._gate.closing

    @property
    def active_checkpoint(self) -> str | None:
        """The checkpoint prepared here and not yet decided, if any."""
        return self._gate.checkpoint

    @property
    def agent_names(self) -> list[str]:
        return self._agents.names

    async def catch_up(self) -> None:
        """Folds what other writers appended to the log since this process last did."""
        await self._journal.catch_up()

    async def wait_changed(self, timeout_s: float) -> None:
        """Until this process's next batch of appends is recorded, or `timeout_s` has passed."""
        await self._journal.wait_changed(timeout_s)

    async def drain(self) -> None:
        """Until every append queued so far is written or failed (a closed coordinator's cancelled
        drivers leave theirs queued; a process handing the log to another waits for them)."""
        await self._journal.drain()

    async def settle_appends(self) -> None:
        """Until every append already being written is in (those cancelled before their batch began
        are never written)."""
        await self._journal.settle()

    async def read_log(self, read: Callable[[], _T], what: str) -> _T:
        """`read()` (a read of the log or beside it), a database outage ridden out as this coordinator's
        own reads are (`what` names it in the log's messages)."""
        return await self._journal.read(read, what)

    def journal_figures(self) -> dict[str, int]:
        """This process's own counts of appends, batches, outage retries and payload puts."""
        journal = self._journal
        return {
            "appends": journal.appends,
            "batches": journal.batches,
            "outage_retries": journal.outage_retries,
            "payload_puts": self._payloads.puts,
            "payload_store_calls": self._payloads.put_calls,
        }

    # --- groups, relays, training ---------------------------------------------------------------

    def owns(self, group: GroupState) -> bool:
        return self._groups.owns(group)

    def open_groups(self) -> list[str]:
        return self._groups.open_groups()

    def attempts_in_flight(self) -> int:
        """Attempts of this trainer's open groups that are neither finished nor settled (the window a
        caller admits new groups by)."""
        return self._groups.attempts_in_flight()

    def sealed_unclaimed(self) -> list[SealedGroup]:
        """This trainer's sealed groups no training step claimed yet (no payload read)."""
        return self._training.sealed_unclaimed()

    def owed_retire_agents(self) -> list[str]:
        """Agents this trainer owes a retire (of an attempt declared lost there)."""
        return self._retires.owed_agents()

    def owed_ack_agents(self) -> list[str]:
        """Agents this trainer owes an ACK."""
        return self._acks.owed_agents()

    def queued_attempts(self) -> int:
        """Attempts waiting for a connection of their agent's run pool (`max_run_connections`): minted,
        not yet dispatched, and spending none of their lease while they wait."""
        return self._agents.waiting_runs()
