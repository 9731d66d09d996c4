"""An agent that refuses this trainer: `409 trainer_conflict` (one trainer per agent, participant.driver).

The answer means the same whenever it comes: the agent is bound to another trainer, which keeps it
until it closes holding nothing there, so no retry changes it meanwhile; and the agent holds nothing
of this trainer (a binding moves only once its trainer holds nothing at the agent, or with the
agent's state directory lost).  Every call site therefore decides it the way `start()` does:

    answer to                               decision
    POST /driver at start()                 AgentShared raised: the coordinator does not start,
                                            nothing is written
    /run, /retire, /acknowledge,            the agent is refused (`on_trainer_conflict`): nothing more
    /checkpoint/* at any later time         is sent to it and nothing is recorded against it (no
                                            RunFailed, RetireOwed or AckOwed: the try never ran there,
                                            and an agent that holds nothing is owed nothing); its
                                            groups stay open, undriven, for a recovery once it is free
                                            (`RolloutCoordinator.recover`); a prepare in flight fails
                                            at once and later checkpoints leave the agent out; one
                                            AgentShared in the coordinator's errors, with start()'s line
    submit to a refused agent               AgentShared raised, nothing written (as at start)

Each machine's own input for the answer says what it means there: `attempt.DriverRefused` settles
a try `refused` with no event, `retire_debt.on_retire` stops calling (the retire stays owed in the
log), `checkpoint.NotDriven` is an agent that holds nothing of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class AgentRefused:
    """The agent `agent_name` refused this trainer.  `line`: the one-line error, the one `start()`
    raises (`<agent url>: <the agent's message>`); `first`: not refused before (so said once)."""

    agent_name: str
    line: str
    first: bool


def refusal_line(base_url: str, message: str) -> str:
    """The error line of an agent's refusal: where it is, and what it said (it names the trainer
    that drives it)."""
    return f"{base_url}: {' '.join(message.split())}"


def on_trainer_conflict(
    refused: Container[str], agent_name: str, base_url: str, message: str
) -> AgentRefused:
    """A `trainer_conflict` answer from `agent_name` (at `base_url`), given the agents already refused:
    the agent is refused from now on, and reported the first time only (an agent refused before
    keeps the error it was reported with)."""
    return AgentRefused(agent_name, refusal_line(base_url, message), first=agent_name not in refused)


def driven(agents: Iterable[str], refused: Container[str]) -> list[str]:
    """The agents still driven: every agent but those that refused this trainer."""
    return [a for a in agents if a not in refused]
