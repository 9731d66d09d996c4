"""Canonical JSON and the `sha256:<hex>` digests every side of the hand-off compares.

Canonical JSON is the standard library's `json` with sorted keys, no insignificant whitespace, UTF-8
text (not ASCII escapes) and no NaN or infinity: those are the bytes every digest is taken of, on
every side and in every version.  `canonical_bytes` writes them with orjson (20x faster on large
replies) wherever its text is json's or mends into it: orjson writes floats below 1e-4 in another form
(`0.00001` and `1e-7` where `json` writes `1e-05` and `1e-07`: a model's logprobs hold thousands),
mended in its text; it writes NaN and infinity as `null` where `json` refuses them, and refuses keys
that are not strings and integers past 64 bits, which `json` writes: those go to the standard library.
In a large text the forms are found with numpy where it is installed (the trainer's side), by searches
in bytes where it is not (a participant's core install needs none).  Property tests hold every way to
json's bytes (tests/core/test_canonical_json.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Annotated, Any, Final

import orjson
from pydantic import StringConstraints

# numpy finds orjson's float forms in a large text in a few passes in C (`_sites`); None in a
# participant's core install: the searches in bytes alone.
from protocol._numpy import np as _np
from protocol.routes import INTEGER_TEXT, RoutesText, fragment_of, lists_of

DIGEST_PREFIX: Final = "sha256:"
DIGEST_PATTERN: Final = r"^sha256:[0-9a-f]{64}$"
Digest = Annotated[str, StringConstraints(pattern=DIGEST_PATTERN)]


# One encoder for every call: `json.dumps` with options builds a new one each time (1 us of 3.3 for a
# small dict; the store renders an append's metadata with it).
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=lists_of
)
_ORJSON_OPTIONS: Final = orjson.OPT_SORT_KEYS
_DIGITS: Final = frozenset(b"0123456789")


def _float_form_in_text(out: bytes, sites: Sites | None) -> bool:
    """Whether `out` holds text where orjson's floats can differ from json's: a one-digit negative
    exponent (`1e-5`, `1.2e-7`; json writes `e-05`) or a fixed-point small number (`0.00001`).  Found
    anywhere, even inside a string, json writes instead.  `sites`: numpy found them (`_sites`, by the
    mend's own rules), else searched with `bytes.find` (C), never a regex (a regex over a 100 KB reply
    cost more than the encoding)."""
    if sites is not None:
        return bool(sites[0] or sites[1])
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
# What one float of a list costs the walk, in nodes (measured: ~0.4 us a float, ~0.1 a node).
_FLOAT_NODES: Final = 4


def _small_floats(value: Any, budget: int, alone: set[int] | None = None) -> bool | None:
    """Whether `value` holds a float that orjson writes in another form than json: 0 < |x| < 1e-4
    (`1e-5` as `0.00001`, `1.5e-7` as `1.5e-7` for json's `1.5e-07`), or NaN or an infinity (orjson
    writes `null`, json refuses them); walking at most `budget` nodes; None (undecided) past the
    budget or at a type this walk does not know.  Strings cost nothing here however long, which is
    what makes a large reply's check cheap: the searches of the text (`_float_form_in_text`, and
    `null` for a NaN) read every byte of them.  `alone` gathers the ids of the lists it found to hold
    numbers alone (`numbers_alone`), so the walks after it in the same write do not write them again."""
    stack = [value]
    while stack:
        budget -= 1
        if budget < 0:
            return None
        item = stack.pop()
        kind = type(item)
        if kind is str or kind is int or kind is bool or item is None or kind is RoutesText:
            continue  # (router choices held as text: integers alone)
        if kind is dict:
            stack.extend(item.values())  # keys: orjson refuses any but str (json's fallback)
        elif kind is list or kind is tuple:
            if item and type(item[0]) in _LISTS:
                # Lists of lists (a MoE reply's `routed_experts`): settled by their text, in C, when
                # it holds integers alone; any float in it leaves the verdict to the text's search.
                text = numbers_alone(item)
                if text is not None:
                    if alone is not None:
                        alone.add(id(item))
                    if text.translate(None, INTEGER_TEXT):
                        return None
                    continue
            # A float costs the walk about four nodes (`abs`, `isfinite`, the compare): a long list of
            # them (a reply's logprobs) is read faster as text, which the search does in C.
            if len(item) * (_FLOAT_NODES if item and type(item[0]) is float else 1) > budget:
                return None
            stack.extend(item)
        elif kind is float:
            if 0.0 < abs(item) < 1e-4 or not math.isfinite(item):
                return True
        else:  # a float or str subclass, a dataclass, ...: the text decides
            return None
    return False


def _json_writes_otherwise(
    out: bytes, value: Any, finite: bool, alone: set[int] | None = None
) -> tuple[bool, Sites | None]:
    """Whether orjson's text `out` of `value` may differ from json's (a small float, NaN or an
    infinity), and the sites of its small floats when the text was searched by numpy for them (None
    when it was not).  Decided by walking `value` (its strings skipped) when `out` is large and the
    walk is short, else by searching `out` (`_float_form_in_text`, then `null` for a NaN, which
    `_all_finite` settles; `finite`: the caller knows there is none).  Either way a True only costs
    the json encoding."""
    if len(out) > _WALK_ABOVE:
        verdict = _small_floats(value, len(out) // _BYTES_PER_NODE, alone)
        if verdict is not None:
            return verdict, None
    sites = _sites(out)
    found = _float_form_in_text(out, sites) or (
        not finite and b"null" in out and not _all_finite(value, alone)
    )
    return found, sites


_NUMBERS: Final = (float, int)
_LISTS: Final = (list, tuple)
# `nesting`'s table: an empty object (`{}`, the one object a text without strings can hold) is a
# level as `[]` is; every byte but the brackets is deleted.
_AS_BRACKETS: Final = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")


# Lists `numbers_alone` wrote inside `written_once`, by id: (the list itself, held so its id stays its
# own, and the answer).  None outside it.
_WRITTEN: ContextVar[dict[int, tuple[Any, bytes | None]] | None] = ContextVar("_WRITTEN", default=None)
# Shorter lists are written again: cheaper than remembering them.
_REMEMBERED_FROM: Final = 64


@contextmanager
def written_once() -> Iterator[None]:
    """Within it, `numbers_alone` writes each long list once: the passes over one reply that ask it of
    the same lists (its nesting check, its canonical JSON, its records' header: a MoE reply's
    `routed_experts`, 16,000 small lists at 8,000 tokens, five writes a reply otherwise) share the
    text.  For values nobody changes while it lasts (a reply being taken in); the lists are held
    until it ends."""
    token = _WRITTEN.set({})
    try:
        yield
    finally:
        _WRITTEN.reset(token)


def numbers_alone(items: list[Any] | tuple[Any, ...]) -> bytes | None:
    """orjson's text of `items` when it holds numbers, booleans and lists of them alone (at any
    depth), each number one JSON carries: no string or object key (no `"`), no None, NaN or infinity
    (no `null`: orjson writes all three so), no integer past 64 bits (orjson refuses it); else None.
    One write in C settles a list of lists that a sum cannot (a MoE reply's `routed_experts`, a list
    per token), where a walk would take a Python step per item; within `written_once`, one write a
    list."""
    written = _WRITTEN.get()
    if written is not None and len(items) < _REMEMBERED_FROM:
        written = None
    if written is not None:
        seen = written.get(id(items))
        if seen is not None and seen[0] is items:
            return seen[1]
    try:
        text: bytes | None = orjson.dumps(items)
    except (TypeError, orjson.JSONEncodeError):
        text = None
    if text is not None and (b'"' in text or b"null" in text):
        text = None
    if written is not None:
        written[id(items)] = (items, text)
    return text


def nesting(text: bytes, limit: int) -> int:
    """How deep the containers of `text` (a `numbers_alone` text) nest, the outer one counted as 1;
    counted up to `limit + 1` at most.  Its brackets alone, then the innermost pairs taken off,
    each pass a level (a C replace over what is left)."""
    skeleton = text.translate(_AS_BRACKETS, _NOT_BRACKETS)
    depth = 0
    while skeleton and depth <= limit:
        skeleton = skeleton.replace(b"[]", b"")
        depth += 1
    return depth


def _all_finite(value: Any, alone: set[int] | None = None) -> bool:
    """No NaN or infinity anywhere in `value` (orjson writes them as `null`; json refuses them);
    `alone`: ids of lists known to hold finite numbers alone (`_small_floats` found them)."""
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
            elif (
                item
                and type(item[0]) in _LISTS
                and ((alone is not None and id(item) in alone) or numbers_alone(item) is not None)
            ):
                continue  # lists of numbers alone, each one JSON carries
            # Any other list is walked: summing it would raise, and a raise costs 1 us (a token
            # header's few `[dtype, count]` lists cost 6.5 us that way, for 0.6 us of encoding).
            stack.extend(item)
        elif isinstance(item, float) and not math.isfinite(item):
            return False
    return True


def json_canonical_bytes(value: Any) -> bytes:
    """Canonical JSON as the standard library writes it: the definition, which `canonical_bytes`
    falls back on and is held to (ValueError or TypeError where json refuses `value`)."""
    return _CANONICAL.encode(value).encode()


def canonical_bytes(value: Any, *, finite: bool = False) -> bytes:
    """Canonical JSON as UTF-8 bytes: exactly `canonical_json(value).encode()`, faster.  `finite`:
    the caller knows `value` holds no NaN or infinity (orjson.loads gave it: it refuses both), so
    the walk that looks for them is left out."""
    try:
        out = orjson.dumps(value, default=fragment_of, option=_ORJSON_OPTIONS)
    except (TypeError, orjson.JSONEncodeError):
        return json_canonical_bytes(value)  # json's own answer: its text, or its error
    alone: set[int] = set()  # lists found to hold numbers alone, written once for the walks
    differs, sites = _json_writes_otherwise(out, value, finite, alone)
    if differs:
        if _rewritable(value, alone):
            sites = sites if sites is not None else _sites(out)  # searched once, and only to mend
            return _json_float_forms(out) if sites is None else _mend_sites(out, sites)
        return json_canonical_bytes(value)
    return out


# orjson writes a float of 0 < |x| < 1e-4 with the digits json writes (both the shortest that read
# back as the float) in another form: an exponent of -5 in fixed point (`0.00001234`, json's
# `1.234e-05`), one of -6 to -9 with one exponent digit (`1.5e-7`, json's `1.5e-07`).  A model's
# logprobs hold many such numbers, and json writes a float32's 17 digits at about 1 us each: a reply
# carrying 8,000 logprobs cost 5-7 ms that way against orjson's 0.3.  `_json_float_forms` mends
# orjson's forms into json's in its text wherever no string's text can hold them (`_rewritable`).
# The property tests hold the result to json's bytes.
#
# Text in a string or key that a mend could take for a number once written: the forms themselves
# (`0.0000`, `e-7`), or an exponent after a control character json writes as `\u000e` or `\u001e`
# (ending in an `e`).  Every other escape ends in a digit, which the mend reads as part of a larger
# number (left alone), or in a letter no form starts with.
_EXPONENT_IN_TEXT: Final = re.compile(r"e-[6-9]")


def _json_float_forms(out: bytes) -> bytes:
    """orjson's text `out` with its small floats in json's form (`_rewritable(value)` holds): split
    at each form (C), each piece after one mended, joined again (C).  A piece's first bytes say
    whether a form began a number there: a form after a digit is the tail of a larger number
    (`10.00001`), json's already, and an exponent of two digits is json's (`e-10`)."""
    if b"0.0000" in out:
        pieces = out.split(b"0.0000")
        parts = [pieces[0]]
        for before, piece in itertools.pairwise(pieces):
            if piece[:1] in _NONZERO and before[-1:] not in _DIGIT:
                tail = piece.lstrip(b"0123456789")
                digits = len(piece) - len(tail)
                point = b"." + piece[1:digits] if digits > 1 else b""
                parts.append(piece[:1] + point + b"e-05" + tail)
            else:
                parts.append(b"0.0000" + piece)
        out = b"".join(parts)
    if b"e-" in out:
        pieces = out.split(b"e-")
        out = b"e-".join(
            [pieces[0]]
            + [b"0" + p if p[:1] in _SHORT_EXPONENT and p[1:2] not in _DIGIT else p for p in pieces[1:]]
        )
    return out


# Where orjson's small floats begin in its text: each fixed point's `0.0000` and each short exponent's
# `e-`, by the rules `_json_float_forms` mends by (the text of a value `_rewritable` holds for).
Sites = tuple[list[int], list[int]]
# Above this many bytes numpy finds the sites: the searches in bytes read every byte one at a time,
# each split of a 290 KB reply about 0.2-0.3 ms here, where numpy compares 16 or 32 at once.
_SITES_IN_NUMPY_ABOVE: Final = 16384
# A fixed point's digits after its `0.0000`: at most json's 17 significant ones, read up to this many.
_MOST_DIGITS: Final = 24


def _sites(out: bytes) -> Sites | None:
    """The sites of `out` found with numpy, when it is large and numpy is here; else None (the
    searches in bytes find them).  A fixed point: `0.0000` then a digit 1-9, after no digit (a
    number's start; `10.00001` is json's already).  A short exponent: `e-` then one digit 6-9 and no
    digit after it (`e-10` is json's).  Each step one comparison over all the text or over the
    candidates left (the rarest first), never a Python step per byte."""
    if _np is None or len(out) <= _SITES_IN_NUMPY_ABOVE:
        return None
    a = _np.frombuffer(out, dtype=_np.uint8)
    n = a.size
    fixed = _np.empty(0, dtype=_np.int64)
    if n >= 7:  # room for `0.0000d` (below that the slices would wrap round)
        # `.00`, with a byte before the `.` and five after it.
        dots = _np.flatnonzero((a[1 : n - 5] == 0x2E) & (a[2 : n - 4] == 0x30) & (a[3 : n - 3] == 0x30))
        dots += 1
        for k in (3, 4, -1):
            dots = dots[a[dots + k] == 0x30]
        fixed = dots[_is_digit(a[dots + 5]) & (a[dots + 5] != 0x30)] - 1
        fixed = fixed[(fixed == 0) | ~_is_digit(a[_np.maximum(fixed - 1, 0)])]
    es = _np.flatnonzero((a[: n - 2] == 0x65) & (a[1 : n - 1] == 0x2D))  # `e-` with a byte after it
    es = es[(a[es + 2] >= 0x36) & (a[es + 2] <= 0x39)]
    short = es[(es + 3 >= n) | ~_is_digit(a[_np.minimum(es + 3, n - 1)])]
    return fixed.tolist(), short.tolist()


def _is_digit(codes: Any) -> Any:
    return (codes >= 0x30) & (codes <= 0x39)


def _mend_sites(out: bytes, sites: Sites) -> bytes:
    """`_json_float_forms(out)` at the sites numpy found: each short exponent `e-7` given its `0`,
    then each fixed point `0.0000dR` (`d` its first significant digit, `R` the digits after) made
    `d.Re-05` (`de-05` when `R` is empty).  Where each fixed point's digits end is found by numpy
    too; the text between two sites is sliced, never searched again."""
    fixed, short = sites
    if short:
        cuts = [q + 2 for q in short]
        out = b"0".join([out[i:j] for i, j in zip([0, *cuts], [*cuts, len(out)], strict=True)])
    if not fixed:
        return out
    a = _np.frombuffer(out + b"\0", dtype=_np.uint8)  # a non-digit past the end
    # Each fixed point moved on by the zeros put in before it.
    starts = _np.asarray(fixed, dtype=_np.int64) + _np.searchsorted(short, fixed)
    window = _np.minimum(starts[:, None] + 7 + _np.arange(_MOST_DIGITS), a.size - 1)
    ends = starts + 7 + _np.argmin(_is_digit(a[window]), axis=1)
    parts: list[bytes] = []
    at = 0
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        lead = out[start + 6 : start + 7]
        rest = b"." + out[start + 7 : end] if end > start + 7 else b""
        parts += (out[at:start], lead, rest, b"e-05")
        at = end
    parts.append(out[at:])
    return b"".join(parts)


# One-byte slices (CPython keeps one object for each byte value): set lookups, no conversions.
_DIGIT: Final = frozenset(bytes((c,)) for c in b"0123456789")
_NONZERO: Final = _DIGIT - {b"0"}
_SHORT_EXPONENT: Final = frozenset({b"6", b"7", b"8", b"9"})


def _text_rewritable(text: str) -> bool:
    """Whether no substitution can match in `text` once written (each test a C search)."""
    if "0.0000" in text:
        return False
    if "-" not in text:
        return True
    if "\x0e-" in text or "\x1e-" in text:
        return False
    return not ("e-" in text and _EXPONENT_IN_TEXT.search(text))


def _rewritable(value: Any, alone: set[int] | None = None) -> bool:
    """Whether json's text of `value` is orjson's with its small floats in json's form: only plain
    JSON types, no NaN or infinity (json refuses them; orjson writes `null`), and no string or key whose
    text could pass for a number once written.  A list of numbers (token ids, logprobs) is settled by
    one sum, in C: orjson wrote `value`, and of what orjson writes only numbers (ints and floats, and
    their subclasses, which both write as the number) can be summed with a float; finite floats that
    overflow the sum only send the value to json."""
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str:
            if not _text_rewritable(item):
                return False
        elif kind is dict:
            # orjson wrote it, so every key is a str; joined by a newline, none can run into the next.
            if not _text_rewritable("\n".join(item)):
                return False
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            try:  # numbers alone (a sum takes nothing else orjson writes): finite exactly when it is
                if not math.isfinite(sum(item, 0.0)):
                    return False
            except TypeError:  # a string, a container or None among them: each walked
                # (but lists of numbers alone, settled by their text in C: nothing in them to mend
                # but numbers)
                if not (
                    type(item[0]) in _LISTS
                    and ((alone is not None and id(item) in alone) or numbers_alone(item) is not None)
                ):
                    stack.extend(item)
            except OverflowError:
                return False
        elif kind is float:
            if not math.isfinite(item):
                return False
        elif not (kind is int or kind is bool or item is None or kind is RoutesText):
            return False  # a subclass or another type: json's own encoding decides
    return True


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
