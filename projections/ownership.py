"""Who owns what when several trainers share one log: the one rule every act at an agent is checked by.

A group belongs to the trainer that reserved it (`GroupState.trainer_id`; a take-over is only ever
by the same trainer id), and so does everything of it: its tries, their retire or adoption, and the
ACK debt of each result.  An agent name is unique only among one trainer's agents: two trainers may
each drive their own agent called `ag`, so a debt `AckOwed(agent_name="ag")` in a group of trainer A
is owed to A's `ag`, never to B's.  The agent a debt or try belongs to is therefore the pair
`AgentRef(trainer_id, agent_name)`, and a checkpoint's participants are the checkpoint trainer's.

`Driver` is one coordinator as the log sees it (its trainer id and the agent names it drives).  The
trainer asks it before every act on a try or debt at an agent (the ACK relay takes only the debts
`Driver.debts` gives it; a checkpoint prepare counts `Driver.unpaid` and adopts or retires only a try
`Driver.refusal` lets it; `Attempts.resolve` refuses anything else), and the auditor judges the
writes in the log by the same rule (`projections.audit`, acts-by-owner).  Pure: state in, answer out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from projections.ledger import LedgerState, RetireDebt
from protocol.ids import group_id_of
from protocol.wire import CompletionReceipt

Act = Literal["ack", "retire", "adopt", "dispatch", "settle"]


@dataclass(frozen=True, slots=True)
class AgentRef:
    """An agent as the log knows it: the trainer that drives it and its name among that trainer's."""

    trainer_id: str | None
    agent_name: str

    def __str__(self) -> str:
        return f"{self.agent_name} (trainer {self.trainer_id!r})"


def owner_of_group(ledger: LedgerState, group_id: str) -> AgentRef | None:
    """The trainer and agent of a group in play or archived; None if the log never reserved it."""
    group = ledger.groups.get(group_id) or ledger.archived.get(group_id)
    return None if group is None else AgentRef(group.trainer_id, group.agent_name)


def owner_of_try(ledger: LedgerState, rollout_id: str) -> AgentRef | None:
    """The owner of a try (and of its debt): its group's.  Rollout ids are `<group>_g<index>` and
    group ids are unique across every trainer of the log, so the id alone names the group."""
    group = ledger.group_of(rollout_id)
    if group is not None:
        return AgentRef(group.trainer_id, group.agent_name)
    head = group_id_of(rollout_id)
    return owner_of_group(ledger, head) if head else None


def debts_of(
    ledger: LedgerState, trainer_id: str | None, agent_name: str
) -> list[tuple[str, CompletionReceipt]]:
    """(debt key, receipt) of every unpaid debt of `trainer_id`'s groups to its agent `agent_name`."""
    owed = ledger.debts.get(agent_name)
    if not owed:
        return []
    return [
        (key, receipt)
        for key, receipt in owed.items()
        if (ref := owner_of_try(ledger, receipt.rollout_id)) is not None and ref.trainer_id == trainer_id
    ]


def trainer_debts(ledger: LedgerState, trainer_id: str | None) -> dict[str, list[CompletionReceipt]]:
    """Agent name -> the receipts `trainer_id` owes it, for every agent it owes anything."""
    found = {a: [r for _, r in debts_of(ledger, trainer_id, a)] for a in ledger.debts}
    return {a: owed for a, owed in found.items() if owed}


@dataclass(frozen=True, slots=True)
class Driver:
    """One coordinator: the trainer it is and the agents it drives (names among that trainer's)."""

    trainer_id: str | None
    agents: frozenset[str]

    @classmethod
    def of(cls, trainer_id: str | None, agents: Iterable[str]) -> Driver:
        return cls(trainer_id, frozenset(agents))

    def drives(self, ref: AgentRef) -> bool:
        return ref.trainer_id == self.trainer_id and ref.agent_name in self.agents

    def refusal(
        self, ledger: LedgerState, rollout_id: str, act: Act, group_id: str | None = None
    ) -> str | None:
        """None if this coordinator may `act` on the try `rollout_id` (of `group_id`, where the caller
        knows it) at its agent; else why not."""
        ref = owner_of_group(ledger, group_id) if group_id is not None else owner_of_try(ledger, rollout_id)
        if ref is None:
            return f"{act} of {rollout_id}: no group of this log holds it"
        if ref.trainer_id != self.trainer_id:
            return (
                f"{act} of {rollout_id}: it belongs to trainer {ref.trainer_id!r} (agent "
                f"{ref.agent_name!r}), not to this one ({self.trainer_id!r})"
            )
        if ref.agent_name not in self.agents:
            return f"{act} of {rollout_id}: its agent {ref.agent_name!r} is not one this trainer drives"
        return None

    def debts(self, ledger: LedgerState, agent_name: str) -> list[tuple[str, CompletionReceipt]]:
        """(debt key, receipt) of every unpaid debt this trainer owes its agent `agent_name`, oldest
        first.  Another trainer's debts to an agent of the same name are that trainer's to pay."""
        if agent_name not in self.agents:
            return []
        return debts_of(ledger, self.trainer_id, agent_name)

    def retires(self, ledger: LedgerState, agent_name: str) -> list[RetireDebt]:
        """The retires this trainer owes its agent `agent_name` (tries of its groups declared lost
        there), oldest first.  Another trainer's are that trainer's to pay."""
        if agent_name not in self.agents:
            return []
        return [
            d
            for d in ledger.retires.get(agent_name, {}).values()
            if (ref := owner_of_try(ledger, d.rollout_id)) is not None and ref.trainer_id == self.trainer_id
        ]

    def owed_agents(self, ledger: LedgerState) -> list[str]:
        """The agents of this trainer with at least one unpaid debt of its own."""
        return [a for a in ledger.debts if self.debts(ledger, a)]

    def unpaid(
        self,
        ledger: LedgerState,
        agent_names: Iterable[str],
        excluding: Mapping[str, frozenset[str]] | None = None,
    ) -> dict[str, int]:
        """Agent -> the number of this trainer's debts to it still unpaid in the log, leaving out the
        debt keys `excluding` names for that agent (a checkpoint's carried tries)."""
        left_out = excluding or {}
        return {
            a: sum(1 for k, _ in self.debts(ledger, a) if k not in left_out.get(a, frozenset()))
            for a in agent_names
        }


__all__ = ["Act", "AgentRef", "Driver", "debts_of", "owner_of_group", "owner_of_try", "trainer_debts"]
