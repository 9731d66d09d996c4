"""The token codec: the binary form against the JSON reference, lists against numpy, every dtype,
ragged lengths, and the payloads a reader must refuse."""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from payloads.token_arrays import canonical, canonical_arrays, decode_arrays, decode_payload, encode_arrays
from protocol import token_codec
from protocol.digests import same_json
from protocol.lineage import LineageError, full_prompts, link_call, token_digest
from protocol.token_codec import (
    NON_FINITE_LOGPROB,
    TOKENS_JSON_MEDIA_TYPE,
    TOKENS_MEDIA_TYPE,
    TokenCodecError,
    assemble,
    assembled,
    decode_json,
    decode_records,
    encode_entries,
    encode_json,
    encode_records,
    encoded_entries,
    read_layout,
    with_arrays,
)
from protocol.wire import TokenEntry
from tests.gym.test_token_records import _delta_chain

small_ids = st.lists(st.integers(0, 2**32 - 1), max_size=40)
wide_ids = st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=10)
f32_values = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=40)
f64_values = st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=40)


@st.composite
def records(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for i in range(draw(st.integers(0, 4))):
        prompt = draw(small_ids | wide_ids)
        lps = draw(f32_values | f64_values)
        gen = draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(lps), max_size=len(lps)))
        record: dict[str, Any] = {
            "rollout_id": "g1_g0",
            "model_call_id": f"call-{i + 1}",
            "prompt_token_ids": prompt,
            "generation_token_ids": gen,
            "generation_log_probs": lps,
        }
        # Every other field rides in the header as it was set: lineage fields, extras, nested JSON.
        record.update(draw(st.dictionaries(st.sampled_from(["model", "created_at", "cum_len", "x_extra"]),
                                           st.none() | st.integers(-5, 5) | st.text(max_size=5) | st.floats(allow_nan=False, allow_infinity=False),
                                           max_size=3)))  # fmt: skip
        out.append(record)
    return out


# Ragged records are big draws: on a loaded machine their generation alone trips the too-slow check.
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records())
def test_both_forms_round_trip_and_both_encoders_write_the_same_bytes(recs: list[dict[str, Any]]) -> None:
    binary = encode_records(recs)
    assert decode_records(binary) == recs
    assert decode_json(encode_json(recs)) == recs
    arrays = decode_arrays(binary)
    assert arrays.to_records() == recs
    again = encode_arrays(
        arrays.records,
        [np.asarray(r["prompt_token_ids"], dtype=np.int64) if r["prompt_token_ids"] else [] for r in recs],
        [np.asarray(r["generation_token_ids"], dtype=np.uint64) for r in recs],
        [np.asarray(r["generation_log_probs"], dtype=np.float64) for r in recs],
    )
    assert again == binary
    assert canonical(binary) is binary
    assert decode_payload(encode_json(recs), TOKENS_JSON_MEDIA_TYPE).to_records() == recs
    # TokenEntry records (the Gym side) pack their own lists: the bytes of their records as they travel
    entries = []
    for record in recs:
        with contextlib.suppress(ValidationError):
            entries.append(TokenEntry.model_validate(record))
    assert encode_entries(entries) == encode_records([e.record() for e in entries])
    # The writer's own layout of its bytes is the one a read gives (the trainer's reduced mode
    # takes it instead of reading its header back).
    written, layout = encoded_entries(entries)
    assert written == encode_entries(entries) and layout == read_layout(written)
    assert assembled([], []) == (assemble([], []), read_layout(assemble([], [])))


