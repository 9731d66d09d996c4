"""Canonical JSON and the `sha256:<hex>` digests every side of the hand-off compares.

Canonical JSON is the standard library's `json` with sorted keys, no insignificant whitespace, UTF-8
text (not ASCII escapes) and no NaN or infinity: those are the bytes every digest is taken of, on
every side and in every version.  `canonical_bytes` writes them with orjson (20x faster on large
replies) and falls back to the standard library wherever orjson's text could differ: orjson writes
floats below 1e-4 in another form (`1e-5` and `0.00001` where `json` writes `1e-05`), writes NaN and
infinity as `null` where `json` refuses them, and refuses keys that are not strings and integers past
64 bits, which `json` writes.  A property test holds the two to the same bytes
(tests/core/test_canonical_json.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Any, Final

import orjson
from pydantic import StringConstraints

DIGEST_PREFIX: Final = "sha256:"
DIGEST_PATTERN: Final = r"^sha256:[0-9a-f]{64}$"
Digest = Annotated[str, StringConstraints(pattern=DIGEST_PATTERN)]


# One encoder for every call: `json.dumps` with options builds a new one each time (1 us of 3.3 for a
# small dict; the store renders an append's metadata with it).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_ORJSON_OPTIONS: Final = orjson.OPT_SORT_KEYS
_DIGITS: Final = frozenset(b"0123456789")


def _float_form_in_text(out: bytes) -> bool:
    """Whether `out` holds text where orjson's floats can differ from json's: a one-digit negative
    exponent (`1e-5`, `1.2e-7`; json writes `e-05`) or a fixed-point small number (`0.00001`).  Found
    anywhere, even inside a string, json writes instead.  Searched with `bytes.find` (C), never a regex
    (a regex over a 100 KB reply cost more than the encoding)."""
    if b"0.0000" in out:
        return True
    i = out.find(b"e-")
    while i >= 0:
        if (
            i > 0
            and out[i - 1] in _DIGITS
            and i + 2 < len(out)
            and out[i + 2] in _DIGITS
            and (i + 3 >= len(out) or out[i + 3] not in _DIGITS)
        ):
            return True
        i = out.find(b"e-", i + 2)
    return False


# Below this many bytes the text is searched (a few us); above it the value is walked first.
_WALK_ABOVE: Final = 4096
# Bytes of text one node of the walk may stand for: the search costs ~2.5 ns a byte, a node ~0.1 us.
_BYTES_PER_NODE: Final = 64


def _small_floats(value: Any, budget: int) -> bool | None:
    """Whether `value` holds a float that orjson writes in another form than json: 0 < |x| < 1e-4
    (`1e-5` as `0.00001`, `1.5e-7` as `1.5e-7` for json's `1.5e-07`), or NaN or an infinity (orjson
    writes `null`, json refuses them); walking at most `budget` nodes; None (undecided) past the
    budget or at a type this walk does not know.  Strings cost nothing here however long, which is
    what makes a large reply's check cheap: the searches of the text (`_float_form_in_text`, and
    `null` for a NaN) read every byte of them."""
    stack = [value]
    while stack:
        budget -= 1
        if budget < 0:
            return None
        item = stack.pop()
        kind = type(item)
        if kind is str or kind is int or kind is bool or item is None:
            continue
        if kind is dict:
            stack.extend(item.values())  # keys: orjson refuses any but str (json's fallback)
        elif kind is list or kind is tuple:
            if len(item) > budget:
                return None
            stack.extend(item)
        elif kind is float:
            if 0.0 < abs(item) < 1e-4 or not math.isfinite(item):
                return True
        else:  # a float or str subclass, a dataclass, ...: the text decides
            return None
    return False


def _json_writes_otherwise(out: bytes, value: Any, finite: bool) -> bool:
    """Whether orjson's text `out` of `value` may differ from json's (a small float, NaN or an
    infinity): decided by walking `value` (its strings skipped) when `out` is large and the walk is
    short, else by searching `out` (`_float_form_in_text`, then `null` for a NaN, which `_all_finite`
    settles; `finite`: the caller knows there is none).  Either way a True only costs the json
    encoding."""
    if len(out) > _WALK_ABOVE:
        verdict = _small_floats(value, len(out) // _BYTES_PER_NODE)
        if verdict is not None:
            return verdict
    return _float_form_in_text(out) or (not finite and b"null" in out and not _all_finite(value))


_NUMBERS: Final = (float, int)


def _all_finite(value: Any) -> bool:
    """No NaN or infinity anywhere in `value` (orjson writes them as `null`; json refuses them)."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is float:
            if not math.isfinite(item):
                return False
        elif kind is dict:
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            if item and type(item[0]) in _NUMBERS:
                try:  # a list of numbers is summed in C: a NaN or infinity shows in the total
                    total = sum(item, 0.0)
                    if math.isfinite(total):
                        continue
                except (TypeError, OverflowError):
                    pass
            # Any other list is walked: summing it would raise, and a raise costs 1 us (a token
            # header's few `[dtype, count]` lists cost 6.5 us that way, for 0.6 us of encoding).
            stack.extend(item)
        elif isinstance(item, float) and not math.isfinite(item):
            return False
    return True


