"""A `/run` body's JSON, its router choices held as their text (`protocol.routes.RoutesText`).

A MoE reply's `routed_experts` (a list a token of a list a layer of k experts: 16,000 small lists at
8,000 tokens) cost the trainer more as Python lists than all of the reply's other numbers together:
made by the parse, walked by the cyclic collector while the reply waits for its ACK, freed after it.
Here they are never made.  Each `"routed_experts":[[[` in the body is found by a search (in C); the
value it opens runs to the first `]]]` after it, and where `routes_text` takes that text (the exact
text of a regular integer array, balanced) it is cut out, a mark put in its place, and the rest
parsed as any body is; each mark the parse put on an output item's `routed_experts` is then that
`RoutesText`.  A mark found anywhere else, or not found, and the body is parsed whole as before: the
values a reader gets are the body's JSON either way.

Why a search is enough: in JSON a `"` that no odd run of backslashes escapes starts or ends a
string, and one that ends a string cannot be followed by a letter; so such a `"routed_experts":` is
an object's key and what follows it a value, which `routes_text`'s check reads to its end.  Cutting
one value for another (a string) leaves valid JSON valid and invalid JSON invalid.
"""

from __future__ import annotations

import secrets
from typing import Any, Final

import msgspec

from protocol.routes import TYPED_FROM_TOKENS, RoutesText, routes_text

_KEY: Final = b'"routed_experts":'
_OPENS: Final = b"[[["
_CLOSES: Final = b"]]]"
# Below this many bytes router choices are too short to be held as text (`TYPED_FROM_TOKENS`
# tokens write at least 8 bytes each).
_TEXT_FROM_BYTES: Final = 8 * TYPED_FROM_TOKENS
# What stands in the body for a text cut out: a string no agent can guess (this process's own), the
# cut's number after it.
_MARK: Final = "\x00routes-" + secrets.token_hex(8) + "-"


def decode_body(body: bytes | bytearray) -> Any:
    """The body's JSON, as `msgspec.json.decode(body)` gives it, but for router choices held as
    `RoutesText` where their text allows; raises `msgspec.DecodeError` where msgspec refuses the body."""
    cuts = _routes_in(body) if len(body) >= _TEXT_FROM_BYTES else []
    if not cuts:
        return msgspec.json.decode(body)
    view = memoryview(body)
    pieces: list[bytes | memoryview] = []
    at = 0
    for number, (start, stop, _) in enumerate(cuts):
        pieces += [view[at:start], msgspec.json.encode(f"{_MARK}{number}")]
        at = stop
    pieces.append(view[at:])
    try:
        value = msgspec.json.decode(b"".join(pieces))
    except msgspec.DecodeError:
        value = None  # (a cut that was no value: never made of valid JSON)
    if value is None or _put_back(value, cuts) != len(cuts):
        return msgspec.json.decode(body)  # a mark off an output item (or none): parsed whole
    return value


def _routes_in(body: bytes | bytearray) -> list[tuple[int, int, RoutesText]]:
    """(start, stop, `RoutesText`) of each key's value that `routes_text` takes, in body order."""
    cuts: list[tuple[int, int, RoutesText]] = []
    found = body.find(_KEY)
    while found >= 0:
        start = found + len(_KEY)
        stop = body.find(_CLOSES, start) + len(_CLOSES) if body.startswith(_OPENS, start) else -1
        if stop - start >= _TEXT_FROM_BYTES and _unescaped(body, found):
            routes = routes_text(bytes(body[start:stop]))
            if routes is not None:
                cuts.append((start, stop, routes))
        found = body.find(_KEY, max(start, stop))
    return cuts


def _unescaped(body: bytes | bytearray, quote: int) -> bool:
    """Whether the `"` at `quote` is no string's escaped quote: an even run of backslashes before it."""
    run = 0
    while quote - run > 0 and body[quote - run - 1] == 0x5C:
        run += 1
    return run % 2 == 0


def _put_back(value: Any, cuts: list[tuple[int, int, RoutesText]]) -> int:
    """Puts each cut's `RoutesText` where the parse put its mark on an output item; how many."""
    response = value.get("response") if type(value) is dict else None
    output = response.get("output") if type(response) is dict else None
    placed = 0
    for item in output if type(output) is list else ():
        mark = item.get("routed_experts") if type(item) is dict else None
        if type(mark) is str and mark.startswith(_MARK):
            number = mark[len(_MARK) :]
            if not number.isdigit() or int(number) >= len(cuts):
                return -1
            item["routed_experts"] = cuts[int(number)][2]
            placed += 1
    return placed


__all__ = ["decode_body"]
