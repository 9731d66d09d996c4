"""Identifiers of the hand-off: the id grammar, a sibling's rollout id and a try's capture key.

A group `G` has siblings `G_g0 … G_gN-1`; each sibling's tries are numbered from 0, and a Gym agent
files try N of rollout R under the capture key `R` (N = 0) or `R-aN` (N > 0), the suffix the real
NeMo Gym uses for its own retries.
"""

from __future__ import annotations

import re
import secrets
from typing import Annotated, Final

from pydantic import Field, Strict, StringConstraints

ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
ID_RE: Final = re.compile(ID_PATTERN)
MAX_ID_LENGTH: Final = 200
MAX_ATTEMPT_INDEX: Final = 1_000_000

# Strict: an id is a JSON string and an index a JSON integer, nothing coerced (`true`, `"0"` and `0.0`
# are refused, not read as 1 and 0).
Identifier = Annotated[
    str, StringConstraints(strict=True, pattern=ID_PATTERN, min_length=1, max_length=MAX_ID_LENGTH)
]
AttemptIndex = Annotated[int, Strict(), Field(ge=0, le=MAX_ATTEMPT_INDEX)]
# An agent process's execution generation (`participant.generation`): a JSON integer, 0 or more.
Generation = Annotated[int, Strict(), Field(ge=0)]

# An agent process's incarnation: a random id minted at every start (`participant.generation`).  Two
# answers come from the same process exactly when their incarnations are equal; incarnations are never
# ordered, so no clock (and no lost state directory) can make a later process look like an earlier one.
INCARNATION_PATTERN: Final = r"^[0-9a-f]{32}$"
INCARNATION_RE: Final = re.compile(INCARNATION_PATTERN)
Incarnation = Annotated[str, StringConstraints(strict=True, pattern=INCARNATION_PATTERN)]


def mint_incarnation() -> str:
    """A fresh incarnation: 128 random bits as 32 lower-case hex digits."""
    return secrets.token_hex(16)


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
