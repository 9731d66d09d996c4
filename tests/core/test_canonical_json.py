"""orjson writes canonical JSON only where its bytes are the standard library's (protocol.digests)."""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import digests
from protocol.digests import canonical_bytes, numbers_alone, same_json, written_once

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


# Where orjson's small floats are in its text is found two ways: by numpy in a text of more than
# `_SITES_IN_NUMPY_ABOVE` bytes, by the searches in bytes in a shorter one or without numpy (a
# participant's core install).  The tests of the forms run each way on values of every size.
_WAYS = ["numpy", "bytes"]


@contextlib.contextmanager
def _found_by(way: str) -> Iterator[None]:
    if way == "numpy":
        with mock.patch.object(digests, "_SITES_IN_NUMPY_ABOVE", 0):
            yield
    else:
        with mock.patch.object(digests, "_np", None):
            yield


@pytest.mark.parametrize("way", _WAYS)
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # loaded machines
@given(value=values)
def test_the_same_bytes_or_the_same_refusal_as_the_standard_library(way: str, value: Any) -> None:
    with _found_by(way):
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


@pytest.mark.parametrize("way", _WAYS)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=values)
def test_a_large_value_walked_for_its_floats_gives_the_same_bytes(way: str, value: Any) -> None:
    padded = {"pad": _PAD, "value": value}
    with _found_by(way):
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


# --- same_json: the bytes' equality, without the bytes ---------------------------------------------

# Values canonical JSON writes (no NaN, infinity or lone surrogate), with the near misses same_json
# must tell apart: booleans, integers and floats of one value, signed zeros, equal floats.
_near_scalars = (
    st.none()
    | st.booleans()
    | st.sampled_from([0, 1, -1, 0.0, -0.0, 1.0, -1.0, 2**64, float(2**64), 1e-5, 1e16, 10**16])
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8"), max_size=6)  # no lone surrogate
    | st.sampled_from(["", "1", "true", "null", "1.0"])
)
json_values = st.recursive(
    _near_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.sampled_from(["a", "b", "1", ""]) | st.text(max_size=3), inner, max_size=4)
        | st.dictionaries(st.sampled_from([1, -1, 0, True, None, 1.0, -0.0]), inner, max_size=2)
    ),
    max_leaves=16,
)


def _nudged(value: Any, data: st.DataObject) -> Any:
    """`value` with at most one small change somewhere (a type, a sign, an order, a key): pairs that are
    the same or nearly so, where an independent draw would almost always differ in its first byte."""
    kind = type(value)
    if kind is dict:
        items = list(value.items())
        data.draw(st.randoms()).shuffle(items)  # key order never matters
        change: bool = data.draw(st.booleans())
        if items and change:
            i = data.draw(st.integers(0, len(items) - 1))
            items[i] = (items[i][0], _nudged(items[i][1], data))
        elif items and data.draw(st.booleans()) is True:
            items.pop()
        return dict(items)
    if kind is list or kind is tuple:
        out = list(value)
        change = data.draw(st.booleans())
        if out and change:
            i = data.draw(st.integers(0, len(out) - 1))
            out[i] = _nudged(out[i], data)
        return tuple(out) if data.draw(st.booleans()) else out
    choices: list[Any] = []
    if kind is bool:
        choices = [int(value), float(value)]
    elif kind is int:
        choices = [float(value), bool(value), str(value)] if abs(value) < 2**53 else [str(value)]
    elif kind is float:
        choices = [-value, int(value) if value.is_integer() and abs(value) < 2**64 else value]
    elif kind is str:
        choices = [value + "x", "".join(value), None]
    elif value is None:
        choices = [False, 0, "null"]
    if not choices or not data.draw(st.booleans()):
        return value
    return data.draw(st.sampled_from(choices))


def _bytes_same(a: Any, b: Any) -> bool | type[BaseException]:
    try:
        return canonical_bytes(a) == canonical_bytes(b)
    except (ValueError, TypeError) as exc:  # a dict of mixed keys json cannot sort
        return type(exc)


def _same(a: Any, b: Any) -> bool | type[BaseException]:
    try:
        return same_json(a, b)
    except (ValueError, TypeError) as exc:
        return type(exc)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values, st.data())
def test_same_json_is_the_canonical_bytes_equality_on_near_pairs(value: Any, data: st.DataObject) -> None:
    other = _nudged(value, data)
    expected = _bytes_same(value, other)
    if expected is True or expected is False:
        assert same_json(value, other) is expected
        assert same_json(other, value) is expected
    else:  # the bytes are refused: same_json may refuse too, or answer from the part it compared
        assert _same(value, other) in (expected, True, False)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values, json_values)
