"""How a try's reply is stored: whole, or apart from the token arrays its token records hold.

A real Gym agent's `/run` reply carries each model call's token arrays on one of its output items
(`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`, `routed_experts`: the real Gym's
`...ForTraining` items), and the try's token records hold the same arrays in the binary form.  Stored
whole, the reply keeps them a second time as JSON text, three times their binary size: a 9k-token
rollout's reply was 290 KB of which 200 KB were its arrays.

The trainer stores the records beside the reply (`protocol.token_codec`, form version 2, or 3 with
the router choices typed): each
record refers to its run of the reply's output items, its token item at `token_item_index` in it.
Where every such item's arrays are, in canonical JSON, its record's, the reply is stored without
them (`REPLY_APART_MEDIA_TYPE`: the canonical JSON of what `take_arrays_off` gives) and
`put_arrays_back` makes it whole again from the records: the reply the agent sent, value for value,
whose canonical JSON has the digest its receipt names (`ledger audit` checks that).  Where any item's
arrays are not its record's (an integer where the record holds a float, a boolean where it holds an
id), the reply is stored whole: nothing the agent sent is lost either way.

The trainer has the reply's canonical JSON without writing it where the participant's completion
frame carried it (bytes that hash to the receipt's digest); `take_arrays_off` compares each item's
arrays with its record's in orjson's text of both (equal text is equal JSON, types included).

Both directions read the mapping from the same stored records (`_token_items`), so the items
written apart and the items made whole are one rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import is_
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import orjson

from payloads.token_arrays import TokenArrays
from protocol.digests import canonical_bytes
from protocol.routes import fragment_of
from protocol.token_codec import (
    ARRAY_FIELDS,
    REFERRING_MEDIA_TYPES,
    ROUTES_FIELD,
    TokenCodecError,
    TokenLayout,
    read_layout,
    reply_output_of,
)

# The reply whole: its canonical JSON, of the digest its receipt names.
REPLY_MEDIA_TYPE: Final = "application/json"
# The reply apart from its records' arrays (`take_arrays_off`): its own digest; made whole, the receipt's.
REPLY_APART_MEDIA_TYPE: Final = "application/vnd.rollout-ledger.reply-apart+json"
_NUMPY: Final = orjson.OPT_SERIALIZE_NUMPY


def _token_items(arrays: TokenArrays) -> Iterator[tuple[int, int]]:
    """(record, index of its token item in the reply's output) for every record of a version 2
    payload that refers to its reply's items and names its token item in that run."""
    layout = arrays.layout
    for r, ref in enumerate(layout.reply_items):
        if ref is None:
            continue
        start, stop = ref
        k = layout.records[r].get("token_item_index")
        if type(k) is int and 0 <= k < stop - start:
            yield r, start + k


def _carries_arrays(output: list[Any]) -> bool:
    """Whether any output item carries a token array (the reference agent's replies carry none: their
    records travel apart, and nothing more is read for them)."""
    return any(isinstance(item, dict) and not item.keys().isdisjoint(ARRAY_FIELDS) for item in output)


def _json_ready(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """An array orjson writes as the Python numbers it holds: float32 values as the float64 each
    exactly is (orjson writes a float32 array with float32's shortest digits, not float64's)."""
    return values.astype(np.float64) if values.dtype.kind == "f" else values


def _record_arrays(arrays: TokenArrays, record: int) -> dict[str, Any]:
    """The arrays a record holds, as its reply's token item carried them: the three binary arrays,
    and `routed_experts` when the record has it (an integer array in version 3, which orjson writes
    as the lists it was read from)."""
    held: dict[str, Any] = {}
    for name in ARRAY_FIELDS:
        # The logprobs the array was just packed from (`ArraySpan.source`): a reply holding their very
        # floats is compared by identity, not by writing both (integer lists write faster than that).
        source = arrays.layout.span(record, name).source if name == "generation_log_probs" else None
        held[name] = source if source is not None else _json_ready(arrays.array(record, name))
    span = arrays.layout.route(record)
    # The lists an array was just made from write its JSON (`RouteSpan.source`): a reply holding
    # that very list is compared by identity, not by writing both.
    routes = span.source if span is not None and span.source is not None else arrays.routes(record)
    if routes is not None:
        held[ROUTES_FIELD] = routes
    return held


def _same_text(given: Any, held: Any) -> bool:
    """Whether `given` (a value of the reply, as parsed) writes the same JSON text as `held` (the
    record's): equal text is equal canonical JSON (both finite: the reply's canonical JSON was
    written), and an integer where the record holds a float, or a boolean, writes other text."""
    if given is held:  # the record's own value, shared with the reply it was read from (reduced mode)
        return True
    if type(given) is list and type(held) is list and len(given) == len(held) and all(map(is_, given, held)):
        return True  # the very numbers the record's list holds: a list read off this reply (reduced mode)
    options = orjson.OPT_SORT_KEYS | _NUMPY
    try:
        # (Router choices held as their text, `RoutesText`, write that text.)
        return orjson.dumps(given, default=fragment_of, option=options) == orjson.dumps(
            held, default=fragment_of, option=options
        )
    except orjson.JSONEncodeError:  # an integer past 64 bits: not what the record holds
        return False


def _with_output(reply: dict[str, Any], output: list[Any]) -> dict[str, Any]:
    return {**reply, "response": {**reply["response"], "output": output}}


def take_arrays_off(
    reply: dict[str, Any], tokens: bytes | memoryview, layout: TokenLayout | None = None
) -> dict[str, Any] | None:
    """`reply` (a `/run` reply's payload) without the arrays of each output item its records (`tokens`,
    a version 2 payload beside it) refer to as their token item; None when there is none, or when any
    such item's arrays are not its record's (then the reply is stored whole).  New dicts where arrays
    are taken off; `reply` unchanged.  `layout`: `tokens`' own, where its writer has it
    (`protocol.token_codec.referred`), so its header is not read again."""
    output = reply_output_of(reply)
    if not _carries_arrays(output):
        return None
    arrays = TokenArrays(layout or read_layout(tokens, check_canonical=False), tokens)
    apart = list(output)
    taken = False
    for record, index in _token_items(arrays):
        item = output[index] if index < len(output) else None
        if not isinstance(item, dict):
            return None
        held = _record_arrays(arrays, record)
        if not all(name in item and _same_text(item[name], value) for name, value in held.items()):
            return None
        apart[index] = {k: v for k, v in item.items() if k not in held}
        taken = True
    return _with_output(reply, apart) if taken else None


def reply_to_store(
    reply: dict[str, Any],
    reply_bytes: bytes,
    tokens: bytes | None,
    tokens_media_type: str | None,
    layout: TokenLayout | None = None,
) -> tuple[bytes, str]:
    """The bytes the trainer stores for a try's reply and their media type: apart from its records'
    arrays where its records (`tokens`, as stored beside it; `layout`, their layout where the caller
    has it) refer to it and hold every array its items carry, else `reply_bytes` (its canonical
    JSON) whole."""
    apart = None
    if tokens is not None and tokens_media_type in REFERRING_MEDIA_TYPES:
        apart = take_arrays_off(reply, tokens, layout)
    if apart is not None:
        # `apart` is part of the reply whose canonical JSON `reply_bytes` is: nothing in it that
        # JSON cannot carry, so the walk that looks for NaN is left out.
        return canonical_bytes(apart, finite=True), REPLY_APART_MEDIA_TYPE
    return reply_bytes, REPLY_MEDIA_TYPE


def put_arrays_back(
    apart: dict[str, Any], tokens: bytes | bytearray | memoryview | TokenArrays
) -> dict[str, Any]:
    """The reply as its agent sent it, from the reply stored apart and its try's token records (their
    stored bytes, or a `SealedGroup`'s `TokenArrays` of them), the arrays as Python lists: for an
    auditor, or a user who hands the Gym's reply itself on; training reads the arrays from the records."""
    content = tokens.buffer if isinstance(tokens, TokenArrays) else tokens
    arrays = TokenArrays(read_layout(content, check_canonical=False), content)
    output = list(reply_output_of(apart))
    items = list(_token_items(arrays))
    if not items:
        return apart
    for record, index in items:
        if index >= len(output) or not isinstance(output[index], dict):
            raise TokenCodecError(
                f"record {record} puts its arrays on output item {index} of a reply that has no such "
                "item (not the reply these records were stored beside)"
            )
        held = _record_arrays(arrays, record)
        output[index] = {
            **output[index],
            **{name: v.tolist() if isinstance(v, np.ndarray) else v for name, v in held.items()},
        }
    return _with_output(apart, output)


__all__ = [
    "REPLY_APART_MEDIA_TYPE",
    "REPLY_MEDIA_TYPE",
    "put_arrays_back",
    "reply_to_store",
    "take_arrays_off",
]
