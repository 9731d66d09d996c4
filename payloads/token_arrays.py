"""Token records as numpy arrays: the trainer's and the workers' side of `protocol.token_codec`.

`decode_arrays` reads a binary payload into views of its buffer (no copy, no per-token Python
object); `encode_arrays` writes the binary form from arrays with the same dtype rule as the Gym
side's list encoder, so both give the same bytes; `canonical` turns any valid binary payload into the
canonical one (the same object when it already is).  numpy is imported here and nowhere below
`payloads`: the Gym side never imports this module.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, SupportsIndex

import numpy as np
import numpy.typing as npt

from protocol.lineage import LineageError, packed_token_digest
from protocol.token_codec import (
    ARRAY_FIELDS,
    NON_FINITE_LOGPROB,
    REPLY_VERSION,
    ROUTES_FIELD,
    ROUTES_VERSION,
    TOKENS_JSON_MEDIA_TYPE,
    ArraySpan,
    TokenCodecError,
    TokenLayout,
    assemble,
    decode_json,
    encode_records,
    form_version,
    media_version,
    read_layout,
    reply_output_of,
    resolve_reply_items,
)

_NUMPY_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "u4": np.dtype("<u4"),
    "i8": np.dtype("<i8"),
    "f4": np.dtype("<f4"),
    "f8": np.dtype("<f8"),
    "i2": np.dtype("<i2"),
    "i4": np.dtype("<i4"),
}
_U4_MAX: Final = 2**32 - 1


@dataclass(frozen=True, slots=True)
class TokenArrays:
    """The token records of one try: each record's other fields, and its arrays as views of `buffer`."""

    layout: TokenLayout
    buffer: bytes | bytearray | memoryview

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.layout.records

    @property
    def resolved(self) -> bool:
        """Whether every record holds its output items (False: a version 2 payload decoded without
        its reply, whose referring records hold none; their arrays and other fields are whole)."""
        return not self.layout.reply_items

    def __len__(self) -> int:
        return len(self.layout.records)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        """Pickled as the payload's bytes (they cross Ray): the header inside them gives the records
        and spans back (`read_layout`, not re-encoded: they were read once already), never a Python
        object per token, nor the records a second time.  Only a layout whose output items were put
        back from the reply (`resolve_reply_items`) ships its records beside the bytes.  From
        protocol 5 the bytes go as a `PickleBuffer` (out of band, no copy, where the pickler takes
        buffers: Ray's does); a `bytearray` comes back as one, read-only bytes as bytes."""
        view = memoryview(self.buffer)
        resolved = form_version(view) in (REPLY_VERSION, ROUTES_VERSION) and not self.layout.reply_items
        data: Any
        if int(protocol) >= 5:
            data = pickle.PickleBuffer(self.buffer)
        else:
            data = self.buffer if isinstance(self.buffer, bytes | bytearray) else view.tobytes()
        return _token_arrays_of, (data, self.layout.records if resolved else None)

    def array(self, record: int, field: str) -> npt.NDArray[Any]:
        span = self.layout.span(record, field)
        return np.frombuffer(
            self.buffer, dtype=_NUMPY_DTYPES[span.dtype], count=span.count, offset=span.offset
        )

    def routes(self, record: int) -> Any:
        """A record's router choices (`routed_experts`): a read-only int16 or int32 array shaped
        `[tokens, layers, k]` where the form holds them as one (version 3), else the record's own
        JSON value (nested lists, NeMo RL's envelope string), or None when it has none."""
        span = self.layout.route(record)
        if span is None:
            return self.layout.records[record].get(ROUTES_FIELD)
        values = np.frombuffer(
            self.buffer, dtype=_NUMPY_DTYPES[span.dtype], count=span.count, offset=span.offset
        )
        return values.reshape(span.shape)

    def prompt(self, record: int) -> npt.NDArray[Any]:
        return self.array(record, "prompt_token_ids")

    def generation(self, record: int) -> npt.NDArray[Any]:
        return self.array(record, "generation_token_ids")

    def logprobs(self, record: int) -> npt.NDArray[Any]:
        return self.array(record, "generation_log_probs")

    @property
    def model_call_ids(self) -> list[str]:
        return [str(r.get("model_call_id")) for r in self.layout.records]

    @property
    def token_count(self) -> int:
        """Generated tokens over every record."""
        return self.layout.generated()

    @property
    def total_tokens(self) -> int:
        """Prompt and generated tokens over every record (each call's prompt counted whole)."""
        return sum(s.count for s in self.layout.spans if s.field != "generation_log_probs")

    def full_prompts(self) -> list[npt.NDArray[np.int64]]:
        """Every record's full prompt (int64), in order: a delta prompt (`prompt_is_delta`) rebuilt
        from its parent chain, the parent's full sequence then the suffix, each rebuilt sequence
        checked against its record's `digest`: `protocol.lineage.full_prompts` over arrays (held to
        it by tests).  `LineageError` names the first record whose chain is broken."""
        heads = self.layout.records
        by_id = {h.get("model_call_id"): i for i, h in enumerate(heads)}
        sequences: dict[int, npt.NDArray[np.int64]] = {}

        def sequence_of(index: int) -> npt.NDArray[np.int64]:
            call_id = heads[index].get("model_call_id")
            path: list[int] = []
            current: int | None = index
            while current not in sequences:
                assert current is not None
                if current in path:
                    raise LineageError(f"model call {call_id!r}: its parent chain is a cycle")
                path.append(current)
                if not heads[current].get("prompt_is_delta"):
                    break
                parent = heads[current].get("parent_call_id")
                current = by_id.get(parent)
                if current is None:
                    raise LineageError(
                        f"model call {call_id!r}: its parent {parent!r} is not among the records"
                    )
            for k in reversed(path):
                head = heads[k]
                prompt = self.prompt(k).astype(np.int64)
                if head.get("prompt_is_delta"):
                    prompt = np.concatenate([sequences[by_id[head.get("parent_call_id")]], prompt])
                full = np.concatenate([prompt, self.generation(k).astype(np.int64)])
                digest = head.get("digest")
                if digest is not None and _digest(full) != digest:
                    raise LineageError(
                        f"model call {head.get('model_call_id')!r}: its rebuilt sequence does not match its digest"
                    )
                sequences[k] = full
            return sequences[index]

        prompts = []
        for r, head in enumerate(heads):
            if not head.get("prompt_is_delta"):
                prompts.append(self.prompt(r).astype(np.int64))
                continue
            full = sequence_of(r)
            prompts.append(full[: full.size - self.layout.span(r, "generation_token_ids").count])
        return prompts

    def to_records(self) -> list[dict[str, Any]]:
        """Each record as a dict with Python lists (the slow, lossless way back)."""
        if not self.resolved:
            raise TokenCodecError(
                "these token records refer to their reply's output items: decode them with it"
            )
        out = []
        for r, head in enumerate(self.layout.records):
            record = dict(head)
            for name in ARRAY_FIELDS:
                record[name] = self.array(r, name).tolist()
            routes = self.routes(r)
            if isinstance(routes, np.ndarray):
                record[ROUTES_FIELD] = routes.tolist()
            out.append(record)
        return out


