"""Token records stored beside their reply (form version 2): the call's output items refer to the
reply's instead of being stored twice, and come back field for field."""

from __future__ import annotations

import struct
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from payloads.token_arrays import decode_arrays, decode_payload
from protocol.digests import canonical_bytes
from protocol.token_codec import (
    TOKENS_MEDIA_TYPE,
    TOKENS_REPLY_MEDIA_TYPE,
    TokenCodecError,
    decode_any,
    decode_records,
    encode_entries,
    encode_records,
    read_layout,
    refer_to_reply,
    referred,
    reply_output_of,
)
from protocol.tokens import token_records_from_reply
from tests.gym.test_token_records import ANSWER, TOOL_CALL, TOOL_OUTPUT, _carrier, _reply


def _stored(reply_payload: dict[str, Any]) -> dict[str, Any]:
    """The reply as a reader gets it back: its stored canonical JSON, loaded."""
    parsed: dict[str, Any] = orjson.loads(canonical_bytes(reply_payload))
    return parsed


def _two_calls() -> tuple[bytes, dict[str, Any]]:
    """A reply whose output items carry the token arrays (a plain Gym agent's), a tool output
    between its two calls, and the records read off it in the binary form, version 1."""
    reply = _reply(
        [
            _carrier("function_call", [1, 2, 3], [4, 5], **TOOL_CALL),
            TOOL_OUTPUT,
            _carrier("message", [1, 2, 3, 4, 5, 9, 9], [6], **ANSWER),
        ]
    )
    return encode_entries(token_records_from_reply(reply, "k", 7.0)), _stored(reply.payload())


def test_records_refer_to_their_replys_items_and_come_back_byte_for_byte() -> None:
    v1, reply = _two_calls()
    v2, media_type = refer_to_reply(v1, reply_output_of(reply))
    assert media_type == TOKENS_REPLY_MEDIA_TYPE
    layout = read_layout(v2)  # canonical: the header check re-encodes it
    assert layout.reply_items == ((0, 1), (2, 3))  # the tool output between is no model's
    assert all("output_items" not in head for head in layout.records)
    assert b"cold" not in v2[: len(v2) - 64] and b"cold" in v1  # the text is the reply's alone
    assert len(v2) < len(v1)
    back = decode_any(v2, media_type, reply)
    assert back == decode_records(v1)
    assert encode_records(back) == v1  # the agent's bytes, rebuilt
    arrays = decode_payload(v2, media_type, check_canonical=False, reply=reply)
    assert arrays.resolved and arrays.records == read_layout(v1).records
    assert arrays.generation(1).tolist() == [6]


def test_items_not_in_the_reply_stay_in_the_record() -> None:
    v1, reply = _two_calls()
    # The first call's item differs in the reply (not the items it was recorded with): it keeps its own.
    reply["response"]["output"][0]["arguments"] = '{"city": "la"}'
    v2, media_type = refer_to_reply(v1, reply_output_of(reply))
    layout = read_layout(v2)
    assert media_type == TOKENS_REPLY_MEDIA_TYPE and layout.reply_items == (None, (2, 3))
    assert "output_items" in layout.records[0]
    assert encode_records(decode_any(v2, media_type, reply)) == v1
    # A reply with none of them: the records stay in version 1, unchanged.
    assert refer_to_reply(v1, []) == (v1, TOKENS_MEDIA_TYPE)
    # Equal as Python values is not enough: 1 and 1.0 are two JSON texts.
    floats = encode_records(
        [{"prompt_token_ids": [], "generation_token_ids": [], "generation_log_probs": [],
          "output_items": [{"n": 1}]}]
    )  # fmt: skip
    assert refer_to_reply(floats, [{"n": 1.0}]) == (floats, TOKENS_MEDIA_TYPE)


def test_records_read_without_their_reply_say_so() -> None:
    v1, reply = _two_calls()
    v2, media_type = refer_to_reply(v1, reply_output_of(reply))
    with pytest.raises(TokenCodecError, match="pass the reply"):
        decode_any(v2, media_type)
    arrays = decode_payload(v2, media_type, check_canonical=False)
    assert not arrays.resolved  # the arrays are whole; the output items are not there
    assert arrays.token_count == 3 and arrays.model_call_ids == ["call-1", "call-2"]
    # Another reply (shorter than the runs): refused, naming the record.
    with pytest.raises(TokenCodecError, match=r"record 1 refers to output items 2\.\.2"):
        decode_payload(v2, media_type, reply={"response": {"output": reply["response"]["output"][:2]}})
    # The media type and the form's version agree, or the payload is refused.
    with pytest.raises(TokenCodecError, match="form version 2"):
        decode_payload(v2, TOKENS_MEDIA_TYPE, reply=reply)
    with pytest.raises(TokenCodecError, match="form version 1"):
        decode_payload(v1, TOKENS_REPLY_MEDIA_TYPE, reply=reply)


def _with_header(v2: bytes, edit: Any) -> bytes:
    layout = read_layout(v2)
    header = orjson.loads(v2[16 : 16 + struct.unpack_from("<Q", v2, 8)[0]])
    edit(header)
    raw = canonical_bytes(header)
    start = layout.spans[0].offset
    return b"".join([v2[:8], struct.pack("<Q", len(raw)), raw, bytes(-len(raw) % 8), v2[start:]])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h.pop("reply_items"), "must hold exactly"),
        (lambda h: h.update(reply_items=[None, None]), "at least one record"),
        (lambda h: h.update(reply_items=[[0, 1]]), "one entry per record"),
        (lambda h: h.update(reply_items=[[2, 3], [0, 1]]), "not a run after the last"),
        (lambda h: h.update(reply_items=[[1, 1], None]), "not a run after the last"),
        (lambda h: h.update(reply_items=[[0, True], None]), "not a run after the last"),
        (lambda h: h["records"][0].update(output_items=[]), "holds its own"),
    ],
)
def test_a_damaged_reply_header_is_refused_with_its_reason(edit: Any, message: str) -> None:
    v1, reply = _two_calls()
    v2, _ = refer_to_reply(v1, reply_output_of(reply))
    with pytest.raises(TokenCodecError, match=message):
        decode_arrays(_with_header(v2, edit))


