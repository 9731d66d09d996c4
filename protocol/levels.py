"""Target levels: how much of an interrupted rollout recovery keeps, finest first.

    turn          a replacement try resumes the interrupted one's latest committed turn boundary (its
                  completed model calls are reused, not generated again)
    sibling       a replacement try starts over from the prompt; the group's other siblings are kept
    prompt_group  the whole group is rerun

A run chooses a level; each group runs at the finest level at or below it that its agent supports:
`turn` needs the agent's `/capabilities` to list `turn_continuation`, the other two need nothing.  The
level a group runs at, and the one asked for, are recorded in its `GroupReserved`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Final, Literal, get_args

from protocol.wire import FEATURE_TURN_CONTINUATION

TargetLevel = Literal["turn", "sibling", "prompt_group"]
# Finest first.
TARGET_LEVELS: Final[tuple[TargetLevel, ...]] = get_args(TargetLevel)
# What an agent must declare for a level (levels not named need nothing).
REQUIRED_FEATURE: Final[dict[TargetLevel, str]] = {"turn": FEATURE_TURN_CONTINUATION}


def effective_level(requested: TargetLevel, features: Collection[str]) -> TargetLevel:
    """The finest level at or below `requested` that an agent with `features` supports."""
    for level in TARGET_LEVELS[TARGET_LEVELS.index(requested) :]:
        needed = REQUIRED_FEATURE.get(level)
        if needed is None or needed in features:
            return level
    raise AssertionError("unreachable: the coarsest level needs no feature")


def parse_level(text: str) -> TargetLevel:
    """`text` as a target level, or ValueError naming the choices."""
    for level in TARGET_LEVELS:
        if text == level:
            return level
    raise ValueError(f"target level must be one of {', '.join(TARGET_LEVELS)}, got {text!r}")