def _digest(ids: npt.NDArray[np.int64]) -> str:
    if ids.size and int(ids.min()) < 0:
        raise LineageError("token ids must be in 0..2**64-1")
    return packed_token_digest(int(ids.size), ids.astype(">u8").tobytes())


def _token_arrays_of(data: Any, records: list[dict[str, Any]] | None) -> TokenArrays:
    """A pickled `TokenArrays` back: its layout read again from the bytes (`TokenArrays.__reduce_ex__`)."""
    content = data if isinstance(data, bytes | bytearray | memoryview) else memoryview(data)
    layout = read_layout(content, check_canonical=False)
    if records is not None:
        layout = TokenLayout(records, layout.spans, (), layout.routes)
    return TokenArrays(layout, content)


def decode_arrays(
    content: bytes | bytearray | memoryview,
    *,
    check_canonical: bool = True,
    reply: Any = None,
    routes_as_text: bool = False,
) -> TokenArrays:
    """The binary payload as views of `content` (pass a bytearray for writable arrays);
    `check_canonical=False` for bytes read by a claim and checked against its digest
    (`read_layout`).  `reply`, the stored reply as JSON, puts a version 2 payload's output items
    back (`protocol.token_codec.resolve_reply_items`); without it they stay out (`resolved`).
    `routes_as_text`: router choices in the records held as their text (`read_layout`)."""
    layout = read_layout(content, check_canonical=check_canonical, routes_as_text=routes_as_text)
    if layout.reply_items and reply is not None:
        layout = resolve_reply_items(layout, reply_output_of(reply))
    return TokenArrays(layout, content)


def decode_payload(
    content: bytes | bytearray, media_type: str, *, check_canonical: bool = True, reply: Any = None
) -> TokenArrays:
    """Token records stored in any form as arrays: the binary forms as views, the JSON reference
    form (what older logs hold) converted once.  `check_canonical=False` for a payload the plane
    read by its claim (checked against the digest): the binary header is not re-encoded.  `reply`:
    the try's stored reply as JSON, for the output items a version 2 payload refers to."""
    version = media_version(media_type)
    if version is not None:
        arrays = decode_arrays(content, check_canonical=check_canonical, reply=reply)
        if content[4] != version:  # the prefix's version byte (read_layout checked the prefix)
            raise TokenCodecError(f"a payload of media type {media_type!r} is of form version {content[4]}")
        return arrays
    if media_type in (TOKENS_JSON_MEDIA_TYPE, "application/json"):
        return decode_arrays(encode_records(decode_json(bytes(content))))
    raise TokenCodecError(f"token records of media type {media_type!r} have no decoder")


