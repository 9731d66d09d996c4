"""Target levels (protocol/levels.py): the finest level at or below the one asked for that an agent
supports."""

from __future__ import annotations

import pytest

from eventstore.upcasting import upcast
from protocol.levels import TARGET_LEVELS, effective_level, parse_level
from protocol.wire import ALL_FEATURES, FEATURE_TURN_CONTINUATION


def test_turn_needs_the_agents_turn_continuation_feature() -> None:
    assert effective_level("turn", [*ALL_FEATURES, FEATURE_TURN_CONTINUATION]) == "turn"
    assert effective_level("turn", ALL_FEATURES) == "sibling"
    assert effective_level("turn", ()) == "sibling"  # a plain Gym agent (reduced mode) declares none


@pytest.mark.parametrize("level", ["sibling", "prompt_group"])
def test_the_coarser_levels_need_nothing_and_are_never_raised(level: str) -> None:
    requested = parse_level(level)
    assert effective_level(requested, ()) == requested
    assert effective_level(requested, [FEATURE_TURN_CONTINUATION]) == requested


def test_levels_are_finest_first_and_a_bad_name_is_refused() -> None:
    assert TARGET_LEVELS == ("turn", "sibling", "prompt_group")
    with pytest.raises(ValueError, match="turn, sibling, prompt_group"):
        parse_level("step")


def test_a_v2_reservation_asked_for_the_level_it_recorded() -> None:
    row = {"group_id": "g", "target_level": "turn"}
    assert upcast("GroupReserved", 2, 3, row)["requested_level"] == "turn"
