"""Stream names of the log: one prefix per kind of stream, written here and nowhere else."""

from __future__ import annotations

from typing import Final

GROUP_STREAM_PREFIX: Final = "group-"
CHECKPOINT_STREAM_PREFIX: Final = "checkpoint-"
LOGPROBS_STREAM_PREFIX: Final = "logprobs-"
# What an operator decided by hand about one agent's debts (`ledger debt drop`); never a trainer's stream.
OPERATOR_STREAM_PREFIX: Final = "operator-"
# Payload retention's record of what it deleted (`ledger payloads prune`); never a trainer's stream.
RETENTION_STREAM: Final = "retention"
# A trainer's own stream: its owner epochs and restores.  The unnamed trainer's is "trainer".
TRAINER_STREAM: Final = "trainer"


def group_stream(group_id: str) -> str:
    return f"{GROUP_STREAM_PREFIX}{group_id}"


def checkpoint_stream(checkpoint_id: str) -> str:
    return f"{CHECKPOINT_STREAM_PREFIX}{checkpoint_id}"


def logprobs_stream(group_id: str) -> str:
    return f"{LOGPROBS_STREAM_PREFIX}{group_id}"


def trainer_stream(trainer_id: str | None) -> str:
    return TRAINER_STREAM if trainer_id is None else f"{TRAINER_STREAM}-{trainer_id}"


def operator_stream(agent_name: str) -> str:
    return f"{OPERATOR_STREAM_PREFIX}{agent_name}"


def is_group_stream(stream_id: str) -> bool:
    return stream_id.startswith(GROUP_STREAM_PREFIX)


def group_of_stream(stream_id: str) -> str | None:
    """The group id of a group stream, None for any other stream."""
    return stream_id[len(GROUP_STREAM_PREFIX) :] if stream_id.startswith(GROUP_STREAM_PREFIX) else None
