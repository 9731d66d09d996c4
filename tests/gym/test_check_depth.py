"""`check_depth`: the nesting cap on free-form JSON, at its exact boundary."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.wire import MAX_JSON_DEPTH, check_depth


def nested(levels: int) -> dict[str, Any]:
    """A dict whose containers (alternately dicts and lists) nest `levels` deep, the outer one included."""
    top: dict[str, Any] = {}
    inner: Any = top
    for level in range(2, levels + 1):
        child: Any = [] if level % 2 else {}
        if isinstance(inner, dict):
            inner["k"] = child
        else:
            inner.append(child)
        inner = child
    return top


def test_the_limit_itself_passes_and_one_more_level_is_refused() -> None:
    ok = nested(MAX_JSON_DEPTH)
    assert check_depth(ok) is ok
    with pytest.raises(ValueError, match=f"deeper than {MAX_JSON_DEPTH}"):
        check_depth(nested(MAX_JSON_DEPTH + 1))
    assert check_depth(nested(3), limit=3) is not None
    with pytest.raises(ValueError):
        check_depth(nested(4), limit=3)


def test_scalars_and_wide_lists_add_no_level() -> None:
    wide = {"ids": list(range(100_000)), "text": "x" * 1000, "none": None, "pairs": [[1, 2]] * 1000}
    assert check_depth(wide, limit=3) is wide
    with pytest.raises(ValueError):
        check_depth(wide, limit=2)  # the lists inside `pairs` are the third level
