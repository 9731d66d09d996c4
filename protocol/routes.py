"""A MoE reply's router choices held as their JSON text, never as Python lists: `RoutesText`.

A real Gym agent's reply from a MoE model carries `routed_experts` on each model call's token item:
a list a token, of a list a MoE layer, of the k experts chosen.  At 8,000 generated tokens, one
layer and two experts, that is 16,000 small lists, and as Python lists they were most of what the
trainer spent on such a reply beyond the collector: their parse, the cyclic collector walking them
while the reply waits for its ACK (each list a container it tracks), freeing them, and every pass
that asks for their text writing it again.

The trainer reads a `/run` body's router choices as their text instead (`trainer.gym.reply_body`):
where the text is exactly what orjson writes of a regular `[tokens][layers][k]` array of integers
within int32 (no space, each integer in its one form), of `TYPED_FROM_TOKENS` tokens or more, it is
held as a `RoutesText`: that text, and the typed array the token records' form version 3 stores
(`protocol.token_codec.routes_array`: the one rule that decides both).  Every pass takes it for the
lists it stands for: canonical JSON writes its text (the bytes json writes of the lists), the nesting
check counts its three levels, the token records take its array, pydantic dumps it as the lists, and
it equals the lists it stands for.  Anything else (a ragged list, a float, a space) is parsed as
before.  numpy parses the numbers: without it (a participant's core install) none is made.

`loads_holding_routes` reads a JSON text so: each `"routed_experts":[[[` in it is found by a search
(in C); the value it opens runs to the first `]]]` after it, and where `routes_text` takes that text
(the exact text of a regular integer array, balanced) it is cut out, a mark put in its place, and
the rest parsed as any text is; each mark the parse put where the caller looks (`places`: a reply's
output items, a token header's records) is then that `RoutesText`.  A mark found anywhere else, or
not found, and the text is parsed whole as before: the values a reader gets are the text's JSON
either way.  Why a search is enough: in JSON a `"` that no odd run of backslashes escapes starts or
ends a string, and one that ends a string cannot be followed by a letter; so such a
`"routed_experts":` is an object's key and what follows it a value, which `routes_text` reads to its
end.  Cutting one value for another (a string) leaves valid JSON valid and invalid JSON invalid (a
cut inside a string, which the escape check leaves out anyway, would end the string at the mark).
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Final

import orjson
from pydantic_core import SchemaSerializer, core_schema

from protocol._numpy import np as _np

# Fewer tokens' choices stay JSON: their text is short, and the array's making (numpy's calls) would
# cost more than the parses it saves (a tiny rollout's few tokens).
TYPED_FROM_TOKENS: Final = 64
# The bytes of a text of lists of integers alone.
INTEGER_TEXT: Final = b"[],-0123456789"
_NUMPY: Final = orjson.OPT_SERIALIZE_NUMPY
# The bytes of a number in such a text: taken out, what is left is fixed by the shape (`_skeleton`).
_NUMBER_BYTES: Final = b"-0123456789"


class RoutesText:
    """Router choices (`routed_experts`) as their JSON text (`text`, canonical: what json writes of
    the lists too), their shape `[tokens, layers, k]` and their values as the little-endian array
    (`dtype`: `i2` where every value fits int16, else `i4`; `data`) the records' version 3 holds.
    Made only by `routes_text`, which checked the text against the array.  Immutable."""

    __slots__ = ("data", "dtype", "shape", "text")

    text: bytes
    shape: tuple[int, int, int]
    dtype: str
    data: bytes

    def __init__(self, text: bytes, shape: tuple[int, int, int], dtype: str, data: bytes) -> None:
        for name, value in (("text", text), ("shape", shape), ("dtype", dtype), ("data", data)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"RoutesText is immutable: cannot set {name}")

    def lists(self) -> list[Any]:
        """The lists the text stands for (a new copy each call)."""
        value: list[Any] = orjson.loads(self.text)
        return value

    def fragment(self) -> orjson.Fragment:
        """The text as orjson writes it into a larger value, as it is."""
        return orjson.Fragment(self.text)

    def __eq__(self, other: object) -> bool:
        if type(other) is RoutesText:
            return self.text == other.text
        if type(other) is list:
            return self.lists() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # the lists it stands for are not hashable either

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"RoutesText(shape={self.shape}, dtype={self.dtype!r}, {len(self.text)} bytes)"

    # pydantic writes it as the lists (`model_dump`, any mode): a `RunReply`'s `response` holding one
    # dumps as the reply the agent sent.
    __pydantic_serializer__ = SchemaSerializer(
        core_schema.any_schema(
            serialization=core_schema.plain_serializer_function_ser_schema(lambda value: value.lists())
        )
    )


def _skeleton(shape: tuple[int, int, int]) -> bytes:
    """The text of a `shape` array of integers with its numbers taken out (`[[[,]],[[,]]]`)."""
    tokens, layers, k = shape
    token = b"[" + b",".join([b"[" + b"," * (k - 1) + b"]"] * layers) + b"]"
    return b"[" + ((token + b",") * tokens)[:-1] + b"]"


def routes_text(text: bytes) -> RoutesText | None:
    """`text` (a JSON value's text) as a `RoutesText` where it is exactly orjson's text of a regular
    `[tokens][layers][k]` array of integers within int32, of `TYPED_FROM_TOKENS` tokens or more;
    else None.  The shape is read off the first token and the numbers parsed by numpy; then two
    comparisons, in C, are the proof: the text without its numbers is that shape's (`_skeleton`),
    and without its brackets it is the numbers as orjson writes them (no space, no `-0` or leading
    zero, no number missing, none past the range numpy read them in)."""
    if _np is None or text[:3] != b"[[[" or text.translate(None, INTEGER_TEXT):
        return None
    first_layer = text.find(b"]")
    first_token = text.find(b"]]")
    if first_layer < 0 or first_token < 0:
        return None
    k = text.count(b",", 3, first_layer) + 1
    layers = text.count(b"[", 2, first_token)
    numbers = text.translate(None, b"[]")
    try:
        with warnings.catch_warnings():
            # Text numpy cannot read to its end (`1,,2`, `1-2`): an error, or in older numpy a
            # warning and the numbers before it, which the checks below refuse.
            warnings.simplefilter("ignore")
            flat = _np.fromstring(numbers, dtype=_np.int64, sep=",")
    except ValueError:
        return None
    per_token = layers * k
    if per_token == 0 or flat.size % per_token or flat.size // per_token < TYPED_FROM_TOKENS:
        return None
    shape = (flat.size // per_token, layers, k)
    if text.translate(None, _NUMBER_BYTES) != _skeleton(shape):
        return None
    if orjson.dumps(flat, option=_NUMPY) != b"[" + numbers + b"]":
        return None
    low, high = int(flat.min()), int(flat.max())
    if low < -(2**31) or high >= 2**31:
        return None
    dtype = "i2" if low >= -(2**15) and high < 2**15 else "i4"
    return RoutesText(bytes(text), shape, dtype, flat.astype("<" + dtype).tobytes())


_KEY: Final = b'"routed_experts":'
_OPENS: Final = b"[[["
_CLOSES: Final = b"]]]"
# Below this many bytes router choices are too short to be held as text (`TYPED_FROM_TOKENS`
# tokens write at least 8 bytes each).
_TEXT_FROM_BYTES: Final = 8 * TYPED_FROM_TOKENS
# What stands in the text for a value cut out: a string no sender can guess (this process's own),
# the cut's number after it.
_MARK: Final = "\x00routes-" + secrets.token_hex(8) + "-"
_MARK_JSON: Final = orjson.dumps(_MARK)[:-1]  # without its closing quote: the number follows


def loads_holding_routes(
    text: bytes | bytearray | memoryview,
    loads: Callable[[bytes | bytearray | memoryview], Any],
    places: Callable[[Any], Iterable[Any]],
) -> Any:
    """`loads(text)`, but for each `routed_experts` of the dicts `places` gives of the value held as
    a `RoutesText` where its text allows (the module's docstring says how); raises what `loads`
    raises where it refuses `text`."""
    cuts = _routes_in(text) if memoryview(text).nbytes >= _TEXT_FROM_BYTES else []
    if not cuts:
        return loads(text)
    view = memoryview(text)
    pieces: list[bytes | memoryview] = []
    at = 0
    for number, (start, stop, _) in enumerate(cuts):
        pieces += [view[at:start], _MARK_JSON, str(number).encode(), b'"']
        at = stop
    pieces.append(view[at:])
    try:
        value = loads(b"".join(pieces))
    except ValueError:  # (orjson's and msgspec's refusals both are): parsed whole, for its own answer
        return loads(text)
    if _put_back(places(value), cuts) != len(cuts):
        return loads(text)  # a mark off the places looked at (or none): parsed whole
    return value


def _routes_in(text: bytes | bytearray | memoryview) -> list[tuple[int, int, RoutesText]]:
    """(start, stop, `RoutesText`) of each key's value that `routes_text` takes, in text order."""
    body = text.tobytes() if isinstance(text, memoryview) else text  # (searched: a view cannot be)
    cuts: list[tuple[int, int, RoutesText]] = []
    found = body.find(_KEY)
    while found >= 0:
        start = after = found + len(_KEY)
        stop = body.find(_CLOSES, start) + len(_CLOSES) if body.startswith(_OPENS, start) else -1
        if stop - start >= _TEXT_FROM_BYTES and _unescaped(body, found):
            routes = routes_text(bytes(body[start:stop]))
            if routes is not None:
                cuts.append((start, stop, routes))
                after = stop
        # (A value refused may end before the `]]]` found, which then belongs to a later key's value:
        # the search goes on from the value's start, not past that `]]]`.)
        found = body.find(_KEY, after)
    return cuts


def _unescaped(body: Any, quote: int) -> bool:
    """Whether the `"` at `quote` is no string's escaped quote: an even run of backslashes before it."""
    run = 0
    while quote - run > 0 and body[quote - run - 1] == 0x5C:
        run += 1
    return run % 2 == 0


def _put_back(places: Iterable[Any], cuts: list[tuple[int, int, RoutesText]]) -> int:
    """Puts each cut's `RoutesText` where the parse put its mark, in the dicts of `places`; how many
    (-1 for a mark no cut made)."""
    placed = 0
    for item in places:
        mark = item.get("routed_experts") if type(item) is dict else None
        if type(mark) is str and mark.startswith(_MARK):
            number = mark[len(_MARK) :]
            if not number.isdecimal() or int(number) >= len(cuts):
                return -1
            item["routed_experts"] = cuts[int(number)][2]
            placed += 1
    return placed


def fragment_of(value: Any) -> orjson.Fragment:
    """orjson's `default`: a `RoutesText` written as its text; any other type refused as orjson would."""
    if type(value) is RoutesText:
        return value.fragment()
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def lists_of(value: Any) -> Any:
    """json's `default`: a `RoutesText` written as its lists; any other type refused as json would."""
    if type(value) is RoutesText:
        return value.lists()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


__all__ = [
    "INTEGER_TEXT",
    "TYPED_FROM_TOKENS",
    "RoutesText",
    "fragment_of",
    "lists_of",
    "loads_holding_routes",
    "routes_text",
]
