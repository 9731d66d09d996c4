"""`check_depth`: the nesting cap on free-form JSON, at its exact boundary."""

from __future__ import annotations

from typing import Any

import orjson
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


def test_finite_takes_the_64_bit_integers_orjson_writes_and_refuses_one_past_them() -> None:
    edges = {"low": -(2**63), "high": 2**64 - 1, "deep": [[{"x": 2**63}]]}
    assert check_depth(edges, finite=True) is edges
    orjson.dumps(edges)  # what every reply and frame is written with takes them
    for past in (2**64, -(2**63) - 1, 10**30):
        row = {"params": [1, {"x": [past]}]}
        with pytest.raises(ValueError, match="outside the 64-bit range"):
            check_depth(row, finite=True)
        with pytest.raises(TypeError):
            orjson.dumps(row)  # why: the reply echoing it could not be written
        assert check_depth(row) is row  # without `finite` (a reply's shape) only depth is checked