def test_same_json_is_the_canonical_bytes_equality_on_any_pair(a: Any, b: Any) -> None:
    expected = _bytes_same(a, b)
    if expected is True or expected is False:
        assert same_json(a, b) is expected


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [(True, 1, False), (1, 1.0, False), (0.0, -0.0, False), (0, False, False), (None, "null", False),
     ([1, 2], (1, 2), True), ({"a": 1, "b": [2.5]}, {"b": [2.5], "a": 1}, True), ({1: "x"}, {"1": "x"}, True),
     ({True: 1}, {"true": 1}, True), ({1: "x"}, {1.0: "x"}, False), ({0: 1}, {False: 1}, False),
     ({"a": {"b": [True]}}, {"a": {"b": [1]}}, False), (2**70, 2**70, True), ({"a": 1}, {"a": 1, "b": 2}, False),
     ({"a": 1}, {"b": 1}, False), ("é", "é", True), ([], {}, False)],
)  # fmt: skip
def test_same_json_tells_apart_what_the_bytes_tell_apart(a: Any, b: Any, same: bool) -> None:
    assert same_json(a, b) is same
    assert (canonical_bytes(a) == canonical_bytes(b)) is same


def test_same_json_walks_deep_values_without_recursion() -> None:
    deep: Any = 1
    for _ in range(50_000):
        deep = [deep]
    assert same_json(deep, deep)


# Small floats, the forms orjson writes otherwise, at every decade and beside text that looks like them:
# written as orjson's text with the forms rewritten (`_json_float_forms`), or by json where text could
# hold what a rewrite matches.
_DECADES = [m * 10.0**-k for k in range(3, 12) for m in (1.0, 1.5, 9.87654321, -2.0)]


@pytest.mark.parametrize(
    "value",
    [
        {"lp": _DECADES, "ids": [0, 7, 151935]},
        {"lp": [-1.234e-05, -1e-05, 10.00001, 100.000015, 1e-05, -0.0, 0.0, 0.0001, 5e-324]},
        [1e-5],
        1.5e-7,
        {"a": {"b": [{"c": -3.2e-05, "d": "text"}], "e": 6.5e-09}},
        {"t": "\x1e-7", "x": 1e-5},  # json writes `\u001e-7`: an exponent's text once written
        {"t": "\x0e-8", "x": [1e-7]},
        {"\x1e-6": 1e-6},
        {"t": "0.00001 in text", "x": 1e-5},
        {"t": "re-7th", "x": 1.5e-7},
        {"t": "e-10 and e-5", "x": [2.5e-7, 1e-12]},
        {"k": ["x\x1e", "-7", 1e-7]},
        {"k": ["x\x1e", "-7"], "v": 1e-7},
        {"k": [1e-6, float("inf")]},
        {"k": [1e-6, 2**70]},
        {"k": [1e-6, 1e308, 1e308]},  # a sum that overflows: json decides, the same bytes
    ],
)
@pytest.mark.parametrize("way", _WAYS)
def test_small_floats_are_written_in_json_form(way: str, value: Any) -> None:
    with _found_by(way):
        assert _ours(value) == _std(value)


@pytest.mark.parametrize("way", _WAYS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lps=st.lists(st.floats(width=32, min_value=-0.0010000000474974513, max_value=0.0), max_size=50),
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=20),
    text=st.text(max_size=20),
)
def test_a_model_calls_logprobs_are_written_as_json_writes_them(
    way: str, lps: list[float], ids: list[int], text: str
) -> None:
    item = {"generation_log_probs": lps, "generation_token_ids": ids, "text": text}
    with _found_by(way):
        assert _ours({"output": [item], "pad": _PAD}) == _std({"output": [item], "pad": _PAD})


@pytest.mark.parametrize("way", _WAYS)
@pytest.mark.parametrize("confident", [0.0, 0.3, 1.0])
def test_a_reply_with_small_logprobs_is_written_without_the_standard_library(
    monkeypatch: pytest.MonkeyPatch, way: str, confident: float
) -> None:
    """The point of the rewrite: a model's logprobs (many below 1e-4) no longer send the whole reply
    to json's encoder, which writes each float32's 17 digits at about 1 us.  A reply of real size
    (4,000 float32 logprobs, a share `confident` of them near certainty, ids and text beside them),
    its forms found by numpy (its text is past the threshold) or by the searches in bytes."""
    rng = random.Random(7)
    lps = [
        float(
            np.float32(
                -(10.0 ** rng.uniform(-9.0, -4.0)) if rng.random() < confident else -rng.expovariate(2)
            )
        )
        for _ in range(4000)
    ]
    reply = {
        "response": {
            "output": [
                {
                    "generation_log_probs": lps,
                    "generation_token_ids": [rng.randrange(151936) for _ in range(4000)],
                    "text": "plain words\n" * 50,
                }
            ]
        },
        "reward": 1.0,
    }
    want = _STD.encode(reply).encode()
    assert len(want) > digests._SITES_IN_NUMPY_ABOVE

    class Refuses:
        def encode(self, value: Any) -> str:
            raise AssertionError("the standard library's encoder was used")

    monkeypatch.setattr("protocol.digests._CANONICAL", Refuses())
    with _found_by(way):
        assert canonical_bytes(reply) == want
        if way == "numpy":
            sites = digests._sites(orjson.dumps(reply, option=orjson.OPT_SORT_KEYS))
            assert sites is not None and (confident == 0.0 or len(sites[0]) + len(sites[1]) > 100)


