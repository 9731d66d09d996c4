"""orjson writes canonical JSON only where its bytes are the standard library's (protocol.digests)."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.digests import canonical_bytes

_STD = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(min_value=-1e-3, max_value=1e-3)  # the small numbers orjson writes otherwise
    | st.text()
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(st.text(max_size=8), inner, max_size=6)
        | st.dictionaries(st.integers(-5, 5), inner, max_size=3)
    ),
    max_leaves=40,
)


def _std(value: Any) -> bytes | type[BaseException]:
    try:
        return _STD.encode(value).encode()
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        return type(exc)


def _ours(value: Any) -> bytes | type[BaseException]:
    try:
        return canonical_bytes(value)
    except (ValueError, TypeError, UnicodeEncodeError) as exc:
        return type(exc)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # loaded machines
@given(values)
def test_the_same_bytes_or_the_same_refusal_as_the_standard_library(value: Any) -> None:
    assert _ours(value) == _std(value)


@pytest.mark.parametrize(
    "value",
    [1e-5, -1.2e-7, 6.186164884549407e-05, 1e16, 1e22, [float("nan")], {"a": [1.0, float("inf")]},
     [1e308, 1e308], 2**64, {1: "x"}, "e-5 in text", {"k": None, "v": -0.0}],
)  # fmt: skip
def test_the_forms_orjson_writes_differently_fall_back(value: Any) -> None:
    assert _ours(value) == _std(value)
    if isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
        assert _ours(value) is ValueError


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_a_value_orjson_parsed_is_written_the_same_without_the_nan_walk(value: Any) -> None:
    """`finite=True` is for what orjson.loads gave (it refuses NaN and infinity): the same bytes."""
    text = _std(value)
    if not isinstance(text, bytes):
        return
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:  # integers past 64 bits: orjson does not read them
        return
    assert canonical_bytes(parsed, finite=True) == _STD.encode(parsed).encode()


# A value whose text passes `_WALK_ABOVE`: its floats are found by walking it, not by searching it.
_PAD = "plain words " * 400


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_a_large_value_walked_for_its_floats_gives_the_same_bytes(value: Any) -> None:
    padded = {"pad": _PAD, "value": value}
    assert _ours(padded) == _std(padded)


@pytest.mark.parametrize(
    "value",
    [
        {"pad": _PAD, "x": 1e-5},  # found by the walk
        {"pad": _PAD, "x": [0.5] * 10 + [-6.186164884549407e-05]},
        {"pad": _PAD, "x": (1.0, 2.5e-7)},
        {"pad": [_PAD, [1.0] * 100_000, 3e-6]},  # a list past the walk's budget: the text is searched
        {"pad": _PAD, "x": _PAD + " 1e-5 in text"},  # text alone never falls back when walked
        {"pad": _PAD, "x": [0.5, float("nan")]},  # found by the walk, no search for null: refused
        {"pad": _PAD, "x": None, "y": float("inf")},
    ],
)
def test_large_values_with_small_floats_fall_back_to_the_standard_library(value: Any) -> None:
    assert _ours(value) == _std(value)


def test_the_walk_decides_small_floats_and_gives_up_past_its_budget() -> None:
    from protocol.digests import _small_floats

    assert _small_floats({"a": ["text" * 1000, 1, True, None, 0.5]}, 100) is False
    assert _small_floats({"a": [0.5, {"b": -1e-6}]}, 100) is True
    assert _small_floats([0.0, -0.0, 1e-4, 1e300], 100) is False
    assert _small_floats({"a": ["text" * 1000, float("nan")]}, 100) is True  # json refuses it
    assert _small_floats([2.0, float("-inf")], 100) is True
    assert _small_floats([1.0] * 200, 100) is None  # past the budget: the text decides
    assert _small_floats({"a": object()}, 100) is None  # a type orjson may write its own way