def canonical_bytes(value: Any, *, finite: bool = False) -> bytes:
    """Canonical JSON as UTF-8 bytes: exactly `canonical_json(value).encode()`, faster.  `finite`:
    the caller knows `value` holds no NaN or infinity (orjson.loads gave it: it refuses both), so
    the walk that looks for them is left out."""
    try:
        out = orjson.dumps(value, option=_ORJSON_OPTIONS)
    except (TypeError, orjson.JSONEncodeError):
        return _CANONICAL.encode(value).encode()  # json's own answer: its text, or its error
    if _json_writes_otherwise(out, value, finite):
        return _CANONICAL.encode(value).encode()
    return out


# The JSON types `same_json` compares itself; a pair holding any other (a str or int subclass, an
# enum, a dataclass) is compared by its canonical bytes.
_JSON_KINDS: Final = frozenset({dict, list, tuple, str, int, bool, float, type(None)})


def same_json(a: Any, b: Any) -> bool:
    """`canonical_bytes(a) == canonical_bytes(b)` without writing either, for any values canonical JSON
    writes (no NaN or infinity): equal JSON values of equal types, compared in place (a string by
    `==`, in C, however long).  So `True` and `1`, `1` and `1.0`, `0.0` and `-0.0`, `"1"` and `1` are
    not the same; a list and a tuple of the same values are, and key order never matters.  A dict with
    a key that is not a str (json writes `1` as `"1"`) or a value of a type not plain JSON is compared
    by its canonical bytes, so the answer is the bytes' answer there too.  Walked with a stack, not
    recursion.  A property test holds it to the bytes (tests/core/test_canonical_json.py)."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        kx, ky = type(x), type(y)
        if kx is str or kx is int or kx is bool:
            if kx is not ky or x != y:
                if kx is ky or ky in _JSON_KINDS:
                    return False
                return canonical_bytes(x) == canonical_bytes(y)
        elif kx is float:
            # repr (what json writes) tells every two floats apart but NaN, and 0.0 from -0.0.
            if ky is not float or x != y or (x == 0.0 and math.copysign(1.0, x) != math.copysign(1.0, y)):
                if ky in _JSON_KINDS:
                    return False
                return canonical_bytes(x) == canonical_bytes(y)
        elif x is None:
            if y is not None:
                if ky in _JSON_KINDS:
                    return False
                return canonical_bytes(x) == canonical_bytes(y)
        elif kx is dict and ky is dict:
            if len(x) != len(y):
                if _str_keys(x) and _str_keys(y):
                    return False
                if canonical_bytes(x) != canonical_bytes(y):
                    return False
                continue
            pairs = []
            for key, value in x.items():
                if type(key) is not str or key not in y:
                    break
                pairs.append((value, y[key]))
            else:
                # Every key of x is a str in y and they are as many: y's keys are x's.
                stack.extend(pairs)
                continue
            if _str_keys(x) and _str_keys(y):
                return False  # a str key of x that y lacks
            if canonical_bytes(x) != canonical_bytes(y):
                return False
        elif (kx is list or kx is tuple) and (ky is list or ky is tuple):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=True))
        elif kx in _JSON_KINDS and ky in _JSON_KINDS:
            return False  # two kinds of JSON value (an object and an array, say): never the same text
        elif canonical_bytes(x) != canonical_bytes(y):
            return False
    return True


def _str_keys(d: dict[Any, Any]) -> bool:
    """Every key a str: json writes no other key as itself (`1` as `"1"`)."""
    return all(type(k) is str for k in d)


def canonical_json(value: Any) -> str:
    """UTF-8 JSON with sorted keys and no insignificant whitespace: the text every digest is taken of."""
    return canonical_bytes(value).decode()


def sha256_digest(content: bytes) -> str:
    """`sha256:<hex>` of `content`."""
    return DIGEST_PREFIX + hashlib.sha256(content).hexdigest()


def reply_digest(reply: dict[str, Any]) -> str:
    """The digest of a `/run` reply, as an agent's completion receipt names it."""
    return sha256_digest(canonical_bytes(reply))