def test_canonical_json_needs_no_numpy() -> None:
    """A participant's core install has no numpy: the module imports without it and writes the same
    bytes by the searches in bytes, and the lineage widens u4 ids by byte slices to the same digest
    (a fresh interpreter, numpy's import refused)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import json; from protocol import digests\n"
        "assert digests._np is None\n"
        "v = {'lp': [-1.5e-7, -2.5e-05, -0.25] * 3000, 't': 'x' * 20000}\n"
        "std = json.dumps(v, sort_keys=True, separators=(',', ':'), ensure_ascii=False).encode()\n"
        "assert digests.canonical_bytes(v) == std\n"
        "import struct; from protocol import lineage\n"
        "assert lineage._np is None\n"
        "ids = [0, 1, 2**32 - 1, 151935] * 50\n"
        "packed = struct.pack(f'<{len(ids)}I', *ids)\n"
        "assert lineage.u4_token_digest(len(ids), packed) == lineage.token_digest(ids)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_text_is_searched_only_where_the_walk_cannot_tell_and_then_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large value the walk of its values settles (a reply of text, or one small float found) has
    its text searched for the forms only to mend it; one past the walk's budget (a long list of
    numbers) is searched once, for the verdict and the mend both."""
    searched: list[int] = []
    real = digests._sites

    def counted(out: bytes) -> digests.Sites | None:
        searched.append(len(out))
        return real(out)

    monkeypatch.setattr(digests, "_sites", counted)
    text = {"output": [{"type": "output_text", "text": "plain words " * 5000}], "reward": 1.0}
    cases: list[tuple[dict[str, Any], int]] = [
        (text, 0),  # settled by the walk: nothing to mend
        ({**text, "x": -1.5e-7}, 1),  # settled by the walk, then searched to mend
        ({"lp": [-0.5] * 50_000 + [-2.5e-5, -1e-7]}, 1),  # past the budget: one search for both
    ]
    for value, searches in cases:
        searched.clear()
        assert canonical_bytes(value) == _STD.encode(value).encode()
        assert len(searched) == searches, sorted(value)


# Lists of lists of numbers (a MoE reply's `routed_experts`) are settled by their text in orjson
# where the other lists are summed: small floats, NaN, None, integers past 64 bits, strings that
# look like orjson's forms, at any depth among them.
_inner_numbers = (
    st.integers(0, 255)
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(min_value=-1e-3, max_value=1e-3)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.sampled_from([None, "1e-7", "0.00001", "x"])
)
_lists_of_lists = st.recursive(
    st.lists(_inner_numbers, min_size=1, max_size=4),
    lambda inner: st.lists(inner, min_size=1, max_size=4) | st.tuples(inner, inner),
    max_leaves=20,
).filter(lambda v: isinstance(v, list | tuple) and isinstance(v[0], list | tuple))


@pytest.mark.parametrize("way", _WAYS)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routes=_lists_of_lists, small=st.booleans())
def test_lists_of_lists_of_numbers_are_written_as_json_writes_them(
    way: str, routes: Any, small: bool
) -> None:
    value = {"routed_experts": routes, "lp": [-2.5e-5 if small else -0.5, -0.25], "pad": _PAD}
    with _found_by(way):
        assert _ours(value) == _std(value)
        assert _ours({"routed_experts": routes}) == _std({"routed_experts": routes})


def test_a_reply_s_routed_experts_are_settled_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """8,000 tokens' router choices beside logprobs near certainty: json's bytes, with no Python step
    per token (the walks meet each list of lists once: `numbers_alone`, one write in C)."""
    rng = random.Random(3)
    routes = [[[rng.randrange(64), rng.randrange(64)]] for _ in range(8000)]
    lps = [float(np.float32(-(10.0 ** rng.uniform(-9, -4)))) for _ in range(8000)]
    reply = {"response": {"output": [{"routed_experts": routes, "generation_log_probs": lps}]}, "r": None}
    settled: list[int] = []
    real = digests.numbers_alone

    def counted(items: Any) -> bytes | None:
        settled.append(len(items))
        return real(items)

    monkeypatch.setattr(digests, "numbers_alone", counted)
    assert canonical_bytes(reply) == _STD.encode(reply).encode()
    assert settled and set(settled) == {8000}


def test_within_written_once_each_long_list_is_written_once() -> None:
    """One reply taken in: its nesting check, its canonical JSON and its records' header share each
    list of lists' text; outside, and for short lists, each call writes its own."""
    routes = [[[t % 64, (t + 3) % 64]] for t in range(100)]
    short = [[1, 2]]
    assert numbers_alone(routes) is not numbers_alone(routes)  # no scope: written each time
    with written_once():
        first = numbers_alone(routes)
        assert first == orjson.dumps(routes) and numbers_alone(routes) is first
        assert numbers_alone([*routes]) is not first  # an equal list is another list
        assert numbers_alone(short) is not numbers_alone(short)
        refused = [[[1, None]]] * 100
        assert numbers_alone(refused) is None and numbers_alone(refused) is None
        with written_once():  # a scope of its own remembers nothing of the outer one
            assert numbers_alone(routes) is not first
        assert numbers_alone(routes) is first
    assert numbers_alone(routes) is not first
