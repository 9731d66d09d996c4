"""`participant.replies.read_reply_body`: the agent's own `/run` body read as pydantic's parser reads it
(the values and their types), by orjson where both read it alike; what orjson reads otherwise or
refuses (NaN, Infinity, 1e999, integers past 64 bits) is pydantic's parser's to read."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import from_json

from participant.replies import read_reply_body


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (1 and 1.0 differ; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


NUMBERS = (
    st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-(2**64), max_value=2**64).map(lambda n: n * 10**5 + 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.floats(min_value=-1e-3, max_value=1e-3)
)
JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | st.text(alphabet=st.characters(codec="utf-8"), max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(JSON)
def test_a_body_reads_as_pydantics_parser_reads_it(value: Any) -> None:
    # Python's json writes what a wrapped agent may answer: NaN, Infinity, integers of any size.
    raw = json.dumps({"response": {"output": [value]}, "reward": 1.0}).encode()
    assert same(read_reply_body(raw), from_json(raw))


@pytest.mark.parametrize(
    "raw",
    [
        b'{"seed": 1180591620717411303424}',  # orjson would read a float
        b'{"seed": -9223372036854775809}',
        b'{"x": [NaN]}',  # orjson refuses these three
        b'{"x": Infinity}',
        b'{"x": 1e999}',
        b'{"x": 18446744073709551615, "y": -9223372036854775808, "z": 1.5e300}',
        b'{"ids": [1, 2, 3], "text": "12345678901234567890 in a string"}',
    ],
)
def test_the_numbers_orjson_reads_otherwise_are_pydantics(raw: bytes) -> None:
    assert same(read_reply_body(raw), from_json(raw))


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b'{"a": 1} trailing', b'"\xff"'])
def test_a_body_that_is_no_json_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        read_reply_body(raw)