def test_the_audit_reads_records_back_with_their_trys_reply(tmp_path: Any) -> None:
    """Both payloads intact, the records paired with another try's reply: payload-intact says so."""
    from payloads import PayloadPlane, open_payload_store
    from projections.payload_audit import PAYLOAD_INTACT, PayloadAuditSummary, PayloadFacts, check_payloads

    v1, reply = _two_calls()
    v2, media_type = refer_to_reply(v1, reply_output_of(reply))
    plane = PayloadPlane(open_payload_store(tmp_path.as_uri()))
    other = {"response": {"output": reply["response"]["output"][:1]}}
    tokens, right, wrong = plane.put(
        [
            (v2, media_type),
            (canonical_bytes(reply), "application/json"),
            (canonical_bytes(other), "application/json"),
        ]
    )
    found: list[tuple[str, list[int], str]] = []
    for reply_claim, violations in ((right, 0), (wrong, 1)):
        facts = PayloadFacts()
        facts.see(3, [tokens, reply_claim])
        facts.replies[("k", 0)] = reply_claim
        facts.beside_reply[tokens.digest] = ("k", 0)
        found.clear()
        check_payloads(facts, plane, lambda *v: found.append(v), PayloadAuditSummary())
        assert len(found) == violations, found
    assert found[0][:2] == (PAYLOAD_INTACT, [3]) and "do not read back with their try's reply" in found[0][2]


def _refer_by_bytes(v1: bytes, reply_output: list[Any]) -> list[list[int] | None]:
    """Which run of `reply_output` each record refers to, found as `refer_to_reply` found it before
    `same_json`: by the canonical bytes of every item (the reference it must agree with)."""
    keys = [canonical_bytes(_stripped(item)) for item in reply_output]
    cursor, refs = 0, []
    for head in read_layout(v1).records:
        items, found = head.get("output_items"), None
        if isinstance(items, list) and items:
            wanted = [canonical_bytes(item) for item in items]
            for start in range(cursor, len(keys) - len(wanted) + 1):
                if keys[start : start + len(wanted)] == wanted:
                    found = [start, start + len(wanted)]
                    cursor = found[1]
                    break
        refs.append(found)
    return refs


def _stripped(item: Any) -> Any:
    from protocol.tokens import TOKEN_FIELDS

    return {k: v for k, v in item.items() if k not in TOKEN_FIELDS} if isinstance(item, dict) else item


_leaf = st.sampled_from(
    [0, 1, True, False, 1.0, -0.0, 0.0, None, "1", "a", [1], [True], {"k": 1}, {"k": 1.0}]
)
_item = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call"])},
    optional={"n": _leaf, "m": st.lists(_leaf, max_size=2), "generation_token_ids": st.just([5])},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_item, max_size=6), st.lists(st.lists(_item, max_size=2), min_size=1, max_size=3))
def test_records_refer_to_the_runs_their_canonical_bytes_match(
    reply_output: list[Any], record_items: list[list[Any]]
) -> None:
    """Records whose output items are the reply's, nearly (a bool for an int, 1.0 for 1, -0.0 for
    0.0), or not at all: each refers to exactly the run the canonical bytes match, and the payload
    comes back as the agent's bytes."""
    v1 = encode_records(
        [
            {"prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.5]}
            | ({"output_items": [_stripped(i) for i in items]} if items else {})
            for items in record_items
        ]
    )
    expected = _refer_by_bytes(v1, reply_output)
    v2, media_type = refer_to_reply(v1, reply_output)
    # `referred` gives the same bytes and the layout a read of them gives.
    again, again_type, layout = referred(v1, reply_output)
    assert (again, again_type) == (v2, media_type) and layout == read_layout(v2)
    if all(ref is None for ref in expected):
        assert (v2, media_type) == (v1, TOKENS_MEDIA_TYPE)
        return
    assert media_type == TOKENS_REPLY_MEDIA_TYPE
    assert [list(r) if r else None for r in read_layout(v2).reply_items] == expected
    assert encode_records(decode_any(v2, media_type, {"response": {"output": reply_output}})) == v1


@pytest.mark.parametrize(
    ("recorded", "in_reply"),
    [({"n": True}, {"n": 1}), ({"n": 0.0}, {"n": -0.0}), ({"n": [{"k": 1}]}, {"n": [{"k": 1.0}]}),
     ({"n": None}, {"n": "null"}), ({"n": 1}, {"n": 1, "extra": None})],
)  # fmt: skip
def test_items_equal_in_python_but_not_in_json_stay_in_the_record(recorded: Any, in_reply: Any) -> None:
    record: dict[str, Any] = {"prompt_token_ids": [], "generation_token_ids": [], "generation_log_probs": []}
    v1 = encode_records([record | {"output_items": [recorded]}])
    assert refer_to_reply(v1, [in_reply]) == (v1, TOKENS_MEDIA_TYPE)
    # The same item, its keys in another order and with token arrays the reply carries: referred to.
    carried = {"generation_token_ids": [7], **dict(reversed(list(recorded.items())))}
    assert refer_to_reply(v1, [carried])[1] == TOKENS_REPLY_MEDIA_TYPE
