"""Identifiers of the hand-off: the id grammar, a sibling's rollout id and a try's capture key.

A group `G` has siblings `G_g0 … G_gN-1`; each sibling's tries are numbered from 0, and a Gym agent
files try N of rollout R under the capture key `R` (N = 0) or `R-aN` (N > 0), the suffix the real
NeMo Gym uses for its own retries.
"""

from __future__ import annotations

import re
from typing import Annotated, Final

from pydantic import Field, StringConstraints

ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
ID_RE: Final = re.compile(ID_PATTERN)
MAX_ID_LENGTH: Final = 200
MAX_ATTEMPT_INDEX: Final = 1_000_000

Identifier = Annotated[str, StringConstraints(pattern=ID_PATTERN, min_length=1, max_length=MAX_ID_LENGTH)]
AttemptIndex = Annotated[int, Field(ge=0, le=MAX_ATTEMPT_INDEX)]

_SIBLING_SEPARATOR: Final = "_g"


def capture_key(rollout_id: str, attempt_index: int) -> str:
    """The key a Gym agent files a try under: the rollout id for try 0, `<id>-a<N>` after."""
    if not ID_RE.match(rollout_id) or attempt_index < 0:
        raise ValueError(f"invalid try ({rollout_id!r}, {attempt_index}); ids must match {ID_PATTERN}")
    return rollout_id if attempt_index == 0 else f"{rollout_id}-a{attempt_index}"


def rollout_id_of(group_id: str, generation_index: int) -> str:
    """A sibling's stable id: `<group_id>_g<generation_index>`."""
    return f"{group_id}{_SIBLING_SEPARATOR}{generation_index}"


def group_id_of(rollout_id: str) -> str:
    """The group of a rollout id, or "" when it is not of the form `<group_id>_g<index>`."""
    return rollout_id.rpartition(_SIBLING_SEPARATOR)[0]