def test_routed_experts_are_written_as_the_dump_would_write_them() -> None:
    """A record's router choices (a list of lists per token) go into its header as they are, not
    copied by its dump: the same bytes as the dump's copy, whatever they hold."""
    base = {"rollout_id": "k", "model_call_id": "call-1", "prompt_token_ids": [1, 2],
            "generation_token_ids": [3, 4], "generation_log_probs": [-0.5, -1e-7]}  # fmt: skip
    routes: Any
    for routes in ([[[1, 2]], [[3, 4]]], [[1.5, 2], [True, 0]], [[1, None]], [["a"]], [[]], [(1, 2)], (1, 2)):
        entry = TokenEntry.model_validate(base | {"routed_experts": routes})
        head = entry.model_dump(mode="json", exclude_unset=True)
        want = encode_records([head])
        written, layout = encoded_entries([entry])
        assert written == want == encode_entries([entry]), routes
        read = read_layout(written)  # the same JSON values (a tuple given stays one in the writer's)
        assert layout.spans == read.spans and same_json(layout.records, read.records)


@pytest.mark.parametrize("created_at", ["INF", "-Infinity", "nan", float("inf")])
def test_a_record_whose_created_at_is_not_finite_is_refused_as_a_record(created_at: Any) -> None:
    """The header is canonical JSON, which has no infinity: such a record is refused when it is
    read as a TokenEntry (a ValidationError its readers report), never a ValueError at encode."""
    record = {"rollout_id": "g1_g0", "model_call_id": "c1", "prompt_token_ids": [1],
              "generation_token_ids": [], "generation_log_probs": [], "created_at": created_at}  # fmt: skip
    with pytest.raises(ValidationError, match="created_at"):
        TokenEntry.model_validate(record)


def test_each_dtype_is_chosen_by_the_values() -> None:
    recs = [
        {"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]},
        {"prompt_token_ids": [-1], "generation_token_ids": [2**40], "generation_log_probs": [-0.1]},
    ]
    layout = read_layout(encode_records(recs))
    assert [s.dtype for s in layout.spans] == ["u4", "u4", "f4", "i8", "i8", "f8"]
    arrays = decode_arrays(encode_records(recs))
    assert arrays.generation(1).dtype == np.dtype("<i8") and arrays.logprobs(1)[0] == -0.1
    assert (arrays.token_count, arrays.total_tokens) == (2, 5)
    # past float32's range (packing it as float32 overflows): f8, the value kept exactly
    [past] = decode_records(encode_records([{**recs[0], "generation_log_probs": [-1e300]}]))
    assert past["generation_log_probs"] == [-1e300]


def test_a_non_canonical_encoding_is_made_canonical() -> None:
    recs = [{"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-0.5]}]
    wide = assemble(
        [{}],
        [("i8", np.array([1, 2], "<i8").tobytes()), ("i8", np.array([3], "<i8").tobytes()),
         ("f8", np.array([-0.5], "<f8").tobytes())],
    )  # fmt: skip
    assert decode_records(wide) == recs
    assert canonical(wide) == encode_records(recs) != wide


def test_a_token_entry_comes_back_with_exactly_the_fields_that_were_set() -> None:
    entry = TokenEntry(
        rollout_id="g1_g0",
        model_call_id="call-1",
        model="m",
        prompt_token_ids=[5, 6, 7],
        generation_token_ids=[8, 9],
        generation_log_probs=[-0.125, -2.5],
        output_items=[{"type": "message", "id": "x"}],
        token_item_index=0,
        created_at=12.5,
    )
    record = entry.model_dump(mode="json", exclude_unset=True)
    [back] = decode_records(encode_records([record]))
    again = TokenEntry.model_validate(back)
    assert again == entry
    assert again.model_fields_set == entry.model_fields_set


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:10], "too short"),
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:4] + b"\x04" + b[5:], "form version 4"),
        (lambda b: b + b"\0" * 8, "follow the last array"),
        (lambda b: b[:-1], "runs past the end|follow the last"),
        (lambda b: b[:8] + struct.pack("<Q", 10**9) + b[16:], "does not fit"),
        (lambda b: b[:16] + b"[" + b[17:], "not JSON|not canonical"),
        (lambda b: b[:-2] + b"\x01\x00", "padding"),
    ],
)
def test_a_damaged_payload_is_refused_with_its_reason(damage: Any, message: str) -> None:
    good = encode_records(
        [{"prompt_token_ids": [1, 2, 3], "generation_token_ids": [4], "generation_log_probs": [-1.0]}]
    )
    with pytest.raises(TokenCodecError, match=message):
        read_layout(damage(good))


