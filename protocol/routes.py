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
"""

from __future__ import annotations

import warnings
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


__all__ = ["INTEGER_TEXT", "TYPED_FROM_TOKENS", "RoutesText", "fragment_of", "lists_of", "routes_text"]
