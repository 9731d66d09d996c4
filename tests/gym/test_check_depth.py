"""`check_depth`: the nesting cap on free-form JSON, at its exact boundary."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.gym_reply import walked_check_depth
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


class _Count(int):
    """An int subclass: not one of the exact kinds settled in C."""


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-(2**2000), max_value=2**2000)  # past a float's range: the sum overflows
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(min_value=-1e308, max_value=1e308)  # large finite floats: their sum may overflow
    | st.text(max_size=3)
    | st.builds(_Count, st.integers(-5, 5))
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=3), _values, max_size=4), st.integers(1, 6), st.booleans())
def test_the_same_verdict_as_the_walk_of_every_item(value: dict[str, Any], limit: int, finite: bool) -> None:
    want = walked_check_depth(value, limit, finite)
    if want is None:
        assert check_depth(value, limit, finite=finite) is value
    else:
        with pytest.raises(ValueError) as got:
            check_depth(value, limit, finite=finite)
        assert str(got.value) == want


# Lists of lists of numbers (a MoE reply's `routed_experts`, a list per token) are settled by their
# text in orjson (`protocol.digests.numbers_alone`) and its nesting, not walked: now and then a None,
# a NaN, an infinity, an integer past 64 bits, a string or an empty object among them, at any depth.
_numbers = (
    st.integers(0, 255)
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
)
_odd: st.SearchStrategy[Any] = st.sampled_from([None, float("nan"), float("inf"), 2**64, "x", {}])
_nested_numbers: st.SearchStrategy[Any] = st.recursive(
    st.lists(_numbers | st.just([]), min_size=1, max_size=4),
    lambda inner: st.lists(inner, min_size=1, max_size=4),
    max_leaves=24,
)


def _sprinkled(value: Any, odd: Any, where: int) -> Any:
    """`value` with `odd` in place of its `where`-th leaf (counted depth first), if it has one."""
    seen = [0]

    def walk(v: Any) -> Any:
        if isinstance(v, list):
            return [walk(x) for x in v]
        seen[0] += 1
        return odd if seen[0] == where else v

    return walk(value)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _nested_numbers,
    st.lists(st.tuples(_odd, st.integers(1, 30)), max_size=2),
    st.integers(1, 8),
    st.booleans(),
)
def test_lists_of_lists_of_numbers_get_the_walks_verdict(
    lists: list[Any], odd: list[tuple[Any, int]], limit: int, finite: bool
) -> None:
    for value, where in odd:
        lists = _sprinkled(lists, value, where)
    value = {"routed_experts": [lists, lists], "nan": [[1.0], [float("nan")]] if finite else []}
    want = walked_check_depth(value, limit, finite)
    if want is None:
        assert check_depth(value, limit, finite=finite) is value
    else:
        with pytest.raises(ValueError) as got:
            check_depth(value, limit, finite=finite)
        assert str(got.value) == want


def test_a_reply_s_routed_experts_are_not_walked(monkeypatch: pytest.MonkeyPatch) -> None:
    """8,000 tokens' router choices, a list of lists per token: settled by one write of their text,
    with nothing of them on the walk's levels (it meets the reply's own few containers)."""
    routes = [[[i % 8, (i + 3) % 8], [i % 5, 7]] for i in range(8000)]
    value = {"output": [{"routed_experts": routes, "generation_log_probs": [-0.5] * 8000}]}
    looked_at: list[int] = []
    real = isinstance

    def counting(obj: Any, kinds: Any) -> bool:
        looked_at.append(1)
        return real(obj, kinds)

    monkeypatch.setattr("builtins.isinstance", counting)
    try:
        assert check_depth(value, limit=6, finite=True) is value
    finally:
        monkeypatch.setattr("builtins.isinstance", real)
    assert len(looked_at) < 50
    with pytest.raises(ValueError, match="deeper than 5"):
        check_depth(value, limit=5, finite=True)  # the pairs are the sixth level