def test_records_without_a_binary_form_are_refused() -> None:
    with pytest.raises(TokenCodecError, match="NaN or infinite"):
        encode_records(
            [{"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [float("nan")]}]
        )
    with pytest.raises(TokenCodecError, match="64-bit"):
        encode_records(
            [{"prompt_token_ids": [2**64], "generation_token_ids": [], "generation_log_probs": []}]
        )
    with pytest.raises(TokenCodecError, match="not an integer"):
        encode_records([{"prompt_token_ids": [1.5], "generation_token_ids": [], "generation_log_probs": []}])
    with pytest.raises(TokenCodecError, match="lacks generation_log_probs"):
        encode_records([{"prompt_token_ids": [1], "generation_token_ids": [2]}])
    assert TOKENS_MEDIA_TYPE.startswith("application/vnd.rollout-ledger.tokens")


def test_arrays_rebuild_delta_prompts_exactly_as_the_lineage_reader_does() -> None:
    c1, c2, c3 = _delta_chain()
    for records in ([c3, c1, c2], [c1, c2, c3], [c1]):
        arrays = decode_arrays(encode_entries(records))
        assert [p.tolist() for p in arrays.full_prompts()] == full_prompts(records)
    with pytest.raises(LineageError, match=r"'c3'.*parent 'c2' is not among"):
        decode_arrays(encode_entries([c1, c3])).full_prompts()
    forged = c2.model_copy(update={"prompt_token_ids": [6, 0]})
    with pytest.raises(LineageError, match=r"'c2'.*does not match its digest"):
        decode_arrays(encode_entries([c1, forged, c3])).full_prompts()
    looped = c1.model_copy(update={"prompt_is_delta": True, "parent_call_id": "c3"})
    with pytest.raises(LineageError, match="cycle"):
        decode_arrays(encode_entries([looped, c2, c3])).full_prompts()


def _widened(recs: list[dict[str, Any]]) -> bytes:
    """The records in the widest dtypes (i8 ids, f8 logprobs): a valid form, never the canonical one
    unless the values need them."""
    arrays: list[tuple[str, bytes]] = []
    for r in recs:
        arrays += [
            ("i8", np.asarray(r["prompt_token_ids"], dtype="<i8").tobytes()),
            ("i8", np.asarray(r["generation_token_ids"], dtype="<i8").tobytes()),
            ("f8", np.asarray(r["generation_log_probs"], dtype="<f8").tobytes()),
        ]
    heads = [{k: v for k, v in r.items() if not k.startswith(("prompt_", "generation_"))} for r in recs]
    return assemble(heads, arrays)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records())
def test_the_canonical_check_without_re_encoding_agrees_with_the_encoders(recs: list[dict[str, Any]]) -> None:
    binary = encode_records(recs)
    assert canonical_arrays(binary).buffer is binary  # canonical: the same bytes, nothing re-encoded
    wide = _widened(recs)
    assert canonical(wide) == binary
    assert (canonical(wide) is wide) == (wide == binary)


@pytest.mark.parametrize("dtype", ["<f4", "<f8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_logprob_that_is_no_number_has_no_canonical_form(dtype: str, bad: float) -> None:
    content = assemble(
        [{}],
        [("u4", np.array([1], "<u4").tobytes()), ("u4", np.array([2, 3], "<u4").tobytes()),
         (dtype[1:], np.array([-0.5, bad], dtype).tobytes())],
    )  # fmt: skip
    assert decode_arrays(content).logprobs(0).size == 2  # the layout alone is sound
    with pytest.raises(TokenCodecError, match="NaN or infinite"):
        canonical(content)


def test_a_payload_checked_by_its_digest_is_read_without_re_encoding_its_header() -> None:
    good = encode_records(
        [{"prompt_token_ids": [1, 2], "generation_token_ids": [3], "generation_log_probs": [-1.0]}]
    )
    (header_len,) = struct.unpack_from("<Q", good, 8)
    arrays_at = 16 + header_len + -header_len % 8
    spaced = json.dumps(json.loads(good[16 : 16 + header_len]), sort_keys=True).encode()  # ", " and ": "
    loose = good[:8] + struct.pack("<Q", len(spaced)) + spaced + bytes(-len(spaced) % 8) + good[arrays_at:]
    with pytest.raises(TokenCodecError, match="not canonical"):
        decode_arrays(loose)
    assert decode_arrays(loose, check_canonical=False).generation(0).tolist() == [3]


def _as_given(content: bytes, kind: str) -> bytes | bytearray | memoryview:
    if kind == "bytes":
        return content
    if kind == "bytearray":
        return bytearray(content)
    return memoryview(b"\xff" * 5 + content + b"\xff" * 3)[5:-3]  # read-only, inside a larger buffer


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
def test_the_header_is_checked_canonical_in_place_however_the_payload_is_held(kind: str) -> None:
    """A header of the canonical length that is not canonical is refused however the payload is held:
    its keys out of order, a space inside a value moved after it, or its canonical text followed by a
    space (the re-encoding is then a prefix of the header, not the header)."""
    good = encode_records(
        [
            {
                "prompt_token_ids": [1, 2],
                "generation_token_ids": [3],
                "generation_log_probs": [-1.0],
                "z": "a b",
            }
        ]
    )
    (header_len,) = struct.unpack_from("<Q", good, 8)
    raw = good[16 : 16 + header_len]
    header = json.loads(raw)
    bad_headers = [
        json.dumps(dict(reversed(header.items())), separators=(",", ":")).encode(),
        raw.replace(b'"a b"}', b'"ab" }'),
        raw.replace(b'"a b"', b'"ab"') + b" ",
    ]
    assert read_layout(_as_given(good, kind)).records == [{"z": "a b"}]
    for bad in bad_headers:
        assert len(bad) == header_len and bad != raw
        damaged = good[:16] + bad + good[16 + header_len :]
        with pytest.raises(TokenCodecError, match="the header is not canonical JSON"):
            read_layout(_as_given(damaged, kind))
        assert read_layout(_as_given(damaged, kind), check_canonical=False).spans == read_layout(good).spans


u32_ids = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@settings(max_examples=200, deadline=None)
@given(u32_ids, f32_values.flatmap(lambda lps: st.tuples(st.just(lps), st.lists(
    st.integers(0, 2**32 - 1), min_size=len(lps), max_size=len(lps)))), st.booleans())  # fmt: skip
def test_a_record_encoded_from_its_arrays_gives_the_bytes_and_digest_of_its_lists(
    prompt: list[int], generation: tuple[list[float], list[int]], all_three: bool
) -> None:
    """`with_arrays` (zero work's pool): the arrays beside the lists give the very bytes the lists
    give, and the same lineage digest; one left out is packed from its list."""
    lps, gen = generation
    entry = TokenEntry(
        rollout_id="g1_g0", model_call_id="call-1", prompt_token_ids=prompt,
        generation_token_ids=gen, generation_log_probs=lps, output_items=[{"type": "message"}],
    )  # fmt: skip
    plain = encode_entries([entry])
    packed = with_arrays(
        entry.model_copy(),
        np.asarray(prompt, dtype=np.uint32).data if all_three else None,
        np.asarray(gen, dtype=np.uint32).data,
        np.asarray(lps, dtype=np.float32).data,
    )
    assert packed.packed_arrays()[0] is None or all_three
    assert packed.packed_arrays()[1] is not None and packed == entry  # a cache, not a field
    assert encode_entries([packed]) == plain == encode_records([entry.record()])
    assert (
        link_call(packed, None, []).digest == link_call(entry, None, []).digest == token_digest(prompt + gen)
    )


def test_arrays_count_only_beside_their_own_lists_and_are_checked() -> None:
    entry = TokenEntry(
        rollout_id="g1_g0", model_call_id="call-1", prompt_token_ids=[1, 2],
        generation_token_ids=[3, 4], generation_log_probs=[-0.5, -0.25],
    )  # fmt: skip
    packed = with_arrays(
        entry,
        np.array([1, 2], np.uint32).data,
        np.array([3, 4], np.uint32).data,
        np.array([-0.5, -0.25], np.float32).data,
    )
    assert all(a is not None for a in packed.packed_arrays())
    # a copy that replaces a list drops them (its bytes are its lists'), one that keeps them keeps them
    other = packed.model_copy(update={"generation_token_ids": [5, 6]})
    assert other.packed_arrays() == (None, None, None)
    assert decode_records(encode_entries([other]))[0]["generation_token_ids"] == [5, 6]
    assert packed.model_copy(update={"model": "m"}).packed_arrays() == packed.packed_arrays()
    # a list grown in place is the same list with other values: its old bytes are not given for it
    grown = with_arrays(
        TokenEntry.model_validate(entry.record()), np.array([1, 2], np.uint32).data,
        np.array([3, 4], np.uint32).data, np.array([-0.5, -0.25], np.float32).data,
    )  # fmt: skip
    grown.generation_token_ids.append(7)
    grown.generation_log_probs.append(-1.0)
    assert grown.packed_arrays() == (None, None, None)
    assert decode_records(encode_entries([grown]))[0]["generation_token_ids"] == [3, 4, 7]
    fresh = TokenEntry.model_validate(entry.record())
    with pytest.raises(TokenCodecError, match="given as a buffer of format"):
        with_arrays(fresh, np.array([1, 2], np.int64).data)
    with pytest.raises(TokenCodecError, match="3 values in the buffer, 2 in the record"):
        with_arrays(fresh, None, np.array([3, 4, 5], np.uint32).data)
    for bad in (np.nan, np.inf, -np.inf):
        with pytest.raises(TokenCodecError, match="NaN or infinite"):
            with_arrays(fresh, None, None, np.array([-0.5, bad], np.float32).data)
    # a high byte of 0x7f / 0xff that is finite (within a factor 2 of float32's largest): kept
    big = np.array([3.0e38, -3.0e38], np.float32)
    wide = TokenEntry.model_validate({**entry.record(), "generation_log_probs": big.tolist()})
    assert encode_entries([with_arrays(wide, None, None, big.data)]) == encode_entries([wide])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_every_encoder_refuses_a_logprob_that_is_no_number_in_the_one_message(bad: float) -> None:
    """One rule, one message, whatever the logprobs come as: lists, a float32 buffer beside them
    (zero work's pool), numpy arrays, or a payload's own array."""
    entry = TokenEntry(
        rollout_id="g1_g0", model_call_id="call-1", prompt_token_ids=[1],
        generation_token_ids=[2, 3], generation_log_probs=[-0.5, bad],
    )  # fmt: skip
    f4, f8 = np.array([-0.5, bad], "<f4"), np.array([-0.5, bad], "<f8")
    ids = ("u4", np.array([1], "<u4").tobytes()), ("u4", np.array([2, 3], "<u4").tobytes())
    refusals: list[Callable[[], object]] = [
        lambda: encode_records([entry.record()]),
        lambda: encode_entries([entry]),
        lambda: with_arrays(entry.model_copy(), None, None, f4.data),
        lambda: encode_arrays([{}], [[1]], [[2, 3]], [f8]),
        lambda: canonical_arrays(assemble([{}], [*ids, ("f8", f8.tobytes())])),
    ]
    for refused in refusals:
        with pytest.raises(TokenCodecError) as caught:
            refused()
        assert str(caught.value) == NON_FINITE_LOGPROB


@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
def test_token_arrays_pickle_as_their_payloads_bytes(kind: str, protocol: int) -> None:
    """Arrays cross Ray pickled: as the payload's bytes (about its size, not a Python int per token),
    equal arrays and records back, from a memoryview too (which pickle refuses on its own)."""
    import pickle

    ids = list(range(5000))
    good = encode_records(
        [{"prompt_token_ids": ids, "generation_token_ids": ids[:3000], "generation_log_probs": [-0.5] * 3000,
          "model_call_id": "call-1", "output_items": [{"type": "message", "text": "x" * 100}]}]
    )  # fmt: skip
    arrays = decode_arrays(_as_given(good, kind))
    pickled = pickle.dumps(arrays, protocol=protocol)
    assert len(good) <= len(pickled) <= len(good) + 200
    back = pickle.loads(pickled)
    assert back.records == arrays.records and back.layout.spans == arrays.layout.spans
    for field in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
        assert np.array_equal(back.array(0, field), arrays.array(0, field))
    assert back.array(0, "prompt_token_ids").flags.writeable == (kind == "bytearray")
    # Out of band (Ray's pickler takes the buffers): the bytes are not in the pickle at all.
    buffers: list[pickle.PickleBuffer] = []
    small = pickle.dumps(arrays, protocol=5, buffer_callback=buffers.append)
    assert len(small) < 200 and len(buffers) == 1
    assert pickle.loads(small, buffers=buffers).records == arrays.records


def test_token_arrays_resolved_from_their_reply_pickle_with_their_records() -> None:
    """A version 2 payload read with its reply holds records its bytes do not: they ship beside them."""
    import pickle

    from protocol.token_codec import refer_to_reply

    items = [{"type": "message", "text": "y" * 50}]
    v1 = encode_records(
        [
            {
                "prompt_token_ids": [1, 2],
                "generation_token_ids": [3],
                "generation_log_probs": [-1.0],
                "output_items": items,
            }
        ]
    )
    reply = {"response": {"output": items}}
    v2, _ = refer_to_reply(v1, reply["response"]["output"])
    resolved = decode_arrays(v2, reply=reply)
    back = pickle.loads(pickle.dumps(resolved))
    assert back.resolved and back.records == resolved.records == read_layout(v1).records
    unresolved = pickle.loads(pickle.dumps(decode_arrays(v2)))
    assert not unresolved.resolved and unresolved.layout.reply_items == ((0, 1),)


_LOGPROB_EDGES = (
    float("nan"),
    float("inf"),
    -float("inf"),
    1e39,
    -3.5e38,
    3.4028235e38,
    3.4028236e38,
    1e-46,
    1.401298464324817e-45,
    5e-324,
    -0.0,
    0,
    True,
    2**1100,
    "x",
    None,
    -0.1,
    -1e-7,
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=64, max_size=300),
    st.lists(st.tuples(st.integers(0, 299), st.sampled_from(_LOGPROB_EDGES)), max_size=3),
)
def test_logprobs_dtype_is_the_same_with_numpy_and_without(values: list[Any], edits: list[Any]) -> None:
    """Long logprob lists are decided with numpy (`_logprob_dtype_numpy`): the same dtype and bytes,
    or the same refusal, as the standard library's way gives, float32 values edited to float64 ones,
    past float32's range, subnormal, not finite, or not numbers at all."""
    for at, value in edits:
        values[at % len(values)] = value

    def decided() -> Any:
        try:
            return token_codec.logprob_dtype_of(values)
        except Exception as exc:  # the refusal itself is compared
            return type(exc), str(exc)

    with_numpy = decided()
    with mock.patch.object(token_codec, "_np", None):
        assert decided() == with_numpy