def _ids(values: npt.ArrayLike) -> tuple[str, bytes]:
    arr = np.asarray(values)
    if arr.size == 0:
        return "u4", b""
    if arr.dtype.kind not in "iu":
        raise TokenCodecError(f"token ids of dtype {arr.dtype} are not integers")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > np.iinfo(np.int64).max:
        raise TokenCodecError("a token id is outside the 64-bit range")
    if int(arr.min()) >= 0 and int(arr.max()) <= _U4_MAX:
        return "u4", arr.astype("<u4", copy=False).tobytes()
    return "i8", arr.astype("<i8", copy=False).tobytes()


def _logprobs(values: npt.ArrayLike) -> tuple[str, bytes]:
    arr = np.asarray(values)
    if arr.size == 0:
        return "f4", b""
    if arr.dtype.kind != "f":
        arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        raise TokenCodecError(NON_FINITE_LOGPROB)
    with np.errstate(over="ignore"):  # a value past float32's range becomes inf, hence f8
        narrow = arr.astype("<f4")
    if arr.dtype.itemsize <= 4 or np.array_equal(narrow.astype(np.float64), arr):
        return "f4", narrow.tobytes()
    return "f8", arr.astype("<f8", copy=False).tobytes()


def encode_arrays(
    records: Sequence[dict[str, Any]],
    prompts: Sequence[npt.ArrayLike],
    generations: Sequence[npt.ArrayLike],
    logprobs: Sequence[npt.ArrayLike],
) -> bytes:
    """The binary form from each record's other fields and its three arrays."""
    if not len(records) == len(prompts) == len(generations) == len(logprobs):
        raise TokenCodecError("one prompt, generation and logprob array per record")
    arrays: list[tuple[str, bytes]] = []
    for prompt, generation, values in zip(prompts, generations, logprobs, strict=True):
        gen = _ids(generation)
        lps = _logprobs(values)
        if len(gen[1]) // (4 if gen[0] == "u4" else 8) != len(lps[1]) // (4 if lps[0] == "f4" else 8):
            raise TokenCodecError("generation_token_ids and generation_log_probs differ in length")
        arrays += [_ids(prompt), gen, lps]
    heads = [{k: v for k, v in r.items() if k not in ARRAY_FIELDS} for r in records]
    return assemble(heads, arrays)


def _in_canonical_dtype(arrays: TokenArrays, span: ArraySpan) -> bool:
    """Whether an array is in the dtype the form's rule gives its values (one vectorised pass; a
    NaN or infinite logprob is no form at all: TokenCodecError, as the encoders say)."""
    if span.dtype == "u4":
        return True  # the narrowest: any values in it are canonical
    values = arrays.array(span.record, span.field)
    if span.dtype == "i8":
        return values.size > 0 and not (int(values.min()) >= 0 and int(values.max()) <= _U4_MAX)
    # A float64 sum is finite exactly when every value is (float32 values cannot overflow it).
    with np.errstate(over="ignore", invalid="ignore"):
        total = float(values.sum(dtype=np.float64))
    if not math.isfinite(total) and not np.isfinite(values).all():
        raise TokenCodecError(NON_FINITE_LOGPROB)
    if span.dtype == "f4":
        return True
    with np.errstate(over="ignore"):
        narrow = values.astype("<f4")
    return values.size > 0 and not np.array_equal(narrow.astype(np.float64), values)


def canonical_arrays(content: bytes | memoryview, *, routes_as_text: bool = False) -> TokenArrays:
    """The records of a binary payload as arrays over their canonical form: over `content` itself
    when it is canonical (its header checked by `read_layout`, each array's dtype by one vectorised
    pass, nothing re-encoded), else over that form, encoded once.  TokenCodecError when `content`
    is no binary token payload at all.  `routes_as_text`: as `read_layout` takes it."""
    arrays = decode_arrays(content, routes_as_text=routes_as_text)
    if all(_in_canonical_dtype(arrays, span) for span in arrays.layout.spans):
        return arrays
    return decode_arrays(
        encode_arrays(
            arrays.records,
            [arrays.prompt(r) for r in range(len(arrays))],
            [arrays.generation(r) for r in range(len(arrays))],
            [arrays.logprobs(r) for r in range(len(arrays))],
        )
    )


def canonical(content: bytes) -> bytes:
    """`content` if it is the canonical binary form of its records, else that form (TokenCodecError
    when it is no binary token payload at all)."""
    buffer = canonical_arrays(content).buffer
    assert isinstance(buffer, bytes)
    return buffer


__all__ = [
    "TokenArrays",
    "canonical",
    "canonical_arrays",
    "decode_arrays",
    "decode_payload",
    "encode_arrays",
]
