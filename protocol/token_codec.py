"""The token records of a try as one payload: the binary form (layout, version, media type) and the
plain JSON reference form beside it.

Binary form, version 1 (`TOKENS_MEDIA_TYPE`), little-endian:

    offset 0   b"RLTK"                      magic
           4   u8 version (1), 3 zero bytes
           8   u64 H, the header's length
          16   header: canonical JSON, {"arrays": [[dtype, count], ...], "records": [{...}, ...]}
               zero bytes up to a multiple of 8
               each array in header order, each padded with zero bytes to a multiple of 8

`records` are the records as they travel (`model_dump(mode="json", exclude_unset=True)`: every field
that was set, extras and lineage fields included) without their three token arrays; `arrays` holds,
per record in order, `prompt_token_ids`, `generation_token_ids`, `generation_log_probs`.  Token ids
are `u4` when every id fits 0..2^32-1, else `i8`; logprobs are `f4` when every value is exactly a
float32 (what a model server's float32 logprobs are), else `f8`.  That choice is part of the form, so
equal records give equal bytes, hence one digest, whichever side encodes them: the Gym side from
Python lists here (the standard library's `struct`, no numpy), the trainer from numpy arrays
(`payloads.token_arrays`), each held to the other by tests.  Decoding gives back exactly the fields
that were set: the form is lossless.

Version 2 (`TOKENS_REPLY_MEDIA_TYPE`) is how the trainer stores a try's records beside its reply: the
same layout, the header `{"arrays": ..., "records": ..., "reply_items": [...]}` with one entry per
record, null or `[start, stop]`.  A record with `[start, stop]` holds no `output_items`: they are the
reply's `response.output[start:stop]`, each item without its token arrays (`protocol.tokens.
TOKEN_FIELDS`), which `refer_to_reply` checked item for item (the same canonical JSON) before it left them
out.  The call's output text is then stored once, in the reply, whose digest the agent's receipt
names; `resolve_reply_items` puts the items back from the reply, so the records read are the Gym's,
field for field, and re-encoding them in version 1 gives the bytes the agent sent.  A version 2
payload refers for at least one record (otherwise its form is version 1).

Version 3 (`TOKENS_ROUTES_MEDIA_TYPE`) is version 2 with the router choices typed: a record's
`routed_experts` that is a regular `[tokens][layers][k]` list of integers within int32, of
`TYPED_FROM_TOKENS` tokens or more (a MoE model server's router choices, as a real Gym agent's reply
carries them: a list a token) leaves the header
for an array of its own, `i2` when every value fits int16, else `i4`, shaped `[tokens, layers, k]`.
The header gains `"routes": [...]`, one entry per record: null (its `routed_experts`, if any, stays in
the record as JSON) or `[dtype, [tokens, layers, k]]`; those arrays follow the records' three arrays,
in record order, each padded to 8 bytes.  The values are exact (read back as nested lists they write
the same JSON text: `referred` checks each array against the list's text before it moves it), so the
form stays lossless; what it saves is a Python list per token at every pass: NeMo RL's own wire form
for the same choices is one typed array (`nrlre1:int16:...`).  Only the trainer writes it (numpy at
hand), beside a reply it refers to; a reader without numpy reads it all the same.

The JSON reference form (`TOKENS_JSON_MEDIA_TYPE`) is the canonical JSON of the record list, the form
token records were stored in before the binary one.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import orjson

from protocol._numpy import np as _np
from protocol.digests import canonical_bytes, numbers_alone, same_json
from protocol.routes import TYPED_FROM_TOKENS, RoutesText, loads_holding_routes, routes_text
from protocol.tokens import TOKEN_FIELDS

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from protocol.wire import TokenEntry

TOKENS_MEDIA_TYPE: Final = "application/vnd.rollout-ledger.tokens.v1"
TOKENS_JSON_MEDIA_TYPE: Final = "application/vnd.rollout-ledger.tokens+json"
# Version 2: the records' output items are their reply's (stored beside it, by the trainer).
TOKENS_REPLY_MEDIA_TYPE: Final = "application/vnd.rollout-ledger.tokens.v2"
# Version 3: version 2, and the records' router choices as typed arrays.
TOKENS_ROUTES_MEDIA_TYPE: Final = "application/vnd.rollout-ledger.tokens.v3"
MAGIC: Final = b"RLTK"
VERSION: Final = 1
REPLY_VERSION: Final = 2
ROUTES_VERSION: Final = 3
_MEDIA_VERSION: Final = {
    TOKENS_MEDIA_TYPE: VERSION,
    TOKENS_REPLY_MEDIA_TYPE: REPLY_VERSION,
    TOKENS_ROUTES_MEDIA_TYPE: ROUTES_VERSION,
}
# The media types of records stored beside the reply they refer to (a reply stored apart names one).
REFERRING_MEDIA_TYPES: Final = frozenset({TOKENS_REPLY_MEDIA_TYPE, TOKENS_ROUTES_MEDIA_TYPE})
ARRAY_FIELDS: Final = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
_ARRAY_FIELD_SET: Final[set[str]] = set(ARRAY_FIELDS)
ID_DTYPES: Final = ("u4", "i8")
LOGPROB_DTYPES: Final = ("f4", "f8")
ROUTE_DTYPES: Final = ("i2", "i4")
ROUTES_FIELD: Final = "routed_experts"
ITEM_SIZE: Final = {"u4": 4, "i8": 8, "f4": 4, "f8": 8, "i2": 2, "i4": 4}
_PREFIX = struct.Struct("<4sB3xQ")
ALIGN: Final = 8
# The largest header a reader accepts: the records' own fields, never their arrays.
MAX_HEADER_BYTES: Final = 64 * 1024 * 1024
_TYPECODES: Final = {"u4": "I", "i8": "q", "f4": "f", "f8": "d", "i2": "h", "i4": "i"}
for _code, _size in (("I", 4), ("q", 8), ("f", 4), ("d", 8), ("h", 2), ("i", 4)):
    assert array(_code).itemsize == _size, f"array typecode {_code} is not {_size} bytes here"
_SWAP: Final = sys.byteorder != "little"
# A float32's high byte (little-endian) is 0x7f or 0xff only when its exponent may be all ones (NaN,
# infinity) or it is within a factor 2 of the largest float32: every other byte value, deleted.
_NOT_HIGH: Final = bytes(b for b in range(256) if b & 0x7F != 0x7F)


class TokenCodecError(ValueError):
    """Bytes that are not token records in the binary form, or records that have no binary form."""


# The one message for the one rule every logprob keeps (lists, buffers and numpy arrays alike).
NON_FINITE_LOGPROB: Final = "a logprob is NaN or infinite"


def refuse_non_finite(values: Sequence[float]) -> None:
    """TokenCodecError unless every logprob is finite: their sum is, in C, whenever each is (a sum
    past a double's range is the one case where each value is looked at)."""
    if not math.isfinite(sum(values, 0.0)) and not all(map(math.isfinite, values)):
        raise TokenCodecError(NON_FINITE_LOGPROB)


@dataclass(frozen=True, slots=True)
class ArraySpan:
    record: int
    field: str
    dtype: str
    offset: int
    count: int
    # The list the array was packed from, where its writer has it (`referring_entries`): the same
    # values, exactly, so a reply holding that list's very items needs no other comparison with the
    # array.  None when read.
    source: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.count * ITEM_SIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class RouteSpan:
    """Where a record's router choices lie (version 3): `shape` is `[tokens, layers, k]`."""

    record: int
    dtype: str
    offset: int
    shape: tuple[int, int, int]
    # The lists the array was made from, where its writer has them (`referred`): the same JSON, so a
    # reply holding that very list needs no comparison with the array.  None when read.
    source: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def count(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]

    @property
    def end(self) -> int:
        return self.offset + self.count * ITEM_SIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """A binary payload read as far as its header: the records' other fields and where each array is."""

    records: list[dict[str, Any]]
    spans: list[ArraySpan]
    # Version 2: per record, the run of the reply's output items it refers to (None: its own items);
    # () once resolved, and in version 1.
    reply_items: tuple[tuple[int, int] | None, ...] = ()
    # Version 3: per record, where its router choices lie (None: in the record, if anywhere); ()
    # in versions 1 and 2.  Kept when the output items are put back.
    routes: tuple[RouteSpan | None, ...] = ()

    @property
    def version(self) -> int:
        if self.routes:
            return ROUTES_VERSION
        return REPLY_VERSION if self.reply_items else VERSION

    def route(self, record: int) -> RouteSpan | None:
        """Where a record's router choices lie as an array (version 3); None where they do not."""
        return self.routes[record] if self.routes else None

    def span(self, record: int, field: str) -> ArraySpan:
        return self.spans[3 * record + ARRAY_FIELDS.index(field)]

    def generated(self) -> int:
        return sum(s.count for s in self.spans if s.field == "generation_token_ids")


def _pad(n: int) -> int:
    return -n % ALIGN


def id_dtype_of(ids: Sequence[int]) -> tuple[str, bytes]:
    """The form's dtype for token ids, and the ids in it (little-endian bytes).  Packed by `struct`
    in one C call per try of a dtype (the standard library's `array` built from a list goes item by
    item, ten times slower)."""
    n = len(ids)
    for dtype in ID_DTYPES:
        try:
            return dtype, struct.pack(f"<{n}{_TYPECODES[dtype]}", *ids)
        except struct.error:
            continue
    if not all(isinstance(i, int) for i in ids):
        raise TokenCodecError("a token id is not an integer")
    raise TokenCodecError("a token id is outside the 64-bit range")


def logprob_dtype_of(values: Sequence[float]) -> tuple[str, bytes]:
    """The form's dtype for logprobs (f4 when every value is exactly a float32), and the values in it.
    Exactly a float32: packing as float32 (round to nearest, as a C cast) and reading back gives the
    values themselves, compared as one list (C; NaN is refused first, and a float32 keeps the sign of
    a zero).  The float64 form is packed only when they are not.  From `_NUMPY_FROM` values on,
    numpy decides where it is installed (`_logprob_dtype_numpy`: the same answer, a third of the
    time on a 4,000-value call)."""
    if _np is not None and len(values) >= _NUMPY_FROM:
        found = _logprob_dtype_numpy(values)
        if found is not None:
            return found
    refuse_non_finite(values)
    n = len(values)
    try:
        narrow = struct.pack(f"<{n}f", *values)
    except OverflowError:  # past float32's range
        return "f8", struct.pack(f"<{n}d", *values)
    back = array("f")
    back.frombytes(narrow)
    if _SWAP:
        back.byteswap()
    if back.tolist() == (values if isinstance(values, list) else list(values)):
        return "f4", narrow
    return "f8", struct.pack(f"<{n}d", *values)


# From this many logprobs numpy decides (its calls cost more than they save on a few).
_NUMPY_FROM: Final = 64


def _logprob_dtype_numpy(values: Sequence[float]) -> tuple[str, bytes] | None:
    """`logprob_dtype_of`'s answer with numpy (the trainer's side), the same bytes: the values packed as
    float64 once (`struct`, one C call), then cast to float32 (round to nearest, as a C cast) and
    compared in one vectorised pass each.  None, for the standard library's way to decide (and to
    refuse), where any value is no finite number."""
    n = len(values)
    try:
        wide = struct.pack(f"<{n}d", *values)
    except (struct.error, OverflowError, TypeError):
        return None
    doubles = _np.frombuffer(wide, dtype="<f8")
    if not _np.isfinite(doubles).all():
        return None
    with _np.errstate(over="ignore"):  # past float32's range: infinity, which compares unequal
        narrow = doubles.astype("<f4")
    return ("f4", narrow.tobytes()) if bool((narrow == doubles).all()) else ("f8", wide)


def assemble(records: list[dict[str, Any]], arrays: list[tuple[str, bytes]]) -> bytes:
    """The binary form from the records' other fields and their arrays as `(dtype, bytes)`, in order."""
    return assembled(records, arrays)[0]


def assembled(records: list[dict[str, Any]], arrays: list[tuple[str, bytes]]) -> tuple[bytes, TokenLayout]:
    """`assemble`, and the layout `read_layout` would read of its bytes (`records` themselves: the
    same JSON values, where a tuple given stays a tuple), so the writer need not read its own header
    back."""
    counts = [len(data) // ITEM_SIZE[dtype] for dtype, data in arrays]
    header = canonical_bytes(
        {"arrays": [[dtype, n] for (dtype, _), n in zip(arrays, counts, strict=True)], "records": records}
    )
    spans, region = _laid_out(arrays, _PREFIX.size + len(header) + _pad(len(header)))
    parts = [_PREFIX.pack(MAGIC, VERSION, len(header)), header, bytes(_pad(len(header))), *region]
    return b"".join(parts), TokenLayout(records, spans)


def _laid_out(
    arrays: list[tuple[str, bytes]], offset: int, sources: Sequence[Any] = ()
) -> tuple[list[ArraySpan], list[bytes]]:
    """Where each array `(dtype, bytes)` lies when they follow one another from `offset`, each padded
    to 8 bytes, and their bytes with the padding, in order; `sources`: the list each was packed from."""
    spans: list[ArraySpan] = []
    region: list[bytes] = []
    for i, (dtype, data) in enumerate(arrays):
        source = sources[i] if sources else None
        count = len(data) // ITEM_SIZE[dtype]
        spans.append(ArraySpan(i // 3, ARRAY_FIELDS[i % 3], dtype, offset, count, source))
        region += (data, bytes(_pad(len(data))))
        offset += len(data) + _pad(len(data))
    return spans, region


def split_record(record: dict[str, Any]) -> dict[str, Any]:
    """A record's fields without its token arrays (KeyError when one of them is missing)."""
    for name in ARRAY_FIELDS:
        if name not in record:
            raise TokenCodecError(f"token record lacks {name}")
    return {k: v for k, v in record.items() if k not in ARRAY_FIELDS}


def encode_records(records: Sequence[dict[str, Any]]) -> bytes:
    """The binary form of records given as dicts (each record as it travels), from Python lists."""
    heads: list[dict[str, Any]] = []
    arrays: list[tuple[str, bytes]] = []
    for record in records:
        heads.append(split_record(record))
        arrays.append(id_dtype_of(record["prompt_token_ids"]))
        arrays.append(id_dtype_of(record["generation_token_ids"]))
        arrays.append(logprob_dtype_of(record["generation_log_probs"]))
    return assemble(heads, arrays)


# The buffer formats `with_arrays` takes for each dtype it keeps (native order on a little-endian machine).
_BUFFER_FORMATS: Final = {"u4": ("I", "<I", "=I"), "f4": ("f", "<f", "=f")}


def _buffer_of(values: Buffer, formats: tuple[str, ...], count: int, name: str) -> bytes:
    view = memoryview(values)
    if view.format not in formats or view.itemsize != 4 or view.ndim != 1:
        raise TokenCodecError(f"{name} given as a buffer of format {view.format!r}, not {formats[0]!r}")
    if len(view) != count:
        raise TokenCodecError(f"{name}: {len(view)} values in the buffer, {count} in the record")
    return view.tobytes()


def with_arrays(
    entry: TokenEntry,
    prompt_token_ids: Buffer | None = None,
    generation_token_ids: Buffer | None = None,
    generation_log_probs: Buffer | None = None,
) -> TokenEntry:
    """`entry`, holding the arrays its writer keeps its tokens in (zero work's pool): ids as a buffer of
    uint32 (format "I", e.g. a numpy uint32 array), logprobs of float32 ("f"), each with exactly the
    values of the entry's own list, in order (the writer's promise: they are not compared).  Their
    dtypes are the ones the form chooses for those values (u4, f4; a NaN or infinity is refused), so
    `encode_entries` copies their bytes instead of packing the lists, with the same bytes.  One left
    None is packed from its list as before; on a big-endian machine none are kept."""
    from protocol.wire import PackedArrays

    if _SWAP:
        return entry
    lists: tuple[Sequence[float], ...] = (
        entry.prompt_token_ids,
        entry.generation_token_ids,
        entry.generation_log_probs,
    )
    given = (prompt_token_ids, generation_token_ids, generation_log_probs)
    arrays: list[tuple[str, bytes] | None] = [None, None, None]
    for i, (name, values, buffer) in enumerate(zip(ARRAY_FIELDS, lists, given, strict=True)):
        if buffer is None:
            continue
        dtype = "f4" if name == "generation_log_probs" else "u4"
        data = _buffer_of(buffer, _BUFFER_FORMATS[dtype], len(values), name)
        # Finite unless a high byte says it may not be (then each value is looked at).
        if dtype == "f4" and data[3::4].translate(None, _NOT_HIGH):
            refuse_non_finite(_floats(data))
        arrays[i] = (dtype, data)
    entry._packed = PackedArrays((lists[0], lists[1], lists[2]), (arrays[0], arrays[1], arrays[2]))
    return entry


def _floats(data: bytes) -> list[float]:
    values = array("f")
    values.frombytes(data)
    return values.tolist()


def record_of(entry: TokenEntry) -> dict[str, Any]:
    """A record as it travels: every field that was set, extras included, nothing added."""
    return entry.record()


def encode_entries(entries: Sequence[TokenEntry]) -> bytes:
    """The binary form of `TokenEntry` records (the Gym side's `/token_capture`, the trainer's JSON path):
    `encode_records` of their `record_of`, with each array packed from the entry's own list (a record's
    dump would copy them first: the arrays are required fields, set in every entry), or copied as
    `with_arrays` packed it beside that list."""
    return encoded_entries(entries)[0]


# Left out of an entry's dump when it holds lists of numbers alone: put in as they are (below).
_SHARED: Final = _ARRAY_FIELD_SET | {"routed_experts"}


def encoded_entries(entries: Sequence[TokenEntry]) -> tuple[bytes, TokenLayout]:
    """`encode_entries`, and the layout of its bytes (`assembled`)."""
    return assembled(*_entry_parts(entries))


def _entry_parts(entries: Sequence[TokenEntry]) -> tuple[list[dict[str, Any]], list[tuple[str, bytes]]]:
    """The records' other fields as they travel and their arrays as `(dtype, bytes)`, in order: what
    `assembled` takes.  `routed_experts`, a list per token, is not copied by the dump where it is a
    list of lists of numbers alone (`numbers_alone`: JSON values already, which the dump would copy
    item by item into equal ones)."""
    heads: list[dict[str, Any]] = []
    arrays: list[tuple[str, bytes]] = []
    for entry in entries:
        routes = entry.routed_experts
        if "routed_experts" in entry.model_fields_set and (
            type(routes) is RoutesText or (type(routes) is list and numbers_alone(routes))
        ):
            head = entry.model_dump(mode="json", exclude_unset=True, exclude=_SHARED)
            head["routed_experts"] = routes
        else:
            head = entry.model_dump(mode="json", exclude_unset=True, exclude=_ARRAY_FIELD_SET)
        heads.append(head)
        prompt, generation, logprobs = entry.packed_arrays()
        arrays.append(prompt or id_dtype_of(entry.prompt_token_ids))
        arrays.append(generation or id_dtype_of(entry.generation_token_ids))
        arrays.append(logprobs or logprob_dtype_of(entry.generation_log_probs))
    return heads, arrays


def _header_records(header: Any) -> Any:
    records = header.get("records") if type(header) is dict else None
    return records if type(records) is list else ()


def read_layout(
    content: bytes | bytearray | memoryview, *, check_canonical: bool = True, routes_as_text: bool = False
) -> TokenLayout:
    """The header of a binary payload, checked: magic, version, a canonical header, every array inside
    the payload and nothing after the last one, generated ids and logprobs of equal length.

    `check_canonical=False` leaves out the one check that re-encodes the header (the costliest: more
    than the rest of a read), for bytes that matched the digest of a claim: the trainer checked them
    canonical before it claimed them, and a changed byte fails the digest.

    `routes_as_text`: each record's `routed_experts` held as `protocol.routes.RoutesText` where its
    text allows (the trainer reading a participant's completion frame: never made into lists)."""
    view = memoryview(content)
    if len(view) < _PREFIX.size:
        raise TokenCodecError(f"{len(view)} bytes are too short for token records")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise TokenCodecError("not token records in the binary form (bad magic)")
    if version not in (VERSION, REPLY_VERSION, ROUTES_VERSION):
        raise TokenCodecError(
            f"token records of form version {version}; this reader knows {VERSION}, {REPLY_VERSION} "
            f"and {ROUTES_VERSION}"
        )
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > len(view):
        raise TokenCodecError(f"a header of {header_len} bytes does not fit the payload")
    # Read and checked where it lies: no copy of the header (the records' output text, in version 1).
    raw = view[_PREFIX.size : _PREFIX.size + header_len]
    try:
        header = (
            loads_holding_routes(raw, orjson.loads, _header_records) if routes_as_text else orjson.loads(raw)
        )
    except orjson.JSONDecodeError as exc:
        raise TokenCodecError(f"the header is not JSON: {exc}") from None
    keys = {"arrays", "records"} if version == VERSION else {"arrays", "records", "reply_items"}
    if version == ROUTES_VERSION:
        keys.add("routes")
    if not isinstance(header, dict) or set(header) != keys:
        raise TokenCodecError(f"the header of version {version} must hold exactly {sorted(keys)}")
    records, arrays = header["records"], header["arrays"]
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise TokenCodecError("the header's records must be a list of objects")
    if not isinstance(arrays, list) or len(arrays) != 3 * len(records):
        raise TokenCodecError("the header must describe three arrays per record")
    reply_items = _reply_items(header["reply_items"], records) if version != VERSION else ()
    if check_canonical and not _same_bytes(canonical_bytes(header, finite=True), raw):
        raise TokenCodecError("the header is not canonical JSON")
    offset = _PREFIX.size + header_len + _pad(header_len)
    spans: list[ArraySpan] = []
    for i, entry in enumerate(arrays):
        field = ARRAY_FIELDS[i % 3]
        allowed = LOGPROB_DTYPES if i % 3 == 2 else ID_DTYPES
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or entry[0] not in allowed
            or type(entry[1]) is not int
            or entry[1] < 0
        ):
            raise TokenCodecError(f"array {i} ({field}) is described as {entry!r}")
        span = ArraySpan(i // 3, field, entry[0], offset, entry[1])
        if span.end > len(view):
            raise TokenCodecError(f"array {i} ({field}) runs past the end of the payload")
        spans.append(span)
        offset = span.end + _pad(span.end - span.offset)
    routes: tuple[RouteSpan | None, ...] = ()
    if version == ROUTES_VERSION:
        routes, offset = _route_spans(header["routes"], records, offset, view, check_canonical)
    if offset != len(view):
        raise TokenCodecError(f"{len(view) - offset} bytes follow the last array")
    if any(view[s.end : s.end + _pad(s.end - s.offset)].tobytes().strip(b"\0") for s in spans):
        raise TokenCodecError("padding between arrays is not zero")
    for r in range(len(records)):
        if spans[3 * r + 1].count != spans[3 * r + 2].count:
            raise TokenCodecError(
                f"record {r}: generation_token_ids and generation_log_probs differ in length"
            )
    return TokenLayout(records, spans, reply_items, routes)


def _route_spans(
    given: Any, records: list[dict[str, Any]], offset: int, view: memoryview, check_canonical: bool
) -> tuple[tuple[RouteSpan | None, ...], int]:
    """A version 3 header's `routes`, checked: one entry per record, null or `[dtype, [tokens,
    layers, k]]` (each at least 1) for a record that holds no `routed_experts` of its own, at least
    one array, each inside the payload and zero-padded; and, where the header is checked canonical,
    an `i4` array holding a value past int16 (else its form is `i2`).  The spans, and the offset
    after the last."""
    if not isinstance(given, list) or len(given) != len(records):
        raise TokenCodecError("routes must hold one entry per record")
    out: list[RouteSpan | None] = []
    for r, entry in enumerate(given):
        if entry is None:
            out.append(None)
            continue
        shape = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if (
            not isinstance(shape, list)
            or entry[0] not in ROUTE_DTYPES
            or len(shape) != 3
            or not all(type(d) is int and d >= 1 for d in shape)
        ):
            raise TokenCodecError(f"record {r}: routes entry {entry!r} is not [dtype, [tokens, layers, k]]")
        if ROUTES_FIELD in records[r]:
            raise TokenCodecError(f"record {r} holds routed_experts both in its fields and as an array")
        span = RouteSpan(r, entry[0], offset, (shape[0], shape[1], shape[2]))
        if span.end > len(view):
            raise TokenCodecError(f"record {r}: its routes run past the end of the payload")
        if view[span.end : span.end + _pad(span.end - span.offset)].tobytes().strip(b"\0"):
            raise TokenCodecError("padding between arrays is not zero")
        if check_canonical and span.dtype == "i4":
            values = _typed(view, span.offset, span.end, span.dtype)
            if min(values) >= -(2**15) and max(values) < 2**15:
                raise TokenCodecError(f"record {r}: its routes fit int16 and are held as int32")
        out.append(span)
        offset = span.end + _pad(span.end - span.offset)
    if all(span is None for span in out):
        raise TokenCodecError("a version 3 payload holds the routes of at least one record")
    return tuple(out), offset


def _same_bytes(encoded: bytes, view: memoryview) -> bool:
    """`encoded == bytes(view)` without the copy: `bytes.startswith` takes any buffer and compares it
    with one memcmp (a memoryview's own `==` compares item by item, 80x slower than the copy)."""
    return len(encoded) == view.nbytes and encoded.startswith(view)


def _reply_items(given: Any, records: list[dict[str, Any]]) -> tuple[tuple[int, int] | None, ...]:
    """A version 2 header's `reply_items`, checked: one per record, null or `[start, stop]` with
    0 <= start < stop, runs in order and apart, at least one, and no `output_items` of its own in a
    record that refers."""
    if not isinstance(given, list) or len(given) != len(records):
        raise TokenCodecError("reply_items must hold one entry per record")
    out: list[tuple[int, int] | None] = []
    after = 0
    for r, entry in enumerate(given):
        if entry is None:
            out.append(None)
            continue
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not all(type(v) is int for v in entry)
            or not after <= entry[0] < entry[1]
        ):
            raise TokenCodecError(f"record {r}: reply_items entry {entry!r} is not a run after the last")
        if "output_items" in records[r]:
            raise TokenCodecError(f"record {r} refers to its reply's output items and holds its own")
        out.append((entry[0], entry[1]))
        after = entry[1]
    if all(entry is None for entry in out):
        raise TokenCodecError("a version 2 payload refers to its reply for at least one record")
    return tuple(out)


_UNSEEN: Final = object()


def _without_arrays(item: Any) -> Any:
    return {k: v for k, v in item.items() if k not in TOKEN_FIELDS} if isinstance(item, dict) else item


def reply_output_of(reply: Any) -> list[Any]:
    """A reply's `response.output` (a `/run` reply as JSON, the stored reply payload loaded), [] when
    it has none."""
    response = reply.get("response") if isinstance(reply, dict) else None
    output = response.get("output") if isinstance(response, dict) else None
    return output if isinstance(output, list) else []


def refer_to_reply(
    content: bytes | memoryview, reply_output: Sequence[Any], *, layout: TokenLayout | None = None
) -> tuple[bytes, str]:
    """Token records in the binary form, version 1 (checked canonical), as the trainer stores them
    beside their reply, and the media type: each record whose `output_items` are, item for item
    (the same canonical JSON: `same_json`, which compares the values without writing them), a run of
    `reply_output` after the previous record's, each item without its token arrays, refers to that run
    instead (version 2; version 3 where a record's router choices are also typed, `routes_array`,
    numpy at hand).  `content` itself, version 1, when no record's items are found there.  The
    arrays are copied as they are (one copy of the bytes).  `layout`: `content`'s own as
    `read_layout` read it (the trainer's intake has), so it is not read again."""
    stored, media_type, _ = referred(content, reply_output, layout=layout)
    return stored, media_type


def referred(
    content: bytes | memoryview, reply_output: Sequence[Any], *, layout: TokenLayout | None = None
) -> tuple[bytes, str, TokenLayout]:
    """`refer_to_reply`, and the layout of the bytes it gives (what `read_layout` would read of them:
    `payloads.replies.reply_to_store` takes it, instead of reading the header again)."""
    if layout is None:
        layout = read_layout(content, check_canonical=False)
    if layout.version != VERSION:
        raise TokenCodecError("only version 1 token records are made to refer to their reply")
    refs, heads = _refer(layout.records, reply_output)
    if all(ref is None for ref in refs):
        return bytes(content), TOKENS_MEDIA_TYPE, layout
    view = memoryview(content)
    start = layout.spans[0].offset if layout.spans else len(view)
    return _referring(layout.records, heads, refs, layout.spans, view[start:], start, finite=True)


def referring_entries(
    entries: Sequence[TokenEntry], reply_output: Sequence[Any]
) -> tuple[bytes, str, TokenLayout]:
    """`referred(*encoded_entries(entries))` (the same bytes, media type and layout) without the version
    1 form in between: its header (the router choices' text written once more) and its bytes are never
    made.  The trainer's reduced mode, which reads the records off the very reply they refer to."""
    heads, arrays = _entry_parts(entries)
    refs, referring = _refer(heads, reply_output)
    if all(ref is None for ref in refs):
        content, layout = assembled(heads, arrays)
        return content, TOKENS_MEDIA_TYPE, layout
    lists = [getattr(entry, name) for entry in entries for name in ARRAY_FIELDS]
    spans, region = _laid_out(arrays, 0, lists)
    # The heads are an entry's dump, not a header read: walked for a NaN as `assembled` walks them.
    return _referring(heads, referring, refs, spans, b"".join(region), 0, finite=False)


def _refer(
    records: list[dict[str, Any]], reply_output: Sequence[Any]
) -> tuple[list[list[int] | None], list[dict[str, Any]]]:
    """Per record, the run of `reply_output` its `output_items` are, item for item (the same canonical
    JSON, each reply item without its token arrays), after the previous record's run (None where they
    are not), and the record without its `output_items` where they are."""
    # The reply's items without their token arrays, each made when first compared.
    stripped: list[Any] = [_UNSEEN] * len(reply_output)
    cursor = 0
    refs: list[list[int] | None] = []
    heads: list[dict[str, Any]] = []
    for head in records:
        items = head.get("output_items")
        found = None
        if isinstance(items, list) and items:
            for start in range(cursor, len(reply_output) - len(items) + 1):
                for k, item in enumerate(items, start):
                    if stripped[k] is _UNSEEN:
                        stripped[k] = _without_arrays(reply_output[k])
                    if not same_json(item, stripped[k]):
                        break
                else:
                    found = [start, start + len(items)]
                    cursor = found[1]
                    break
        refs.append(found)
        heads.append(head if found is None else {k: v for k, v in head.items() if k != "output_items"})
    return refs, heads


def _referring(
    records: list[dict[str, Any]],
    heads: list[dict[str, Any]],
    refs: list[list[int] | None],
    spans_in: Sequence[ArraySpan],
    region: Buffer,
    region_at: int,
    *,
    finite: bool,
) -> tuple[bytes, str, TokenLayout]:
    """The version 2 (or 3) form of `records` (their version 1 heads), `heads` (without the output
    items their `refs` name), and their arrays: `region`, every array padded in order, which
    `spans_in` place as if `region` began at `region_at`.  `finite`: the heads are known to hold no
    NaN or infinity (a header read gave them)."""
    typed: list[tuple[str, tuple[int, int, int], bytes] | None] = [None] * len(heads)
    if _np is not None:  # the trainer's side: router choices as typed arrays (version 3)
        for r, head in enumerate(heads):
            typed[r] = routes_array(head.get(ROUTES_FIELD))
            if typed[r] is not None:
                heads[r] = {k: v for k, v in head.items() if k != ROUTES_FIELD}
    fields: dict[str, Any] = {
        "arrays": [[s.dtype, s.count] for s in spans_in],
        "records": heads,
        "reply_items": refs,
    }
    version, media_type = REPLY_VERSION, TOKENS_REPLY_MEDIA_TYPE
    if any(t is not None for t in typed):
        version, media_type = ROUTES_VERSION, TOKENS_ROUTES_MEDIA_TYPE
        fields["routes"] = [None if t is None else [t[0], list(t[1])] for t in typed]
    header = canonical_bytes(fields, finite=finite)
    moved = _PREFIX.size + len(header) + _pad(len(header)) - region_at
    spans = [dataclasses.replace(s, offset=s.offset + moved) for s in spans_in]
    parts: list[Buffer] = [
        _PREFIX.pack(MAGIC, version, len(header)),
        header,
        bytes(_pad(len(header))),
        region,
    ]
    offset = region_at + memoryview(region).nbytes + moved
    routes: list[RouteSpan | None] = []
    for r, t in enumerate(typed):
        if t is None:
            routes.append(None)
            continue
        dtype, shape, data = t
        routes.append(RouteSpan(r, dtype, offset, shape, records[r].get(ROUTES_FIELD)))
        parts += [data, bytes(_pad(len(data)))]
        offset += len(data) + _pad(len(data))
    refers = tuple(None if ref is None else (ref[0], ref[1]) for ref in refs)
    layout_out = TokenLayout(heads, spans, refers, tuple(routes) if version == ROUTES_VERSION else ())
    return b"".join(parts), media_type, layout_out


def routes_array(value: Any) -> tuple[str, tuple[int, int, int], bytes] | None:
    """A record's `routed_experts` as version 3 holds it: (dtype, [tokens, layers, k], little-endian
    bytes), when it is a regular list of lists of lists of integers within int32 (int16 when they
    fit), of `TYPED_FROM_TOKENS` tokens or more; else None (it stays in the record, as JSON).
    Decided on its JSON text, written once in C (`numbers_alone`), by the rule that decides which
    router choices a `/run` body's parse holds as text (`protocol.routes.routes_text`): the array
    written again is that text, so the array read back as lists writes the same text.  numpy parses
    the numbers (the trainer's side; None without it)."""
    if type(value) is RoutesText:
        return value.dtype, value.shape, value.data
    if type(value) is not list or len(value) < TYPED_FROM_TOKENS:
        return None
    text = numbers_alone(value)
    typed = routes_text(text) if text is not None else None
    return None if typed is None else (typed.dtype, typed.shape, typed.data)


def resolve_reply_items(layout: TokenLayout, reply_output: Sequence[Any]) -> TokenLayout:
    """A version 2 layout with each referring record's `output_items` put back from its reply's
    `response.output` (without their token arrays): the records the Gym wrote.  The layout itself in
    version 1.  TokenCodecError when a run is not in the reply (not the reply the records were stored
    beside)."""
    if not layout.reply_items:
        return layout
    records = []
    for r, (head, ref) in enumerate(zip(layout.records, layout.reply_items, strict=True)):
        if ref is None:
            records.append(head)
            continue
        start, stop = ref
        run = reply_output[start:stop]
        if len(run) != stop - start or not all(isinstance(item, dict) for item in run):
            raise TokenCodecError(
                f"record {r} refers to output items {start}..{stop - 1} of its reply, which has "
                f"{len(reply_output)} (not the reply it was stored beside)"
            )
        records.append({**head, "output_items": [_without_arrays(item) for item in run]})
    return TokenLayout(records, layout.spans, (), layout.routes)


def media_version(media_type: str) -> int | None:
    """The binary form's version a media type names (None: not the binary form)."""
    return _MEDIA_VERSION.get(media_type)


def _typed(view: memoryview, start: int, end: int, dtype: str) -> array[Any]:
    arr = array(_TYPECODES[dtype])
    arr.frombytes(view[start:end])
    if _SWAP:
        arr.byteswap()
    return arr


def _values(view: memoryview, span: ArraySpan) -> list[Any]:
    return _typed(view, span.offset, span.end, span.dtype).tolist()


def routes_lists(view: memoryview, span: RouteSpan) -> list[list[list[int]]]:
    """A record's router choices held as an array (version 3), as the nested lists the Gym sent."""
    flat = _typed(view, span.offset, span.end, span.dtype).tolist()
    tokens, layers, k = span.shape
    per_token = layers * k
    return [
        [flat[t * per_token + j * k : t * per_token + (j + 1) * k] for j in range(layers)]
        for t in range(tokens)
    ]


def decode_records(
    content: bytes | bytearray | memoryview, reply_output: Sequence[Any] | None = None
) -> list[dict[str, Any]]:
    """The records of a binary payload as dicts with Python lists (the reference decoder); a version
    2 payload's with `reply_output`, its reply's `response.output` (`reply_output_of`)."""
    layout = read_layout(content)
    if layout.reply_items:
        if reply_output is None:
            raise TokenCodecError("these token records refer to their reply's output items: pass the reply")
        layout = resolve_reply_items(layout, reply_output)
    view = memoryview(content)
    out = []
    for r, head in enumerate(layout.records):
        record = dict(head)
        for name in ARRAY_FIELDS:
            record[name] = _values(view, layout.span(r, name))
        route = layout.route(r)
        if route is not None:
            record[ROUTES_FIELD] = routes_lists(view, route)
        out.append(record)
    return out


def encode_json(records: Sequence[dict[str, Any]]) -> bytes:
    """The JSON reference form: canonical JSON of the record list."""
    return canonical_bytes(list(records))


def decode_json(content: bytes) -> list[dict[str, Any]]:
    try:
        records = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise TokenCodecError(f"token records are not JSON: {exc}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise TokenCodecError("token records must be a JSON list of objects")
    return records


def form_version(content: bytes | bytearray | memoryview) -> int | None:
    """The form version a binary payload's prefix names, unchecked (None: too short for a prefix)."""
    view = memoryview(content)
    if view.nbytes < _PREFIX.size:
        return None
    return int(_PREFIX.unpack_from(view)[1])


def decode_any(content: bytes, media_type: str, reply: Any = None) -> list[dict[str, Any]]:
    """The records of a payload in either form, by its media type; `reply` (the stored reply, as
    JSON) for a version 2 payload."""
    version = media_version(media_type)
    if version is not None:
        found = form_version(content)
        if found is not None and found != version:
            raise TokenCodecError(f"a payload of media type {media_type!r} is of form version {found}")
        return decode_records(content, None if reply is None else reply_output_of(reply))
    if media_type in (TOKENS_JSON_MEDIA_TYPE, "application/json"):
        return decode_json(content)
    raise TokenCodecError(f"token records of media type {media_type!r} have no decoder")


__all__ = [
    "ARRAY_FIELDS",
    "MAGIC",
    "REFERRING_MEDIA_TYPES",
    "REPLY_VERSION",
    "ROUTES_FIELD",
    "ROUTES_VERSION",
    "TOKENS_JSON_MEDIA_TYPE",
    "TOKENS_MEDIA_TYPE",
    "TOKENS_REPLY_MEDIA_TYPE",
    "TOKENS_ROUTES_MEDIA_TYPE",
    "TYPED_FROM_TOKENS",
    "VERSION",
    "ArraySpan",
    "RouteSpan",
    "TokenCodecError",
    "TokenLayout",
    "assemble",
    "assembled",
    "decode_any",
    "decode_json",
    "decode_records",
    "encode_entries",
    "encode_json",
    "encode_records",
    "encoded_entries",
    "form_version",
    "media_version",
    "read_layout",
    "record_of",
    "refer_to_reply",
    "referred",
    "reply_output_of",
    "resolve_reply_items",
    "routes_array",
    "routes_lists",
    "with_arrays",
]
