"""Token records with their router choices typed (form version 3): a MoE reply's `routed_experts`, a
list per token, is stored beside the reply as one int16 or int32 array `[tokens, layers, k]`; read
back it is the lists the agent sent, text for text, and anything that is not such a list stays in its
record as JSON."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from payloads.replies import REPLY_APART_MEDIA_TYPE, put_arrays_back, reply_to_store, take_arrays_off
from payloads.token_arrays import decode_arrays, decode_payload
from protocol.digests import canonical_bytes
from protocol.token_codec import (
    TOKENS_REPLY_MEDIA_TYPE,
    TOKENS_ROUTES_MEDIA_TYPE,
    TYPED_FROM_TOKENS,
    TokenCodecError,
    decode_any,
    decode_records,
    encode_entries,
    encode_records,
    read_layout,
    referred,
    reply_output_of,
)
from protocol.tokens import token_records_from_reply
from protocol.wire import gym_reply
from tests.gym.test_token_records import ANSWER, TOOL_CALL, TOOL_OUTPUT, _carrier, _reply
from tests.payloads.test_reply_apart import audit_apart
from tests.payloads.test_reply_items import _stored

# 65 generated tokens' choices, one MoE layer, two experts each (a real Gym stub model's shape): past
# the length from which they are typed, their 260 bytes padded to 264.
ROUTES = [[[t % 64, (t * 7) % 64]] for t in range(65)]
OTHER = [*ROUTES[:-1], [[63, 62]]]


def _many(tokens: list[Any]) -> list[Any]:
    """`tokens` repeated past `TYPED_FROM_TOKENS` tokens (its shape kept, ragged or not)."""
    return tokens * (TYPED_FROM_TOKENS // len(tokens) + 1)


def _with_routes(first: Any, second: Any = None) -> tuple[bytes, dict[str, Any]]:
    """A plain Gym agent's reply whose two calls carry `first` and `second` as their router choices
    (None: that call has none), and its records read off it in the binary form, version 1."""
    extra = {} if second is None else {"routed_experts": second}
    reply = _reply(
        [
            _carrier("function_call", [1, 2, 3], [4, 5, 7], routed_experts=first, **TOOL_CALL),
            TOOL_OUTPUT,
            _carrier("message", [1, 2, 3, 4, 5, 7, 9], [6], **ANSWER, **extra),
        ]
    )
    return encode_entries(token_records_from_reply(reply, "k", 7.0)), _stored(reply.payload())


@pytest.mark.parametrize(
    ("routes", "dtype"),
    [
        (ROUTES, "i2"),
        (_many([[[-(2**15), 2**15 - 1]]]), "i2"),
        (_many([[[0, 2**15]]]), "i4"),
        (_many([[[-(2**15) - 1, 0]]]), "i4"),
        (_many([[[-(2**31), 2**31 - 1]]]), "i4"),
        (_many([[[1, 2], [3, 4], [5, 6]], [[7, 8], [9, 10], [11, 12]]]), "i2"),  # three layers
        (ROUTES[: TYPED_FROM_TOKENS - 1], None),  # too few tokens to be worth an array
        (_many([[[0, 2**31]]]), None),  # past int32
        (_many([[[0, 2**64 - 1]]]), None),  # past int64: read as its limit, refused all the same
        (_many([[[0, -(2**40)]]]), None),
        (_many([[[1, 2]], [[3]]]), None),  # ragged
        (_many([[[1, 2]], [[3, 4], [5, 6]]]), None),  # ragged layers
        (_many([[1, 2], [3, 4]]), None),  # two levels
        (_many([[[[1]]]]), None),  # four
        ([], None),
        (_many([[[]]]), None),
        (_many([[[True, False]]]), None),  # booleans write other text than integers
        (_many([[[1.0, 2.0]]]), None),
        (_many([[["1", "2"]]]), None),
        (_many([[[1, None]]]), None),
        ("nrlre1:int16:3x1x2:AAAAAAAAAAAAAAAA", None),  # NeMo RL's envelope: one string already
    ],
)
def test_router_choices_are_typed_where_they_are_integer_lists_of_one_shape(
    routes: Any, dtype: str | None
) -> None:
    v1, reply = _with_routes(routes)
    stored, media_type, layout = referred(v1, reply_output_of(reply))
    assert read_layout(stored) == layout  # canonical: the header check re-encodes it
    if dtype is None:
        assert media_type == TOKENS_REPLY_MEDIA_TYPE and not layout.routes
        assert layout.records[0]["routed_experts"] == routes
    else:
        assert media_type == TOKENS_ROUTES_MEDIA_TYPE
        span = layout.routes[0]
        assert span is not None and layout.routes[1] is None
        assert (span.dtype, span.shape) == (dtype, (len(routes), len(routes[0]), len(routes[0][0])))
        assert "routed_experts" not in layout.records[0]
    # Lossless either way: the Gym's records, field for field, and version 1's bytes again.
    records = decode_any(stored, media_type, reply)
    assert records == decode_records(v1)
    assert encode_records(records) == v1
    # And the reply stored apart from them comes back whole.
    whole = canonical_bytes(reply)
    apart, apart_type = reply_to_store(reply, whole, stored, media_type, layout)
    assert apart_type == REPLY_APART_MEDIA_TYPE
    assert canonical_bytes(put_arrays_back(orjson.loads(apart), stored)) == whole


def test_training_reads_the_router_choices_as_an_array_with_no_list_per_token() -> None:
    from trainer.ray_gym.results import decode_routes

    v1, reply = _with_routes(ROUTES, OTHER)
    stored, media_type, _ = referred(v1, reply_output_of(reply))
    arrays = decode_payload(stored, media_type, check_canonical=False, reply=reply)
    routes = arrays.routes(0)
    assert isinstance(routes, np.ndarray) and routes.dtype == np.int16 and routes.shape == (65, 1, 2)
    assert routes.tolist() == ROUTES and not routes.flags.writeable
    assert arrays.routes(1).tolist() == OTHER
    assert arrays.to_records() == decode_records(v1)
    tensor = decode_routes(routes, "int32")
    assert tensor.shape == (65, 1, 2) and str(tensor.dtype) == "torch.int32" and tensor.tolist() == ROUTES
    # Across Ray (pickled): the arrays come back from the bytes, the records beside them.
    for protocol in (4, 5):
        back = pickle.loads(pickle.dumps(arrays, protocol=protocol))
        assert back.routes(0).tolist() == ROUTES and back.records == arrays.records
    # Read without its reply, the record's router choices are whole all the same.
    bare = decode_arrays(stored, check_canonical=True)
    assert not bare.resolved and bare.routes(0).tolist() == ROUTES


def test_a_reply_whose_router_choices_are_not_its_records_is_stored_whole() -> None:
    v1, reply = _with_routes(ROUTES)
    stored, media_type, layout = referred(v1, reply_output_of(reply))
    assert media_type == TOKENS_ROUTES_MEDIA_TYPE
    # Compared by identity where the records were made from the reply's own lists, by text otherwise.
    for given_layout in (layout, None):
        assert take_arrays_off(reply, stored, given_layout) == take_arrays_off(reply, stored)
        assert take_arrays_off(reply, stored, given_layout) is not None
    output = list(reply_output_of(reply))
    for other in (OTHER, ROUTES[:-1], [*ROUTES[:-1], [[2, True]]]):
        output[0] = {**output[0], "routed_experts": other}
        edited = {**reply, "response": {**reply["response"], "output": output}}
        assert take_arrays_off(edited, stored, layout) is None, other
        assert take_arrays_off(edited, stored) is None, other


def _rewritten(stored: bytes, edit: Any, tail: Any = None) -> bytes:
    """`stored` (version 3) with its header edited and, with `tail`, the bytes after the records'
    three arrays replaced by `tail(old)`."""
    layout = read_layout(stored)
    header = orjson.loads(stored[16 : 16 + struct.unpack_from("<Q", stored, 8)[0]])
    edit(header)
    raw = canonical_bytes(header)
    start = layout.spans[0].offset
    end = layout.spans[-1].end + (-(layout.spans[-1].end - layout.spans[-1].offset) % 8)
    rest = stored[end:] if tail is None else tail(stored[end:])
    return b"".join(
        [stored[:8], struct.pack("<Q", len(raw)), raw, bytes(-len(raw) % 8), stored[start:end], rest]
    )


def _as_int32(routes: bytes) -> bytes:
    values = np.frombuffer(routes[: 65 * 2 * 2], dtype="<i2").astype("<i4").tobytes()
    return values + bytes(-len(values) % 8)


@pytest.mark.parametrize(
    ("edit", "tail", "message"),
    [
        (lambda h: h.pop("routes"), None, "must hold exactly"),
        (lambda h: h.update(routes=[None, None]), lambda t: b"", "at least one record"),
        (lambda h: h.update(routes=[["i2", [3, 1, 2]]]), None, "one entry per record"),
        (lambda h: h["routes"][0].__setitem__(0, "i8"), None, "is not \\[dtype"),
        (lambda h: h["routes"][0].__setitem__(1, [3, 2]), None, "is not \\[dtype"),
        (lambda h: h["routes"][0].__setitem__(1, [0, 1, 2]), None, "is not \\[dtype"),
        (lambda h: h["routes"][0].__setitem__(1, [3, 1, True]), None, "is not \\[dtype"),
        (lambda h: h["routes"].__setitem__(0, "i2"), None, "is not \\[dtype"),
        (lambda h: h["records"][0].update(routed_experts=ROUTES), None, "both in its fields and as an array"),
        (lambda h: h["routes"][0].__setitem__(1, [300, 1, 2]), None, "past the end"),
        (lambda h: None, lambda t: t + bytes(8), "follow the last array"),
        (lambda h: None, lambda t: t[:261] + b"\x01" + t[262:], "padding between arrays is not zero"),
        (lambda h: h["routes"][0].__setitem__(0, "i4"), _as_int32, "fit int16 and are held as int32"),
    ],
)
def test_a_damaged_routes_header_is_refused_with_its_reason(edit: Any, tail: Any, message: str) -> None:
    v1, reply = _with_routes(ROUTES)
    stored, media_type, _ = referred(v1, reply_output_of(reply))
    assert media_type == TOKENS_ROUTES_MEDIA_TYPE
    assert read_layout(_rewritten(stored, lambda h: None)) == read_layout(stored)  # the rewrite itself
    with pytest.raises(TokenCodecError, match=message):
        decode_arrays(_rewritten(stored, edit, tail))


def test_the_audit_reads_typed_router_choices_back_with_their_reply(tmp_path: Path) -> None:
    """Records of version 3 beside their reply, and the reply stored apart from them: read back with
    the try's reply they are clean; with another try's records, payload-intact names the reply."""
    v1, reply = _with_routes(ROUTES)
    stored, media_type, _ = referred(v1, reply_output_of(reply))
    other_v1, _ = _with_routes(OTHER)
    other, other_type, _ = referred(other_v1, reply_output_of(reply))
    assert media_type == other_type == TOKENS_ROUTES_MEDIA_TYPE
    audit_apart(tmp_path, reply, stored, other, media_type)


def test_a_real_size_reply_keeps_its_router_choices_in_less_than_half_the_bytes() -> None:
    """A 9k-token plain Gym reply with a MoE layer's choices per generated token (1,000 + 8,000)."""
    import random

    from benchmarks.gym_reply import plain_gym_reply
    from benchmarks.token_path import agent_episodes

    [(run_reply, records)] = agent_episodes(1, 1000, 8000, (1, 1))
    payload = _stored(plain_gym_reply(run_reply, records, 0.0, random.Random(0), routed_experts=1))
    rebuilt = token_records_from_reply(gym_reply(payload, "r", 0), "k", 1.0)
    v1 = encode_entries(rebuilt)
    stored, media_type, layout = referred(v1, reply_output_of(payload))
    assert media_type == TOKENS_ROUTES_MEDIA_TYPE
    typed = sum(span.count * 2 for span in layout.routes if span is not None)
    as_json = len(orjson.dumps([r.routed_experts for r in rebuilt]))
    assert typed * 2 < as_json  # 2 bytes a choice against ~6 of text
    assert decode_any(stored, media_type, payload) == decode_records(v1)


def test_without_numpy_the_choices_stay_json_and_version_3_reads_all_the_same() -> None:
    """A participant's core install has no numpy: it never writes version 3 (its records stay in
    version 2's JSON), and its reference decoder reads the trainer's version 3 to the same records."""
    from unittest import mock

    from protocol import token_codec

    v1, reply = _with_routes(ROUTES)
    typed, media_type, _ = referred(v1, reply_output_of(reply))
    with mock.patch.object(token_codec, "_np", None):
        plain, plain_type, layout = referred(v1, reply_output_of(reply))
        assert plain_type == TOKENS_REPLY_MEDIA_TYPE and layout.records[0]["routed_experts"] == ROUTES
        assert (
            decode_any(typed, media_type, reply) == decode_any(plain, plain_type, reply) == decode_records(v1)
        )
