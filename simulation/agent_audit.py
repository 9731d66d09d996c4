"""The audit of a shared fleet: the log beside what each agent holds (its durable execution evidence,
its driver binding, and its phase where the caller asked it), judged by the one ownership rule of
`projections.ownership` (a try, its debt and a checkpoint belong to their trainer; an agent is
`(trainer, name)`).

`projections.audit` judges the log alone; what only the agents can show is judged here:

- `paid-result-held`: the agent's newest generation holds a finished result unreleased that the log
  says was ACKed: the ACK went to another agent (two trainers' agents of one name mixed up).
- `one-trainer-per-agent`: the agent holds a try of another trainer's group (or of none in this log),
  or its binding names another trainer than the one that drives it: it was shared.
- `no-stale-prepare`: the agent is left preparing or paused by a checkpoint the log aborted (or by
  another trainer's), or holds the artefact of a checkpoint the log aborted.

A violation names its agent and the tries or checkpoint; an empty list says the fleet is clean.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from eventstore import EventStore
from participant.driver import DRIVER_FILE
from participant.evidence import read_evidence
from projections.ownership import AgentRef, owner_of_try
from projections.runner import rebuild
from protocol.wire import AgentStatus

PAID_RESULT_HELD: Final = "paid-result-held"
ONE_TRAINER_PER_AGENT: Final = "one-trainer-per-agent"
NO_STALE_PREPARE: Final = "no-stale-prepare"
AGENT_RULES: Final = (PAID_RESULT_HELD, ONE_TRAINER_PER_AGENT, NO_STALE_PREPARE)
_LISTED: Final = 5  # tries named in one message; the count is always given


@dataclass(frozen=True, slots=True)
class AgentSeen:
    """What one agent holds: its state directory and, if the caller asked it, its `/status`."""

    state_dir: Path
    status: AgentStatus | None = None


@dataclass(frozen=True, slots=True)
class AgentViolation:
    rule: str
    agent: AgentRef
    message: str

    def line(self) -> str:
        return f"{self.rule}: {self.agent}: {self.message}"


def _named(keys: list[str]) -> str:
    more = f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
    return ", ".join(keys[:_LISTED]) + more


def _label(trainer_id: str | None) -> str:
    return "the unnamed trainer" if trainer_id is None else f"trainer {trainer_id!r}"


def audit_agents(store: EventStore, agents: Mapping[AgentRef, AgentSeen]) -> list[AgentViolation]:
    """Every violation of the fleet `agents` (each as the log knows it) against the log in `store`."""
    replay = rebuild(store)
    ledger = replay.state("ledger")
    checkpoints = replay.state("checkpoints").checkpoints
    paid = {
        (str(e.data["rollout_id"]), int(e.data["attempt_index"]))
        for e in store.read_all()
        if e.type == "AckAccepted"
    }
    found: list[AgentViolation] = []
    for ref, seen in sorted(agents.items(), key=lambda item: str(item[0])):
        evidence = read_evidence(seen.state_dir)
        held_paid = sorted(
            f"{t.rollout_id}#{t.attempt_index}"
            for t in evidence.stranded
            if (t.rollout_id, t.attempt_index) in paid
        )
        if held_paid:
            found.append(
                AgentViolation(
                    PAID_RESULT_HELD,
                    ref,
                    f"{len(held_paid)} result(s) the log says were ACKed are still held here: "
                    f"{_named(held_paid)} (their ACK went to another agent)",
                )
            )
        foreign = []
        for t in evidence.tries.values():
            owner = owner_of_try(ledger, t.rollout_id)
            if owner is None or owner.trainer_id != ref.trainer_id:
                whose = "no group of this log" if owner is None else _label(owner.trainer_id)
                foreign.append(f"{t.rollout_id}#{t.attempt_index} ({whose})")
        if foreign:
            found.append(
                AgentViolation(
                    ONE_TRAINER_PER_AGENT,
                    ref,
                    f"{len(foreign)} tries not of {_label(ref.trainer_id)}'s groups ran here: {_named(sorted(foreign))}",
                )
            )
        binding = _binding(seen.state_dir)
        if binding is not None and binding != (ref.trainer_id,):
            found.append(
                AgentViolation(
                    ONE_TRAINER_PER_AGENT,
                    ref,
                    f"bound to {_label(binding[0])}, driven by {_label(ref.trainer_id)}",
                )
            )
        active = seen.status.active_checkpoint_id if seen.status is not None else None
        if active is not None:
            ck = checkpoints.get(active)
            if ck is not None and ck.status == "aborted":
                found.append(
                    AgentViolation(
                        NO_STALE_PREPARE,
                        ref,
                        f"left {seen.status.phase if seen.status else '?'} by checkpoint {active}, "
                        "which the log aborted (a stale prepare)",
                    )
                )
            elif ck is not None and ck.trainer_id != ref.trainer_id:
                found.append(
                    AgentViolation(
                        NO_STALE_PREPARE, ref, f"in checkpoint {active} of {_label(ck.trainer_id)}"
                    )
                )
        for cid, ck in sorted(checkpoints.items()):
            if ck.status == "aborted" and (seen.state_dir / "checkpoints" / f"{cid}.json").exists():
                found.append(
                    AgentViolation(
                        NO_STALE_PREPARE, ref, f"holds the artefact of {cid}, which the log aborted"
                    )
                )
    return found


def _binding(state_dir: Path) -> tuple[str | None] | None:
    """The trainer the agent's `driver.json` binds it to (as a 1-tuple; None: unbound or unreadable)."""
    try:
        saved = json.loads((state_dir / DRIVER_FILE).read_text())
    except (OSError, ValueError):
        return None
    tid = saved.get("trainer_id") if isinstance(saved, dict) else None
    return (tid if isinstance(tid, str) else None,)


__all__ = ["AGENT_RULES", "AgentSeen", "AgentViolation", "audit_agents"]
